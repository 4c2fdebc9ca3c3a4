"""Publishing node messages to the broker: bounded in time, buffered for events.

Messages go to :data:`~allocator.wire.topology.NODES_EXCHANGE` with the routing keys of
:mod:`allocator.wire.topology`, as JSON, with the AMQP ``user_id`` set to the broker user of the
URL (RabbitMQ refuses a ``user_id`` that is not the connection's user, so the allocator
can trust it to tell which agent sent a heartbeat).

- **Heartbeats** (full or deltas) are transient and expire after two intervals: a heartbeat
  that waited longer than that in a queue describes a past that the next one corrects. A
  failed heartbeat is counted and dropped; the next one follows in one interval, in full.
- **A heartbeat the allocator may never get** makes the next one full as well, so that an agent
  started before the allocator is known within one heartbeat of the allocator consuming, not
  only at the next full report due (``full_report_s``): the deltas in between would reach an
  allocator that never saw the report they apply to. Two cases: no queue took it (the
  allocator has not declared its queue yet, on a broker without the shipped definitions:
  heartbeats are published ``mandatory`` and the broker returns it,
  :class:`PublishUnroutable`), or it is a full report queued while no allocator consumes the
  allocator's queue (declared by the definitions: it would expire there unread,
  :class:`NoAllocatorConsuming`; asked by a passive declaration after each full report, which
  needs no permission). Neither is an error of the agent: each is logged once until a report
  is delivered again.
- **Container events** are persistent, never expire, and are published ``mandatory``: an
  event the broker could not route or confirm is kept in a bounded FIFO buffer and retried
  in order until it goes through (the order matters: a ``die`` must not overtake its
  ``start``). When the buffer is full the oldest event is dropped, logged and counted —
  never silently.
- **A publish the broker refuses** (the allocator's queue at its bound, or its leader lost)
  fails like any other, is counted in ``publishes_refused``, and all refusals are logged in
  one line at most every :data:`REFUSED_LOG_S`.

Every broker call is bounded by ``timeout_s``: aio-pika's publish on a robust connection
waits for the connection to come back, which during an outage would block the agent's
heartbeat loop indefinitely. The connection itself is aio-pika's robust connection, which
reconnects and redeclares the exchange by itself; if even the first connection fails, a
background task keeps trying.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractChannel, AbstractExchange, AbstractRobustConnection

from allocator.amqp import broker
from allocator.amqp.broker import broker_user
from allocator.amqp.declare import OnRefusal, Refusal, Tolerate, declare_exchange
from allocator.tasks import cancel_and_wait
from allocator.wire.protocol import ContainerEvent, Heartbeat, HeartbeatDelta, encode
from allocator.wire.topology import (
    ALLOCATOR_QUEUE,
    NODES_EXCHANGE,
    NODES_EXCHANGE_SPEC,
    event_routing_key,
    heartbeat_routing_key,
)

log = logging.getLogger(__name__)

APP_ID = "swarm-gpu-nodeagent"

REFUSED_LOG_S = 60.0
"""While the broker refuses publishes, one log line at most this often says how many."""


class PublishRefused(ConnectionError):
    """The broker refused a publish (a ``basic.nack``): nothing was enqueued."""

    WHY = ("the allocator's queue is full (at its bound: the allocator is far behind or "
           "stopped) or a broker node holding its leader was lost")

    def __init__(self) -> None:
        super().__init__(f"the broker refused the publish: {self.WHY}")


class PublishUnroutable(ConnectionError):
    """The broker returned a ``mandatory`` publish: no queue is bound for its routing key, so
    nobody got it (a ``basic.return``; the broker still confirms it)."""

    def __init__(self, routing_key: str) -> None:
        super().__init__(
            f"no queue takes {routing_key!r} on {NODES_EXCHANGE}: the allocator has not "
            "declared its queue yet (or the broker definitions were not loaded); "
            "heartbeats are sent in full until one is delivered, events kept and sent again")


class NoAllocatorConsuming(ConnectionError):
    """A full report reached the allocator's queue, but no allocator consumes it yet."""

    def __init__(self) -> None:
        super().__init__(
            f"no allocator consumes {ALLOCATOR_QUEUE} yet (it is not running, or still "
            "starting): heartbeats wait there and expire unread; they are sent in full until "
            "one consumes")


class Publisher:
    """Publishes heartbeats and container events for one host."""

    def __init__(
        self,
        amqp_url: str,
        host: str,
        *,
        timeout_s: float = 5.0,
        reconnect_s: float = 2.0,
        buffer_size: int = 1000,
    ) -> None:
        self.amqp_url = amqp_url
        self.host = host
        self.user_id = broker_user(amqp_url)
        self.timeout_s = timeout_s
        self.reconnect_s = reconnect_s
        self.buffer_size = buffer_size
        self._connection: AbstractRobustConnection | None = None
        self._exchange: AbstractExchange | None = None
        self._channel: AbstractChannel | None = None
        """The channel of ``_exchange``."""
        self._buffer: deque[ContainerEvent] = deque()
        self._kick = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._lock = asyncio.Lock()
        """Serializes event publishes, so the buffer drains in order."""
        self.heartbeats_sent = 0
        """Heartbeats the broker confirmed (the unroutable ones among them)."""
        self.heartbeats_unroutable = 0
        """Heartbeats the broker confirmed but returned: no queue took them."""
        self.full_reports_unread = 0
        """Full reports queued while no allocator consumed the allocator's queue."""
        self.heartbeats_delivered = 0
        """Heartbeats that reached the allocator's queue (full ones: while one consumed)."""
        self.heartbeat_failures = 0
        self.events_sent = 0
        self.event_failures = 0
        """Event publish attempts that failed (the event stayed buffered)."""
        self.events_dropped = 0
        """Events lost because the buffer was full (each one logged)."""
        self.publishes_refused = 0
        """Publishes the broker refused (each also counts as a heartbeat or event failure)."""
        self._refused_unlogged = 0
        self._refused_logged_at: float | None = None
        """When refused publishes were last logged (monotonic); None: none since the last
        publish that went through."""
        self.last_error: str | None = None
        self._failing: dict[str, str] = {}
        """What is failing now (connect, heartbeat, event) → the last error, so an outage is
        logged once per kind and per new error, not once per attempt."""

    # ------------------------------------------------------------------ lifecycle

    @property
    def connected(self) -> bool:
        """Whether a broker connection is open now."""
        connection = self._connection
        return connection is not None and not connection.is_closed and self._exchange is not None

    @property
    def link_up(self) -> bool:
        """Whether the broker connection is up at this moment: unlike :attr:`connected`, also
        False while the robust connection reconnects after a drop (its ``connected`` event,
        which the health check reads from the metrics' HTTP thread)."""
        connection = self._connection
        return connection is not None and connection.connected.is_set()

    @property
    def buffered(self) -> int:
        """Container events waiting to be published."""
        return len(self._buffer)

    async def start(self) -> None:
        """Try to connect once (bounded); on failure keep trying in the background."""
        try:
            await self._connect()
        except Exception as exc:
            self._note_error("connect", exc)
            self._tasks.append(asyncio.create_task(self._connect_loop(), name="amqp-connect"))
        self._tasks.append(asyncio.create_task(self._flush_loop(), name="amqp-flush"))

    async def stop(self, drain_s: float | None = None) -> None:
        """Try to send buffered events (at most ``drain_s``), then close."""
        if self._buffer and self.connected:
            await self.flush(drain_s if drain_s is not None else self.timeout_s)
        if self._buffer:
            log.error("stopping with %d container event(s) unsent", len(self._buffer))
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
        connection, self._connection, self._exchange = self._connection, None, None
        if connection is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.timeout_s):
                    await connection.close()

    async def _connect(self) -> None:
        # aio-pika's own timeout normally ends a failed attempt cleanly; the outer bound is
        # the backstop, a little later so it does not cut aio-pika's clean-up short.
        async with asyncio.timeout(self.timeout_s + 1.0):
            connection = await broker.connect_robust(
                self.amqp_url,
                timeout=self.timeout_s,
                reconnect_interval=self.reconnect_s,
                client_properties={"connection_name": f"{APP_ID} {self.host}"},
            )
        try:
            async with asyncio.timeout(self.timeout_s):
                self._exchange = await self._declare(connection)
        except BaseException:
            with contextlib.suppress(Exception):
                await connection.close()
            raise
        self._connection = connection
        self._note_success("connect")
        connection.reconnect_callbacks.add(self._on_reconnect)
        log.info("broker: connected to %s as %s", broker.redact(self.amqp_url), self.user_id)
        self._kick.set()

    async def _declare(self, connection: AbstractRobustConnection) -> AbstractExchange:
        # The allocator owns the topology; declaring the exchange with the same type and
        # durability is idempotent and lets an agent start before the allocator ever ran.
        # A least-privilege agent user may lack "configure" on it: fall back to a passive
        # check (which needs no permission) on a fresh channel, since the refusal closed the
        # first one.
        declared = await declare_exchange(
            lambda: connection.channel(on_return_raises=True), NODES_EXCHANGE_SPEC,
            tolerate=[Tolerate(Refusal.ACCESS, OnRefusal.PASSIVE)])
        if declared.refusal is not None:
            # Said once, not at every new channel (one per refused publish).
            log.log(logging.INFO if self._channel is None else logging.DEBUG,
                    "broker: may not declare %s; it exists", NODES_EXCHANGE)
        assert declared.value is not None and declared.channel is not None
        self._channel = declared.channel
        return declared.value

    async def _connect_loop(self) -> None:
        while self._connection is None:
            await asyncio.sleep(self.reconnect_s)
            try:
                await self._connect()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._note_error("connect", exc)

    def _on_reconnect(self, *_: Any) -> None:
        log.info("broker: reconnected")
        self._kick.set()

    def _note_error(self, what: str, exc: BaseException, detail: str = "") -> None:
        message = broker.refusal(exc, self.amqp_url, "node agent") or (
            f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        if self._failing.get(what) != message:
            log.warning("broker: %s failed%s: %s", what, detail, message)
        self._failing[what] = message
        self.last_error = message

    def _note_success(self, what: str) -> None:
        if self._failing.pop(what, None) is not None:
            log.info("broker: %s works again", what)

    # ------------------------------------------------------------------ publishing

    async def _publish(self, body: bytes, routing_key: str, *, kind: str, persistent: bool,
                       expiration: float | None, mandatory: bool) -> None:
        exchange = self._exchange
        if exchange is None:
            raise ConnectionError("not connected to the broker")
        message = aio_pika.Message(
            body,
            content_type="application/json",
            user_id=self.user_id,
            app_id=APP_ID,
            type=kind,
            timestamp=time.time(),
            delivery_mode=(
                aio_pika.DeliveryMode.PERSISTENT if persistent
                else aio_pika.DeliveryMode.NOT_PERSISTENT
            ),
            expiration=expiration,
        )
        try:
            async with asyncio.timeout(self.timeout_s):
                await exchange.publish(message, routing_key, mandatory=mandatory)
        except TimeoutError:
            # Not confirmed in time on a connection that is up: the channel may be wedged
            # (seen on a channel whose queue lost its leader), and would stay so.
            if self.connected:
                await self._renew_channel(exchange)
            raise
        except aiormq.exceptions.PublishError as exc:  # returned: before AMQPError, its base
            raise PublishUnroutable(routing_key) from exc
        except aiormq.exceptions.AMQPError as exc:
            if broker.is_refused(exc):
                self._note_refused()
                await self._renew_channel(exchange, quiet=True)
                raise PublishRefused() from exc
            raise
        if self._refused_unlogged or self._refused_logged_at is not None:
            log.info("broker: publishes go through again (%d refused since the last line)",
                     self._refused_unlogged)
            self._refused_unlogged, self._refused_logged_at = 0, None

    def _note_refused(self) -> None:
        """Count a refused publish; log at most one line per :data:`REFUSED_LOG_S` for all
        the refusals meanwhile (a queue at its bound refuses every publish, heartbeats
        included, for as long as it stays full)."""
        self.publishes_refused += 1
        self._refused_unlogged += 1
        now = time.monotonic()
        if self._refused_logged_at is None or now - self._refused_logged_at >= REFUSED_LOG_S:
            log.warning("broker: %d publish(es) refused%s: %s; heartbeats are dropped, "
                        "container events kept and sent again", self._refused_unlogged,
                        "" if self._refused_logged_at is None
                        else f" in the last {now - self._refused_logged_at:.0f} s",
                        PublishRefused.WHY)
            self._refused_unlogged, self._refused_logged_at = 0, now

    async def _renew_channel(self, refused: AbstractExchange, *, quiet: bool = False) -> None:
        """Publish on a new channel from now on: the broker refused a publish of the one
        ``refused`` is on, or did not confirm it in time. A refusal means the channel refuses
        every publish for as long as it lives (a quorum queue's leader lost just before that
        channel first used it, :func:`allocator.amqp.broker.is_refused`). The message fails as
        before (a heartbeat is counted and dropped, an event stays buffered) and the next one
        goes out on the new channel."""
        connection, channel = self._connection, self._channel
        if self._exchange is not refused or connection is None or connection.is_closed:
            return
        if not quiet:  # a refusal has its own line (_note_refused)
            log.warning("broker: a publish was not confirmed in time; publishing on a new "
                        "channel from now on")
        try:
            async with asyncio.timeout(self.timeout_s):
                self._exchange = await self._declare(connection)
        except Exception as exc:  # the refused channel stays; the next refusal tries again
            self._note_error("new channel", exc)
            return
        if channel is not None:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.timeout_s):
                    await channel.close()

    async def publish_heartbeat(self, heartbeat: Heartbeat | HeartbeatDelta) -> bool:
        """Publish one heartbeat or delta (expires after two intervals). True when it reached
        the allocator's queue and, for a full report, an allocator consumes that queue; False
        when the allocator may never get it (the publish failed, no queue took it, or a full
        report waits where nobody reads it), so that the next one is sent in full."""
        try:
            await self._publish(
                encode(heartbeat),
                heartbeat_routing_key(heartbeat.host),
                kind=heartbeat.kind,
                persistent=False,
                expiration=2 * heartbeat.interval_s,
                # Unroutable = the allocator's queue is not there yet: the report is lost, and
                # the agent must know it, or its deltas would follow a report nobody holds.
                mandatory=True,
            )
        except asyncio.CancelledError:
            raise
        except PublishUnroutable as exc:
            # The broker took and confirmed it, so it counts as sent, not as delivered.
            # Logged once until heartbeats are delivered again.
            self.heartbeats_sent += 1
            self.heartbeats_unroutable += 1
            self._note_error("heartbeat delivery", exc)
            return False
        except PublishRefused:
            self.heartbeat_failures += 1  # logged by _note_refused, at most once a minute
            return False
        except Exception as exc:
            self.heartbeat_failures += 1
            self._note_error("heartbeat publish", exc)
            return False
        self._note_success("heartbeat publish")
        self.heartbeats_sent += 1
        # A full report queued while no allocator consumes (the broker definitions declared
        # the queue; the allocator is not up yet) expires there after two intervals, and the
        # deltas after it would reach an allocator that never saw it. Asked after the publish
        # was confirmed: a consumer there now will be handed the report.
        if isinstance(heartbeat, Heartbeat) and await self.allocator_consumers() == 0:
            self.full_reports_unread += 1
            self._note_error("heartbeat delivery", NoAllocatorConsuming())
            return False
        self._note_success("heartbeat delivery")
        self.heartbeats_delivered += 1
        return True

    async def allocator_consumers(self) -> int | None:
        """How many consumers the allocator's queue has (the active allocator and standbys),
        by a passive declaration (which needs no permission: the agent's least-privilege user
        may) on a channel of its own; None when the broker does not say: not connected, or no
        queue of that name (none declared yet, or the allocator's ``queue_name`` renamed it,
        and then heartbeats go on as if one consumed)."""
        connection = self._connection
        if connection is None or connection.is_closed:
            return None
        try:
            async with asyncio.timeout(self.timeout_s):
                # Its own channel: a missing queue closes the channel that asked.
                channel = await connection.channel(publisher_confirms=False)
                try:
                    underlay = await channel.get_underlay_channel()
                    declared = await underlay.queue_declare(ALLOCATOR_QUEUE, passive=True)
                    return int(declared.consumer_count or 0)
                finally:
                    with contextlib.suppress(Exception):  # closed by the broker already
                        await channel.close()
        except (TimeoutError, OSError, aio_pika.exceptions.AMQPError):
            return None

    def submit_event(self, event: ContainerEvent) -> None:
        """Queue a container event; the flush task publishes it at once, in order.

        Never blocks, so a broker outage cannot hold up the Docker event stream. When the
        buffer is full the oldest event is dropped (logged and counted).
        """
        if len(self._buffer) >= self.buffer_size:
            dropped = self._buffer.popleft()
            self.events_dropped += 1
            log.error("event buffer full (%d): dropped %s of container %s (lease %s)",
                      self.buffer_size, dropped.action, dropped.container_id[:12],
                      dropped.lease_id)
        self._buffer.append(event)
        self._kick.set()

    async def flush(self, timeout_s: float | None = None) -> bool:
        """Try to publish every buffered event now; True if the buffer is empty after."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                async with self._lock:
                    await self._drain()
        return not self._buffer

    async def _drain(self) -> None:
        """Publish buffered events in order until one fails. Caller holds the lock."""
        while self._buffer:
            event = self._buffer[0]
            try:
                await self._publish(
                    encode(event),
                    event_routing_key(event.host),
                    kind=event.kind,
                    persistent=True,
                    expiration=None,
                    mandatory=True,  # unroutable = nobody got it: keep it and retry
                )
            except asyncio.CancelledError:
                raise
            except PublishRefused:
                self.event_failures += 1  # logged by _note_refused, at most once a minute
                return
            except Exception as exc:
                self.event_failures += 1
                self._note_error("event publish", exc, f" ({len(self._buffer)} buffered)")
                return
            self._note_success("event publish")
            if self._buffer and self._buffer[0] is event:
                self._buffer.popleft()
            self.events_sent += 1

    async def _flush_loop(self) -> None:
        # Publishes buffered events: at once when one is submitted or the connection comes
        # back, and every reconnect_s while some wait (a retry after a failure).
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.reconnect_s if self._buffer else None):
                    await self._kick.wait()
            self._kick.clear()
            if self._buffer:
                async with self._lock:
                    await self._drain()
