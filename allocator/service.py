"""The allocator process: consumes the inbound queue, applies, commits, then replies.

One task (the applier) takes up to ``batch_max`` requests and ``batch_max`` node messages at
a time (requests go ahead of node messages that arrived before them; each kind keeps its
arrival order: :mod:`allocator.inbox`, docs/design.md "Decisions"), applies them to the
:class:`~allocator.engine.Engine`, commits the whole batch to the ledger in one transaction,
and only then sends the replies and acknowledges the messages. A crash before the commit
loses nothing (the broker redelivers, requests are idempotent by ``request_key``); a failed
commit grants nothing (memory is rebuilt from the ledger and every request in the batch is
answered ``storage_error``).

Commands the batch decided for node agents (stop a lease's container) are published to the
agents exchange after the commit, before the replies: fire-and-forget, each bounded in time;
a command that cannot be published is logged and counted and never fails the batch (Swarm
still stops the task, later, and a container that heartbeats keep listing is asked again).

Timers (queue waits, bind deadlines, node silence) are ticks put into the same inbox, so
they are serialized with messages and need no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import aio_pika
import aio_pika.abc
import aiormq.abc
import aiormq.exceptions
from aiormq.exceptions import AMQPError, ChannelInvalidStateError
from pydantic import BaseModel

from allocator import broker, metrics
from allocator.broker import broker_address
from allocator.client import broker_user
from allocator.config import AllocatorSettings, ConfigurationError, guarantee_problem
from allocator.counters import Count, Family, ServiceStats
from allocator.decided import DecidedRequests, RequestId
from allocator.engine import Engine, Sender
from allocator.inbox import Inbox, acknowledgements
from allocator.ledger import Changes, Ledger, LedgerChanged, LedgerError
from allocator.protocol import (
    AllocateRequest,
    ErrorCode,
    ErrorReply,
    LeaseReply,
    LeaseState,
    ReleaseRequest,
    StatusRequest,
    StopContainer,
    decode_inbound,
    encode,
    error_reply,
)
from allocator.replication import (
    LogFenced,
    LogMismatch,
    LogNotHere,
    LogUnavailable,
    ReplicatedLog,
)
from allocator.tasks import cancel_and_wait
from allocator.topology import (
    AGENTS_EXCHANGE,
    DEAD_LETTER_EXCHANGE,
    HEARTBEAT_ROUTING_PREFIX,
    NODES_EXCHANGE,
    RPC_EXCHANGE,
    RPC_ROUTING_KEY,
    allocator_queue_spec,
    command_routing_key,
    dead_letter_queue_spec,
    is_direct_reply_to,
)
from allocator.waiters import ReplyAddress, Waiters

log = logging.getLogger(__name__)

STOP_STEP_S = 5.0
"""Bound on each step of :meth:`AllocatorService.stop` (consumer, tasks, connection)."""

_TICK = object()


@dataclass
class _Pending:
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


class _Poisoned(Exception):
    """The engine raised on the batch's message at ``index``."""

    def __init__(self, index: int):
        super().__init__(index)
        self.index = index


async def declare_topology(
    channel: aio_pika.abc.AbstractChannel, queue_name: str
) -> aio_pika.abc.AbstractQueue:
    """Declare exchanges, the inbound queue, the dead-letter queue and their bindings.

    The agents exchange, where the allocator sends its commands, is declared apart on a channel
    of its own (:func:`declare_agents_exchange`); the agents' queues are declared by the agents.
    """
    rpc = await channel.declare_exchange(RPC_EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True)
    nodes = await channel.declare_exchange(NODES_EXCHANGE, aio_pika.ExchangeType.TOPIC,
                                           durable=True)
    await channel.declare_exchange(DEAD_LETTER_EXCHANGE, aio_pika.ExchangeType.FANOUT,
                                          durable=True)
    await declare_dead_letter_queue(channel)
    spec = allocator_queue_spec(queue_name)
    queue = await channel.declare_queue(spec.name, durable=True, arguments=spec.arguments)
    await queue.bind(rpc, routing_key=RPC_ROUTING_KEY)
    await queue.bind(nodes, routing_key="#")
    return queue


async def declare_dead_letter_queue(channel: aio_pika.abc.AbstractChannel) -> None:
    """Declare the dead-letter queue with its bounds, on a channel of its own, and bind it.

    A queue declared by a version without the byte bound (or by hand) has other arguments,
    and RabbitMQ refuses to redeclare it (PRECONDITION_FAILED, which closes the channel): it
    is then used as it is, with a warning, instead of the allocator not starting.
    """
    spec = dead_letter_queue_spec()
    connection = (await channel.get_underlay_channel()).connection
    own = await connection.channel()
    try:
        await own.queue_declare(spec.name, durable=True, arguments=spec.arguments)
    except aiormq.exceptions.ChannelPreconditionFailed as exc:
        log.warning("the dead-letter queue %s exists with other arguments (%s); it is used as "
                    "it is. It stays unbounded by bytes unless the broker policy bounds it "
                    "(compose/rabbitmq-definitions.json) or it is deleted, once read, for the "
                    "allocator to declare it again", spec.name, exc)
        own = await connection.channel()
    try:
        await own.queue_bind(spec.name, DEAD_LETTER_EXCHANGE, routing_key="")
    finally:
        with contextlib.suppress(Exception):
            await own.close()


async def declare_agents_exchange(
    channel: aio_pika.abc.AbstractChannel,
) -> aio_pika.abc.AbstractExchange | None:
    """Declare the agents exchange on ``channel`` (the allocator's command channel); None when
    the broker user may not (definitions from before stop commands existed).

    A refusal closes the channel, which is why commands have a channel of their own: the
    allocator then runs on without stop commands instead of not starting at all, and a
    refused command can never close the channel its replies go out on.
    """
    try:
        return await channel.declare_exchange(AGENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC,
                                              durable=True)
    except aiormq.exceptions.ChannelAccessRefused as exc:
        with contextlib.suppress(Exception):
            await channel.close()
        log.error("stop commands are off: the broker refused to declare %s (%s). Render the "
                  "broker definitions again (compose/render_definitions.py): the allocator's "
                  "user needs configure and write on it", AGENTS_EXCHANGE, exc)
        return None


BROKER_RETRY_FIRST_S = 1.0
"""First pause between broker connection attempts at start; it doubles each time..."""
BROKER_RETRY_MAX_S = 10.0
"""...up to this, until ``broker_wait_s`` has passed."""


def _request_id(message: aio_pika.abc.AbstractIncomingMessage) -> RequestId:
    """What identifies one call of a caller's: its broker user, reply address and correlation
    id (a retry of the call has a new correlation id)."""
    return (message.user_id or "", message.reply_to or "", message.correlation_id or "")


def _may_linger(item: object) -> bool:
    """Whether ``item`` may wait for company before it is applied: a tick or a heartbeat.

    Told by the routing key, before decoding; a message that only claims to be a heartbeat
    lingers at most ``heartbeat_linger_s`` and is then refused as usual.
    """
    if item is _TICK:
        return True
    routing_key = getattr(item, "routing_key", None)
    return isinstance(routing_key, str) and routing_key.startswith(HEARTBEAT_ROUTING_PREFIX)


def _delivery(message: aio_pika.abc.AbstractIncomingMessage
              ) -> tuple[aiormq.abc.AbstractChannel, int] | None:
    """The channel and delivery tag that settle ``message``; None once its channel has
    closed (the broker has given the delivery back to the queue)."""
    if message.delivery_tag is None:
        return None
    try:
        return message.channel, message.delivery_tag
    except ChannelInvalidStateError:
        return None


def _channel_closed(message: aio_pika.abc.AbstractIncomingMessage) -> bool:
    """Whether the channel a delivery came on has closed (aio-pika raises on a closed one)."""
    try:
        return message.channel.is_closed
    except ChannelInvalidStateError:
        return True


class AllocatorService:
    """The running allocator: broker consumer, engine and ledger writer."""

    def __init__(self, settings: AllocatorSettings, *, clock: Callable[[], float] = time.time):
        self.settings = settings
        self.clock = clock
        # With the replicated log, the log is the durable record: a replica's file may lose
        # its last transactions in a power cut and replays them from its recorded position
        # (kept in the same transactions), so it needs no fsync per batch.
        self.ledger = Ledger(settings.ledger_path,
                             synchronous="normal" if settings.ledger_log == "stream"
                             else settings.ledger_synchronous)
        self.engine = Engine(settings, started_at=clock())
        self.stats = ServiceStats()
        self.metrics = metrics.AllocatorMetrics()
        """This service's registry and request histogram (served when metrics_port is set)."""
        self._inbox: Inbox[object, aiormq.abc.AbstractChannel] = Inbox()
        """Deliveries (and timer ticks) not applied yet: requests ahead of node messages."""
        self._arrived = asyncio.Event()
        """Set when something is put into the empty inbox."""
        self._wake = asyncio.Event()
        """Set when a message arrives that must not wait out a heartbeat batch's linger."""
        self._connection: aio_pika.abc.AbstractRobustConnection | None = None
        self._channel: aio_pika.abc.AbstractChannel | None = None
        self._agents: aio_pika.abc.AbstractExchange | None = None
        """The agents exchange on the command channel; None: stop commands cannot be sent."""
        self.user_id = broker_user(settings.amqp_url)
        """The broker user of the connection: the AMQP user_id of every command, which the
        broker verifies and the agents check."""
        self._tasks: list[asyncio.Task[None]] = []
        self._consumer_tag: str | None = None
        self._queue: aio_pika.abc.AbstractQueue | None = None
        self._data_version: int | None = None
        self._last_delivery: float | None = None
        self._delivery_channel: aiormq.abc.AbstractChannel | None = None
        """The channel of the newest delivery (a reconnect brings a new one)."""
        self.metrics_server: metrics.MetricsServer | None = None
        self._stopped = False
        self.started = asyncio.Event()
        self.log: ReplicatedLog | None = None
        """The replicated ledger log (``ledger_log = "stream"``), or None: one shared file."""
        self.failure: str | None = None
        """Why this allocator stopped serving (its ledger is not the log's history)."""
        self.failed = asyncio.Event()
        self._watchdog: asyncio.Task[None] | None = None
        self.waiters = Waiters()
        """Reply addresses of queued requests, where their outcome is pushed."""
        self.decided = DecidedRequests()
        """Requests decided and committed lately: their redeliveries are not decided again."""

    # ------------------------------------------------------------------ life

    async def start(self) -> None:
        """Open the ledger, load it, connect, declare the topology and start consuming."""
        self.ledger.open()
        # Fenced: this ledger may be behind what the nodes run (deleted, restored, another
        # node's volume); each node's first complete report comes before any grant there.
        await self._reload(fenced=True)
        self._check_guarantees()
        self._connection = await self._connect()
        if self.settings.ledger_log == "stream":
            # Follow the log before consuming requests: a ledger that is not the log's
            # history must be found out before it could serve.
            self._connection, self.log = await self._follow_log(self._connection)
            self._watchdog = asyncio.create_task(self._watch_log(self.log),
                                                 name="allocator-log-watch")
        self._channel = await self._connection.channel(publisher_confirms=False)
        await self._channel.set_qos(prefetch_count=self.settings.prefetch)
        self._queue = await declare_topology(self._channel, self.settings.queue_name)
        self._agents = await declare_agents_exchange(
            await self._connection.channel(publisher_confirms=False))
        self._tasks = [
            asyncio.create_task(self._apply_loop(), name="allocator-apply"),
            asyncio.create_task(self._tick_loop(), name="allocator-tick"),
        ]
        self._consumer_tag = await self._queue.consume(self._on_message)
        self.started.set()
        if self.settings.metrics_port is not None:
            self.metrics_server = metrics.serve(self, self.settings.metrics_port)
        log.info("allocator consuming %s; ledger %s", self.settings.queue_name,
                 self.settings.ledger_path)

    async def _follow_log(self, connection: aio_pika.abc.AbstractRobustConnection) \
            -> tuple[aio_pika.abc.AbstractRobustConnection, ReplicatedLog]:
        """Follow the replicated log from a broker node that holds a replica of its stream,
        declaring the stream first if it is new; the connection it follows on and the log.

        A node without a replica refuses the stream's consumer (a broker node that joined
        the cluster after the stream was declared, before it is added as a replica): then
        the next node of ``amqp_url`` is tried, round the list, pausing after each round,
        until ``broker_wait_s`` has passed. Exiting instead would only have Swarm restart
        the allocator, which connects to the same first node again.
        """
        nodes = len(broker.broker_urls(self.settings.amqp_url))
        deadline = time.monotonic() + self.settings.broker_wait_s
        moved = 0
        while True:
            replicated = ReplicatedLog(self.ledger, self.settings.ledger_log_stream,
                                       max_bytes=self.settings.ledger_log_max_bytes,
                                       segment_bytes=self.settings.ledger_log_segment_bytes,
                                       snapshot_bytes=self.settings.ledger_log_snapshot_bytes,
                                       timeout_s=self.settings.request_timeout_s)
            if not await replicated.exists(connection):
                await self._await_broker_nodes(deadline)
            try:
                await replicated.start(connection)
                return connection, replicated
            except LogNotHere as exc:
                await replicated.stop()
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(STOP_STEP_S):
                        await connection.close()
                if time.monotonic() >= deadline:
                    raise
                moved += 1
                log.warning("ledger log: %s; connecting to the next broker node", exc)
                if moved % nodes == 0:
                    await asyncio.sleep(min(BROKER_RETRY_MAX_S,
                                            max(0.0, deadline - time.monotonic())))
                connection = await self._connect(first_node=moved)

    async def _await_broker_nodes(self, deadline: float) -> None:
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
        url = self.settings.amqp_url
        if len(broker.broker_urls(url)) == 1:
            return
        pause = BROKER_RETRY_FIRST_S
        while silent := await broker.silent_nodes(url, timeout=self.settings.request_timeout_s):
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("ledger log: declaring the stream %s while broker node(s) %s do "
                            "not answer (broker_wait_s passed): it has no replica there "
                            "until one is added", self.settings.ledger_log_stream,
                            ", ".join(silent))
                return
            log.info("ledger log: the stream %s is new; waiting for broker node(s) %s to "
                     "answer before declaring it, so that it has a replica on each",
                     self.settings.ledger_log_stream, ", ".join(silent))
            await asyncio.sleep(min(pause, left))
            pause = min(pause * 2, BROKER_RETRY_MAX_S)

    async def _connect(self, first_node: int = 0) -> aio_pika.abc.AbstractRobustConnection:
        """The broker connection, waiting up to ``broker_wait_s`` for the broker to listen.

        Swarm may start the allocator before RabbitMQ on a first deploy; exiting at once
        would crash-loop the task. One log line per failed attempt tells the admin why. The
        attempts use plain connections: a robust one whose first attempt is cut short by a
        timeout keeps reconnecting in the background.
        """
        timeout = self.settings.request_timeout_s
        url = broker.rotate_nodes(self.settings.amqp_url, first_node)
        deadline = time.monotonic() + self.settings.broker_wait_s
        pause = BROKER_RETRY_FIRST_S
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
                pause = min(pause, left)
                log.warning("broker %s not reachable (attempt %d: %s); retrying in %.0f s",
                            broker_address(self.settings.amqp_url), attempt,
                            str(exc) or type(exc).__name__, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, BROKER_RETRY_MAX_S)
                attempt += 1
        async with asyncio.timeout(timeout):
            return await broker.connect_robust(url, timeout=timeout)

    async def stop(self) -> None:
        """Stop consuming, finish the batch in hand, close the broker and the ledger.

        Stopping twice is harmless.
        """
        if self._stopped:
            return
        self._stopped = True
        # Each step bounded (asyncio.timeout, not 3.11's wait_for, which can swallow a
        # cancellation): a broker that does not answer must not hang the shutdown.
        if self._queue is not None and self._consumer_tag is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(STOP_STEP_S):
                    await self._queue.cancel(self._consumer_tag)
        await cancel_and_wait([*self._tasks, self._watchdog], within=STOP_STEP_S)
        self._tasks, self._watchdog = [], None
        if self.log is not None:
            await self.log.stop()
        if self._connection is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(STOP_STEP_S):
                    await self._connection.close()
            self._connection = None
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        self.ledger.close()

    async def __aenter__(self) -> AllocatorService:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def _check_guarantees(self) -> None:
        """With ``strict_guarantees``: refuse to start when the guarantees cannot all be
        honoured at once by the cluster (``cluster_gpus``, or the GPUs the ledger knows), the
        per-model ones by the GPUs of their model (``cluster_model_gpus``, or the ledger's)."""
        if not self.settings.strict_guarantees:
            return
        model_gpus: dict[str, int] = {}
        for gpu in self.engine.cluster.gpus.values():
            if gpu.present and gpu.allocatable:
                model_gpus[gpu.model] = model_gpus.get(gpu.model, 0) + 1
        gpus = self.settings.cluster_gpus
        if gpus is None:
            gpus = sum(model_gpus.values())
        problem = guarantee_problem(self.settings, gpus, model_gpus)
        if problem is not None:
            self.ledger.close()
            raise ConfigurationError(problem)

    async def _reload(self, *, fenced: bool = False) -> None:
        """Rebuild the engine from the ledger (start, failed commit, takeover).

        Only the start is fenced: after a failed commit the ledger is what this process
        wrote, and a takeover finds what the active one wrote.
        """
        state = await self.ledger.run(self.ledger.load)
        self.engine.load(state, self.clock(), fenced=fenced)
        self._data_version = await self.ledger.run(self.ledger.data_version)
        # Another allocator may have decided queued requests whose clients wait here (a
        # takeover): what the ledger says now is committed, so it may be pushed.
        await self._push_outcomes(self.waiters.lease_ids())

    # ------------------------------------------------------------------ loops

    async def _on_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        self._last_delivery = time.monotonic()
        delivery = _delivery(message)
        if delivery is not None and delivery[0] is not self._delivery_channel:
            if self._delivery_channel is not None:
                # A new channel: what the old one delivered and nobody applied yet can no
                # longer be settled, and the broker has given it back to the queue.
                self._drop_stale(len(self._inbox.keep_channel(delivery[0])))
            self._delivery_channel = delivery[0]
        self._inbox.put(message, request=message.exchange != NODES_EXCHANGE, delivery=delivery)
        self._arrived.set()
        if not _may_linger(message) or len(self._inbox) >= self.settings.batch_max:
            self._wake.set()

    async def is_standby(self) -> bool:
        """Whether another allocator is the active one, as far as this one can tell.

        RabbitMQ does not tell a single-active-consumer which it is. Only the active one gets
        deliveries, so a recent delivery means active; without one, another process writing
        the ledger (node heartbeats make the active one write every few seconds) means
        standby. An allocator alone with a silent cluster counts as active: its timers must
        still notice the silence.
        """
        if self.log is not None:
            # With the log, the writer is whoever made the newest accepted claim.
            return not self.log.is_writer
        if (self._last_delivery is not None
                and time.monotonic() - self._last_delivery < self.settings.standby_after_s):
            return False
        return await self.ledger.run(self.ledger.data_version) != self._data_version

    async def _tick_loop(self) -> None:
        # A standby runs no timers: it would write timer decisions to the shared ledger and
        # then have to reload after every write of the active one.
        while True:
            await asyncio.sleep(self.settings.tick_s)
            if not await self.is_standby():
                self._inbox.put(_TICK, request=False)
                self._arrived.set()

    async def _apply_loop(self) -> None:
        while True:
            batch = await self._next_batch()
            try:
                batch = self._without_stale(batch)
                if not batch:
                    continue
                await self._apply_batch(batch)
            except asyncio.CancelledError:
                raise
            except Exception:  # the loop must survive anything; the batch is answered below
                log.exception("batch failed; rebuilding from the ledger")
                self.stats.counters.add(Count.BATCH_FAILURES)
                try:
                    await self._recover(batch)
                except Exception:  # a dead applier would leave the queue unanswered for good
                    log.exception("could not answer a failed batch")

    async def _next_batch(self) -> list[object]:
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
                and all(_may_linger(item) for item in batch)):
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(linger):
                    await self._wake.wait()
            batch += self._inbox.take(batch_max - len(batch))
        return batch

    def _without_stale(self, batch: list[object]) -> list[object]:
        """The batch without deliveries whose channel has closed since they arrived.

        Such a delivery cannot be acknowledged any more, and the broker has given it back to
        the queue, to the active allocator: this one was stopped or cut off long enough for
        the broker to close its channel (a paused process, a lost connection). Deciding it
        here would be a second decision on a request another allocator is answering.
        """
        fresh = [item for item in batch if not (
            isinstance(item, aio_pika.abc.AbstractIncomingMessage) and _channel_closed(item))]
        self._drop_stale(len(batch) - len(fresh))
        return fresh

    def _drop_stale(self, count: int) -> None:
        if count:
            self.stats.counters.add(Count.STALE_DELIVERIES, count)
            log.warning("dropped %d message(s) whose channel closed before they were applied "
                        "(the broker gives them to the active allocator)", count)

    async def _watch_log(self, replicated: ReplicatedLog) -> None:
        """Stop serving for good when the log turns out not to be this ledger's history."""
        await replicated.mismatch_event.wait()
        self.failure = str(replicated.mismatch)
        if self._queue is not None and self._consumer_tag is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(STOP_STEP_S):
                    await self._queue.cancel(self._consumer_tag)
            self._consumer_tag = None
        self.failed.set()

    async def _become_writer(self, replicated: ReplicatedLog) -> None:
        """Claim the log (single-active-consumer made this allocator the active one) and
        rebuild memory from the ledger, which now holds every entry before the claim."""
        genesis = await replicated.claim()
        self.stats.counters.add(Count.TAKEOVERS)
        # A log started here from an empty or unlogged ledger may be behind the nodes; a
        # ledger caught up with the log is not.
        await self._reload(fenced=genesis)

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
        deliveries = [(message, _delivery(message)) for message in messages]
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
            self._drop_stale(len(stale))
            await self._requeue(list(stale.values()))
        if len(stale) == len(messages):
            return []
        return [item for item in batch if id(item) not in stale]

    async def _apply_batch(self, batch: list[object]) -> None:
        began = time.monotonic()
        poisoned: dict[int, _Pending | None] = {}
        takeovers = 0
        replicated = self.log
        if replicated is not None and not replicated.is_writer:
            batch = await self._proof_of_activity(batch)
            if not batch:
                return
            try:
                await self._become_writer(replicated)
            except (LogFenced, LogMismatch, LogUnavailable) as exc:
                log.warning("not the writer of the ledger log (%s); the batch goes back to "
                            "the queue", exc)
                await self._requeue(batch)
                return
        deciding = committing = 0.0
        while True:
            phase_began = time.monotonic()
            try:
                changes, pending = self._apply_in_memory(batch, poisoned)
            except _Poisoned as bad:
                # One message made the engine fail: answer it alone with internal_error, throw
                # away what the batch did to memory, and apply the others again without it.
                log.error("message %d of a batch failed; it alone is refused", bad.index,
                          exc_info=bad.__cause__)
                self.stats.counters.add(Count.POISONED)
                poisoned[bad.index] = self._refused(batch[bad.index])
                await self._reload()
                deciding += time.monotonic() - phase_began
                continue
            # One trip to the ledger thread per batch: the commit itself checks that no other
            # allocator wrote since our last look. If one did, we are a standby that has just
            # become active: start from what it left and apply the batch again.
            def commit(batch_changes: Changes = changes) -> None:
                self.ledger.commit(batch_changes, expect_version=self._data_version)

            decided_at = time.monotonic()
            deciding += decided_at - phase_began
            try:
                if replicated is not None:
                    if changes:
                        await replicated.append(changes)
                else:
                    await self.ledger.run(commit)
            except (LogFenced, LogMismatch) as exc:
                # Deposed (or stopped): the batch was applied nowhere. Memory holds its
                # decisions: rebuild it, answer nothing, and give the messages back to the
                # queue for the active allocator.
                log.warning("batch fenced, not applied (%s); its messages go back to the "
                            "queue", exc)
                self.stats.counters.add(Count.FENCED_BATCHES)
                await self._reload()
                await self._requeue(batch)
                return
            except LedgerChanged:
                committing += time.monotonic() - decided_at
                takeovers += 1
                if takeovers > 3:
                    raise LedgerError("the ledger keeps changing under this allocator") from None
                log.warning("the ledger was written by another allocator (takeover); reloading")
                self.stats.counters.add(Count.TAKEOVERS)
                await self._reload()
                continue
            except LedgerError as exc:
                await self._commit_failed(exc, pending)
                return
            break
        committed_at = time.monotonic()
        committing += committed_at - decided_at
        if pending:  # a batch of timer ticks alone is no batch of messages
            self.stats.counters.add(Count.BATCHES)
        self.decided.forget_expired(committed_at)
        for entry in pending:
            if entry.message.reply_to and entry.message.correlation_id:
                self.decided.add(_request_id(entry.message), committed_at)
        await self._send_commands(self.engine.take_commands())
        await self._resolve_lookups(pending)
        self._remember_waiters(pending)
        await self._reply_and_ack(pending)
        await self._push_outcomes(changes.leases)
        answered_at = time.monotonic()
        elapsed = answered_at - began
        for entry in pending:
            self.metrics.observe_request(entry.kind, elapsed)
        if pending:
            self.metrics.observe_batch(deciding, committing, answered_at - committed_at)
        if replicated is not None and replicated.snapshot_due():
            await self._snapshot(replicated)

    async def _snapshot(self, replicated: ReplicatedLog) -> None:
        """Append a snapshot of the ledger to the log, after a batch is answered and before
        the next one is applied (a batch between its parts would break it)."""
        try:
            await replicated.take_snapshot()
        except (LogFenced, LogUnavailable, LedgerError) as exc:
            # Nothing decided is lost: the next batch claims again if this one was deposed,
            # and the snapshot is tried again after it.
            log.warning("no snapshot of the ledger log this time: %s", exc)

    def _apply_in_memory(self, batch: list[object], poisoned: dict[int, _Pending | None]
                         ) -> tuple[Changes, list[_Pending]]:
        changes = Changes()
        self.engine.commands.clear()  # only this batch's own decisions go out after its commit
        pending: list[_Pending] = []
        for index, item in enumerate(batch):
            if index in poisoned:
                refused = poisoned[index]
                if refused is not None:
                    pending.append(refused)
                continue
            now = self.clock()
            try:
                if item is _TICK:
                    self.engine.tick(now, changes)
                    continue
                assert isinstance(item, aio_pika.abc.AbstractIncomingMessage)
                pending.append(self._apply_message(item, now, changes))
            except Exception as exc:
                raise _Poisoned(index) from exc
        return changes, pending

    def _refused(self, item: object) -> _Pending | None:
        """How to answer a message the engine failed on (None for a failed tick)."""
        if not isinstance(item, aio_pika.abc.AbstractIncomingMessage):
            return None
        if not (item.reply_to and item.correlation_id):
            return _Pending(item, None, dead_letter=True)
        return _Pending(item, error_reply(
            ErrorCode.INTERNAL_ERROR,
            "the allocator failed on this request and did nothing with it; the allocator's "
            "log says why"))

    async def _commit_failed(self, exc: LedgerError, pending: list[_Pending]) -> None:
        """Nothing of the batch was written: forget it in memory and say so to every caller."""
        log.error("ledger commit failed: %s", exc)
        self.stats.counters.add(Count.COMMIT_FAILURES)
        await self._reload()
        failure = error_reply(ErrorCode.STORAGE_ERROR,
                              f"the allocator could not record the decision ({exc}); "
                              "nothing was granted, try again later")
        # Every reply of the batch was computed on memory that has just been thrown away.
        for entry in pending:
            if entry.reply is not None:
                entry.reply = failure
        await self._reply_and_ack(pending)

    def _apply_message(self, message: aio_pika.abc.AbstractIncomingMessage, now: float,
                       changes: Changes) -> _Pending:
        self.stats.counters.add(Count.RECEIVED)
        wants_reply = bool(message.reply_to and message.correlation_id)
        if wants_reply and message.redelivered and _request_id(message) in self.decided:
            # Decided, committed and answered already; its acknowledgement was lost with a
            # broker node. Its caller may have released the lease since: deciding it again
            # would grant that request key a lease nobody holds.
            self.stats.counters.add(Count.REDELIVERED_DECIDED)
            log.info("dropped a redelivered request decided already (correlation id %s)",
                     (message.correlation_id or "")[:40])
            return _Pending(message, None)
        if wants_reply and not self._may_reply_to(message.reply_to or ""):
            # Publishing there would let any sender make the allocator write into a queue of
            # its choosing (its own inbound queue included): refuse unanswered, keep it for a
            # person in the dead-letter queue, and count it.
            self.stats.counters.add(Count.REPLY_TO_REFUSED)
            log.warning("refused a message whose reply_to %r is not a direct reply-to address",
                        (message.reply_to or "")[:100])
            return _Pending(message, None, dead_letter=True)
        decoded = decode_inbound(message.body)
        if isinstance(decoded, ErrorReply):
            self.stats.counters.add_to(Family.INVALID_MESSAGE, decoded.error.code.value)
            log.info("refused a message: %s", decoded.error.message)
            if not wants_reply:
                return _Pending(message, None, dead_letter=True)
            return _Pending(message, decoded)
        deadline = getattr(decoded, "deadline", None)
        if deadline is not None and now > deadline:
            # The caller gave up already; granting now would leak a lease nobody holds.
            self.stats.counters.add(Count.EXPIRED_DROPPED)
            return _Pending(message, None, kind=decoded.kind)
        sender = Sender(user_id=message.user_id,
                        via_nodes_exchange=message.exchange == NODES_EXCHANGE)
        reply = self.engine.handle(decoded, sender, now, changes)
        entry = _Pending(message, reply if wants_reply else None, kind=decoded.kind)
        if (wants_reply and isinstance(decoded, AllocateRequest | StatusRequest)
                and isinstance(reply, LeaseReply) and reply.lease.state is LeaseState.QUEUED):
            entry.waits = reply.lease.lease_id
        if (isinstance(decoded, StatusRequest | ReleaseRequest) and isinstance(reply, ErrorReply)
                and reply.error.code is ErrorCode.NOT_FOUND):
            entry.lookup = (decoded.lease_id, decoded.request_key)
        return entry

    def _may_reply_to(self, address: str) -> bool:
        """Whether a reply may be published to ``address`` (see ``reply_to_prefix``)."""
        prefix = self.settings.reply_to_prefix
        return is_direct_reply_to(address) or (prefix is not None and address.startswith(prefix))

    async def _send_commands(self, commands: list[StopContainer]) -> None:
        """Publish the batch's commands to the agents (after the commit, never before).

        Not mandatory and not persistent: an agent whose queue does not exist (agent down) is
        simply not stopping anything, and Swarm stops the task as before.
        """
        exchange = self._agents
        if not commands:
            return
        if exchange is None:
            self.stats.counters.add(Count.COMMAND_FAILURES, len(commands))
            log.warning("%d stop command(s) not sent: stop commands are off (see the error "
                        "at start)", len(commands))
            return
        # One bound for the whole batch, so that a broker that stopped answering delays the
        # batch's replies by request_timeout_s at most, however many commands it decided.
        give_up = time.monotonic() + self.settings.request_timeout_s
        for index, command in enumerate(commands):
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                self.stats.counters.add(Count.COMMAND_FAILURES, len(commands) - index)
                log.warning("gave up sending %d command(s) to node agents: the broker does "
                            "not take them", len(commands) - index)
                return
            try:
                await exchange.publish(
                    aio_pika.Message(
                        body=encode(command),
                        content_type="application/json",
                        type=command.kind,
                        user_id=self.user_id,
                        delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT,
                    ),
                    routing_key=command_routing_key(command.host),
                    mandatory=False,
                    timeout=remaining,
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never fail the batch: the decision is committed
                self.stats.counters.add(Count.COMMAND_FAILURES)
                log.warning("could not ask %s to stop container %s (lease %s): %s",
                            command.host, command.container_id[:12], command.lease_id,
                            exc or type(exc).__name__)
                continue
            self.stats.counters.add(Count.COMMANDS_SENT)
            log.info("asked %s to stop container %s of lease %s (%s, grace %g s)",
                     command.host, command.container_id[:12], command.lease_id,
                     command.reason.value, command.grace_s)

    async def _resolve_lookups(self, pending: list[_Pending]) -> None:
        """Answer status/release of leases that left memory long ago from the ledger."""
        for entry in pending:
            if entry.lookup is None:
                continue
            lease_id, request_key = entry.lookup
            fetch = (functools.partial(self.ledger.find_lease, lease_id) if lease_id is not None
                     else functools.partial(self.ledger.latest_lease_for_key, request_key or ""))
            record = await self.ledger.run(fetch)
            if record is not None and entry.reply is not None:
                entry.reply = self.engine.lease_reply(record)

    def _remember_waiters(self, pending: list[_Pending]) -> None:
        """Each queued answer of the batch names where the lease's outcome is pushed."""
        for entry in pending:
            if entry.waits is not None and entry.message.reply_to and entry.message.correlation_id:
                self.waiters.remember(entry.waits, ReplyAddress(
                    entry.message.reply_to, entry.message.correlation_id))

    async def _push_outcomes(self, lease_ids: Iterable[str]) -> None:
        """Publish the lease to the waiting client of each of ``lease_ids`` that has left the
        queue (after the commit that decided it, like every reply), then forget the address.

        A push that is lost (the client went away, the broker is down) loses nothing: the
        grant is in the ledger, and the client's retry or status call finds it.
        """
        waiters = self.waiters
        if not len(waiters):
            return
        decided = [lease_id for lease_id in lease_ids
                   if lease_id in waiters and not self._still_queued(lease_id)]
        replies: dict[str, BaseModel | None] = {}
        for lease_id, address in waiters.take(decided):
            if lease_id not in replies:
                record = self.engine.find(lease_id, None)
                if record is None:
                    record = await self.ledger.run(
                        functools.partial(self.ledger.find_lease, lease_id))
                # None cannot happen: the ledger keeps every lease
                replies[lease_id] = None if record is None else self.engine.lease_reply(record)
            reply = replies[lease_id]
            if reply is None:
                continue
            sent = await self._publish_reply(reply, address.reply_to, address.correlation_id)
            self.stats.counters.add(Count.PUSHES if sent else Count.PUSH_FAILURES)

    def _still_queued(self, lease_id: str) -> bool:
        record = self.engine.leases.get(lease_id)
        return record is not None and record.state is LeaseState.QUEUED

    async def _publish_reply(self, reply: BaseModel, reply_to: str, correlation_id: str | None
                             ) -> bool:
        """Publish one reply; False when it could not be sent (logged)."""
        channel = self._channel
        if channel is None:
            return False
        try:
            await channel.default_exchange.publish(
                aio_pika.Message(
                    body=encode(reply),
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

    async def _reply_and_ack(self, pending: list[_Pending]) -> None:
        """Send replies, then acknowledge (after the commit, never before)."""
        for entry in pending:
            if entry.reply is not None:
                sent = await self._publish_reply(entry.reply, entry.message.reply_to or "",
                                                 entry.message.correlation_id)
                self.stats.counters.add(Count.REPLIES if sent else Count.REPLY_FAILURES)
        for entry in pending:
            if entry.dead_letter:
                # Rejected without requeue: the queue's dead-letter exchange keeps it for a
                # person to look at.
                self.stats.counters.add(Count.DEAD_LETTERED)
                await self._settle(entry.message.reject(requeue=False))
        # As few acknowledgements as settle exactly the rest: mostly one multiple=True per
        # batch (a frame, and a socket write, per message was the costliest part of a
        # heartbeat), plus one each for requests taken ahead of node messages still waiting.
        by_delivery = {key: entry.message for entry in pending if not entry.dead_letter
                       if (key := _delivery(entry.message)) is not None}
        for ack in acknowledgements(by_delivery, self._inbox.oldest_deliveries()):
            await self._settle(by_delivery[(ack.channel, ack.tag)].ack(multiple=ack.multiple))

    async def _settle(self, settlement: Awaitable[object]) -> None:
        """An ack, nack or reject, bounded in time and never raising: on a channel that a
        broker node's loss left half-closed it could wait for good and stop the applier (seen
        with a three-node broker). An unsettled delivery goes back to the queue when its
        channel closes, and requests are idempotent by request key."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(self.settings.request_timeout_s):
                await settlement

    async def _requeue(self, batch: list[object]) -> None:
        """Give a batch's messages back to the broker unanswered (another allocator is the
        writer; a quorum queue hands them to the active consumer)."""
        for item in batch:
            if isinstance(item, aio_pika.abc.AbstractIncomingMessage):
                await self._settle(item.nack(requeue=True))

    async def _recover(self, batch: list[object]) -> None:
        """After an unexpected error: rebuild from disk and answer what was asked."""
        try:
            await self._reload()
        except Exception:
            log.exception("could not reload the ledger")
        failure = error_reply(ErrorCode.INTERNAL_ERROR,
                              "the allocator hit an internal error on this batch; nothing was "
                              "granted; see the allocator log")
        pending = [
            _Pending(item, failure if item.reply_to and item.correlation_id else None)
            for item in batch if isinstance(item, aio_pika.abc.AbstractIncomingMessage)
        ]
        await self._reply_and_ack(pending)
