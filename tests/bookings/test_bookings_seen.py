"""What users see of bookings: the inventory's ``bookings`` (built by
``allocator.bookings.schedule``) and what ``allocator.bookings.outlook`` reads in it for one
user (theirs, and what others' take back soon); over the real broker, the field for a 0.3.0
client and never for a 0.2.0 or 0.1.0 one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from allocator.amqp.client import AllocatorClient
from allocator.bookings.in_effect import Held
from allocator.bookings.outlook import is_member, outlook_for, window_text
from allocator.bookings.schedule import SOON_S, WEEK_S, bookings_view
from allocator.wire.protocol import (
    CLIENT_RELEASE_HEADER,
    AllocateRequest,
    BookingsView,
    InventoryReply,
    LeaseState,
)
from tests.support.bookings_seen import BERLIN, CS101, FOUR, LATER, ML, NINE, WEEKLY, held
from tests.support.common import GTX1070, NodeSimulator, gpus, started, wait_until
from tests.support.raw_client import RawClient


def view(free: int, holding: list[Held], now: float = NINE) -> BookingsView:
    return bookings_view([CS101, ML, WEEKLY, LATER], now, FOUR, holding,
                         {(GTX1070, "gpu-a"): free})


def test_the_week_each_booking_its_windows_in_utc_and_on_its_zones_clock() -> None:
    found = {b.name: b for b in view(free=3, holding=[]).bookings}
    assert list(found) == ["CS101 lab", "ML lab", "Thesis", "Exam"]
    cs101 = found["CS101 lab"]
    assert cs101.in_effect and cs101.group == "cs101" and cs101.count == 2
    assert [(w.local_start, w.local_end) for w in cs101.windows] == [
        ("2026-12-08T08:30:00", "2026-12-08T12:00:00")]
    assert cs101.windows[0].start == NINE - 1800
    assert window_text(cs101.windows[0]) == "Tue 2026-12-08 08:30\u201312:00"
    # Thursday 10th and Monday 14th fall in the week from Tuesday 09:00; Thursday 17th not.
    assert [w.local_start for w in found["Thesis"].windows] == [
        "2026-12-10T14:00:00", "2026-12-14T14:00:00"]
    assert found["Thesis"].users == ["carol"] and found["Thesis"].group is None
    # Beyond the week: its next window only.
    assert [w.local_start for w in found["Exam"].windows] == ["2026-12-22T09:00:00"]
    assert not found["Exam"].in_effect and found["Exam"].takes_back_at is None


def test_what_a_booking_takes_back_soon_and_what_stays_spare() -> None:
    # 3 of 4 free; nobody of cs101 or ml holds one: CS101 (in effect) needs 2 now, ML 2 at
    # 10:00. Taking more than 1 now may be reclaimed for CS101; any at all for ML at 10:00.
    found = {b.name: b for b in view(free=3, holding=[held("L-bob", "bob", ())]).bookings}
    assert (found["CS101 lab"].takes_back_at, found["CS101 lab"].spare) == (NINE, 1)
    assert (found["ML lab"].takes_back_at, found["ML lab"].spare) == (NINE + 3600, 0)
    assert found["CS101 lab"].guaranteed == 2 and found["ML lab"].guaranteed == 2
    # Thursday's Thesis window is beyond SOON_S: nothing taken back for it yet.
    assert found["Thesis"].takes_back_at is None and SOON_S < 2 * 86400
    # Two members of cs101 hold GPUs: CS101 has no room left and takes nothing back.
    members = [held("L-a", "alice", ("cs101",)), held("L-d", "dave", ("cs101",))]
    found = {b.name: b for b in view(free=2, holding=members).bookings}
    assert found["CS101 lab"].takes_back_at is None
    assert (found["ML lab"].takes_back_at, found["ML lab"].spare) == (NINE + 3600, 0)


def test_a_member_sees_their_booking_and_others_see_what_it_takes_back() -> None:
    reply = view(free=3, holding=[])
    alice = outlook_for(reply, "alice", ["cs101"], NINE)
    assert [b.name for b in alice.mine] == ["CS101 lab", "Exam"]
    booked = alice.booked_for(GTX1070)
    assert booked is not None and booked.text(NINE) == "booked for CS101 lab until 12:00"
    assert alice.take_back_for(GTX1070, 2.0) is None, "her own booking covers 2 GPUs"
    beyond = alice.take_back_for(GTX1070, 4.0)  # 4 GPUs are more than her booking's 2
    assert beyond is not None and beyond.schedule.name == "ML lab", beyond
    bob = outlook_for(reply, "bob", ["students"], NINE)
    assert bob.mine == [] and bob.booked_for(GTX1070) is None
    # One GPU: CS101 (now) leaves 1 spare, ML (at 10:00) none; two: CS101 already.
    taken = bob.take_back_for(GTX1070, 1.0)
    assert taken is not None and taken.text(NINE) == "reclaimable at 10:00 for a booking"
    taken = bob.take_back_for(GTX1070, 2.0)
    assert taken is not None and taken.text(NINE) == "reclaimable now for a booking"
    assert [t.schedule.name for t in bob.take_backs] == ["CS101 lab", "ML lab"]
    # ML's members: ML is theirs and starts within SOON_S; CS101 takes back beyond 1 GPU.
    ml = outlook_for(reply, "erin", ["ml"], NINE)
    booked = ml.booked_for(GTX1070)
    assert booked is not None and booked.text(NINE) == "booked for ML lab from 10:00 to 11:30"
    carol = outlook_for(reply, "carol", [], NINE)
    assert [b.name for b in carol.mine] == ["Thesis"] and carol.booked == []
    cs101_only = outlook_for(reply.model_copy(update={"bookings": reply.bookings[:1]}),
                             "bob", [], NINE)
    (taken_back,) = cs101_only.take_backs
    assert not taken_back.applies(1.0) and taken_back.applies(2.0) and taken_back.applies(None)
    assert taken_back.model_text(NINE) == "beyond 1 GPU, reclaimable now for a booking"
    assert is_member(reply.bookings[2], "carol", ["cs101"])
    assert not is_member(reply.bookings[2], "alice", ["cs101"])
    assert outlook_for(None, "bob", [], NINE).mine == []


def test_a_later_start_reads_at_its_time_on_the_zones_clock() -> None:
    early = NINE - 2 * 3600  # 07:00 Berlin: CS101 starts at 08:30
    reply = view(free=4, holding=[], now=early)
    bob = outlook_for(reply, "bob", [], early)
    (first, *_) = bob.take_backs
    assert first.schedule.name == "CS101 lab" and first.at == NINE - 1800
    assert first.text(early) == "reclaimable at 08:30 for a booking"
    assert reply.week_from == int(early) and reply.week_to == int(early) + WEEK_S


# ------------------------------------------------------------------ over the real broker


@pytest.fixture
async def allocator(amqp_vhost: Any, ledger_path: Path) -> AsyncIterator[Any]:
    """guest (the tests' broker user) is an admin; groups cs101 and ml are known."""
    from allocator.config import AllocatorSettings
    from allocator.service import AllocatorService

    async with started(AllocatorService(AllocatorSettings(
        amqp_url=amqp_vhost.url, ledger_path=ledger_path, allow_any_node_user=True,
        admin_users=["guest"], tick_s=0.1, start_fence_s=0, aliases={"1070": GTX1070},
        group_quota={"cs101": 4, "ml": 4}))) as service:
        yield service


async def test_the_inventory_carries_the_bookings_to_a_0_3_0_client_only(
        allocator: Any, amqp_vhost: Any, nodes: NodeSimulator,
        monkeypatch: pytest.MonkeyPatch) -> None:
    await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 4))
    now = datetime.now(BERLIN).replace(second=0, microsecond=0, tzinfo=None)
    window = {"kind": "once", "start": now.isoformat(),
              "end": (now + timedelta(hours=2)).isoformat()}
    soon = {"kind": "once", "start": (now + timedelta(hours=1)).isoformat(),
            "end": (now + timedelta(hours=3)).isoformat()}
    async with AllocatorClient(amqp_vhost.url, timeout_s=10) as admin:
        async def up() -> bool:
            return any(node.up for node in (await admin.inventory()).nodes)
        await wait_until(up)
        for name, group, when in (("CS101 lab", "cs101", window), ("ML lab", "ml", soon)):
            await admin.add_booking({"name": name, "group": group, "zone": "Europe/Berlin",
                                     "gpus": {"model": "1070", "count": 2}, "window": when})
        bob = await admin.allocate(AllocateRequest(request_key="hub/bob/", user="bob",
                                                   model="1070"))
        assert bob.state is LeaseState.GRANTED
    # A client that says it reads 0.3.0 gets them; 0.2.0 and 0.1.0 (no header) do not.
    monkeypatch.setattr("allocator.amqp.client.__version__", "0.2.0")  # the client of 0.2.0
    async with AllocatorClient(amqp_vhost.url, timeout_s=10) as older:
        assert (await older.inventory()).bookings is None
    for headers, reads in ((None, False), ({CLIENT_RELEASE_HEADER: "0.2.0"}, False),
                           ({CLIENT_RELEASE_HEADER: "0.3.0"}, True)):
        async with RawClient(amqp_vhost.url, headers) as raw:
            body = await raw.call(kind="inventory")
            assert body["ok"] is True and ("bookings" in body) is reads, (headers, body)
    monkeypatch.setattr("allocator.amqp.client.__version__", "0.3.0")
    async with AllocatorClient(amqp_vhost.url, timeout_s=10) as hub:
        reply = await hub.inventory()
    assert isinstance(reply, InventoryReply) and reply.bookings is not None
    found = {b.name: b for b in reply.bookings.bookings}
    assert found["CS101 lab"].in_effect and not found["ML lab"].in_effect
    # 3 of 4 free (bob holds one): CS101 needs 2 now (1 spare), ML 2 more in an hour.
    assert found["CS101 lab"].spare == 1 and found["ML lab"].spare == 0
    assert found["CS101 lab"].takes_back_at == pytest.approx(reply.at, abs=1)
    assert found["ML lab"].takes_back_at == datetime.fromisoformat(
        soon["start"]).replace(tzinfo=BERLIN).timestamp()
    alice = outlook_for(reply.bookings, "alice", ["cs101"], reply.at)
    booked = alice.booked_for(GTX1070)
    assert booked is not None
    end = now + timedelta(hours=2)
    until = f"{end:%H:%M}" if end.date() == now.date() else f"{end:%a %H:%M}"  # after 22:00
    assert booked.text(reply.at) == f"booked for CS101 lab until {until}"
    taken = outlook_for(reply.bookings, "carol", [], reply.at).take_back_for(GTX1070, 2.0)
    assert taken is not None and taken.text(reply.at) == "reclaimable now for a booking"
