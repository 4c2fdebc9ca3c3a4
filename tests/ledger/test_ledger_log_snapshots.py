"""Snapshots of the replicated ledger log on the real broker, with real SQLite ledgers: the
stream is given tiny segments and retention so that RabbitMQ really drops its oldest entries,
and a replica that is new, or was offline meanwhile, catches up from the newest snapshot. A
snapshot of a deposed writer is ignored by everyone; a ledger of another log is still
refused. (Whole allocator processes: tests/faults/test_fault_ledger_log.py; the pure rules:
tests/ledger/test_log_snapshot.py.)"""

from __future__ import annotations

import asyncio
import json
import logging
import sqlite3
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any

import aio_pika

from allocator.ledger.change_set import ChangeSet
from allocator.ledger.changes import Changes
from allocator.ledger.log_entries import Batch, SnapshotPart
from allocator.ledger.log_position import LogPosition
from allocator.ledger.log_snapshot import AsOf, PartHeader, encode_parts
from allocator.ledger.replication import ReplicatedLog
from allocator.ledger.store import Ledger
from allocator.metrics import exporter as metrics
from tests.support.common import wait_until
from tests.support.faults import Proxy, first_kept_offset
from tests.support.ledger_log import STREAM, batch, lease_ids, replica

TINY: dict[str, Any] = {"max_bytes": 64 << 10, "segment_bytes": 4 << 10,
                        "snapshot_bytes": 12 << 10, "snapshot_part_bytes": 1 << 10}
"""Retention of 64 KiB in 4 KiB segments, a snapshot every 12 KiB in parts of 1 KiB: a few
hundred batches make RabbitMQ drop segments, and every snapshot has several parts (some
across a segment's end, where RabbitMQ gives an offset to a chunk of its own)."""
LEASES = 20
BATCHES = 400


def update(n: int) -> Changes:
    """Batch ``n``: one of a few leases changes state, with a line of history and an event
    (the trail grows the log; the state stays small)."""
    lease_id = f"lease-{n % LEASES}"
    changes = Changes()
    changes.leases[lease_id] = {
        "lease_id": lease_id, "request_key": f"hub/{lease_id}/", "user": f"user{n % 7}",
        "state": ("queued", "granted", "bound", "released")[n % 4], "created_at": float(n),
        "groups": ["g"], "request": {"count": 1}, "gpu_uuids": [f"GPU-{n % 8}"], "env": {}}
    changes.history.append({"lease_id": lease_id, "at": float(n), "from_state": None,
                            "to_state": "queued", "reason": "test", "by": ""})
    changes.event(float(n), "test", lease_id=lease_id, padding="p" * 300)
    return changes


async def write(writer: ReplicatedLog, changes: Changes) -> None:
    """One batch, then a snapshot if one is due: what the service does after each batch."""
    await writer.append(changes)
    if writer.snapshot_due():
        taken = await writer.take_snapshot()
        assert taken.whole and taken.parts > 1, taken


def caught_up(follower: ReplicatedLog, writer: ReplicatedLog) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return follower.position is not None and writer.position is not None \
            and follower.position.offset == writer.position.offset
    return check


def rows(path: Path, sql: str) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(path)
    try:
        return [tuple(row) for row in conn.execute(sql)]
    finally:
        conn.close()


def state(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    """Every node, GPU and lease row: what a replica serves from."""
    return {table: rows(path, f"SELECT * FROM {table} ORDER BY 1")
            for table in ("nodes", "gpus", "leases")}


def trail(path: Path) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    """The lease history and the events, without their row ids."""
    return (rows(path, "SELECT lease_id, at, from_state, to_state, reason, by "
                       "FROM lease_history ORDER BY id"),
            rows(path, "SELECT at, kind, host, lease_id, user, gpu_uuid, detail "
                       "FROM events ORDER BY id"))


def event_kinds(path: Path) -> list[str]:
    return [kind for (kind,) in rows(path, "SELECT kind FROM events ORDER BY id")]


async def test_a_new_empty_replica_catches_up_from_the_newest_snapshot_after_truncation(
        amqp_vhost, tmp_path: Path) -> None:
    url = amqp_vhost.url
    async with replica(url, tmp_path / "a.sqlite", **TINY) as a:
        await a.claim()
        for n in range(BATCHES):
            await write(a, update(n))
        await a.append(update(BATCHES))  # the newest entry: a batch naming the newest snapshot
        assert await first_kept_offset(url) > 0, "RabbitMQ dropped the log's oldest segments"
        assert a.snapshots_taken >= 3
        assert a.last_snapshot is not None and a.last_snapshot.whole
        figures = {family.name: family.samples[0].value
                   for family in metrics.log_families(metrics.log_figures(a))}
        assert figures["swarm_gpu_ledger_log_snapshots_taken"] == a.snapshots_taken
        assert figures["swarm_gpu_ledger_log_last_snapshot_bytes"] == \
            a.last_snapshot.stored_bytes > 0
        async with replica(url, tmp_path / "new.sqlite", **TINY) as new:
            await wait_until(caught_up(new, a), within=30)
            assert new.mismatch is None and new.snapshots_loaded == 1
            assert {family.name: family.samples[0].value for family in
                    metrics.log_families(metrics.log_figures(new))
                    }["swarm_gpu_ledger_log_snapshots_loaded"] == 1
            assert new.position is not None and a.position is not None
            assert new.position.snapshot_from == a.position.snapshot_from, \
                "it loaded the newest snapshot"
            assert new.entries_applied * 10 < a.entries_applied, \
                "it replayed only what follows the snapshot"
            await write(a, update(BATCHES + 1))  # and it goes on following
            await wait_until(caught_up(new, a), within=10)
    assert state(tmp_path / "new.sqlite") == state(tmp_path / "a.sqlite")
    assert len(state(tmp_path / "new.sqlite")["leases"]) == LEASES
    # Its trail starts at the snapshot, and says so.
    history, _ = trail(tmp_path / "new.sqlite")
    assert 0 < len(history) < BATCHES / 4
    assert event_kinds(tmp_path / "new.sqlite")[0] == "log_snapshot_loaded"


class DropWhenSnapshotFound(logging.Handler):
    """Breaks the catching-up replica's broker link (``proxy``) the moment it has found where
    the newest snapshot starts, before it moves its consumer there."""

    def __init__(self, proxy: Proxy) -> None:
        super().__init__()
        self.proxy, self.dropped = proxy, 0

    def emit(self, record: logging.LogRecord) -> None:
        if not self.dropped and "the newest snapshot starts at offset" in record.getMessage():
            self.proxy.drop()
            self.dropped += 1


async def test_a_replica_catching_up_when_its_broker_connection_drops_still_catches_up(
        amqp_vhost, tmp_path: Path) -> None:
    url = amqp_vhost.url
    replication_log = logging.getLogger("allocator.ledger.replication")
    async with replica(url, tmp_path / "a.sqlite", **TINY) as a:
        await a.claim()
        for n in range(BATCHES):
            await write(a, update(n))
        await a.append(update(BATCHES))
        assert await first_kept_offset(url) > 0, "RabbitMQ dropped the log's oldest segments"
        proxy = Proxy(lambda: asyncio.open_connection(amqp_vhost.broker.host,
                                                      amqp_vhost.broker.port))
        port = await proxy.serve_tcp()
        through_proxy = url.replace(f":{amqp_vhost.broker.port}/", f":{port}/", 1)
        assert through_proxy != url
        dropper = DropWhenSnapshotFound(proxy)
        replication_log.addHandler(dropper)
        level = replication_log.level
        replication_log.setLevel(logging.INFO)
        try:
            async with replica(f"{through_proxy}?reconnect_interval=0.5",
                               tmp_path / "new.sqlite", **TINY) as new:
                await wait_until(caught_up(new, a), within=30)
                assert dropper.dropped == 1, "the connection was dropped while catching up"
                assert new.mismatch is None, new.mismatch
                assert new.snapshots_loaded == 1
                await write(a, update(BATCHES + 1))  # and it goes on following
                await wait_until(caught_up(new, a), within=20)
        finally:
            replication_log.removeHandler(dropper)
            replication_log.setLevel(level)
            await proxy.close()
    assert state(tmp_path / "new.sqlite") == state(tmp_path / "a.sqlite")


async def test_a_replica_offline_while_the_log_was_truncated_catches_up_and_keeps_its_trail(
        amqp_vhost, tmp_path: Path) -> None:
    url = amqp_vhost.url
    path_a, path_b = tmp_path / "a.sqlite", tmp_path / "b.sqlite"
    async with replica(url, path_a, **TINY) as a, replica(url, path_b, **TINY) as b:
        await a.claim()
        for n in range(30):
            await write(a, update(n))
        await wait_until(caught_up(b, a), within=10)
        assert b.position is not None
        left_at = b.position.offset
    history_before, _ = trail(path_b)
    async with replica(url, path_a, **TINY) as a:
        await a.claim()  # a new process: epoch 2
        for n in range(30, BATCHES):
            await write(a, update(n))
        await a.append(update(BATCHES))
        assert await first_kept_offset(url) > left_at, "b's place in the log is gone"
        async with replica(url, path_b, **TINY) as b:
            await wait_until(caught_up(b, a), within=30)
            assert b.mismatch is None and b.snapshots_loaded == 1
            assert b.position is not None and b.position.epoch == 2
            # It can take over: its claim follows the log it caught up with.
            assert await b.claim() is False
            await write(b, update(BATCHES + 1))
            await wait_until(caught_up(a, b), within=10)
    assert state(path_b) == state(path_a)
    history, _ = trail(path_b)
    assert history[:len(history_before)] == history_before, "its own trail is kept"
    assert "log_snapshot_loaded" in event_kinds(path_b)

    # A ledger of another log whose place is gone as well is still refused.
    another = Ledger(tmp_path / "another.sqlite")
    another.open()
    another.call(lambda: another.commit(batch("someone-else"), position=LogPosition(
        "another-log", left_at, "its-entry", 1, "its-writer")))
    another.close()
    async with replica(url, tmp_path / "another.sqlite", **TINY) as stranger:
        assert await asyncio.wait_for(stranger.mismatch_event.wait(), 10) is True
        assert "not the history" in str(stranger.mismatch)
        assert stranger.snapshots_loaded == 0
    assert lease_ids(tmp_path / "another.sqlite") == ["someone-else"], "nothing applied to it"


async def test_a_snapshot_of_a_deposed_writer_is_ignored_by_followers_and_by_a_new_replica(
        amqp_vhost, tmp_path: Path) -> None:
    """a writes, with snapshots; b claims the log (a is deposed). Then what a deposed writer's
    snapshot in flight looks like lands: its tables read at a's place before b's claim (with
    a lease nobody granted), its parts after the claim, and a late batch of a's naming it as
    the newest snapshot, the stream's newest entry. b skips all of it; a new replica that
    follows that pointer finds the claim where the parts should be, and loads a's last
    snapshot from before the claim instead."""
    url = amqp_vhost.url
    async with replica(url, tmp_path / "a.sqlite", **TINY) as a, \
            replica(url, tmp_path / "b.sqlite", **TINY) as b:
        await a.claim()
        for n in range(BATCHES):
            await write(a, update(n))
        await a.append(update(BATCHES))
        await wait_until(caught_up(b, a), within=20)
        stale = a.position
        assert stale is not None and stale.snapshot_from is not None
        assert await first_kept_offset(url) > 0
        assert await b.claim() is False  # epoch 2

        _, tables = a.ledger.call(lambda: a.ledger.snapshot_tables(trail=False))
        tables["leases"].rows.append([*tables["leases"].rows[0]])
        tables["leases"].rows[-1][tables["leases"].columns.index("lease_id")] = "forged"
        payloads = encode_parts(tables, TINY["snapshot_part_bytes"])
        as_of = AsOf(offset=stale.offset, entry_id=stale.entry_id, epoch=1, writer=a.writer_id)
        parts = [SnapshotPart(log_id=stale.log_id, entry_id=f"forged-part-{number}", epoch=1,
                              writer=a.writer_id, snapshot_from=stale.snapshot_from,
                              payload=payload,
                              snapshot=PartHeader(id="forged", part=number,
                                                  parts=len(payloads), as_of=as_of))
                 for number, payload in enumerate(payloads)]
        late = Batch(log_id=stale.log_id, entry_id="forged-late", epoch=1, writer=a.writer_id,
                     changes=ChangeSet.of(batch("forged-late")), snapshot_from=stale.offset)
        connection = await aio_pika.connect(url, timeout=10)
        async with connection:
            channel = await connection.channel()
            for forged in (*parts, late):
                await channel.default_exchange.publish(
                    aio_pika.Message(body=forged.encode()), routing_key=STREAM)

        async def b_read_them() -> bool:
            return b.entries_fenced == len(parts) + 1
        await wait_until(b_read_them, within=10)
        assert len(parts) > 1
        async with replica(url, tmp_path / "new.sqlite", **TINY) as new:
            await wait_until(caught_up(new, b), within=30)
            assert new.mismatch is None and new.snapshots_loaded == 1
            assert new.position is not None and b.position is not None
            assert new.position.snapshot_from == b.position.snapshot_from == \
                stale.snapshot_from, "a's last snapshot from before b's claim"
            assert new.entries_fenced >= len(parts) + 1
            await write(b, update(BATCHES + 1))  # b's batches are the ones it applies
            await wait_until(caught_up(new, b), within=10)
            assert (new.position.epoch, new.position.writer) == (2, b.writer_id)
    for name in ("b", "new"):
        ids = lease_ids(tmp_path / f"{name}.sqlite")
        assert "forged" not in ids and "forged-late" not in ids
    assert state(tmp_path / "new.sqlite") == state(tmp_path / "b.sqlite")


async def test_a_ledger_with_data_that_starts_the_log_seeds_every_replica_with_all_of_it(
        amqp_vhost, tmp_path: Path) -> None:
    """The snapshot right after the genesis claim carries the trail too (the log's only copy
    of it); every other replica loads it, and its writer's own ledger is left as it was."""
    url = amqp_vhost.url
    seeded = Ledger(tmp_path / "seeded.sqlite")
    seeded.open()
    for n in range(60):
        seeded.call(partial(seeded.commit, update(n)))
    seeded.close()
    before = state(tmp_path / "seeded.sqlite"), trail(tmp_path / "seeded.sqlite")
    async with replica(url, tmp_path / "seeded.sqlite", snapshot_part_bytes=2048) as a:
        assert await a.claim() is True
        await a.append(update(60))
        async with replica(url, tmp_path / "empty.sqlite") as b:
            await wait_until(caught_up(b, a), within=10)
            assert b.mismatch is None
    history, events = trail(tmp_path / "seeded.sqlite")
    assert (history[:-1], events[:-1]) == before[1], "the writer's trail, once, then batch 60"
    assert state(tmp_path / "empty.sqlite") == state(tmp_path / "seeded.sqlite")
    assert trail(tmp_path / "empty.sqlite") == trail(tmp_path / "seeded.sqlite")
    assert json.loads(events[0][-1])["padding"], "events whole, details included"


async def test_a_replica_whose_retention_settings_differ_from_the_streams_follows_it(
        amqp_vhost, tmp_path: Path, caplog) -> None:
    """Retention is fixed when the stream is declared (an operator raises it by policy); a
    replica started with other values says so and follows the stream as it is."""
    url = amqp_vhost.url
    async with replica(url, tmp_path / "a.sqlite", **TINY) as a:
        await a.claim()
        await write(a, update(0))
        async with replica(url, tmp_path / "b.sqlite",
                           **{**TINY, "max_bytes": 128 << 10, "segment_bytes": 8 << 10}) as b:
            await wait_until(caught_up(b, a), within=10)
            assert b.mismatch is None
    assert "the stream was declared with other retention" in caplog.text
    assert state(tmp_path / "b.sqlite") == state(tmp_path / "a.sqlite")
