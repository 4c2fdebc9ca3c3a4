"""What every part of the engine shares: who sent a message, the engine's limits, its log, and
the rule for counting anomalies.

No part's state lives here: each part owns its own (see :mod:`allocator.engine`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from allocator.metrics.counters import Count, Counters
from allocator.wire.protocol import LeaseState

log = logging.getLogger("allocator.engine")

CLOCK_SKEW_WARN_S = 30.0
"""A heartbeat stamped further than this from the allocator's clock is logged (once a host)."""

RECENT_FINAL_LEASES = 10_000
"""Finished leases kept in memory so a repeated release or status is answered without I/O."""

TIMED_STATES = frozenset({LeaseState.QUEUED, LeaseState.GRANTED, LeaseState.RELEASING})
"""The states with a timer: a queued request's wait, a grant's bind deadline, a release's
wait for a silent node."""


@dataclass(frozen=True)
class Sender:
    """Who sent a message, as the broker vouches for it."""

    user_id: str | None
    """The AMQP ``user_id`` property (RabbitMQ refuses a publish whose user_id is not the
    connection's user), or None when the publisher did not set it."""
    via_nodes_exchange: bool
    """True when it came through the nodes exchange (agents), False for the RPC exchange."""


def count_anomaly(counters: Counters, kind: Count) -> bool:
    """Count one more ``kind``; True for the first and every 1000th, the ones worth a log line
    and a ledger event (one per heartbeat would grow the ledger without end)."""
    counters.add(kind)
    return counters[kind.value] % 1000 == 1
