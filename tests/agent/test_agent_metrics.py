"""The node agent's Prometheus metrics: a real :class:`~nodeagent.agent.NodeAgent` with a
simulated inventory and the real broker, scraped over HTTP as Prometheus would; and
``gpu-nodeagent`` without the ``agent`` extra."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aio_pika
import aiodocker
import pytest
from pydantic import ValidationError

from allocator.wire.lease_container import grant_labels
from allocator.wire.protocol import Lease, LeaseState, StopContainer, StopReason, encode
from allocator.wire.topology import AGENTS_EXCHANGE, NODES_EXCHANGE, command_routing_key
from nodeagent import containers
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.metrics import DOCKER_CALLS, STOP_OUTCOMES
from nodeagent.simulated import (
    make_gpu,
    make_mig_gpu,
    simulated_mig_uuid,
    simulated_uuid,
    update_gpu,
    write_inventory,
)
from tests.support.common import wait_until
from tests.support.ports import free_port
from tests.support.prometheus_text import Samples, scrape, scrape_text, value

REPO_ROOT = Path(__file__).resolve().parents[2]
MIB = 1024 * 1024
GTX1070 = "NVIDIA GeForce GTX 1070"
A100 = "NVIDIA A100-SXM4-40GB"


def settings_for(host: str, amqp_url: str, inventory: Path, **overrides: Any) -> AgentSettings:
    """Short periods, so each test takes seconds; metrics on a free port of loopback."""
    values: dict[str, Any] = {
        "host": host, "amqp_url": amqp_url, "inventory": "simulated",
        "simulated_file": inventory, "interval_s": 0.25, "publish_timeout_s": 1.0,
        "amqp_reconnect_s": 0.2, "docker_timeout_s": 3.0, "xid_poll_s": 0.2, "docker": False,
        "metrics_port": free_port(),
    }
    values.update(overrides)
    return AgentSettings(**values)


@contextlib.asynccontextmanager
async def running(settings: AgentSettings) -> AsyncIterator[NodeAgent]:
    agent = NodeAgent(settings)
    await agent.start()
    try:
        yield agent
    finally:
        await agent.stop()


async def scraped_when(port: int, condition: Callable[[Samples], bool],
                       within: float = 10.0) -> Samples:
    """Scrape until ``condition`` holds; that scrape."""
    async def check() -> Samples | None:
        samples = await scrape(port)
        return samples if condition(samples) else None
    return await wait_until(check, within=within, interval=0.1)


@pytest.fixture
def host() -> str:
    return f"metrics-node-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def inventory(tmp_path: Path, host: str) -> Path:
    path = tmp_path / "inventory.json"
    write_inventory(path, {host: [
        make_gpu(host, 0, GTX1070, utilization_pct=37.0, memory_used_mib=2048,
                 temperature_c=55.0),
        make_mig_gpu(host, 1, A100, ["1g.5gb", "3g.20gb"], temperature_c=41.0),
    ]})
    return path


# ----------------------------------------------------------------------------- settings


def test_metrics_settings_default_to_a_port_on_loopback_only() -> None:
    defaults = AgentSettings()
    assert defaults.metrics_port == 9465
    assert defaults.metrics_addr == "127.0.0.1"
    assert AgentSettings(metrics_addr="::").metrics_addr == "::"
    with pytest.raises(ValidationError, match="not an IP address"):
        AgentSettings(metrics_addr="localhost")
    with pytest.raises(ValidationError):
        AgentSettings(metrics_port=70000)


def test_every_docker_call_the_watcher_times_has_its_series() -> None:
    # The watcher names its calls in literals; each must be one the metrics declare, or its
    # series would appear only after its first call.
    source = Path(containers.__file__).read_text()
    named = {part.split('"')[1] for part in source.split('self._timed(')[1:]}
    assert named == set(DOCKER_CALLS)


# ---------------------------------------------------------------------- a running agent


async def test_a_real_agent_exports_heartbeats_and_each_gpu_with_dcgm_labels(
        amqp_vhost: Any, host: str, inventory: Path) -> None:
    settings = settings_for(host, amqp_vhost.url, inventory)
    async with running(settings) as agent:
        samples = await scraped_when(
            settings.metrics_port,
            lambda s: (value(s, "swarm_gpu_agent_heartbeats_sent_total") or 0) >= 2)
        assert value(samples, "swarm_gpu_agent_heartbeat_failures_total") == 0
        assert value(samples, "swarm_gpu_agent_broker_connected") == 1
        assert agent.heartbeats_sent >= (value(samples, "swarm_gpu_agent_heartbeats_sent_total")
                                         or 0) >= 2

        # The whole GPU: DCGM exporter's labels, the simulated file's values.
        gpu0 = {"gpu": "0", "UUID": simulated_uuid(host, 0), "modelName": GTX1070,
                "Hostname": host}
        assert value(samples, "swarm_gpu_agent_gpu_utilization_ratio", **gpu0) == 0.37
        assert value(samples, "swarm_gpu_agent_gpu_memory_used_bytes", **gpu0) == 2048 * MIB
        assert value(samples, "swarm_gpu_agent_gpu_memory_total_bytes", **gpu0) == 8192 * MIB
        assert value(samples, "swarm_gpu_agent_gpu_temperature_celsius", **gpu0) == 55.0
        assert value(samples, "swarm_gpu_agent_gpu_healthy", **gpu0) == 1
        assert value(samples, "swarm_gpu_agent_gpu_held", **gpu0) == 0
        labels = next(got for got, _ in samples["swarm_gpu_agent_gpu_healthy"]
                      if got["UUID"] == gpu0["UUID"])
        assert labels == {**gpu0, "GPU_I_PROFILE": "", "mig_uuid": ""}

        # A MIG instance, as DCGM reports one: its parent's UUID and model name, its profile;
        # and its own uuid besides. The parent in MIG mode is a series of its own.
        small = {"gpu": "1", "UUID": simulated_uuid(host, 1), "modelName": A100,
                 "Hostname": host, "GPU_I_PROFILE": "1g.5gb",
                 "mig_uuid": simulated_mig_uuid(host, 1, 0)}
        assert value(samples, "swarm_gpu_agent_gpu_healthy", **small) == 1
        assert value(samples, "swarm_gpu_agent_gpu_memory_total_bytes", **small) == 4864 * MIB
        assert len(samples["swarm_gpu_agent_gpu_healthy"]) == 4  # GPU 0, A100, 2 instances

        # Reading the file is the inventory read, timed; nothing failed.
        assert (value(samples, "swarm_gpu_agent_inventory_read_seconds_count",
                      source="simulated") or 0) >= 2
        assert value(samples, "swarm_gpu_agent_inventory_errors_total") == 0
        # Docker is off here: its series are there, at 0.
        for call in DOCKER_CALLS:
            assert value(samples, "swarm_gpu_agent_docker_call_seconds_count", call=call) == 0
            assert value(samples, "swarm_gpu_agent_docker_call_errors_total", call=call) == 0
        assert value(samples, "swarm_gpu_agent_docker_watched") == 0
        for outcome in STOP_OUTCOMES:
            assert value(samples, "swarm_gpu_agent_stop_commands_total", outcome=outcome) == 0

        # The file changes: the gauges follow, and the verdict with them.
        update_gpu(inventory, host, 0, temperature_c=95.0, utilization_pct=100.0)
        samples = await scraped_when(
            settings.metrics_port,
            lambda s: value(s, "swarm_gpu_agent_gpu_healthy", **gpu0) == 0)
        assert value(samples, "swarm_gpu_agent_gpu_temperature_celsius", **gpu0) == 95.0
        assert value(samples, "swarm_gpu_agent_gpu_utilization_ratio", **gpu0) == 1.0
    # Stopped: the port is closed again.
    with pytest.raises(OSError):
        await asyncio.to_thread(scrape_text, settings.metrics_port)


async def test_heartbeats_that_cannot_be_published_are_counted(host: str,
                                                                inventory: Path) -> None:
    nobody = free_port()
    settings = settings_for(host, f"amqp://guest:guest@127.0.0.1:{nobody}/", inventory,
                            publish_timeout_s=0.3)
    async with running(settings):
        samples = await scraped_when(
            settings.metrics_port,
            lambda s: (value(s, "swarm_gpu_agent_heartbeat_failures_total") or 0) >= 2)
    assert value(samples, "swarm_gpu_agent_heartbeats_sent_total") == 0
    assert value(samples, "swarm_gpu_agent_broker_connected") == 0
    # The GPUs are still read and exported: the agent knows them, the allocator does not.
    assert value(samples, "swarm_gpu_agent_gpu_healthy", gpu="0", GPU_I_PROFILE="") == 1


async def test_an_inventory_read_past_its_timeout_is_an_error(amqp_vhost: Any, host: str,
                                                              inventory: Path) -> None:
    # A read that takes longer than inventory_timeout_s is what a hanging NVML looks like.
    # The heartbeat counts the error when it gives up waiting; the reading thread records the
    # read's duration only when that read ends, which on a loaded machine is later. So the
    # scrape waits for both: each must come, in whichever order.
    settings = settings_for(host, amqp_vhost.url, inventory, inventory_timeout_s=1e-6)
    async with running(settings):
        await scraped_when(
            settings.metrics_port,
            lambda s: (value(s, "swarm_gpu_agent_inventory_errors_total") or 0) >= 1
            and (value(s, "swarm_gpu_agent_inventory_read_seconds_count",
                       source="simulated") or 0) >= 1)


async def test_metrics_off_and_a_port_in_use_leave_the_agent_running(
        amqp_vhost: Any, host: str, inventory: Path, caplog: pytest.LogCaptureFixture) -> None:
    async with running(settings_for(host, amqp_vhost.url, inventory, metrics_port=0)) as agent:
        assert agent.metrics_server is None
        await wait_until(lambda: _sent(agent))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        settings = settings_for(host, amqp_vhost.url, inventory, metrics_port=port)
        async with running(settings) as agent:
            assert agent.metrics_server is None
            await wait_until(lambda: _sent(agent))
    assert f"metrics: cannot listen on 127.0.0.1:{port}" in caplog.text


async def _sent(agent: NodeAgent) -> bool:
    return agent.heartbeats_sent >= 1


# ------------------------------------------------------------------ Docker and commands


async def _command(amqp_url: str, host: str, body: bytes, *, user_id: str | None) -> None:
    """Publish to the agents exchange as the allocator does (``user_id`` None: unsigned)."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        exchange = await channel.get_exchange(AGENTS_EXCHANGE, ensure=True)
        await exchange.publish(aio_pika.Message(body, user_id=user_id),
                               routing_key=command_routing_key(host), timeout=10)


@pytest.fixture
async def node_messages_routed(amqp_vhost: Any) -> AsyncIterator[None]:
    """A queue bound to every node message of the vhost, as the allocator's is: container
    events are published mandatory, and one nobody would receive is not confirmed."""
    connection = await aio_pika.connect(amqp_vhost.url, timeout=10)
    async with connection:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(NODES_EXCHANGE, aio_pika.ExchangeType.TOPIC,
                                                  durable=True)
        queue = await channel.declare_queue(exclusive=True, auto_delete=True)
        await queue.bind(exchange, "#")
        yield


@pytest.mark.docker
@pytest.mark.usefixtures("node_messages_routed")
async def test_docker_calls_events_stop_commands_and_holders(
        amqp_vhost: Any, host: str, inventory: Path, docker_engine: str,
        busybox_image: str) -> None:
    # Names of this test's own: other tests' lease containers may run on the shared engine.
    tag = uuid.uuid4().hex[:8]
    user, staff, students = f"alice-{tag}", f"staff-{tag}", f"students-{tag}"
    lease = Lease(lease_id=f"lease-{tag}", request_key=f"hub/{user}/",
                  user=user, state=LeaseState.GRANTED, host=host,
                  gpu_uuids=[simulated_uuid(host, 0)], created_at=1.0)
    settings = settings_for(host, amqp_vhost.url, inventory, docker=True,
                            docker_url=docker_engine, command_users=["guest"])
    port = settings.metrics_port
    docker = aiodocker.Docker(url=docker_engine)
    container_id = ""
    try:
        async with running(settings) as agent:
            assert agent.commands is not None
            await agent.commands.wait_consuming(10)
            container = await docker.containers.run(
                config={"Image": busybox_image, "Cmd": ["sleep", "300"],
                        "Labels": grant_labels(lease, groups=[staff, students]),
                        "HostConfig": {"NetworkMode": "host"}},
                name=f"agent-metrics-{lease.lease_id}")
            container_id = container.id
            gpu0 = {"UUID": simulated_uuid(host, 0), "GPU_I_PROFILE": ""}
            samples = await scraped_when(
                port, lambda s: value(s, "swarm_gpu_agent_gpu_held", **gpu0) == 1
                and (value(s, "swarm_gpu_agent_events_forwarded_total") or 0) >= 1)
            assert value(samples, "swarm_gpu_agent_user_gpus", user=user, shared="false") == 1
            assert value(samples, "swarm_gpu_agent_group_gpus", group=staff, shared="false") == 1
            assert value(samples, "swarm_gpu_agent_group_gpus", group=students,
                         shared="false") == 1
            assert (value(samples, "swarm_gpu_agent_lease_containers") or 0) >= 1
            assert value(samples, "swarm_gpu_agent_docker_watched") == 1
            assert value(samples, "swarm_gpu_agent_docker_complete") == 1
            assert value(samples, "swarm_gpu_agent_stop_commands_consuming") == 1
            assert (value(samples, "swarm_gpu_agent_docker_call_seconds_count",
                          call="list") or 0) >= 1

            # Refused: unsigned, not a command, another lease's container. Taken: the stop.
            def stop(lease_id: str) -> bytes:
                return encode(StopContainer(host=host, lease_id=lease_id,
                                            container_id=container_id, grace_s=1,
                                            reason=StopReason.RELEASED))
            await _command(amqp_vhost.url, host, stop(lease.lease_id), user_id=None)
            await _command(amqp_vhost.url, host, b"not a command", user_id="guest")
            await _command(amqp_vhost.url, host, stop("someone-else"), user_id="guest")
            await _command(amqp_vhost.url, host, stop(lease.lease_id), user_id="guest")

            def outcome(s: Samples, name: str) -> float:
                return value(s, "swarm_gpu_agent_stop_commands_total", outcome=name) or 0
            # One scrape is not one instant: the histograms are read before the collector
            # reads the counters, so a scrape may count the stop as done while its histogram
            # was read just before the call ended. Wait for the call too.
            samples = await scraped_when(
                port, lambda s: outcome(s, "stopped") == 1
                and value(s, "swarm_gpu_agent_gpu_held", **gpu0) == 0
                and (value(s, "swarm_gpu_agent_docker_call_seconds_count", call="stop")
                     or 0) >= 1, within=30)
            assert value(samples, "swarm_gpu_agent_stop_commands_received_total") == 4
            assert [outcome(samples, name) for name in
                    ("refused_user", "invalid", "wrong_lease", "failed")] == [1, 1, 1, 0]
            assert value(samples, "swarm_gpu_agent_user_gpus", user=user, shared="false") is None
            # inspect: before each of the two stops that got that far; stop: once.
            assert value(samples, "swarm_gpu_agent_docker_call_seconds_count",
                         call="inspect") == 2
            assert value(samples, "swarm_gpu_agent_docker_call_seconds_count", call="stop") == 1
            assert value(samples, "swarm_gpu_agent_docker_call_errors_total", call="stop") == 0
            # start and die forwarded
            assert (value(samples, "swarm_gpu_agent_events_forwarded_total") or 0) >= 2
    finally:
        if container_id:
            with contextlib.suppress(aiodocker.DockerError):
                await docker.containers.container(container_id).delete(force=True)
        await docker.close()


# ------------------------------------------------------------- without the agent extra


def _without_aiodocker(*args: str) -> subprocess.CompletedProcess[str]:
    """``gpu-nodeagent ARGS`` in an interpreter where aiodocker cannot be imported."""
    program = ("import sys; sys.modules['aiodocker'] = None; "
               "from nodeagent.cli import main; sys.exit(main(sys.argv[1:]))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_GPU_AGENT_")}
    return subprocess.run([sys.executable, "-c", program, *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def test_help_works_without_the_agent_extra() -> None:
    done = _without_aiodocker("--help")
    assert done.returncode == 0, done.stderr
    assert "--metrics-port" in done.stdout and "--metrics-addr" in done.stdout
    assert "Traceback" not in done.stderr


def test_running_without_the_agent_extra_says_which_extra_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "inventory.json"
    write_inventory(path, {"gpu-a": [make_gpu("gpu-a", 0, GTX1070)]})
    done = _without_aiodocker("--host", "gpu-a", "--inventory", "simulated",
                              "--simulated-file", str(path), "--no-docker")
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert lines == ["gpu-nodeagent: the node agent needs the aiodocker package, which the "
                     "'agent' extra installs: pip install 'swarm-gpu[agent]'"]


async def test_with_a_token_the_agents_metrics_answer_only_to_whoever_sends_it(
        amqp_vhost: Any, host: str, inventory: Path, tmp_path: Path) -> None:
    token = uuid.uuid4().hex
    token_file = tmp_path / "metrics-token"
    token_file.write_text(token)
    settings = settings_for(host, amqp_vhost.url, inventory, metrics_token_file=token_file)
    assert settings.metrics_token == token and token not in repr(settings)
    url = f"http://127.0.0.1:{settings.metrics_port}/metrics"

    def status(authorization: str | None) -> tuple[int, str]:
        request = urllib.request.Request(url)
        if authorization is not None:
            request.add_header("Authorization", authorization)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as error:
            with error:
                return error.code, error.read().decode()

    async with running(settings) as agent:
        await wait_until(lambda: _sent(agent))
        for refused in (None, f"Bearer {token}x", f"Basic {token}", token):
            code, body = await asyncio.to_thread(status, refused)
            assert code == 401 and "swarm_gpu_agent" not in body, refused
        code, body = await asyncio.to_thread(status, f"Bearer {token}")
        assert code == 200 and "swarm_gpu_agent_heartbeats_sent_total" in body
