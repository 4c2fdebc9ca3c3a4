"""Placement: the pure policy of where a demand fits, and what it reads."""
