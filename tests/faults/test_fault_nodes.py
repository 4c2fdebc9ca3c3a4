"""Leases follow the containers' truth when nodes, agents, engines and hubs fail.

Each test checks one documented bound (docs/design.md, flow 3), with timers set short:

- **bind timeout**: a lease the hub never binds (it crashed mid-spawn) is reclaimed at
  ``bind_timeout_s``; a container that turns up later does not get the GPU back;
- **node silence**: a stopped (``releasing``) lease on a node that went silent is freed after
  ``stop_grace_s``; a running (``bound``) one is not freed on silence alone;
- **hub restart between allocate and bind**: the restarted hub's retry with the same request
  key finds the same lease, and the container it then starts binds it;
- **agent kill -9 and restart** (real agent process, real Docker engine): a container that died
  while no agent watched is released by the new agent's first report; a living one stays;
- **engine restart** (a private dockerd, restarted for real): while the engine is down nothing
  is released on the strength of an incomplete listing; containers that outlive the restart
  (live-restore) keep their lease, those the restart killed lose it.

Node silence and bind timeout use the test's own heartbeats (``NodeSimulator``); the rest run
the real node agent against a real Docker engine.

Only without the replicated log (``ledger_log = "off"``): these faults are in the nodes, their
agents and engines and the hub, and what answers them is the engine's timers and its reading
of reports, the same code whichever way a batch is then committed. Committing through the log
under faults is what tests/faults/test_fault_allocator_crash.py, test_fault_broker_restart.py,
test_fault_disk.py and test_fault_node_truth.py run in both ways, and test_fault_ledger_log.py
runs alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.ledger.invariants import NodeReport
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerAction,
    ContainerInfo,
    ErrorCode,
    LeaseState,
    ReleaseReason,
)
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.simulated import make_gpu, write_inventory
from tests.support.common import GTX1070, LabelledDocker, NodeSimulator, gpus, started, wait_until
from tests.support.fault_nodes import agent_settings, host_up
from tests.support.faults import (
    REPO_ROOT,
    assert_sound,
    audit_ledger,
    await_state,
    gpu_ledger_check,
    report,
    running_allocator,
)

pytestmark = pytest.mark.slow  # real processes, brokers and engines: seconds each

SLACK_S = 1.5
"""How much later than its bound a timer may fire on a loaded 2-core machine (ticks: 0.1 s)."""


def ask(user: str, host: str | None = None) -> AllocateRequest:
    return AllocateRequest(request_key=f"hub/{user}/", user=user, host=host)


# ------------------------------------------------------------------- simulated nodes


async def test_bind_timeout_reclaims_a_lease_the_hub_never_bound(amqp_vhost, ledger_path):
    bind_timeout = 1.0
    async with (running_allocator(amqp_vhost.url, ledger_path, bind_timeout_s=bind_timeout),
                AllocatorClient(amqp_vhost.url, timeout_s=5) as client,
                NodeSimulator(amqp_vhost.url) as nodes):
        await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 1))
        await host_up(client, "gpu-a")
        lease = await client.allocate(ask("alice"))
        # The hub crashed before it created the service: heartbeats go on, listing nothing.
        async def beating():
            while True:
                await nodes.beat("gpu-a")
                await asyncio.sleep(0.2)
        beats = asyncio.create_task(beating())
        try:
            reclaimed, _ = await await_state(client, lease.lease_id, LeaseState.RELEASED,
                                             within=bind_timeout + 5)
        finally:
            beats.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beats
        assert reclaimed.release_reason is ReleaseReason.BIND_TIMEOUT
        assert reclaimed.granted_at is not None and reclaimed.released_at is not None
        took = reclaimed.released_at - reclaimed.granted_at
        assert bind_timeout <= took < bind_timeout + SLACK_S

        # The GPU is free again, and a container of the reclaimed lease that starts late
        # (the hub's service came up after all) does not take it back.
        bob = await client.allocate(ask("bob"))
        assert bob.gpu_uuids == lease.gpu_uuids
        await nodes.event("gpu-a", lease.lease_id, ContainerAction.START, container_id="late")
        await nodes.beat("gpu-a", containers=[ContainerInfo(container_id="late",
                                                            lease_id=lease.lease_id)])
        await asyncio.sleep(0.5)
        assert (await client.status(lease_id=lease.lease_id)).state is LeaseState.RELEASED
        assert (await client.status(lease_id=bob.lease_id)).state is LeaseState.GRANTED
    audit = audit_ledger(ledger_path)
    assert_sound(audit)
    assert audit.held_gpus == list(lease.gpu_uuids)
    report("bind_timeout", bound_s=bind_timeout, reclaimed_after_s=round(took, 2),
           leaked=0, double_booked=len(audit.double_booked))


async def test_node_silence_frees_stopped_leases_after_the_grace_only(amqp_vhost, ledger_path):
    grace = 1.5
    async with (running_allocator(amqp_vhost.url, ledger_path, stop_grace_s=grace,
                                  node_down_after_s=1.0, container_gone_grace_s=0.5),
                AllocatorClient(amqp_vhost.url, timeout_s=5) as client,
                NodeSimulator(amqp_vhost.url) as nodes):
        await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 2))
        await host_up(client, "gpu-a")
        stopped = await client.allocate(ask("alice"))
        running = await client.allocate(ask("bob"))
        for lease, container in ((stopped, "c-alice"), (running, "c-bob")):
            await nodes.event("gpu-a", lease.lease_id, ContainerAction.START,
                              container_id=container)
            await await_state(client, lease.lease_id, LeaseState.BOUND)
        both = [ContainerInfo(container_id="c-alice", lease_id=stopped.lease_id),
                ContainerInfo(container_id="c-bob", lease_id=running.lease_id)]
        await nodes.beat("gpu-a", containers=both)
        await asyncio.sleep(0.2)
        # The hub stops alice's server, and at that moment the node goes silent: no event,
        # no heartbeat ever says whether her container is gone.
        assert (await client.release(lease_id=stopped.lease_id)).state is LeaseState.RELEASING
        last_beat = (await client.inventory()).nodes[0].last_heartbeat
        assert last_beat is not None
        freed, _ = await await_state(client, stopped.lease_id, LeaseState.RELEASED,
                                     within=grace + 5)
        assert freed.release_reason is ReleaseReason.NODE_SILENT
        assert freed.released_at is not None
        silent_for = freed.released_at - last_beat
        assert grace <= silent_for < grace + SLACK_S
        # Bob's server was never stopped: silence alone does not free a GPU that a container
        # may still be using, and nothing new lands on the silent node.
        await asyncio.sleep(0.5)
        assert (await client.status(lease_id=running.lease_id)).state is LeaseState.BOUND
        inventory = await client.inventory()
        assert not inventory.nodes[0].up
        with pytest.raises(AllocatorError) as refused:
            await client.allocate(ask("carol"))
        assert refused.value.code in (ErrorCode.NO_CAPACITY, ErrorCode.UNSATISFIABLE)

        # The node comes back: its report is the truth. Bob's container runs: kept. Then
        # it is gone from the next report: freed.
        await nodes.beat("gpu-a", containers=both[1:])
        await asyncio.sleep(0.3)
        assert (await client.status(lease_id=running.lease_id)).state is LeaseState.BOUND
        await nodes.beat("gpu-a", containers=[], sent_at=time.time() + 1)
        gone, _ = await await_state(client, running.lease_id, LeaseState.RELEASED)
        assert gone.release_reason is ReleaseReason.CONTAINER_GONE
    audit = audit_ledger(ledger_path)
    assert_sound(audit)
    assert audit.held_gpus == []
    report("node_silence", stop_grace_s=grace, freed_after_silence_s=round(silent_for, 2),
           bound_lease_kept=True, leaked=0, double_booked=len(audit.double_booked))


async def test_a_listing_the_engine_could_not_give_releases_nothing(amqp_vhost, ledger_path):
    """An agent whose engine is down says so (``containers_complete=False``): its empty list
    is no evidence that a container is gone, however long the engine stays down."""
    async with (running_allocator(amqp_vhost.url, ledger_path, container_gone_grace_s=0.2),
                AllocatorClient(amqp_vhost.url, timeout_s=5) as client,
                NodeSimulator(amqp_vhost.url) as nodes):
        await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 1))
        await host_up(client, "gpu-a")
        lease = await client.allocate(ask("alice"))
        await nodes.event("gpu-a", lease.lease_id, ContainerAction.START, container_id="c1")
        await await_state(client, lease.lease_id, LeaseState.BOUND)
        for offset in (1, 2, 3):
            await nodes.beat("gpu-a", containers=[], containers_complete=False,
                             sent_at=time.time() + offset)
        await asyncio.sleep(0.5)
        assert (await client.status(lease_id=lease.lease_id)).state is LeaseState.BOUND
        # The engine answers again and its listing has no container: now it is gone.
        await nodes.beat("gpu-a", containers=[], sent_at=time.time() + 4)
        gone, _ = await await_state(client, lease.lease_id, LeaseState.RELEASED)
        assert gone.release_reason is ReleaseReason.CONTAINER_GONE
    assert_sound(audit_ledger(ledger_path))


# ----------------------------------------------------------- real agent, real engine


def write_host(tmp_path: Path, host: str, count: int = 2) -> Path:
    path = tmp_path / "inventory.json"
    write_inventory(path, {host: [make_gpu(host, i, GTX1070) for i in range(count)]})
    return path


def running_agent(settings: AgentSettings) -> contextlib.AbstractAsyncContextManager[NodeAgent]:
    return started(NodeAgent(settings))


class FaultDocker(LabelledDocker):
    """Lease-labelled containers that sleep, and die at once when stopped (SIGKILL)."""

    async def run_lease_container(self, lease_id: str, image: str) -> str:
        return await self.start_labelled(lease_id, image, ["sleep", "300"],
                                         stop_signal="SIGKILL", prefix="fault")


@contextlib.asynccontextmanager
async def docker_client(url: str) -> AsyncIterator[FaultDocker]:
    docker = FaultDocker(url)
    try:
        yield docker
    finally:
        await docker.close()


@pytest.mark.docker
async def test_hub_restart_between_allocate_and_bind_keeps_one_lease(
        amqp_vhost, ledger_path, tmp_path, docker_engine, busybox_image):
    host = f"fault-hub-{uuid.uuid4().hex[:8]}"
    url = amqp_vhost.url
    settings = agent_settings(host, url, write_host(tmp_path, host), docker_engine)
    async with (running_allocator(url, ledger_path), running_agent(settings),
                docker_client(docker_engine) as docker):
        async with AllocatorClient(url, timeout_s=5) as hub:
            await host_up(hub, host)
            lease = await hub.allocate(ask("alice", host))
        # The hub process died here, after the allocation and before the service existed.
        async with AllocatorClient(url, timeout_s=5) as restarted:
            again = await restarted.allocate(ask("alice", host))
            assert (again.lease_id, again.state) == (lease.lease_id, LeaseState.GRANTED)
            container = await docker.run_lease_container(lease.lease_id, busybox_image)
            bound, bind_s = await await_state(restarted, lease.lease_id, LeaseState.BOUND)
            assert bound.container_id == container
            await docker.containers.container(container).delete(force=True)
            done, release_s = await await_state(restarted, lease.lease_id, LeaseState.RELEASED)
            assert done.release_reason is ReleaseReason.CONTAINER_EXITED
    audit = audit_ledger(ledger_path)
    assert_sound(audit)
    assert list(audit.leases_per_key.items()) == [("hub/alice/", 1)]
    report("hub_restart_before_bind", leases_for_the_key=1, bound_after_start_s=round(bind_s, 2),
           released_after_removal_s=round(release_s, 2), leaked=0, double_booked=0)


class AgentProcess:
    """``python -m nodeagent`` as a child process (so that it can be killed with -9)."""

    def __init__(self, host: str, amqp_url: str, inventory: Path, docker_url: str,
                 log_path: Path) -> None:
        self.args = [sys.executable, "-m", "nodeagent", "--host", host, "--amqp-url", amqp_url,
                     "--inventory", "simulated", "--simulated-file", str(inventory),
                     "--docker-url", docker_url, "--interval", "0.25"]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_GPU_AGENT_")}
        self.env.update(SWARM_GPU_AGENT_DOCKER_BACKOFF_S="0.1",
                        SWARM_GPU_AGENT_DOCKER_BACKOFF_MAX_S="0.5",
                        SWARM_GPU_AGENT_AMQP_RECONNECT_S="0.2", PYTHONUNBUFFERED="1",
                        # see agent_settings: `gpu-ledger check --live` needs a full report
                        SWARM_GPU_AGENT_FULL_REPORT_S="0.5")
        self.log_path = log_path
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: ASYNC230, SIM115 - handed to the child
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.args, cwd=REPO_ROOT, env=self.env, stdin=asyncio.subprocess.DEVNULL,
                stdout=log, stderr=asyncio.subprocess.STDOUT)
        finally:
            log.close()

    async def kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.kill()
            await self.process.wait()

    async def stop(self) -> None:
        if self.process is not None and self.process.returncode is None:
            self.process.terminate()
            try:
                async with asyncio.timeout(10):
                    await self.process.wait()
            except TimeoutError:
                await self.kill()


@pytest.mark.docker
@pytest.mark.slow
async def test_agent_kill_9_and_restart_leases_follow_the_containers(
        amqp_vhost, ledger_path, tmp_path, docker_engine, busybox_image):
    host = f"fault-agent-{uuid.uuid4().hex[:8]}"
    url = amqp_vhost.url
    inventory = write_host(tmp_path, host)
    first = AgentProcess(host, url, inventory, docker_engine, tmp_path / "agent-1.log")
    second = AgentProcess(host, url, inventory, docker_engine, tmp_path / "agent-2.log")
    try:
        async with (running_allocator(url, ledger_path) as allocator,
                    AllocatorClient(url, timeout_s=5) as client,
                    docker_client(docker_engine) as docker):
            await first.start()
            await host_up(client, host, within=30)
            dies = await client.allocate(ask("alice", host))
            lives = await client.allocate(ask("bob", host))
            doomed = await docker.run_lease_container(dies.lease_id, busybox_image)
            survivor = await docker.run_lease_container(lives.lease_id, busybox_image)
            for lease in (dies, lives):
                await await_state(client, lease.lease_id, LeaseState.BOUND)
            first_agent = allocator.engine.cluster.nodes[host].agent_id

            await first.kill()
            await docker.containers.container(doomed).delete(force=True)
            await asyncio.sleep(1.0)
            # Nobody reported the death: the lease waits for the node's word.
            assert (await client.status(lease_id=dies.lease_id)).state is LeaseState.BOUND

            restarted = time.monotonic()
            await second.start()
            released, _ = await await_state(client, dies.lease_id, LeaseState.RELEASED,
                                            within=30)
            release_s = time.monotonic() - restarted
            assert released.release_reason in (ReleaseReason.CONTAINER_GONE,
                                               ReleaseReason.CONTAINER_EXITED)
            assert allocator.engine.cluster.nodes[host].agent_id != first_agent
            kept = await client.status(lease_id=lives.lease_id)
            assert (kept.state, kept.container_id) == (LeaseState.BOUND, survivor)
            # The operator's check agrees: every bound lease's container runs, and no lease
            # container runs for a lease that holds no GPU.
            checked = await asyncio.to_thread(gpu_ledger_check, ledger_path, live_amqp=url,
                                              listen_s=1.5)
            assert checked.returncode == 0, checked.stdout + checked.stderr
            assert json.loads(checked.stdout)["hosts_reported"] == [host]
            await second.stop()
    finally:
        await first.kill()
        await second.kill()
    audit = audit_ledger(ledger_path)
    assert_sound(audit)
    assert sorted(audit.holding()) == [lives.lease_id]
    report("agent_kill_9_restart", released_after_agent_start_s=round(release_s, 2),
           living_lease_kept=True, leaked=0, double_booked=0)


@pytest.mark.docker
@pytest.mark.slow
async def test_engine_restart_leases_follow_the_containers(amqp_vhost, ledger_path, tmp_path,
                                                            private_docker):
    engine = private_docker
    host = f"fault-engine-{uuid.uuid4().hex[:8]}"
    url = amqp_vhost.url
    settings = agent_settings(host, url, write_host(tmp_path, host), engine.url)
    figures: dict[str, Any] = {}
    async with (running_allocator(url, ledger_path, container_gone_grace_s=0.5),
                AllocatorClient(url, timeout_s=5) as client,
                running_agent(settings) as agent,
                docker_client(engine.url) as docker):
        await host_up(client, host)
        lease = await client.allocate(ask("alice", host))
        container = await docker.run_lease_container(lease.lease_id, "local/busybox:latest")
        await await_state(client, lease.lease_id, LeaseState.BOUND)

        # 1. The engine restarts with live-restore: the container outlives it. While the
        # engine is down the agent cannot list containers, and nothing is released for it.
        figures["engine_stop_s"] = round(await asyncio.to_thread(engine.stop), 2)
        async def incomplete():
            beat = agent.last_heartbeat
            return beat is not None and not beat.containers_complete
        await wait_until(incomplete, within=10)
        await asyncio.sleep(1.5)  # several heartbeats, three times the container grace
        during = await client.status(lease_id=lease.lease_id)
        assert (during.state, during.container_id) == (LeaseState.BOUND, container)
        figures["engine_start_s"] = round(
            await asyncio.to_thread(engine.start, live_restore=True), 2)
        up_at = time.monotonic()

        async def listed_again():
            beat = agent.last_heartbeat
            return (beat is not None and beat.containers_complete
                    and [c.lease_id for c in beat.containers] == [lease.lease_id])
        await wait_until(listed_again, within=15)
        figures["agent_listing_again_after_s"] = round(time.monotonic() - up_at, 2)
        await asyncio.sleep(0.6)
        after = await client.status(lease_id=lease.lease_id)
        assert (after.state, after.container_id) == (LeaseState.BOUND, container)

        # 2. The engine restarts without live-restore: dockerd kills what still runs, and
        # the lease follows.
        await asyncio.to_thread(engine.stop)
        await asyncio.to_thread(engine.start, live_restore=False)
        up_at = time.monotonic()
        released, _ = await await_state(client, lease.lease_id, LeaseState.RELEASED, within=20)
        figures["released_after_engine_up_s"] = round(time.monotonic() - up_at, 2)
        assert released.release_reason in (ReleaseReason.CONTAINER_EXITED,
                                           ReleaseReason.CONTAINER_GONE)

        # The agent follows the new engine: a new lease's container binds.
        fresh = await client.allocate(ask("bob", host))
        started = await docker.run_lease_container(fresh.lease_id, "local/busybox:latest")
        bound, bind_s = await await_state(client, fresh.lease_id, LeaseState.BOUND)
        assert bound.container_id == started
        figures["new_container_bound_s"] = round(bind_s, 2)
        # Audited while everything still runs (a WAL reader disturbs nothing), against what
        # the agent reports: on the way out the container is removed and its lease freed.
        assert agent.last_heartbeat is not None
        audit = audit_ledger(ledger_path, {host: NodeReport.from_heartbeat(
            agent.last_heartbeat, time.time())})
    assert_sound(audit)
    assert sorted(audit.holding()) == [fresh.lease_id]
    assert_sound(audit_ledger(ledger_path))
    report("engine_restart", **figures, leaked=0, double_booked=0)
