"""What the GPU page shows of bookings, as plain data for its template: the viewer's own
bookings, and for admins the week's calendar of every booking (days by hours, rendered on the
server: the page runs no script).

Everything comes from the inventory reply's ``bookings``
(:class:`~allocator.wire.protocol.BookingsView`) through :mod:`allocator.bookings.outlook`; this
module only lays it out. The calendar is in one zone, the one most bookings of the week name
(a site's bookings are usually all in its own), and says which; a booking of another zone is
shown at its instants in that zone. Pure: no I/O, the clock passed in.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from datetime import UTC, date, datetime, timedelta
from typing import Any, Final
from zoneinfo import ZoneInfo

from allocator.bookings.outlook import UserOutlook, gpus_text, window_text
from allocator.wire.model_names import display_name
from allocator.wire.protocol import BookingSchedule, BookingsView

DAYS: Final = 7
"""The calendar's columns: today and the six days after, in its zone."""


def my_bookings(outlook: UserOutlook, now: float) -> list[dict[str, Any]]:
    """The viewer's bookings: name, GPUs, next window in the booking's zone, in effect now."""
    cards = []
    for schedule in outlook.mine:
        window = next((w for w in schedule.windows if w.end > now), None)
        cards.append({
            "name": schedule.name,
            "gpus": gpus_text(schedule, display_name(schedule.model)),
            "members": f"group {schedule.group}" if schedule.group else "users named in it",
            "next": f"{window_text(window)} ({schedule.zone})" if window else "—",
            "in_effect": schedule.in_effect,
        })
    return cards


def _zone_of(bookings: Sequence[BookingSchedule]) -> str:
    counts = Counter(b.zone for b in bookings)
    return max(counts, key=lambda zone: counts[zone]) if counts else "UTC"


def _instant(day: date, hour: int, zone: ZoneInfo) -> float:
    return datetime(day.year, day.month, day.day, hour, tzinfo=zone).timestamp()


def week_calendar(view: BookingsView | None, now: float) -> dict[str, Any] | None:
    """Days by hours of the coming week: in each hour, the bookings with a window in it
    (name and GPUs booked). Rows run from the first hour any booking uses to the last; None
    without bookings this week."""
    if view is None or not any(b.windows for b in view.bookings):
        return None
    zone_name = _zone_of(view.bookings)
    zone = ZoneInfo(zone_name)
    first = datetime.fromtimestamp(now, UTC).astimezone(zone).date()
    days = [first + timedelta(days=n) for n in range(DAYS)]
    cells: dict[tuple[int, int], list[str]] = {}
    for column, day in enumerate(days):
        for hour in range(24):
            since = _instant(day, hour, zone)
            until = _instant(day + timedelta(days=1), 0, zone) if hour == 23 \
                else _instant(day, hour + 1, zone)
            names = [f"{b.name} ({b.count})" for b in view.bookings
                     if any(w.start < until and since < w.end for w in b.windows)]
            if names:
                cells[(hour, column)] = names
    if not cells:
        return None
    hours = range(min(h for h, _ in cells), max(h for h, _ in cells) + 1)
    return {
        "zone": zone_name,
        "days": [f"{day:%a %d %b}" for day in days],
        "rows": [{"hour": f"{hour:02d}:00",
                  "cells": [cells.get((hour, column), []) for column in range(DAYS)]}
                 for hour in hours],
        "bookings": [{"name": b.name, "gpus": gpus_text(b, display_name(b.model)),
                      "members": f"group {b.group}" if b.group else ", ".join(b.users or ()),
                      "zone": b.zone, "in_effect": b.in_effect}
                     for b in view.bookings],
    }
