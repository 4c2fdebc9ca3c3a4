"""RPC client for the allocator, over AMQP with RabbitMQ's direct reply-to.

Every call is bounded: connecting, publishing and waiting for the reply each have a
timeout, and a call that runs out raises :class:`AllocatorTimeout` instead of hanging
(a publish to a broker that is down blocks forever otherwise). The request carries its
own ``deadline`` and an AMQP ``expiration`` with the same bound, so the allocator never
grants a request whose caller has already given up.

Replies are JSON (never pickle). Usage::

    async with AllocatorClient("amqp://hub:secret@rabbit/") as client:
        lease = await client.allocate(AllocateRequest(request_key="hub/alice/", user="alice",
                                                      model="1070"))

A request that may wait (``wait_s > 0``) is best sent with
:meth:`AllocatorClient.allocate_and_wait`: the allocator pushes the grant to the call's reply
address when it is decided, and the client keeps its channel open until then
(docs/protocol.md, "Waiting in the queue").
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Self, TypeVar

import aio_pika
import aio_pika.abc
from pydantic import BaseModel, ValidationError

from allocator import __version__
from allocator.amqp import broker
from allocator.amqp.broker import broker_user, redact
from allocator.wire.protocol import (
    CLIENT_RELEASE_HEADER,
    READ_EXTRA,
    REPLY_ADAPTER,
    AllocateRequest,
    BookingReply,
    BookingRequest,
    BookingView,
    DrainReply,
    DrainRequest,
    ErrorCode,
    ErrorReply,
    InventoryReply,
    InventoryRequest,
    Lease,
    LeaseReply,
    LeasesReply,
    LeasesRequest,
    LeaseState,
    QueueReply,
    QueueRequest,
    QuotaReply,
    QuotaRequest,
    ReleaseRequest,
    Reply,
    StatusRequest,
    describe_validation_error,
    encode,
)
from allocator.wire.topology import ALLOCATOR_QUEUE, DIRECT_REPLY_TO, RPC_EXCHANGE, RPC_ROUTING_KEY

log = logging.getLogger(__name__)

ReplyT = TypeVar("ReplyT", bound=BaseModel)


class AllocatorError(Exception):
    """The allocator answered with an error, or no answer could be had."""

    def __init__(self, code: ErrorCode, message: str, details: dict[str, Any] | None = None):
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.details = details or {}


class UnreadableReply(AllocatorError):
    """The allocator answered, but this client cannot read the answer (an allocator of a newer,
    incompatible protocol, or a bug): ``internal_error``. Whatever the request did was done."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.INTERNAL_ERROR, message)


class AllocatorTimeout(AllocatorError):
    """No reply arrived within the call's timeout (the allocator may be down or overloaded)."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.TIMEOUT, message)


class StillQueued(AllocatorTimeout):
    """A queued request was not granted within the caller's own wait (the allocator answers;
    it just had no GPU). Distinct from a call that got no reply."""

    def __init__(self, wait_s: float):
        super().__init__(f"still queued after {wait_s:g} s")
        self.wait_s = wait_s


class AllocatorUnavailable(AllocatorError):
    """The broker cannot be reached, or no allocator queue receives requests."""

    def __init__(self, message: str):
        super().__init__(ErrorCode.UNAVAILABLE, message)


class AllocatorQueueFull(AllocatorUnavailable):
    """The broker refuses requests because the allocator's inbound queue is at its bound
    (the broker policy's ``max-length``, ``overflow: reject-publish``): the allocator is far
    behind or stopped. Nothing was enqueued; a later call may go through."""

    def __init__(self, queue: str, waiting: int):
        super().__init__(
            f"the allocator's queue {queue} is full ({waiting} messages wait in it): the "
            "broker refuses new requests until the allocator catches up (it is far behind or "
            "stopped); try again later")
        self.waiting = waiting


class ClientClosed(AllocatorUnavailable):
    """The client was closed while a call or a wait was under way."""

    def __init__(self) -> None:
        super().__init__("the client was closed")


QueuedCallback = Callable[[Lease], Awaitable[None] | None]
"""Told of each ``queued`` lease a wait in the queue learns of (its position may change)."""

DEFAULT_RECHECK_S = 15.0
"""How long a wait in the queue goes without news before it asks ``status`` once: the grant
is pushed, so this only bounds how late an answer comes after an allocator restart."""


class AllocatorClient:
    """Typed RPC calls to the allocator. Safe to share between tasks of one event loop."""

    def __init__(
        self,
        amqp_url: str,
        *,
        timeout_s: float = 10.0,
        connect_timeout_s: float = 5.0,
        exchange: str = RPC_EXCHANGE,
        routing_key: str = RPC_ROUTING_KEY,
        queue_name: str = ALLOCATOR_QUEUE,
    ) -> None:
        self.amqp_url = amqp_url
        self.queue_name = queue_name
        """The allocator's inbound queue, asked how full it is when requests are refused."""
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.exchange_name = exchange
        self.routing_key = routing_key
        self.user_id = broker_user(amqp_url)
        self._connection: aio_pika.abc.AbstractRobustConnection | None = None
        self._channel: aio_pika.abc.AbstractChannel | None = None
        self._exchange: aio_pika.abc.AbstractExchange | None = None
        self._pending: dict[str, asyncio.Future[bytes]] = {}
        self._streams: dict[str, asyncio.Queue[bytes | AllocatorError]] = {}
        """Correlation id -> the answers of a wait in the queue (its calls and the pushes)."""
        self._connect_lock = asyncio.Lock()
        self.requests_refused = 0
        """Requests the broker refused and this client sent again on a new channel."""

    async def __aenter__(self) -> Self:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def connected(self) -> bool:
        """Whether a channel is open now."""
        return self._channel is not None and not self._channel.is_closed

    async def connect(self) -> None:
        """Open the connection and the reply consumer (idempotent)."""
        async with self._connect_lock:
            if self.connected:
                return
            await self._close_quietly()
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    self._connection = await broker.connect_robust(
                        self.amqp_url, timeout=self.connect_timeout_s)
                await self._open_channel(self._connection)
            except (TimeoutError, OSError, aio_pika.exceptions.AMQPError) as exc:
                await self._close_quietly()
                reason = broker.connection_failure(exc, self.amqp_url)
                raise AllocatorUnavailable(
                    f"cannot reach the broker at {redact(self.amqp_url)}: {reason}"
                ) from exc

    async def _open_channel(self, connection: aio_pika.abc.AbstractRobustConnection) -> None:
        """A channel with its direct reply-to consumer, the one requests go out on from now.

        With publisher confirms: the broker says whether it took each request, and a refused
        one is sent again on a new channel (:func:`allocator.amqp.broker.is_refused`). They cost no
        extra wait: the allocator sees a request only after the quorum queue took it, which is
        when the confirm comes.
        """
        async with asyncio.timeout(self.connect_timeout_s):
            channel = await connection.channel(publisher_confirms=True)
        channel.return_callbacks.add(self._on_return)
        channel.close_callbacks.add(self._on_channel_close)
        reply_queue = await channel.get_queue(DIRECT_REPLY_TO, ensure=False)
        async with asyncio.timeout(self.connect_timeout_s):
            await reply_queue.consume(self._on_reply, no_ack=True)
        self._exchange = await channel.get_exchange(self.exchange_name, ensure=False)
        self._channel = channel

    async def _replace_channel(self, refused: aio_pika.abc.AbstractChannel) -> None:
        """Requests go out on a new channel of the same connection from now on; ``refused``
        (whose publishes the broker refuses, or does not confirm) is closed, once, by
        whichever call saw it first.

        Calls waiting for a reply keep waiting: a refused request was never enqueued and is
        sent again on the new channel, whose consumer gets its reply (replies are matched by
        correlation id, whatever channel they come on).
        """
        async with self._connect_lock:
            if self._channel is not refused:
                return  # replaced already, or the connection was closed meanwhile
            log.warning("the broker refused a request or did not confirm it in time (a broker "
                        "node holding a queue's leader lost?); requests go out on a new channel")
            connection = self._connection
            self._channel, self._exchange = None, None
            refused.close_callbacks.discard(self._on_channel_close)
            with contextlib.suppress(Exception):  # it is being thrown away
                async with asyncio.timeout(self.connect_timeout_s):
                    await refused.close()
            if connection is None or connection.is_closed:
                return  # the next publish connects again
            try:
                await self._open_channel(connection)
            except (TimeoutError, OSError, aio_pika.exceptions.AMQPError) as exc:
                raise AllocatorUnavailable(
                    f"cannot open a channel to the broker at {redact(self.amqp_url)}: "
                    f"{str(exc) or type(exc).__name__}") from exc

    async def close(self) -> None:
        """Close the connection; pending calls and waits fail with :class:`ClientClosed`."""
        async with self._connect_lock:
            await self._close_quietly()
            self._tell_streams(ClientClosed())

    async def _close_quietly(self) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(ClientClosed())
        self._pending.clear()
        connection, self._connection, self._channel, self._exchange = (
            self._connection, None, None, None,
        )
        if connection is not None:
            try:
                async with asyncio.timeout(self.connect_timeout_s):
                    await connection.close()
            except Exception:  # closing a broken connection may fail in many ways; it is gone
                log.debug("error while closing the allocator connection", exc_info=True)

    async def _on_reply(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        correlation_id = message.correlation_id or ""
        stream = self._streams.get(correlation_id)
        if stream is not None:
            stream.put_nowait(message.body)
            return
        future = self._pending.pop(correlation_id, None)
        if future is not None and not future.done():
            future.set_result(message.body)

    def _tell_streams(self, error: AllocatorError) -> None:
        """Wake every wait in the queue: its reply address is gone with the channel."""
        for stream in {id(q): q for q in self._streams.values()}.values():
            stream.put_nowait(error)

    def _on_channel_close(self, _channel: Any, exc: BaseException | None = None) -> None:
        # A channel error (e.g. the RPC exchange does not exist yet) closes the channel; the
        # calls waiting on it would otherwise sit out their whole timeout.
        reason = f": {exc}" if exc else ""
        for future in self._pending.values():
            if not future.done():
                future.set_exception(AllocatorUnavailable(f"the broker closed the channel{reason}"))
        self._pending.clear()
        self._tell_streams(AllocatorUnavailable(f"the broker closed the channel{reason}"))
        self._channel = None

    def _on_return(self, _channel: Any, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        unrouted = AllocatorUnavailable("no allocator queue is bound to receive requests")
        stream = self._streams.get(message.correlation_id or "")
        if stream is not None:
            stream.put_nowait(unrouted)
            return
        future = self._pending.pop(message.correlation_id or "", None)
        if future is not None and not future.done():
            future.set_exception(unrouted)

    async def call(self, request: BaseModel, *, timeout_s: float | None = None) -> Reply:
        """Send one request and return the allocator's reply (errors included, not raised)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        started = time.monotonic()
        if not self.connected:
            await self.connect()  # before the call is pending: connecting fails pending calls
        correlation_id = uuid.uuid4().hex
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._pending[correlation_id] = future
        try:
            await self._publish(request, correlation_id, timeout)
            remaining = timeout - (time.monotonic() - started)
            try:
                async with asyncio.timeout(max(remaining, 0.001)):
                    body = await future
            except TimeoutError as exc:
                raise _no_answer(timeout) from exc
        finally:
            self._pending.pop(correlation_id, None)
            if future.done() and not future.cancelled():
                # Failed by close() while the publish was still in flight, and never awaited:
                # the publish's own error is what the caller gets; asyncio would otherwise
                # log "Future exception was never retrieved".
                future.exception()
        return _read_reply(body)

    async def _publish(self, request: BaseModel, correlation_id: str, bound_s: float) -> None:
        """Publish ``request`` with its deadline, answers to come on ``correlation_id``.

        Returns once the broker has taken it. A request the broker refuses is sent again, on
        a new channel, every :data:`~allocator.amqp.broker.REFUSED_RETRY_S` until ``bound_s`` is
        spent (a quorum queue whose leader's node was just lost, see
        :func:`allocator.amqp.broker.is_refused`); then it is :class:`AllocatorUnavailable`.
        """
        give_up = time.monotonic() + bound_s
        if "deadline" in type(request).model_fields:
            request = request.model_copy(update={"deadline": time.time() + bound_s})
        message = aio_pika.Message(
            body=encode(request),
            content_type="application/json",
            correlation_id=correlation_id,
            reply_to=DIRECT_REPLY_TO,
            expiration=max(bound_s, 0.001),
            user_id=self.user_id,
            delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT,
            # Replies may carry this release's fields (a 0.1.0 client, which sends no such
            # header, gets only 0.1.0's: it refuses a field it does not know).
            headers={CLIENT_RELEASE_HEADER: __version__},
        )
        if not self.connected:
            await self.connect()
        refusals = 0
        while True:
            channel, exchange = self._channel, self._exchange
            if channel is None or exchange is None or channel.is_closed:
                # Lost while the refused request waited to be sent again: the caller's
                # next call connects anew (connecting here would fail the pending calls).
                raise AllocatorUnavailable("the broker connection was lost")
            try:
                await exchange.publish(message, routing_key=self.routing_key, mandatory=True,
                                       timeout=max(give_up - time.monotonic(), 0.001))
                return
            except TimeoutError as exc:
                # Not confirmed in time: the next call goes out on a new channel, in case
                # this one is wedged (seen on a channel whose queue lost its leader).
                await self._replace_channel(channel)
                raise AllocatorTimeout(
                    f"publishing the request took longer than {bound_s:g} s (is the broker down?)"
                ) from exc
            except aio_pika.exceptions.AMQPError as exc:
                if not broker.is_refused(exc):
                    await self._close_quietly()
                    raise AllocatorUnavailable(f"the broker refused the request: {exc}") from exc
                refusals += 1
                if refusals > 1:
                    # Refused on a new channel too: a queue at its bound refuses every
                    # channel, while a lost leader's refusal ends with a new channel.
                    waiting = await self._messages_waiting()
                    if waiting:
                        raise AllocatorQueueFull(self.queue_name, waiting) from exc
                if time.monotonic() + broker.REFUSED_RETRY_S >= give_up:
                    raise AllocatorUnavailable(
                        f"the broker refused the request for {bound_s:g} s (the allocator's "
                        "queue has no leader it can reach)") from exc
                self.requests_refused += 1
            await self._replace_channel(channel)
            await asyncio.sleep(broker.REFUSED_RETRY_S)

    async def _messages_waiting(self) -> int | None:
        """How many messages wait in the allocator's queue, by a passive declaration (which
        needs no permission) on a channel of its own; None when the broker does not say.

        A quorum queue without a leader it can reach counts 0, so a count is also the sign
        that the queue has a leader: refusals then mean it is full."""
        connection = self._connection
        if connection is None or connection.is_closed:
            return None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                channel = await connection.channel(publisher_confirms=False)
                try:
                    underlay = await channel.get_underlay_channel()
                    declared = await underlay.queue_declare(self.queue_name, passive=True)
                    return int(declared.message_count or 0)
                finally:
                    with contextlib.suppress(Exception):  # closed by a refusal already
                        await channel.close()
        except (TimeoutError, OSError, aio_pika.exceptions.AMQPError):
            return None

    async def _expect(
        self, request: BaseModel, expected: type[ReplyT], timeout_s: float | None
    ) -> ReplyT:
        reply = await self.call(request, timeout_s=timeout_s)
        if isinstance(reply, ErrorReply):
            raise AllocatorError(reply.error.code, reply.error.message, reply.error.details)
        if not isinstance(reply, expected):
            raise AllocatorError(
                ErrorCode.INTERNAL_ERROR,
                f"expected a {expected.__name__} reply, got {type(reply).__name__}",
            )
        return reply

    async def allocate(self, request: AllocateRequest, *, timeout_s: float | None = None) -> Lease:
        """Ask for GPUs. Returns a ``granted`` lease, or a ``queued`` one when it waits.

        A reply this client cannot read may be a grant it will never use: the request key is
        released at once and :class:`UnreadableReply` raised (:meth:`_give_back`).
        """
        try:
            return (await self._expect(request, LeaseReply, timeout_s)).lease
        except UnreadableReply as exc:
            raise await self._give_back(request.request_key, exc) from exc

    async def _give_back(self, request_key: str, unreadable: UnreadableReply) -> UnreadableReply:
        """Release ``request_key`` after an answer to its allocate could not be read, and say
        so in one line (the error to raise).

        The allocator may have granted (or queued) the request: left alone, the GPUs would stay
        held until the bind timeout with nobody to use them. A release by request key is
        harmless when nothing was granted (``not_found``), and an allocator whose grant was
        unreadable has applied the release even when its answer to that is unreadable too.
        """
        try:
            await self.release(request_key=request_key, by="client",
                               reason="the client could not read the allocator's answer")
            outcome = "released it"
        except UnreadableReply:
            outcome = "released it (that answer was unreadable too)"
        except AllocatorError as exc:
            outcome = ("nothing to release" if exc.code is ErrorCode.NOT_FOUND
                       else f"could not release it ({exc}): it is held until its bind timeout")
        log.warning("allocate %s: unreadable answer, %s", request_key, outcome)
        return UnreadableReply(
            f"the allocator's answer to allocate {request_key!r} cannot be read by this client "
            f"({unreadable}); {outcome}; an allocator of a newer protocol? see "
            "docs/protocol.md#compatibility")

    async def release(
        self,
        *,
        lease_id: str | None = None,
        request_key: str | None = None,
        by: str = "hub",
        reason: str = "",
        force: bool = False,
        timeout_s: float | None = None,
    ) -> Lease:
        """Release a lease (or withdraw a queued request). Releasing twice is harmless."""
        request = ReleaseRequest(
            lease_id=lease_id, request_key=request_key, by=by, reason=reason, force=force
        )
        return (await self._expect(request, LeaseReply, timeout_s)).lease

    async def status(
        self,
        *,
        lease_id: str | None = None,
        request_key: str | None = None,
        timeout_s: float | None = None,
    ) -> Lease:
        """A lease by id, or the newest lease of a request key (with its queue position)."""
        request = StatusRequest(lease_id=lease_id, request_key=request_key)
        return (await self._expect(request, LeaseReply, timeout_s)).lease

    async def inventory(
        self, *, include_leases: bool = False, timeout_s: float | None = None
    ) -> InventoryReply:
        """Nodes, GPUs, per-model summary and queue length."""
        return await self._expect(
            InventoryRequest(include_leases=include_leases), InventoryReply, timeout_s
        )

    async def quota(self, user: str, groups: Sequence[str] = (), *, count: float | None = None,
                    model: str | None = None, timeout_s: float | None = None) -> QuotaReply:
        """The user's quotas (theirs, then their groups') and what each holds now; with
        ``count``, also whether a grant of that many GPUs (of ``model``, whose per-model
        quotas then count too) now would be borrowed."""
        request = QuotaRequest(user=user, groups=list(groups), count=count, model=model)
        return await self._expect(request, QuotaReply, timeout_s)

    async def leases(self, user: str | None = None, *, include_finished_s: float = 0.0,
                     include_usage: bool = False,
                     timeout_s: float | None = None) -> LeasesReply:
        """One user's leases (None: everyone's), with those ended within
        ``include_finished_s`` and, with ``include_usage``, their per-minute GPU use."""
        request = LeasesRequest(user=user, include_finished_s=include_finished_s,
                                include_usage=include_usage)
        return await self._expect(request, LeasesReply, timeout_s)

    async def queue(self, *, timeout_s: float | None = None) -> list[Lease]:
        """Queued requests in the order they will be served."""
        return (await self._expect(QueueRequest(), QueueReply, timeout_s)).leases

    async def drain(
        self,
        host: str,
        *,
        gpu_uuid: str | None = None,
        drained: bool = True,
        by: str = "admin",
        reason: str = "",
        timeout_s: float | None = None,
    ) -> DrainReply:
        """Admin: drain (or undrain) a node or one GPU."""
        request = DrainRequest(host=host, gpu_uuid=gpu_uuid, drained=drained, by=by, reason=reason)
        return await self._expect(request, DrainReply, timeout_s)

    async def add_booking(self, booking: Mapping[str, Any], *, by: str = "admin",
                          reason: str = "", timeout_s: float | None = None) -> BookingView:
        """Admin: add a booking (its body as ``docs/protocol.md`` describes it). A refusal
        raises :class:`AllocatorError` with the booking's error code (``collides``: the
        details say what collides and what would fit)."""
        request = BookingRequest(op="add", booking=dict(booking), by=by, reason=reason)
        return (await self._expect(request, BookingReply, timeout_s)).bookings[0]

    async def remove_booking(self, name: str, *, by: str = "admin", reason: str = "",
                             timeout_s: float | None = None) -> BookingView:
        """Admin: remove a booking by name; returns it as it was."""
        request = BookingRequest(op="remove", name=name, by=by, reason=reason)
        return (await self._expect(request, BookingReply, timeout_s)).bookings[0]

    async def bookings(self, *, by: str = "admin",
                       timeout_s: float | None = None) -> list[BookingView]:
        """Admin: every booking, in the order admitted, with its next occurrences and any
        shortfall."""
        request = BookingRequest(op="list", by=by)
        return (await self._expect(request, BookingReply, timeout_s)).bookings

    async def allocate_and_wait(
        self,
        request: AllocateRequest,
        *,
        recheck_s: float = DEFAULT_RECHECK_S,
        on_queued: QueuedCallback | None = None,
    ) -> Lease:
        """Ask for GPUs and, when the request is queued, wait for the grant to be pushed.

        Returns the ``granted`` lease (at once, or the moment the allocator grants it: it
        publishes the outcome to this call's reply address, see docs/protocol.md). No polling:
        a ``status`` call goes out only after ``recheck_s`` without news (an allocator that
        restarted forgets where to push) or after the connection was lost. ``on_queued`` gets
        each ``queued`` lease this wait learns of (its ``queue_position``).

        Raises :class:`AllocatorError` for a refusal, ``no_capacity`` when the request's wait
        ran out (or it was withdrawn), and :class:`StillQueued` if ``request.wait_s`` (plus
        one call timeout) passes first.
        """
        return await self._wait_in_queue(request, request.request_key, wait_s=request.wait_s,
                                         recheck_s=recheck_s, on_queued=on_queued)

    async def wait_for_grant(
        self,
        request_key: str,
        *,
        wait_s: float,
        recheck_s: float = DEFAULT_RECHECK_S,
        on_queued: QueuedCallback | None = None,
    ) -> Lease:
        """Wait for the grant of a request queued earlier (by this client or one before a
        reconnect): one ``status`` call, then as :meth:`allocate_and_wait`."""
        return await self._wait_in_queue(StatusRequest(request_key=request_key), request_key,
                                         wait_s=wait_s, recheck_s=recheck_s,
                                         on_queued=on_queued)

    async def _wait_in_queue(self, first: AllocateRequest | StatusRequest, request_key: str, *,
                             wait_s: float, recheck_s: float,
                             on_queued: QueuedCallback | None) -> Lease:
        """Send ``first``, then read every answer about the request (replies to this wait's
        calls and the allocator's pushes, on correlation ids of one stream) until it is
        granted or ended; ``status`` again after ``recheck_s`` without news."""
        started = time.monotonic()
        give_up = started + wait_s + self.timeout_s
        stream: asyncio.Queue[bytes | AllocatorError] = asyncio.Queue()
        mine: list[str] = []

        async def ask(request: BaseModel) -> None:
            correlation_id = uuid.uuid4().hex
            self._streams[correlation_id] = stream
            mine.append(correlation_id)
            await self._publish(request, correlation_id, self.timeout_s)

        try:
            await ask(first)
            answered = False
            # The first call is answered within the call timeout, or raises like any call.
            wake_at = started + self.timeout_s
            while True:
                now = time.monotonic()
                if now >= give_up:
                    raise StillQueued(wait_s)
                try:
                    async with asyncio.timeout(min(wake_at, give_up) - now):
                        item = await stream.get()
                except TimeoutError:
                    if not answered and time.monotonic() < give_up:
                        raise _no_answer(self.timeout_s) from None
                    # No news for recheck_s: the allocator may have restarted and forgotten
                    # where to push; ask (which also tells it where to push from now on).
                    await self._ask_again(ask, request_key, give_up)
                    wake_at = time.monotonic() + recheck_s
                    continue
                if isinstance(item, AllocatorError):
                    if not answered or isinstance(item, ClientClosed):
                        raise item
                    # The channel (and its reply address) is gone: reconnect and ask.
                    await self._ask_again(ask, request_key, give_up)
                    wake_at = time.monotonic() + recheck_s
                    continue
                try:
                    reply = _read_reply(item)
                except UnreadableReply as exc:
                    raise await self._give_back(request_key, exc) from exc
                if isinstance(reply, ErrorReply):
                    raise AllocatorError(reply.error.code, reply.error.message,
                                         reply.error.details)
                if not isinstance(reply, LeaseReply):
                    raise AllocatorError(ErrorCode.INTERNAL_ERROR,
                                         f"expected a lease reply, got {type(reply).__name__}")
                answered = True
                lease = reply.lease
                if lease.state in (LeaseState.GRANTED, LeaseState.BOUND):
                    return lease
                if lease.state is not LeaseState.QUEUED:
                    raise AllocatorError(
                        ErrorCode.NO_CAPACITY,
                        f"the request ended without GPUs ({lease.state.value}"
                        f"{', ' + lease.release_reason.value if lease.release_reason else ''})",
                        {"lease": lease.model_dump(mode="json")},
                    )
                if on_queued is not None:
                    result = on_queued(lease)
                    if inspect.isawaitable(result):
                        await result
                wake_at = time.monotonic() + recheck_s
        finally:
            for correlation_id in mine:
                self._streams.pop(correlation_id, None)

    async def _ask_again(self, ask: Callable[[BaseModel], Awaitable[None]], request_key: str,
                         give_up: float) -> None:
        """One ``status`` call of a waiting request; a broker that cannot be reached now is
        tried again, every ``connect_timeout_s`` at most, until ``give_up``."""
        while True:
            try:
                await ask(StatusRequest(request_key=request_key))
                return
            except AllocatorError as exc:
                if time.monotonic() + self.connect_timeout_s >= give_up:
                    raise
                log.info("status of queued request %s not sent (%s); trying again",
                         request_key, exc)
                await asyncio.sleep(min(self.connect_timeout_s, 1.0))


def _no_answer(timeout: float) -> AllocatorTimeout:
    return AllocatorTimeout(
        f"the allocator did not answer within {timeout:g} s "
        "(it may be down, restarting or overloaded)"
    )


def _read_reply(body: bytes) -> Reply:
    """A reply, fields this client does not know ignored (a newer allocator may add some:
    docs/protocol.md, "Compatibility"); :class:`UnreadableReply` when it still cannot be read."""
    try:
        return REPLY_ADAPTER.validate_json(body, extra=READ_EXTRA)
    except ValidationError as exc:
        raise UnreadableReply(
            f"the allocator sent a reply this client cannot read: "
            f"{describe_validation_error(exc)}") from exc


