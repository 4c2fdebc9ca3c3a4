"""How long the ledger keeps its trail: events, and finished leases with their history.

Events and lease history grow with time, not with the cluster (a flapping GPU, a refused
node message each add a row), so without a bound they fill the ledger's disk in the end. Rows
older than ``history_retention_days`` are deleted, now and then (``history_prune_interval_s``),
in bounded steps: each step is one short transaction of at most ``history_prune_batch`` rows
on the ledger's own connection and thread, so a prune never holds the writer for longer than
one step, and the batches the allocator commits meanwhile go between its steps. Admins who
want the trail kept run ``gpu-ledger export`` first (docs/operations.md, "Retention").

What goes, and the rule for each (``cutoff`` is now less the window):

- an event whose ``at`` is before the cutoff (walked through the ``at`` index);
- a finished lease (released or expired) that ended before the cutoff, with its whole state
  history in the same transaction (walked through the ``created_at`` index: a lease that
  ended before the cutoff was created before it);
- a state-history row before the cutoff whose lease the ledger no longer holds (a replica
  that loaded a snapshot of the replicated log keeps its own history of leases the snapshot
  no longer had), walked in row-id order (the order rows were written in) until a step finds
  none older than the cutoff.

Active leases and their history are never pruned, however old. Each replica of the
replicated ledger log prunes its own file by this rule (docs/design.md, "Retention").
:class:`Pruner` is the service's timer; the steps are plain functions on a connection.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from allocator.ledger.store import Ledger
from allocator.metrics.counters import Count, Counters
from allocator.wire.protocol import LeaseState

log = logging.getLogger(__name__)

T = TypeVar("T")

DAY_S = 86_400.0

FINAL_STATES: tuple[str, ...] = tuple(state.value for state in LeaseState if state.final)
"""Lease states whose rows retention may delete (every other state is a lease still held or
waited for)."""

PAUSE_BETWEEN_STEPS_S = 0.005
"""A step yields the ledger thread for this long before the next, so that batches waiting
to commit go first even when the event loop has nothing else ready."""


def cutoff_for(now: float, retention_days: float) -> float | None:
    """The time before which rows go; None when ``retention_days`` is 0 (keep forever)."""
    if retention_days <= 0:
        return None
    return now - retention_days * DAY_S


@dataclass
class Pruned:
    """Rows deleted, by table (one step's or a whole prune's)."""

    events: int = 0
    leases: int = 0
    history: int = 0

    @property
    def rows(self) -> int:
        return self.events + self.leases + self.history

    def add(self, other: Pruned) -> None:
        self.events += other.events
        self.leases += other.leases
        self.history += other.history


def prune_events(conn: sqlite3.Connection, cutoff: float, limit: int) -> int:
    """Delete at most ``limit`` of the oldest events before ``cutoff``, in one transaction;
    how many were deleted."""
    with conn:
        cursor = conn.execute(
            "DELETE FROM events WHERE id IN "
            "(SELECT id FROM events WHERE at < ? ORDER BY at LIMIT ?)", (cutoff, limit))
    return max(cursor.rowcount, 0)


def prune_finished_leases(conn: sqlite3.Connection, cutoff: float, limit: int) -> Pruned:
    """Delete at most ``limit`` finished leases that ended before ``cutoff``, and their state
    history, in one transaction."""
    marks = ", ".join("?" for _ in FINAL_STATES)
    with conn:
        ids = [row[0] for row in conn.execute(
            f"SELECT lease_id FROM leases WHERE created_at < ? AND state IN ({marks}) "
            "AND released_at < ? ORDER BY created_at LIMIT ?",
            (cutoff, *FINAL_STATES, cutoff, limit))]
        if not ids:
            return Pruned()
        # One statement per lease through the lease_id index: bounded by ``limit`` leases.
        history = 0
        for lease_id in ids:
            history += max(conn.execute("DELETE FROM lease_history WHERE lease_id = ?",
                                        (lease_id,)).rowcount, 0)
        conn.executemany("DELETE FROM leases WHERE lease_id = ?", [(i,) for i in ids])
    return Pruned(leases=len(ids), history=history)


def prune_orphan_history(conn: sqlite3.Connection, cutoff: float, after_id: int,
                         limit: int) -> tuple[int, int | None]:
    """Look at the next ``limit`` history rows after row id ``after_id``; delete those before
    ``cutoff`` whose lease the ledger does not hold. Returns (rows deleted, the id to go on
    after), the id None when the walk is done: no row left, or none of these before the
    cutoff (rows are written in time order, so none after them is either)."""
    with conn:
        rows = conn.execute("SELECT id, at, lease_id FROM lease_history WHERE id > ? "
                            "ORDER BY id LIMIT ?", (after_id, limit)).fetchall()
        old = [(row_id, lease_id) for row_id, at, lease_id in rows
               if at is not None and at < cutoff]
        if not old:
            return 0, None
        leases = sorted({lease_id for _, lease_id in old if lease_id is not None})
        held: set[str] = set()
        for start in range(0, len(leases), 500):  # below SQLite's bound on parameters
            chunk = leases[start:start + 500]
            held.update(row[0] for row in conn.execute(
                f"SELECT lease_id FROM leases WHERE lease_id IN "
                f"({', '.join('?' for _ in chunk)})", chunk))
        orphans = [(row_id,) for row_id, lease_id in old if lease_id not in held]
        if orphans:
            conn.executemany("DELETE FROM lease_history WHERE id = ?", orphans)
    return len(orphans), int(rows[-1][0])


class OnLedger(Protocol):
    """Runs one step on the ledger's thread, with its connection, and awaits the result."""

    def __call__(self, step: Callable[[sqlite3.Connection], T]) -> Awaitable[T]: ...


async def prune(run: OnLedger, cutoff: float, batch: int, *,
                pause_s: float = PAUSE_BETWEEN_STEPS_S) -> Pruned:
    """Prune everything before ``cutoff``, one step of at most ``batch`` rows per call of
    ``run``, pausing ``pause_s`` between steps."""
    total = Pruned()
    while True:
        events = await run(lambda conn: prune_events(conn, cutoff, batch))
        total.events += events
        if events < batch:
            break
        await asyncio.sleep(pause_s)
    while True:
        step = await run(lambda conn: prune_finished_leases(conn, cutoff, batch))
        total.add(step)
        if step.leases < batch:
            break
        await asyncio.sleep(pause_s)
    after: int | None = 0
    while after is not None:
        deleted, after = await run(
            functools.partial(prune_orphan_history, cutoff=cutoff, after_id=after,
                              limit=batch))
        total.history += deleted
        if after is not None:
            await asyncio.sleep(pause_s)
    return total


class Pruner:
    """The service's retention timer: a prune shortly after start, then every
    ``interval_s``, on the ledger's thread in bounded steps.

    ``may_prune`` says whether this process prunes now: the active allocator on a shared
    ledger file (a standby must not write the file the active one writes), every replica
    with the replicated ledger log (each its own file).
    """

    def __init__(self, ledger: Ledger, counters: Counters, *, retention_days: float,
                 interval_s: float, batch: int, clock: Callable[[], float],
                 may_prune: Callable[[], Awaitable[bool]]) -> None:
        self._ledger = ledger
        self._counters = counters
        self.retention_days = retention_days
        self.interval_s = interval_s
        self.batch = batch
        self._clock = clock
        self._may_prune = may_prune
        self.last: Pruned | None = None
        """What the newest prune deleted (None before the first)."""

    async def run(self) -> None:
        """Prune now and then until cancelled; a failed prune is logged and tried again at the
        next interval."""
        if self.retention_days <= 0:
            return  # keep forever
        await asyncio.sleep(min(self.interval_s, 60.0))
        while True:
            try:
                if await self._may_prune():
                    await self.prune_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # the timer must outlive one failure (a full disk, a lock)
                log.exception("pruning the ledger failed; trying again in %g s",
                              self.interval_s)
            await asyncio.sleep(self.interval_s)

    async def prune_once(self) -> Pruned:
        """One whole prune of rows older than the window (now less ``retention_days``)."""
        cutoff = cutoff_for(self._clock(), self.retention_days)
        if cutoff is None:
            return Pruned()
        ledger = self._ledger

        def run(step: Callable[[sqlite3.Connection], T]) -> Awaitable[T]:
            return ledger.run(lambda: step(ledger.db.conn))

        began = time.monotonic()
        pruned = await prune(run, cutoff, self.batch)
        self.last = pruned
        self._counters.add(Count.LEDGER_ROWS_PRUNED, pruned.rows)
        if pruned.rows:
            log.info("retention: pruned %d events, %d finished leases and %d lease history "
                     "rows older than %g days in %.2f s", pruned.events, pruned.leases,
                     pruned.history, self.retention_days, time.monotonic() - began)
        return pruned
