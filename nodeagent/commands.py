"""Commands from the allocator: stop a lease container on this host at once; its hello.

When the hub stops a notebook, Swarm sends the container SIGTERM only seconds after the
service is removed (Docker 20.10 first waits 2 s for gossip to converge); the allocator knows
of the stop at once (the hub's release) and asks this host's agent to stop the container, so
the GPU is free in milliseconds. The allocator also asks when an admin force-released a lease
and when a container runs for a lease that is already finished.

The agent consumes a queue of its own, ``swarm-gpu.agent.<host>`` (classic, not durable, gone
a while after its agent: :func:`allocator.wire.topology.agent_queue_spec`), bound to the agents
exchange with ``stop.<host>`` only. A command is carried out only if

1. its AMQP ``user_id`` (which the broker verifies) is one of ``command_users``: defense in
   depth on top of the broker's permissions, which let only the allocator write there;
2. it decodes as a command (:data:`~allocator.wire.protocol.AgentCommand`) for this very host;
3. for a :class:`~allocator.wire.protocol.StopContainer`, the container carries the label
   ``swarm-gpu.lease`` with the command's lease id
   (:meth:`~nodeagent.containers.ContainerWatcher.stop_lease_container`): nothing else on the
   host is ever touched.

An :class:`~allocator.wire.protocol.AllocatorHello` (the allocator says which optional parts of
node messages it reads: the agent then sends them, see ``gpu_processes`` in
:mod:`nodeagent.config`) goes to the agent at once; it arrives through the same queue, so an
agent without this consumer (``docker`` or ``stop_commands`` off) never gets one.

The stop (``docker stop -t grace_s``) runs in a task of its own, so a long grace holds up
nothing; the container's ``die`` event then releases the lease as usual. Every message is
acknowledged (a command that fails is not retried by redelivery: the allocator asks again
if heartbeats keep listing the container), and nothing a message says can end the consumer.

The consumer does not rely on aio-pika's robust connection: a loop of its own connects,
declares, binds and consumes, then watches the connection, the channel and the consumer
(the broker cancels a consumer whose queue is deleted) and starts over after any of them
ended, every ``reconnect_s``, for as long as the agent runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, cast

import aio_pika
import aio_pika.abc
import aiormq

from allocator.amqp import broker
from allocator.amqp.declare import (
    OnRefusal,
    Refusal,
    Tolerate,
    declare_exchange,
    declare_queue,
)
from allocator.tasks import cancel_and_wait
from allocator.wire.protocol import AllocatorHello, StopContainer, decode_agent_command
from allocator.wire.topology import (
    AGENTS_EXCHANGE,
    AGENTS_EXCHANGE_SPEC,
    agent_queue_spec,
    command_routing_key,
)
from nodeagent.containers import StopOutcome

log = logging.getLogger(__name__)

APP_ID = "swarm-gpu-nodeagent"
PREFETCH = 64
"""Unacknowledged commands the broker hands over at once (each is acknowledged at once)."""

Stopper = Callable[[str, str, float], Awaitable[StopOutcome]]
"""``(container_id, lease_id, grace_s) -> outcome``: stops a lease container."""

HelloHandler = Callable[[AllocatorHello], None]
"""Told every :class:`~allocator.wire.protocol.AllocatorHello` for this host (in the event loop)."""


class CommandConsumer:
    """Consumes one host's command queue: stops the lease containers it names, and hands each
    allocator hello to ``on_hello``.

    ``counters`` (all since start): ``received``, ``refused_user`` (sender not in
    ``command_users``), ``invalid`` (did not decode), ``wrong_host``, ``hellos``, ``duplicate``
    (a stop of that container for that lease is already under way), ``failed`` (Docker error
    or timeout), and one ``outcome_<StopOutcome>`` per stop carried out (``outcome_stopped``,
    ``outcome_gone``, ``outcome_not_running``, ``outcome_wrong_lease``); ``sessions``: times the
    consumer was (re)established.
    """

    def __init__(self, amqp_url: str, host: str, stopper: Stopper, *,
                 command_users: Iterable[str], timeout_s: float = 5.0,
                 reconnect_s: float = 2.0, check_s: float = 5.0,
                 on_hello: HelloHandler | None = None) -> None:
        if any(char in host for char in "*#"):
            # A topic binding key with a wildcard would receive other hosts' commands.
            raise ValueError(f"host name {host!r} cannot be a routing key (it has * or #)")
        self.amqp_url = amqp_url
        self.host = host
        self.stopper = stopper
        self.on_hello = on_hello
        self.command_users = frozenset(command_users)
        self.timeout_s = timeout_s
        self.reconnect_s = reconnect_s
        self.check_s = check_s
        self.spec = agent_queue_spec(host)
        self.counters: Counter[str] = Counter()
        self.last_error: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._consuming = asyncio.Event()
        self._tried = asyncio.Event()
        """Set once the first session was established or failed."""
        self._stopping: dict[tuple[str, str], asyncio.Task[None]] = {}
        """(container id, lease id) -> its stop under way."""
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._stopped = False

    # ------------------------------------------------------------------ life

    @property
    def consuming(self) -> bool:
        """Whether the consumer is established now."""
        return self._consuming.is_set()

    async def start(self, wait_s: float | None = None) -> bool:
        """Start consuming in the background; wait up to ``wait_s`` (default: the timeout)
        for the first attempt to connect. True if consuming now; a broker that is down is
        retried in the background."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="agent-commands")
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.timeout_s if wait_s is None else wait_s):
                await self._tried.wait()
        return self.consuming

    async def wait_consuming(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until the consumer is established."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._consuming.wait()
        return self.consuming

    async def stop(self) -> None:
        """Stop consuming, cancel the stops under way (Docker finishes them), close."""
        self._stopped = True
        await cancel_and_wait([*self._stopping.values(), self._task])
        self._task = None
        self._stopping.clear()
        await self._close()

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        # The flag as well as the cancellation: a cancellation that arrives inside the broker
        # client's connect can come out as a connection error, and the loop must end anyway.
        while not self._stopped:
            try:
                await self._session()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._note_error(exc)
            finally:
                self._tried.set()
                self._consuming.clear()
                await self._close()
            if not self._stopped:
                await asyncio.sleep(self.reconnect_s)

    async def _session(self) -> None:
        """One connection: set up, consume until something breaks, then raise why."""
        broken = asyncio.Event()

        def on_break(*_: Any) -> None:
            broken.set()

        async with asyncio.timeout(self.timeout_s + 1.0):
            connection = await broker.connect(
                self.amqp_url, timeout=self.timeout_s,
                client_properties={"connection_name": f"{APP_ID} commands {self.host}"})
        self._connection = connection
        connection.close_callbacks.add(on_break)
        async with asyncio.timeout(self.timeout_s):
            await self._declare_exchange(connection)
            channel = await connection.channel(publisher_confirms=False)
            channel.close_callbacks.add(on_break)
            await channel.set_qos(prefetch_count=PREFETCH)
            queue = (await declare_queue(connection.channel, self.spec, channel=channel)).value
            assert queue is not None  # nothing tolerated
            await queue.bind(AGENTS_EXCHANGE, command_routing_key(self.host))
            tag = await queue.consume(self._on_message)
            underlay = cast(aiormq.Channel, await channel.get_underlay_channel())
            underlay.on_consumer_cancel_callbacks.add(on_break)
        self.counters["sessions"] += 1
        if self.last_error is not None:
            log.info("commands: consuming %s again", self.spec.name)
        else:
            log.info("commands: consuming %s (stop commands from %s)", self.spec.name,
                     ", ".join(sorted(self.command_users)) or "nobody")
        self.last_error = None
        self._consuming.set()
        self._tried.set()
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.check_s):
                    await broken.wait()
            if connection.is_closed:
                raise ConnectionError("the broker connection closed")
            if channel.is_closed:
                raise ConnectionError("the broker closed the channel")
            if tag not in underlay.consumers:
                raise ConnectionError("the broker cancelled the consumer (queue deleted?)")
            broken.clear()

    async def _declare_exchange(self, connection: aio_pika.abc.AbstractConnection) -> None:
        # The allocator owns the exchange; declaring it (same type and durability) lets an
        # agent start first. A least-privilege agent may not: then it must exist already, and
        # the bind below says so if it does not.
        declared = await declare_exchange(
            lambda: connection.channel(publisher_confirms=False), AGENTS_EXCHANGE_SPEC,
            tolerate=[Tolerate(Refusal.ACCESS, OnRefusal.REPORT)])
        if declared.channel is not None:
            with contextlib.suppress(Exception):
                await declared.channel.close()

    async def _close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and not connection.is_closed:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(self.timeout_s):
                    await connection.close()

    def _note_error(self, exc: BaseException) -> None:
        message = broker.refusal(exc, self.amqp_url, "node agent") or (
            f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        if message != self.last_error:
            log.warning("commands: %s; retrying every %g s", message, self.reconnect_s)
        self.last_error = message

    # ------------------------------------------------------------------ messages

    async def _on_message(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        try:
            self._handle(message)
        except Exception:  # nothing a message says may end the consumer
            self.counters["failed"] += 1
            log.exception("commands: handling a message failed")
        finally:
            with contextlib.suppress(Exception):
                await message.ack()

    def _handle(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        self.counters["received"] += 1
        if message.user_id not in self.command_users:
            self.counters["refused_user"] += 1
            log.warning("commands: ignored a command from broker user %r (command_users: %s)",
                        message.user_id, ", ".join(sorted(self.command_users)) or "none")
            return
        command = decode_agent_command(message.body)
        if isinstance(command, str):
            self.counters["invalid"] += 1
            log.warning("commands: ignored a message that is no command: %s", command)
            return
        if command.host != self.host:
            self.counters["wrong_host"] += 1
            what = (f"a stop of container {command.container_id[:12]}"
                    if isinstance(command, StopContainer) else "a hello")
            log.warning("commands: ignored %s for host %r (this is %r)", what, command.host,
                        self.host)
            return
        if isinstance(command, AllocatorHello):
            self.counters["hellos"] += 1
            if self.on_hello is not None:
                self.on_hello(command)
            return
        # A repeat is the same container for the same lease: a stop for another lease (left
        # alone once its label is read) must not swallow the right one arriving meanwhile.
        key = (command.container_id, command.lease_id)
        if key in self._stopping:
            self.counters["duplicate"] += 1
            return
        task = asyncio.create_task(self._stop(command), name="stop-container")
        self._stopping[key] = task
        task.add_done_callback(lambda _: self._stopping.pop(key, None))

    async def _stop(self, command: StopContainer) -> None:
        short = command.container_id[:12]
        context = {"lease_id": command.lease_id, "host": command.host}  # JSON logs' fields
        log.info("commands: stopping container %s of lease %s (%s, grace %g s)", short,
                 command.lease_id, command.reason.value, command.grace_s, extra=context)
        started = time.monotonic()
        try:
            outcome = await self.stopper(command.container_id, command.lease_id,
                                         command.grace_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.counters["failed"] += 1
            log.error("commands: could not stop container %s of lease %s: %s", short,
                      command.lease_id, f"{type(exc).__name__}: {exc}", extra=context)
            return
        self.counters[f"outcome_{outcome.value}"] += 1
        took = time.monotonic() - started
        if outcome is StopOutcome.WRONG_LEASE:
            log.warning("commands: left container %s alone: it is not a container of lease %s",
                        short, command.lease_id, extra=context)
        elif outcome is StopOutcome.STOPPED:
            log.info("commands: container %s of lease %s stopped in %.2f s", short,
                     command.lease_id, took, extra=context)
        else:
            log.info("commands: container %s of lease %s: %s (nothing to do)", short,
                     command.lease_id, outcome.value.replace("_", " "), extra=context)
