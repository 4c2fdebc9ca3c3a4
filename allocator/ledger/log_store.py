"""This replica's own ledger as the replicated log writes to it: whether its storage takes
writes (:mod:`allocator.ledger.replication`).

A write the storage refuses (:class:`~allocator.ledger.store.LedgerUnwritable`: disk full,
read-only) is no broken entry: every other replica applies it, and so will this one once its
disk takes writes again. Meanwhile the replica stops serving, keeps the entry and everything
after it unread, and tries the same write again every ``STORE_RETRY_S``; nothing is skipped,
so the entry is applied exactly once, in its place.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from allocator.ledger.store import Ledger, LedgerUnwritable

log = logging.getLogger(__name__)

STORE_RETRY_S = 1.0
"""Pause before writing an entry to this replica's ledger again after its storage refused it
(disk full, read-only): one small transaction a second costs nothing, and the replica serves
again within a second of the space coming back."""


class ReplicaStore:
    """Writes of the log's entries to this replica's ledger, and its storage's health."""

    def __init__(self, ledger: Ledger, stream: str,
                 on_failure: Callable[[LedgerUnwritable], None]) -> None:
        self.ledger = ledger
        self.stream = stream
        self._on_failure = on_failure
        """Called once when the storage starts refusing (the log stops serving then)."""
        self.failure: LedgerUnwritable | None = None
        """Set while this replica's ledger refuses to apply the next entry (disk full,
        read-only): the replica follows without serving and writes the entry again every
        ``STORE_RETRY_S`` until it works. An error of the local store, not of the log."""
        self.failing = asyncio.Event()
        """Set while :attr:`failure` is."""
        self.writable = asyncio.Event()
        """Set while it is not."""
        self.writable.set()
        self.retries = 0
        """Writes of an entry to this ledger tried again after its storage refused them."""
        self._failed_at = 0.0

    async def write(self, write: Callable[[], None]) -> None:
        """Run ``write`` (one entry's transaction) on the ledger's thread until it is done;
        any error but :class:`~allocator.ledger.store.LedgerUnwritable` is raised."""
        while True:
            try:
                await self.ledger.run(write)
            except LedgerUnwritable as exc:
                if self.failure is None:
                    self._failed(exc)
                else:
                    self.retries += 1
                    self.failure = exc
                await asyncio.sleep(STORE_RETRY_S)
                continue
            if self.failure is not None:
                self._recovered()
            return

    def _failed(self, exc: LedgerUnwritable) -> None:
        log.error("ledger log %s: this replica's ledger cannot apply the next entry (%s); "
                  "it follows the log without serving and writes the entry again every "
                  "%g s until its storage takes it", self.stream, exc, STORE_RETRY_S)
        self.failure = exc
        self._failed_at = time.monotonic()
        self.writable.clear()
        self.failing.set()
        self._on_failure(exc)

    def _recovered(self) -> None:
        log.warning("ledger log %s: this replica's ledger takes writes again after %.1f s; "
                    "the entry it could not apply is applied, and the replica serves again",
                    self.stream, time.monotonic() - self._failed_at)
        self.failure = None
        self.failing.clear()
        self.writable.set()
