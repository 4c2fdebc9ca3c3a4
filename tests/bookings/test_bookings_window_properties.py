"""Bookings in the engine, over random bookings, requests, releases and clocks (hypothesis):

* a member's lease that a booking covers is never warned, so never reclaimed, while the
  booking covers it (for a borrower or anyone else);
* the bookings in effect never guarantee more GPUs than exist, and never cover more than they
  guarantee.

Both are checked after every message and every tick (a reclaim's stop needs a warning
``reclaim_grace_s`` before it, so a lease never warned while covered is never stopped for
one while covered).

Pure engine, no broker.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocator.bookings.guarantees import GuaranteeState
from allocator.wire.protocol import (
    AllocateRequest,
    BookingReply,
    BookingRequest,
    LeaseState,
    ReleaseRequest,
)
from tests.support.booked_cluster import NINE, BookedCluster
from tests.support.common import ADMIN

GPUS = 3
USERS = ("alice", "bob", "carol", "dave")
MEMBERS = {"alice", "carol"}


def _window(start_min: int, minutes: int) -> dict[str, str]:
    def local(offset: int) -> str:
        hours, mins = divmod(9 * 60 + offset, 60)
        return f"2026-12-08T{hours:02d}:{mins:02d}"
    return {"kind": "once", "start": local(start_min), "end": local(start_min + minutes)}


bookings = st.lists(st.tuples(
    st.integers(1, GPUS), st.integers(0, 60), st.integers(5, 90), st.integers(0, 1800),
    st.booleans(), st.booleans()), min_size=1, max_size=3)
steps = st.lists(st.one_of(
    st.tuples(st.just("ask"), st.sampled_from(USERS), st.integers(0, 3)),
    st.tuples(st.just("release"), st.integers(0, 50), st.integers(0, 0)),
    st.tuples(st.just("wait"), st.integers(1, 600), st.integers(0, 0)),
), min_size=1, max_size=40)


def check(cluster: BookedCluster) -> None:
    engine = cluster.engine
    windows = engine.windows
    for lease_id in windows.booking_of:
        record = engine.leases.get(lease_id)
        assert record is not None and record.state.holds_gpus, lease_id
        assert record.reclaim_at is None and not record.borrowed, lease_id
    active = [g for g in windows.guarantees if g.state is GuaranteeState.ACTIVE]
    assert sum(g.guaranteed for g in active) <= GPUS
    for share in windows.current.active():
        units = sum((engine.leases[i].units for i in share.covered if i in engine.leases),
                    Fraction(0))
        assert units <= share.guarantee.guaranteed


@settings(max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(made=bookings, script=steps)
def test_covered_members_are_never_reclaimed_and_nothing_is_overbooked(
        tmp_path: Path, made: list[tuple[int, int, int, int, bool, bool]],
        script: list[tuple[str, object, int]]) -> None:
    cluster = BookedCluster(tmp_path / str(id(script)), gpus=GPUS)
    for index, (count, start, minutes, lead, by_group, quota) in enumerate(made):
        members = ({"group": "cs101"} if by_group else {"users": sorted(MEMBERS)})
        body = {"name": f"b{index}", **members,
                "gpus": {"model": "NVIDIA GeForce GTX 1070", "count": count},
                "zone": "UTC", "window": _window(start, minutes), "lead_s": lead,
                "quota_applies": quota}
        reply = cluster.send(BookingRequest(op="add", booking=body, by="prof"), ADMIN)
        assert isinstance(reply, BookingReply) or reply.error.code == "collides"
    asked = 0
    for kind, what, extra in script:
        if kind == "ask":
            user = str(what)
            asked += 1
            cluster.send(AllocateRequest(
                request_key=f"hub/{user}/{asked}", user=user,
                groups=["cs101"] if user in MEMBERS else [], count=2 if extra == 3 else 1,
                wait_s=3600 if extra else 0))
        elif kind == "release":
            holding = sorted(cluster.engine.leases)
            if holding:
                lease_id = holding[int(str(what)) % len(holding)]
                cluster.send(ReleaseRequest(lease_id=lease_id))
                if lease_id in cluster.running:
                    cluster.died(lease_id)
        else:
            end = cluster.now + int(str(what))
            while cluster.now < end:
                cluster.until(min(cluster.now + 30.0, end), step=30.0)
                check(cluster)
                for lease_id, record in list(cluster.engine.leases.items()):
                    if record.state is LeaseState.GRANTED and lease_id not in cluster.running:
                        cluster.start(lease_id)  # the hub's container starts
                    elif record.state is LeaseState.RELEASING and lease_id in cluster.running:
                        cluster.died(lease_id)  # the agent stopped it
        check(cluster)
    assert cluster.now >= NINE
