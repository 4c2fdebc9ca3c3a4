"""Helpers for tests that stand in for node agents by publishing heartbeats themselves.

Publishing a ``Heartbeat`` on the nodes exchange is exactly what a node agent with a
simulated inventory does; these helpers make the GPUs and messages short to write.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import aio_pika
import aio_pika.abc
import aiodocker

from allocator.engine import Sender
from allocator.wire.lease_container import LEASE_LABEL
from allocator.wire.protocol import (
    ContainerAction,
    ContainerEvent,
    ContainerInfo,
    GPUInfo,
    Health,
    Heartbeat,
    encode,
)
from allocator.wire.topology import (
    DEAD_LETTER_QUEUE,
    NODES_EXCHANGE,
    event_routing_key,
    heartbeat_routing_key,
)

T = TypeVar("T")


class Startable(Protocol):
    """A part that runs between ``start()`` and ``stop()``: a node agent, an allocator."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


PartT = TypeVar("PartT", bound=Startable)


class LabelledDocker(aiodocker.Docker):
    """A Docker client that starts plain containers carrying a lease label (as a notebook's
    container does, without a Swarm service) and removes every one of them when closed."""

    def __init__(self, url: str) -> None:
        super().__init__(url=url)
        self._labelled: list[str] = []

    async def start_labelled(self, label: str, image: str, cmd: list[str], *,
                             stop_signal: str | None = None, prefix: str = "lease") -> str:
        """Start a container of ``image`` running ``cmd`` with the lease label ``label``."""
        config: dict[str, Any] = {"Image": image, "Cmd": cmd, "Labels": {LEASE_LABEL: label},
                                  "HostConfig": {"NetworkMode": "host"}}
        if stop_signal is not None:
            config["StopSignal"] = stop_signal
        container = await self.containers.run(
            config=config, name=f"{prefix}-{label[:16]}-{uuid.uuid4().hex[:6]}")
        self._labelled.append(container.id)
        return str(container.id)

    async def is_running(self, container_id: str | None) -> bool:
        """Whether the container runs; a lease without a known container is a failure."""
        assert container_id is not None, "the lease names no container"
        info = await self.containers.container(container_id).show()
        return bool(info["State"]["Running"])

    async def close(self) -> None:
        for container_id in self._labelled:
            with contextlib.suppress(aiodocker.DockerError, OSError):
                await self.containers.container(container_id).delete(force=True)
        await super().close()


@contextlib.asynccontextmanager
async def started(part: PartT) -> AsyncIterator[PartT]:
    """``part`` started for the ``async with`` block and stopped after it, whatever happens."""
    await part.start()
    try:
        yield part
    finally:
        await part.stop()

GTX1070 = "NVIDIA GeForce GTX 1070"
RTX3090 = "NVIDIA GeForce RTX 3090"
A100 = "NVIDIA A100-SXM4-80GB"
MEMORY = {GTX1070: 8192, RTX3090: 24576, A100: 81920}

# The MIG tests' GPU, as NVML names it and its instances.
A100_40GB = "NVIDIA A100-SXM4-40GB"
MIG_1G = f"{A100_40GB} MIG 1g.5gb"
MIG_3G = f"{A100_40GB} MIG 3g.20gb"

# Senders as the engine sees them, for tests that drive the engine without a broker.
NODE = Sender(user_id="agent", via_nodes_exchange=True)
"""A node agent (broker user ``agent``), through the nodes exchange."""
HUB = Sender(user_id="hub", via_nodes_exchange=False)
"""The hub (broker user ``hub``), through the RPC exchange."""
ADMIN = Sender(user_id="admin", via_nodes_exchange=False)
"""An admin (broker user ``admin``), through the RPC exchange."""

_seq = itertools.count(1)


def gpus(host: str, model: str, count: int, *, start_index: int = 0,
         health: Health = Health.HEALTHY) -> list[GPUInfo]:
    """``count`` GPUs of one model on ``host`` with stable uuids."""
    return [
        GPUInfo(uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{host}/{i}')}", index=i, model=model,
                memory_total_mib=MEMORY.get(model, 16384), health=health,
                health_reasons=[] if health is Health.HEALTHY else ["test"])
        for i in range(start_index, start_index + count)
    ]


def heartbeat(host: str, gpu_list: list[GPUInfo], containers: list[ContainerInfo] | None = None,
              *, agent_id: str = "test-agent", sent_at: float | None = None,
              containers_complete: bool = True) -> Heartbeat:
    """A heartbeat with a fresh sequence number."""
    return Heartbeat(host=host, agent_id=agent_id, seq=next(_seq),
                     sent_at=time.time() if sent_at is None else sent_at, interval_s=2.0,
                     gpus=gpu_list, containers=containers or [],
                     containers_complete=containers_complete, source="simulated")


class NodeSimulator:
    """Publishes node messages to a vhost as the agents of several hosts would."""

    def __init__(self, amqp_url: str):
        self.amqp_url = amqp_url
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._exchange: aio_pika.abc.AbstractExchange | None = None
        self.inventory: dict[str, list[GPUInfo]] = {}

    async def __aenter__(self) -> NodeSimulator:
        self._connection = await aio_pika.connect(self.amqp_url, timeout=10)
        channel = await self._connection.channel()
        self._exchange = await channel.declare_exchange(
            NODES_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._connection is not None:
            await self._connection.close()

    async def publish(self, message: Heartbeat | ContainerEvent, *,
                      user_id: str | None = "guest") -> None:
        """Publish one node message (``user_id`` is checked by the broker)."""
        assert self._exchange is not None
        key = (heartbeat_routing_key(message.host) if isinstance(message, Heartbeat)
               else event_routing_key(message.host))
        await self._exchange.publish(
            aio_pika.Message(encode(message), content_type="application/json", user_id=user_id),
            routing_key=key, timeout=10)

    async def beat(self, host: str, gpu_list: list[GPUInfo] | None = None,
                   containers: list[ContainerInfo] | None = None, **kwargs: object) -> Heartbeat:
        """Publish a heartbeat for ``host`` (remembering its GPUs for the next one)."""
        if gpu_list is not None:
            self.inventory[host] = gpu_list
        beat = heartbeat(host, self.inventory[host], containers, **kwargs)  # type: ignore[arg-type]
        await self.publish(beat)
        return beat

    async def event(self, host: str, lease_id: str, action: ContainerAction,
                    container_id: str = "c0ffee") -> None:
        """Publish a container event."""
        await self.publish(ContainerEvent(host=host, container_id=container_id,
                                          lease_id=lease_id, action=action, at=time.time()))


async def wait_until(predicate: Callable[[], Awaitable[T | None]], within: float = 10.0,
                     interval: float = 0.05) -> T:
    """Poll an async predicate until it returns something truthy, and return that."""
    deadline = time.monotonic() + within
    while True:
        result = await predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not reached within {within} s")
        await asyncio.sleep(interval)


class RawRPC:
    """Publishes arbitrary bytes to the allocator, as a buggy or hostile client would."""

    def __init__(self, amqp_url: str):
        self.amqp_url = amqp_url
        self._replies: asyncio.Queue[aio_pika.abc.AbstractIncomingMessage] = asyncio.Queue()
        self.last_correlation_id: str | None = None
        """The correlation id of the last message sent."""

    async def __aenter__(self) -> RawRPC:
        self._connection = await aio_pika.connect(self.amqp_url, timeout=10)
        self.channel = await self._connection.channel(publisher_confirms=False)
        reply_queue = await self.channel.get_queue("amq.rabbitmq.reply-to", ensure=False)
        await reply_queue.consume(self._replies.put, no_ack=True)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._connection.close()

    async def send(self, body: bytes, *, exchange: str = "swarm-gpu.rpc",
                   routing_key: str = "request", reply: bool = True,
                   user_id: str | None = None, expiration: float | None = None) -> None:
        """Publish ``body``; with ``reply`` it asks for an answer through direct reply-to."""
        target = await self.channel.get_exchange(exchange, ensure=False)
        self.last_correlation_id = uuid.uuid4().hex if reply else None
        await target.publish(
            aio_pika.Message(body, correlation_id=self.last_correlation_id,
                             reply_to="amq.rabbitmq.reply-to" if reply else None,
                             user_id=user_id, expiration=expiration),
            routing_key=routing_key, timeout=10)

    async def reply(self, within: float = 10.0) -> dict[str, object]:
        """The next reply, decoded."""
        return json.loads((await self.reply_message(within)).body)

    async def reply_message(self, within: float = 10.0) -> aio_pika.abc.AbstractIncomingMessage:
        """The next message on the reply address, as it came."""
        return await asyncio.wait_for(self._replies.get(), within)

    async def no_reply(self, within: float = 1.0) -> bool:
        """True when nothing arrives for ``within`` seconds."""
        try:
            await asyncio.wait_for(self._replies.get(), within)
        except TimeoutError:
            return True
        return False


async def docker_cli(*args: str, within: float = 60.0) -> str:
    """Run the ``docker`` CLI against the test engine (DOCKER_HOST); its stdout, stripped."""
    process = await asyncio.create_subprocess_exec(
        "docker", *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(within):
        out, err = await process.communicate()
    assert process.returncode == 0, f"docker {' '.join(args)}: {err.decode()}"
    return out.decode().strip()


async def drain_queue(channel: aio_pika.abc.AbstractChannel, name: str) -> list[bytes]:
    """Every message now in queue ``name``, taken off it."""
    queue = await channel.get_queue(name)
    bodies = []
    while (message := await queue.get(no_ack=True, fail=False, timeout=5)) is not None:
        bodies.append(message.body)
    return bodies


async def settled_dead_letters(channel: aio_pika.abc.AbstractChannel, within: float = 60.0
                               ) -> int:
    """The dead-letter queue's message count once it stops moving (dead-lettering is
    asynchronous, and a bound drops the oldest as new ones arrive)."""
    counts: list[int] = []

    async def settled() -> bool:
        declared = await channel.declare_queue(DEAD_LETTER_QUEUE, passive=True)
        counts.append(declared.declaration_result.message_count or 0)
        await asyncio.sleep(0.5)
        return len(counts) > 1 and counts[-1] == counts[-2] > 0
    await wait_until(settled, within=within)
    return counts[-1]


async def beat_until(url: str, inventory: dict[str, list[GPUInfo]], stop: asyncio.Event,
                     interval_s: float = 0.5) -> None:
    """Heartbeats for every host of ``inventory`` every ``interval_s`` until ``stop`` is set."""
    async with NodeSimulator(url) as nodes:
        while not stop.is_set():
            for host, gpu_list in inventory.items():
                await nodes.beat(host, gpu_list)
            await asyncio.sleep(interval_s)
