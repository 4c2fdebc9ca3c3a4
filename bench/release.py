"""How soon a killed notebook's GPU is free: `docker kill` to the lease released in the ledger.

    python bench/release.py            # about 3 minutes; prints one JSON object

Runs, on a fresh vhost of the local broker and on the shared Docker engine in Swarm mode
(``scripts/services start``; ``source .services/env``):

- the real allocator (``python -m allocator.admin.cli serve``) with a fresh ledger;
- the real node agent (``python -m nodeagent``) for this engine's node, with a simulated
  inventory of ``--gpus`` GPUs, heartbeating every ``--interval`` seconds, watching the engine;
- for every lease: an allocation over RPC, then a Swarm service carrying the lease label,
  ``NVIDIA_VISIBLE_DEVICES`` and the ``node.hostname`` constraint, as the hub plugin makes it.

Once the lease is bound and its container has run a few seconds (a notebook runs longer
than the allocator's ``container_gone_grace_s``), the container is killed (``docker kill``
through the engine API) at a random moment, and the ledger (read-only, every 10 ms) says
when the lease was released. Figures: ``released_at`` (the allocator's clock when it
decided) minus the moment of the kill, p50/p99 over ``--kills`` kills, for two agents:

- ``events``: the agent follows Docker's event stream (the default) — the ``die`` event
  releases the lease;
- ``reconciliation``: the agent runs with ``--no-docker-events`` (no event stream; the
  containers are re-listed before every heartbeat) — the first heartbeat that no longer
  lists the container releases it.

A bare aiodocker listener on the same engine records when Docker's own ``die`` event of each
killed container arrives (``kill_to_die_event``): the floor of a release by event, measured
in the same run.

The hand-over (``kill_to_next_grant``): before the kills, the GPUs no lease of the batch holds
are taken and one request per lease waits in the queue, so each kill hands its GPU to the next
request; the figure is that request's ``granted_at`` minus the kill of the lease that held the
GPU. The simulated GPU lists each container's main process (its real pid) until the process
exits, as the driver would; with ``--gpu-processes on`` (the default) the agent reports it
once the allocator's hello asks (the allocator's broker user is in the agent's
``command_users``), so the ended lease's GPU drains until a report shows the process gone
(verified release) before it is granted again; ``off``: the agent reports no processes and
the GPU is placed again at the release.

Targets: p99 <= 500 ms by events, and within 1.2x of the bare listener's ``die`` p99;
<= 2 heartbeat intervals by reconciliation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiodocker
from common import (
    GPU_PROCESSES,
    DieListener,
    ProcessListing,
    machine,
    processes,
    read_ledger,
    services,
    start_process,
    stop_process,
    summary_ms,
    task_template,
    wait_for_allocator,
    wait_running,
)

from allocator.amqp.client import AllocatorClient
from allocator.wire.lease_container import LEASE_LABEL
from allocator.wire.protocol import AllocateRequest, Lease, LeaseState
from nodeagent.simulated import make_gpu

MODEL = "NVIDIA GeForce GTX 1070"


def agent_command(mode: str) -> list[str]:
    command = [sys.executable, "-m", "nodeagent"]
    return command + (["--no-docker-events"] if mode == "reconciliation" else [])


async def wait_bound(client: AllocatorClient, lease_ids: list[str], within: float = 60) -> None:
    deadline = time.monotonic() + within
    for lease_id in lease_ids:
        while (await client.status(lease_id=lease_id)).state is not LeaseState.BOUND:
            if time.monotonic() > deadline:
                raise TimeoutError(f"lease {lease_id} not bound after {within} s")
            await asyncio.sleep(0.1)


async def wait_final(client: AllocatorClient, lease_ids: list[str], within: float = 30) -> None:
    """Until the leases have ended (a released lease that never bound ends when a report
    no longer lists a container for it), so the next batch finds the GPUs free."""
    deadline = time.monotonic() + within
    for lease_id in lease_ids:
        while not (await client.status(lease_id=lease_id)).state.final:
            if time.monotonic() > deadline:
                raise TimeoutError(f"lease {lease_id} not ended after {within} s")
            await asyncio.sleep(0.05)


async def released(ledger: Path, lease_ids: list[str], within: float
                   ) -> dict[str, tuple[float, float, str]]:
    """lease id -> (released_at, seen_at, reason), polling the ledger every 10 ms."""
    found: dict[str, tuple[float, float, str]] = {}
    marks = ", ".join("?" for _ in lease_ids)
    deadline = time.monotonic() + within
    while len(found) < len(lease_ids) and time.monotonic() < deadline:
        rows = await asyncio.to_thread(
            read_ledger, ledger,
            f"SELECT lease_id, released_at, release_reason FROM leases WHERE lease_id IN "
            f"({marks}) AND state = 'released'", tuple(lease_ids))
        now = time.time()
        for lease_id, released_at, reason in rows:
            found.setdefault(lease_id, (released_at, now, reason))
        await asyncio.sleep(0.01)
    return found


async def run_mode(mode: str, args: argparse.Namespace, vhost_url: str, tmp: Path,
                   docker: aiodocker.Docker, host: str) -> dict[str, Any]:
    """``--kills`` kills, in batches of ``--batch`` services, with one agent mode."""
    inventory = tmp / f"inventory-{mode}.json"
    listing = ProcessListing(inventory, host, [make_gpu(host, i, MODEL) for i in range(args.gpus)])
    ledger = tmp / f"ledger-{mode}.sqlite"
    env = {"SWARM_GPU_AMQP_URL": vhost_url, "SWARM_GPU_LEDGER_PATH": str(ledger),
           "SWARM_GPU_ALLOW_ANY_NODE_USER": "true"}
    agent_env = {"SWARM_GPU_AGENT_HOST": host, "SWARM_GPU_AGENT_AMQP_URL": vhost_url,
                 "SWARM_GPU_AGENT_INVENTORY": "simulated",
                 "SWARM_GPU_AGENT_SIMULATED_FILE": str(inventory),
                 "SWARM_GPU_AGENT_INTERVAL_S": str(args.interval),
                 "SWARM_GPU_AGENT_DOCKER_URL": services.docker_host(),
                 # The allocator's broker user, whose hello says it reads GPU processes.
                 "SWARM_GPU_AGENT_COMMAND_USERS": "guest",
                 "SWARM_GPU_AGENT_GPU_PROCESSES": GPU_PROCESSES[args.gpu_processes]}
    latencies: list[float] = []
    handovers: list[float] = []
    seen: list[float] = []
    die_events: list[float] = []
    reasons: dict[str, int] = {}
    missing = 0
    rng = random.Random(mode)
    with processes() as started:
        started.append(start_process([sys.executable, "-m", "allocator.admin.cli", "serve"], env,
                                     tmp / f"allocator-{mode}.log"))
        await wait_for_allocator(vhost_url)
        started.append(start_process(agent_command(mode), agent_env, tmp / f"agent-{mode}.log"))
        async with AllocatorClient(vhost_url, timeout_s=30) as client, \
                DieListener(docker) as dies:
            for _ in range(600):
                inventory_reply = await client.inventory()
                if any(n.host == host and n.up for n in inventory_reply.nodes):
                    break
                await asyncio.sleep(0.1)
            batch_no = 0
            while len(latencies) + missing < args.kills:
                batch = min(args.batch, args.kills - len(latencies) - missing)
                batch_no += 1
                leases = [await client.allocate(AllocateRequest(
                    request_key=f"bench/{mode}/{batch_no}/{i}", user=f"user{i}", host=host,
                    model=MODEL)) for i in range(batch)]
                names = [f"bench-release-{lease.lease_id[:12]}" for lease in leases]
                others: list[Lease] = []
                waiting: list[asyncio.Task[Lease]] = []
                try:
                    for lease, name in zip(leases, names, strict=True):
                        await docker.services.create(task_template(
                            services.BUSYBOX_IMAGE, ["sleep", "600"],
                            labels={LEASE_LABEL: lease.lease_id}, env=lease.env,
                            constraints=[f"node.hostname=={host}"]), name=name)
                    containers = await asyncio.gather(*(wait_running(docker, n) for n in names))
                    for lease, container in zip(leases, containers, strict=True):
                        await listing.add(docker, container, lease.gpu_uuids[0])
                    await wait_bound(client, [lease.lease_id for lease in leases])
                    others, waiting = await queue_for_the_gpus(
                        client, args.gpus - batch, batch, f"bench/{mode}/{batch_no}", host)
                    # Longer than container_gone_grace_s (2 s): a notebook has run a while.
                    await asyncio.sleep(2.5)
                    killed_at: dict[str, float] = {}
                    container_of = {lease.lease_id: container
                                    for lease, container in zip(leases, containers, strict=True)}

                    async def kill(lease_id: str, container: str, delay: float,
                                   killed_at: dict[str, float] = killed_at) -> None:
                        await asyncio.sleep(delay)
                        killed_at[lease_id] = time.time()
                        await docker.containers.container(container).kill()

                    # Kills spread over one interval: every phase relative to the heartbeats.
                    watcher = asyncio.create_task(released(
                        ledger, [lease.lease_id for lease in leases],
                        within=args.interval * 4 + 10))
                    await asyncio.gather(*(
                        kill(lease.lease_id, container, rng.uniform(0, args.interval))
                        for lease, container in zip(leases, containers, strict=True)))
                    found = await watcher
                    for lease in leases:
                        if lease.lease_id not in found:
                            missing += 1
                            continue
                        released_at, seen_at, reason = found[lease.lease_id]
                        latencies.append(released_at - killed_at[lease.lease_id])
                        die_at = await dies.wait(container_of[lease.lease_id])
                        if die_at is not None:
                            die_events.append(die_at - killed_at[lease.lease_id])
                        seen.append(seen_at - killed_at[lease.lease_id])
                        reasons[reason] = reasons.get(reason, 0) + 1
                    handovers.extend(await next_grants(waiting, leases, killed_at))
                finally:
                    for name in names:
                        with contextlib.suppress(aiodocker.DockerError):
                            await docker.services.delete(name)
                    for task in waiting:
                        task.cancel()
                    for task in waiting:
                        with contextlib.suppress(BaseException):
                            others.append(await task)
                    for other in others:
                        with contextlib.suppress(Exception):
                            await client.release(lease_id=other.lease_id, by="hub")
                    await wait_final(client, [other.lease_id for other in others])
        listing.close()
        for process in started[::-1]:
            stop_process(process)
        reported = REPORTS_PROCESSES in (tmp / f"agent-{mode}.log").read_text()
    return {
        "agent": "docker events" if mode == "events" else
                 "--no-docker-events (containers listed before every heartbeat)",
        "kills": len(latencies) + missing,
        "not_released": missing,
        "kill_to_released": summary_ms(latencies),
        "kill_to_visible_in_ledger": summary_ms(seen),
        "kill_to_die_event": summary_ms(die_events),
        "release_reasons": reasons,
        "gpu_processes": args.gpu_processes,
        "agent_reported_processes": reported,
        "kill_to_next_grant": summary_ms(handovers),
    }


REPORTS_PROCESSES = "the allocator reads GPU processes"
"""What the agent logs when it starts listing each GPU's processes (the allocator's hello)."""


async def queue_for_the_gpus(client: AllocatorClient, free: int, batch: int, key: str,
                             host: str) -> tuple[list[Lease], list[asyncio.Task[Lease]]]:
    """Take the ``free`` GPUs no lease of the batch holds, then queue ``batch`` requests
    that wait for the batch's GPUs: each kill hands a GPU over. The leases taken, and the
    waiting requests (each returns its grant)."""
    taken = [await client.allocate(AllocateRequest(
        request_key=f"{key}/free/{i}", user=f"holder{i}", host=host, model=MODEL))
        for i in range(free)]
    queued: set[str] = set()
    waiting = [asyncio.create_task(client.allocate_and_wait(
        AllocateRequest(request_key=f"{key}/next/{i}", user=f"next{i}", host=host,
                        model=MODEL, wait_s=60),
        recheck_s=600, on_queued=lambda lease: queued.add(lease.lease_id)))
        for i in range(batch)]
    deadline = time.monotonic() + 30
    while len(queued) < batch and not any(task.done() for task in waiting):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{batch - len(queued)} requests not queued after 30 s")
        await asyncio.sleep(0.01)
    return taken, waiting


async def next_grants(waiting: list[asyncio.Task[Lease]], killed: list[Lease],
                      killed_at: dict[str, float], within: float = 30.0) -> list[float]:
    """Kill to the next grant of the same GPU (the allocator's ``granted_at``), per GPU
    handed over within ``within`` s."""
    done, _ = await asyncio.wait(waiting, timeout=within)
    kill_of_gpu = {lease.gpu_uuids[0]: killed_at[lease.lease_id] for lease in killed
                   if lease.lease_id in killed_at}
    handovers = []
    for task in done:
        if task.exception() is not None:
            continue
        lease = task.result()
        kill = kill_of_gpu.get(lease.gpu_uuids[0])
        if kill is not None and lease.granted_at is not None and lease.granted_at > kill:
            handovers.append(lease.granted_at - kill)
    return handovers


def print_logs(tmp: Path, mode: str) -> None:
    for log in sorted(tmp.glob(f"*-{mode}.log")):
        print(f"--- {log.name}\n{log.read_text()[-3000:]}", file=sys.stderr)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    broker = services.rabbitmq_from_env()
    docker = aiodocker.Docker(url=services.docker_host())
    try:
        host = (await docker.system.info())["Name"]
        result: dict[str, Any] = {"benchmark": "release", "machine": machine(),
                                  "node": host, "heartbeat_interval_s": args.interval}
        with tempfile.TemporaryDirectory(prefix="swarm-gpu-release-") as tmp_name:
            tmp = Path(tmp_name)
            for mode in ("events", "reconciliation"):
                with services.temporary_vhost(broker) as vhost:
                    try:
                        result[mode] = await run_mode(mode, args, vhost.url, tmp, docker, host)
                    except BaseException:
                        print_logs(tmp, mode)
                        raise
    finally:
        await docker.close()
    interval_ms = args.interval * 1000
    events = result["events"]
    result["ratios"] = {"events_release_vs_bare_die_event_p99": round(
        events["kill_to_released"]["p99_ms"] / events["kill_to_die_event"]["p99_ms"], 2),
        "events_release_vs_bare_die_event_p50": round(
        events["kill_to_released"]["p50_ms"] / events["kill_to_die_event"]["p50_ms"], 2)}
    result["targets"] = {
        "events p99 <= 500 ms": events["kill_to_released"]["p99_ms"] <= 500,
        "events p99 <= 1.2 x the bare die event p99":
            result["ratios"]["events_release_vs_bare_die_event_p99"] <= 1.2,
        f"reconciliation p99 <= 2 intervals ({2 * interval_ms:g} ms)":
            result["reconciliation"]["kill_to_released"]["p99_ms"] <= 2 * interval_ms,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=50, help="kills per agent mode")
    parser.add_argument("--batch", type=int, default=10, help="services running at once")
    parser.add_argument("--gpus", type=int, default=16, help="simulated GPUs of this node")
    parser.add_argument("--interval", type=float, default=2.0, help="heartbeat interval (s)")
    parser.add_argument("--gpu-processes", choices=sorted(GPU_PROCESSES), default="on",
                        help="the agent lists each GPU's processes once the allocator reads "
                        "them (on: the default), or never (off)")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    print(json.dumps(asyncio.run(bench(args)), indent=2))


if __name__ == "__main__":
    main()
