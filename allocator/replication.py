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

Writers and epochs. Each entry is a *claim* (``epoch``, ``writer``) or a *batch* (``epoch``,
``writer``, changes). Every replica applies the same rules to the same sequence:

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
applied, in the same transaction as the entry (:class:`~allocator.ledger.LogPosition`). At
start it reads the log from that entry on, checking it is the one it applied: a ledger of
another log, one with data but never part of a log while the log has entries, or one older
than the oldest entry the stream retains is refused (:class:`LogMismatch`): it is not the
active one's history, and the allocator does not serve from it. An empty ledger replays the
log from its start. A ledger with data starting a new log puts a snapshot of itself in the
log right after its claim, so that every replica's copy is whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import aio_pika
import aio_pika.abc

from allocator.ledger import Changes, Ledger, LedgerError, LogPosition

log = logging.getLogger(__name__)

ENTRY_VERSION = 1
"""Version of the entry format; an entry of another version stops the replica."""


class LogFenced(LedgerError):
    """Another allocator claimed the log first: this one's batch was not applied anywhere."""


class LogUnavailable(LedgerError):
    """The entry did not come back in time: it may still be applied later (by everyone)."""


class LogMismatch(LedgerError):
    """This ledger is not the log's history; the allocator must not serve from it."""


@dataclass(frozen=True)
class Entry:
    """One entry of the log."""

    kind: Literal["claim", "batch"]
    log_id: str
    entry_id: str
    epoch: int
    writer: str
    changes: dict[str, Any] | None = None
    genesis: bool = False

    def encode(self) -> bytes:
        return json.dumps({"v": ENTRY_VERSION, "kind": self.kind, "log_id": self.log_id,
                           "entry_id": self.entry_id, "epoch": self.epoch,
                           "writer": self.writer, "changes": self.changes,
                           "genesis": self.genesis}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, body: bytes) -> Entry:
        data = json.loads(body)
        if data.get("v") != ENTRY_VERSION or data.get("kind") not in ("claim", "batch"):
            raise ValueError(f"not a ledger log entry of version {ENTRY_VERSION}")
        return cls(kind=data["kind"], log_id=str(data["log_id"]),
                   entry_id=str(data["entry_id"]), epoch=int(data["epoch"]),
                   writer=str(data["writer"]), changes=data.get("changes"),
                   genesis=bool(data.get("genesis")))


class ReplicatedLog:
    """One replica's side of the log: its consumer, its applier and, when active, its writes."""

    def __init__(self, ledger: Ledger, stream: str, *, max_bytes: int, timeout_s: float,
                 writer_id: str | None = None) -> None:
        self.ledger = ledger
        self.stream = stream
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.writer_id = writer_id or uuid.uuid4().hex
        """This allocator process as the log knows it."""
        self.position: LogPosition | None = None
        self.is_writer = False
        """Whether this process's :meth:`claim` made it the writer and nothing ended that
        since: another writer's claim, a skipped batch, a dropped connection or an entry that
        did not come back in time. Entries of its own that arrive later do not restore it."""
        self.mismatch: LogMismatch | None = None
        """Set when the log is not this ledger's history: stop serving."""
        self.mismatch_event = asyncio.Event()
        self._ledger_had_data = False
        self._verify: str | None = None
        """Entry id expected at the position the consumer starts from (already applied)."""
        self._waiters: dict[str, asyncio.Future[bool]] = {}
        self._inbox: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
        self._channel: aio_pika.abc.AbstractChannel | None = None
        self._publish_channel: aio_pika.abc.AbstractChannel | None = None
        self._applier: asyncio.Task[None] | None = None
        self._consume_arguments: dict[str, Any] = {}
        """The stream consumer's arguments; its offset follows the entries applied."""
        self.entries_applied = 0
        self.entries_fenced = 0

    # ------------------------------------------------------------------ life

    async def start(self, connection: aio_pika.abc.AbstractConnection) -> None:
        """Declare the stream and follow it from this ledger's position."""
        self.position = await self.ledger.run(self.ledger.log_position)
        self._ledger_had_data = not await self.ledger.run(self.ledger.is_empty)
        self._channel = await connection.channel()
        await self._channel.set_qos(prefetch_count=1000)
        queue = await self._channel.declare_queue(
            self.stream, durable=True,
            arguments={"x-queue-type": "stream", "x-max-length-bytes": self.max_bytes})
        self._publish_channel = await connection.channel(publisher_confirms=False)
        start: int | str = "first"
        if self.position is not None:
            start = self.position.offset
            self._verify = self.position.entry_id
        self._applier = asyncio.create_task(self._apply_loop(), name="ledger-log-apply")
        # aio-pika's robust queue keeps this very dict to consume again after a reconnect
        # (to the same broker node or another): with the offset kept past the last entry
        # applied, a reconnect resumes there instead of replaying the log from the start
        # (which would be correct too, only slow: applied offsets are skipped).
        self._consume_arguments = {"x-stream-offset": start}
        await queue.consume(self._inbox.put, arguments=self._consume_arguments)
        connection.close_callbacks.add(self._connection_lost)
        log.info("ledger log %s: following from %s (%s)", self.stream, start,
                 f"epoch {self.position.epoch}" if self.position else "a ledger new to it")

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
        attempt claims on the current picture.
        """
        for attempt in range(attempts):
            self._raise_if_mismatched()
            genesis = self.position is None
            log_id = uuid.uuid4().hex if self.position is None else self.position.log_id
            epoch = (self.position.epoch if self.position else 0) + 1
            entry = Entry("claim", log_id, uuid.uuid4().hex, epoch, self.writer_id,
                          genesis=genesis)
            if await self._append(entry):
                # Unless another writer's claim was applied right after this one.
                self.is_writer = self.position is not None \
                    and self.position.writer == self.writer_id
                break
            if attempt == attempts - 1:
                raise LogFenced(f"other allocators kept claiming the ledger log {self.stream}")
        if genesis and self._ledger_had_data:
            snapshot = await self.ledger.run(self.ledger.snapshot)
            await self.append(snapshot)
            log.info("ledger log %s started from this ledger (a snapshot of it is its second "
                     "entry)", self.stream)
        log.info("ledger log %s: this allocator is the writer (epoch %d)", self.stream, epoch)
        return genesis

    async def append(self, changes: Changes) -> None:
        """Append one batch and wait until it is applied to this ledger.

        Raises :class:`LogFenced` if a newer writer claimed the log first (the batch is
        applied nowhere) and :class:`LogUnavailable` if the entry did not come back in time.
        """
        self._raise_if_mismatched()
        if not self.is_writer or self.position is None:
            raise LogFenced("this allocator is not the writer of the ledger log")
        entry = Entry("batch", self.position.log_id, uuid.uuid4().hex, self.position.epoch,
                      self.writer_id, changes=changes.to_json())
        if not await self._append(entry):
            self.is_writer = False
            raise LogFenced("another allocator claimed the ledger log; this batch was fenced")

    async def _append(self, entry: Entry) -> bool:
        assert self._publish_channel is not None, "start() first"
        waiter: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._waiters[entry.entry_id] = waiter
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._publish_channel.default_exchange.publish(
                    aio_pika.Message(body=entry.encode(), content_type="application/json",
                                     delivery_mode=aio_pika.DeliveryMode.PERSISTENT),
                    routing_key=self.stream, timeout=self.timeout_s)
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

    # ------------------------------------------------------------------ reads

    async def _apply_loop(self) -> None:
        while True:
            message = await self._inbox.get()
            try:
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
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(exc)

    async def _apply_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        offset = int((message.headers or {}).get("x-stream-offset", -1))  # type: ignore[arg-type]
        entry = Entry.decode(message.body)
        position = self.position
        if self._verify is not None:
            # The first entry read must be the one this ledger applied last.
            expected, self._verify = self._verify, None
            assert position is not None
            if offset == position.offset and entry.entry_id == expected:
                return
            if offset > position.offset + 1 or offset < position.offset or \
                    entry.log_id != position.log_id or offset == position.offset:
                raise LogMismatch(
                    f"the ledger {self.ledger.path} is not the history of the ledger log "
                    f"{self.stream}: it applied entry {expected} at offset {position.offset} "
                    f"of log {position.log_id}, the log has entry {entry.entry_id} of log "
                    f"{entry.log_id} at offset {offset}. Seed it from a backup of a current "
                    "replica (docs/operations.md) or empty it to replay the log.")
        if position is not None and offset <= position.offset:
            return  # a redelivery after a reconnect: applied already
        if position is None:
            if not entry.genesis or offset != 0 or (
                    self._ledger_had_data and entry.writer != self.writer_id):
                raise LogMismatch(
                    f"the ledger {self.ledger.path} is not the history of the ledger log "
                    f"{self.stream}: " + (
                        "it has data but was never part of this log"
                        if self._ledger_had_data else
                        f"the log's oldest entry kept is offset {offset}, not its start")
                    + ". Seed it from a backup of a current replica (docs/operations.md).")
            log_id, epoch, writer = entry.log_id, 0, ""
        else:
            if entry.log_id != position.log_id and not entry.genesis:
                raise LogMismatch(f"ledger log {self.stream} holds entries of log "
                                  f"{entry.log_id}; this ledger follows {position.log_id}")
            log_id, epoch, writer = position.log_id, position.epoch, position.writer
        changes = Changes()
        accepted = False
        if entry.log_id != log_id:
            pass  # a second replica's attempt to start the log, after the first: skipped
        elif entry.kind == "claim":
            if entry.epoch > epoch:
                accepted, epoch, writer = True, entry.epoch, entry.writer
        elif entry.epoch == epoch and entry.writer == writer:
            accepted = True
            changes = Changes.from_json(entry.changes or {})
        new_position = LogPosition(log_id, offset, entry.entry_id, epoch, writer)

        def commit() -> None:
            self.ledger.commit(changes, position=new_position)

        await self.ledger.run(commit)
        self.position = new_position
        self._consume_arguments["x-stream-offset"] = offset + 1
        if accepted:
            self.entries_applied += 1
        else:
            self.entries_fenced += 1
            log.warning("ledger log %s: skipped a %s of writer %s (epoch %d): fenced by "
                        "epoch %d", self.stream, entry.kind, entry.writer[:8], entry.epoch,
                        epoch)
        if writer != self.writer_id:
            self.is_writer = False
        # Never made the writer here: after a drop or a timeout, entries of this allocator
        # that were in flight still arrive, and taking them for a mandate would let it decide
        # on a memory that lacks them (the same request key granted twice, seen in the
        # broker-cluster test). Only a claim (:meth:`claim`) makes it the writer again.
        waiter = self._waiters.get(entry.entry_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(accepted)

