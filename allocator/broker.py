"""Broker addresses: one AMQP URL may name several broker nodes of one RabbitMQ cluster.

``amqp://user:password@node1:5672,node2:5672,node3:5672/vhost`` is the same user, password,
vhost and options on three nodes (the form libpq and MongoDB use for their clusters). Every
part of swarm-gpu that connects (the allocator, the hub's client, ``gpu-ledger``, the node
agents) takes such a URL: it connects to the first node that answers and, when that
connection drops or an attempt fails, tries the next one, round the list. A one-node URL
behaves exactly as before.

Why in the client and not behind a load balancer: a site that wants the broker highly
available has three broker nodes and no load balancer in front of them (that would be one
more thing to fail), and aio-pika connects to one URL only. Quorum queues and streams are
reachable from every node of the cluster, so any node that answers will do.

One trap of a three-node RabbitMQ 3.10 comes with it (:func:`is_refused`): a channel opened on
a surviving node while a quorum queue is electing a new leader can never publish to that
queue; the publisher must see the refusal (publisher confirms) and open another channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.parse
from collections.abc import Sequence
from typing import Any

import aio_pika
import aio_pika.abc
from aio_pika.abc import TimeoutType
from aiormq.exceptions import AMQPError, DeliveryError, PublishError
from yarl import URL

log = logging.getLogger(__name__)

DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
"""The broker URL every part uses when none is configured: RabbitMQ's own default user on
this machine (development and tests; a deployment names its broker and user)."""


def broker_user(amqp_url: str) -> str:
    """The broker user name in an AMQP URL (``guest`` when the URL names none): the
    ``user_id`` a publisher stamps on its messages, which RabbitMQ checks against the
    connection's user."""
    return urllib.parse.unquote(urllib.parse.urlparse(amqp_url).username or "guest")


def broker_urls(amqp_url: str) -> list[str]:
    """One URL per broker node named in ``amqp_url`` (``host1:port1,host2:port2``), in order.

    Raises ValueError for an empty host in the list (``node1,,node2``).
    """
    parts = urllib.parse.urlsplit(amqp_url)
    credentials, at, hosts = parts.netloc.rpartition("@")
    if "," not in hosts:
        return [amqp_url]
    urls = []
    for host in hosts.split(","):
        if not host.strip():
            raise ValueError(f"an empty broker address in {redact(amqp_url)}")
        netloc = f"{credentials}{at}{host.strip()}"
        urls.append(urllib.parse.urlunsplit(parts._replace(netloc=netloc)))
    return urls


def rotate_nodes(amqp_url: str, by: int) -> str:
    """``amqp_url`` with its list of broker nodes rotated so that node ``by`` (modulo their
    number) comes first: where a new connection should try first. A one-node URL is returned
    as it is."""
    urls = broker_urls(amqp_url)
    if len(urls) == 1:
        return amqp_url
    by %= len(urls)
    parts = urllib.parse.urlsplit(amqp_url)
    credentials, at, _ = parts.netloc.rpartition("@")
    hosts = [urllib.parse.urlsplit(url).netloc.rpartition("@")[2] for url in urls]
    netloc = credentials + at + ",".join(hosts[by:] + hosts[:by])
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


async def silent_nodes(amqp_url: str, timeout: float) -> list[str]:  # noqa: ASYNC109
    """The addresses (``host:port``) of the broker nodes named in ``amqp_url`` that do not
    accept an AMQP connection within ``timeout`` seconds (each tried at once, on its own
    connection).

    A RabbitMQ node opens its AMQP listener only at the end of its boot, after it has joined
    its cluster: a node that accepts a connection is a running member of it.
    """

    async def answers(url: str) -> bool:
        try:
            async with asyncio.timeout(timeout):
                connection = await open_connection(url, timeout=timeout)
                await connection.close()
            return True
        except (OSError, TimeoutError, AMQPError, aio_pika.exceptions.AMQPError):
            return False

    urls = broker_urls(amqp_url)
    answered = await asyncio.gather(*(answers(url) for url in urls))
    return [broker_address(url).partition("/")[0]
            for url, ok in zip(urls, answered, strict=True) if not ok]


def redact(amqp_url: str) -> str:
    """The URL without its password, for messages and log lines."""
    parts = urllib.parse.urlsplit(amqp_url)
    credentials, at, hosts = parts.netloc.rpartition("@")
    user, colon, _ = credentials.partition(":")
    if not (at and colon):
        return amqp_url
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{hosts}"))


def broker_address(amqp_url: str) -> str:
    """``host:port[,host:port...]/vhost`` of an AMQP URL, without credentials."""
    urls = [urllib.parse.urlsplit(url) for url in broker_urls(amqp_url)]
    hosts = ",".join(f"{url.hostname}:{url.port or 5672}" for url in urls)
    return f"{hosts}{urls[0].path or '/'}"


FAILOVER_RECONNECT_S = 1.0
"""Pause before reconnecting over a list of nodes (aio-pika's default is 5 s): the next
attempt goes to another node, which is most likely up."""


class FailoverConnection(aio_pika.RobustConnection):
    """A robust connection over several broker nodes: each new attempt after a drop or a
    failed attempt goes to the next node of the list.

    aio-pika's robust connection clears its transport at the start of every connection
    attempt (and on close); that is where this class moves on to the next URL. The channels,
    queues and consumers are then restored on the node that answers, as after any reconnect.
    """

    def __init__(self, urls: Sequence[str], **kwargs: Any) -> None:
        self._urls = [URL(url) for url in urls]
        self._current = 0
        self._armed = False
        """Whether the first attempt has begun (the constructor clears the transport too)."""
        self._transport: Any = None
        super().__init__(self._urls[0], **kwargs)

    @property
    def transport(self) -> Any:
        return self._transport

    @transport.setter
    def transport(self, value: Any) -> None:
        if value is None and self._armed and len(self._urls) > 1:
            self._current = (self._current + 1) % len(self._urls)
            self.url = self._urls[self._current]
            log.info("broker connection: next attempt to %s", self)
        self._transport = value

    async def connect(self, timeout: TimeoutType = None) -> None:  # noqa: ASYNC109 (aio-pika's)
        # The first attempt goes to the first node; every later one to the next.
        self._armed = False
        self._transport = None
        self.url = self._urls[self._current]
        await super().connect(timeout)

    def arm(self) -> None:
        """From now on, each cleared transport moves to the next node."""
        self._armed = True


REFUSED_RETRY_S = 0.25
"""Pause before publishing a refused message again, on a new channel: a quorum queue's leader
election takes a fraction of a second to a few seconds on a loaded machine."""


def is_refused(exc: BaseException) -> bool:
    """Whether a publish failed because the broker refused it (a ``basic.nack``): nothing was
    enqueued, so sending it again cannot duplicate it; a returned (unroutable) message is not
    a refusal.

    Why a refused publish is sent again **on a new channel**: in RabbitMQ 3.10 a channel's
    first publish to a quorum queue asks the node of the leader named in the queue's record
    (read when the channel first uses the queue) which queue version it runs
    (``rabbit_fifo_client:enqueue/3``). When that node is down, the publish is refused and the
    channel's state is left as it was, so every later publish of that channel to that queue
    asks the dead node again and is refused too, for as long as the channel lives: nacked
    with publisher confirms, dropped without a trace without them. A channel opened on a
    surviving node after the leader's node died and before the new leader is recorded (a
    fraction of a second; seconds on a loaded machine) is in that state, and a client whose
    connection was on the lost node reconnects to the next node at once, into exactly that
    window. A new channel reads the record again and finds the new leader.
    """
    return isinstance(exc, DeliveryError) and not isinstance(exc, PublishError)


async def connect_robust(amqp_url: str, **kwargs: Any) -> aio_pika.abc.AbstractRobustConnection:
    """A robust connection to the first node of ``amqp_url`` that answers; on a drop it
    reconnects to the next node, round the list (one-node URLs: aio-pika's own)."""
    urls = broker_urls(amqp_url)
    if len(urls) > 1:
        kwargs.setdefault("reconnect_interval", FAILOVER_RECONNECT_S)
    if len(urls) == 1:
        robust: aio_pika.abc.AbstractRobustConnection = await aio_pika.connect_robust(
            amqp_url, **kwargs)
        return robust
    last: BaseException | None = None
    for index in range(len(urls)):
        ordered = urls[index:] + urls[:index]
        connection = FailoverConnection(ordered, **_connection_kwargs(kwargs))
        try:
            await connection.connect(timeout=kwargs.get("timeout"))
        except (OSError, TimeoutError, AMQPError, aio_pika.exceptions.AMQPError) as exc:
            last = exc
            with contextlib.suppress(Exception):
                await connection.close()
            log.warning("broker node %s not reachable: %s", broker_address(ordered[0]),
                        str(exc) or type(exc).__name__)
            continue
        connection.arm()
        return connection
    assert last is not None
    raise last


async def open_connection(url: str, timeout: TimeoutType = None,  # noqa: ASYNC109 (aio-pika's)
                          client_properties: dict[str, Any] | None = None,
                          ) -> aio_pika.abc.AbstractConnection:
    """``aio_pika.connect`` to one node, closing the connection object when the attempt
    fails. aio-pika leaves a failed one to its ``__del__``, which schedules ``close()`` on
    whatever loop runs when the object is collected, or, with none running, leaves a
    coroutine that is never awaited (a warning at an arbitrary later moment)."""
    extra: dict[str, Any] = {} if client_properties is None \
        else {"client_properties": client_properties}
    connection = aio_pika.Connection(aio_pika.connection.make_url(url), **extra)
    try:
        await connection.connect(timeout=timeout)
    except BaseException:
        with contextlib.suppress(Exception):
            await connection.close()
        raise
    return connection


async def connect(amqp_url: str, **kwargs: Any) -> aio_pika.abc.AbstractConnection:
    """A plain connection to the first node of ``amqp_url`` that answers."""
    last: BaseException | None = None
    urls = broker_urls(amqp_url)
    for url in urls:
        try:
            return await open_connection(url, **kwargs)
        except (OSError, TimeoutError, AMQPError, aio_pika.exceptions.AMQPError) as exc:
            last = exc
            if len(urls) > 1:  # the caller says why when no node answers
                log.info("broker node %s not reachable: %s", broker_address(url),
                         str(exc) or type(exc).__name__)
    assert last is not None
    raise last


def _connection_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """connect_robust's keyword arguments as the connection class takes them."""
    return {key: value for key, value in kwargs.items() if key != "timeout"}
