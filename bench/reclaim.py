"""How soon a guaranteed request gets a borrowed GPU: queued to granted by reclaim, grace excluded.

    python bench/reclaim.py            # about 6 minutes; prints one JSON object

Runs, on a fresh vhost of the local broker and on the shared Docker engine
(``scripts/services start``; ``source .services/env``):

- the real allocator (``python -m allocator.admin.cli serve``) with a fresh ledger, ``alice``
  guaranteed 1 GPU and allowed to borrow a second, ``bob`` guaranteed 1, ``dave`` guaranteed
  none and allowed to borrow 1; ``reclaim_grace_s = 0``, so the figure excludes the grace
  (with a grace, the stop comes that much later and nothing else changes);
- the real node agent (``python -m nodeagent``) on this engine, for a host of its own name with
  a simulated inventory of 2 GPUs, following Docker's events;
- alice's two notebooks as plain containers carrying the lease label, which exit on SIGTERM.

Rounds alternate:

- ``reclaim``: bob (within his guarantee) asks while alice holds both GPUs; the allocator warns
  alice's borrowed lease, stops its container at once (grace 0), the container's ``die`` event
  releases it and bob's queued request is granted;
- ``hub_release`` (the baseline, same path after the decision): dave (borrowing, so he reclaims
  nothing) asks and queues, and the hub releases alice's borrowed lease at once, as when she
  stops her server: stop command, ``die`` event, grant.

Figures: the waiter's ``granted_at - enqueued_at`` from the ledger (the allocator's clock), p50
and p99, and the ratio reclaim / hub release. The reclaim path adds the tick that plans it
(``tick_s``, default 0.5 s, here ``--tick``).

Then ``--booking-rounds`` rounds of a booking's window (each waits for the next whole minute,
since windows are in whole minutes): alice's borrowed notebook runs, a booking of 1 GPU for
the group ``cs101`` starts at the next minute with a lead of 2 s, and erin, a member, asks
before it starts (she would borrow until then, so she waits). alice is warned at the lead;
at the start her container is stopped and erin granted. Figure: ``window_start_to_granted``,
erin's ``granted_at`` less the window's start, against the hub release's queued-to-granted
(the same stop, ``die`` event and grant after the decision).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiodocker
from common import (
    machine,
    processes,
    read_ledger,
    services,
    start_process,
    stop_process,
    summary_ms,
    wait_for_allocator,
)

from allocator.amqp.client import AllocatorClient
from allocator.wire.lease_container import LEASE_LABEL
from allocator.wire.protocol import AllocateRequest, Lease, LeaseState
from nodeagent.simulated import make_gpu, write_inventory

MODEL = "NVIDIA GeForce GTX 1070"
TRAP_TERM = 'trap "exit 0" TERM; while true; do sleep 0.1; done'


async def until_state(client: AllocatorClient, lease_id: str, states: set[LeaseState],
                      within: float = 60.0) -> Lease:
    deadline = time.monotonic() + within
    while True:
        lease = await client.status(lease_id=lease_id)
        if lease.state in states:
            return lease
        if time.monotonic() > deadline:
            raise TimeoutError(f"lease {lease_id} still {lease.state} after {within} s")
        await asyncio.sleep(0.02)


class Notebooks:
    """alice's notebooks: plain containers with the lease label that exit on SIGTERM."""

    def __init__(self, docker: aiodocker.Docker):
        self.docker = docker
        self.started: list[str] = []

    async def run(self, lease_id: str) -> None:
        container = await self.docker.containers.run(
            config={"Image": services.BUSYBOX_IMAGE, "Cmd": ["sh", "-c", TRAP_TERM],
                    "Labels": {LEASE_LABEL: lease_id}, "HostConfig": {"NetworkMode": "host"}},
            name=f"bench-reclaim-{uuid.uuid4().hex[:10]}")
        self.started.append(container.id)

    async def remove_all(self) -> None:
        for container_id in self.started:
            with contextlib.suppress(aiodocker.DockerError):
                await self.docker.containers.container(container_id).delete(force=True)


async def a_round(kind: str, n: int, client: AllocatorClient, notebooks: Notebooks,
                  host: str) -> str:
    """alice's borrowed notebook runs; the waiter asks; returns the waiter's lease id once
    granted, then frees its GPU again for the next round."""
    extra = await client.allocate(AllocateRequest(request_key=f"bench/alice/extra{n}",
                                                  user="alice", host=host, model=MODEL))
    assert extra.state is LeaseState.GRANTED and extra.borrowed, extra
    await notebooks.run(extra.lease_id)
    await until_state(client, extra.lease_id, {LeaseState.BOUND})
    waiter_user = "bob" if kind == "reclaim" else "dave"
    waiter = await client.allocate(AllocateRequest(
        request_key=f"bench/{waiter_user}/{n}", user=waiter_user, host=host, model=MODEL,
        wait_s=120))
    assert waiter.state is LeaseState.QUEUED, waiter
    if kind == "hub_release":
        await client.release(lease_id=extra.lease_id, reason="server stopped")
    await until_state(client, waiter.lease_id, {LeaseState.GRANTED})
    ended = await until_state(client, extra.lease_id, {LeaseState.RELEASED})
    expected = "reclaimed" if kind == "reclaim" else "container_exited"
    assert ended.release_reason == expected, ended
    # The waiter's grant was never bound: its release ends at the next heartbeat.
    await client.release(lease_id=waiter.lease_id, reason="round over")
    await until_state(client, waiter.lease_id, {LeaseState.RELEASED})
    return waiter.lease_id


BOOKING_LEAD_S = 2


async def a_booked_round(n: int, client: AllocatorClient, notebooks: Notebooks,
                         host: str) -> float:
    """alice's borrowed notebook runs on the GPU a booking starting at the next whole minute
    needs; erin, a member, waits for it. Returns the window's start (epoch seconds) once erin
    is granted, then ends the booking and frees the GPU again."""
    extra = await client.allocate(AllocateRequest(request_key=f"bench/alice/booked{n}",
                                                  user="alice", host=host, model=MODEL))
    assert extra.state is LeaseState.GRANTED and extra.borrowed, extra
    await notebooks.run(extra.lease_id)
    await until_state(client, extra.lease_id, {LeaseState.BOUND})
    start = (int(time.time()) + BOOKING_LEAD_S + 5) // 60 * 60 + 60

    def minute(at: int) -> str:
        return f"{datetime.fromtimestamp(at, UTC):%Y-%m-%dT%H:%M}"
    name = f"bench-{n}"
    await client.add_booking({
        "name": name, "group": "cs101", "gpus": {"model": MODEL, "count": 1, "host": host},
        "zone": "UTC", "lead_s": BOOKING_LEAD_S,
        "window": {"kind": "once", "start": minute(start), "end": minute(start + 60)}},
        by="bench")
    member = await client.allocate(AllocateRequest(
        request_key=f"bench/erin/{n}", user="erin", groups=["cs101"], host=host, model=MODEL,
        wait_s=120))
    assert member.state is LeaseState.QUEUED, member
    await until_state(client, member.lease_id, {LeaseState.GRANTED},
                      within=start - time.time() + 60)
    ended = await until_state(client, extra.lease_id, {LeaseState.RELEASED})
    assert ended.release_reason == "reclaimed", ended
    await client.remove_booking(name, by="bench")
    await client.release(lease_id=member.lease_id, reason="round over")
    await until_state(client, member.lease_id, {LeaseState.RELEASED})
    return float(start)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    broker = services.rabbitmq_from_env()
    docker = aiodocker.Docker(url=services.docker_host())
    notebooks = Notebooks(docker)
    waits: dict[str, list[str]] = {"reclaim": [], "hub_release": []}
    booked: dict[str, float] = {}  # erin's lease id -> its window's start
    try:
        # A host name of its own: the agent sees every lease container of the shared engine,
        # and one that another run granted on this node's name must not be adopted here.
        host = f"bench-reclaim-{uuid.uuid4().hex[:8]}"
        with tempfile.TemporaryDirectory(prefix="swarm-gpu-reclaim-") as tmp_name, \
                services.temporary_vhost(broker) as vhost:
            tmp = Path(tmp_name)
            inventory = tmp / "inventory.json"
            write_inventory(inventory, {host: [make_gpu(host, i, MODEL) for i in range(2)]})
            ledger = tmp / "ledger.sqlite"
            config = tmp / "allocator.toml"
            config.write_text(
                f'ledger_path = "{ledger}"\nallow_any_node_user = true\n'
                f"reclaim_grace_s = 0\ntick_s = {args.tick}\ncontainer_stop_grace_s = 5\n"
                'admin_users = ["guest"]\n'
                "[user_quota]\nalice = 1\nbob = 1\ndave = 0\n"
                "[user_borrow_limit]\nalice = 2\ndave = 1\n"
                "[group_quota]\ncs101 = 0\n[group_borrow_limit]\ncs101 = 1\n")
            agent_env = {"SWARM_GPU_AGENT_HOST": host, "SWARM_GPU_AGENT_AMQP_URL": vhost.url,
                         "SWARM_GPU_AGENT_INVENTORY": "simulated",
                         "SWARM_GPU_AGENT_SIMULATED_FILE": str(inventory),
                         "SWARM_GPU_AGENT_INTERVAL_S": str(args.interval),
                         "SWARM_GPU_AGENT_DOCKER_URL": services.docker_host(),
                         # The allocator runs as guest here (in a cluster: allocator).
                         "SWARM_GPU_AGENT_COMMAND_USERS": "guest"}
            with processes() as started:
                started.append(start_process(
                    [sys.executable, "-m", "allocator.admin.cli", "serve", "--config", str(config)],
                    {"SWARM_GPU_AMQP_URL": vhost.url}, tmp / "allocator.log"))
                await wait_for_allocator(vhost.url)
                started.append(start_process([sys.executable, "-m", "nodeagent"], agent_env,
                                             tmp / "agent.log"))
                try:
                    async with AllocatorClient(vhost.url, timeout_s=30) as client:
                        await _wait_node(client, host)
                        own = await client.allocate(AllocateRequest(
                            request_key="bench/alice/own", user="alice", host=host,
                            model=MODEL))
                        await notebooks.run(own.lease_id)
                        await until_state(client, own.lease_id, {LeaseState.BOUND})
                        for n in range(args.rounds):
                            for kind in ("reclaim", "hub_release"):
                                waits[kind].append(
                                    await a_round(kind, n, client, notebooks, host))
                        for n in range(args.booking_rounds):
                            start = await a_booked_round(n, client, notebooks, host)
                            booked[(await client.status(
                                request_key=f"bench/erin/{n}")).lease_id] = start
                except BaseException:
                    _print_logs(tmp)
                    raise
                for process in started[::-1]:
                    stop_process(process)
            figures = {kind: summary_ms(_queued_to_granted(ledger, ids))
                       for kind, ids in waits.items()}
            from_start = summary_ms(_granted_after(ledger, booked))
    finally:
        await notebooks.remove_all()
        await docker.close()
    return {
        "benchmark": "reclaim", "machine": machine(), "node": host, "rounds": args.rounds,
        "tick_s": args.tick, "heartbeat_interval_s": args.interval, "reclaim_grace_s": 0,
        "queued_to_granted": figures,
        "ratio_reclaim_to_hub_release": {
            stat: round(figures["reclaim"][stat] / figures["hub_release"][stat], 2)
            for stat in ("p50_ms", "p99_ms")},
        "booking_lead_s": BOOKING_LEAD_S,
        "window_start_to_granted": from_start,
        "ratio_window_start_to_hub_release": {
            stat: round(from_start[stat] / figures["hub_release"][stat], 2)
            for stat in ("p50_ms", "p99_ms") if stat in from_start},
    }


def _print_logs(tmp: Path) -> None:
    for log in sorted(tmp.glob("*.log")):
        print(f"--- {log.name}\n{log.read_text()[-3000:]}", file=sys.stderr)


async def _wait_node(client: AllocatorClient, host: str) -> None:
    for _ in range(600):
        if any(n.host == host and n.up for n in (await client.inventory()).nodes):
            return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"node {host} never reported")


def _queued_to_granted(ledger: Path, lease_ids: list[str]) -> list[float]:
    marks = ", ".join("?" for _ in lease_ids)
    rows = read_ledger(ledger, f"SELECT granted_at - enqueued_at FROM leases WHERE lease_id IN "
                               f"({marks})", tuple(lease_ids))
    return [float(seconds) for (seconds,) in rows if seconds is not None]


def _granted_after(ledger: Path, starts: dict[str, float]) -> list[float]:
    """Each lease's ``granted_at`` less its window's start."""
    if not starts:
        return []
    marks = ", ".join("?" for _ in starts)
    rows = read_ledger(ledger, f"SELECT lease_id, granted_at FROM leases WHERE lease_id IN "
                               f"({marks})", tuple(starts))
    return [float(granted) - starts[lease_id] for lease_id, granted in rows
            if granted is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30, help="rounds of each kind")
    parser.add_argument("--booking-rounds", type=int, default=3,
                        help="rounds of a booking's window (about a minute each)")
    parser.add_argument("--tick", type=float, default=0.5, help="the allocator's tick_s")
    parser.add_argument("--interval", type=float, default=2.0, help="heartbeat interval (s)")
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    print(json.dumps(asyncio.run(bench(args)), indent=2))


if __name__ == "__main__":
    main()
