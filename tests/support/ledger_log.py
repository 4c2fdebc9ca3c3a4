"""Replicas of the ledger over a real log stream: one replica, a batch of changes, the leases a
ledger holds."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aio_pika

from allocator.ledger.changes import Changes
from allocator.ledger.replication import ReplicatedLog
from allocator.ledger.store import Ledger

STREAM = "swarm-gpu.ledger-log"


def batch(lease_id: str) -> Changes:
    changes = Changes()
    changes.leases[lease_id] = {"lease_id": lease_id, "request_key": f"k/{lease_id}/",
                                "user": "u", "state": "queued", "created_at": 1.0,
                                "groups": [], "request": {}, "gpu_uuids": [], "env": {}}
    changes.event(1.0, "test", lease_id=lease_id)
    return changes


@contextlib.asynccontextmanager
async def replica(url: str, path: Path, stream: str = STREAM,
                  **options: Any) -> AsyncIterator[ReplicatedLog]:
    """A replica of the log ``stream`` on the ledger at ``path`` (``options``:
    ReplicatedLog's)."""
    ledger = Ledger(path)
    ledger.open()
    connection = await aio_pika.connect_robust(url, timeout=10)
    replicated = ReplicatedLog(ledger, stream, **{"max_bytes": 64 << 20, "timeout_s": 5,
                                                  **options})
    try:
        await replicated.start(connection)
        yield replicated
    finally:
        await replicated.stop()
        await connection.close()
        ledger.close()


def lease_ids(path: Path) -> list[str]:
    conn = sqlite3.connect(path)
    try:
        return [row[0] for row in conn.execute("SELECT lease_id FROM leases ORDER BY lease_id")]
    finally:
        conn.close()
