"""Standby detection, and how a standby takes over.

RabbitMQ does not tell a single-active consumer that it became active. Only the active one
gets deliveries; so:

- *One shared ledger file* (``ledger_log = "off"``): a recent delivery means active; without
  one, another process writing the ledger means standby. A standby that gets a batch takes
  over when its commit finds the file written by another allocator: it rebuilds its memory
  from the file and applies the batch again (:meth:`Standby.took_over_file`).
- *The replicated ledger log*: the writer is whoever made the newest accepted claim. A
  replica that gets a batch while not the writer claims the log, but only on a delivery the
  broker still stands behind (:meth:`Standby.may_write`), then rebuilds its memory from its
  ledger, which holds every entry before its claim.

A replica whose ledger cannot apply the log's next entry (disk full or read-only) is a
standby until it can: it stops consuming requests, so that another replica is given them,
keeps following the log, and consumes again once the entry is applied
(:func:`serve_while_writable`).

A standby runs no timers (the service asks :meth:`Standby.is_standby` before each tick): it
would write timer decisions to the shared ledger and then have to reload after every write
of the active one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import aio_pika.abc
import aiormq.abc

from allocator.config import AllocatorSettings
from allocator.ledger.replication import LogFenced, LogMismatch, LogUnavailable, ReplicatedLog
from allocator.ledger.store import LedgerError
from allocator.metrics.counters import Count, ServiceStats
from allocator.service.answers import Answers
from allocator.service.intake import Intake, delivery_of
from allocator.service.memory import Memory

log = logging.getLogger(__name__)

RESUME_RETRY_S = 1.0
"""Pause before consuming requests again when the broker refused it (the connection is being
restored meanwhile)."""

MAX_TAKEOVERS_PER_BATCH = 3
"""How often one batch may find the shared ledger file written by another allocator and be
applied again. One takeover is the normal case; more mean two allocators both believe they
are active, and the batch then fails (answered ``internal_error``) rather than loop."""


class Standby:
    """Whether this allocator is a standby, and its takeover when it is given a batch."""

    def __init__(self, settings: AllocatorSettings, stats: ServiceStats, memory: Memory,
                 intake: Intake, answers: Answers, replicated: ReplicatedLog | None) -> None:
        self.settings = settings
        self._stats = stats
        self._memory = memory
        self._intake = intake
        """Tells when the newest delivery came, and counts stale ones."""
        self._answers = answers
        """Gives stale deliveries and unclaimed batches back to the queue."""
        self._log = replicated
        """The replicated ledger log, or None: one shared ledger file."""

    async def is_standby(self) -> bool:
        """Whether another allocator is the active one, as far as this one can tell.

        Only the active one gets deliveries, so a recent delivery means active; without
        one, another process writing the ledger (node heartbeats make the active one write
        every few seconds) means standby. An allocator alone with a silent cluster counts as
        active: its timers must still notice the silence.
        """
        if self._log is not None:
            # With the log, the writer is whoever made the newest accepted claim.
            return not self._log.is_writer
        last = self._intake.last_delivery
        if last is not None and time.monotonic() - last < self.settings.standby_after_s:
            return False
        return await self._memory.written_elsewhere()

    def is_active(self) -> bool:
        """Whether this allocator is the active one by what it holds itself, without I/O
        (the metrics read it on every scrape: ``swarm_gpu_allocator_active``).

        Active: the broker gave it a delivery within ``standby_after_s`` (single-active-
        consumer gives deliveries to the active one only, and node heartbeats bring one
        every few seconds) and, with the replicated log, it is the log's writer (a standby
        given a stale delivery is not; a deposed writer stops being one when it applies the
        newer claim). So a standby is not active from its start, and exactly one replica is
        while the nodes report; with none reporting, none is.
        """
        if self._log is not None and not self._log.is_writer:
            return False
        last = self._intake.last_delivery
        return last is not None and time.monotonic() - last < self.settings.standby_after_s

    async def may_write(self, batch: list[object]) -> list[object]:
        """What of ``batch`` this allocator may decide: all of it while it writes the ledger
        (one shared file, whose commit checks for a takeover itself, or the log's writer).
        Otherwise it claims the log, when the batch shows it is the active one: then the
        batch without its stale deliveries; else nothing, the batch's messages given back
        to the queue."""
        replicated = self._log
        if replicated is None or replicated.is_writer:
            return batch
        batch = await self._proof_of_activity(batch)
        if not batch:
            return []
        try:
            await self._become_writer(replicated)
        except (LogFenced, LogMismatch, LogUnavailable) as exc:
            log.warning("not the writer of the ledger log (%s); the batch goes back to "
                        "the queue", exc)
            await self._answers.requeue(batch)
            return []
        return batch

    async def took_over_file(self, takeovers: int) -> None:
        """The batch's commit found the shared file written by another allocator, for the
        ``takeovers``-th time: this one is a standby that has just become active. Start from
        what the other one left (the caller applies the batch again); past
        :data:`MAX_TAKEOVERS_PER_BATCH` raise :class:`~allocator.ledger.store.LedgerError`."""
        if takeovers > MAX_TAKEOVERS_PER_BATCH:
            raise LedgerError("the ledger keeps changing under this allocator") from None
        log.warning("the ledger was written by another allocator (takeover); reloading")
        self._stats.counters.add(Count.TAKEOVERS)
        await self._memory.reload()

    async def _become_writer(self, replicated: ReplicatedLog) -> None:
        """Claim the log (single-active-consumer made this allocator the active one) and
        rebuild memory from the ledger, which now holds every entry before the claim."""
        genesis = await replicated.claim()
        self._stats.counters.add(Count.TAKEOVERS)
        # A log started here from an empty or unlogged ledger may be behind the nodes; a
        # ledger caught up with the log is not.
        await self._memory.reload(fenced=genesis)

    async def _proof_of_activity(self, batch: list[object]) -> list[object]:
        """What of ``batch`` shows that single-active-consumer made this allocator the active
        one, which a claim of the log needs: its deliveries on a channel the broker still
        holds. The batch without its stale deliveries, or empty when nothing shows it; then
        nothing may claim.

        Timer ticks alone show nothing: one queued just before this allocator learnt that
        another one claimed the log would depose the active one. A delivery shows it only
        while its channel is open at the broker, which one round trip on it settles: after
        a pause (a stopped process, a stalled machine) past the connection's heartbeat
        timeout, the broker has closed the connection and given its deliveries to the other
        allocator, while this process may not have read that yet. Deliveries whose channel
        does not answer go back to the queue (nothing to do if it is closed).
        """
        messages = [item for item in batch
                    if isinstance(item, aio_pika.abc.AbstractIncomingMessage)]
        deliveries = [(message, delivery_of(message)) for message in messages]
        live: set[aiormq.abc.AbstractChannel] = set()
        for channel in {delivery[0] for _, delivery in deliveries if delivery is not None}:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.settings.request_timeout_s):
                    # Re-sets the prefetch it already has: a round trip with no effect (it
                    # applies to consumers started after it, and none will be).
                    await channel.basic_qos(prefetch_count=self.settings.prefetch)
                live.add(channel)
        stale = {id(message): message for message, delivery in deliveries
                 if delivery is None or delivery[0] not in live}
        if stale:
            self._intake.drop_stale(len(stale))
            await self._answers.requeue(stale.values())
        if len(stale) == len(messages):
            return []
        return [item for item in batch if id(item) not in stale]


async def serve_while_writable(replicated: ReplicatedLog, consuming: asyncio.Event, *,
                               pause: Callable[[], Awaitable[None]],
                               resume: Callable[[], Awaitable[None]]) -> None:
    """Stop consuming requests (``pause``) while this replica's ledger cannot apply the log
    (:attr:`~allocator.ledger.log_store.ReplicaStore.failure`), and consume again
    (``resume``) once it can; return when the log turns out not to be this ledger's
    history (the caller stops serving for good).

    ``consuming`` is set once the service has started its consumer: a failure found before
    that is acted on right after it, so a consumer started meanwhile is stopped too. While
    paused, single-active-consumer gives the requests to another replica, if there is one;
    if not, they wait in the queue (no restart would help: the disk is the same after one).
    """
    mismatch, failing, writable = (replicated.mismatch_event, replicated.store.failing,
                                   replicated.store.writable)
    while True:
        await _first_of(mismatch, failing)
        await _first_of(mismatch, consuming)
        if mismatch.is_set():
            return
        await pause()
        log.warning("stopped consuming requests: this replica's ledger cannot apply the "
                    "ledger log (%s); following it until it can", replicated.store.failure)
        await _first_of(mismatch, writable)
        if mismatch.is_set():
            return
        while True:
            try:
                await resume()
                break
            except Exception as exc:  # the broker link is being restored: try again
                log.warning("cannot consume requests again yet (%s); again in %g s",
                            exc or type(exc).__name__, RESUME_RETRY_S)
                await asyncio.sleep(RESUME_RETRY_S)
        log.info("consuming requests again: this replica's ledger applies the ledger log")


async def _first_of(*events: asyncio.Event) -> None:
    """Until one of ``events`` is set."""
    waits = [asyncio.ensure_future(event.wait()) for event in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for wait in waits:
            wait.cancel()
