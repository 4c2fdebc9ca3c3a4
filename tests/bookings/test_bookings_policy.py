"""The bookings' policy core (allocator.bookings), by example: each rule of a booking and the
one error each breach gets, occurrences across the changes of the clocks, admission with what
collides and what would fit, shortfall after GPUs went away, and the guarantees at an instant.
The properties over generated bookings and clocks are in
tests/bookings/test_bookings_properties.py."""

from __future__ import annotations

import json
from datetime import date, datetime
from typing import Any
from zoneinfo import ZoneInfo

import pytest

import allocator.bookings.booking as booking_module
from allocator.bookings.admission import admit
from allocator.bookings.booking import Booking, BookingErrorCode, BookingProblem, read_booking
from allocator.bookings.checks import ClusterFacts, ResolvedBooking, check_booking
from allocator.bookings.guarantees import GuaranteeState, guarantees_at
from allocator.bookings.local_time import instant_of, local_at
from allocator.bookings.shortfall import shortfalls
from allocator.bookings.supply import Capacity
from allocator.bookings.windows import occurrences
from allocator.wire.model_names import ModelNames, mig_model_name

GTX = "NVIDIA GeForce GTX 1070"
A100 = "NVIDIA A100-SXM4-40GB"
A100_1G = mig_model_name(A100, "1g.5gb")
BERLIN = ZoneInfo("Europe/Berlin")
NEW_YORK = ZoneInfo("America/New_York")

CAPACITY = Capacity.of_gpus(
    [("gpu-a", GTX)] * 4 + [("gpu-b", GTX)] * 2 + [("gpu-c", A100_1G)] * 7)
FACTS = ClusterFacts(
    groups=frozenset({"cs101", "ml-lab"}),
    names=ModelNames.build([GTX, A100, A100_1G], {"1070": GTX, "a100": A100}),
    capacity=CAPACITY,
)
NOW = instant_of(datetime(2026, 12, 1, 9, 0), BERLIN)  # a Tuesday


def body(**changes: Any) -> dict[str, Any]:
    """A weekly lab's booking as a request would carry it, with ``changes`` applied (a
    ``window`` change is merged into the window)."""
    data: dict[str, Any] = {
        "name": "CS101 lab", "group": "cs101",
        "gpus": {"model": "1070", "count": 2},
        "zone": "Europe/Berlin",
        "window": {"kind": "weekly", "weekdays": ["tue"], "start": "10:00",
                   "duration_s": 7200, "until": "2027-02-09"},
        "created_by": "admin",
    }
    window = changes.pop("window", None)
    data.update(changes)
    if window is not None:
        data["window"] = {**data["window"], **window} if window.get("kind") is None else window
    return data


def once(start: str, end: str) -> dict[str, Any]:
    return {"kind": "once", "start": start, "end": end}


def booking(**changes: Any) -> Booking:
    made = read_booking(body(**changes))
    assert isinstance(made, Booking), made
    return made


def resolved(**changes: Any) -> ResolvedBooking:
    checked = check_booking(booking(**changes), NOW, FACTS)
    assert isinstance(checked, ResolvedBooking), checked
    return checked


def problem(data: dict[str, Any]) -> BookingProblem:
    made = read_booking(data)
    assert isinstance(made, BookingProblem), made
    return made


# ----------------------------------------------------------------------------- a booking


def test_a_weekly_lab_reads_with_its_local_times() -> None:
    lab = booking()
    assert lab.window.kind == "weekly"
    assert lab.group == "cs101" and lab.users is None
    assert lab.tz.key == "Europe/Berlin"


@pytest.mark.parametrize("changes", [
    {}, {"window": once("2026-12-08T10:00", "2026-12-08T12:00")},
    {"group": None, "users": ["alice", "bob"], "lead_s": 600, "quota_applies": False,
     "gpus": {"model": "a100", "mig_profile": "1g.5gb", "count": 3, "host": "gpu-c"}},
])
def test_a_booking_written_as_json_reads_back_the_same(changes: dict[str, Any]) -> None:
    written = booking(**changes)
    assert read_booking(json.loads(written.model_dump_json())) == written
    assert Booking.model_json_schema()["title"] == "Booking"


@pytest.mark.parametrize(("data", "code", "words"), [
    (body(zone="Mars/Olympus"), BookingErrorCode.UNKNOWN_ZONE, "'Mars/Olympus' is not a known"),
    (body(zone="../../etc/passwd"), BookingErrorCode.UNKNOWN_ZONE, "not a known IANA"),
    (body(zone="Europe"), BookingErrorCode.UNKNOWN_ZONE, "not a known IANA"),
    (body(zone="Europe/{Berlin}"), BookingErrorCode.UNKNOWN_ZONE, "'Europe/{Berlin}' is not"),
    (body(window=once("2026-12-08T12:00", "2026-12-08T10:00")),
     BookingErrorCode.WINDOW_ENDS_BEFORE_START, "ends (2026-12-08 10:00) at or before"),
    (body(window=once("2026-12-08T10:00", "2026-12-08T10:00")),
     BookingErrorCode.WINDOW_ENDS_BEFORE_START, "at or before it starts"),
    # 02:10-02:40 on the night Berlin's clocks jump from 02:00 to 03:00 holds no instant.
    (body(window=once("2026-03-29T02:10", "2026-03-29T02:40")),
     BookingErrorCode.WINDOW_ENDS_BEFORE_START, "the clocks skip that time"),
    (body(window={"until": None}), BookingErrorCode.RECURRENCE_WITHOUT_END, "needs 'until'"),
    (body(window={"starts_on": "2027-03-01"}), BookingErrorCode.WINDOW_ENDS_BEFORE_START,
     "ends (2027-02-09) before it starts (2027-03-01)"),
    (body(window={"weekdays": ["mon", "tue"], "duration_s": 2 * 86400}),
     BookingErrorCode.WINDOWS_OVERLAP, "longer than the 1 day(s) to its next weekday"),
    (body(window={"starts_on": "2027-02-10", "until": "2027-02-15"}),
     BookingErrorCode.NO_OCCURRENCE, "none of tue falls between"),
    (body(users=["alice"]), BookingErrorCode.BAD_BOOKING, "by 'group' or by 'users'"),
    (body(group=None), BookingErrorCode.BAD_BOOKING, "by 'group' or by 'users'"),
    (body(group=None, users=["alice", "alice"]), BookingErrorCode.BAD_BOOKING, "listed twice"),
    (body(window={"weekdays": ["tue", "tue"]}), BookingErrorCode.BAD_BOOKING, "listed twice"),
    (body(window={"start": "10:00:30"}), BookingErrorCode.BAD_BOOKING, "whole minutes"),
    (body(window={"duration_s": 7230}), BookingErrorCode.BAD_BOOKING, "whole minutes"),
    (body(window=once("2026-12-08T10:00+01:00", "2026-12-08T12:00")),
     BookingErrorCode.BAD_BOOKING, "window.start: the window's start is a local time"),
    (body(window=once(1796720400, "2026-12-08T12:00")),  # type: ignore[arg-type]
     BookingErrorCode.BAD_BOOKING, "window.start: a date and time"),
    (body(gpus={"model": "1070", "count": True}), BookingErrorCode.BAD_BOOKING, "gpus.count"),
    (body(gpus={"model": "1070", "count": "2"}), BookingErrorCode.BAD_BOOKING, "gpus.count"),
    (body(gpus={"model": "1070", "count": 0}), BookingErrorCode.BAD_BOOKING, "gpus.count"),
    (body(lead_s=-1), BookingErrorCode.BAD_BOOKING, "lead_s"),
    (body(colour="red"), BookingErrorCode.BAD_BOOKING, "colour"),
    (body(window={"weekdays": ["tuesday"]}), BookingErrorCode.BAD_BOOKING, "window.weekdays"),
])
def test_each_bad_booking_gets_its_one_code(data: dict[str, Any], code: BookingErrorCode,
                                            words: str) -> None:
    found = problem(data)
    assert found.code is code, found
    assert words in found.message, found.message


def test_a_machine_without_zone_data_is_named_as_the_cause(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(booking_module, "available_timezones", set)
    found = problem(body(zone="Nowhere/Here"))
    assert found.code is BookingErrorCode.UNKNOWN_ZONE
    assert "this machine has no time zone database" in found.message


def test_one_problem_names_every_field_that_is_wrong() -> None:
    found = problem(body(zone="Nowhere/Here", gpus={"model": "1070", "count": 0}))
    assert found.code is BookingErrorCode.UNKNOWN_ZONE  # a booking's code before bad_booking
    assert "zone: 'Nowhere/Here'" in found.message and "gpus.count:" in found.message
    assert {e["type"] for e in found.details["errors"]} >= {"unknown_zone"}


# ----------------------------------------------------------------------------- checks


@pytest.mark.parametrize(("changes", "code", "words"), [
    ({"group": "cs999"}, BookingErrorCode.UNKNOWN_GROUP, "Known groups: cs101, ml-lab."),
    ({"gpus": {"model": "rtx 9090", "count": 1}}, BookingErrorCode.UNKNOWN_MODEL,
     "Unknown GPU model 'rtx 9090'"),
    ({"gpus": {"model": "a100", "mig_profile": "3g.20gb", "count": 1}},
     BookingErrorCode.UNKNOWN_MODEL, "Its known profiles: 1g.5gb."),
    ({"gpus": {"model": "1070", "mig_profile": "1g.5gb", "count": 1}},
     BookingErrorCode.UNKNOWN_MODEL, "none (no GPU of it is in MIG mode)"),
    ({"gpus": {"model": "1070", "count": 1, "host": "gpu-z"}}, BookingErrorCode.UNKNOWN_HOST,
     "Known hosts: gpu-a, gpu-b, gpu-c."),
    ({"gpus": {"model": "1070", "count": 7}}, BookingErrorCode.COUNT_OVER_CAPACITY,
     f"7 GPUs of {GTX} asked for; the cluster has 6 (gpu-a: 4, gpu-b: 2)."),
    ({"gpus": {"model": "1070", "count": 3, "host": "gpu-b"}},
     BookingErrorCode.COUNT_OVER_CAPACITY, "gpu-b has 2"),
    ({"window": once("2026-11-30T10:00", "2026-11-30T12:00")},
     BookingErrorCode.WINDOW_IN_PAST, "The window ended at 2026-11-30 12:00"),
    ({"window": {"until": "2026-11-24"}}, BookingErrorCode.WINDOW_IN_PAST,
     "Every occurrence up to 2026-11-24 has ended"),
    ({"window": {"until": "2028-06-01"}}, BookingErrorCode.TOO_FAR_AHEAD, "400 days ahead"),
])
def test_each_check_against_the_cluster_gets_its_one_code(
        changes: dict[str, Any], code: BookingErrorCode, words: str) -> None:
    found = check_booking(booking(**changes), NOW, FACTS)
    assert isinstance(found, BookingProblem), found
    assert found.code is code, found
    assert words in found.message, found.message


def test_a_model_resolves_by_alias_and_a_mig_profile_to_its_instances() -> None:
    assert resolved().model == GTX
    assert resolved(gpus={"model": "a100", "mig_profile": "1g.5gb", "count": 7}).model == A100_1G
    assert resolved(gpus={"model": "a100 1g.5gb", "count": 1}).model == A100_1G


def test_a_window_already_begun_is_booked_for_the_rest_of_it() -> None:
    begun = booking(window=once("2026-12-01T08:00", "2026-12-01T12:00"))
    assert isinstance(check_booking(begun, NOW, FACTS), ResolvedBooking)


# ----------------------------------------------------------------------------- windows


def test_a_lab_keeps_its_local_hours_across_both_changes_of_the_clocks() -> None:
    lab = booking(window={"starts_on": "2026-03-17", "until": "2026-11-03"})
    found = occurrences(lab, 0, 2**36)
    assert [o.local_start.date() for o in found][:3] == [date(2026, 3, 17), date(2026, 3, 24),
                                                          date(2026, 3, 31)]
    assert all(local_at(o.start, BERLIN).time().isoformat() == "10:00:00" for o in found)
    assert all(local_at(o.end, BERLIN).time().isoformat() == "12:00:00" for o in found)
    utc_hours = {datetime.fromtimestamp(o.start, ZoneInfo("UTC")).hour for o in found}
    assert utc_hours == {8, 9}  # 08:00 UTC in summer time, 09:00 in winter time
    assert len(found) == 34


def test_a_start_the_clocks_skip_begins_at_the_jump() -> None:
    # New York, 2026-03-08: 02:00 EST becomes 03:00 EDT (07:00 UTC).
    night = booking(zone="America/New_York", window={
        "weekdays": ["sun"], "start": "02:30", "duration_s": 5400,
        "starts_on": "2026-03-01", "until": "2026-03-15"})
    found = occurrences(night, 0, 2**36)
    assert [(local_at(o.start, NEW_YORK).isoformat(" "), local_at(o.end, NEW_YORK).time())
            for o in found] == [
        ("2026-03-01 02:30:00", datetime(1, 1, 1, 4, 0).time()),
        ("2026-03-08 03:00:00", datetime(1, 1, 1, 4, 0).time()),  # 03:00-04:00 that night
        ("2026-03-15 02:30:00", datetime(1, 1, 1, 4, 0).time()),
    ]
    assert found[1].start == int(datetime(2026, 3, 8, 7, 0, tzinfo=ZoneInfo("UTC")).timestamp())


def test_a_time_the_clocks_show_twice_is_the_first_time() -> None:
    # Berlin, 2026-10-25: 03:00 CEST becomes 02:00 CET; 02:30 comes at 00:30 and 01:30 UTC.
    first = instant_of(datetime(2026, 10, 25, 2, 30), BERLIN)
    assert first == int(datetime(2026, 10, 25, 0, 30, tzinfo=ZoneInfo("UTC")).timestamp())
    # A window from 01:00 to 04:00 that night lasts four hours.
    night = booking(window=once("2026-10-25T01:00", "2026-10-25T04:00"))
    [only] = occurrences(night, 0, 2**36)
    assert only.end - only.start == 4 * 3600


def test_a_weekly_window_in_the_skipped_hour_is_empty_that_night_only() -> None:
    night = booking(window={"weekdays": ["sun"], "start": "02:10", "duration_s": 1800,
                            "starts_on": "2026-03-22", "until": "2026-04-05"})
    found = occurrences(night, 0, 2**36)
    assert [o.local_start.date() for o in found] == [date(2026, 3, 22), date(2026, 4, 5)]


def test_occurrences_are_those_overlapping_the_interval() -> None:
    lab = booking()
    tue = instant_of(datetime(2026, 12, 8, 10, 0), BERLIN)
    assert [o.start for o in occurrences(lab, tue + 3600, tue + 3601)] == [tue]
    assert occurrences(lab, tue + 7200, tue + 7 * 86400) == []  # ends as the next begins
    assert occurrences(lab, tue, tue) == []


# ----------------------------------------------------------------------------- admission


def test_a_booking_that_fits_is_admitted() -> None:
    others = [resolved(name="ML", gpus={"model": "1070", "count": 4})]
    answer = admit(resolved(gpus={"model": "1070", "count": 2}), others, CAPACITY, NOW)
    assert answer.fits and answer.problem(resolved()) is None
    assert answer.occurrences == 11  # Tuesdays 2026-12-01 .. 2027-02-09
    assert answer.largest_count == 2


def test_a_collision_says_what_collides_and_what_would_fit() -> None:
    ml = resolved(name="ML lab", window=once("2026-12-15T11:00", "2026-12-15T15:00"),
                  gpus={"model": "1070", "count": 5})
    new = resolved(gpus={"model": "1070", "count": 3})
    answer = admit(new, [ml], CAPACITY, NOW)
    assert not answer.fits
    assert answer.colliding == 1
    [collision] = answer.collisions
    assert collision.occurrence.local_start == datetime(2026, 12, 15, 10, 0)
    assert local_at(collision.worst_start, BERLIN) == datetime(2026, 12, 15, 11, 0)
    assert local_at(collision.worst_end, BERLIN) == datetime(2026, 12, 15, 12, 0)
    assert collision.short_by == 2 and collision.others == ("ML lab",)
    assert answer.largest_count == 1
    assert answer.fits_until == date(2026, 12, 8)
    refusal = answer.problem(new)
    assert refusal is not None and refusal.code is BookingErrorCode.COLLIDES
    assert "1 of its 11 occurrence(s) collide" in refusal.message
    assert "Tue 2026-12-15 10:00 (Europe/Berlin)" in refusal.message
    assert "1 GPU(s) would fit" in refusal.message
    assert "Ending it on 2026-12-08 would fit" in refusal.message
    assert refusal.details["collisions"][0]["others"] == ["ML lab"]


def test_a_booking_pinned_to_a_full_host_would_fit_elsewhere() -> None:
    pinned = resolved(name="ML", gpus={"model": "1070", "count": 2, "host": "gpu-b"})
    new = resolved(gpus={"model": "1070", "count": 1, "host": "gpu-b"})
    answer = admit(new, [pinned], CAPACITY, NOW)
    assert not answer.fits and answer.fits_without_host is True
    assert answer.collisions[0].others == ("ML",)
    assert admit(resolved(gpus={"model": "1070", "count": 4}), [pinned], CAPACITY, NOW).fits


def test_unpinned_bookings_share_what_the_pinned_ones_leave() -> None:
    pinned = resolved(name="ML", gpus={"model": "1070", "count": 3, "host": "gpu-a"})
    assert admit(resolved(gpus={"model": "1070", "count": 3}), [pinned], CAPACITY, NOW).fits
    too_many = admit(resolved(gpus={"model": "1070", "count": 4}), [pinned], CAPACITY, NOW)
    assert not too_many.fits and too_many.largest_count == 3


def test_other_models_and_back_to_back_windows_never_collide() -> None:
    mig = resolved(name="MIG", gpus={"model": "a100", "mig_profile": "1g.5gb", "count": 7})
    before = resolved(name="Before", window={"start": "08:00"},
                      gpus={"model": "1070", "count": 6})
    after = resolved(name="After", window={"start": "12:00"}, gpus={"model": "1070", "count": 6})
    new = resolved(gpus={"model": "1070", "count": 6})
    assert admit(new, [mig, before, after], CAPACITY, NOW).fits


def test_a_window_already_begun_collides_only_from_now_on() -> None:
    earlier = ResolvedBooking(booking(name="Morning", window=once("2026-12-01T07:00",
                                                                  "2026-12-01T09:00"),
                                      gpus={"model": "1070", "count": 6}), GTX)
    begun = resolved(window=once("2026-12-01T08:00", "2026-12-01T12:00"),
                     gpus={"model": "1070", "count": 6})
    assert admit(begun, [earlier], CAPACITY, NOW).fits  # NOW is 09:00, when Morning ends
    assert not admit(begun, [earlier], CAPACITY, NOW - 60).fits


def test_a_collision_with_an_already_short_booking_asks_for_nothing_more() -> None:
    big = resolved(name="Big", gpus={"model": "1070", "count": 6})
    smaller = Capacity.of_gpus([("gpu-a", GTX)] * 4)
    answer = admit(resolved(gpus={"model": "1070", "count": 1}), [big], smaller, NOW)
    assert not answer.fits and answer.largest_count == 0
    assert answer.collisions[0].short_by == 1  # its own GPU; the rest was short already


# ----------------------------------------------------------------------------- shortfall


def test_when_a_host_goes_the_later_booking_is_short_and_the_earlier_kept() -> None:
    earlier = resolved(name="ML", gpus={"model": "1070", "count": 3})
    later = resolved(gpus={"model": "1070", "count": 3})
    assert admit(later, [earlier], CAPACITY, NOW).fits
    assert shortfalls([earlier, later], CAPACITY, NOW, NOW + 14 * 86400) == []
    drained = Capacity.of_gpus([("gpu-a", GTX)] * 4)  # gpu-b drained
    short = shortfalls([earlier, later], drained, NOW, NOW + 14 * 86400)
    assert [(s.booking, s.occurrence.local_start, s.short_by) for s in short] == [
        ("CS101 lab", datetime(2026, 12, 1, 10, 0), 2),
        ("CS101 lab", datetime(2026, 12, 8, 10, 0), 2),
    ]
    assert short[0].text(later) == (
        f"Booking 'CS101 lab' is 2 of its 3 GPU(s) of {GTX} short on "
        "Tue 2026-12-01 10:00 (Europe/Berlin).")


def test_a_pinned_booking_on_a_lost_host_is_short_by_all_of_it() -> None:
    pinned = resolved(gpus={"model": "1070", "count": 2, "host": "gpu-b"})
    lost = Capacity.of_gpus([("gpu-a", GTX)] * 4)
    [first, *_] = shortfalls([pinned], lost, NOW, NOW + 86400)
    assert first.short_by == 2


# ----------------------------------------------------------------------------- guarantees


def test_a_booking_guarantees_its_members_during_its_window_and_warns_within_its_lead() -> None:
    lab = resolved(lead_s=900, gpus={"model": "1070", "count": 2})
    start = instant_of(datetime(2026, 12, 8, 10, 0), BERLIN)
    assert guarantees_at([lab], start - 901, CAPACITY, default_lead_s=0) == []
    [soon] = guarantees_at([lab], start - 900, CAPACITY, default_lead_s=0)
    assert soon.state is GuaranteeState.UPCOMING and soon.starts_at == start
    [now] = guarantees_at([lab], start + 60, CAPACITY, default_lead_s=0)
    assert (now.state, now.model, now.count, now.guaranteed, now.host) == (
        GuaranteeState.ACTIVE, GTX, 2, 2, None)
    assert now.ends_at == start + 7200 and now.quota_applies
    assert now.covers("alice", ["cs101"]) and not now.covers("bob", ["ml-lab"])
    assert guarantees_at([lab], start + 7200, CAPACITY, default_lead_s=0) == []


def test_the_default_lead_applies_to_a_booking_without_its_own() -> None:
    lab = resolved(group=None, users=["alice"])
    start = instant_of(datetime(2026, 12, 8, 10, 0), BERLIN)
    assert guarantees_at([lab], start - 300, CAPACITY, default_lead_s=299) == []
    [soon] = guarantees_at([lab], start - 300, CAPACITY, default_lead_s=300)
    assert soon.covers("alice", []) and not soon.covers("bob", ["cs101"])


def test_guarantees_after_gpus_went_away_are_what_is_left_in_admission_order() -> None:
    earlier = resolved(name="ML", gpus={"model": "1070", "count": 3})
    later = resolved(gpus={"model": "1070", "count": 3})
    drained = Capacity.of_gpus([("gpu-a", GTX)] * 4)
    start = instant_of(datetime(2026, 12, 8, 10, 0), BERLIN)
    found = guarantees_at([earlier, later], start, drained, default_lead_s=0)
    assert [(g.booking, g.count, g.guaranteed) for g in found] == [
        ("ML", 3, 3), ("CS101 lab", 3, 1)]
