"""Bookings: the pure policy, the engine's windows and alerts, the RPC."""
