"""The applier: one batch at a time, decided in memory, committed in one transaction (or
one entry of the replicated ledger log), and only then answered.

A crash before the commit loses nothing (the broker redelivers; requests are idempotent by
``request_key``). Whatever goes wrong, no caller is told of a decision that is not on disk,
and every message of the batch is answered or given back to the queue:

- *a poisoned message* (the engine raised on it): it alone is answered ``internal_error``
  (dead-lettered when nobody waits for an answer), memory is rebuilt from the ledger and the
  rest of the batch applied again without it;
- *a fenced batch* (with the log: another replica claimed it first, or the log is not this
  ledger's history): nothing is answered; memory is rebuilt and the messages go back to the
  queue, for the active allocator;
- *a stalled batch* (with the log: its entry is in the log, but this replica's ledger cannot
  apply it now, disk full or read-only): nothing is answered; memory is rebuilt and the
  messages go back to the queue. They are decided again once the entry is applied, here or
  on another replica, and answered from it (a request key keeps its lease);
- *a takeover* (the shared file was written by another allocator): memory is rebuilt from
  the file and the batch applied again (:mod:`allocator.service.standby`);
- *a failed commit*: nothing was written; memory is rebuilt and every caller of the batch is
  answered ``storage_error``;
- *anything else*: memory is rebuilt and every caller is answered ``internal_error``; the
  applier goes on with the next batch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import aio_pika.abc

from allocator.config import AllocatorSettings
from allocator.ledger.changes import Changes
from allocator.ledger.replication import (
    LogFenced,
    LogMismatch,
    LogStalled,
    LogUnavailable,
    ReplicatedLog,
)
from allocator.ledger.store import LedgerChanged, LedgerError
from allocator.logs import lease_context
from allocator.metrics.counters import Count, ServiceStats
from allocator.metrics.exporter import AllocatorMetrics
from allocator.service.answers import Answers, Pending
from allocator.service.commands import Commands
from allocator.service.decide import Decider, Poisoned, wants_reply
from allocator.service.intake import Intake
from allocator.service.memory import Memory
from allocator.service.standby import Standby
from allocator.wire.protocol import ErrorCode, error_reply

log = logging.getLogger(__name__)


@dataclass
class _Phases:
    """Where one batch's time went (``time.monotonic()`` seconds), for its metrics."""

    began: float
    deciding: float = 0.0
    """Applying it to the engine, every try (and the rebuilds a poisoned message cost)."""
    committing: float = 0.0
    """The commit (or the log's append), every try."""
    committed_at: float = 0.0
    """When the commit that stood ended."""
    writing: float | None = None
    """Of ``committing``, the ledger file's transaction on the ledger's thread (the commit
    that stood); None when the batch went to the replicated log instead."""


class Batches:
    """Takes batches from the intake and decides, commits and answers each."""

    def __init__(self, settings: AllocatorSettings, stats: ServiceStats,
                 metrics: AllocatorMetrics, *, intake: Intake, standby: Standby,
                 decider: Decider, memory: Memory, answers: Answers, commands: Commands,
                 replicated: ReplicatedLog | None) -> None:
        self.settings = settings
        self._stats = stats
        self._metrics = metrics
        self._intake = intake
        self._standby = standby
        self._decider = decider
        self._memory = memory
        self._answers = answers
        self._commands = commands
        self._log = replicated
        """The replicated ledger log each batch is appended to, or None: the ledger file."""

    async def run(self) -> None:
        """Apply batch after batch until cancelled; no batch's failure ends it."""
        while True:
            batch = await self._intake.next_batch()
            try:
                batch = self._intake.without_stale(batch)
                if not batch:
                    continue
                await self.apply(batch)
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must survive anything; the batch is answered below
                log.exception("batch failed; rebuilding from the ledger")
                self._stats.counters.add(Count.BATCH_FAILURES)
                try:
                    await self._recover(batch)
                except Exception:  # a dead applier would leave the queue unanswered for good
                    log.exception("could not answer a failed batch")

    async def apply(self, batch: list[object]) -> None:
        """Decide, commit and answer ``batch`` (messages and ticks, in arrival order)."""
        phases = _Phases(began=time.monotonic())
        batch = await self._standby.may_write(batch)
        if not batch:
            return
        decided = await self._decide_and_commit(batch, phases)
        if decided is None:
            return
        changes, pending = decided
        await self._answer(changes, pending, phases)
        if self._log is not None and self._log.snapshot_due():
            await self._snapshot(self._log)

    async def _decide_and_commit(self, batch: list[object], phases: _Phases
                                 ) -> tuple[Changes, list[Pending]] | None:
        """The batch decided and committed: its change set and what to answer; None when it
        was dealt with otherwise (fenced, or its commit failed: answered already)."""
        poisoned: dict[int, Pending | None] = {}
        takeovers = 0
        while True:
            phase_began = time.monotonic()
            try:
                changes, pending = self._decider.decide(batch, poisoned)
            except Poisoned as bad:
                await self._isolate(batch, bad, poisoned)
                phases.deciding += time.monotonic() - phase_began
                continue
            decided_at = time.monotonic()
            phases.deciding += decided_at - phase_began
            try:
                phases.writing = await self._commit(changes)
            except (LogFenced, LogMismatch) as exc:
                await self._fenced(batch, exc)
                return None
            except LogStalled as exc:
                await self._stalled(batch, exc)
                return None
            except LedgerChanged:
                phases.committing += time.monotonic() - decided_at
                takeovers += 1
                await self._standby.took_over_file(takeovers)
                continue
            except LedgerError as exc:
                await self._commit_failed(exc, pending)
                return None
            phases.committed_at = time.monotonic()
            phases.committing += phases.committed_at - decided_at
            return changes, pending

    async def _commit(self, changes: Changes) -> float | None:
        """Commit the batch: the seconds the ledger file's transaction took on the ledger's
        thread, or None when it went to the replicated log."""
        if self._log is not None:
            if changes:  # a batch that changed nothing is no entry of the log
                await self._log.append(changes)
            return None
        return await self._memory.commit(changes)

    async def _isolate(self, batch: list[object], bad: Poisoned,
                       poisoned: dict[int, Pending | None]) -> None:
        """One message made the engine fail: answer it alone with internal_error, throw away
        what the batch did to memory (the caller applies the others again without it)."""
        log.error("message %d of a batch failed; it alone is refused", bad.index,
                  exc_info=bad.__cause__)
        self._stats.counters.add(Count.POISONED)
        poisoned[bad.index] = self._decider.refused(batch[bad.index])
        await self._memory.reload()

    async def _fenced(self, batch: list[object], exc: LedgerError) -> None:
        """Deposed (or stopped): the batch was applied nowhere. Memory holds its decisions:
        rebuild it, answer nothing, and give the messages back to the queue for the active
        allocator."""
        log.warning("batch fenced, not applied (%s); its messages go back to the "
                    "queue", exc)
        self._stats.counters.add(Count.FENCED_BATCHES)
        await self._give_back(batch)

    async def _stalled(self, batch: list[object], exc: LogStalled) -> None:
        """The batch's entry is in the log, but this replica's ledger cannot apply it yet:
        nothing is answered now (memory is rebuilt, the messages go back to the queue). Once
        the entry is applied, here or on another replica, their redeliveries are decided on
        a memory that holds it: each request key gets the lease the entry gave it."""
        log.warning("batch in the ledger log but not applied here (%s); its messages go back "
                    "to the queue", exc)
        await self._give_back(batch)

    async def _give_back(self, batch: list[object]) -> None:
        # Memory holds the batch's decisions, which this ledger does not (yet) hold.
        await self._memory.reload()
        await self._answers.requeue(batch)

    async def _commit_failed(self, exc: LedgerError, pending: list[Pending]) -> None:
        """Nothing of the batch was written: forget it in memory and say so to every caller."""
        log.error("ledger commit failed: %s", exc)
        self._stats.counters.add(Count.COMMIT_FAILURES)
        await self._memory.reload()
        failure = error_reply(ErrorCode.STORAGE_ERROR,
                              f"the allocator could not record the decision ({exc}); "
                              "nothing was granted, try again later")
        # Every reply of the batch was computed on memory that has just been thrown away.
        for entry in pending:
            if entry.reply is not None:
                entry.reply = failure
        await self._answers.reply_and_ack(pending)

    async def _answer(self, changes: Changes, pending: list[Pending], phases: _Phases) -> None:
        """After the commit: the commands it decided, then the replies and acknowledgements,
        then the pushes of the leases that left the queue; then the batch's metrics."""
        committed_at = phases.committed_at
        if pending:  # a batch of timer ticks alone is no batch of messages
            self._stats.counters.add(Count.BATCHES)
        self._decider.committed(pending, committed_at)
        log_lease_changes(changes)
        answers = self._answers
        not_greeted = await self._commands.send(self._decider.take_commands())
        if not_greeted:
            self._decider.hellos_not_sent(not_greeted)
        await answers.resolve_lookups(pending)
        answers.remember_waiters(pending)
        await answers.reply_and_ack(pending)
        await answers.push_outcomes(changes.leases)
        answered_at = time.monotonic()
        elapsed = answered_at - phases.began
        for entry in pending:
            self._metrics.observe_request(entry.kind, elapsed)
        if pending:
            self._metrics.observe_batch(phases.deciding, phases.committing,
                                        answered_at - committed_at, write_s=phases.writing)

    async def _snapshot(self, replicated: ReplicatedLog) -> None:
        """Append a snapshot of the ledger to the log, after a batch is answered and before
        the next one is applied (a batch between its parts would break it)."""
        try:
            await replicated.take_snapshot()
        except (LogFenced, LogUnavailable, LedgerError) as exc:
            # Nothing decided is lost: the next batch claims again if this one was deposed,
            # and the snapshot is tried again after it.
            log.warning("no snapshot of the ledger log this time: %s", exc)

    async def _recover(self, batch: list[object]) -> None:
        """After an unexpected error: rebuild from disk and answer what was asked."""
        try:
            await self._memory.reload()
        except Exception:
            log.exception("could not reload the ledger")
        failure = error_reply(ErrorCode.INTERNAL_ERROR,
                              "the allocator hit an internal error on this batch; nothing was "
                              "granted; see the allocator log")
        pending = [Pending(item, failure if wants_reply(item) else None)
                   for item in batch if isinstance(item, aio_pika.abc.AbstractIncomingMessage)]
        await self._answers.reply_and_ack(pending)


def log_lease_changes(changes: Changes) -> None:
    """One log line per step of a lease's life that a committed batch holds (each state
    change: queued, granted, bound, released, expired, reclaimed...; each event that names a
    lease: reclaim warnings, stops, adoption), with the lease's id, host and user as the
    JSON line's fields. Logged after the commit, so that the log never tells of a decision
    that is not on disk."""
    if not log.isEnabledFor(logging.INFO):
        return
    for line in changes.history:
        lease_id = line["lease_id"]
        row = changes.leases.get(lease_id, {})
        host, user = row.get("host"), row.get("user")
        log.info("lease %s of %s on %s: %s -> %s (%s; by %s)", lease_id, user or "-",
                 host or "-", line["from_state"] or "new", line["to_state"], line["reason"],
                 line["by"] or "-", extra=lease_context(lease_id, host, user))
    for event in changes.events:
        lease_id = event.get("lease_id")
        if lease_id is None:
            continue
        host, user = event.get("host"), event.get("user")
        if user is None:  # an event may name the lease alone; the row knows its owner
            user = changes.leases.get(lease_id, {}).get("user")
        log.info("lease %s of %s on %s: %s%s", lease_id, user or "-", host or "-",
                 event["kind"], f" {event['detail']}" if event["detail"] else "",
                 extra=lease_context(lease_id, host, user))
