"""The node agent end to end: real broker, real Docker engine in Swarm mode, simulated GPUs.

Each test runs a real :class:`~nodeagent.agent.NodeAgent` with a simulated inventory file and
reads what it publishes from a queue bound to the nodes exchange in the test's own vhost.
Outages are made with a small proxy the test controls (a unix socket in front of the Docker
engine, a TCP port in front of the broker): the shared broker and engine are never stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aio_pika
import aiodocker
import pytest
from yarl import URL

from allocator.wire.heartbeat_delta import apply_delta
from allocator.wire.lease_container import HOST_LABEL, LEASE_LABEL, MEMORY_LABEL, grant_labels
from allocator.wire.protocol import (
    GPU_PROCESSES,
    INTERCONNECT,
    LEASE_USAGE,
    NODE_MESSAGE_ADAPTER,
    AllocatorHello,
    ContainerAction,
    ContainerEvent,
    ContainerGrant,
    GPUProcess,
    Health,
    Heartbeat,
    HeartbeatDelta,
    Lease,
    LeaseState,
    ProcessUse,
    encode,
)
from allocator.wire.topology import AGENTS_EXCHANGE, NODES_EXCHANGE, command_routing_key
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.containers import ContainerChange, ContainerWatcher, LeaseContainer
from nodeagent.metrics import agent_families, read_figures
from nodeagent.simulated import (
    make_gpu,
    preset_interconnect,
    read_inventory,
    simulated_uuid,
    update_gpu,
    write_inventory,
)
from tests.support.common import docker_cli, started
from tests.support.faults import Proxy

REPO_ROOT = Path(__file__).resolve().parents[2]

WAIT_S = 10.0
"""Bound on every wait for a message: generous for a loaded machine, far above the normal."""


# ------------------------------------------------------------------------------ helpers


@dataclass(frozen=True)
class Received:
    """A node message as the test queue received it, with the AMQP properties that matter."""

    message: Heartbeat | ContainerEvent
    """A heartbeat delta is recorded as the full heartbeat it stands for (applied onto the
    host's report as the allocator does); ``delta`` says it came as one."""
    routing_key: str
    user_id: str | None
    content_type: str | None
    expiration: Any
    persistent: bool
    delta: bool = False
    body: bytes = b""
    """The message as published."""


class Inbox:
    """Every message published to the nodes exchange of one vhost, in arrival order."""

    def __init__(self) -> None:
        self.messages: list[Received] = []
        self.reports: dict[str, Heartbeat] = {}
        """host -> its full report, deltas applied (what the allocator would hold)."""
        self.gaps = 0
        """Deltas that did not apply onto the report held (none, when nothing is lost)."""
        self._arrived = asyncio.Condition()

    async def on_message(self, incoming: aio_pika.abc.AbstractIncomingMessage) -> None:
        async with incoming.process():
            message = NODE_MESSAGE_ADAPTER.validate_json(incoming.body)
            delta = isinstance(message, HeartbeatDelta)
            if isinstance(message, HeartbeatDelta):
                base = self.reports.get(message.host)
                rebuilt = apply_delta(base, message) if base is not None else None
                if rebuilt is None:
                    self.gaps += 1
                    return
                message = rebuilt
            if isinstance(message, Heartbeat):
                self.reports[message.host] = message
            received = Received(
                message=message,
                routing_key=incoming.routing_key or "",
                user_id=incoming.user_id,
                content_type=incoming.content_type,
                expiration=incoming.expiration,
                persistent=incoming.delivery_mode == aio_pika.DeliveryMode.PERSISTENT,
                delta=delta,
                body=incoming.body,
            )
        async with self._arrived:
            self.messages.append(received)
            self._arrived.notify_all()

    def mark(self) -> int:
        """Position to wait from: only messages after it count."""
        return len(self.messages)

    async def wait_for(self, predicate: Callable[[Received], bool], *, after: int = 0,
                       within: float = WAIT_S, what: str = "message") -> Received:
        """The first message after ``after`` that satisfies ``predicate``."""
        position = after

        def find() -> Received | None:
            nonlocal position
            while position < len(self.messages):
                candidate = self.messages[position]
                position += 1
                if predicate(candidate):
                    return candidate
            return None

        try:
            async with asyncio.timeout(within), self._arrived:
                while (found := find()) is None:
                    await self._arrived.wait()
                return found
        except TimeoutError:
            raise AssertionError(f"no {what} within {within}s") from None

    async def heartbeat(self, host: str, predicate: Callable[[Heartbeat], bool] = lambda _: True,
                        **kwargs: Any) -> Heartbeat:
        """The next heartbeat of ``host`` that satisfies ``predicate``."""
        received = await self.wait_for(
            lambda r: isinstance(r.message, Heartbeat) and r.message.host == host
            and predicate(r.message), what=f"matching heartbeat of {host}", **kwargs)
        assert isinstance(received.message, Heartbeat)
        return received.message

    async def event(self, lease_id: str, action: ContainerAction, **kwargs: Any) -> ContainerEvent:
        """The next container event of ``lease_id`` with ``action``."""
        received = await self.wait_for(
            lambda r: isinstance(r.message, ContainerEvent) and r.message.lease_id == lease_id
            and r.message.action is action, what=f"{action.value} event of {lease_id}", **kwargs)
        assert isinstance(received.message, ContainerEvent)
        return received.message


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture
async def inbox(amqp_vhost: Any) -> AsyncIterator[Inbox]:
    """A queue bound to every node message of the vhost, consumed into an :class:`Inbox`."""
    connection = await aio_pika.connect(amqp_vhost.url, timeout=10)
    try:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(NODES_EXCHANGE, aio_pika.ExchangeType.TOPIC,
                                                  durable=True)
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        await queue.bind(exchange, "#")
        box = Inbox()
        await queue.consume(box.on_message)
        yield box
    finally:
        await connection.close()


@pytest.fixture
def host() -> str:
    return f"test-node-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def inventory(tmp_path: Path, host: str) -> Path:
    path = tmp_path / "inventory.json"
    write_inventory(path, {
        host: [make_gpu(host, 0, "NVIDIA GeForce GTX 1070"),
               make_gpu(host, 1, "NVIDIA GeForce GTX 1070")],
        "someone-else": [make_gpu("someone-else", 0, "NVIDIA A100-SXM4-40GB")],
    })
    return path


def agent_settings(host: str | None, amqp_url: str, inventory: Path, **overrides: Any
                   ) -> AgentSettings:
    """Settings with every period short, so each test takes seconds."""
    values: dict[str, Any] = {
        "host": host, "amqp_url": amqp_url, "inventory": "simulated",
        "simulated_file": inventory, "interval_s": 0.25, "publish_timeout_s": 1.0,
        "amqp_reconnect_s": 0.2, "docker_backoff_s": 0.1, "docker_backoff_max_s": 0.5,
        "docker_replay_grace_s": 0.5, "docker_timeout_s": 3.0, "xid_poll_s": 0.2,
        "xid_quiet_s": 1.0, "ecc_stable_s": 1.0, "overheat_c": 90.0,
        "overheat_hysteresis_c": 10.0, "docker": False,
    }
    values.update(overrides)
    return AgentSettings(**values)


def running(settings: AgentSettings) -> contextlib.AbstractAsyncContextManager[NodeAgent]:
    return started(NodeAgent(settings))


@pytest.fixture
async def docker(docker_engine: str) -> AsyncIterator[aiodocker.Docker]:
    client = aiodocker.Docker(url=docker_engine)
    try:
        yield client
    finally:
        await client.close()


@pytest.fixture
async def lease_containers(docker: aiodocker.Docker, busybox_image: str
                           ) -> AsyncIterator[Callable[..., Awaitable[str]]]:
    """Starts plain containers with the lease label (faster than a service); removed after."""
    started: list[str] = []

    async def run(lease_id: str, labels: dict[str, str] | None = None) -> str:
        container = await docker.containers.run(
            config={"Image": busybox_image, "Cmd": ["sleep", "300"],
                    "Labels": {LEASE_LABEL: lease_id, **(labels or {})},
                    "HostConfig": {"NetworkMode": "host"}},
            name=f"nodeagent-test-{lease_id}",
        )
        started.append(container.id)
        return container.id

    yield run
    for container_id in started:
        with contextlib.suppress(aiodocker.DockerError):
            await docker.containers.container(container_id).delete(force=True)


def lease() -> str:
    return f"lease-{uuid.uuid4().hex[:10]}"


# -------------------------------------------------------------------------------- tests


@pytest.mark.docker
async def test_swarm_service_lifecycle(amqp_vhost: Any, inbox: Inbox, host: str,
                                       inventory: Path, docker_engine: str,
                                       busybox_image: str) -> None:
    """Heartbeats carry the GPUs, the user_id and the service's container (with its GPU use);
    start and die reach the broker as events the moment they happen."""
    lease_id = lease()
    settings = agent_settings(host, amqp_vhost.url, inventory, docker=True,
                              docker_url=docker_engine)
    service = f"nodeagent-test-{lease_id}"
    async with running(settings) as agent:
        first = await inbox.wait_for(lambda r: isinstance(r.message, Heartbeat))
        beat = first.message
        assert isinstance(beat, Heartbeat)
        assert (beat.host, beat.agent_id, beat.source) == (host, agent.agent_id, "simulated")
        assert [(g.uuid, g.index, g.model, g.memory_total_mib, g.health) for g in beat.gpus] == [
            (simulated_uuid(host, i), i, "NVIDIA GeForce GTX 1070", 8192, Health.HEALTHY)
            for i in (0, 1)]
        assert beat.containers_complete is True
        assert first.user_id == "guest"  # the broker checked it against the connection
        assert first.content_type == "application/json"
        assert first.routing_key == f"heartbeat.{host}"
        assert not first.persistent
        assert float(first.expiration) == pytest.approx(2 * settings.interval_s)

        try:
            await docker_cli("service", "create", "--detach", "--quiet", "--name", service,
                             "--network", "host", "--no-resolve-image",
                             "--restart-condition", "none",
                             "--container-label", f"{LEASE_LABEL}={lease_id}",
                             busybox_image, "sleep", "300")
            started = await inbox.event(lease_id, ContainerAction.START, within=30)
            assert started.host == host
            container_id = started.container_id
            assert len(container_id) == 64

            beat = await inbox.heartbeat(host, lambda b: any(
                c.lease_id == lease_id for c in b.containers))
            listed = next(c for c in beat.containers if c.lease_id == lease_id)
            assert listed.container_id == container_id
            assert listed.name.startswith(f"{service}.1.")  # Swarm's task container name
            assert listed.gpu_use == []

            # The container's main process uses GPU 1: the agent finds it by its cgroup.
            pid = int(await docker_cli("inspect", "-f", "{{.State.Pid}}", container_id))
            update_gpu(inventory, host, 1, memory_used_mib=1500,
                       processes=[{"pid": pid, "used_memory_mib": 1234},
                                  {"pid": os.getpid(), "used_memory_mib": 99}])
            beat = await inbox.heartbeat(host, lambda b: any(
                c.lease_id == lease_id and c.gpu_use for c in b.containers))
            listed = next(c for c in beat.containers if c.lease_id == lease_id)
            assert listed.gpu_use == [ProcessUse(gpu_uuid=simulated_uuid(host, 1),
                                                 memory_used_mib=1234)]

            mark = inbox.mark()
            killed_at = time.monotonic()
            await docker_cli("kill", container_id)
            died = await inbox.event(lease_id, ContainerAction.DIE, after=mark, within=5)
            latency = time.monotonic() - killed_at
            assert died.container_id == container_id
            assert died.exit_code == 137
            assert latency < 2.0, f"die took {latency:.2f}s to reach the broker"
            # the next heartbeat no longer lists it (and comes at once, not an interval later)
            await inbox.heartbeat(host, lambda b: all(c.lease_id != lease_id
                                                      for c in b.containers), after=mark)
            died_received = next(r for r in inbox.messages[mark:]
                                 if r.message == died)
            assert died_received.persistent and died_received.expiration is None
            assert died_received.routing_key == f"event.{host}"
            assert died_received.user_id == "guest"
        finally:
            with contextlib.suppress(AssertionError):
                await docker_cli("service", "rm", service)
        assert agent.events_forwarded >= 2
        assert agent.publish_failures == 0


@pytest.mark.docker
async def test_host_defaults_to_the_engines_node_name(amqp_vhost: Any, inbox: Inbox,
                                                      tmp_path: Path, docker_engine: str) -> None:
    engine = aiodocker.Docker(url=docker_engine)
    try:
        node_name = (await engine.system.info())["Name"]
    finally:
        await engine.close()
    path = tmp_path / "inventory.json"
    write_inventory(path, {node_name: [make_gpu(node_name, 0, "NVIDIA GeForce RTX 3090")]})
    settings = agent_settings(None, amqp_vhost.url, path, docker=True, docker_url=docker_engine)
    async with running(settings) as agent:
        assert agent.host == node_name
        beat = await inbox.heartbeat(node_name)
        assert [g.model for g in beat.gpus] == ["NVIDIA GeForce RTX 3090"]


async def test_health_follows_the_inventory_and_recovers(amqp_vhost: Any, inbox: Inbox,
                                                         host: str, inventory: Path) -> None:
    """XID, overheat, lost and ECC make a GPU unhealthy in the next heartbeat; each recovers."""
    uuid0 = simulated_uuid(host, 0)

    def gpu0(beat: Heartbeat) -> Any:
        return next(g for g in beat.gpus if g.uuid == uuid0)

    def unhealthy_because(prefix: str) -> Callable[[Heartbeat], bool]:
        return lambda b: gpu0(b).health is Health.UNHEALTHY and any(
            r.startswith(prefix) for r in gpu0(b).health_reasons)

    def healthy(b: Heartbeat) -> bool:
        return gpu0(b).health is Health.HEALTHY

    settings = agent_settings(host, amqp_vhost.url, inventory)
    async with running(settings) as agent:
        beat = await inbox.heartbeat(host)
        assert beat.containers_complete is False  # docker watching is off
        assert all(g.health is Health.HEALTHY for g in beat.gpus)

        # fatal XID: unhealthy at once (the agent does not wait for the interval) ...
        mark = inbox.mark()
        written = time.monotonic()
        update_gpu(inventory, host, 0, xid=79)
        beat = await inbox.heartbeat(host, unhealthy_because("xid 79"), after=mark)
        assert time.monotonic() - written < 1.0
        assert gpu0(beat).recent_xids == [79]
        assert next(g for g in beat.gpus if g.uuid != uuid0).health is Health.HEALTHY
        # ... and healthy again after the quiet period, still listing the XID
        beat = await inbox.heartbeat(host, healthy, after=inbox.mark(), within=5)
        assert gpu0(beat).recent_xids == [79]

        # a non-fatal XID (a user's faulting kernel) is listed but changes nothing
        mark = inbox.mark()
        update_gpu(inventory, host, 0, xid=13)
        beat = await inbox.heartbeat(host, lambda b: 13 in gpu0(b).recent_xids, after=mark)
        assert healthy(beat)

        # overheat, with hysteresis
        update_gpu(inventory, host, 0, temperature_c=95.0)
        await inbox.heartbeat(host, unhealthy_because("overheat"), after=inbox.mark())
        update_gpu(inventory, host, 0, temperature_c=85.0)
        beat = await inbox.heartbeat(host, lambda b: gpu0(b).temperature_c == 85.0,
                                     after=inbox.mark())
        assert not healthy(beat)
        update_gpu(inventory, host, 0, temperature_c=70.0)
        await inbox.heartbeat(host, healthy, after=inbox.mark())

        # lost and found
        update_gpu(inventory, host, 0, lost=True)
        await inbox.heartbeat(host, unhealthy_because("lost"), after=inbox.mark())
        update_gpu(inventory, host, 0, lost=False)
        await inbox.heartbeat(host, healthy, after=inbox.mark())

        # uncorrected ECC errors rising: unhealthy until the count is stable
        update_gpu(inventory, host, 0, ecc_uncorrected=3)
        await inbox.heartbeat(host, unhealthy_because("ecc"), after=inbox.mark())
        await inbox.heartbeat(host, healthy, after=inbox.mark(), within=5)
        assert agent.xids_received == 2
        assert agent.publish_failures == 0


@pytest.mark.docker
async def test_docker_stream_cut_resumes_and_reports_a_death_in_the_gap(
        amqp_vhost: Any, inbox: Inbox, host: str, inventory: Path, tmp_path: Path,
        docker_engine: str, docker: aiodocker.Docker,
        lease_containers: Callable[[str], Awaitable[str]]) -> None:
    engine_socket = URL(docker_engine).path
    proxy = Proxy(lambda: asyncio.open_unix_connection(engine_socket))
    proxy_url = await proxy.serve_unix(tmp_path / "docker.sock")
    lease_id = lease()
    settings = agent_settings(host, amqp_vhost.url, inventory, docker=True, docker_url=proxy_url)
    try:
        async with running(settings) as agent:
            container_id = await lease_containers(lease_id)
            await inbox.event(lease_id, ContainerAction.START)
            await inbox.heartbeat(host, lambda b: b.containers_complete and any(
                c.container_id == container_id for c in b.containers))

            await proxy.cut()  # the engine is unreachable for the agent
            mark = inbox.mark()
            await inbox.heartbeat(host, lambda b: not b.containers_complete, after=mark)
            await docker.containers.container(container_id).kill()  # dies during the gap
            await asyncio.sleep(0.5)  # a few failed reconnects
            assert not any(isinstance(r.message, ContainerEvent) for r in inbox.messages[mark:])

            await proxy.restore()
            died = await inbox.event(lease_id, ContainerAction.DIE, after=mark)
            assert died.container_id == container_id
            assert died.exit_code == 137  # replayed by Docker, not inferred
            await inbox.heartbeat(host, lambda b: b.containers_complete and all(
                c.container_id != container_id for c in b.containers), after=mark)
            assert agent.docker_reconnects >= 1
            assert agent.watcher is not None and agent.watcher.deaths_inferred == 0

            # the resumed stream is live: a new container is reported as before
            second = await lease_containers(lease())
            started = await inbox.wait_for(
                lambda r: isinstance(r.message, ContainerEvent)
                and r.message.container_id == second, after=mark)
            assert isinstance(started.message, ContainerEvent)
            assert started.message.action is ContainerAction.START
            await docker.containers.container(second).delete(force=True)
            destroyed = await inbox.wait_for(
                lambda r: isinstance(r.message, ContainerEvent)
                and r.message.container_id == second
                and r.message.action is ContainerAction.DESTROY, after=mark)
            assert destroyed.message.host == host
            # each event exactly once, even though the replay repeated some of them
            keys = [(r.message.container_id, r.message.action) for r in inbox.messages
                    if isinstance(r.message, ContainerEvent)]
            assert len(keys) == len(set(keys)), keys
    finally:
        await proxy.close()


async def test_engine_unreachable_means_incomplete_container_list(
        amqp_vhost: Any, inbox: Inbox, host: str, inventory: Path, tmp_path: Path) -> None:
    settings = agent_settings(host, amqp_vhost.url, inventory, docker=True,
                              docker_url=f"unix://{tmp_path}/no-engine.sock")
    async with running(settings) as agent:
        beats = [await inbox.heartbeat(host, after=inbox.mark()) for _ in range(2)]
        assert all(not b.containers_complete and b.containers == [] for b in beats)
        assert [g.index for g in beats[-1].gpus] == [0, 1]  # GPUs are reported regardless
        assert agent.watcher is not None and agent.watcher.last_error


async def test_deaths_no_event_reported_are_inferred_after_a_gap() -> None:
    """Docker keeps a bounded number of past events; a death the replay does not cover is
    reported by the watcher itself once the replay had its chance."""
    changes: list[ContainerChange] = []
    watcher = ContainerWatcher("unix:///nonexistent.sock", on_change=changes.append,
                               replay_grace_s=0.05)
    gone = LeaseContainer("a" * 64, "lease-a", "nb-a")
    reported = LeaseContainer("b" * 64, "lease-b", "nb-b")
    await watcher._handle({"Type": "container", "Action": "die", "timeNano": 5,
                           "Actor": {"ID": reported.container_id,
                                     "Attributes": {LEASE_LABEL: "lease-b", "exitCode": "1"}}})
    watcher._schedule_inferred_deaths([gone, reported])
    await asyncio.sleep(0.2)
    assert [(c.container_id, c.action, c.synthesized, c.exit_code) for c in changes] == [
        (reported.container_id, "die", False, 1), (gone.container_id, "die", True, None)]
    assert watcher.deaths_inferred == 1


async def test_publish_to_an_unreachable_broker_is_bounded(host: str, inventory: Path) -> None:
    """Nothing listens on the port: the agent keeps beating (and counting failures), and
    stops promptly."""
    settings = agent_settings(host, "amqp://guest:guest@127.0.0.1:1/", inventory,
                              publish_timeout_s=0.3, interval_s=0.1)
    started = time.monotonic()
    async with running(settings) as agent:
        assert time.monotonic() - started < 2.0
        await asyncio.sleep(0.6)
        assert agent.heartbeats_sent == 0
        assert agent.publish_failures >= 3
        assert agent.seq >= 3  # the heartbeat loop was never blocked
    assert time.monotonic() - started < 5.0


@pytest.mark.docker
async def test_broker_outage_buffers_events_and_delivers_them_after(
        amqp_vhost: Any, inbox: Inbox, host: str, inventory: Path, docker_engine: str,
        docker: aiodocker.Docker, lease_containers: Callable[[str], Awaitable[str]]) -> None:
    """A broker that stops answering (black hole, then refused): heartbeats fail within the
    publish timeout, the death that happens meanwhile is kept and published on reconnect."""
    broker = URL(amqp_vhost.url)
    proxy = Proxy(lambda: asyncio.open_connection(broker.host, broker.port))
    port = await proxy.serve_tcp()
    lease_id = lease()
    settings = agent_settings(host, str(broker.with_port(port)), inventory, docker=True,
                              docker_url=docker_engine, publish_timeout_s=0.5)
    try:
        async with running(settings) as agent:
            container_id = await lease_containers(lease_id)
            await inbox.event(lease_id, ContainerAction.START)
            await inbox.heartbeat(host, lambda b: any(c.lease_id == lease_id
                                                      for c in b.containers))

            proxy.freeze()  # publishes now hang: the timeout must end them
            failures, seq = agent.publish_failures, agent.seq
            mark = inbox.mark()
            await docker.containers.container(container_id).kill()
            await asyncio.sleep(1.5)
            assert agent.publish_failures > failures
            assert agent.seq >= seq + 2  # heartbeats went on being attempted
            assert agent.publisher is not None and agent.publisher.buffered >= 1

            await proxy.cut()  # and now the broker refuses connections
            await asyncio.sleep(0.5)
            await proxy.restore()
            died = await inbox.event(lease_id, ContainerAction.DIE, after=mark)
            assert died.container_id == container_id and died.exit_code == 137
            await inbox.heartbeat(host, lambda b: all(c.lease_id != lease_id
                                                      for c in b.containers), after=mark)
            assert agent.publisher.buffered == 0
            assert agent.events_dropped == 0
    finally:
        await proxy.close()


def test_inventory_json_is_what_a_person_would_write(tmp_path: Path) -> None:
    """The documented file format, written by hand, is accepted as is."""
    from nodeagent.simulated import SimulatedSource

    path = tmp_path / "hand.json"
    path.write_text(json.dumps({"hosts": {"gpu-a": [
        {"uuid": "GPU-1", "index": 0, "model": "NVIDIA GeForce GTX 1070",
         "memory_total_mib": 8192, "memory_used_mib": 0, "utilization_pct": 0,
         "temperature_c": 40, "power_w": 30, "ecc_uncorrected": 0, "xids": [], "lost": False}]}}))
    assert [g.uuid for g in SimulatedSource(path, "gpu-a").read_gpus()] == ["GPU-1"]


@pytest.mark.docker
async def test_a_silent_engine_is_noticed(amqp_vhost: Any, inbox: Inbox, host: str,
                                          inventory: Path, tmp_path: Path,
                                          docker_engine: str) -> None:
    """An engine that stops answering without closing the connection (a black hole) never
    ends the event stream: the liveness ping notices, and the list becomes incomplete."""
    engine_socket = URL(docker_engine).path
    proxy = Proxy(lambda: asyncio.open_unix_connection(engine_socket))
    proxy_url = await proxy.serve_unix(tmp_path / "docker.sock")
    settings = agent_settings(host, amqp_vhost.url, inventory, docker=True, docker_url=proxy_url,
                              docker_liveness_s=0.3, docker_timeout_s=0.5)
    try:
        async with running(settings):
            await inbox.heartbeat(host, lambda b: b.containers_complete)
            proxy.freeze()
            await inbox.heartbeat(host, lambda b: not b.containers_complete,
                                  after=inbox.mark(), within=5)
            await proxy.restore()
            await inbox.heartbeat(host, lambda b: b.containers_complete,
                                  after=inbox.mark(), within=5)
    finally:
        await proxy.close()


async def test_command_line_runs_until_sigterm(amqp_vhost: Any, inbox: Inbox, host: str,
                                               inventory: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_GPU_AGENT_")}
    env["SWARM_GPU_AGENT_INTERVAL_S"] = "0.2"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "nodeagent", "--host", host, "--amqp-url", amqp_vhost.url,
        "--inventory", "simulated", "--simulated-file", str(inventory), "--no-docker",
        cwd=REPO_ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        beat = await inbox.heartbeat(host, within=20)
        assert beat.interval_s == 0.2 and len(beat.gpus) == 2
        # The loop is sequential: a second heartbeat means the first one's publish returned
        # (its confirm may lag behind its delivery to our queue on a loaded broker).
        await inbox.heartbeat(host, lambda b: b.seq >= 1)
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            _, err = await process.communicate()
        assert process.returncode == 0, err.decode()
        log = err.decode()
        assert "first heartbeat sent: 2 GPU(s)" in log
        assert "agent stopped:" in log
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_fatal_xid_is_reported_at_once_not_an_interval_later(
        amqp_vhost: Any, inbox: Inbox, host: str, inventory: Path) -> None:
    settings = agent_settings(host, amqp_vhost.url, inventory, interval_s=30.0)
    async with running(settings):
        await inbox.heartbeat(host)
        mark = inbox.mark()
        written = time.monotonic()
        update_gpu(inventory, host, 1, xid=48)
        beat = await inbox.heartbeat(host, after=mark, within=2)
        assert time.monotonic() - written < 1.0
        assert [g.health for g in beat.gpus] == [Health.HEALTHY, Health.UNHEALTHY]
        assert beat.gpus[1].recent_xids == [48]


@pytest.mark.docker
async def test_the_grant_labels_travel_in_start_events_and_heartbeats(
        amqp_vhost: Any, inbox: Inbox, host: str, inventory: Path, docker_engine: str,
        lease_containers: Callable[..., Awaitable[str]]) -> None:
    """A container labelled with its whole grant is reported with it (start event and every
    listing), so an allocator that lost the lease can claim its GPUs again; labels that do
    not make a grant are reported as no grant, the container still by its lease id."""
    granted = Lease(lease_id=lease(), request_key="hub/alice/big", user="alice",
                    state=LeaseState.GRANTED, host=host, shared=True, memory_mib=3000,
                    gpu_uuids=[simulated_uuid(host, 1)], created_at=1.0)
    settings = agent_settings(host, amqp_vhost.url, inventory, docker=True,
                              docker_url=docker_engine)
    async with running(settings):
        await inbox.wait_for(lambda r: isinstance(r.message, Heartbeat))
        container_id = await lease_containers(granted.lease_id,
                                              grant_labels(granted, server_name="big"))
        broken = lease()
        broken_id = await lease_containers(broken, {HOST_LABEL: host, MEMORY_LABEL: "lots"})
        expected = ContainerGrant(host=host, gpu_uuids=[simulated_uuid(host, 1)], shared=True,
                                  memory_mib=3000, user="alice", server_name="big",
                                  request_key="hub/alice/big")
        started = await inbox.event(granted.lease_id, ContainerAction.START)
        assert (started.container_id, started.grant) == (container_id, expected)
        broken_start = await inbox.event(broken, ContainerAction.START)
        assert (broken_start.container_id, broken_start.grant) == (broken_id, None)
        beat = await inbox.heartbeat(host, lambda b: {c.lease_id for c in b.containers}
                                     >= {granted.lease_id, broken})
        by_lease = {c.lease_id: c for c in beat.containers}
        assert by_lease[granted.lease_id].grant == expected
        assert by_lease[broken].grant is None
        mark = inbox.mark()
    # Listing mode (no event stream): the listing itself reads the labels.
    listing = agent_settings(host, amqp_vhost.url, inventory, docker=True,
                             docker_url=docker_engine, docker_events=False)
    async with running(listing):
        beat = await inbox.heartbeat(host, lambda b: {c.lease_id for c in b.containers}
                                     >= {granted.lease_id, broken}, after=mark)
        by_lease = {c.lease_id: c for c in beat.containers}
        assert by_lease[granted.lease_id].grant == expected
        assert by_lease[broken].grant is None


# ------------------------------------------------------------------------ GPU processes


async def say_hello(url: str, host: str, reads: list[str], *, body_host: str | None = None
                    ) -> None:
    """Send ``host``'s agent the allocator's hello, as the allocator does (broker user
    ``guest``); ``body_host``: one that names another host."""
    connection = await aio_pika.connect(url, timeout=10)
    try:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(AGENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC,
                                                  durable=True)
        await exchange.publish(
            aio_pika.Message(encode(AllocatorHello(host=body_host or host, reads=reads)),
                             user_id="guest",
                             content_type="application/json"),
            routing_key=command_routing_key(host))
    finally:
        await connection.close()


async def eventually(condition: Callable[[], bool], what: str, within: float = WAIT_S) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not within {within}s: {what}"
        await asyncio.sleep(0.02)


def execs(pid: int, program: str) -> bool:
    """Whether process ``pid`` runs ``program`` (a forked child is its parent until exec)."""
    with contextlib.suppress(OSError):
        return Path(os.readlink(f"/proc/{pid}/exe")).name == program
    return False


async def container_pid(container_id: str) -> int:
    return int(await docker_cli("inspect", "-f", "{{.State.Pid}}", container_id))


@pytest.fixture
async def stray_container(docker: aiodocker.Docker, busybox_image: str
                          ) -> AsyncIterator[tuple[str, str]]:
    """A running container without the lease label: (its id, its name)."""
    name = f"nodeagent-stray-{uuid.uuid4().hex[:8]}"
    container = await docker.containers.run(
        config={"Image": busybox_image, "Cmd": ["sleep", "300"],
                "HostConfig": {"NetworkMode": "host"}}, name=name)
    try:
        yield container.id, name
    finally:
        with contextlib.suppress(aiodocker.DockerError):
            await container.delete(force=True)


async def test_an_agent_set_to_report_lists_host_processes_but_no_daemon(
        amqp_vhost: Any, inbox: Inbox, host: str, inventory: Path, tmp_path: Path) -> None:
    """With ``gpu_processes = "on"`` every heartbeat lists each GPU's processes: a process of
    the host by its pid and command name, the driver's persistence daemon left out, a failed
    listing as not known (absent on the wire: null) rather than none, and none as []."""
    sleep = shutil.which("sleep")
    assert sleep is not None
    daemon_program = tmp_path / "nvidia-persistenced"  # as the kernel keeps it: 15 characters
    shutil.copy(sleep, daemon_program)
    worker = await asyncio.create_subprocess_exec(sleep, "300")
    daemon = await asyncio.create_subprocess_exec(str(daemon_program), "300")
    try:
        await eventually(lambda: execs(worker.pid, "sleep")
                         and execs(daemon.pid, "nvidia-persistenced"), "both started")
        update_gpu(inventory, host, 0, processes=[{"pid": worker.pid, "used_memory_mib": 700},
                                                  {"pid": daemon.pid, "used_memory_mib": 1}])
        update_gpu(inventory, host, 1, processes_error=True)
        settings = agent_settings(host, amqp_vhost.url, inventory, gpu_processes="on")
        async with running(settings):
            received = await inbox.wait_for(lambda r: isinstance(r.message, Heartbeat))
            assert isinstance(received.message, Heartbeat)
            assert [gpu.processes for gpu in received.message.gpus] == [
                [GPUProcess(pid=worker.pid, memory_used_mib=700, name="sleep")], None]
            assert "processes" not in json.loads(received.body)["gpus"][1]
            # The listing works again and the process is gone: a later report says so.
            mark = inbox.mark()
            update_gpu(inventory, host, 1, processes_error=False)
            update_gpu(inventory, host, 0, processes=[])
            await inbox.heartbeat(host, lambda b: [g.processes for g in b.gpus] == [[], []],
                                  after=mark)
    finally:
        for process in (worker, daemon):
            process.kill()
            await process.wait()


async def test_an_agent_no_allocator_said_hello_to_sends_no_processes(
        amqp_vhost: Any, inbox: Inbox, host: str, inventory: Path) -> None:
    """``auto`` (the default) without a hello, and ``off``: not a byte of the new fields, so
    an allocator of 0.1.0 reads every heartbeat."""
    update_gpu(inventory, host, 0, processes=[{"pid": os.getpid(), "used_memory_mib": 700}])
    for mode in ("auto", "off"):
        mark = inbox.mark()
        settings = agent_settings(host, amqp_vhost.url, inventory, gpu_processes=mode)
        async with running(settings) as agent:
            await inbox.heartbeat(host, after=mark)
            assert not agent.reports_processes
        sent = [r.body for r in inbox.messages[mark:] if isinstance(r.message, Heartbeat)]
        assert sent and all(b"processes" not in body for body in sent)


@pytest.mark.docker
async def test_processes_are_reported_once_the_allocator_said_it_reads_them(
        amqp_vhost: Any, inbox: Inbox, host: str, inventory: Path, docker_engine: str,
        busybox_image: str, lease_containers: Callable[..., Awaitable[str]],
        stray_container: tuple[str, str]) -> None:
    """No processes before a hello for this host (one for another host changes nothing); the
    first heartbeat after it is full and lists each GPU's processes: a lease container's by
    its container, another container's with its name and image (from Docker), the host's by
    command name; a change of them is sent as a delta of that GPU alone; a hello that does
    not read them stops them."""
    lease_id = lease()
    lease_container = await lease_containers(lease_id)
    stray_id, stray_name = stray_container
    worker = await asyncio.create_subprocess_exec("sleep", "300")
    try:
        await eventually(lambda: execs(worker.pid, "sleep"), "sleep started")
        update_gpu(inventory, host, 0, processes=[
            {"pid": await container_pid(lease_container), "used_memory_mib": 900}])
        listed_on_1 = [{"pid": await container_pid(stray_id), "used_memory_mib": 500},
                       {"pid": worker.pid, "used_memory_mib": 200}]
        update_gpu(inventory, host, 1, processes=listed_on_1)
        settings = agent_settings(host, amqp_vhost.url, inventory, docker=True,
                                  docker_url=docker_engine, command_users=["guest"])
        async with running(settings) as agent:
            await inbox.heartbeat(host, lambda b: len(b.containers) == 1)
            await say_hello(amqp_vhost.url, host, [GPU_PROCESSES], body_host="another-host")
            await eventually(lambda: agent.command_counters["wrong_host"] == 1, "refused")
            mark = inbox.mark()
            await inbox.heartbeat(host, after=mark)
            assert all(b"processes" not in r.body for r in inbox.messages
                       if isinstance(r.message, Heartbeat))

            await say_hello(amqp_vhost.url, host, [GPU_PROCESSES, "something-newer"])
            first = await inbox.wait_for(
                lambda r: isinstance(r.message, Heartbeat) and r.message.gpus[0].processes
                is not None, after=mark, what="a heartbeat with processes")
            assert not first.delta  # a full report: this allocator may hold none
            # Docker names the stray container within a second, else in a later report.
            beat = await inbox.heartbeat(host, lambda b: any(
                p.image for p in b.gpus[1].processes or []), after=mark)
            gpus = beat.gpus
            assert gpus[0].processes == [GPUProcess(
                pid=await container_pid(lease_container), memory_used_mib=900, name="sleep",
                container_id=lease_container)]
            assert gpus[1].processes == [
                GPUProcess(pid=listed_on_1[0]["pid"], memory_used_mib=500, name="sleep",
                           container_id=stray_id, container_name=stray_name,
                           image=busybox_image),
                GPUProcess(pid=worker.pid, memory_used_mib=200, name="sleep")]

            # The host's process ends: GPU 1 alone is sent again, as a delta.
            mark = inbox.mark()
            update_gpu(inventory, host, 1, processes=listed_on_1[:1])
            changed = await inbox.wait_for(
                lambda r: isinstance(r.message, Heartbeat)
                and len(r.message.gpus[1].processes or []) == 1, after=mark,
                what="GPU 1 without the host's process")
            assert changed.delta
            assert [gpu["uuid"] for gpu in json.loads(changed.body)["gpus"]] == [
                simulated_uuid(host, 1)]

            mark = inbox.mark()
            await say_hello(amqp_vhost.url, host, [])
            quiet = await inbox.wait_for(
                lambda r: isinstance(r.message, Heartbeat) and b"processes" not in r.body,
                after=mark, what="a heartbeat without processes")
            assert not quiet.delta
            assert agent.command_counters["hellos"] == 2
    finally:
        worker.kill()
        await worker.wait()


@pytest.mark.docker
async def test_a_death_brings_a_fresh_reading_at_once(
        amqp_vhost: Any, inbox: Inbox, host: str, inventory: Path, docker_engine: str,
        lease_containers: Callable[..., Awaitable[str]]) -> None:
    """A lease container's ``die`` makes the agent read the GPUs and report at once, not an
    interval later: the allocator sees its processes gone one report after the death."""
    lease_id = lease()
    container_id = await lease_containers(lease_id)
    update_gpu(inventory, host, 0, processes=[
        {"pid": await container_pid(container_id), "used_memory_mib": 900}])
    settings = agent_settings(host, amqp_vhost.url, inventory, docker=True,
                              docker_url=docker_engine, gpu_processes="on", interval_s=60.0)
    async with running(settings):
        beat = await inbox.heartbeat(host, lambda b: len(b.containers) == 1)
        assert [p.container_id for p in beat.gpus[0].processes or []] == [container_id]
        # The driver lets go of the process as it dies; a file change alone wakes nothing.
        update_gpu(inventory, host, 0, processes=[])
        mark = inbox.mark()
        await docker_cli("kill", container_id)
        await inbox.event(lease_id, ContainerAction.DIE, after=mark)
        # Well within the interval: the die woke the heartbeat loop.
        after = await inbox.heartbeat(host, lambda b: b.containers == [], after=mark,
                                      within=WAIT_S)
        assert after.gpus[0].processes == []


# ------------------------------------------------------------------ how the GPUs are joined


def _joined_as(inventory: Path, host: str, preset: str) -> None:
    """Describe ``host``'s GPUs in the file as joined like ``preset`` (the rest kept)."""
    write_inventory(inventory, read_inventory(inventory), topology={host: preset})


def _carries_interconnect(received: Received) -> bool:
    return isinstance(received.message, Heartbeat) and b'"interconnect"' in received.body


async def _full_reports(inbox: Inbox, host: str, count: int) -> int:
    """Wait for ``count`` more full heartbeats of ``host``; the mark from before them."""
    mark = position = inbox.mark()
    for _ in range(count):
        await inbox.wait_for(lambda r: isinstance(r.message, Heartbeat) and not r.delta
                             and r.message.host == host, after=position, what="a full report")
        position = inbox.mark()
    return mark


async def test_an_agent_no_allocator_said_hello_to_sends_no_interconnect(
        amqp_vhost: Any, inbox: Inbox, host: str, inventory: Path) -> None:
    """The file describes the GPUs' links, but no allocator said it reads them (one before
    0.3.0 never does; this agent has no command queue at all): not a byte of them goes out,
    in full reports or deltas."""
    _joined_as(inventory, host, "hgx")
    settings = agent_settings(host, amqp_vhost.url, inventory, full_report_s=0.5)
    async with running(settings) as agent:
        await _full_reports(inbox, host, 3)
        assert not agent.reports_interconnect
    sent = [r for r in inbox.messages if isinstance(r.message, Heartbeat)]
    assert any(r.delta for r in sent), "deltas were sent too"
    assert not any(_carries_interconnect(r) for r in sent)


@pytest.mark.docker
async def test_the_interconnect_goes_out_once_the_allocator_said_it_reads_it(
        amqp_vhost: Any, inbox: Inbox, host: str, inventory: Path, docker_engine: str) -> None:
    """A hello that reads processes only changes nothing; one that reads the interconnect
    makes the next report full and carries it; the reports after leave it out; a change of
    it goes out at once, in full; each hello that reads it brings it again; after a hello
    that does not, it stays home."""
    _joined_as(inventory, host, "nvlink-pairs")
    uuids = [simulated_uuid(host, i) for i in range(2)]
    settings = agent_settings(host, amqp_vhost.url, inventory, docker=True,
                              docker_url=docker_engine, command_users=["guest"],
                              full_report_s=0.5)
    async with running(settings) as agent:
        await inbox.heartbeat(host)
        await say_hello(amqp_vhost.url, host, [GPU_PROCESSES])
        await eventually(lambda: agent.command_counters["hellos"] == 1, "the first hello")
        await _full_reports(inbox, host, 2)
        assert not any(_carries_interconnect(r) for r in inbox.messages)

        mark = inbox.mark()
        await say_hello(amqp_vhost.url, host, [GPU_PROCESSES, INTERCONNECT])
        first = await inbox.wait_for(_carries_interconnect, after=mark,
                                     what="a heartbeat with the interconnect")
        assert not first.delta
        assert isinstance(first.message, Heartbeat)
        assert first.message.interconnect == preset_interconnect("nvlink-pairs", uuids)
        later = await _full_reports(inbox, host, 2)
        assert not any(_carries_interconnect(r) for r in inbox.messages[later:])
        assert any(r.delta for r in inbox.messages[later:])

        mark = inbox.mark()
        _joined_as(inventory, host, "pcie-two-socket")
        changed = await inbox.wait_for(_carries_interconnect, after=mark,
                                       what="the changed interconnect")
        assert not changed.delta and isinstance(changed.message, Heartbeat)
        assert changed.message.interconnect == preset_interconnect("pcie-two-socket", uuids)

        mark = inbox.mark()
        await say_hello(amqp_vhost.url, host, [INTERCONNECT])
        again = await inbox.wait_for(_carries_interconnect, after=mark,
                                     what="the interconnect after another hello")
        assert not again.delta and isinstance(again.message, Heartbeat)
        assert again.message.interconnect == changed.message.interconnect

        await say_hello(amqp_vhost.url, host, [GPU_PROCESSES])
        await eventually(lambda: agent.command_counters["hellos"] == 4, "the last hello")
        _joined_as(inventory, host, "hgx")
        quiet = await _full_reports(inbox, host, 3)
        assert not any(_carries_interconnect(r) for r in inbox.messages[quiet:])


# ------------------------------------------------------------------------------- lease usage


def _usage_inventory(path: Path, host: str, energy_mj: int, leases: dict[str, Any]) -> None:
    write_inventory(path, {host: [make_gpu(host, 0, "NVIDIA GeForce GTX 1070"),
                                  make_gpu(host, 1, "NVIDIA GeForce GTX 1070",
                                           energy_mj=energy_mj)]}, leases=leases)


@pytest.mark.docker
async def test_lease_usage_goes_out_once_the_allocator_reads_it_and_apportions_energy(
        amqp_vhost: Any, inbox: Inbox, host: str, inventory: Path, docker_engine: str,
        lease_containers: Callable[..., Awaitable[str]]) -> None:
    """Two slices of one GPU: before a hello that reads ``lease_usage`` not a byte of usage
    goes out; after it each container carries its counters, and a step of the GPU's energy
    counter is apportioned by their SM shares (30 % and 10 %: 3/4 and 1/4); SM- and
    memory-seconds follow the utilization the inventory sets (each since its own start)."""
    slices = [Lease(lease_id=lease(), request_key=f"hub/u{i}/", user=f"u{i}",
                    state=LeaseState.GRANTED, host=host, shared=True, memory_mib=3000,
                    gpu_uuids=[simulated_uuid(host, 1)], created_at=1.0) for i in range(2)]
    use = {slices[0].lease_id: {"utilization_pct": 30, "memory_used_mib": 900,
                                "memory_utilization_pct": 12},
           slices[1].lease_id: {"utilization_pct": 10, "memory_used_mib": 100}}
    _usage_inventory(inventory, host, 1_000_000, use)
    settings = agent_settings(host, amqp_vhost.url, inventory, docker=True,
                              docker_url=docker_engine, command_users=["guest"],
                              full_report_s=0.5)
    async with running(settings) as agent:
        for granted in slices:
            await lease_containers(granted.lease_id, grant_labels(granted))
        ids = {granted.lease_id for granted in slices}
        await inbox.heartbeat(host, lambda b: {c.lease_id for c in b.containers} >= ids)
        await _full_reports(inbox, host, 2)
        assert not any(b'"usage"' in r.body for r in inbox.messages)

        mark = inbox.mark()
        await say_hello(amqp_vhost.url, host, [GPU_PROCESSES, LEASE_USAGE])
        await eventually(lambda: agent.reports_usage, "the hello that reads usage")
        await inbox.wait_for(
            lambda r: isinstance(r.message, Heartbeat) and not r.delta
            and sum(c.usage is not None for c in r.message.containers) == 2, after=mark,
            what="a full report with both containers' usage")
        _usage_inventory(inventory, host, 41_000_000, use)  # 40 kJ more
        stepped = await inbox.heartbeat(host, lambda b: sum(
            c.usage.energy_j for c in b.containers if c.usage is not None) >= 39_999)
        # The metrics count the same energy, by group (none here) and GPU, DCGM's labels.
        families = {f.name: f for f in agent_families(read_figures(agent, agent.metrics))}
        [energy] = families["swarm_gpu_agent_lease_energy_joules"].samples
        assert energy.labels["UUID"] == simulated_uuid(host, 1)
        assert (energy.labels["group"], energy.labels["Hostname"]) == ("", host)
        assert energy.value == pytest.approx(40_000)
    by_lease = {c.lease_id: c.usage for c in stepped.containers}
    first, second = by_lease[slices[0].lease_id], by_lease[slices[1].lease_id]
    assert first is not None and second is not None
    assert first.energy_j == pytest.approx(30_000) and second.energy_j == pytest.approx(10_000)
    assert first.peak_memory_mib == 900 and second.peak_memory_mib == 100
    assert 0 < first.sm_s <= 0.3 * (stepped.sent_at - first.since) + 1e-6
    assert 0 < second.sm_s <= 0.1 * (stepped.sent_at - second.since) + 1e-6
    assert first.memory_s == pytest.approx(first.sm_s * 12 / 30) and second.memory_s == 0
