"""Shortfall: which occurrences of the bookings made are short of GPUs, and by how many, once
GPUs went away after they were admitted (a node drained or lost, a GPU gone).

A short booking is kept, never dropped: its members get what is left, served in the order the
bookings were admitted (:func:`allocator.bookings.supply.served`), and the admin is told,
from these findings, which occurrences are short and by how much. When the GPUs come back the
same question answers that nothing is short.

Pure: no I/O, no clock (the interval is passed in).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from allocator.bookings.checks import ResolvedBooking
from allocator.bookings.supply import Capacity, served
from allocator.bookings.windows import Occurrence, describe


@dataclass(frozen=True)
class Shortfall:
    """One occurrence of one booking that cannot be given all its GPUs."""

    booking: str
    occurrence: Occurrence
    short_by: int
    """The most GPUs it lacks at any instant of the occurrence."""
    worst_start: int
    """Where it lacks the most, from ...."""
    worst_end: int
    """... to (epoch seconds)."""

    def text(self, booking: ResolvedBooking) -> str:
        """One line for the admin."""
        return (f"Booking {self.booking!r} is {self.short_by} of its "
                f"{booking.booking.gpus.count} GPU(s) of {booking.model} short on "
                f"{describe(self.occurrence, booking.booking)}.")


def shortfalls(bookings: Sequence[ResolvedBooking], capacity: Capacity, since: int,
               until: int) -> list[Shortfall]:
    """The short occurrences overlapping ``[since, until)`` of ``bookings`` (in the order they
    were admitted) against ``capacity``, in time order."""
    events: list[tuple[int, int, int, Occurrence]] = []  # (instant, sign, booking, occurrence)
    for index, booking in enumerate(bookings):
        for occurrence in booking.occurrences(since, until):
            events.append((occurrence.start, 1, index, occurrence))
            events.append((occurrence.end, -1, index, occurrence))
    events.sort(key=lambda e: (e[0], e[1], e[2]))
    running: dict[int, Occurrence] = {}  # booking -> its running occurrence
    worst: dict[tuple[int, int], Shortfall] = {}
    position = 0
    while position < len(events):
        instant = events[position][0]
        while position < len(events) and events[position][0] == instant:
            _, sign, index, occurrence = events[position]
            if sign > 0:
                running[index] = occurrence
            else:
                running.pop(index, None)
            position += 1
        if not running or position >= len(events):
            continue
        stretch_end = events[position][0]
        order = sorted(running)
        given = served([bookings[i].draw for i in order], capacity)
        for index, got in zip(order, given, strict=True):
            short = bookings[index].booking.gpus.count - got
            occurrence = running[index]
            key = (index, occurrence.start)
            if short > 0 and (key not in worst or short > worst[key].short_by):
                worst[key] = Shortfall(bookings[index].name, occurrence, short,
                                       max(instant, since), min(stretch_end, until))
    return sorted(worst.values(), key=lambda s: (s.occurrence.start, s.booking))
