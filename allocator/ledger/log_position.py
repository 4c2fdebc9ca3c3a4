"""Where a ledger stands in the replicated log: the last entry it applied."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LogPosition:
    """The last entry of the replicated log this ledger applied (see
    :mod:`allocator.ledger.replication`), and the writer the log obeyed after it."""

    log_id: str
    """Which log: set by the log's first entry; a ledger never applies another log."""
    offset: int
    """The stream offset of the last entry applied (or skipped as fenced)."""
    entry_id: str
    """That entry's own id, to recognise it when the log is read again."""
    epoch: int
    """The epoch of the newest accepted claim: only its writer's batches are applied."""
    writer: str
    """The allocator that made that claim."""
    snapshot_from: int | None = None
    """The offset of the as-of entry of the newest whole snapshot in the log, where a replica
    that has to load it starts reading; None while the log has none."""
    bytes_since_snapshot: int | None = None
    """Bytes of the entries after that snapshot (after the log's start while it has none):
    the writer takes the next one when they reach ``ledger_log_snapshot_bytes``; None: not
    known (a ledger that followed the log before snapshots), and one is due."""
