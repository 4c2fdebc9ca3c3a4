"""What a metrics scrape reads of the engine: the figures the engine publishes, as plain data.

The engine counts into :mod:`allocator.metrics.counters`, so the metrics stand below it and
never read its parts: at each scrape the engine walks its own state once and hands back
:class:`EngineFigures` (:meth:`allocator.engine.Engine.figures`, through
:class:`FiguresSource`), which :mod:`allocator.metrics.exporter` turns into Prometheus
families. The label values the figures are counted by are here too, as the engine fills them
and the exporter writes them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Protocol

from allocator.metrics.counters import Counters

GPU_STATES = ("free", "held", "unhealthy", "drained", "down", "conflict", "draining",
              "stuck_process", "outside_use")
"""Each present GPU is in exactly one: conflict (a running container's grant contradicts the
ledger on it) first, then stuck_process (an ended lease's process still on it past
release_verify_s), outside_use (a process no lease on it accounts for), held (any claim),
draining (a lease on it ended, its processes not yet seen gone), unhealthy, drained (the GPU
or its node), down (its node is silent), else free."""

SHARES = ("guaranteed", "borrowed")
"""How a held lease stands in fair share: within every guarantee of its owner, or beyond one
(borrowed: reclaim may take it for a request within its guarantee)."""


@dataclass
class EngineFigures:
    """The engine's state as one scrape reports it, read in one go."""

    gpus: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(model, state of :data:`GPU_STATES`) -> GPUs"""
    slots: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(model, free|held) -> share slots, for models with more than one slot"""
    leases: Counter[str] = field(default_factory=Counter)
    """lease state -> leases not yet final"""
    group_held: dict[str, dict[str, Fraction]] = field(default_factory=dict)
    """group with a guarantee -> share (:data:`SHARES`) -> GPUs its members' leases hold"""
    queue_length: int = 0
    queue_oldest_wait_s: float = 0.0
    nodes: dict[str, tuple[bool, bool, float | None]] = field(default_factory=dict)
    """host -> (up, drained, last heartbeat)"""
    booking_short: dict[str, int] = field(default_factory=dict)
    """booking -> GPUs missing in its next short occurrence (0 when whole)"""
    engine_counters: Counters = field(default_factory=Counters)
    """A copy of the engine's counters."""


class FiguresSource(Protocol):
    """What publishes :class:`EngineFigures`: the engine."""

    def figures(self, now: float) -> EngineFigures:
        """The figures as of ``now`` (call on the allocator's event loop, between two
        batches: the engine's state is only consistent there)."""
        ...
