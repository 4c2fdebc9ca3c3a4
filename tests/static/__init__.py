"""Checks of the code and the docs themselves: types, lint, the design map, the protocol's
examples."""
