"""What goes back to the callers, always after the commit that decided it: replies,
acknowledgements (or a reject to the dead-letter queue, or a requeue), and the pushes of a
queued lease's outcome to the clients waiting for it.

A reply that cannot be sent loses nothing: the decision is in the ledger, and the caller's
retry (idempotent by ``request_key``) or ``status`` call finds it. No settlement may block
the applier: each is bounded in time and never raises.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass

import aio_pika
import aio_pika.abc
from aiormq.exceptions import AMQPError, ChannelInvalidStateError
from pydantic import BaseModel

from allocator.config import AllocatorSettings
from allocator.engine import Engine, Sender
from allocator.ledger.store import Ledger
from allocator.metrics.counters import Count, ServiceStats
from allocator.service.inbox import acknowledgements
from allocator.service.intake import Intake, delivery_of
from allocator.service.waiters import ReplyAddress, Waiters
from allocator.wire.protocol import OLDEST_READER, LeaseState, encode, reader_release

log = logging.getLogger(__name__)


@dataclass
class Pending:
    """One message of a batch, and what to send back once the batch is committed."""

    message: aio_pika.abc.AbstractIncomingMessage
    reply: BaseModel | None = None
    lookup: tuple[str | None, str | None] | None = None
    """(lease_id, request_key) to look up in the ledger when memory had no such lease."""
    dead_letter: bool = False
    """Reject it to the dead-letter queue instead of acknowledging it."""
    kind: str = "invalid"
    """The message kind, for the latency histogram."""
    waits: str | None = None
    """The queued lease this reply reports: its outcome is pushed to the same address."""


class Answers:
    """Replies, settlements and pushes, on the inbound queue's channel.

    Owns the reply addresses of queued leases (:class:`~allocator.service.waiters.Waiters`):
    kept in memory only, and forgotten once their lease's outcome is pushed.
    """

    def __init__(self, settings: AllocatorSettings, ledger: Ledger, engine: Engine,
                 stats: ServiceStats, intake: Intake) -> None:
        self.settings = settings
        self._ledger = ledger
        self._engine = engine
        self._stats = stats
        self._intake = intake
        """Asked which deliveries still wait, so that no acknowledgement reaches them."""
        self._channel: aio_pika.abc.AbstractChannel | None = None
        """The channel replies go out on (the inbound queue's); None until :meth:`attach`."""
        self._waiters = Waiters()

    def attach(self, channel: aio_pika.abc.AbstractChannel) -> None:
        """Send replies and pushes on ``channel`` from now on."""
        self._channel = channel

    async def resolve_lookups(self, pending: list[Pending]) -> None:
        """Answer status/release of leases that left memory long ago from the ledger."""
        for entry in pending:
            if entry.lookup is None:
                continue
            lease_id, request_key = entry.lookup
            ledger = self._ledger
            sender = Sender(user_id=entry.message.user_id, via_nodes_exchange=False)
            fetch = (functools.partial(ledger.find_lease, lease_id) if lease_id is not None
                     else functools.partial(  # the asker's own key space, as in the engine
                         ledger.latest_lease_for_key, request_key or "", asker=sender.user_id,
                         every_owner=sender.user_id in self._engine.settings.admin_users))
            record = await ledger.run(fetch)
            if record is not None and entry.reply is not None:
                # Another hub's lease stays another's when it is read from the ledger.
                entry.reply = self._engine.lease_reply_for(
                    record, sender, "release" if entry.kind == "release" else "see")

    def remember_waiters(self, pending: list[Pending]) -> None:
        """Each queued answer of the batch names where the lease's outcome is pushed."""
        for entry in pending:
            if entry.waits is not None and entry.message.reply_to and entry.message.correlation_id:
                self._waiters.remember(entry.waits, ReplyAddress(
                    entry.message.reply_to, entry.message.correlation_id,
                    reader_release(entry.message.headers)))

    async def push_waiting(self) -> None:
        """Push the outcome of every lease with a waiting client that has left the queue
        (after a reload: what the ledger says now is committed, another allocator's
        decisions included)."""
        await self.push_outcomes(self._waiters.lease_ids())

    async def push_outcomes(self, lease_ids: Iterable[str]) -> None:
        """Publish the lease to the waiting client of each of ``lease_ids`` that has left the
        queue (after the commit that decided it, like every reply), then forget the address.

        A push that is lost (the client went away, the broker is down) loses nothing: the
        grant is in the ledger, and the client's retry or status call finds it.
        """
        waiters = self._waiters
        if not len(waiters):
            return
        decided = [lease_id for lease_id in lease_ids
                   if lease_id in waiters and not self._still_queued(lease_id)]
        replies: dict[str, BaseModel | None] = {}
        for lease_id, address in waiters.take(decided):
            if lease_id not in replies:
                record = self._engine.find(lease_id, None)
                if record is None:
                    record = await self._ledger.run(
                        functools.partial(self._ledger.find_lease, lease_id))
                # None cannot happen: the ledger keeps every lease
                replies[lease_id] = None if record is None else self._engine.lease_reply(record)
            reply = replies[lease_id]
            if reply is None:
                continue
            sent = await self.publish_reply(reply, address.reply_to, address.correlation_id,
                                            address.release)
            self._stats.counters.add(Count.PUSHES if sent else Count.PUSH_FAILURES)

    def _still_queued(self, lease_id: str) -> bool:
        record = self._engine.leases.get(lease_id)
        return record is not None and record.state is LeaseState.QUEUED

    async def publish_reply(self, reply: BaseModel, reply_to: str, correlation_id: str | None,
                            release: tuple[int, int, int] = OLDEST_READER) -> bool:
        """Publish one reply, written for a client of ``release`` (the fields a later release
        added left out: :func:`allocator.wire.protocol.encode`); False when it could not be sent
        (logged)."""
        channel = self._channel
        if channel is None:
            return False
        try:
            await channel.default_exchange.publish(
                aio_pika.Message(
                    body=encode(reply, release=release),
                    content_type="application/json",
                    correlation_id=correlation_id,
                ),
                routing_key=reply_to,
                # Not mandatory: RabbitMQ 3.10 returns mandatory publishes to a
                # direct reply-to address even when it delivered them.
                mandatory=False,
                timeout=self.settings.request_timeout_s,
            )
        except (AMQPError, aio_pika.exceptions.AMQPError, TimeoutError, OSError,
                ChannelInvalidStateError) as exc:
            # The client is gone (its direct reply-to consumer closed) or the broker
            # is down (the channel is closed until the robust connection restores it:
            # ChannelInvalidStateError, a RuntimeError); the decision stands in the
            # ledger and a retry will find it.
            log.info("could not send a reply: %s", exc)
            return False
        return True

    async def reply_and_ack(self, pending: list[Pending]) -> None:
        """Send replies, then acknowledge (after the commit, never before)."""
        for entry in pending:
            if entry.reply is not None:
                sent = await self.publish_reply(entry.reply, entry.message.reply_to or "",
                                                entry.message.correlation_id,
                                                reader_release(entry.message.headers))
                self._stats.counters.add(Count.REPLIES if sent else Count.REPLY_FAILURES)
        for entry in pending:
            if entry.dead_letter:
                # Rejected without requeue: the queue's dead-letter exchange keeps it for a
                # person to look at.
                self._stats.counters.add(Count.DEAD_LETTERED)
                await self.settle(entry.message.reject(requeue=False))
        # As few acknowledgements as settle exactly the rest: mostly one multiple=True per
        # batch (a frame, and a socket write, per message was the costliest part of a
        # heartbeat), plus one each for requests taken ahead of node messages still waiting.
        by_delivery = {key: entry.message for entry in pending if not entry.dead_letter
                       if (key := delivery_of(entry.message)) is not None}
        for ack in acknowledgements(by_delivery, self._intake.oldest_deliveries()):
            await self.settle(by_delivery[(ack.channel, ack.tag)].ack(multiple=ack.multiple))

    async def settle(self, settlement: Awaitable[object]) -> None:
        """An ack, nack or reject, bounded in time and never raising: on a channel that a
        broker node's loss left half-closed it could wait for good and stop the applier (seen
        with a three-node broker). An unsettled delivery goes back to the queue when its
        channel closes, and requests are idempotent by request key."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.settings.request_timeout_s):
                await settlement

    async def requeue(self, items: Iterable[object]) -> None:
        """Give the messages among ``items`` back to the broker unanswered (another allocator
        is the writer; a quorum queue hands them to the active consumer)."""
        for item in items:
            if isinstance(item, aio_pika.abc.AbstractIncomingMessage):
                await self.settle(item.nack(requeue=True))
