"""The ledger's writes on a real SQLite file: one batch is one transaction; partial rows keep
the columns they do not carry."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from allocator.ledger.changes import Changes
from allocator.ledger.store import Ledger, LedgerError
from allocator.placement.cluster import Node


def _rows(path: Path, sql: str) -> list[tuple[object, ...]]:
    with sqlite3.connect(path) as conn:
        return conn.execute(sql).fetchall()


def test_a_batch_that_fails_half_way_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    ledger = Ledger(path)
    ledger.open()
    try:
        changes = Changes()
        changes.node(Node(host="gpu-a", agent_id="a1", last_heartbeat=1.0))
        changes.event(1.0, "node_joined", host="gpu-a")
        # a history line naming a column the table does not have: the write after the node's
        changes.history.append({"lease_id": "L", "at": 1.0, "no_such_column": 1})
        with pytest.raises(LedgerError):
            ledger.call(lambda: ledger.commit(changes))
    finally:
        ledger.close()
    assert _rows(path, "SELECT host FROM nodes") == [], "the node row went with the batch"
    assert _rows(path, "SELECT kind FROM events") == []


def test_a_partial_row_keeps_the_columns_it_does_not_carry(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    ledger = Ledger(path)
    ledger.open()
    try:
        first = Changes()
        first.node(Node(host="gpu-a", agent_id="a1", last_heartbeat=1.0), agent_user="agent-a",
                   first_seen=1.0)
        ledger.call(lambda: ledger.commit(first))
        later = Changes()  # a heartbeat: no agent_user, no first_seen
        later.node(Node(host="gpu-a", agent_id="a2", last_heartbeat=5.0))
        ledger.call(lambda: ledger.commit(later))
    finally:
        ledger.close()
    assert _rows(path, "SELECT agent_id, last_heartbeat, agent_user, first_seen FROM nodes") \
        == [("a2", 5.0, "agent-a", 1.0)]
