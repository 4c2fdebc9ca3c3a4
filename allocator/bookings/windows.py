"""A booking's occurrences: the stretches of time, in UTC epoch seconds, its window stands for.

A one-off window is one occurrence. A weekly window has one on each chosen weekday from
``starts_on`` to ``until`` (local dates in the booking's zone): it starts at the local start
time and ends at the local time ``duration_s`` later on the wall clock, both read by
:mod:`allocator.bookings.local_time`'s rule. So a 10:00-12:00 lab is 10:00-12:00 local every
week, whatever the clocks did in between; only a window that spans the change itself is an
hour shorter (spring) or longer (autumn) than its duration. An occurrence that the rule makes
empty (a window lying wholly in a skipped hour) is left out.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Final

from allocator.bookings.booking import Booking, OnceWindow
from allocator.bookings.local_time import instant_of, local_at


@dataclass(frozen=True, order=True)
class Occurrence:
    """One stretch of a booking's window: from ``start`` (included) to ``end`` (excluded),
    epoch seconds."""

    start: int
    end: int
    local_start: datetime
    """The wall-clock start in the booking's zone, for messages."""

    def overlaps(self, since: int, until: int) -> bool:
        """Whether it shares an instant with ``[since, until)``."""
        return self.start < until and since < self.end


EARLIEST: Final = 0
"""The earliest instant occurrences are looked for at (1970)."""
LATEST: Final = 100 * 365 * 86400 * 2
"""The latest (about 2170): beyond it ``datetime`` could not read an interval's bounds, and no
booking reaches it (they end within a horizon of now)."""


def occurrences(booking: Booking, since: int, until: int) -> list[Occurrence]:
    """The occurrences of the booking's window that overlap ``[since, until)``, in order."""
    since, until = max(since, EARLIEST), min(until, LATEST)
    if until <= since:
        return []
    zone = booking.tz
    window = booking.window
    if isinstance(window, OnceWindow):
        once = Occurrence(instant_of(window.start, zone), instant_of(window.end, zone),
                          window.start)
        return [once] if once.start < once.end and once.overlaps(since, until) else []
    duration = timedelta(seconds=window.duration_s)
    # An occurrence that started up to one duration before ``since`` still overlaps it; a
    # day more on each side covers any zone's offset.
    first = local_at(since, zone).date() - timedelta(days=duration.days + 2)
    last = local_at(until, zone).date() + timedelta(days=1)
    found: list[Occurrence] = []
    for day in window.days(first, last):
        local_start = datetime.combine(day, window.start)
        occurrence = Occurrence(instant_of(local_start, zone),
                                instant_of(local_start + duration, zone), local_start)
        if occurrence.start < occurrence.end and occurrence.overlaps(since, until):
            found.append(occurrence)
    return found


def describe(occurrence: Occurrence, booking: Booking) -> str:
    """``Tue 2026-12-08 10:00 (Europe/Berlin)``: when an occurrence starts, as people read it."""
    return f"{occurrence.local_start:%a %Y-%m-%d %H:%M} ({booking.zone})"
