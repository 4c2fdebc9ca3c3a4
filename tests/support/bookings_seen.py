"""Bookings as users see them: a few bookings of a week, and leases held under them."""

from __future__ import annotations

from datetime import datetime
from fractions import Fraction
from typing import Any
from zoneinfo import ZoneInfo

from allocator.bookings.booking import Booking, read_booking
from allocator.bookings.checks import ResolvedBooking
from allocator.bookings.in_effect import Held
from allocator.bookings.supply import Capacity
from tests.support.common import GTX1070

BERLIN = ZoneInfo("Europe/Berlin")


NINE = datetime(2026, 12, 8, 9, 0, tzinfo=BERLIN).timestamp()
"""Tuesday 2026-12-08, 09:00 in Berlin (08:00 UTC)."""


def booking(name: str, group: str, count: int, start: str, end: str, **more: Any) -> Booking:
    body = {"name": name, "group": group, "gpus": {"model": "1070", "count": count},
            "zone": "Europe/Berlin", "created_by": "admin",
            "window": {"kind": "once", "start": start, "end": end}, **more}
    found = read_booking(body)
    assert isinstance(found, Booking), found
    return found


CS101 = ResolvedBooking(booking("CS101 lab", "cs101", 2, "2026-12-08T08:30",
                                "2026-12-08T12:00"), GTX1070)


ML = ResolvedBooking(booking("ML lab", "ml", 2, "2026-12-08T10:00", "2026-12-08T11:30"),
                     GTX1070)


WEEKLY = ResolvedBooking(read_booking({
    "name": "Thesis", "users": ["carol"], "gpus": {"model": "1070", "count": 1},
    "zone": "Europe/Berlin", "created_by": "admin",
    "window": {"kind": "weekly", "weekdays": ["mon", "thu"], "start": "14:00",
               "duration_s": 3600, "until": "2027-02-01"}}), GTX1070)  # type: ignore[arg-type]


LATER = ResolvedBooking(booking("Exam", "cs101", 1, "2026-12-22T09:00", "2026-12-22T10:00"),
                        GTX1070)


FOUR = Capacity.of_gpus([("gpu-a", GTX1070)] * 4)


def held(lease_id: str, user: str, groups: tuple[str, ...]) -> Held:
    return Held(lease_id, user, groups, GTX1070, "gpu-a", Fraction(1), NINE - 3600)
