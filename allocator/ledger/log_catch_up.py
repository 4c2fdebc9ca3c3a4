"""Catching up: a replica whose place in the ledger log is gone, or that has none, looks for
a whole snapshot to load instead of its state (pure: no I/O).

:mod:`allocator.ledger.replication` moves its consumer to where the stream's newest entry says
the newest whole snapshot starts (the *hint*), or to the oldest entry kept; this decides, entry
by entry, whether a whole snapshot has been read, and when to look again from the oldest."""

from __future__ import annotations

from dataclasses import dataclass, field

from allocator.ledger.log_entries import Entry
from allocator.ledger.log_rules import NotHistory
from allocator.ledger.log_snapshot import Assembled, SnapshotAssembly


@dataclass(frozen=True)
class ScanFromOldest:
    """The hint led nowhere: read again from the oldest entry kept."""

    why: str


@dataclass
class SnapshotSearch:
    """One replica's search for a whole snapshot of the log."""

    log_id: str | None
    """The log it must be of (a ledger too old for what the stream keeps); None: any."""
    hint: int | None = None
    """The offset the consumer was started at, the newest snapshot's as-of entry; None:
    scanning from the oldest entry kept for the first whole snapshot."""
    assembly: SnapshotAssembly = field(default_factory=SnapshotAssembly)
    hint_read: bool = False

    def see(self, offset: int, entry: Entry) -> Assembled | ScanFromOldest | NotHistory | None:
        """Read one entry: the whole snapshot once read (to load), a reason to scan again,
        the finding that the log is not this ledger's history, or None: read on."""
        if self.hint is not None and not self.hint_read:
            self.hint_read = True
            if offset != self.hint:
                return ScanFromOldest(f"the newest snapshot's start (offset {self.hint}) is no "
                                      "longer kept")
            self.assembly.see(entry.seen(offset))
            return None
        snapshot = self.assembly.see(entry.seen(offset))
        if snapshot is None:
            if self.hint is not None and not self.assembly.assembling:
                return ScanFromOldest(f"the entries after offset {self.hint} do not make a "
                                      "whole snapshot")
            return None
        if self.log_id is not None and snapshot.log_id != self.log_id:
            return NotHistory(f"it follows log {self.log_id}, the stream's snapshot is of log "
                              f"{snapshot.log_id}")
        return snapshot
