"""Whole systems: the demo, the Swarm stack, a real multi-node Swarm, mixed releases."""
