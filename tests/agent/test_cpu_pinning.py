"""The node agent's ``pin_cpus``: lease containers pinned to the CPUs near their GPUs.

The pure part (:func:`nodeagent.cpu_pinning.cpus_near`) on its own; the rest with a real
agent (simulated GPUs whose written-out interconnect names CPUs this machine has), a real
broker, and a Docker engine of the module's own (``services.private_docker``: an agent pins
every lease container of its engine, so it must not see other tests' notebooks), whose
containers' ``HostConfig.CpusetCpus`` and ``Cpus_allowed_list`` are read back.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import aiodocker
import pytest

from allocator.wire.interconnect import GpuLink, HostGpu, HostInterconnect, LinkLevel
from allocator.wire.lease_container import (
    GPUS_LABEL,
    HOST_LABEL,
    LEASE_LABEL,
    MEMORY_LABEL,
    REQUEST_KEY_LABEL,
    SHARED_LABEL,
    USER_LABEL,
)
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.cpu_pinning import cpulist_union, cpus_near
from nodeagent.metrics import agent_families, read_figures
from nodeagent.simulated import (
    make_gpu,
    make_mig_gpu,
    simulated_mig_uuid,
    simulated_uuid,
    write_inventory,
)
from tests.support import services

CPUS = sorted(os.sched_getaffinity(0))
"""This machine's CPUs: the first and the last stand for two sockets' (one CPU: the same)."""
FIRST, LAST = str(CPUS[0]), str(CPUS[-1])
MISSING_CPU = "65535"
"""A CPU number no machine of these tests has: Docker refuses a cpuset that names it."""


# ----------------------------------------------------------------------------- pure


def test_cpulists_join_into_one() -> None:
    assert cpulist_union(["0-3", "4,8"]) == "0-4,8"
    assert cpulist_union(["32-63", "0-31"]) == "0-63"
    assert cpulist_union(["0-15,32-47", "16-31,48-63"]) == "0-63"
    assert cpulist_union(["2", "2", "5-6"]) == "2,5-6"
    with pytest.raises(ValueError, match="increase"):
        cpulist_union(["3,1"])


def test_the_cpus_near_a_grant_are_all_its_gpus_or_none() -> None:
    host = HostInterconnect(
        gpus=(HostGpu(uuid="GPU-a", numa_node=0, cpus="0-31"),
              HostGpu(uuid="GPU-b", numa_node=1, cpus="32-63"),
              HostGpu(uuid="GPU-c", numa_node=None, cpus=None)),
        links=(GpuLink(a="GPU-a", b="GPU-b", level=LinkLevel.SYSTEM),
               GpuLink(a="GPU-a", b="GPU-c", level=LinkLevel.SYSTEM),
               GpuLink(a="GPU-b", b="GPU-c", level=LinkLevel.SYSTEM)))
    assert cpus_near(["GPU-a"], host, {}) == "0-31"
    assert cpus_near(["GPU-b", "GPU-a"], host, {}) == "0-63"
    # A MIG instance takes its parent's CPUs.
    assert cpus_near(["MIG-1"], host, {"MIG-1": "GPU-b"}) == "32-63"
    # Unknown: a GPU without CPUs (never the others' alone), one the host does not name, no
    # GPUs, no interconnect.
    assert cpus_near(["GPU-a", "GPU-c"], host, {}) is None
    assert cpus_near(["GPU-x"], host, {}) is None
    assert cpus_near(["MIG-2"], host, {}) is None
    assert cpus_near([], host, {}) is None
    assert cpus_near(["GPU-a"], None, {}) is None


# ------------------------------------------------------------------------ real parts


@pytest.fixture(scope="module")
def engine() -> Iterator[services.PrivateDocker]:
    """A Docker engine of the module's own, with the busybox image."""
    with services.private_docker() as private:
        yield private


def topology(host: str, cpus: list[str | None]) -> dict[str, Any]:
    """The written-out interconnect of ``host``'s GPUs 0.. with these CPUs (one NUMA node
    each), every pair across sockets."""
    uuids = [simulated_uuid(host, index) for index in range(len(cpus))]
    return {
        "gpus": [{"uuid": u, "numa_node": i, "cpus": c}
                 for i, (u, c) in enumerate(zip(uuids, cpus, strict=True))],
        "links": [{"a": uuids[i], "b": uuids[j], "level": int(LinkLevel.SYSTEM)}
                  for i in range(len(uuids)) for j in range(i + 1, len(uuids))],
    }


def grant(host: str, gpu_uuids: list[str], *, shared: bool = False) -> dict[str, str]:
    """A lease container's labels, its whole grant (as the spawner puts them)."""
    labels = {LEASE_LABEL: f"lease-{uuid.uuid4().hex[:10]}", HOST_LABEL: host,
              GPUS_LABEL: ",".join(gpu_uuids), SHARED_LABEL: "1" if shared else "0",
              USER_LABEL: "alice", REQUEST_KEY_LABEL: f"alice//{uuid.uuid4().hex[:8]}"}
    if shared:
        labels[MEMORY_LABEL] = "1024"
    return labels


class Notebooks:
    """Lease containers on the module's engine, removed afterwards."""

    def __init__(self, engine: services.PrivateDocker) -> None:
        self.engine = engine
        self.docker = aiodocker.Docker(url=engine.url)
        self.ids: list[str] = []

    async def start(self, labels: dict[str, str]) -> str:
        container = await self.docker.containers.run(
            config={"Image": services.BUSYBOX_IMAGE, "Cmd": ["sleep", "600"],
                    "StopSignal": "SIGKILL", "Labels": labels,
                    "HostConfig": {"NetworkMode": "none"}},
            name=f"pin-{labels[LEASE_LABEL]}")
        self.ids.append(container.id)
        return str(container.id)

    async def cpuset(self, container_id: str) -> str:
        info = await self.docker.containers.get(container_id)
        return str(info["HostConfig"]["CpusetCpus"] or "")

    def allowed(self, container_id: str) -> str:
        """The CPUs the kernel lets the container's processes run on."""
        status = subprocess.run(
            ["docker", "exec", container_id, "cat", "/proc/self/status"],
            env=dict(os.environ, DOCKER_HOST=self.engine.url), capture_output=True,
            text=True, timeout=30, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in status.splitlines()
                    if line.startswith("Cpus_allowed_list:"))

    async def close(self) -> None:
        for container_id in self.ids:
            with contextlib.suppress(aiodocker.DockerError):
                await self.docker.containers.container(container_id).delete(force=True)
        await self.docker.close()


@contextlib.asynccontextmanager
async def notebooks(engine: services.PrivateDocker) -> AsyncIterator[Notebooks]:
    made = Notebooks(engine)
    try:
        yield made
    finally:
        await made.close()


@contextlib.asynccontextmanager
async def running(settings: AgentSettings) -> AsyncIterator[NodeAgent]:
    agent = NodeAgent(settings)
    await agent.start()
    try:
        yield agent
    finally:
        await agent.stop()


def settings_for(host: str, amqp_url: str, inventory: Path, engine: services.PrivateDocker,
                 **more: Any) -> AgentSettings:
    return AgentSettings(host=host, amqp_url=amqp_url, inventory="simulated",
                         simulated_file=inventory, interval_s=0.25, publish_timeout_s=1.0,
                         docker_url=engine.url, docker_timeout_s=2.0, xid_poll_s=0.2,
                         metrics_port=0, **more)


WAIT_S = 15.0


async def until(condition: Callable[[], Any], within: float = WAIT_S) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not within {within}s"
        await asyncio.sleep(0.05)


async def until_cpuset(made: Notebooks, container_id: str, expected: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while (got := await made.cpuset(container_id)) != expected:
        assert time.monotonic() < deadline, f"cpuset {got!r}, not {expected!r} in {WAIT_S}s"
        await asyncio.sleep(0.05)


def exported_pinning(agent: NodeAgent) -> dict[str, float]:
    """``swarm_gpu_agent_cpu_pinning_total`` by outcome, as a scrape reads it."""
    family = next(f for f in agent_families(read_figures(agent, agent.metrics))
                  if f.name == "swarm_gpu_agent_cpu_pinning")
    return {s.labels["outcome"]: s.value for s in family.samples if s.name.endswith("_total")}


def update_calls(agent: NodeAgent) -> tuple[float, int]:
    """Docker ``update`` calls timed, and failed."""
    observed = next(
        s.value for m in agent.metrics.registry.collect()
        if m.name == "swarm_gpu_agent_docker_call_seconds" for s in m.samples
        if s.name.endswith("_count") and s.labels.get("call") == "update")
    return observed, agent.metrics.failures()[1]["update"]


@pytest.mark.docker
async def test_lease_containers_are_pinned_near_their_gpus_at_start_and_at_adoption(
        amqp_vhost: Any, engine: services.PrivateDocker, tmp_path: Path) -> None:
    host = f"pin-{uuid.uuid4().hex[:8]}"
    gpu0, gpu1 = simulated_uuid(host, 0), simulated_uuid(host, 1)
    mig = simulated_mig_uuid(host, 2, 0)
    inventory = tmp_path / "inventory.json"
    write_inventory(
        inventory,
        {host: [make_gpu(host, 0, "NVIDIA GeForce GTX 1070"),
                make_gpu(host, 1, "NVIDIA GeForce GTX 1070"),
                make_mig_gpu(host, 2, "NVIDIA A100-SXM4-40GB", ["1g.5gb"])]},
        topology={host: topology(host, [FIRST, LAST, LAST])})
    async with notebooks(engine) as made:
        adopted = await made.start(grant(host, [gpu1]))
        async with running(settings_for(host, amqp_vhost.url, inventory, engine,
                                        pin_cpus=True)) as agent:
            # Running before the agent started: pinned at its first heartbeat.
            await until_cpuset(made, adopted, LAST)
            assert made.allowed(adopted) == LAST

            # Started while the agent runs: pinned at its start event.
            both = await made.start(grant(host, [gpu0, gpu1]))
            union = cpulist_union([FIRST, LAST])
            await until_cpuset(made, both, union)
            assert made.allowed(both) == union
            # A shared slice of a MIG instance: its parent's socket.
            slice_ = await made.start(grant(host, [mig], shared=True))
            await until_cpuset(made, slice_, LAST)
            # Without grant labels the GPUs are not known: left alone, counted.
            bare = await made.start({LEASE_LABEL: f"lease-{uuid.uuid4().hex[:10]}"})
            await until(lambda: agent.pinner is not None
                        and agent.pinner.counters["unknown"] == 1)
            assert await made.cpuset(bare) == ""

            assert exported_pinning(agent) == {"pinned": 3, "failed": 0, "unknown": 1}
            assert update_calls(agent) == (3, 0)
            # Heartbeats go on (built) without pinning anything twice.
            beats = agent.seq
            await until(lambda: agent.seq >= beats + 3)
            assert exported_pinning(agent) == {"pinned": 3, "failed": 0, "unknown": 1}


@pytest.mark.docker
async def test_pin_cpus_off_leaves_lease_containers_alone(
        amqp_vhost: Any, engine: services.PrivateDocker, tmp_path: Path) -> None:
    host = f"pin-{uuid.uuid4().hex[:8]}"
    inventory = tmp_path / "inventory.json"
    write_inventory(inventory, {host: [make_gpu(host, 0, "NVIDIA GeForce GTX 1070")]},
                    topology={host: topology(host, [LAST])})
    async with notebooks(engine) as made, \
            running(settings_for(host, amqp_vhost.url, inventory, engine)) as agent:
        assert agent.pinner is None
        container_id = await made.start(grant(host, [simulated_uuid(host, 0)]))
        await until(lambda: agent.last_heartbeat is not None and any(
            c.container_id == container_id for c in agent.last_heartbeat.containers))
        beats = agent.seq
        await until(lambda: agent.seq >= beats + 2)
        assert await made.cpuset(container_id) == ""
        assert exported_pinning(agent) == {"pinned": 0, "failed": 0, "unknown": 0}
        assert update_calls(agent) == (0, 0)


@pytest.mark.docker
async def test_docker_refusing_a_cpuset_is_counted_and_the_agent_goes_on(
        amqp_vhost: Any, engine: services.PrivateDocker, tmp_path: Path) -> None:
    host = f"pin-{uuid.uuid4().hex[:8]}"
    gpu0, gpu1 = simulated_uuid(host, 0), simulated_uuid(host, 1)
    inventory = tmp_path / "inventory.json"
    write_inventory(inventory, {host: [make_gpu(host, 0, "NVIDIA GeForce GTX 1070"),
                                       make_gpu(host, 1, "NVIDIA GeForce GTX 1070")]},
                    topology={host: topology(host, [MISSING_CPU, FIRST])})
    async with notebooks(engine) as made, \
            running(settings_for(host, amqp_vhost.url, inventory, engine,
                                 pin_cpus=True)) as agent:
        await until(lambda: agent.seq >= 1)
        refused = await made.start(grant(host, [gpu0]))
        await until(lambda: exported_pinning(agent)["failed"] == 1)
        assert await made.cpuset(refused) == ""
        # The agent goes on: the next container is pinned, its heartbeats keep coming.
        pinned = await made.start(grant(host, [gpu1]))
        await until_cpuset(made, pinned, FIRST)
        beats = agent.seq
        await until(lambda: agent.seq >= beats + 2)
        # Counted once: the heartbeats since did not try it again.
        assert exported_pinning(agent) == {"pinned": 1, "failed": 1, "unknown": 0}
        assert update_calls(agent) == (2, 1)
        # Its next start is tried again (a restarted container may have lost its cpuset).
        await made.docker.containers.container(refused).restart(timeout=0)
        await until(lambda: exported_pinning(agent)["failed"] == 2)
        assert update_calls(agent) == (3, 2)

        # An engine that does not answer (dockerd stopped, its socket still listening): the
        # update gives up after docker_timeout_s, counted; nothing waits on it for longer.
        assert engine.process is not None and agent.watcher is not None
        os.kill(engine.process.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await agent.watcher.update_cpuset(pinned, FIRST)
            assert time.monotonic() - started < agent.settings.docker_timeout_s + 2
        finally:
            os.kill(engine.process.pid, signal.SIGCONT)
        assert update_calls(agent) == (4, 3)
