"""Start order: whichever of a node agent and the allocator starts first, the host is known
within one heartbeat of both being up (docs/protocol.md, "heartbeat_delta").

Both are real processes (``python -m nodeagent`` with a simulated inventory, ``python -m
allocator.admin.cli serve``) on the real broker, in both orders, on two brokers:

- **bare**: a fresh vhost where the allocator declares its queue. An agent alone there
  publishes into an exchange no queue is bound to: each report is lost, and the agent must
  know (``mandatory``), or its deltas would follow a full report the allocator never got.
- **definitions**: the shipped broker definitions with their least-privilege users, so the
  allocator's queue exists before any allocator. An agent alone there queues its full report
  where nobody reads it, and it expires (two intervals) before the allocator comes.

Either way the old agent sent deltas after a report nobody got, and the host stayed unknown
until its next full report was due (``full_report_s``, 20 s by default).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from allocator.amqp.client import AllocatorClient
from nodeagent.simulated import make_gpu, write_inventory
from tests.support import services
from tests.support.broker_definitions import TEMPLATE, loaded_broker
from tests.support.common import wait_until
from tests.support.faults import REPO_ROOT, AllocatorProcess
from tests.support.ports import free_port
from tests.support.prometheus_text import scrape, value

pytestmark = pytest.mark.slow

INTERVAL_S = 1.0
"""The agent's heartbeat interval."""

FULL_REPORT_S = 20 * INTERVAL_S
"""A full report at least this often (the default's 20 s): the longest the host could stay
unknown if the agent went on with deltas after a report nobody got."""

KNOWN_WITHIN_S = 2 * INTERVAL_S
"""The host is known within this of both being up: the next heartbeat is at most one interval
away, and it gets one more to be published, routed and applied on a loaded machine."""

BEATS_ALONE = 4
"""Heartbeats the agent publishes before the allocator starts, in the agent-first order: more
than two intervals, so its first full report has expired wherever it waited."""

HOST = "gpu-a"
"""The host the shipped definitions' example agent user reports for."""

GTX1070 = "NVIDIA GeForce GTX 1070"


@dataclass(frozen=True)
class Broker:
    """Where the test runs: the URLs of the allocator, an agent of :data:`HOST` and a client,
    and the allocator settings that say whose heartbeats it takes."""

    allocator_url: str
    agent_url: str
    client_url: str
    allocator_settings: dict[str, object]


@contextlib.contextmanager
def broker_of(kind: str, rabbitmq: services.RabbitMQ) -> Iterator[Broker]:
    """``bare`` (a fresh vhost, the broker's own user everywhere) or ``definitions`` (the
    committed definitions, each part as its own least-privilege user)."""
    if kind == "bare":
        with services.temporary_vhost(rabbitmq) as vhost:
            yield Broker(vhost.url, vhost.url, vhost.url, {})
        return
    with loaded_broker(rabbitmq, TEMPLATE, "order") as loaded:
        yield Broker(loaded.url("allocator"), loaded.url(f"agent-{HOST}"), loaded.url("hub"), {
            "allow_any_node_user": False,
            "node_user_template": loaded.prefix + "agent-{host}",
            "admin_users": [loaded.prefix + "admin"]})


class AgentProcess:
    """``python -m nodeagent`` for :data:`HOST`: one simulated GPU, no Docker, metrics on a
    port of its own; its log in a file."""

    def __init__(self, amqp_url: str, tmp: Path) -> None:
        inventory = tmp / "inventory.json"
        write_inventory(inventory, {HOST: [make_gpu(HOST, 0, GTX1070)]})
        self.metrics_port = free_port()
        self.log_path = tmp / "agent.log"
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_GPU_")}
        self.env.update({
            "SWARM_GPU_AGENT_HOST": HOST, "SWARM_GPU_AGENT_AMQP_URL": amqp_url,
            "SWARM_GPU_AGENT_INVENTORY": "simulated",
            "SWARM_GPU_AGENT_SIMULATED_FILE": str(inventory), "SWARM_GPU_AGENT_DOCKER": "false",
            "SWARM_GPU_AGENT_STOP_COMMANDS": "false",
            "SWARM_GPU_AGENT_INTERVAL_S": str(INTERVAL_S),
            "SWARM_GPU_AGENT_FULL_REPORT_S": str(FULL_REPORT_S),
            "SWARM_GPU_AGENT_METRICS_PORT": str(self.metrics_port),
            "PYTHONUNBUFFERED": "1"})
        self.process: asyncio.subprocess.Process | None = None

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    async def start(self) -> None:
        with open(self.log_path, "ab") as out:  # noqa: ASYNC230 - handed to the child
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "nodeagent", cwd=REPO_ROOT, env=self.env,
                stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT)

    async def heartbeats_published(self) -> float:
        """What the agent's metrics say it published (0 while they do not answer yet)."""
        return await self.counter("swarm_gpu_agent_heartbeats_sent_total")

    async def counter(self, name: str) -> float:
        """One counter of the agent's metrics (0 while they do not answer yet)."""
        with contextlib.suppress(OSError):
            return value(await scrape(self.metrics_port), name) or 0.0
        return 0.0

    async def stop(self) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        process.terminate()
        try:  # an agent that does not stop on SIGTERM fails the test, and is killed
            async with asyncio.timeout(10):
                await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()


async def until_logged(log: AgentProcess | AllocatorProcess, line: str,
                       within: float = 30.0) -> float:
    """Poll a process's log until it holds ``line``; the time (epoch) it was seen."""
    deadline = time.monotonic() + within
    while line not in log.log():
        process = log.process
        assert process is None or process.returncode is None, log.log()[-3000:]
        assert time.monotonic() < deadline, f"no {line!r} within {within} s:\n{log.log()[-3000:]}"
        await asyncio.sleep(0.05)
    return time.time()


def first_seen(ledger: Path, host: str) -> float | None:
    """When the allocator first took the host's full report (its clock, from its ledger)."""
    with contextlib.closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as db:
        row = db.execute("SELECT first_seen FROM nodes WHERE host = ?", (host,)).fetchone()
    return None if row is None else float(row[0])


@contextlib.asynccontextmanager
async def running(*parts: AgentProcess | AllocatorProcess) -> AsyncIterator[None]:
    try:
        yield
    finally:
        for part in parts:
            await part.stop()


@pytest.mark.parametrize("broker_kind", ["bare", "definitions"])
@pytest.mark.parametrize("agent_first", [True, False], ids=["agent-first", "allocator-first"])
async def test_the_host_is_known_within_one_heartbeat_whichever_starts_first(
        rabbitmq: services.RabbitMQ, tmp_path: Path, broker_kind: str, agent_first: bool) -> None:
    with broker_of(broker_kind, rabbitmq) as broker:
        ledger = tmp_path / "ledger.sqlite"
        agent = AgentProcess(broker.agent_url, tmp_path)
        allocator = AllocatorProcess("order", broker.allocator_url, ledger, tmp_path,
                                     start_fence_s=0, tick_s=0.2, **broker.allocator_settings)
        async with running(agent, allocator):
            if agent_first:
                await agent.start()
                agent_up = await until_logged(agent, "broker: connected")

                async def published_alone() -> bool:
                    return await agent.heartbeats_published() >= BEATS_ALONE

                await wait_until(published_alone, within=BEATS_ALONE * INTERVAL_S + 30)
                await allocator.start()
                allocator_up = await until_logged(allocator, "allocator consuming")
            else:
                await allocator.start()
                allocator_up = await until_logged(allocator, "allocator consuming")
                await agent.start()
                agent_up = await until_logged(agent, "broker: connected")
            both_up = max(agent_up, allocator_up)

            async with AllocatorClient(broker.client_url, timeout_s=10) as client:
                async def known_and_up() -> bool:
                    nodes = {node.host: node for node in (await client.inventory()).nodes}
                    return HOST in nodes and nodes[HOST].up and nodes[HOST].gpus == 1

                # Past the bound, so that a host known only at its next full report (the old
                # wait) fails with the time it took, not with a timeout.
                await wait_until(known_and_up, within=FULL_REPORT_S + 10)
            # The host may be known from a report queued before the allocator consumed; the
            # agent learns that its heartbeats arrive at its next one.
            await until_logged(agent, "first heartbeat sent", within=10 * INTERVAL_S)
            # The agent's metrics say which way its first reports went nowhere: no queue
            # (a bare vhost, before the allocator declares it), or a queue nobody read.
            unroutable = await agent.counter("swarm_gpu_agent_heartbeats_unroutable_total")
            unread = await agent.counter("swarm_gpu_agent_full_reports_unread_total")
            if not agent_first:
                assert (unroutable, unread) == (0, 0)
            elif broker_kind == "bare":
                assert unroutable >= 1, unroutable
            else:
                assert unroutable == 0 and unread >= 1, (unroutable, unread)
            seen = first_seen(ledger, HOST)
            assert seen is not None
            took = seen - both_up
            assert took <= KNOWN_WITHIN_S, (
                f"{HOST} known {took:.2f} s after both were up (bound {KNOWN_WITHIN_S} s)\n"
                f"{agent.log()[-3000:]}")
    # The admin reads it in the agent's log: once that heartbeats went nowhere (only when the
    # agent was alone), and once that they arrive again.
    log = agent.log()
    assert ("broker: heartbeat delivery failed" in log) is agent_first, log[-3000:]
    assert ("broker: heartbeat delivery works again" in log) is agent_first, log[-3000:]
    assert log.count("first heartbeat sent: 1 GPU(s)") == 1, log[-3000:]
    assert "Traceback" not in allocator.log() + log
