"""The GPU models of the engine's property tests: a small and a big one, and their memory."""

from __future__ import annotations

SMALL, BIG = "NVIDIA GeForce GTX 1070", "NVIDIA A100-SXM4-80GB"


MEMORY = {SMALL: 8192, BIG: 81920}
