"""Bookings during their window, in the engine: members' leases are guaranteed, members wait
ahead of the others, non-members standing on the booked GPUs are warned ``lead_s`` before
and reclaimed at the start when members need the GPUs, and nothing changes outside windows.

Pure engine, no broker: the engine is driven with messages and a clock (epoch seconds, since
bookings are in wall-clock time).
"""

from __future__ import annotations

from pathlib import Path

from allocator.engine import Engine
from allocator.ledger.changes import Changes
from allocator.ledger.store import Ledger
from allocator.wire.protocol import (
    AllocateRequest,
    DrainRequest,
    LeaseState,
    ReleaseRequest,
)
from tests.support.booked_cluster import HOST, NINE, BookedCluster
from tests.support.common import ADMIN


def at(hhmm: str) -> float:
    """That time (UTC) on the tests' day, epoch seconds."""
    hours, minutes = (int(part) for part in hhmm.split(":"))
    return NINE + (hours - 9) * 3600 + minutes * 60


def test_a_borrower_is_warned_at_the_lead_reclaimed_at_the_start_for_a_waiting_member(
        tmp_path: Path) -> None:
    cluster = BookedCluster(tmp_path, gpus=2)
    older = cluster.hold("bob", "a")
    cluster.now += 1
    newer = cluster.hold("bob", "b")
    cluster.book(count=1, lead_s=300)
    cluster.until(at("09:54"))
    assert cluster.engine.leases[newer].reclaim_at is None
    cluster.until(at("09:55"))
    # Only as many as the booking lacks: one GPU, the newest grant.
    warned = cluster.lease(newer)
    assert (warned.reclaim_at, warned.reclaim_reason, warned.reclaim_booking) == (
        at("10:00"), "reclaimed", "CS101")
    assert cluster.engine.leases[older].reclaim_at is None
    (event,) = cluster.events("reclaim_warning")
    assert (event["booking"], event["note"]) == ("CS101",
                                                  "reclaimable at 10:00 for the booking CS101")
    member = cluster.ask("alice", member=True, wait_s=3600).lease.lease_id
    cluster.until(at("10:00") - 5)
    assert cluster.engine.leases[newer].state is LeaseState.BOUND  # not before the start
    cluster.until(at("10:00"))
    assert cluster.engine.leases[newer].state is LeaseState.RELEASING
    cluster.died(newer)
    granted = cluster.lease(member)
    assert (granted.state, granted.borrowed) == (LeaseState.GRANTED, False)
    assert cluster.lease(newer).release_reason == "reclaimed"
    cluster.until(at("10:01"))
    assert cluster.lease(member).booking == "CS101"


def test_nobody_is_warned_when_free_gpus_cover_the_booking(tmp_path: Path) -> None:
    cluster = BookedCluster(tmp_path, gpus=3)
    cluster.hold("bob", "a")
    cluster.hold("bob", "b")
    cluster.book(count=1, lead_s=300)
    cluster.until(at("09:56"))
    assert not cluster.events("reclaim_warning")


def test_without_a_waiting_member_the_warning_is_not_carried_out(tmp_path: Path) -> None:
    cluster = BookedCluster(tmp_path, gpus=1)
    bob = cluster.hold("bob")
    cluster.book(count=1, lead_s=60)
    cluster.until(at("10:05"))
    assert cluster.engine.leases[bob].state is LeaseState.BOUND
    assert cluster.engine.leases[bob].reclaim_at == at("10:00")  # still warned: in the window
    cluster.until(at("11:00"))
    assert cluster.engine.leases[bob].reclaim_at is None  # the window ended: withdrawn
    assert cluster.events("reclaim_withdrawn")


def test_members_wait_ahead_of_others_during_the_window(tmp_path: Path) -> None:
    cluster = BookedCluster(tmp_path, gpus=1)
    cluster.book(count=1, lead_s=0)
    cluster.until(at("10:00"))
    holder = cluster.hold("carol", "x")  # not a member: warned, the booking lacks its GPU
    cluster.now += 1
    other = cluster.ask("bob", wait_s=3600).lease.lease_id
    cluster.now += 1
    member = cluster.ask("alice", member=True, wait_s=3600).lease.lease_id
    assert cluster.lease(member).queue_position == 1
    assert cluster.lease(other).queue_position == 2
    cluster.send(ReleaseRequest(lease_id=holder))
    cluster.died(holder)
    assert cluster.engine.leases[member].state is LeaseState.GRANTED
    assert cluster.engine.leases[other].state is LeaseState.QUEUED


def test_a_member_within_the_booking_is_not_reclaimed_for_a_guaranteed_waiter(
        tmp_path: Path) -> None:
    cluster = BookedCluster(tmp_path, gpus=1, user_quota={"dave": 1})
    cluster.book(count=1, lead_s=0)
    cluster.until(at("10:00"))
    member = cluster.hold("alice", member=True)
    assert not cluster.engine.leases[member].borrowed
    cluster.ask("dave", wait_s=3600)
    cluster.until(at("10:10"))
    assert cluster.engine.leases[member].reclaim_at is None
    assert cluster.engine.leases[member].state is LeaseState.BOUND


def test_a_members_lease_outlives_the_window_as_an_ordinary_lease(tmp_path: Path) -> None:
    cluster = BookedCluster(tmp_path, gpus=1)
    cluster.book(count=1, lead_s=0)
    cluster.until(at("10:00"))
    member = cluster.hold("alice", member=True)
    assert cluster.lease(member).booking == "CS101"
    cluster.until(at("11:30"))
    record = cluster.engine.leases[member]
    assert (record.state, record.borrowed, record.reclaim_at) == (LeaseState.BOUND, True, None)
    assert cluster.lease(member).booking is None


def test_a_booking_may_lift_the_members_quota(tmp_path: Path) -> None:
    cluster = BookedCluster(tmp_path, gpus=2, group_borrow_limit={"cs101": 0})
    cluster.book(name="lifted", count=1, lead_s=0, quota_applies=False)
    refused = cluster.send(AllocateRequest(request_key="hub/alice/", user="alice",
                                           groups=["cs101"]))
    assert refused.error.code == "quota_exceeded"  # before the window
    cluster.until(at("10:00"))
    assert cluster.ask("alice", member=True).lease.state is LeaseState.GRANTED
    second = cluster.send(AllocateRequest(request_key="hub/alice/2", user="alice",
                                          groups=["cs101"]))
    assert second.error.code == "quota_exceeded"  # beyond the booking's room


def test_a_booking_whose_quota_applies_keeps_it(tmp_path: Path) -> None:
    cluster = BookedCluster(tmp_path, gpus=2, group_borrow_limit={"cs101": 0})
    cluster.book(count=1, lead_s=0)
    cluster.until(at("10:00"))
    refused = cluster.send(AllocateRequest(request_key="hub/alice/", user="alice",
                                           groups=["cs101"]))
    assert refused.error.code == "quota_exceeded"


def test_a_tick_between_boundaries_does_not_compute_the_guarantees_again(tmp_path: Path) -> None:
    cluster = BookedCluster(tmp_path, gpus=1)
    cluster.book(count=1, lead_s=300)
    windows = cluster.engine.windows
    cluster.until(at("09:10"))
    computed = windows.computed_at
    assert windows.next_at == at("09:55")
    cluster.until(at("09:50"))
    assert windows.computed_at == computed
    cluster.until(at("09:55"))
    assert windows.computed_at == at("09:55") and windows.next_at == at("10:00")


def test_a_drain_in_the_window_is_judged_at_once_not_at_the_next_boundary(
        tmp_path: Path) -> None:
    """The guarantees are judged against the GPUs placeable now: a GPU drained in the middle
    of a window leaves the booking short at once, and undrained, whole again."""
    cluster = BookedCluster(tmp_path, gpus=2)
    cluster.book(count=2, lead_s=0)
    cluster.until(at("10:10"))
    (guarantee,) = cluster.engine.windows.now(cluster.now)
    before = cluster.engine.windows.computed_at
    assert guarantee.guaranteed == 2, guarantee
    cluster.send(DrainRequest(host=HOST, gpu_uuid="GPU-1"), ADMIN)
    cluster.until(at("10:11"))
    (guarantee,) = cluster.engine.windows.now(cluster.now)
    assert guarantee.guaranteed == 1 and cluster.engine.windows.computed_at != before, guarantee
    cluster.send(DrainRequest(host=HOST, gpu_uuid="GPU-1", drained=False), ADMIN)
    (guarantee,) = cluster.engine.windows.now(cluster.now)
    assert guarantee.guaranteed == 2, guarantee


def test_a_free_gpu_counts_for_one_booking_only(tmp_path: Path) -> None:
    cluster = BookedCluster(tmp_path, gpus=3)
    cluster.hold("bob", "a")
    cluster.now += 1
    newer = cluster.hold("bob", "b")
    cluster.book(name="first", count=1, lead_s=300)
    cluster.book(name="second", count=1, lead_s=300)
    cluster.until(at("09:55"))
    # One GPU is free: the first booking counts on it, the second needs bob's newest.
    (event,) = cluster.events("reclaim_warning")
    assert (event["lease_id"], event["booking"]) == (newer, "second")


def test_a_restart_keeps_the_warning_and_names_its_booking_again(tmp_path: Path) -> None:
    cluster = BookedCluster(tmp_path, gpus=1)
    bob = cluster.hold("bob")
    cluster.book(count=1, lead_s=300)
    cluster.until(at("09:55"))
    assert cluster.lease(bob).reclaim_booking == "CS101"
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open()
    try:
        ledger.call(lambda: ledger.commit(cluster.changes))
        cluster.now += 5
        restarted = Engine(cluster.settings, started_at=cluster.now)
        restarted.load(ledger.call(ledger.load), cluster.now, fenced=False)
    finally:
        ledger.close()
    cluster.engine, cluster.changes = restarted, Changes()
    # The warning is the ledger's; which booking it is for, memory's: named by the next run.
    assert cluster.lease(bob).reclaim_at == at("10:00")
    cluster.until(cluster.now + 5)
    warned = cluster.lease(bob)
    assert (warned.reclaim_at, warned.reclaim_booking) == (at("10:00"), "CS101")
    assert cluster.events("reclaim_warning") == []  # named again, not warned again
