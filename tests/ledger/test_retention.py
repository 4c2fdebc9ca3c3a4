"""Retention on a real ledger file: rows older than the window go, in bounded steps; newer
rows, active leases and their history stay; and a running allocator prunes by itself."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from allocator.config import AllocatorSettings
from allocator.ledger import retention
from allocator.ledger.store import Ledger
from allocator.metrics.counters import Count, Counters
from allocator.service import AllocatorService
from tests.support.common import wait_until

T = TypeVar("T")

NOW = 1_900_000_000.0
DAY = retention.DAY_S
WINDOW_DAYS = 400.0
OLD = NOW - (WINDOW_DAYS + 10) * DAY
"""Before the window: pruned."""
RECENT = NOW - (WINDOW_DAYS - 10) * DAY
"""Inside the window: kept."""


def lease_row(lease_id: str, state: str, created_at: float,
              released_at: float | None) -> tuple[object, ...]:
    return (lease_id, f"hub/{lease_id}/", "alice", state, created_at, released_at, "{}", "[]",
            "{}")


def history_rows(lease_id: str, at: float, count: int = 3) -> list[tuple[object, ...]]:
    return [(lease_id, at + i, "queued", "granted", "r", "test") for i in range(count)]


def fill(conn: sqlite3.Connection) -> None:
    """Old and recent events; finished leases old and recent; an active lease created long
    ago; history of a lease the ledger no longer holds (a snapshot load leaves such)."""
    with conn:
        conn.executemany(
            "INSERT INTO events (at, kind, host, detail) VALUES (?, ?, ?, ?)",
            [(OLD + i, "heartbeat_rejected", "gpu-b", json.dumps({"from_user": "agent-gpu-a"}))
             for i in range(25)]
            + [(RECENT + i, "node_up", "gpu-a", None) for i in range(5)])
        conn.executemany(
            "INSERT INTO leases (lease_id, request_key, user, state, created_at, released_at, "
            "request, gpu_uuids, env) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [lease_row(f"old-{i}", "released", OLD - DAY, OLD) for i in range(7)]
            + [lease_row("old-expired", "expired", OLD - DAY, OLD)]
            # Created before the window, ended inside it: its whole history is kept.
            + [lease_row("ended-recently", "released", OLD - DAY, RECENT)]
            + [lease_row("held-for-long", "bound", OLD - DAY, None)])
        history = [row for i in range(7) for row in history_rows(f"old-{i}", OLD - DAY)]
        history += history_rows("old-expired", OLD - DAY)
        history += history_rows("ended-recently", OLD - DAY)
        history += history_rows("held-for-long", OLD - DAY)
        history += history_rows("gone-in-a-snapshot", OLD - DAY)
        history += history_rows("gone-recently", RECENT)
        conn.executemany("INSERT INTO lease_history (lease_id, at, from_state, to_state, "
                         "reason, by) VALUES (?, ?, ?, ?, ?, ?)", history)


@pytest.fixture
def ledger(ledger_path: Path) -> Iterator[Ledger]:
    ledger = Ledger(ledger_path)
    ledger.open()
    try:
        yield ledger
    finally:
        ledger.close()


def rows(ledger: Ledger, sql: str) -> list[tuple[object, ...]]:
    return ledger.call(lambda: ledger.db.conn.execute(sql).fetchall())


async def test_rows_older_than_the_window_go_in_bounded_steps(ledger: Ledger) -> None:
    ledger.call(lambda: fill(ledger.db.conn))
    deleted_per_step: list[int] = []

    async def run(step: Callable[[sqlite3.Connection], T]) -> T:
        def counted() -> T:
            conn = ledger.db.conn
            before = conn.total_changes
            result = step(conn)
            deleted_per_step.append(conn.total_changes - before)
            return result
        return await ledger.run(counted)

    batch = 4
    cutoff = retention.cutoff_for(NOW, WINDOW_DAYS)
    assert cutoff == NOW - WINDOW_DAYS * DAY
    pruned = await retention.prune(run, cutoff, batch, pause_s=0)

    assert pruned == retention.Pruned(events=25, leases=8, history=27)
    assert rows(ledger, "SELECT kind, count(*) FROM events GROUP BY kind") == [("node_up", 5)]
    assert rows(ledger, "SELECT lease_id FROM leases ORDER BY lease_id") == [
        ("ended-recently",), ("held-for-long",)]
    assert rows(ledger, "SELECT lease_id, count(*) FROM lease_history GROUP BY lease_id "
                "ORDER BY lease_id") == [("ended-recently", 3), ("gone-recently", 3),
                                         ("held-for-long", 3)]
    # Bounded: no step deleted more than the batch of events, or the batch of leases with
    # their history (3 rows each here), so events alone took 7 steps.
    assert sum(deleted_per_step) == 25 + 8 + 27
    assert max(deleted_per_step) <= batch * (1 + 3), deleted_per_step
    assert len(deleted_per_step) >= -(-25 // batch) + -(-8 // batch), deleted_per_step


async def test_a_second_prune_finds_nothing_and_zero_keeps_everything(ledger: Ledger) -> None:
    ledger.call(lambda: fill(ledger.db.conn))

    async def always() -> bool:
        return True

    counters = Counters()
    pruner = retention.Pruner(ledger, counters, retention_days=WINDOW_DAYS, interval_s=3600,
                              batch=10, clock=lambda: NOW, may_prune=always)
    assert (await pruner.prune_once()).rows == 25 + 8 + 27
    assert (await pruner.prune_once()).rows == 0
    assert counters[Count.LEDGER_ROWS_PRUNED.value] == 25 + 8 + 27

    def old_events(conn: sqlite3.Connection) -> None:
        with conn:
            conn.executemany("INSERT INTO events (at, kind) VALUES (?, 'node_down')",
                             [(OLD + i,) for i in range(25)])
    ledger.call(lambda: old_events(ledger.db.conn))
    assert retention.cutoff_for(NOW, 0) is None
    forever = retention.Pruner(ledger, counters, retention_days=0, interval_s=0.01,
                               batch=10, clock=lambda: NOW, may_prune=always)
    await forever.run()  # returns at once: there is never anything to prune
    assert (await forever.prune_once()).rows == 0
    assert rows(ledger, "SELECT kind, count(*) FROM events GROUP BY kind") == [
        ("node_down", 25), ("node_up", 5)]


async def test_a_running_allocator_prunes_its_ledger(amqp_vhost, ledger_path: Path) -> None:
    setup = Ledger(ledger_path)
    setup.open()
    setup.call(lambda: fill(setup.db.conn))
    setup.close()
    settings = AllocatorSettings(amqp_url=amqp_vhost.url, ledger_path=ledger_path,
                                 history_retention_days=WINDOW_DAYS,
                                 history_prune_interval_s=0.2, history_prune_batch=3)
    service = AllocatorService(settings, clock=lambda: NOW)
    await service.start()
    try:
        async def pruned() -> bool:
            return service.stats.counters[Count.LEDGER_ROWS_PRUNED.value] >= 25 + 8 + 27
        await wait_until(pruned, within=30)
        assert service.stats.counters[Count.LEDGER_ROWS_PRUNED.value] == 25 + 8 + 27
        assert rows(service.ledger, "SELECT lease_id FROM leases ORDER BY lease_id") == [
            ("ended-recently",), ("held-for-long",)]
    finally:
        await service.stop()
