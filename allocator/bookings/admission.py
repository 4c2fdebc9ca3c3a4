"""Admission: whether a new booking fits next to the bookings already made, in every instant
of its windows from now to its end (at most a horizon ahead), and if not, what collides and
what would fit.

The bookings of one model fit at an instant by :mod:`allocator.bookings.supply`'s rule (every
host's pinned bookings within the host, all of them within the model). Other models never
collide with it. The check sweeps over the boundaries of the occurrences (an occurrence of a
booking that overlaps none of the new one's is never looked at), not over minutes: between two
boundaries nothing changes.

A refusal says, for each colliding occurrence of the new booking (the first
:data:`MAX_COLLISIONS` of them, and how many there are): when it is, the stretch in it where
the fewest GPUs are left, by how many GPUs it is short there, and which bookings hold GPUs of
its constraint then. What would fit, all of it cheap by-products of the same sweep:

* ``largest_count``: the most GPUs the same booking could have in every occurrence;
* ``fits_without_host``: for a booking pinned to a host, whether it would fit on any host;
* ``fits_until``: for a weekly booking, the last day it could end on and fit (the day of the
  last occurrence before the first collision).

Pure: no I/O, no clock (``now`` is passed in).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from typing import Final

from allocator.bookings.booking import BookingErrorCode, BookingProblem, OnceWindow
from allocator.bookings.checks import DEFAULT_HORIZON_S, ResolvedBooking
from allocator.bookings.supply import Capacity
from allocator.bookings.windows import Occurrence, describe

MAX_COLLISIONS: Final = 10
"""The most colliding occurrences a refusal lists (it counts them all)."""


@dataclass(frozen=True)
class Collision:
    """One occurrence of the new booking that does not fit."""

    occurrence: Occurrence
    worst_start: int
    """The stretch of the occurrence where it is shortest of GPUs, from..."""
    worst_end: int
    """... to (epoch seconds)."""
    short_by: int
    """How many of its GPUs do not fit there."""
    others: tuple[str, ...]
    """The bookings holding GPUs of the constraint it breaks there, by name, sorted."""


@dataclass(frozen=True)
class Admission:
    """The answer: fits, or what collides and what would fit."""

    fits: bool
    occurrences: int
    """Occurrences of the new booking checked (from now to its end or the horizon)."""
    collisions: tuple[Collision, ...]
    """The first :data:`MAX_COLLISIONS` colliding occurrences, in time order."""
    colliding: int
    """How many occurrences collide."""
    largest_count: int
    """The most GPUs the booking could have and fit every occurrence (0: none)."""
    fits_without_host: bool | None
    """For a booking pinned to a host: whether it would fit on any host of its model."""
    fits_until: date | None
    """For a weekly booking that collides: the last day it could end on and fit; None when
    its first occurrence already collides."""

    def problem(self, booking: ResolvedBooking) -> BookingProblem | None:
        """The refusal as one problem for people and programs; None when it fits."""
        if self.fits:
            return None
        first = self.collisions[0]
        gpus = booking.booking.gpus
        where = f" on {gpus.host}" if gpus.host is not None else ""
        with_ = ", ".join(first.others) or "no other booking (the GPUs are gone)"
        text = [
            f"Booking {booking.name!r} does not fit: {self.colliding} of its {self.occurrences} "
            f"occurrence(s) collide. The first, {describe(first.occurrence, booking.booking)}, "
            f"is {first.short_by} GPU(s) of {booking.model}{where} short, next to {with_}."
        ]
        if self.largest_count > 0:
            text.append(f"{self.largest_count} GPU(s) would fit in every occurrence.")
        if self.fits_without_host:
            text.append(f"It would fit without naming the host {gpus.host}.")
        if self.fits_until is not None:
            text.append(f"Ending it on {self.fits_until} would fit.")
        return BookingProblem(BookingErrorCode.COLLIDES, " ".join(text), {
            "occurrences": self.occurrences,
            "colliding": self.colliding,
            "collisions": [{
                "start": c.occurrence.start, "end": c.occurrence.end,
                "local_start": c.occurrence.local_start.isoformat(),
                "worst_start": c.worst_start, "worst_end": c.worst_end,
                "short_by": c.short_by, "others": list(c.others)}
                for c in self.collisions],
            "largest_count": self.largest_count,
            "fits_without_host": self.fits_without_host,
            "fits_until": self.fits_until.isoformat() if self.fits_until else None,
        })


@dataclass
class _Worst:
    short: int
    start: int
    end: int
    others: tuple[str, ...]


def admit(new: ResolvedBooking, existing: Sequence[ResolvedBooking], capacity: Capacity,
          now: int, *, horizon_s: int = DEFAULT_HORIZON_S) -> Admission:
    """Whether ``new`` fits next to ``existing`` (not including a booking it replaces) in
    every instant of its windows from ``now`` to ``now + horizon_s``."""
    mine = new.occurrences(now, now + horizon_s)
    host = new.booking.gpus.host
    model = new.model
    if not mine:
        return Admission(True, 0, (), 0, new.booking.gpus.count, None, None)
    # A window already begun is checked from now on: what is over cannot collide.
    span_start, span_end = max(mine[0].start, now), mine[-1].end
    # Boundaries: +count at a start, -count at an end, of every same-model occurrence that
    # overlaps one of the new booking's.
    events: list[tuple[int, int, int]] = []  # (instant, +1 start / -1 end, index in others)
    others = [b for b in existing if b.model == model]
    for index, other in enumerate(others):
        for occurrence in other.occurrences(span_start, span_end):
            if _overlaps_any(occurrence, mine):
                events.append((occurrence.start, 1, index))
                events.append((occurrence.end, -1, index))
    events.sort(key=lambda e: (e[0], e[1]))  # ends before starts at one instant
    total_cap = capacity.on(model)
    host_cap = capacity.on(model, host) if host is not None else 0
    count = new.booking.gpus.count

    active: dict[int, int] = {}  # index in others -> occurrences of it running (0 or 1)
    total_load = host_load = 0
    worst_overall = 0  # the most any stretch is short, counting the new booking
    total_only_worst = 0  # the same without its host's constraint
    collisions: list[Collision] = []
    colliding = 0
    first_collision: Occurrence | None = None
    event_index = 0
    for occurrence in mine:
        # Apply every boundary up to the occurrence's start, then walk the stretches in it.
        worst: _Worst | None = None
        cursor = max(occurrence.start, now)
        while True:
            while event_index < len(events) and events[event_index][0] <= cursor:
                _, sign, index = events[event_index]
                other = others[index]
                active[index] = active.get(index, 0) + sign
                total_load += sign * other.booking.gpus.count
                if host is not None and other.booking.gpus.host == host:
                    host_load += sign * other.booking.gpus.count
                event_index += 1
            stretch_end = min(occurrence.end,
                              events[event_index][0] if event_index < len(events)
                              else occurrence.end)
            total_short = total_load + count - total_cap
            short = total_short
            if host is not None:
                short = max(short, host_load + count - host_cap)
            total_only_worst = max(total_only_worst, total_short)
            worst_overall = max(worst_overall, short)
            if short > 0 and (worst is None or short > worst.short):
                host_short = host is not None and host_load + count - host_cap == short
                names = sorted({others[i].name for i, n in active.items() if n > 0 and (
                    not host_short or others[i].booking.gpus.host == host)})
                worst = _Worst(short, cursor, stretch_end, tuple(names))
            if stretch_end >= occurrence.end:
                break
            cursor = stretch_end
        if worst is not None:
            colliding += 1
            if first_collision is None:
                first_collision = occurrence
            if len(collisions) < MAX_COLLISIONS:
                collisions.append(Collision(occurrence, worst.start, worst.end,
                                            min(worst.short, count), worst.others))
    fits = colliding == 0
    return Admission(
        fits=fits,
        occurrences=len(mine),
        collisions=tuple(collisions),
        colliding=colliding,
        largest_count=max(0, count - worst_overall),
        fits_without_host=None if host is None or fits else total_only_worst <= 0,
        fits_until=None if fits else _fits_until(new, mine, first_collision),
    )


def _overlaps_any(occurrence: Occurrence, sorted_mine: Sequence[Occurrence]) -> bool:
    """Whether it overlaps one of the (sorted, disjoint) occurrences: a bisection."""
    lo, hi = 0, len(sorted_mine)
    while lo < hi:  # the first of mine that ends after the occurrence starts
        middle = (lo + hi) // 2
        if sorted_mine[middle].end <= occurrence.start:
            lo = middle + 1
        else:
            hi = middle
    return lo < len(sorted_mine) and sorted_mine[lo].start < occurrence.end


def _fits_until(new: ResolvedBooking, mine: Sequence[Occurrence],
                first_collision: Occurrence | None) -> date | None:
    if isinstance(new.booking.window, OnceWindow) or first_collision is None:
        return None
    before = [o for o in mine if o.start < first_collision.start]
    return before[-1].local_start.date() if before else None
