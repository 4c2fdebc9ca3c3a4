"""The engine's memory as rebuilt from the ledger, and the ledger's version it reflects.

SQLite's ``data_version`` changes when *another* connection commits. :class:`Memory` records
it at each rebuild; a commit to the shared file expects it unchanged (optimistic concurrency:
a standby that another allocator's writes made stale must not write), and a ledger whose
version moved on says another allocator is writing (:meth:`Memory.written_elsewhere`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager, nullcontext

from allocator.engine import Engine
from allocator.ledger.changes import Changes
from allocator.ledger.lease import LeaseRecord
from allocator.ledger.loaded import LoadedState
from allocator.ledger.store import Ledger
from allocator.ledger.usage_history import ended_since


class Memory:
    """Rebuilds the engine from the ledger and commits batches to the ledger file.

    Invariant: ``_data_version`` is the ledger's ``data_version`` as of the last rebuild; the
    engine holds what the ledger held then, plus the batches this process has committed since.
    """

    def __init__(self, ledger: Ledger, engine: Engine, clock: Callable[[], float],
                 after_reload: Callable[[], Awaitable[None]], *,
                 rebuilding: Callable[[], AbstractContextManager[object]] = nullcontext
                 ) -> None:
        self._ledger = ledger
        self._engine = engine
        self._clock = clock
        self._after_reload = after_reload
        """Called after each rebuild (pushes the outcomes the ledger now holds)."""
        self._rebuilding = rebuilding
        """Around each rebuild, from reading the ledger to the engine holding its state
        (:func:`allocator.service.heap.rebuilding` in the ``serve`` process)."""
        self._data_version: int | None = None
        """The ledger's ``data_version`` at the last rebuild; None before the first."""

    async def reload(self, *, fenced: bool = False) -> None:
        """Rebuild the engine from the ledger (start, failed commit, poisoned message,
        takeover, fenced batch).

        Only the start is fenced: after a failed commit the ledger is what this process
        wrote, and a takeover finds what the active one wrote.
        """
        ledger = self._ledger
        since = self._engine.usage_history_since(self._clock())

        def read() -> tuple[LoadedState, list[LeaseRecord]]:
            # One trip: the ended leases of the same ledger state as the rest.
            return ledger.load(), [] if since is None else ended_since(ledger.db.conn, since)

        with self._rebuilding():
            state, history = await ledger.run(read)
            self._engine.load(state, self._clock(), fenced=fenced, usage_history=history)
            del state, history  # the rows the engine was built from: garbage once it holds them
        self._data_version = await ledger.run(ledger.data_version)
        # Another allocator may have decided queued requests whose clients wait here (a
        # takeover): what the ledger says now is committed, so it may be pushed.
        await self._after_reload()

    async def commit(self, changes: Changes) -> float:
        """Write one batch to the ledger file in one transaction, in one trip to the ledger's
        thread; :class:`~allocator.ledger.store.LedgerChanged` (nothing written) when another
        allocator wrote since the last rebuild. Returns the seconds the transaction took on
        the ledger's thread (the rest of the wait is the hand-over to it and back)."""
        ledger = self._ledger
        expect_version = self._data_version

        def write() -> float:
            started = time.perf_counter()
            ledger.commit(changes, expect_version=expect_version)
            return time.perf_counter() - started

        return await ledger.run(write)

    async def written_elsewhere(self) -> bool:
        """Whether another process has written the ledger since the last rebuild."""
        return await self._ledger.run(self._ledger.data_version) != self._data_version
