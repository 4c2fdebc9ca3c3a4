"""The leases decayed usage is computed from: a rebuild's (:mod:`allocator.engine.usage`, those
that held GPUs and ended since a time, read on the ledger's thread) and ``gpu-ledger
fairshare``'s (those too, the leases holding GPUs now, and the GPUs' models).

The leases table has no index on ``released_at``: this reads every final lease once, at a
load, and only when ``usage_half_life_h`` is set. Retention
(``history_retention_days``) shorter than the history window loses what it deleted.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from typing import Any

from allocator.ledger.lease import LeaseRecord, row_reader
from allocator.wire.protocol import LeaseState

FINAL = tuple(state.value for state in LeaseState if state.final)
HOLDING = tuple(state.value for state in LeaseState if state.holds_gpus)


def ended_since(conn: sqlite3.Connection, since: float) -> list[LeaseRecord]:
    """The final leases granted GPUs that ended at or after ``since``, oldest end first."""
    return _leases(conn, f"state IN ({', '.join('?' for _ in FINAL)}) AND granted_at IS NOT "
                   "NULL AND released_at >= ? ORDER BY released_at, lease_id", [*FINAL, since])


def holding(conn: sqlite3.Connection) -> list[LeaseRecord]:
    """The leases that hold GPUs now (granted, bound, releasing), oldest grant first."""
    return _leases(conn, f"state IN ({', '.join('?' for _ in HOLDING)}) AND granted_at IS "
                   "NOT NULL ORDER BY granted_at, lease_id", HOLDING)


def gpu_models(conn: sqlite3.Connection) -> dict[str, tuple[str, bool]]:
    """Each GPU the ledger knows: uuid -> (its model, whether it is a MIG instance, part of
    a GPU counted apart)."""
    return {uuid: (model, parent is not None) for uuid, model, parent in conn.execute(
        "SELECT uuid, model, mig_parent_uuid FROM gpus")}


def _leases(conn: sqlite3.Connection, where: str, params: Sequence[Any]) -> list[LeaseRecord]:
    cursor = conn.execute(f"SELECT * FROM leases WHERE {where}", params)
    read = row_reader(tuple(column[0] for column in cursor.description))
    return [read(values) for values in cursor]
