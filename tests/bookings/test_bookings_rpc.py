"""Bookings over the real broker: the ``booking`` request (add, list, remove) against a real
allocator and its ledger file, each bad input answered with its one error code while the
consumer keeps serving, admins only, and ``gpu-ledger booking`` against the same allocator."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.config import AllocatorSettings
from allocator.service import AllocatorService
from allocator.wire.protocol import AllocateRequest, ErrorCode, LeaseState
from tests.support.common import GTX1070, RawRPC, gpus, started, wait_until
from tests.support.ledger_cli import assert_one_line_error, gpu_ledger

BERLIN = ZoneInfo("Europe/Berlin")
TOMORROW = (datetime.now(BERLIN) + timedelta(days=1)).date()
YESTERDAY = TOMORROW - timedelta(days=2)


def lab(**changes: Any) -> dict[str, Any]:
    """2 GTX 1070 for cs101 tomorrow 10:00-12:00 in Berlin."""
    body: dict[str, Any] = {
        "name": "CS101 lab", "group": "cs101", "gpus": {"model": "1070", "count": 2},
        "zone": "Europe/Berlin",
        "window": {"kind": "once", "start": f"{TOMORROW}T10:00", "end": f"{TOMORROW}T12:00"},
    }
    body.update(changes)
    return body


def settings(amqp_url: str, ledger_path: Path, admins: list[str]) -> AllocatorSettings:
    return AllocatorSettings(
        amqp_url=amqp_url, ledger_path=ledger_path, allow_any_node_user=True,
        admin_users=admins, tick_s=0.1, start_fence_s=0, aliases={"1070": GTX1070},
        group_quota={"cs101": 4, "ml": 2})


@pytest.fixture
async def booking_allocator(amqp_vhost: Any, ledger_path: Path) -> AsyncIterator[Any]:
    """An allocator where guest (the tests' broker user) is an admin; gpu-a has 4 GTX 1070,
    gpu-b 2."""
    async with started(AllocatorService(settings(amqp_vhost.url, ledger_path,
                                                 ["guest"]))) as service:
        yield service


@pytest.fixture
async def admin(booking_allocator: Any, amqp_vhost: Any, nodes: Any
                ) -> AsyncIterator[AllocatorClient]:
    await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 4))
    await nodes.beat("gpu-b", gpus("gpu-b", GTX1070, 2))
    async with AllocatorClient(amqp_vhost.url, timeout_s=10) as rpc:
        async def both_up() -> bool:
            return sum(node.up for node in (await rpc.inventory()).nodes) == 2
        await wait_until(both_up)
        yield rpc


def ledger_rows(path: Path, sql: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


async def test_add_list_collide_and_remove(admin: AllocatorClient, ledger_path: Path) -> None:
    added = await admin.add_booking(lab(), by="prof", reason="winter term")
    assert added.model == GTX1070 and added.created_by == "prof (guest)"
    assert [o.local_start for o in added.next] == [f"{TOMORROW}T10:00:00"]
    with pytest.raises(AllocatorError) as refused:
        await admin.add_booking(lab(name="ML lab", group="ml",
                                    gpus={"model": "1070", "count": 5}))
    assert refused.value.code is ErrorCode.COLLIDES
    assert refused.value.details["largest_count"] == 4
    assert refused.value.details["collisions"][0]["others"] == ["CS101 lab"]
    await admin.add_booking(lab(name="ML lab", group="ml", gpus={"model": "1070", "count": 4}))
    assert [v.name for v in await admin.bookings()] == ["CS101 lab", "ML lab"]
    removed = await admin.remove_booking("ML lab", by="prof", reason="cancelled")
    assert removed.name == "ML lab"
    assert [v.name for v in await admin.bookings()] == ["CS101 lab"]
    assert ledger_rows(ledger_path, "SELECT kind, json_extract(detail, '$.by') FROM events "
                                    "WHERE kind LIKE 'booking%' ORDER BY id") == [
        ("booking_added", "prof (guest)"), ("booking_added", "admin (guest)"),
        ("booking_removed", "prof (guest)")]


BAD: list[tuple[dict[str, Any], str, str]] = [
    ({"op": "add", "booking": lab(window={"kind": "once", "start": f"{YESTERDAY}T10:00",
                                          "end": f"{YESTERDAY}T12:00"})},
     "window_in_past", "ended"),
    ({"op": "add", "booking": lab(window={"kind": "once", "start": f"{TOMORROW}T12:00",
                                          "end": f"{TOMORROW}T10:00"})},
     "window_ends_before_start", "before it starts"),
    ({"op": "add", "booking": lab(zone="Mars/Olympus")}, "unknown_zone", "Mars/Olympus"),
    ({"op": "add", "booking": lab(group="cs999")}, "unknown_group", "cs101"),
    ({"op": "add", "booking": lab(gpus={"model": "h100", "count": 1})}, "unknown_model",
     GTX1070),
    ({"op": "add", "booking": lab(window={"kind": "weekly", "weekdays": ["tue"],
                                          "start": "10:00", "duration_s": 7200})},
     "recurrence_without_end", "until"),
    ({"op": "add", "booking": lab(gpus={"model": "1070", "count": 7})},
     "count_over_capacity", "has 6"),
    ({"op": "add", "booking": lab(gpus={"model": "1070", "count": "2"})}, "bad_request",
     "count"),
    ({"op": "add", "booking": lab(window={"kind": "once", "start": 1796000000,
                                          "end": 1796007200})}, "bad_request", "ISO 8601"),
    ({"op": "add", "booking": "CS101 lab"}, "bad_request", "booking"),
    ({"op": "add"}, "bad_request", "op add"),
    ({"op": "remove"}, "bad_request", "op remove"),
    ({"op": "rename", "name": "x"}, "bad_request", "op"),
    ({"op": "remove", "name": "no such lab"}, "not_found", "no booking"),
]


async def test_each_bad_booking_gets_its_error_and_the_consumer_stays_up(
        admin: AllocatorClient, amqp_vhost: Any, ledger_path: Path) -> None:
    async with RawRPC(amqp_vhost.url) as raw:
        for fields, code, words in BAD:
            await raw.send(json.dumps({"v": 1, "kind": "booking", **fields}).encode(),
                           user_id="guest")
            reply = await raw.reply()
            assert reply["ok"] is False, (fields, reply)
            error = reply["error"]
            assert isinstance(error, dict)
            assert (error["code"], words in error["message"]) == (code, True), (fields, error)
    # Nothing of it was kept, and the consumer serves as before.
    assert await admin.bookings() == []
    assert ledger_rows(ledger_path, "SELECT count(*) FROM bookings") == [(0,)]
    lease = await admin.allocate(AllocateRequest(request_key="k/bob/", user="bob"))
    assert lease.state is LeaseState.GRANTED
    assert (await admin.add_booking(lab())).name == "CS101 lab"


async def test_only_admins_manage_bookings(amqp_vhost: Any, ledger_path: Path,
                                           nodes: Any) -> None:
    async with started(AllocatorService(settings(amqp_vhost.url, ledger_path, ["admin"]))):
        await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 4))
        async with AllocatorClient(amqp_vhost.url, timeout_s=10) as guest:
            for call in (guest.add_booking(lab()), guest.bookings(),
                         guest.remove_booking("CS101 lab")):
                with pytest.raises(AllocatorError) as refused:
                    await call
                assert refused.value.code is ErrorCode.FORBIDDEN
                assert "admin_users" in refused.value.message
    assert ledger_rows(ledger_path, "SELECT count(*) FROM bookings") == [(0,)]


async def test_gpu_ledger_booking_add_list_remove(admin: AllocatorClient, amqp_vhost: Any,
                                                  tmp_path: Path) -> None:
    common = ("--amqp", amqp_vhost.url, "--by", "prof")
    until = TOMORROW + timedelta(days=21)
    weekday = TOMORROW.strftime("%a").lower()
    added = await gpu_ledger("booking", "add", "--name", "CS101 lab", "--group", "cs101",
                             "--model", "1070", "--count", "4", "--zone", "Europe/Berlin",
                             "--weekly", weekday, "--at", "10:00", "--duration", "2h",
                             "--until", str(until), "--lead", "15m", *common)
    assert added.rc == 0, added
    assert "booking 'CS101 lab' added" in added.out and f"until {until}" in added.out
    assert f"next: {TOMORROW} 10:00" in added.out and "warned 15 min before" in added.out
    # A file (TOML: its dates and times unquoted) that collides: what collides, what fits.
    toml = tmp_path / "ml.toml"
    toml.write_text(f"""name = "ML lab"
group = "ml"
zone = "Europe/Berlin"
gpus = {{ model = "1070", count = 3 }}
[window]
kind = "once"
start = {TOMORROW}T11:00:00
end = {TOMORROW}T13:00:00
""")
    refused = await gpu_ledger("booking", "add", "--file", toml, *common)
    assert refused.rc == 2, refused
    assert "1 of 1 occurrence(s) collide" in refused.err
    assert f"{TOMORROW} 11:00: 1 GPU(s) short, next to CS101 lab" in refused.err
    assert "would fit: --count 2" in refused.err
    assert refused.err.strip().splitlines()[-1].startswith(
        "gpu-ledger: error: collides: Booking 'ML lab' does not fit")
    toml.write_text(toml.read_text().replace("count = 3", "count = 2"))
    assert (await gpu_ledger("booking", "add", "--file", toml, *common)).rc == 0
    listed = await gpu_ledger("booking", "list", "--json", *common)
    assert listed.rc == 0, listed
    assert [(b["name"], b["booking"]["lead_s"]) for b in listed.json()] == [
        ("CS101 lab", 900), ("ML lab", None)]
    text = await gpu_ledger("booking", "list", *common)
    assert "CS101 lab: 4 x NVIDIA GeForce GTX 1070 for group cs101" in text.out
    assert (await gpu_ledger("booking", "remove", "ML lab", *common)).out.strip() == \
        "booking 'ML lab' removed"
    assert_one_line_error(await gpu_ledger("booking", "remove", "ML lab", *common),
                          "no booking 'ML lab'")
    assert_one_line_error(await gpu_ledger("booking", "add", "--name", "x", *common),
                          "--model", "--zone")
    assert_one_line_error(
        await gpu_ledger("booking", "add", "--name", "CS102", "--group", "cs101", "--model",
                         "1070", "--count", "1", "--zone", "Europe/Berlin", "--weekly", "tue",
                         "--at", "10:00", "--duration", "2h", *common),
        "until")
    assert [v.name for v in await admin.bookings()] == ["CS101 lab"]
