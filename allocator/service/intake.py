"""Deliveries in, batches out: what the consumer puts into the inbox, and the next batch.

:class:`Intake` owns the :class:`~allocator.service.inbox.Inbox` (requests ahead of node
messages, each lane in arrival order) and the two events the applier waits on. Timer ticks
(:data:`TICK`) go into the node lane like messages, so timers are serialized with messages
and need no locks. A batch holds at most ``batch_max`` items of each lane; one of nothing but
heartbeats and ticks lingers up to ``heartbeat_linger_s`` for company (docs/design.md,
"Heartbeat batches linger; nothing else does").

A delivery can only be settled on the channel it came on. Once that channel has closed the
broker has given the delivery back to the queue, and so to the active allocator: such a
delivery is *stale* and is dropped here unapplied, counted and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import aio_pika.abc
import aiormq.abc
from aiormq.exceptions import ChannelInvalidStateError

from allocator.config import AllocatorSettings
from allocator.metrics.counters import Count, ServiceStats
from allocator.service.inbox import Inbox
from allocator.wire.topology import HEARTBEAT_ROUTING_PREFIX, NODES_EXCHANGE

log = logging.getLogger(__name__)

TICK = object()
"""A timer tick in the inbox: the engine's timers run when the applier reaches it."""

Delivery = tuple[aiormq.abc.AbstractChannel, int]
"""The channel and delivery tag that settle one delivery."""


def delivery_of(message: aio_pika.abc.AbstractIncomingMessage) -> Delivery | None:
    """The channel and delivery tag that settle ``message``; None once its channel has
    closed (the broker has given the delivery back to the queue)."""
    if message.delivery_tag is None:
        return None
    try:
        return message.channel, message.delivery_tag
    except ChannelInvalidStateError:
        return None


def channel_closed(message: aio_pika.abc.AbstractIncomingMessage) -> bool:
    """Whether the channel a delivery came on has closed (aio-pika raises on a closed one)."""
    try:
        return message.channel.is_closed
    except ChannelInvalidStateError:
        return True


def may_linger(item: object, awaited: Callable[[str], bool] | None = None) -> bool:
    """Whether ``item`` may wait for company before it is applied: a tick, or a heartbeat of
    a host whose report nothing waits for (``awaited(host)`` false).

    Told by the routing key, before decoding; a message that only claims to be a heartbeat
    lingers at most ``heartbeat_linger_s`` and is then refused as usual. A report that a
    GPU's hand-over waits for (its last lease's processes to be seen gone: a drain) is
    applied at once: the linger would add itself to every hand-over.
    """
    if item is TICK:
        return True
    routing_key = getattr(item, "routing_key", None)
    if not (isinstance(routing_key, str) and routing_key.startswith(HEARTBEAT_ROUTING_PREFIX)):
        return False
    return awaited is None or not awaited(routing_key[len(HEARTBEAT_ROUTING_PREFIX):])


class Intake:
    """The inbox between the consumer and the applier.

    Invariant: every delivery in the inbox that can be settled came on the channel of the
    newest delivery (a reconnect brings a new channel, and what the old one delivered is
    dropped as stale),
    so :meth:`oldest_deliveries` speaks of the one channel acknowledgements go out on.
    """

    def __init__(self, settings: AllocatorSettings, stats: ServiceStats,
                 awaited: Callable[[str], bool] | None = None) -> None:
        self.settings = settings
        self._stats = stats
        self._awaited = awaited
        """Whether a host's next report is awaited (a GPU of it drains): its heartbeats do
        not linger (:func:`may_linger`)."""
        self._inbox: Inbox[object, aiormq.abc.AbstractChannel] = Inbox()
        self._arrived = asyncio.Event()
        """Set when something is put into the empty inbox."""
        self._wake = asyncio.Event()
        """Set when a message arrives that must not wait out a heartbeat batch's linger."""
        self._last_delivery: float | None = None
        """``time.monotonic()`` of the newest delivery; None before the first."""
        self._delivery_channel: aiormq.abc.AbstractChannel | None = None
        """The channel of the newest delivery."""

    @property
    def last_delivery(self) -> float | None:
        """When (``time.monotonic()``) the newest delivery arrived; None before the first."""
        return self._last_delivery

    async def on_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        """The consumer's callback: put ``message`` into its lane."""
        self._last_delivery = time.monotonic()
        delivery = delivery_of(message)
        if delivery is not None and delivery[0] is not self._delivery_channel:
            if self._delivery_channel is not None:
                # A new channel: what the old one delivered and nobody applied yet can no
                # longer be settled, and the broker has given it back to the queue.
                self.drop_stale(len(self._inbox.keep_channel(delivery[0])))
            self._delivery_channel = delivery[0]
        self._inbox.put(message, request=message.exchange != NODES_EXCHANGE, delivery=delivery)
        self._arrived.set()
        if (not may_linger(message, self._awaited)
                or len(self._inbox) >= self.settings.batch_max):
            self._wake.set()

    def put_tick(self) -> None:
        """Put a timer tick into the node lane."""
        self._inbox.put(TICK, request=False)
        self._arrived.set()

    async def next_batch(self) -> list[object]:
        """The next batch: what the inbox holds, up to ``batch_max`` messages of each lane
        (requests, node messages), in arrival order.

        A batch of nothing but heartbeats (and ticks), taken while the inbox had nothing
        more, first waits up to ``heartbeat_linger_s`` for more. Heartbeats answer nobody
        and a few tens of milliseconds mean nothing to liveness, while a commit each (a
        quiet cluster's batches are one message long) was most of what a heartbeat cost.
        A request or a container event arriving meanwhile ends the wait at once, so neither
        waits for it; neither does anything else once the inbox holds a full batch.
        """
        while not self._inbox:
            self._arrived.clear()
            await self._arrived.wait()
        batch_max = self.settings.batch_max
        batch = self._inbox.take(batch_max)
        linger = self.settings.heartbeat_linger_s
        if (linger > 0 and len(batch) < batch_max and not self._inbox
                and all(may_linger(item, self._awaited) for item in batch)):
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(linger):
                    await self._wake.wait()
            batch += self._inbox.take(batch_max - len(batch))
        return batch

    def without_stale(self, batch: list[object]) -> list[object]:
        """The batch without deliveries whose channel has closed since they arrived.

        Such a delivery cannot be acknowledged any more, and the broker has given it back to
        the queue, to the active allocator: this one was stopped or cut off long enough for
        the broker to close its channel (a paused process, a lost connection). Deciding it
        here would be a second decision on a request another allocator is answering.
        """
        fresh = [item for item in batch if not (
            isinstance(item, aio_pika.abc.AbstractIncomingMessage) and channel_closed(item))]
        self.drop_stale(len(batch) - len(fresh))
        return fresh

    def drop_stale(self, count: int) -> None:
        """Count and log ``count`` deliveries dropped unapplied as stale."""
        if count:
            self._stats.counters.add(Count.STALE_DELIVERIES, count)
            log.warning("dropped %d message(s) whose channel closed before they were applied "
                        "(the broker gives them to the active allocator)", count)

    def oldest_deliveries(self) -> list[Delivery]:
        """The oldest delivery still waiting in each lane: an acknowledgement must not
        reach it (:func:`allocator.service.inbox.acknowledgements`)."""
        return self._inbox.oldest_deliveries()
