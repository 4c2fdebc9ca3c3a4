"""The allocator's way onto the broker: connecting with retries, going round the broker nodes
of ``amqp_url``, following the replicated ledger log, declaring, consuming, closing.

:class:`BrokerLink` owns the connection, the inbound channel and queue and the consumer; the
parts that publish get the channel or exchange they publish on from it once, at start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import aio_pika.abc
from aiormq.exceptions import AMQPError

from allocator.amqp import broker
from allocator.amqp.broker import broker_address
from allocator.config import AllocatorSettings
from allocator.ledger.replication import LogNotHere, ReplicatedLog
from allocator.ledger.store import Ledger
from allocator.service.declare import declare_agents_exchange, declare_topology
from allocator.tasks import Backoff

log = logging.getLogger(__name__)

STOP_STEP_S = 5.0
"""Bound on each step of stopping (the consumer, the background tasks, the connection): a
broker that does not answer must not hang the shutdown."""

BROKER_RETRY_FIRST_S = 1.0
"""First pause between broker connection attempts at start; it doubles each time..."""
BROKER_RETRY_MAX_S = 10.0
"""...up to this, until ``broker_wait_s`` has passed."""


async def connect(settings: AllocatorSettings, first_node: int = 0
                  ) -> aio_pika.abc.AbstractRobustConnection:
    """The broker connection, waiting up to ``broker_wait_s`` for the broker to listen.

    Swarm may start the allocator before RabbitMQ on a first deploy; exiting at once
    would crash-loop the task. One log line per failed attempt tells the admin why. The
    attempts use plain connections: a robust one whose first attempt is cut short by a
    timeout keeps reconnecting in the background.
    """
    timeout = settings.request_timeout_s
    url = broker.rotate_nodes(settings.amqp_url, first_node)
    deadline = time.monotonic() + settings.broker_wait_s
    backoff = Backoff(BROKER_RETRY_FIRST_S, BROKER_RETRY_MAX_S)
    attempt = 1
    while True:
        try:
            async with asyncio.timeout(timeout):
                probe = await broker.connect(url, timeout=timeout)
            await probe.close()
            break
        except (OSError, TimeoutError, AMQPError) as exc:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            pause = min(backoff.next(), left)
            log.warning("broker %s not reachable (attempt %d: %s); retrying in %.0f s",
                        broker_address(settings.amqp_url), attempt,
                        broker.connection_failure(exc, url), pause)
            await asyncio.sleep(pause)
            attempt += 1
    async with asyncio.timeout(timeout):
        return await broker.connect_robust(url, timeout=timeout)


async def await_broker_nodes(settings: AllocatorSettings, deadline: float) -> None:
    """Before the log's stream is first declared: wait (until ``deadline``) for every
    broker node named in ``amqp_url`` to answer.

    Why: RabbitMQ places a new stream's replicas on the cluster's nodes running at its
    declaration, and 3.10 cannot add a replica on a node that joined the cluster later
    until its stream coordinator has taken that node in (up to a coordinator tick
    later); a command for a stream on such a node before then starts a second stream
    coordinator there, and the stream is stuck on its first nodes (docs/design.md,
    high availability). Declared once every node runs, the stream has a replica on
    each, and the coordinator a member on each. A node that does not come within
    ``broker_wait_s`` is left out, with a warning.
    """
    url = settings.amqp_url
    if len(broker.broker_urls(url)) == 1:
        return
    backoff = Backoff(BROKER_RETRY_FIRST_S, BROKER_RETRY_MAX_S)
    while silent := await broker.silent_nodes(url, timeout=settings.request_timeout_s):
        left = deadline - time.monotonic()
        if left <= 0:
            log.warning("ledger log: declaring the stream %s while broker node(s) %s do "
                        "not answer (broker_wait_s passed): it has no replica there "
                        "until one is added", settings.ledger_log_stream, ", ".join(silent))
            return
        log.info("ledger log: the stream %s is new; waiting for broker node(s) %s to "
                 "answer before declaring it, so that it has a replica on each",
                 settings.ledger_log_stream, ", ".join(silent))
        await asyncio.sleep(min(backoff.next(), left))


async def close_within(connection: aio_pika.abc.AbstractConnection) -> None:
    """Close ``connection``, waiting at most :data:`STOP_STEP_S`, never raising."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(STOP_STEP_S):
            await connection.close()


class BrokerLink:
    """The allocator's connection to the broker and its consumer of the inbound queue.

    The steps are called in order by the service's start: :meth:`connect`, then (with the
    ledger log) :meth:`follow_log`, :meth:`declare`, :meth:`consume`. The connection may
    change in :meth:`follow_log` (it goes on to the next broker node); everything declared
    is declared on the connection it ends on.
    """

    def __init__(self, settings: AllocatorSettings, ledger: Ledger) -> None:
        self.settings = settings
        self._ledger = ledger
        """Written by the replicated log this link follows (its entries go into it)."""
        self._connection: aio_pika.abc.AbstractRobustConnection | None = None
        self._queue: aio_pika.abc.AbstractQueue | None = None
        self._consumer_tag: str | None = None
        """The consumer of the inbound queue while it consumes; None before and after."""

    async def connect(self) -> None:
        """Connect to the first broker node that answers, waiting up to ``broker_wait_s``."""
        self._connection = await connect(self.settings)

    @property
    def up(self) -> bool:
        """Whether the broker connection is open at this moment: False before it is made,
        after it is closed, and while the robust connection reconnects after a drop (its
        ``connected`` event, which a thread may read; ``is_closed`` stays False then)."""
        connection = self._connection
        return connection is not None and connection.connected.is_set()

    async def follow_log(self) -> ReplicatedLog:
        """Follow the replicated log from a broker node that holds a replica of its stream,
        declaring the stream first if it is new; the log, followed on this link's connection.

        A node without a replica refuses the stream's consumer (a broker node that joined
        the cluster after the stream was declared, before it is added as a replica): then
        the next node of ``amqp_url`` is tried, round the list, pausing after each round,
        until ``broker_wait_s`` has passed. Exiting instead would only have Swarm restart
        the allocator, which connects to the same first node again.
        """
        connection = self._open()
        settings = self.settings
        nodes = len(broker.broker_urls(settings.amqp_url))
        deadline = time.monotonic() + settings.broker_wait_s
        moved = 0
        while True:
            replicated = ReplicatedLog(self._ledger, settings.ledger_log_stream,
                                       max_bytes=settings.ledger_log_max_bytes,
                                       segment_bytes=settings.ledger_log_segment_bytes,
                                       snapshot_bytes=settings.ledger_log_snapshot_bytes,
                                       timeout_s=settings.request_timeout_s)
            if not await replicated.exists(connection):
                await await_broker_nodes(settings, deadline)
            try:
                await replicated.start(connection)
                return replicated
            except LogNotHere as exc:
                await replicated.stop()
                await close_within(connection)
                if time.monotonic() >= deadline:
                    raise
                moved += 1
                log.warning("ledger log: %s; connecting to the next broker node", exc)
                if moved % nodes == 0:
                    await asyncio.sleep(min(BROKER_RETRY_MAX_S,
                                            max(0.0, deadline - time.monotonic())))
                connection = self._connection = await connect(settings, first_node=moved)

    async def declare(self) -> tuple[aio_pika.abc.AbstractChannel,
                                     aio_pika.abc.AbstractExchange | None]:
        """Declare the topology; the channel replies go out on (the inbound queue's, with
        the prefetch), and the agents exchange on a channel of its own (None: the broker
        user may not use it, and stop commands are off)."""
        connection = self._open()
        channel = await connection.channel(publisher_confirms=False)
        await channel.set_qos(prefetch_count=self.settings.prefetch)
        self._queue = await declare_topology(connection, self.settings.queue_name,
                                             channel=channel)
        agents = await declare_agents_exchange(connection)
        return channel, agents

    async def consume(self, on_message: Callable[[aio_pika.abc.AbstractIncomingMessage],
                                                 Awaitable[None]]) -> None:
        """Start consuming the inbound queue declared by :meth:`declare`."""
        if self._queue is None:
            raise RuntimeError("consume before declare")
        self._consumer_tag = await self._queue.consume(on_message)

    async def cancel_consumer(self) -> None:
        """Stop consuming (bounded, never raising); nothing more is delivered here."""
        if self._queue is not None and self._consumer_tag is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(STOP_STEP_S):
                    await self._queue.cancel(self._consumer_tag)
        self._consumer_tag = None

    async def close(self) -> None:
        """Close the connection (bounded, never raising). Closing twice is harmless."""
        if self._connection is not None:
            await close_within(self._connection)
            self._connection = None

    def _open(self) -> aio_pika.abc.AbstractRobustConnection:
        if self._connection is None:
            raise RuntimeError("the broker link is not connected")
        return self._connection
