"""What the allocator reads from the ledger at start (:class:`LoadedState`), and a booking's
row; pure, no SQLite."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from allocator.ledger.lease import LeaseRecord
from allocator.placement.cluster import GPU, Node

BOOKING_ALERT_KINDS = ("booking_short", "booking_whole")
"""The events that tell the admin a booking became short of GPUs, or whole again
(:mod:`allocator.engine.booking_alerts`); the newest of each booking is loaded at start."""


@dataclass
class LoadedState:
    """What the allocator reads at start: every node and GPU, and the leases not yet final."""

    nodes: list[Node]
    gpus: list[GPU]
    leases: list[LeaseRecord]
    agent_users: dict[str, str]
    finished: list[LeaseRecord] = field(default_factory=list)
    """The newest final leases (oldest first), so that a container of a lease finished before
    a restart is still known as a zombie, not adopted as a lease the ledger forgot."""
    bookings: list[BookingRow] = field(default_factory=list)
    """The bookings not removed, in the order they were admitted."""
    booking_alerts: dict[str, str] = field(default_factory=dict)
    """Booking name -> the kind of the newest of its events among
    :data:`BOOKING_ALERT_KINDS` (bookings not removed that have one): what the admin was
    last told of it, so that a restart does not tell it again."""


@dataclass(frozen=True)
class BookingRow:
    """A booking as the ledger keeps it: its JSON as admitted (read back by
    :func:`allocator.bookings.booking.read_booking`, outside the ledger), who made it, when,
    and, once removed, who removed it and when."""

    name: str
    booking: dict[str, Any]
    created_at: float
    created_by: str
    removed_at: float | None = None
    removed_by: str | None = None
