"""The replicated ledger log: every committed batch is an entry of a RabbitMQ stream.

With ``ledger_log = "stream"`` an allocator does not commit a batch to its SQLite file
directly. It appends the batch to the stream ``ledger_log_stream`` and waits until the entry
comes back on its own consumer of the stream; only then is the batch applied to its ledger
and answered. Every replica, active or standby, on any node and with its own disk, applies
the same entries in the same order to its own ledger, so a standby that takes over has the
whole ledger: the queue, granted-but-unbound leases, history and accounting.

Why read back instead of a publisher confirm: a stream consumer sees only entries the broker
has committed (on a three-node broker, replicated by Raft to a majority), and reading its own
entry in order also tells the writer whether a newer writer came first (below). One wait
gives both durability and fencing.

Writers and epochs. Each entry (:mod:`allocator.ledger.log_entries`) is a *claim* (``epoch``,
``writer``), a *batch* (``epoch``, ``writer``, changes) or a snapshot's part (below). Every
replica applies the same rules to the same sequence:

- a claim whose epoch is higher than the current one is accepted: its writer is the writer;
- a batch is applied only if its epoch and writer are the current ones; any other batch is a
  deposed writer's late write and is skipped by everyone (fenced).

An allocator becomes the writer when single-active-consumer gives it its first delivery: it
appends a claim (epoch = newest seen + 1) and waits for it, so everything before it is
applied; then it rebuilds its engine from its ledger. A writer that reads a batch of its own
skipped learns it was deposed: it throws that batch away (the messages go back to the queue
for the new active one) and stops writing.

Identity. The log's first entry is a claim carrying a new ``log_id``; every entry carries it.
A ledger records the log id and the position (offset, entry id) of the last entry it
applied, in the same transaction as the entry
(:class:`~allocator.ledger.log_position.LogPosition`). At start it reads the log from that
entry on, checking it is the one it applied: a ledger of another log, or one with data but
never part of a log while the log has entries, is refused (:class:`LogMismatch`): it is not
the active one's history, and the allocator does not serve from it. An empty ledger replays
the log from its start while the stream keeps it.

A full or read-only disk is an error of this replica's store, not of the log: the entry is
in the log and every other replica applies it. The replica stops serving (its batch in flight
goes back to the queue: :class:`LogStalled`), keeps following, writes the same entry again
every ``STORE_RETRY_S``, and serves again once it is applied (:mod:`allocator.ledger.log_store`).
Only an entry that cannot be read or applied for what it holds stops the replica for good.

Snapshots (:mod:`allocator.ledger.log_snapshot`). The stream keeps only ``ledger_log_max_bytes``.
The writer appends a snapshot of the ledger's state (nodes, GPUs, leases; not the lease
history and events) each time the log has grown by ``ledger_log_snapshot_bytes``, in parts of
at most ``SNAPSHOT_PART_BYTES``, right after the entry it is the state of; every entry names
where the newest whole snapshot starts. A replica whose place in the log is gone (older than
what the stream keeps) or that has none (an empty ledger, the log's start gone) *catches up*:
it reads that pointer from the newest entry, reads the snapshot there (or, if that does not
make a whole one, the first whole one from the oldest entry kept), loads it in place of its
state and follows the log from its last part. A ledger of another log is still refused. The
retention settings are checked so that the stream always keeps the newest snapshot
(:func:`allocator.config.ledger_log_retention_problem`). A ledger with data starting a new log
puts a snapshot of itself (its trail too) right after its claim, which every other replica
loads, so that every replica's copy is whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

import aio_pika
import aio_pika.abc
from aiormq.exceptions import ChannelInvalidStateError

from allocator.amqp.declare import OnRefusal, Refusal, Tolerate, declare_queue
from allocator.ledger.change_set import ChangeSet
from allocator.ledger.changes import Changes
from allocator.ledger.log_catch_up import ScanFromOldest, SnapshotSearch
from allocator.ledger.log_entries import (
    Batch,
    Claim,
    Entry,
    SnapshotPart,
    decode_entry,
)
from allocator.ledger.log_position import LogPosition
from allocator.ledger.log_probes import (
    newest_snapshot_start,
    offset_of,
    oldest_entry,
    stream_exists,
)
from allocator.ledger.log_rules import (
    ENTRY_OVERHEAD_BYTES,
    Applied,
    CatchUp,
    NotHistory,
    Verdict,
    fence,
    grown_since_snapshot,
    join,
    resume,
    snapshot_outgrows_retention,
    stream_is_not_the_log,
)
from allocator.ledger.log_snapshot import (
    AsOf,
    PartHeader,
    SnapshotAssembly,
    decode_parts,
    encode_parts,
)
from allocator.ledger.log_store import ReplicaStore
from allocator.ledger.store import Ledger, LedgerError, LedgerUnwritable
from allocator.wire.topology import RABBITMQ_SEGMENT_BYTES, SNAPSHOT_BYTES, QueueSpec
from allocator.wire.topology import (
    stream_arguments as stream_arguments,  # re-exported: tests use it
)

log = logging.getLogger(__name__)

SNAPSHOT_PART_BYTES = 1 << 20
"""The most payload one snapshot part carries. Far below RabbitMQ's largest message (128 MiB
in 3.10, 16 MiB from 4.0) and small enough that a part never holds up the stream's other
readers for long."""

FOLLOW_RETRY_S = 1.0
"""Pause before consuming the stream again after a broker error while catching up."""



RETENTION_ARGUMENTS = ("x-max-length-bytes", "x-stream-max-segment-size-bytes")


class LogFenced(LedgerError):
    """Another allocator claimed the log first: this one's batch was not applied anywhere."""


class LogUnavailable(LedgerError):
    """The entry did not come back in time: it may still be applied later (by everyone)."""


class LogStalled(LogUnavailable):
    """The entry is in the log, but this replica's ledger cannot apply it now (its storage
    refused the write: disk full, read-only). The replica follows without serving and applies
    it, here as everywhere, once its storage takes writes again."""


class LogNotHere(LedgerError):
    """The broker node of this connection holds no replica of the log's stream, so it cannot
    be consumed there (RabbitMQ consumes a stream only on a node with a replica): connect to
    another node of the cluster."""


class LogMismatch(LedgerError):
    """This ledger is not the log's history; the allocator must not serve from it."""


@dataclass(frozen=True)
class SnapshotTaken:
    """What appending one snapshot cost, and whether it became the log's newest."""

    as_of_offset: int
    parts: int
    payload_bytes: int
    """The tables' bytes (JSON)."""
    stored_bytes: int
    """What the stream holds of it: its entries with their overhead."""
    seconds: float
    """From reading the ledger to the last part read back."""
    whole: bool
    """Every replica reads it as a whole snapshot (no other entry broke its run)."""


class ReplicatedLog:
    """One replica's side of the log: its consumer, its applier and, when active, its writes."""

    def __init__(self, ledger: Ledger, stream: str, *, max_bytes: int, timeout_s: float,
                 segment_bytes: int = RABBITMQ_SEGMENT_BYTES,
                 snapshot_bytes: int = SNAPSHOT_BYTES,
                 snapshot_part_bytes: int = SNAPSHOT_PART_BYTES,
                 writer_id: str | None = None) -> None:
        self.ledger = ledger
        self.stream = stream
        self.max_bytes = max_bytes
        self.segment_bytes = segment_bytes
        self.snapshot_bytes = snapshot_bytes
        """The writer appends a snapshot once the log has grown by this much since the last."""
        self.snapshot_part_bytes = snapshot_part_bytes
        self.timeout_s = timeout_s
        self.writer_id = writer_id or uuid.uuid4().hex
        """This allocator process as the log knows it."""
        self.position: LogPosition | None = None
        self.is_writer = False
        """Whether the newest accepted claim is this process's, made by :meth:`claim` (which
        then rebuilt the engine), and nothing ended that since: another writer's claim, a
        skipped batch, a dropped connection or an entry that did not come back in time.
        Entries of its own that arrive later do not restore it."""
        self.mismatch: LogMismatch | None = None
        """Set when the log is not this ledger's history: stop serving."""
        self.mismatch_event = asyncio.Event()
        self.store = ReplicaStore(ledger, stream, self._store_failed)
        """This replica's ledger as the log writes to it, and whether its storage takes
        writes (:mod:`allocator.ledger.log_store`)."""
        self.caught_up = asyncio.Event()
        """Cleared while the replica loads a snapshot (it cannot claim the log meanwhile)."""
        self.caught_up.set()
        self._ledger_had_data = False
        self._verify: str | None = None
        """Entry id expected at the position the consumer starts from (already applied)."""
        self._verified = asyncio.Event()
        """Set once the consumer has read the entry at this ledger's position (or the log
        turned out not to be its history): until then a claim checks the stream first."""
        self._claimed_epoch: int | None = None
        """The epoch of the claim :meth:`claim` saw accepted; a claim of this process that is
        accepted after its wait ended makes it no writer (its engine was not rebuilt)."""
        self._assembly = SnapshotAssembly(keep_payloads=False)
        """Follows the snapshots in the entries applied (a seeding one is loaded)."""
        self._catch_up: SnapshotSearch | None = None
        self._waiters: dict[str, asyncio.Future[bool]] = {}
        self._inbox: asyncio.Queue[tuple[int, aio_pika.abc.AbstractIncomingMessage]] = \
            asyncio.Queue()
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._channel: aio_pika.abc.AbstractChannel | None = None
        self._queue: aio_pika.abc.AbstractQueue | None = None
        self._consumer_tag: str | None = None
        self._generation = 0
        """Counts the consumers started; a delivery of an earlier one is dropped."""
        self._publish_channel: aio_pika.abc.AbstractChannel | None = None
        self._applier: asyncio.Task[None] | None = None
        self._consume_arguments: dict[str, Any] = {}
        """The stream consumer's arguments; its offset follows the entries applied."""
        self.entries_applied = 0
        self.entries_fenced = 0
        self.snapshots_taken = 0
        self.snapshots_loaded = 0
        self.last_snapshot: SnapshotTaken | None = None
        """What this process's newest whole snapshot cost (None: it took none)."""

    @property
    def arguments(self) -> dict[str, Any]:
        """The stream's queue arguments."""
        return stream_arguments(self.max_bytes, self.segment_bytes)

    # ------------------------------------------------------------------ life

    async def exists(self, connection: aio_pika.abc.AbstractConnection) -> bool:
        """Whether the log's stream has been declared."""
        return await stream_exists(connection, self.stream)

    async def start(self, connection: aio_pika.abc.AbstractConnection) -> None:
        """Declare the stream and follow it from this ledger's position."""
        self.position = await self.ledger.run(self.ledger.log_position)
        self._ledger_had_data = not await self.ledger.run(self.ledger.is_empty)
        self._connection = connection
        # Declared by an earlier start with other retention settings: what it keeps is the
        # stream's own (or a policy's) business; it is used as it is.
        declared = await declare_queue(
            connection.channel, QueueSpec(self.stream, self.arguments),
            tolerate=[Tolerate(Refusal.PRECONDITION, OnRefusal.PASSIVE,
                               only_if=RETENTION_ARGUMENTS)])
        if declared.refusal is not None:
            log.warning("ledger log %s: the stream was declared with other retention than "
                        "ledger_log_max_bytes = %d, ledger_log_segment_bytes = %d (%s); "
                        "following it as it is: its arguments, or a policy on it, decide "
                        "what it keeps", self.stream, self.max_bytes, self.segment_bytes,
                        declared.reason)
        assert declared.value is not None and declared.channel is not None
        self._channel, self._queue = declared.channel, declared.value
        await self._channel.set_qos(prefetch_count=1000)
        self._publish_channel = await connection.channel(publisher_confirms=False)
        start: int | str = "first"
        self._verified.set()  # an empty ledger has no place in the log to check
        if self.position is not None:
            start = self.position.offset
            self._verify = self.position.entry_id
            self._verified.clear()
            # The log's genesis claim is its offset 0: a snapshot right after it seeds it.
            self._assembly = SnapshotAssembly(
                (self.position.offset, self.position.entry_id, self.position.log_id,
                 self.position.offset == 0), keep_payloads=False)
        self._applier = asyncio.create_task(self._apply_loop(), name="ledger-log-apply")
        try:
            await self._follow(start)
        except aio_pika.exceptions.ChannelPreconditionFailed as exc:
            if "replica" not in str(exc):
                raise
            raise LogNotHere(f"the broker node holds no replica of the stream {self.stream} "
                             f"({exc})") from exc
        connection.close_callbacks.add(self._connection_lost)
        log.info("ledger log %s: following from %s (%s)", self.stream, start,
                 f"epoch {self.position.epoch}" if self.position else "a ledger new to it")

    async def _follow_again(self, offset: int | str) -> None:
        """:meth:`_follow` while following already (catching up moves the consumer): a broker
        error (the connection dropped, a broker node stopped, the channel closed) is tried
        again every ``FOLLOW_RETRY_S`` until it works, the robust connection reconnecting
        meanwhile, instead of ending the applier: a replica catching up when its broker node
        goes would otherwise stop serving for good (its ledger is still the log's history)."""
        attempt = 1
        while True:
            try:
                async with asyncio.timeout(self.timeout_s):
                    await self._follow(offset)
                return
            except (aio_pika.exceptions.AMQPError, ChannelInvalidStateError, OSError,
                    TimeoutError) as exc:
                log.warning("ledger log %s: cannot consume the stream from offset %s (attempt "
                            "%d: %s); again in %g s", self.stream, offset, attempt,
                            exc or type(exc).__name__, FOLLOW_RETRY_S)
            attempt += 1
            await asyncio.sleep(FOLLOW_RETRY_S)

    async def _follow(self, offset: int | str) -> None:
        """Consume the stream from ``offset``, instead of any consumer before (whose
        deliveries not applied yet are dropped)."""
        assert self._queue is not None, "start() first"
        if self._consumer_tag is not None:
            tag, self._consumer_tag = self._consumer_tag, None
            # The robust queue forgets it first, so it is not restored after a reconnect
            # even if the cancel itself fails with the connection.
            await self._queue.cancel(tag)
        self._generation += 1
        generation = self._generation

        async def deliver(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            await self._inbox.put((generation, message))

        # aio-pika's robust queue keeps this very dict to consume again after a reconnect
        # (to the same broker node or another): with the offset kept past the last entry
        # applied, a reconnect resumes there instead of replaying the log from the start
        # (which would be correct too, only slow: applied offsets are skipped).
        self._consume_arguments = {"x-stream-offset": offset}
        self._consumer_tag = await self._queue.consume(deliver,
                                                       arguments=self._consume_arguments)

    def _connection_lost(self, _connection: object, reason: BaseException | None) -> None:
        """The broker connection dropped (a broker node stopped): an entry in flight cannot
        come back on this connection, so its batch fails now rather than at its timeout. It
        may still have been appended; the writer claims again first (a later claim fences
        it, or everyone applies it before the claim)."""
        self.is_writer = False
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(LogUnavailable(
                    f"the broker connection dropped ({reason or 'closed'}) before the entry "
                    "came back"))

    async def stop(self) -> None:
        """Stop applying (the connection is closed by its owner)."""
        if self._applier is not None:
            self._applier.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._applier
            self._applier = None
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(LogUnavailable("the allocator is stopping"))
        self._waiters.clear()

    # ------------------------------------------------------------------ writes

    async def claim(self, attempts: int = 3) -> bool:
        """Become the writer: append a claim and wait until it is applied (everything before
        it is then applied too). True when this claim started the log (a genesis).

        A claim made on a picture that was behind (entries not read yet, or another claim
        first) is skipped by everyone; by then every entry before it is applied, so the next
        attempt claims on the current picture. A replica loading a snapshot does not claim
        (:class:`LogUnavailable` if it has not caught up within the timeout).
        """
        await self._check_the_stream_is_the_log()
        for attempt in range(attempts):
            self._raise_if_mismatched()
            self._raise_if_stalled()
            if not self.caught_up.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.timeout_s):
                        await self.caught_up.wait()
                self._raise_if_mismatched()
                if not self.caught_up.is_set():
                    raise LogUnavailable(f"this replica is still loading a snapshot of the "
                                         f"ledger log {self.stream}")
            genesis = self.position is None
            log_id = uuid.uuid4().hex if self.position is None else self.position.log_id
            epoch = (self.position.epoch if self.position else 0) + 1
            entry = Claim(log_id=log_id, entry_id=uuid.uuid4().hex, epoch=epoch,
                          writer=self.writer_id, genesis=genesis,
                          snapshot_from=self.position.snapshot_from if self.position else None)
            if await self._append(entry):
                break
            if attempt == attempts - 1:
                raise LogFenced(f"other allocators kept claiming the ledger log {self.stream}")
        self._claimed_epoch = epoch
        position = self.position
        self.is_writer = position is not None and (position.epoch, position.writer) == \
            (epoch, self.writer_id)
        if not self.is_writer:
            raise LogFenced(f"another allocator claimed the ledger log {self.stream} right "
                            "after this one")
        if genesis and self._ledger_had_data:
            taken = await self.take_snapshot(trail=True)
            if not taken.whole:
                # Another replica's entry came between the claim and its snapshot: the other
                # replicas do not have this ledger's data, and never will from this log.
                self._mismatched(LogMismatch(
                    f"the snapshot of the ledger {self.ledger.path} did not directly follow "
                    f"its claim of the new ledger log {self.stream} (another allocator "
                    "appended in between): stop the other replicas, delete the stream and "
                    "start this one first (docs/operations.md)"))
                raise LogMismatch("the log did not get this ledger's data")
            log.info("ledger log %s started from this ledger (a snapshot of it, %d bytes, "
                     "follows its claim)", self.stream, taken.payload_bytes)
        log.info("ledger log %s: this allocator is the writer (epoch %d)", self.stream, epoch)
        return genesis

    async def _check_the_stream_is_the_log(self) -> None:
        """Before this ledger's first claim, while the entry at its position has not come
        back: raise :class:`LogMismatch` (nothing appended) if the stream is not its log.

        A ledger restored from a backup without ``gpu-ledger restore --new-log`` onto a stream
        that was lost and declared again follows a position the stream never reaches; its
        claim would time out and still land on that stream, under the old log's id. The
        stream is not its log when its first entry is of another log, when its offset 0 is
        no genesis claim (the first entry of a log is always its genesis: such a stream was
        started by a claim of exactly this kind), or when it holds no entry at all (within
        the timeout; the ledger's position is then beyond its end).
        """
        position = self.position
        if position is None or self._verified.is_set():
            return
        assert self._connection is not None, "start() first"
        try:
            oldest = await oldest_entry(self._connection, self.stream, self.timeout_s,
                                        unless=self._verified)
        except (aio_pika.exceptions.AMQPError, OSError) as exc:
            log.warning("ledger log %s: cannot read its oldest entry (%s); claiming anyway",
                        self.stream, exc or type(exc).__name__)
            return
        if self._verified.is_set():
            return  # the consumer read this ledger's entry (or found the mismatch itself)
        why = stream_is_not_the_log(position, oldest, self.timeout_s)
        if why is not None:
            mismatch = LogMismatch(
                f"the ledger {self.ledger.path} is not the history of the ledger log "
                f"{self.stream} ({why}): a backup restored onto a new stream must be restored "
                "with `gpu-ledger restore --new-log` (docs/operations.md, Back up and restore)")
            self._mismatched(mismatch)
            raise mismatch

    async def append(self, changes: Changes) -> None:
        """Append one batch and wait until it is applied to this ledger.

        Raises :class:`LogFenced` if a newer writer claimed the log first (the batch is
        applied nowhere) and :class:`LogUnavailable` if the entry did not come back in time.
        """
        self._raise_if_mismatched()
        if not self.is_writer or self.position is None:
            raise LogFenced("this allocator is not the writer of the ledger log")
        # Checked as every replica checks it, so that no replica stops on what it appends.
        entry = Batch(log_id=self.position.log_id, entry_id=uuid.uuid4().hex,
                      epoch=self.position.epoch, writer=self.writer_id,
                      changes=ChangeSet.of(changes), snapshot_from=self.position.snapshot_from)
        if not await self._append(entry):
            self.is_writer = False
            raise LogFenced("another allocator claimed the ledger log; this batch was fenced")

    def snapshot_due(self) -> bool:
        """Whether this writer should append a snapshot now: the log has grown by
        ``snapshot_bytes`` since its newest (or its growth is not known)."""
        position = self.position
        if not self.is_writer or position is None or self._catch_up is not None:
            return False
        grown = position.bytes_since_snapshot
        return grown is None or grown >= self.snapshot_bytes

    async def take_snapshot(self, *, trail: bool = False) -> SnapshotTaken:
        """As the writer, append a snapshot of the ledger at its position and wait until its
        last part is applied. The caller appends nothing meanwhile (the service calls this
        between batches): a batch between the parts would break the snapshot.

        ``trail``: with the lease history and events (only the snapshot seeding a new log).
        Raises :class:`LogFenced` if this allocator is not, or no longer, the writer, and
        :class:`LogUnavailable` if the parts did not come back in time.
        """
        self._raise_if_mismatched()
        began = time.monotonic()
        position, tables = await self.ledger.run(
            lambda: self.ledger.snapshot_tables(trail=trail))
        if not self.is_writer or position is None or position.writer != self.writer_id:
            raise LogFenced("this allocator is not the writer of the ledger log")
        # Off the event loop: a large ledger takes a second or more to encode.
        payloads = await asyncio.to_thread(encode_parts, tables, self.snapshot_part_bytes)
        snapshot_id = uuid.uuid4().hex
        as_of = AsOf(offset=position.offset, entry_id=position.entry_id, epoch=position.epoch,
                     writer=position.writer)
        entries = [
            SnapshotPart(log_id=position.log_id, entry_id=uuid.uuid4().hex,
                         epoch=position.epoch, writer=self.writer_id,
                         snapshot_from=position.snapshot_from, payload=payload,
                         snapshot=PartHeader(id=snapshot_id, part=number, parts=len(payloads),
                                             as_of=as_of))
            for number, payload in enumerate(payloads)]
        bodies = [entry.encode() for entry in entries]
        for entry, body in zip(entries[:-1], bodies, strict=False):
            await self._publish(entry, body)
        if not await self._append(entries[-1], bodies[-1]):
            self.is_writer = False
            raise LogFenced("another allocator claimed the ledger log during the snapshot")
        now = self.position
        stored = sum(len(body) + ENTRY_OVERHEAD_BYTES for body in bodies)
        taken = SnapshotTaken(position.offset, len(payloads), sum(map(len, payloads)), stored,
                              time.monotonic() - began,
                              now is not None and now.snapshot_from == position.offset)
        if taken.whole:
            self.snapshots_taken += 1
            self.last_snapshot = taken
            log.info("ledger log %s: snapshot of the ledger at offset %d appended (%d bytes "
                     "in %d parts, %.2f s)", self.stream, position.offset, taken.payload_bytes,
                     taken.parts, taken.seconds)
            if snapshot_outgrows_retention(taken.stored_bytes, max_bytes=self.max_bytes,
                                           segment_bytes=self.segment_bytes,
                                           snapshot_bytes=self.snapshot_bytes):
                log.error("ledger log %s: a snapshot of %d bytes is too large for the "
                          "stream's retention: with ledger_log_max_bytes = %d, "
                          "ledger_log_segment_bytes = %d and ledger_log_snapshot_bytes = %d "
                          "the newest snapshot may be dropped before the next one is whole; "
                          "raise ledger_log_max_bytes (docs/operations.md)", self.stream,
                          taken.stored_bytes, self.max_bytes, self.segment_bytes,
                          self.snapshot_bytes)
        else:
            log.warning("ledger log %s: the snapshot at offset %d was broken by another "
                        "allocator's entry; the next batch tries again", self.stream,
                        position.offset)
        return taken

    async def _publish(self, entry: Entry, body: bytes | None = None) -> None:
        """Publish ``entry`` (``body``: its encoding, if made already)."""
        assert self._publish_channel is not None, "start() first"
        await self._publish_channel.default_exchange.publish(
            aio_pika.Message(body=entry.encode() if body is None else body,
                             content_type="application/x-ndjson" if entry.kind == "snapshot"
                             else "application/json",
                             delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
            routing_key=self.stream, timeout=self.timeout_s)

    async def _append(self, entry: Entry, body: bytes | None = None) -> bool:
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters[entry.entry_id] = waiter
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._publish(entry, body)
                return await waiter
        except LogUnavailable:
            self.is_writer = False
            raise
        except TimeoutError:
            # It may still land: a later claim of ours (the writer is re-elected after any
            # doubt) fences it, or everyone applies it before that claim; either way alike.
            self.is_writer = False
            raise LogUnavailable(f"the ledger log {self.stream} did not return the entry "
                                 f"within {self.timeout_s:g} s") from None
        except (aio_pika.exceptions.AMQPError, OSError, RuntimeError) as exc:
            self.is_writer = False
            raise LogUnavailable(f"cannot append to the ledger log {self.stream}: "
                                 f"{exc or type(exc).__name__}") from exc
        finally:
            self._waiters.pop(entry.entry_id, None)

    def _raise_if_mismatched(self) -> None:
        if self.mismatch is not None:
            raise self.mismatch

    def _raise_if_stalled(self) -> None:
        # A claim would be appended and then wait for an apply that cannot happen here.
        if self.store.failure is not None:
            raise LogStalled(f"this replica's ledger cannot apply the ledger log "
                             f"{self.stream} now: {self.store.failure}")

    # ------------------------------------------------------------------ reads

    async def _apply_loop(self) -> None:
        while True:
            generation, message = await self._inbox.get()
            try:
                if generation == self._generation:
                    await self._apply_message(message)
            except LogMismatch as exc:
                self._mismatched(exc)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a broken entry must not pass silently: stop serving
                log.exception("ledger log entry could not be applied")
                self._mismatched(LogMismatch(f"ledger log entry could not be applied: {exc}"))
            with contextlib.suppress(Exception):  # bounded: a half-closed channel may hang
                async with asyncio.timeout(self.timeout_s):
                    await message.ack()
            if self.mismatch is not None:
                return

    def _mismatched(self, exc: LogMismatch) -> None:
        log.error("%s", exc)
        self.mismatch = exc
        self.is_writer = False
        self.mismatch_event.set()
        self.caught_up.set()  # nothing to wait for: claim() raises the mismatch
        self._verified.set()
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(exc)

    def _not_the_history(self, why: str) -> LogMismatch:
        return LogMismatch(
            f"the ledger {self.ledger.path} is not the history of the ledger log "
            f"{self.stream}: {why}. Empty its folder (it then loads the log's newest "
            "snapshot) or restore a backup of a current replica (docs/operations.md).")

    async def _apply_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        offset = offset_of(message)
        entry = decode_entry(message.body)
        if self._catch_up is not None:
            await self._catch_up_with(offset, entry)
            return
        position = self.position
        if self._verify is not None:
            # The first entry read must be the one this ledger applied last.
            expected, self._verify = self._verify, None
            self._verified.set()
            assert position is not None
            if not await self._act_on(resume(position, expected, offset, entry), offset,
                                      entry):
                return
        if position is not None and offset <= position.offset:
            return  # a redelivery after a reconnect: applied already
        if position is None:
            if not await self._act_on(join(self._ledger_had_data, self.writer_id, offset,
                                           entry), offset, entry):
                return
            log_id, epoch, writer = entry.log_id, 0, ""
        else:
            if entry.log_id != position.log_id and not entry.genesis:
                raise LogMismatch(f"ledger log {self.stream} holds entries of log "
                                  f"{entry.log_id}; this ledger follows {position.log_id}")
            log_id, epoch, writer = position.log_id, position.epoch, position.writer
        fenced = fence(entry, log_id, epoch, writer)
        epoch, writer = fenced.epoch, fenced.writer
        snapshot_from = position.snapshot_from if position is not None else None
        grown = grown_since_snapshot(position, len(message.body))
        seed = None
        snapshot = self._assembly.see(entry.seen(offset))
        if snapshot is not None and fenced.accepted:
            snapshot_from, grown = snapshot.header.as_of.offset, 0
            if snapshot.as_of_genesis and snapshot.header.as_of.writer != self.writer_id:
                # The ledger the log was started from: every other replica loads it.
                seed = await asyncio.to_thread(decode_parts, snapshot.payloads)
        new_position = LogPosition(log_id, offset, entry.entry_id, epoch, writer,
                                   snapshot_from, grown)

        def commit() -> None:
            if seed is not None:
                self.ledger.load_snapshot(seed, new_position)
            else:
                self.ledger.commit(fenced.changes, position=new_position)

        await self.store.write(commit)
        self.position = new_position
        self._consume_arguments["x-stream-offset"] = offset + 1
        if fenced.accepted:
            self.entries_applied += 1
        else:
            self.entries_fenced += 1
            log.warning("ledger log %s: skipped a %s of writer %s (epoch %d): fenced by "
                        "epoch %d", self.stream, entry.kind, entry.writer[:8], entry.epoch,
                        epoch)
        if writer != self.writer_id or epoch != self._claimed_epoch:
            self.is_writer = False
        # Never made the writer here: after a drop or a timeout, entries of this allocator
        # that were in flight still arrive, and taking them for a mandate would let it decide
        # on a memory that lacks them (the same request key granted twice, seen in the
        # broker-cluster test). Only a claim (:meth:`claim`) makes it the writer again.
        self._resolve(entry.entry_id, fenced.accepted)

    async def _act_on(self, verdict: Verdict, offset: int, entry: Entry) -> bool:
        """Carry out a verdict of :mod:`~allocator.ledger.log_rules` on the entry at
        ``offset``; True when the entry is still to be applied by the epoch rule."""
        if isinstance(verdict, NotHistory):
            raise self._not_the_history(verdict.why)
        if isinstance(verdict, CatchUp):
            await self._begin_catch_up(offset, entry, verdict.log_id, verdict.why)
            return False
        if isinstance(verdict, Applied):
            self._assembly = SnapshotAssembly(
                (offset, entry.entry_id, entry.log_id, entry.genesis), keep_payloads=False)
            return False
        return True

    def _store_failed(self, exc: LedgerUnwritable) -> None:
        """This replica's storage refused an entry: it stops serving until it takes it."""
        self.is_writer = False
        stalled = LogStalled(f"the entry is in the ledger log {self.stream}, but this "
                             f"replica's ledger cannot apply it now ({exc})")
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(stalled)

    def _resolve(self, entry_id: str, accepted: bool) -> None:
        waiter = self._waiters.get(entry_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(accepted)

    # ------------------------------------------------------------------ catching up

    async def _begin_catch_up(self, offset: int, entry: Entry, log_id: str | None,
                              why: str) -> None:
        """Load the log's newest snapshot instead of this ledger's state (``log_id``: the
        log the snapshot must be of), then follow the log from it."""
        log.warning("ledger log %s: %s; catching up from the log's newest snapshot",
                    self.stream, why)
        self.caught_up.clear()
        self._catch_up = SnapshotSearch(log_id)
        hint = await self._newest_snapshot_hint(log_id or entry.log_id)
        if hint is not None and hint > offset:
            self._catch_up.hint = hint
            log.info("ledger log %s: the newest snapshot starts at offset %d; reading it",
                     self.stream, hint)
            await self._follow_again(hint)
            return
        await self._catch_up_with(offset, entry)  # no pointer to follow: scan from here

    async def _newest_snapshot_hint(self, log_id: str) -> int | None:
        """Where the newest whole snapshot starts, as the stream's newest entry says."""
        assert self._connection is not None
        try:
            return await newest_snapshot_start(self._connection, self.stream, log_id,
                                               self.timeout_s)
        except (TimeoutError, aio_pika.exceptions.AMQPError, OSError) as exc:
            log.warning("ledger log %s: the newest entry did not say where the newest "
                        "snapshot is (%s); looking from the oldest entry kept", self.stream,
                        exc or type(exc).__name__)
            return None

    async def _scan_from_oldest(self, why: str) -> None:
        log.warning("ledger log %s: %s; looking for the first whole snapshot from the oldest "
                    "entry kept", self.stream, why)
        assert self._catch_up is not None
        self._catch_up = SnapshotSearch(self._catch_up.log_id)
        await self._follow_again("first")

    async def _catch_up_with(self, offset: int, entry: Entry) -> None:
        """Read one entry while catching up: nothing is applied until a whole snapshot is
        read; then it is loaded and the log is followed from its last part."""
        assert self._catch_up is not None
        snapshot = self._catch_up.see(offset, entry)
        if isinstance(snapshot, ScanFromOldest):
            await self._scan_from_oldest(snapshot.why)
            return
        if isinstance(snapshot, NotHistory):
            raise self._not_the_history(snapshot.why)
        if snapshot is None:
            return
        tables = await asyncio.to_thread(decode_parts, snapshot.payloads)
        header = snapshot.header
        position = LogPosition(snapshot.log_id, snapshot.last_offset, snapshot.last_entry_id,
                               header.as_of.epoch, header.as_of.writer, header.as_of.offset, 0)
        await self.store.write(lambda: self.ledger.load_snapshot(tables, position,
                                                            loaded_at=time.time()))
        self.position = position
        self._catch_up = None
        self._assembly = SnapshotAssembly(
            (snapshot.last_offset, snapshot.last_entry_id, snapshot.log_id, False),
            keep_payloads=False)
        self._consume_arguments["x-stream-offset"] = offset + 1
        self.snapshots_loaded += 1
        self.is_writer = False
        self.caught_up.set()
        log.info("ledger log %s: loaded the snapshot at offset %d (%d bytes in %d parts, "
                 "epoch %d); following from offset %d", self.stream, header.as_of.offset,
                 snapshot.size, header.parts, header.as_of.epoch, offset + 1)
