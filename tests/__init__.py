"""swarm-gpu's tests, in rooms by what they test; helpers in :mod:`tests.support`."""
