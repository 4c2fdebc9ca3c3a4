"""The process rules end to end: a real allocator, the real broker, a real node agent whose
simulated inventory lists real containers' processes, and a Docker engine of the module's own.

docs/reliability.md, "Processes on a GPU": each test breaks one thing below the labels and
checks what the allocator does with the agent's report of it.

- **a dead container's process still listed**: its GPU drains, then is ``stuck_process``
  after ``release_verify_s``; a request for it waits until the process leaves the listing;
- **a stray container** (no lease label) uses a free GPU: that GPU is never granted while the
  stray runs, and is granted once it stops;
- **a lease container outside its grant**: the lease is flagged ``outside_grant``;
- **a shared slice over its budget**: warned, or its container stopped by the agent;
- **a process listing that fails** (``processes_error``): the GPU's processes are not known
  and it is judged by labels and events as before 0.2.0, never held by the process rules;
- **the hand-over after a kill**, with processes reported and without: the verified release
  costs the hand-over at most one report.

Processes are simulated (the inventory file names real host pids, which the agent maps to
their containers through ``/proc/<pid>/cgroup``, or names a container directly for a process
that outlived it); everything else is real. Only without the replicated log: these rules live
in the engine's memory and are judged from reports, the same code however a batch commits.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiodocker
import pytest

from allocator.amqp.client import AllocatorClient
from allocator.ledger.readonly import open_readonly
from allocator.wire.lease_container import grant_labels
from allocator.wire.protocol import (
    AllocateRequest,
    GPUView,
    Lease,
    LeaseState,
    ProcessState,
    ReleaseReason,
    ShareRequest,
)
from nodeagent.agent import NodeAgent
from nodeagent.simulated import make_gpu, simulated_uuid, write_inventory
from tests.support import services
from tests.support.common import GTX1070, started, wait_until
from tests.support.fault_nodes import agent_settings, host_up
from tests.support.faults import assert_sound, audit_ledger, await_state, report, running_allocator

pytestmark = [pytest.mark.slow, pytest.mark.docker]

RELEASE_VERIFY_S = 2.0
"""The drain's bound in these tests: short, and long enough that the draining state is seen
before it runs out on a loaded machine."""


@pytest.fixture(scope="module")
def engine() -> Iterator[services.PrivateDocker]:
    """A Docker engine of the module's own, with the busybox image."""
    with services.private_docker() as private:
        yield private


class Node:
    """One simulated host: its inventory file, rewritten by the test, and what each GPU
    lists."""

    def __init__(self, path: Path, host: str, count: int) -> None:
        self.path = path
        self.host = host
        self.count = count
        self.uuids = [simulated_uuid(host, i) for i in range(count)]
        self.processes: dict[int, list[dict[str, Any]]] = {i: [] for i in range(count)}
        self.failing: set[int] = set()
        self.write()

    def write(self) -> None:
        """Write the file as the test set it: the agent reads it at its next report."""
        gpus = [make_gpu(self.host, i, GTX1070, processes=self.processes[i],
                         processes_error=i in self.failing) for i in range(self.count)]
        write_inventory(self.path, {self.host: gpus})

    def list_on(self, index: int, *processes: dict[str, Any]) -> None:
        """GPU ``index`` lists ``processes`` (and nothing else) from now on."""
        self.processes[index] = list(processes)
        self.write()

    def index_of(self, gpu_uuid: str) -> int:
        """The index of the GPU ``gpu_uuid`` on this host."""
        return self.uuids.index(gpu_uuid)


class Containers(aiodocker.Docker):
    """Containers on the module's engine that sleep and die at once when killed; removed
    when closed."""

    def __init__(self, url: str) -> None:
        super().__init__(url=url)
        self.started: list[str] = []

    async def run_sleeping(self, labels: dict[str, str], name: str) -> tuple[str, int]:
        """A container with ``labels``: (its id, its main process's host pid)."""
        container = await self.containers.run(
            config={"Image": services.BUSYBOX_IMAGE, "Cmd": ["sleep", "300"], "Labels": labels,
                    "StopSignal": "SIGKILL", "HostConfig": {"NetworkMode": "host"}},
            name=f"{name}-{uuid.uuid4().hex[:6]}")
        self.started.append(container.id)
        info = await container.show()
        return str(container.id), int(info["State"]["Pid"])

    async def kill(self, container_id: str) -> None:
        await self.containers.container(container_id).kill()

    async def running(self, container_id: str) -> bool:
        info = await self.containers.container(container_id).show()
        return bool(info["State"]["Running"])

    async def close(self) -> None:
        for container_id in self.started:
            with contextlib.suppress(aiodocker.DockerError, OSError):
                await self.containers.container(container_id).delete(force=True)
        await super().close()


@contextlib.asynccontextmanager
async def node_with_agent(url: str, ledger_path: Path, tmp_path: Path, engine_url: str, *,
                          gpus: int, agent: dict[str, Any] | None = None,
                          **allocator: Any) -> AsyncIterator[tuple[Node, AllocatorClient,
                                                                   Containers, NodeAgent]]:
    """An allocator, a node agent of one host with ``gpus`` simulated GPUs, a client, and the
    engine's containers; the ledger audited afterwards."""
    host = f"proc-{uuid.uuid4().hex[:8]}"
    node = Node(tmp_path / "inventory.json", host, gpus)
    # The allocator talks to the agent as the broker's guest user here (its hello, its stop
    # commands): the agent must take commands from it.
    settings = agent_settings(host, url, node.path, engine_url, command_users=["guest"],
                              **(agent or {}))
    values: dict[str, Any] = {"release_verify_s": RELEASE_VERIFY_S,
                              "share_slots": {GTX1070: 4}}
    values.update(allocator)
    async with (running_allocator(url, ledger_path, **values),
                AllocatorClient(url, timeout_s=5) as client,
                started(NodeAgent(settings)) as running_agent):
        docker = Containers(engine_url)
        try:
            await host_up(client, host)
            yield node, client, docker, running_agent
        finally:
            await docker.close()
    assert_sound(audit_ledger(ledger_path))


def ask(user: str, host: str, *, wait_s: float = 0.0, **more: Any) -> AllocateRequest:
    """A request of ``user``'s server for one GPU of ``host`` (``wait_s``: queued if none)."""
    return AllocateRequest(request_key=f"hub/{user}/", user=user, host=host, wait_s=wait_s,
                           **more)


async def lease_container(docker: Containers, lease: Lease) -> tuple[str, int]:
    """The lease's container, labelled as the spawner labels it."""
    return await docker.run_sleeping(grant_labels(lease, "server"), "lease")


async def gpu_view(client: AllocatorClient, gpu_uuid: str) -> GPUView:
    """The GPU as the allocator's inventory shows it now."""
    return next(g for g in (await client.inventory()).gpus if g.uuid == gpu_uuid)


async def gpu_shows(client: AllocatorClient, gpu_uuid: str, state: ProcessState | None, *,
                    pid: int | None = None, within: float = 10.0) -> GPUView:
    """Until the GPU's view has process state ``state`` (and, with ``pid``, lists it)."""
    async def shown() -> GPUView | None:
        view = await gpu_view(client, gpu_uuid)
        if view.process_state is not state:
            return None
        if pid is not None and pid not in [p.pid for p in view.processes or ()]:
            return None
        return view
    return await wait_until(shown, within=within, interval=0.02)


def events(ledger_path: Path, kind: str) -> list[dict[str, Any]]:
    """The ledger's events of ``kind``, each its detail with host, lease and GPU."""
    conn = open_readonly(ledger_path)
    try:
        rows = conn.execute("SELECT at, host, lease_id, gpu_uuid, detail FROM events"
                            " WHERE kind = ? ORDER BY id", (kind,)).fetchall()
    finally:
        conn.close()
    found = []
    for at, host, lease_id, gpu_uuid, detail in rows:
        entry: dict[str, Any] = json.loads(detail) if detail else {}
        entry.update(at=at, host=host, lease_id=lease_id, gpu_uuid=gpu_uuid)
        found.append(entry)
    return found


async def ledger_event(ledger_path: Path, kind: str, within: float = 10.0
                       ) -> list[dict[str, Any]]:
    """Until the ledger holds an event of ``kind`` (events commit with their batch)."""
    async def found() -> list[dict[str, Any]]:
        return events(ledger_path, kind)
    return await wait_until(found, within=within)


# ------------------------------------------------------------------------------ cases


async def test_a_dead_containers_process_holds_its_gpu_until_it_goes(
        amqp_vhost, ledger_path, tmp_path, engine):
    async with node_with_agent(amqp_vhost.url, ledger_path, tmp_path, engine.url,
                               gpus=1) as (node, client, docker, _agent):
        gpu = node.uuids[0]
        alice = await client.allocate(ask("alice", node.host))
        container, pid = await lease_container(docker, alice)
        await await_state(client, alice.lease_id, LeaseState.BOUND)
        # The driver keeps the process after its container is gone: the listing names the
        # container itself, as its cgroup did.
        node.list_on(0, {"pid": pid, "used_memory_mib": 700, "container_id": container})
        await gpu_shows(client, gpu, None, pid=pid)

        await docker.kill(container)
        ended, _ = await await_state(client, alice.lease_id, LeaseState.RELEASED)
        assert ended.released_at is not None
        draining = await gpu_shows(client, gpu, ProcessState.DRAINING, within=RELEASE_VERIFY_S)
        assert [(p.pid, p.container_id) for p in draining.processes or ()] == [(pid, container)]
        bob = await client.allocate(ask("bob", node.host, wait_s=60))
        assert bob.state is LeaseState.QUEUED

        await gpu_shows(client, gpu, ProcessState.STUCK_PROCESS, within=RELEASE_VERIFY_S + 10)
        (stuck,) = await ledger_event(ledger_path, "stuck_process")
        assert (stuck["gpu_uuid"], stuck["container_ids"], stuck["pids"]) == (
            gpu, [container], [pid])
        assert stuck["lease_ids"] == [alice.lease_id]
        assert stuck["at"] - ended.released_at >= RELEASE_VERIFY_S
        assert (await client.status(lease_id=bob.lease_id)).state is LeaseState.QUEUED

        # The process is gone at last: the GPU goes to the waiting request.
        gone_at = time.monotonic()
        node.list_on(0)
        granted, _ = await await_state(client, bob.lease_id, LeaseState.GRANTED)
        handed_s = time.monotonic() - gone_at
        assert granted.gpu_uuids == [gpu]
        (settled,) = await ledger_event(ledger_path, "stuck_process_gone")
        assert settled["lease_ids"] == [alice.lease_id]
    report("dead_container_process", release_verify_s=RELEASE_VERIFY_S,
           granted_after_process_gone_s=round(handed_s, 2))


async def test_a_stray_container_keeps_a_free_gpu_out_while_it_runs(
        amqp_vhost, ledger_path, tmp_path, engine):
    async with node_with_agent(amqp_vhost.url, ledger_path, tmp_path, engine.url,
                               gpus=2) as (node, client, docker, agent):
        stray, pid = await docker.run_sleeping({"purpose": "mining"}, "stray")
        node.list_on(1, {"pid": pid, "used_memory_mib": 900})
        used = await gpu_shows(client, node.uuids[1], ProcessState.OUTSIDE_USE, pid=pid)
        assert used.processes is not None
        (process,) = used.processes
        assert (process.container_id, process.image, process.lease_id) == (
            stray, services.BUSYBOX_IMAGE, None)
        assert process.container_name is not None and process.container_name.startswith("stray-")
        (seen,) = await ledger_event(ledger_path, "outside_use")
        assert (seen["gpu_uuid"], seen["pids"]) == (node.uuids[1], [pid])

        # Requests get the other GPU, then wait: the used one is never granted.
        alice = await client.allocate(ask("alice", node.host))
        assert alice.gpu_uuids == [node.uuids[0]]
        bob = await client.allocate(ask("bob", node.host, wait_s=60))
        assert bob.state is LeaseState.QUEUED
        # Three more reports of the stray still running change nothing.
        heard = agent.seq

        async def three_more_reports() -> bool:
            return agent.seq >= heard + 3
        await wait_until(three_more_reports)
        assert (await client.status(lease_id=bob.lease_id)).state is LeaseState.QUEUED

        # The stray stops, and its process leaves the listing with it.
        await docker.kill(stray)
        node.list_on(1)
        granted, _ = await await_state(client, bob.lease_id, LeaseState.GRANTED)
        assert granted.gpu_uuids == [node.uuids[1]]
        (ended,) = await ledger_event(ledger_path, "outside_use_ended")
        assert ended["gpu_uuid"] == node.uuids[1]


async def test_a_lease_container_using_a_gpu_outside_its_grant_is_flagged(
        amqp_vhost, ledger_path, tmp_path, engine):
    async with node_with_agent(amqp_vhost.url, ledger_path, tmp_path, engine.url,
                               gpus=2) as (node, client, docker, _agent):
        alice = await client.allocate(ask("alice", node.host))
        (granted,) = alice.gpu_uuids
        other = node.uuids[1 - node.index_of(granted)]
        container, pid = await lease_container(docker, alice)
        await await_state(client, alice.lease_id, LeaseState.BOUND)
        # Its own GPU is fine; the runtime let it see the other one too, and it uses it.
        node.list_on(node.index_of(granted), {"pid": pid, "used_memory_mib": 500})
        node.list_on(node.index_of(other), {"pid": pid, "used_memory_mib": 300})

        async def flagged() -> Lease | None:
            lease = await client.status(lease_id=alice.lease_id)
            return lease if lease.outside_grant else None
        lease = await wait_until(flagged)
        assert lease.outside_grant == [other]
        assert lease.state is LeaseState.BOUND
        (event,) = await ledger_event(ledger_path, "outside_grant")
        assert (event["lease_id"], event["container_id"], event["gpu_uuids"]) == (
            alice.lease_id, container, [other])
        view = await gpu_shows(client, other, ProcessState.OUTSIDE_USE, pid=pid)
        assert [p.lease_id for p in view.processes or ()] == [alice.lease_id]
        own = await gpu_view(client, granted)
        assert own.process_state is None
        listed = (await client.inventory(include_leases=True)).leases or []
        assert [x.outside_grant for x in listed if x.lease_id == alice.lease_id] == [[other]]


@pytest.mark.parametrize("action", ["warn", "stop"])
async def test_a_slice_over_its_budget_is_warned_or_stopped(
        amqp_vhost, ledger_path, tmp_path, engine, action):
    grace = 0.5
    async with node_with_agent(amqp_vhost.url, ledger_path, tmp_path, engine.url, gpus=1,
                               over_budget_grace_s=grace,
                               over_budget_action=action) as (node, client, docker, agent):
        alice = await client.allocate(ask("alice", node.host,
                                          share=ShareRequest(memory_mib=1024)))
        assert alice.shared and alice.memory_mib == 1024
        container, pid = await lease_container(docker, alice)
        await await_state(client, alice.lease_id, LeaseState.BOUND)
        node.list_on(0, {"pid": pid, "used_memory_mib": 600})
        await gpu_shows(client, node.uuids[0], None, pid=pid)
        assert (await client.status(lease_id=alice.lease_id)).over_budget_since is None

        over_at = time.time()
        node.list_on(0, {"pid": pid, "used_memory_mib": 3000})
        (warning,) = await ledger_event(ledger_path, "over_budget")
        assert (warning["lease_id"], warning["used_mib"], warning["budget_mib"],
                warning["action"]) == (alice.lease_id, 3000, 1024, action)
        assert warning["since"] >= over_at
        if action == "warn":
            lease = await client.status(lease_id=alice.lease_id)
            assert lease.state is LeaseState.BOUND
            assert lease.over_budget_since == warning["since"]
            assert await docker.running(container)
        else:
            ended, _ = await await_state(client, alice.lease_id, LeaseState.RELEASED)
            (stop,) = [e for e in events(ledger_path, "stop_container")
                       if e["lease_id"] == alice.lease_id]
            assert stop["reason"] == "over_budget"
            # The agent stopped it (a stop command carried out), and the lease ended with
            # the container.
            async def stopped_by_the_agent() -> bool:
                return agent.command_counters["outcome_stopped"] == 1
            await wait_until(stopped_by_the_agent)
            assert not await docker.running(container)
            assert ended.release_reason is ReleaseReason.CONTAINER_EXITED
            conn = open_readonly(ledger_path)
            try:
                ((by, why),) = conn.execute(
                    "SELECT by, reason FROM lease_history WHERE lease_id = ? AND "
                    "to_state = 'releasing'", (alice.lease_id,)).fetchall()
            finally:
                conn.close()
            assert by == "allocator" and "memory budget" in why, (by, why)
            report("over_budget_stop", grace_s=grace,
                   stopped_after_over_s=round((ended.released_at or 0) - over_at, 2))


async def test_a_failing_process_listing_keeps_the_old_rules(
        amqp_vhost, ledger_path, tmp_path, engine):
    # A bound far beyond the wait below: a drain would hold the GPU past it.
    async with node_with_agent(amqp_vhost.url, ledger_path, tmp_path, engine.url, gpus=1,
                               release_verify_s=60.0) as (node, client, docker, _agent):
        gpu = node.uuids[0]
        alice = await client.allocate(ask("alice", node.host))
        container, pid = await lease_container(docker, alice)
        await await_state(client, alice.lease_id, LeaseState.BOUND)
        # Known first: the listing shows the container's process.
        node.list_on(0, {"pid": pid, "used_memory_mib": 700, "container_id": container})
        await gpu_shows(client, gpu, None, pid=pid)
        # Then NVML's process call fails: what the file lists is not read, and the process
        # seen before is no evidence either way (it stays in the file all along).
        node.failing.add(0)
        node.write()

        async def unknown() -> GPUView | None:
            view = await gpu_view(client, gpu)
            return view if view.processes is None else None
        assert (await wait_until(unknown)).process_state is None

        bob = await client.allocate(ask("bob", node.host, wait_s=60))
        assert bob.state is LeaseState.QUEUED
        killed_at = time.monotonic()
        await docker.kill(container)
        granted, _ = await await_state(client, bob.lease_id, LeaseState.GRANTED, within=10)
        handed_s = time.monotonic() - killed_at
        assert granted.gpu_uuids == [gpu]
        assert events(ledger_path, "stuck_process") == []
        assert (await gpu_view(client, gpu)).process_state is None
    report("process_listing_fails", granted_after_kill_s=round(handed_s, 2))


# -------------------------------------------------------------------- the hand-over

HAND_OVERS = 4


@pytest.mark.parametrize("processes", ["on", "off"])
async def test_the_hand_over_after_a_kill_costs_at_most_one_report(
        amqp_vhost, ledger_path, tmp_path, engine, processes):
    """``docker kill`` of a lease container (its process leaves the listing as it dies) to
    the GPU granted to a waiting request, with the processes reported and without. Reported,
    the drain is settled by a report, never by the bound."""
    verify_s = 10.0
    times: list[float] = []
    async with node_with_agent(amqp_vhost.url, ledger_path, tmp_path, engine.url, gpus=1,
                               agent={"gpu_processes": processes},
                               release_verify_s=verify_s) as (node, client, docker, agent):
        gpu = node.uuids[0]
        for n in range(HAND_OVERS):
            holder = await client.allocate(ask(f"holder{n}", node.host))
            container, pid = await lease_container(docker, holder)
            await await_state(client, holder.lease_id, LeaseState.BOUND)
            node.list_on(0, {"pid": pid, "used_memory_mib": 700})
            if processes == "on":
                await gpu_shows(client, gpu, None, pid=pid)
            else:
                assert (await gpu_view(client, gpu)).processes is None
            waiting = await client.allocate(ask(f"next{n}", node.host, wait_s=60))
            assert waiting.state is LeaseState.QUEUED

            killed_at = time.time()
            node.list_on(0)
            await docker.kill(container)
            granted, _ = await await_state(client, waiting.lease_id, LeaseState.GRANTED,
                                           within=verify_s + 10, interval=0.02)
            assert granted.granted_at is not None
            times.append(granted.granted_at - killed_at)
            await client.release(lease_id=waiting.lease_id, force=True, by="test",
                                 reason="next round")
        reported = agent.reports_processes
    assert reported is (processes == "on")
    assert events(ledger_path, "stuck_process") == []
    # Settled by the agent's report after the die, not by the bound.
    assert max(times) < verify_s, times
    report(f"hand_over_processes_{processes}", runs=len(times),
           median_s=round(statistics.median(times), 3), max_s=round(max(times), 3))
