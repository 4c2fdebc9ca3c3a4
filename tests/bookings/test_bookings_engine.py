"""Bookings kept by the engine (allocator.engine.bookings) and the ledger: an admin adds,
lists and removes them; each bad input gets its one error code; each change is written to a
real SQLite ledger with an event that says who made it, and an engine loaded from that ledger
holds the same bookings. The RPC over the broker is tests/bookings/test_bookings_rpc.py."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from allocator.bookings.local_time import instant_of
from allocator.engine import Sender
from allocator.ledger.store import Ledger
from allocator.wire.protocol import (
    BookingReply,
    DrainRequest,
    ErrorCode,
    ErrorReply,
)
from tests.support.booking_engine import BERLIN, NOW, Cluster, lab
from tests.support.common import GTX1070, RTX3090, gpus

HUB = Sender(user_id="hub", via_nodes_exchange=False)


@pytest.fixture
def cluster(tmp_path: Path) -> Any:
    made = Cluster(tmp_path / "ledger.sqlite")
    yield made
    made.close()


def test_an_added_booking_is_held_resolved_written_and_reloaded(cluster: Cluster,
                                                                tmp_path: Path) -> None:
    reply = cluster.add(lab())
    [view] = reply.bookings
    assert view.name == "CS101 lab" and view.model == GTX1070
    assert view.created_by == "prof (admin)" and view.shortfalls == []
    # Its next occurrences: today 10:00 Berlin (an hour from now), then each Tuesday.
    first = instant_of(datetime(2026, 12, 1, 10, 0), BERLIN)
    assert [o.start for o in view.next] == [first, first + 7 * 86400, first + 14 * 86400]
    assert view.next[0].local_start == "2026-12-01T10:00:00"
    assert [b.name for b in cluster.engine.bookings.all()] == ["CS101 lab"]
    assert [(r.name, r.model) for r in cluster.engine.bookings.resolved()] == [
        ("CS101 lab", GTX1070)]
    # The ledger: the row, and the event with who made it.
    [(name, stored, created_at, created_by, removed_at)] = cluster.rows(
        "SELECT name, booking, created_at, created_by, removed_at FROM bookings")
    assert (name, created_at, created_by, removed_at) == ("CS101 lab", NOW, "prof (admin)", None)
    assert json.loads(stored)["gpus"] == {"model": "1070", "mig_profile": None, "count": 2,
                                          "host": None}
    [(kind, detail)] = cluster.rows("SELECT kind, detail FROM events WHERE kind LIKE 'booking%'")
    assert kind == "booking_added"
    assert json.loads(detail).items() >= {"booking": "CS101 lab", "by": "prof (admin)",
                                          "model": GTX1070, "count": 2,
                                          "group": "cs101"}.items()
    # A second allocator on the same file holds the same booking.
    cluster.close()
    again = Cluster(tmp_path / "ledger.sqlite")
    try:
        assert [(r.name, r.model, r.booking) for r in again.engine.bookings.resolved()] == [
            (r.name, r.model, r.booking) for r in cluster.engine.bookings.resolved()]
        listed = again.booking("list")
        assert isinstance(listed, BookingReply) and [v.name for v in listed.bookings] == [
            "CS101 lab"]
    finally:
        again.close()
    cluster.ledger = Ledger(tmp_path / "ledger.sqlite")
    cluster.ledger.open()


def test_a_booking_that_does_not_fit_is_refused_with_what_collides(cluster: Cluster) -> None:
    cluster.add(lab(gpus={"model": "1070", "count": 4}))
    refused = cluster.refused(lab(name="ML lab", group="ml",
                                  gpus={"model": "1070", "count": 3}))
    assert refused.error.code is ErrorCode.COLLIDES
    assert "CS101 lab" in refused.error.message and "2 GPU(s) would fit" in refused.error.message
    details = refused.error.details
    assert details["largest_count"] == 2 and details["collisions"][0]["others"] == ["CS101 lab"]
    assert details["collisions"][0]["short_by"] == 1
    # What would fit fits; nothing of the refusal was kept.
    cluster.add(lab(name="ML lab", group="ml", gpus={"model": "1070", "count": 2}))
    assert [b.name for b in cluster.engine.bookings.all()] == ["CS101 lab", "ML lab"]
    assert cluster.rows("SELECT count(*) FROM events WHERE kind = 'booking_added'") == [(2,)]


@pytest.mark.parametrize(("change", "code", "says"), [
    ({"window": {"kind": "once", "start": "2026-11-30T10:00", "end": "2026-11-30T12:00"}},
     ErrorCode.WINDOW_IN_PAST, "ended"),
    ({"window": {"kind": "once", "start": "2026-12-08T12:00", "end": "2026-12-08T10:00"}},
     ErrorCode.WINDOW_ENDS_BEFORE_START, "before it starts"),
    ({"zone": "Europe/Atlantis"}, ErrorCode.UNKNOWN_ZONE, "Europe/Atlantis"),
    ({"group": "cs999"}, ErrorCode.UNKNOWN_GROUP, "cs101"),
    ({"gpus": {"model": "h100", "count": 1}}, ErrorCode.UNKNOWN_MODEL, GTX1070),
    ({"window": {"kind": "weekly", "weekdays": ["tue"], "start": "10:00", "duration_s": 7200}},
     ErrorCode.RECURRENCE_WITHOUT_END, "until"),
    ({"gpus": {"model": "1070", "count": 7}}, ErrorCode.COUNT_OVER_CAPACITY, "has 6"),
    ({"gpus": {"model": "1070", "count": 5, "host": "gpu-a"}}, ErrorCode.COUNT_OVER_CAPACITY,
     "gpu-a has 4"),
    ({"gpus": {"model": "1070", "count": 1, "host": "gpu-z"}}, ErrorCode.UNKNOWN_HOST, "gpu-a"),
    ({"window": {"kind": "weekly", "weekdays": ["tue"], "start": "10:00",
                 "duration_s": 7200, "until": "2028-12-01"}}, ErrorCode.TOO_FAR_AHEAD, "days"),
    ({"gpus": {"model": "1070"}}, ErrorCode.BAD_REQUEST, "count"),
    ({"users": ["alice"]}, ErrorCode.BAD_REQUEST, "one of them"),
])
def test_each_bad_booking_gets_its_one_error(cluster: Cluster, change: dict[str, Any],
                                             code: ErrorCode, says: str) -> None:
    refused = cluster.refused(lab(**change))
    assert refused.error.code is code, refused.error
    assert says in refused.error.message, refused.error.message
    assert "\n" not in refused.error.message
    assert cluster.engine.bookings.all() == []
    assert cluster.rows("SELECT count(*) FROM bookings") == [(0,)]


def test_only_admins_manage_bookings_and_names_are_unique(cluster: Cluster) -> None:
    for op, fields in (("add", {"booking": lab()}), ("list", {}),
                       ("remove", {"name": "CS101 lab"})):
        refused = cluster.booking(op, HUB, **fields)
        assert isinstance(refused, ErrorReply) and refused.error.code is ErrorCode.FORBIDDEN
        assert "admin_users" in refused.error.message
    cluster.add(lab())
    twice = cluster.refused(lab(gpus={"model": "1070", "count": 1}))
    assert twice.error.code is ErrorCode.CONFLICT
    missing = cluster.booking("remove", name="CS102 lab")
    assert isinstance(missing, ErrorReply) and missing.error.code is ErrorCode.NOT_FOUND
    assert "CS101 lab" in missing.error.message


def test_a_removed_booking_is_gone_and_its_row_says_who_removed_it(cluster: Cluster,
                                                                   tmp_path: Path) -> None:
    cluster.add(lab())
    cluster.now += 10
    removed = cluster.booking("remove", name="CS101 lab", reason="term moved")
    assert isinstance(removed, BookingReply) and [v.name for v in removed.bookings] == [
        "CS101 lab"]
    assert cluster.engine.bookings.all() == [] and cluster.engine.bookings.resolved() == ()
    assert cluster.rows("SELECT removed_at, removed_by FROM bookings") == [
        (NOW + 10, "prof (admin)")]
    [(detail,)] = cluster.rows("SELECT detail FROM events WHERE kind = 'booking_removed'")
    assert json.loads(detail) == {"booking": "CS101 lab", "by": "prof (admin)",
                                  "reason": "term moved"}
    # The name is free again, and a reload holds nothing removed.
    cluster.add(lab(gpus={"model": "1070", "count": 6}))
    loaded = cluster.ledger.call(cluster.ledger.load)
    assert [(row.name, row.booking["gpus"]["count"]) for row in loaded.bookings] == [
        ("CS101 lab", 6)]


def test_a_booking_short_after_a_drain_is_kept_and_says_so(cluster: Cluster) -> None:
    cluster.add(lab(gpus={"model": "1070", "count": 5}))
    drained = cluster.apply(DrainRequest(host="gpu-b", reason="maintenance"))
    assert not isinstance(drained, ErrorReply)
    listed = cluster.booking("list")
    assert isinstance(listed, BookingReply)
    [view] = listed.bookings
    assert view.shortfalls and "1 of its 5 GPU(s)" in view.shortfalls[0]
    assert "Tue 2026-12-01 10:00 (Europe/Berlin)" in view.shortfalls[0]
    assert [b.name for b in cluster.engine.bookings.resolved()] == ["CS101 lab"]


def test_bookings_are_resolved_again_when_their_model_appears(tmp_path: Path) -> None:
    """A ledger holding a booking of a model no node reports yet (a restored ledger, the
    node still starting): the booking is kept, left out of resolved(), and resolved once a
    heartbeat brings the model."""
    path = tmp_path / "ledger.sqlite"
    first = Cluster(path, hosts={"gpu-a": gpus("gpu-a", GTX1070, 4),
                                 "gpu-b": gpus("gpu-b", RTX3090, 2)})
    first.add(lab(name="3090 lab", gpus={"model": RTX3090, "count": 2}))
    first.close()
    second = Cluster(path, hosts={})
    try:
        # The ledger's GPUs are known at load; a ledger without them is a fresh cluster.
        second.engine.cluster.gpus.clear()
        second.engine.bookings.inventory_changed()
        assert [b.name for b in second.engine.bookings.all()] == ["3090 lab"]
        assert second.engine.bookings.resolved() == ()
        listed = second.booking("list")
        assert isinstance(listed, BookingReply)
        assert listed.bookings[0].model is None and "kept" in listed.bookings[0].shortfalls[0]
        second.beat("gpu-b", gpus("gpu-b", RTX3090, 2))
        assert [(b.name, b.model) for b in second.engine.bookings.resolved()] == [
            ("3090 lab", RTX3090)]
    finally:
        second.close()


def test_a_window_already_begun_is_booked_for_the_rest_of_it(cluster: Cluster) -> None:
    cluster.now = float(instant_of(datetime(2026, 12, 1, 11, 0), BERLIN))
    for host, count in (("gpu-a", 4), ("gpu-b", 2)):  # the nodes are up at the new time
        cluster.beat(host, gpus(host, GTX1070, count))
    reply = cluster.add(lab(window={"kind": "once", "start": "2026-12-01T10:00",
                                    "end": "2026-12-01T12:00"}))
    assert [o.local_start for o in reply.bookings[0].next] == ["2026-12-01T10:00:00"]
    # ... and a node silent past node_down_after_s is no capacity to book.
    cluster.now += cluster.settings.node_down_after_s + 1
    cluster.beat("gpu-a", gpus("gpu-a", GTX1070, 4))
    refused = cluster.refused(lab(name="late", gpus={"model": "1070", "count": 5},
                                  window={"kind": "once", "start": "2026-12-01T12:00",
                                          "end": "2026-12-01T13:00"}))
    assert refused.error.code is ErrorCode.COUNT_OVER_CAPACITY
    assert "gpu-a: 4" in refused.error.message


def test_every_booking_problem_has_an_error_code_of_the_protocol() -> None:
    from allocator.bookings.booking import BookingErrorCode
    from allocator.engine.bookings import error_code_of

    codes = {code: error_code_of(code) for code in BookingErrorCode}
    assert codes[BookingErrorCode.BAD_BOOKING] is ErrorCode.BAD_REQUEST
    assert all(error.value == code.value for code, error in codes.items()
               if code is not BookingErrorCode.BAD_BOOKING)
