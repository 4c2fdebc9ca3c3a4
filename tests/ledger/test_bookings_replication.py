"""Bookings go through the replicated ledger log like every other row change: a booking an
admin adds on the writer, and its removal, reach a standby's ledger (real broker, real
SQLite files), with their events; an engine that takes over from that ledger holds them; and
a snapshot of the log carries them."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from allocator.config import AllocatorSettings
from allocator.engine import Engine
from allocator.ledger.changes import Changes
from allocator.ledger.log_position import LogPosition
from allocator.ledger.store import Ledger
from allocator.wire.protocol import BookingReply, BookingRequest
from tests.support.booking_engine import ADMIN, NOW, Cluster, lab
from tests.support.common import GTX1070, gpus, wait_until
from tests.support.ledger_log import replica


def rows(path: Path, sql: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute(sql).fetchall()
    finally:
        conn.close()


async def test_a_standby_applies_bookings_added_and_removed_and_takes_over_with_them(
        amqp_vhost, tmp_path: Path) -> None:
    writer_ledger, standby_ledger = tmp_path / "writer.sqlite", tmp_path / "standby.sqlite"
    # The engine's batches, as the active allocator makes them.
    decided = Cluster(tmp_path / "engine.sqlite")
    try:
        def batch(message: BookingRequest) -> Changes:
            changes = Changes()
            reply = decided.engine.handle(message, ADMIN, decided.now, changes)
            assert isinstance(reply, BookingReply), reply
            return changes

        added = batch(BookingRequest(op="add", booking=lab(), by="prof"))
        second = batch(BookingRequest(op="add", by="prof", booking=lab(
            name="ML lab", group="ml", gpus={"model": "1070", "count": 1})))
        removed = batch(BookingRequest(op="remove", name="ML lab", by="prof"))
    finally:
        decided.close()
    async with (replica(amqp_vhost.url, writer_ledger) as writer,
                replica(amqp_vhost.url, standby_ledger) as standby):
        assert await writer.claim() is True
        for changes in (added, second, removed):
            await writer.append(changes)

        async def caught_up() -> bool:
            return (standby.position is not None and writer.position is not None
                    and standby.position.offset == writer.position.offset)
        await wait_until(caught_up, within=10)
    for path in (writer_ledger, standby_ledger):
        assert rows(path, "SELECT name, created_by, removed_at IS NOT NULL FROM bookings "
                          "ORDER BY name") == [("CS101 lab", "prof (admin)", 0),
                                               ("ML lab", "prof (admin)", 1)]
        assert rows(path, "SELECT kind FROM events WHERE kind LIKE 'booking%' ORDER BY id") == [
            ("booking_added",), ("booking_added",), ("booking_removed",)]
    # The standby takes over: an engine loaded from its ledger holds the booking.
    ledger = Ledger(standby_ledger)
    ledger.open()
    try:
        state = ledger.call(ledger.load)
    finally:
        ledger.close()
    settings = AllocatorSettings(ledger_path=standby_ledger, aliases={"1070": GTX1070},
                                 group_quota={"cs101": 4})
    engine = Engine(settings, started_at=NOW)
    engine.load(state, NOW)
    assert [b.name for b in engine.bookings.all()] == ["CS101 lab"]
    assert [(b.name, b.model) for b in engine.bookings.resolved()] == [("CS101 lab", GTX1070)]


def test_a_snapshot_carries_the_bookings(tmp_path: Path) -> None:
    """What a replica that catches up from a snapshot loads: the bookings held and removed,
    replacing its own."""
    source = Cluster(tmp_path / "source.sqlite",
                     hosts={"gpu-a": gpus("gpu-a", GTX1070, 4)})
    try:
        source.add(lab())
        source.add(lab(name="ML lab", group="ml", gpus={"model": "1070", "count": 1}))
        source.booking("remove", name="ML lab")
        position, tables = source.ledger.call(lambda: source.ledger.snapshot_tables(trail=False))
    finally:
        source.close()
    assert "bookings" in tables and len(tables["bookings"].rows) == 2
    target = Ledger(tmp_path / "target.sqlite")
    target.open()
    try:
        stale = Changes()
        stale.bookings["stale"] = {"name": "stale", "booking": {}, "created_at": 1.0,
                                   "created_by": "x"}
        target.call(lambda: target.commit(stale))
        at = position or LogPosition("log", 9, "entry-9", 1, "writer")
        target.call(lambda: target.load_snapshot(tables, at))
        loaded = target.call(target.load)
    finally:
        target.close()
    assert [row.name for row in loaded.bookings] == ["CS101 lab"]
    assert rows(tmp_path / "target.sqlite", "SELECT name FROM bookings ORDER BY name") == [
        ("CS101 lab",), ("ML lab",)]
