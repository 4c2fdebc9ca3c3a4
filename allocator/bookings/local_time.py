"""What a local wall-clock time in a named zone means as an instant, on every day of the year
the clocks change included.

The rule, one for starts and ends alike: **a local time is the first instant at which the
zone's clock reads that time or later.** So

* a local time that exists once is that instant (10:00 stays 10:00 local in summer and in
  winter: a lab from 10:00 to 12:00 is 10:00-12:00 on both sides of a change);
* a local time the clocks skip (02:30 on the night they jump from 02:00 to 03:00) is the
  instant of the jump, which the clock shows as 03:00: a window from 02:30 to 04:00 runs
  03:00-04:00 that night, and one lying wholly in the skipped hour is empty that night;
* a local time the clocks show twice (02:30 on the night they go back from 03:00 to 02:00) is
  the first time they show it, in summer time.

This is iCalendar's reading (RFC 5545, 3.3.5) for repeated times; for skipped ones it keeps
instants in the order of their local times (a later local time is never an earlier instant),
which iCalendar's "shift by the gap" does not, so a window's end never comes before its start.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from datetime import UTC, datetime
from zoneinfo import ZoneInfo


def local_at(instant: int, zone: ZoneInfo) -> datetime:
    """The zone's wall-clock reading (naive) at an instant in epoch seconds."""
    return datetime.fromtimestamp(instant, UTC).astimezone(zone).replace(tzinfo=None)


def instant_of(local: datetime, zone: ZoneInfo) -> int:
    """The first instant (epoch seconds) at which the zone's clock reads ``local`` (naive) or
    later: see the module's rule."""
    # fold=0 is the earlier reading of a repeated time, which is the first pass; for a skipped
    # time it reads the time with the offset from before the jump, an instant after the jump.
    after = int(local.replace(tzinfo=zone, fold=0).timestamp())
    if local_at(after, zone) == local:
        return after
    # Skipped: fold=1 reads it with the offset from after the jump, an instant before the
    # jump. The jump is the first instant in between whose reading is at least ``local``;
    # readings rise with instants on each side of it, so halving finds it (about 12 steps).
    before = int(local.replace(tzinfo=zone, fold=1).timestamp())
    while after - before > 1:
        middle = (before + after) // 2
        if local_at(middle, zone) >= local:
            after = middle
        else:
            before = middle
    return after
