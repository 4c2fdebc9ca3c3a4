"""Telling the admin when a booking becomes short of GPUs (a node drained or lost, a GPU
gone) and when it is whole again: one ``booking_short`` or ``booking_whole`` event per change
of state, and each booking's GPUs missing for the metrics.

What is short is the pure core's answer (:func:`allocator.bookings.shortfall.shortfalls`) over
the next :data:`SHORT_HORIZON_S`; this part decides when to ask it. It asks only when
something it depends on changed since it last asked (the bookings or the GPUs:
``BookingBook.version``; a node down or up, a drain or undrain:
``NodeReports.availability_version``), at most once per tick, and then again at the end of
the first short occurrence or after :data:`RECHECK_S`, as its horizon moves on. A heartbeat
that changes nothing costs it nothing, and so does a cluster without bookings. An admin's
booking added or removed is answered at once (:meth:`BookingShortWatch.check`).

While a start fence holds (:mod:`allocator.engine.fence`), nodes not yet reported count as
they were, and a restart would call bookings short that are not: it waits for the fence.

What the admin was last told of each booking is read back from the ledger at load
(``LoadedState.booking_alerts``), so that a restart, a takeover or a reload after a failed
commit tells nothing twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from allocator.bookings.shortfall import shortfalls
from allocator.bookings.windows import occurrences
from allocator.engine.bookings import BookingBook
from allocator.engine.fence import StartFence
from allocator.engine.nodes import NodeReports
from allocator.ledger.changes import Changes
from allocator.ledger.loaded import BOOKING_ALERT_KINDS

SHORT_HORIZON_S: Final = 7 * 24 * 3600
"""How far ahead a booking's occurrences are looked at for being short: a weekly booking's
every occurrence."""

RECHECK_S: Final = 3600
"""How often, with bookings held and nothing changed, the shortfalls are asked again: the
horizon moves on (a dated booking's first occurrence comes into it)."""

SHORT, WHOLE = BOOKING_ALERT_KINDS


@dataclass(frozen=True)
class BookingState:
    """What a booking can get in its first short occurrence within the horizon."""

    missing: int
    """GPUs it lacks there (0: whole)."""
    gets: int = 0
    count: int = 0
    start: int = 0
    end: int = 0
    text: str = ""
    """The line for the admin (``Shortfall.text``)."""


WHOLE_STATE: Final = BookingState(0)


class BookingShortWatch:
    """Each booking's state, short or whole, and the events that report its changes.

    Memory only, but for what the admin was last told (the ledger's events). Invariant:
    ``told`` holds, for each booking, the kind of the newest event written of it (missing:
    none, i.e. whole).
    """

    def __init__(self, bookings: BookingBook, nodes: NodeReports,
                 start_fence: StartFence) -> None:
        self.bookings = bookings
        self.nodes = nodes
        self.start_fence = start_fence
        self.states: dict[str, BookingState] = {}
        """Booking -> its state as last computed (every booking held then)."""
        self.told: dict[str, str] = {}
        """Booking -> the kind of the last event written of it."""
        self._seen: tuple[int, int] | None = None
        """The versions of the bookings and of the nodes' availability last computed at."""
        self.recheck_at = float("inf")

    def load(self, told: Mapping[str, str]) -> None:
        """A rebuild from the ledger: what was told is the ledger's; the rest is computed
        again at the next tick."""
        self.told = dict(told)
        self.states = {}
        self._seen = None
        self.recheck_at = float("inf")

    def missing(self) -> dict[str, int]:
        """Booking -> GPUs missing in its first short occurrence (0 when whole), as last
        computed: the metrics' gauge."""
        return {name: state.missing for name, state in self.states.items()}

    def tick(self, now: float, changes: Changes) -> None:
        """Compute again when something changed since the last time, or the recheck is due;
        else nothing."""
        seen = (self.bookings.version, self.nodes.availability_version)
        if seen == self._seen and now < self.recheck_at:
            return
        self.check(now, changes)

    def check(self, now: float, changes: Changes) -> None:
        """Compute each booking's state now and write an event for each that changed."""
        if self.start_fence.holds(now):
            return
        self._seen = (self.bookings.version, self.nodes.availability_version)
        held = self.bookings.all()
        if not held:
            self.states, self.told = {}, {}
            self.recheck_at = float("inf")
            return
        t = int(now)
        until = t + SHORT_HORIZON_S
        resolved = self.bookings.resolved()
        by_name = {booking.name: booking for booking in resolved}
        states: dict[str, BookingState] = {}
        for found in shortfalls(resolved, self.bookings.capacity(now), t, until):
            if found.booking not in states:  # time order: the first is the next
                made = by_name[found.booking]
                count = made.booking.gpus.count
                states[found.booking] = BookingState(
                    found.short_by, count - found.short_by, count, found.occurrence.start,
                    found.occurrence.end, found.text(made))
        for booking in held:
            if booking.name in by_name or booking.name in states:
                continue
            # Its model is not known now (its last GPU gone): it gets nothing.
            coming = occurrences(booking, t, until)
            if coming:
                count = booking.gpus.count
                states[booking.name] = BookingState(
                    count, 0, count, coming[0].start, coming[0].end,
                    f"Booking {booking.name!r}: no GPU of {booking.gpus.model!r} is known "
                    "now; it is kept and gets its GPUs when they are back.")
        self.states = {booking.name: states.get(booking.name, WHOLE_STATE) for booking in held}
        self.told = {name: kind for name, kind in self.told.items() if name in self.states}
        for booking in held:
            self._tell(booking.name, booking.gpus.host, now, changes)
        # The first short occurrence's end: the next one is then the first.
        self.recheck_at = min([t + RECHECK_S, *(state.end for state in states.values())])

    def _tell(self, name: str, host: str | None, now: float, changes: Changes) -> None:
        """The event of the booking's state, if it is not what was told last."""
        state = self.states[name]
        kind = SHORT if state.missing else WHOLE
        if self.told.get(name, WHOLE) == kind:
            return
        self.told[name] = kind
        if state.missing:
            changes.event(now, SHORT, host=host, booking=name, start=state.start,
                          end=state.end, gets=state.gets, count=state.count, text=state.text)
        else:
            changes.event(now, WHOLE, host=host, booking=name,
                          text=f"Booking {name!r} gets all its GPUs again.")
