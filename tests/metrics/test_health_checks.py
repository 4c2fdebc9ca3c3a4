"""The processes' health checks, as Swarm's healthcheck runs them: ``GET /healthz`` on the
metrics port (allocator/metrics/endpoint.py), and ``gpu-allocator health`` / ``gpu-nodeagent
health``.

The endpoint is checked in this process on a real HTTP server and a real event loop: ok
without the metrics token, each failing check in a line of its own, and a loop blocked by a
synchronous call reported while the HTTP thread still answers, then healthy again. The
commands are checked against a real ``gpu-allocator serve`` and a real node agent (simulated
inventory), each talking to the real broker through a proxy the test cuts to lose the broker
connection, and against a port nothing listens on.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import os
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from allocator.metrics.endpoint import HEALTH_PATH, MetricsServer, ProcessHealth, serve_registry
from nodeagent.simulated import make_gpu, write_inventory
from tests.support import services
from tests.support.faults import AllocatorProcess, Proxy
from tests.support.ports import free_port
from tests.support.services import REPO_ROOT

TOKEN = "health-test-token-0123456789"


def get(port: int, path: str = HEALTH_PATH) -> tuple[int, str]:
    """``GET path`` from 127.0.0.1:port, without a token: the status and the body."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


async def answered(port: int, status: int, within: float = 10.0) -> str:
    """Poll ``/healthz`` until it answers ``status`` (a port not open yet is a process still
    starting); that answer's body."""
    deadline = time.monotonic() + within
    while True:
        try:
            got, body = await asyncio.to_thread(get, port)
        except ConnectionRefusedError:
            got, body = 0, "nothing listens yet"
        if got == status:
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"/healthz still answers {got} after {within} s: {body!r}")
        await asyncio.sleep(0.05)


@contextlib.contextmanager
def endpoint(health: ProcessHealth) -> Iterator[MetricsServer]:
    """A metrics endpoint on a free loopback port with the token and ``health``."""
    server = serve_registry(CollectorRegistry(), 0, "127.0.0.1", TOKEN, health)
    try:
        yield server
    finally:
        server.close()


@contextlib.asynccontextmanager
async def watched(health: ProcessHealth) -> AsyncIterator[None]:
    """``health``'s loop watchdog running on this event loop."""
    task = asyncio.create_task(health.watch_loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# ----------------------------------------------------------------------------- /healthz


async def test_healthz_is_ok_without_the_token_and_names_each_failing_check() -> None:
    health = ProcessHealth(stale_after_s=5.0)
    broker_up = True
    health.add("broker connection", lambda: None if broker_up else "down")

    def broken() -> str | None:
        raise RuntimeError("cannot tell")

    with endpoint(health) as server:
        # Before the watchdog ran, the loop is not known to run: not healthy.
        status, body = await asyncio.to_thread(get, server.port)
        assert (status, body) == (503, "event loop: not watched yet\n")
        async with watched(health):
            assert await answered(server.port, 200) == "ok\n"
            # The metrics still need the token; only /healthz is open.
            assert (await asyncio.to_thread(get, server.port, "/metrics"))[0] == 401
            broker_up = False
            health.add("ledger", broken)
            body = await answered(server.port, 503)
            assert body.splitlines() == ["broker connection: down",
                                         "ledger: check failed: RuntimeError: cannot tell"]


async def test_a_blocked_event_loop_fails_healthz_while_the_http_thread_answers() -> None:
    stale_after_s = 1.0
    health = ProcessHealth(stale_after_s)
    seen: list[tuple[float, int, str]] = []
    """(seconds into the block, status, body) of the first 503 read during the block."""
    blocked_at = 0.0
    unhealthy_seen = threading.Event()

    def read_until_unhealthy(port: int) -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status, body = get(port)
            if status == 503:
                seen.append((time.monotonic() - blocked_at, status, body))
                unhealthy_seen.set()
                return
            time.sleep(0.05)

    with endpoint(health) as server:
        async with watched(health):
            await answered(server.port, 200)
            reader = threading.Thread(target=read_until_unhealthy, args=(server.port,))
            blocked_at = time.monotonic()
            reader.start()
            # A long synchronous call on the loop: it returns once the HTTP thread has
            # answered 503 (at most 30 s), so the block lasts as long as the check needs.
            unhealthy_seen.wait(timeout=30)
            blocked_s = time.monotonic() - blocked_at
            reader.join(timeout=10)
            assert seen, f"/healthz never answered 503 during a {blocked_s:.1f} s block"
            into_block, _, body = seen[0]
            # Not before the bound: the last stamp is at most one stamp interval old.
            assert into_block >= stale_after_s - health.stamp_every_s, seen
            assert body.startswith("event loop: has not run for "), body
            assert "(health_stale_s = 1)" in body, body
            # Once the loop runs again, healthy again.
            assert await answered(server.port, 200) == "ok\n"


# ----------------------------------------------------------------------------- commands


@dataclass
class Command:
    """What a health command did: its exit status and its stderr lines."""

    returncode: int
    lines: list[str]


async def run_health(args: list[str], env: dict[str, str]) -> Command:
    """``python -m <args>`` (a health command) with ``env``."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", *args, cwd=REPO_ROOT, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    async with asyncio.timeout(30):
        stdout, stderr = await process.communicate()
    assert stdout == b""
    assert process.returncode is not None
    return Command(process.returncode, stderr.decode().splitlines())


@dataclass(frozen=True)
class HealthCommand:
    """A process's health command: its module, and the process as its line names it."""

    module: str
    program: str
    process: str


ALLOCATOR = HealthCommand("allocator.admin.cli", "gpu-allocator", "allocator")
AGENT = HealthCommand("nodeagent.cli", "gpu-nodeagent", "agent")


async def healthy_until_the_broker_is_lost(health: HealthCommand, env: dict[str, str],
                                           proxy: Proxy, metrics_port: int) -> None:
    """The command says healthy (exit 0, nothing on stderr); once the proxy to the broker is
    cut, unhealthy (exit 1) in one line naming the broker connection."""
    healthy = await run_health([health.module, "health"], env)
    assert (healthy.returncode, healthy.lines) == (0, [])
    await proxy.cut()
    await answered(metrics_port, 503, within=20)
    lost = await run_health([health.module, "health"], env)
    assert (lost.returncode, lost.lines) == (1, [
        f"{health.program}: unhealthy: broker connection: down (the {health.process} keeps "
        "reconnecting; see its log)"]), lost.lines


async def nothing_answers(health: HealthCommand, env: dict[str, str], metrics_port: int
                          ) -> None:
    """The command, with its process gone, exits 1 saying that nothing answers."""
    gone = await run_health([health.module, "health"], env)
    assert gone.returncode == 1
    assert len(gone.lines) == 1, gone.lines
    assert gone.lines[0].startswith(f"{health.program}: nothing answers on port "
                                    f"{metrics_port} (127.0.0.1:{metrics_port})"), gone.lines


@contextlib.asynccontextmanager
async def broker_proxy(rabbitmq: services.RabbitMQ) -> AsyncIterator[tuple[Proxy, int]]:
    """A TCP proxy to the broker on a loopback port: cutting it loses the broker."""
    proxy = Proxy(lambda: asyncio.open_connection(rabbitmq.host, rabbitmq.port))
    port = await proxy.serve_tcp()
    try:
        yield proxy, port
    finally:
        await proxy.close()


def through(url: str, rabbitmq: services.RabbitMQ, port: int) -> str:
    """``url`` with the broker's address replaced by the proxy's."""
    return url.replace(f"@{rabbitmq.host}:{rabbitmq.port}/", f"@127.0.0.1:{port}/", 1)


async def test_gpu_allocator_health_follows_the_running_allocator(
        rabbitmq: services.RabbitMQ, amqp_vhost: services.AmqpVhost, tmp_path: Path) -> None:
    metrics_port = free_port()
    async with broker_proxy(rabbitmq) as (proxy, proxy_port):
        url = through(amqp_vhost.url, rabbitmq, proxy_port)
        allocator = AllocatorProcess("health", url, tmp_path / "ledger.sqlite", tmp_path,
                                     metrics_port=metrics_port, metrics_token=TOKEN,
                                     broker_wait_s=0)
        await allocator.start()
        try:
            await allocator.wait_consuming(within=60)
            await healthy_until_the_broker_is_lost(ALLOCATOR, allocator.env, proxy,
                                                   metrics_port)
        finally:
            # Killed: a stop without its broker waits out its bounded steps, not the point
            # here.
            allocator.kill()
            await allocator.stop()
    await nothing_answers(ALLOCATOR, allocator.env, metrics_port)


def agent_env(amqp_url: str, inventory: Path, metrics_port: int, **settings: str) -> dict[str, str]:
    """The environment of a node agent and of its health command (``SWARM_GPU_AGENT_*``),
    with short periods, a simulated inventory and no Docker engine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_GPU_AGENT_")}
    values = {"amqp_url": amqp_url, "host": inventory.stem, "inventory": "simulated",
              "simulated_file": str(inventory), "docker": "false", "interval_s": "0.25",
              "amqp_reconnect_s": "0.2", "publish_timeout_s": "2",
              "metrics_port": str(metrics_port), "metrics_token": TOKEN, **settings}
    env.update({f"SWARM_GPU_AGENT_{key.upper()}": value for key, value in values.items()})
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextlib.asynccontextmanager
async def agent_process(env: dict[str, str], log_path: Path) -> AsyncIterator[
        asyncio.subprocess.Process]:
    """``python -m nodeagent`` with ``env``, its output in ``log_path``; stopped with
    SIGTERM afterwards."""
    with open(log_path, "wb") as log:  # noqa: ASYNC230 - handed to the child
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "nodeagent", cwd=REPO_ROOT, env=env,
            stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT)
    try:
        yield process
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                async with asyncio.timeout(15):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    """A simulated inventory of one GPU; the file's stem is the agent's host name."""
    host = f"health-node-{os.getpid()}"
    path = tmp_path / f"{host}.json"
    write_inventory(path, {host: [make_gpu(host, 0, "NVIDIA GeForce GTX 1070")]})
    return path


async def test_gpu_nodeagent_health_follows_the_running_agent(
        rabbitmq: services.RabbitMQ, amqp_vhost: services.AmqpVhost, inventory: Path,
        tmp_path: Path) -> None:
    metrics_port = free_port()
    async with broker_proxy(rabbitmq) as (proxy, proxy_port):
        env = agent_env(through(amqp_vhost.url, rabbitmq, proxy_port), inventory,
                        metrics_port)
        async with agent_process(env, tmp_path / "agent.log") as agent:
            await answered(metrics_port, 200, within=30)
            await healthy_until_the_broker_is_lost(AGENT, env, proxy, metrics_port)
            # The broker back: healthy again, without a restart.
            await proxy.restore()
            await answered(metrics_port, 200, within=20)
            assert agent.returncode is None
        assert agent.returncode == 0, (tmp_path / "agent.log").read_text()[-3000:]
    await nothing_answers(AGENT, env, metrics_port)


async def test_the_health_commands_say_when_there_is_no_endpoint_to_ask() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_GPU_")}
    env["SWARM_GPU_AGENT_METRICS_PORT"] = "0"
    allocator, agent = await asyncio.gather(run_health(["allocator.admin.cli", "health"], env),
                                            run_health(["nodeagent.cli", "health"], env))
    assert (allocator.returncode, allocator.lines) == (1, [
        "gpu-allocator: metrics_port is not set, so the allocator serves no /healthz to "
        "ask: set metrics_port (SWARM_GPU_METRICS_PORT)"])
    assert (agent.returncode, agent.lines) == (1, [
        "gpu-nodeagent: metrics_port is 0, so the agent serves no /healthz to ask: set "
        "metrics_port (SWARM_GPU_AGENT_METRICS_PORT)"])


async def test_the_health_commands_ask_no_broker_so_its_tls_files_do_not_matter(
        tmp_path: Path) -> None:
    """As in compose/stack.yml: the broker's CA file is in the environment, but the amqps://
    URL exists only in the start command, so a healthcheck sees the CA file beside the
    default amqp:// URL. That is no reason to refuse: the command reaches the endpoint (here
    nothing listens, and it says so) instead of calling the settings invalid."""
    ca_file = tmp_path / "ca.pem"
    ca_file.write_text("not read: the health command connects to no broker\n")
    with socket.socket() as probe:  # a port that was free a moment ago: nothing listens
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_GPU_")}
    env.update(SWARM_GPU_AMQP_CA_FILE=str(ca_file), SWARM_GPU_METRICS_PORT=str(port),
               SWARM_GPU_AGENT_AMQP_CA_FILE=str(ca_file),
               SWARM_GPU_AGENT_METRICS_PORT=str(port))
    allocator, agent = await asyncio.gather(run_health(["allocator.admin.cli", "health"], env),
                                            run_health(["nodeagent.cli", "health"], env))
    for program, done in (("gpu-allocator", allocator), ("gpu-nodeagent", agent)):
        assert done.returncode == 1, done
        assert len(done.lines) == 1 and done.lines[0].startswith(
            f"{program}: nothing answers on port {port}"), done.lines
