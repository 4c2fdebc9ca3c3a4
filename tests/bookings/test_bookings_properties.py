"""Properties of the bookings' policy core over generated bookings, clusters and clocks:

* occurrences are what a naive minute-by-minute reading of the zone's clock says (around the
  changes of the clocks in zones that move by an hour and by half an hour);
* a weekly window keeps its local hours across the changes of the clocks;
* admitting bookings one by one never books more GPUs than exist in any minute, and refuses
  exactly the bookings that would;
* the guarantees at any instant never add up to more than exists, also after GPUs went away,
  and what they lack is what the shortfall reports.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, date, datetime, time, timedelta
from functools import lru_cache
from typing import Any
from zoneinfo import ZoneInfo

from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.bookings.admission import admit
from allocator.bookings.booking import WEEKDAYS, Booking, read_booking
from allocator.bookings.checks import ClusterFacts, ResolvedBooking, check_booking
from allocator.bookings.guarantees import GuaranteeState, guarantees_at
from allocator.bookings.local_time import instant_of, local_at
from allocator.bookings.shortfall import shortfalls
from allocator.bookings.supply import Capacity
from allocator.bookings.windows import occurrences
from allocator.wire.model_names import ModelNames

# Days the clocks change (and one on which they do not), by zone.
CHANGES = {
    "Europe/Berlin": [date(2026, 3, 29), date(2026, 10, 25)],
    "America/New_York": [date(2026, 3, 8), date(2026, 11, 1)],
    "Australia/Lord_Howe": [date(2026, 4, 5), date(2026, 10, 4)],  # by half an hour
    "UTC": [date(2026, 6, 1)],
}
MINUTE = 60


def weekly_body(zone: str, weekdays: Sequence[str], start: time, duration_min: int,
                starts_on: date | None, until: date, **extra: Any) -> dict[str, Any]:
    return {
        "name": extra.pop("name", "lab"), "group": "g",
        "gpus": extra.pop("gpus", {"model": "A", "count": 1}), "zone": zone,
        "window": {"kind": "weekly", "weekdays": list(weekdays),
                   "start": start.strftime("%H:%M"), "duration_s": duration_min * MINUTE,
                   "starts_on": starts_on.isoformat() if starts_on else None,
                   "until": until.isoformat()},
        "created_by": "admin", **extra,
    }


def made(data: dict[str, Any]) -> Booking | None:
    """The booking, or None for one its own rules refuse (a window that overlaps itself,
    none of its weekdays in its dates): generated bodies may be either."""
    booking = read_booking(data)
    return booking if isinstance(booking, Booking) else None


@lru_cache(maxsize=16)
def readings(zone: str, lo: int, hi: int) -> tuple[datetime, ...]:
    """What the zone's clock reads at each minute from ``lo`` to ``hi``, one by one."""
    tz = ZoneInfo(zone)
    return tuple(datetime.fromtimestamp(m, UTC).astimezone(tz).replace(tzinfo=None)
                 for m in range(lo, hi, MINUTE))


def reference_minutes(booking: Booking, lo: int, hi: int) -> set[int]:
    """The minutes in ``[lo, hi)`` the booking's window holds, the naive way: a local time is
    the first minute at which the clock reads it or later, found by reading every minute."""
    window = booking.window
    assert window.kind == "weekly" and window.until is not None
    margin = 3 * 86400
    start_at = lo - margin
    clock = readings(booking.zone, start_at, hi + margin)

    def first_reaching(local: datetime) -> int:
        for i, reading in enumerate(clock):
            if reading >= local:
                return start_at + i * MINUTE
        return hi + margin

    held: set[int] = set()
    day = clock[0].date()
    while day <= clock[-1].date():
        in_dates = (window.starts_on is None or day >= window.starts_on) and day <= window.until
        if in_dates and WEEKDAYS[day.weekday()] in window.weekdays:
            begin = datetime.combine(day, window.start)
            end = begin + timedelta(seconds=window.duration_s)
            held.update(m for m in range(first_reaching(begin), first_reaching(end), MINUTE)
                        if lo <= m < hi)
        day += timedelta(days=1)
    return held


def minutes_of(booking: Booking, lo: int, hi: int) -> set[int]:
    return {m for o in occurrences(booking, lo, hi)
            for m in range(max(o.start, lo), min(o.end, hi), MINUTE)}


@st.composite
def weekly_near_a_change(draw: st.DrawFn) -> tuple[Booking | None, int, int]:
    zone = draw(st.sampled_from(sorted(CHANGES)))
    change = draw(st.sampled_from(CHANGES[zone]))
    weekdays = draw(st.lists(st.sampled_from(WEEKDAYS), min_size=1, max_size=7, unique=True))
    start = time(draw(st.integers(0, 23)), draw(st.sampled_from([0, 10, 15, 30, 45, 59])))
    duration = draw(st.integers(1, 36 * 60))
    starts_on = draw(st.none() | st.just(change - timedelta(days=draw(st.integers(0, 3)))))
    until = change + timedelta(days=draw(st.integers(-1, 3)))
    lo = int(datetime.combine(change, time(), UTC).timestamp()) - 2 * 86400
    return made(weekly_body(zone, weekdays, start, duration, starts_on, until)), lo, lo + 4 * 86400


@settings(max_examples=40, deadline=None)
@given(weekly_near_a_change())
def test_occurrences_are_what_reading_the_clock_minute_by_minute_says(
        case: tuple[Booking | None, int, int]) -> None:
    booking, lo, hi = case
    if booking is None:
        return
    assert minutes_of(booking, lo, hi) == reference_minutes(booking, lo, hi)


@settings(max_examples=60, deadline=None)
@given(zone=st.sampled_from(["Europe/Berlin", "America/New_York"]),
       hour=st.integers(5, 20), minute=st.sampled_from([0, 30]),
       duration_min=st.integers(30, 180), weekday=st.sampled_from(WEEKDAYS))
def test_a_weekly_window_keeps_its_local_hours_all_year(zone: str, hour: int, minute: int,
                                                       duration_min: int, weekday: str) -> None:
    booking = made(weekly_body(zone, [weekday], time(hour, minute), duration_min,
                               date(2026, 1, 1), date(2026, 12, 31)))
    assert booking is not None
    tz = ZoneInfo(zone)
    found = occurrences(booking, 0, 2**36)
    assert len(found) in (52, 53)
    for occurrence in found:
        begin = local_at(occurrence.start, tz)
        assert begin == occurrence.local_start and begin.time() == time(hour, minute)
        assert local_at(occurrence.end, tz) == begin + timedelta(minutes=duration_min)
        assert WEEKDAYS[begin.weekday()] == weekday
    # The clocks did change: the same local hour is two UTC hours over the year.
    assert len({datetime.fromtimestamp(o.start, UTC).hour for o in found}) == 2


@settings(max_examples=200, deadline=None)
@given(zone=st.sampled_from(sorted(CHANGES)),
       day_offset=st.integers(-1, 1), day=st.integers(0, 1),
       first=st.integers(0, 24 * 60 - 1), second=st.integers(0, 24 * 60 - 1))
def test_a_later_local_time_is_never_an_earlier_instant(zone: str, day_offset: int, day: int,
                                                        first: int, second: int) -> None:
    tz = ZoneInfo(zone)
    base = datetime.combine(CHANGES[zone][day % len(CHANGES[zone])], time())
    base += timedelta(days=day_offset)
    a, b = sorted([base + timedelta(minutes=first), base + timedelta(minutes=second)])
    assert instant_of(a, tz) <= instant_of(b, tz)
    # The first instant the clock reads it or later: it does, and the minute before it not.
    assert local_at(instant_of(a, tz), tz) >= a
    assert local_at(instant_of(a, tz) - MINUTE, tz) < a


# ----------------------------------------------------------------------------- admission

MODELS = ("A", "B")
HOSTS = ("h1", "h2")
NOW = int(datetime(2026, 3, 27, 12, 0, tzinfo=UTC).timestamp())  # two days before Berlin's change
SPAN = 4 * 86400
NAMES = ModelNames.build(MODELS, {})


@st.composite
def capacities(draw: st.DrawFn) -> Capacity:
    return Capacity.of_gpus([(host, model) for model in MODELS for host in HOSTS
                             for _ in range(draw(st.integers(1, 3)))])


@st.composite
def booking_bodies(draw: st.DrawFn, name: str) -> dict[str, Any]:
    zone = draw(st.sampled_from(["Europe/Berlin", "UTC"]))
    gpus = {"model": draw(st.sampled_from(MODELS)), "count": draw(st.integers(1, 3)),
            "host": draw(st.sampled_from([None, *HOSTS]))}
    tz = ZoneInfo(zone)
    local_now = local_at(NOW, tz)
    if draw(st.booleans()):
        # Within a day, so that bookings meet often.
        start = local_now + timedelta(minutes=15 * draw(st.integers(-8, 96)))
        end = start + timedelta(minutes=15 * draw(st.integers(1, 48)))
        return {"name": name, "group": "g", "gpus": gpus, "zone": zone, "created_by": "a",
                "window": {"kind": "once", "start": start.strftime("%Y-%m-%dT%H:%M"),
                           "end": end.strftime("%Y-%m-%dT%H:%M")}}
    weekdays = draw(st.lists(st.sampled_from(WEEKDAYS), min_size=2, max_size=7, unique=True))
    start_time = time(draw(st.integers(0, 23)), draw(st.sampled_from([0, 15, 30, 45])))
    return weekly_body(zone, weekdays, start_time, 15 * draw(st.integers(1, 64)), None,
                       (local_now + timedelta(days=draw(st.integers(1, 3)))).date(),
                       name=name, gpus=gpus)


def several_bodies(most: int) -> st.SearchStrategy[tuple[dict[str, Any], ...]]:
    """Up to ``most`` bookings, named ``b0``, ``b1``... in the order they are made."""
    return st.integers(1, most).flatmap(
        lambda n: st.tuples(*[booking_bodies(f"b{i}") for i in range(n)]))


def checked(bodies: Sequence[dict[str, Any]], capacity: Capacity) -> list[ResolvedBooking]:
    """The generated bookings that pass their own rules and the cluster's checks."""
    facts = ClusterFacts(groups=frozenset({"g"}), names=NAMES, capacity=capacity,
                         hosts=frozenset(HOSTS))
    found = []
    for data in bodies:
        booking = made(data)
        if booking is not None:
            result = check_booking(booking, NOW, facts, horizon_s=SPAN + 86400)
            if isinstance(result, ResolvedBooking):
                found.append(result)
    return found


def overbooked_minutes(bookings: Sequence[ResolvedBooking], capacity: Capacity) -> set[int]:
    """Every minute from ``NOW`` on where the bookings together hold more of a model than
    exists, or more of one host's GPUs than it has: counted minute by minute."""
    held: dict[int, list[ResolvedBooking]] = {}
    for b in bookings:
        for minute in minutes_of(b.booking, NOW, NOW + SPAN + 2 * 86400):
            held.setdefault(minute, []).append(b)
    bad = set()
    for minute, running in held.items():
        for model in MODELS:
            of_model = [b for b in running if b.model == model]
            if sum(b.booking.gpus.count for b in of_model) > capacity.on(model):
                bad.add(minute)
            for host in HOSTS:
                pinned = sum(b.booking.gpus.count for b in of_model if b.booking.gpus.host == host)
                if pinned > capacity.on(model, host):
                    bad.add(minute)
    return bad


@settings(max_examples=40, deadline=None)
@given(capacity=capacities(),
       bodies=several_bodies(7))
def test_admitting_one_by_one_never_books_more_than_exists_in_any_minute(
        capacity: Capacity, bodies: tuple[dict[str, Any], ...]) -> None:
    admitted: list[ResolvedBooking] = []
    for candidate in checked(bodies, capacity):
        answer = admit(candidate, admitted, capacity, NOW, horizon_s=SPAN + 86400)
        # Exactly the bookings that would overbook a minute of theirs are refused.
        would_overbook = bool(overbooked_minutes([*admitted, candidate], capacity)
                              & minutes_of(candidate.booking, NOW, NOW + SPAN + 2 * 86400))
        assert answer.fits is not would_overbook
        if answer.fits:
            admitted.append(candidate)
        else:
            assert answer.collisions and answer.colliding >= len(answer.collisions)
            assert answer.largest_count < candidate.booking.gpus.count
            smaller = ResolvedBooking(candidate.booking.model_copy(update={
                "gpus": candidate.booking.gpus.model_copy(
                    update={"count": answer.largest_count})}), candidate.model)
            if answer.largest_count > 0:  # what it says would fit does
                assert admit(smaller, admitted, capacity, NOW, horizon_s=SPAN + 86400).fits
    assert not overbooked_minutes(admitted, capacity)


@settings(max_examples=100, deadline=None)
@given(capacity=capacities(), lost=st.lists(st.sampled_from(HOSTS), max_size=2, unique=True),
       bodies=several_bodies(6),
       minutes=st.lists(st.integers(-60, 2 * 86400 // MINUTE), min_size=1, max_size=8),
       lead_s=st.integers(0, 6 * 3600))
def test_guarantees_never_exceed_what_exists_and_lack_what_the_shortfall_says(
        capacity: Capacity, lost: list[str], bodies: tuple[dict[str, Any], ...],
        minutes: list[int], lead_s: int) -> None:
    admitted: list[ResolvedBooking] = []
    for candidate in checked(bodies, capacity):
        if admit(candidate, admitted, capacity, NOW, horizon_s=SPAN + 86400).fits:
            admitted.append(candidate)
    left = Capacity({model: {h: n for h, n in hosts.items() if h not in lost}
                     for model, hosts in capacity.gpus.items()})
    short = shortfalls(admitted, left, NOW - 3600, NOW + SPAN + 2 * 86400)
    short_by = {(s.booking, s.occurrence.start): s.short_by for s in short}
    for minute in minutes:
        t = NOW + minute * MINUTE
        with_all = guarantees_at(admitted, t, capacity, default_lead_s=lead_s)
        assert all(g.guaranteed == g.count for g in with_all)
        found = guarantees_at(admitted, t, left, default_lead_s=lead_s)
        assert [g.booking for g in found] == [g.booking for g in with_all]
        active = [g for g in found if g.state is GuaranteeState.ACTIVE]
        for model in MODELS:
            assert sum(g.guaranteed for g in active if g.model == model) <= left.on(model)
            for host in HOSTS:
                assert sum(g.guaranteed for g in active if g.model == model and g.host == host
                           ) <= left.on(model, host)
        for g in found:
            assert 0 <= g.guaranteed <= g.count
            if g.state is GuaranteeState.ACTIVE:
                assert g.starts_at <= t < g.ends_at
            else:
                assert t < g.starts_at <= t + lead_s
            if g.guaranteed < g.count:
                assert short_by[(g.booking, g.starts_at)] >= g.count - g.guaranteed
