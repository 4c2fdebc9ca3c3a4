"""Spawn to ready on the real hub and engine: with a GPU through swarm-gpu, and without.

    python bench/spawn.py [--spawns 30]      # about 9 minutes; prints one JSON object

Runs, on a fresh vhost of the local broker and the shared Docker engine in Swarm mode
(``scripts/services start``; ``source .services/env``):

- the real allocator (``python -m allocator.admin.cli serve``) with a fresh ledger;
- the real node agent (``python -m nodeagent``) for this engine's node, with a simulated
  inventory of one GTX 1070, watching the engine (it binds and frees the leases, and stops a
  released lease's container);
- a real JupyterHub with the project's example configuration (``tests/support/hub_harness.py``, as
  the end-to-end tests run it): ``GPUSwarmSpawner``, host networking, ``local/busybox``
  serving HTTP as the notebook server.

Two users of the same hub alternate (the order swapped every round): ``gpu`` spawns with one
GTX 1070 (``{"mode": "exclusive", "model": "1070"}``: the spawner asks the allocator, then
creates the service with the lease's environment, constraint and labels), ``plain`` with no
GPU (``{"mode": "none"}``: the same spawner, same image, same host, no allocator call). The
figure is the user's wait: ``POST /hub/api/users/NAME/server`` until the hub says the server
is ready (the POST returns 201 once it is; a 202 is followed by polling the server's
``ready`` every 20 ms). Between spawns, untimed: the server is stopped, its container gone
and, for ``gpu``, the GPU free again.

Target: median and p99 with a GPU within 1.05x of those without.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiodocker
import common

from allocator.amqp.client import AllocatorClient
from nodeagent.simulated import make_gpu, write_inventory
from tests.support.hub_harness import (
    Hub,  # tests/ (on the path through common): the tests' real JupyterHub
)

MODEL = "NVIDIA GeForce GTX 1070"
CHOICES = {"gpu": {"mode": "exclusive", "model": "1070"}, "plain": {"mode": "none"}}
"""The user's spawn options, by user."""


async def spawn_to_ready(hub: Hub, user: str) -> float:
    """Seconds from the spawn request to the hub saying the server is ready."""
    started = time.monotonic()
    status, body = await hub.spawn(user, CHOICES[user])
    if status not in (201, 202):
        raise RuntimeError(f"spawn of {user}: {status} {body}\n{hub.log_tail()}")
    if status == 202:
        while not ((await hub.server_model(user)) or {}).get("ready"):
            if time.monotonic() - started > 120:
                raise RuntimeError(f"{user}'s server not ready\n{hub.log_tail()}")
            await asyncio.sleep(0.02)
    return time.monotonic() - started


async def containers_of(docker: aiodocker.Docker, service: str) -> int:
    listed = await docker.containers.list(all=True, filters=json.dumps(
        {"label": [f"com.docker.swarm.service.name={service}"]}))
    return len(listed)


async def settle(hub: Hub, docker: aiodocker.Docker, client: AllocatorClient, user: str) -> None:
    """Stop the user's server and wait until nothing of it is left (untimed)."""
    await hub.stop_server(user)
    deadline = time.monotonic() + 60
    while await containers_of(docker, hub.service_name(user)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{user}'s container still there 60 s after the stop")
        await asyncio.sleep(0.1)
    while not all(model.free == model.total for model in (await client.inventory()).models):
        if time.monotonic() > deadline:
            raise RuntimeError("the GPU is not free 60 s after the stop")
        await asyncio.sleep(0.1)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    broker = common.services.rabbitmq_from_env()
    chp = common.services.chp_path()
    if chp is None:
        raise SystemExit("configurable-http-proxy not found: run scripts/services start first")
    docker_url = common.services.docker_host()
    docker = aiodocker.Docker(url=docker_url)
    times: dict[str, list[float]] = {user: [] for user in CHOICES}
    try:
        host = (await docker.system.info())["Name"]
        with common.services.temporary_vhost(broker) as vhost, \
                tempfile.TemporaryDirectory(prefix="swarm-gpu-spawn-") as tmp_name, \
                common.processes() as started:
            tmp = Path(tmp_name)
            inventory = tmp / "inventory.json"
            write_inventory(inventory, {host: [make_gpu(host, 0, MODEL)]})
            started.append(common.start_process(
                [sys.executable, "-m", "allocator.admin.cli", "serve"],
                {"SWARM_GPU_AMQP_URL": vhost.url, "SWARM_GPU_LEDGER_PATH": str(tmp / "l.sqlite"),
                 "SWARM_GPU_ALLOW_ANY_NODE_USER": "true",
                 "SWARM_GPU_ALIASES": json.dumps({"1070": MODEL})}, tmp / "allocator.log"))
            await common.wait_for_allocator(vhost.url)
            started.append(common.start_process(
                [sys.executable, "-m", "nodeagent"],
                common.agent_env(host, vhost.url, inventory, docker_url), tmp / "agent.log"))
            hub = Hub(tmp / "hub", chp=chp, amqp_url=vhost.url, docker_host=docker_url,
                      image=common.services.BUSYBOX_IMAGE,
                      users={"gpu": ["students"], "plain": ["students"]}, hub_id="bench",
                      allocator_timeout=10.0)
            try:
                async with AllocatorClient(vhost.url, timeout_s=30) as client:
                    for _ in range(600):
                        if any(n.host == host and n.up for n in (await client.inventory()).nodes):
                            break
                        await asyncio.sleep(0.1)
                    await hub.start()
                    # One untimed round first: images, hub and proxy warm for both.
                    for user in CHOICES:
                        await spawn_to_ready(hub, user)
                        await settle(hub, docker, client, user)
                    for round_no in range(args.spawns):
                        order = list(CHOICES) if round_no % 2 == 0 else list(CHOICES)[::-1]
                        for user in order:
                            times[user].append(await spawn_to_ready(hub, user))
                            await settle(hub, docker, client, user)
            except BaseException:
                for log in ("allocator.log", "agent.log"):
                    print(f"--- {log}\n{(tmp / log).read_text()[-3000:]}", file=sys.stderr)
                print(f"--- hub.log\n{hub.log_tail()}", file=sys.stderr)
                raise
            finally:
                with contextlib.suppress(Exception):
                    await hub.stop()
    finally:
        await docker.close()
    gpu, plain = common.summary_ms(times["gpu"]), common.summary_ms(times["plain"])
    ratios = {"p50_with_vs_without_gpu": round(gpu["p50_ms"] / plain["p50_ms"], 3),
              "p99_with_vs_without_gpu": round(gpu["p99_ms"] / plain["p99_ms"], 3)}
    return {
        "benchmark": "spawn", "machine": common.machine(), "node": host, "spawns_each": args.spawns,
        "with_gpu": gpu, "without_gpu": plain, "ratios": ratios,
        "targets": {name: value <= 1.05 for name, value in
                    (("p50 with GPU <= 1.05 x without", ratios["p50_with_vs_without_gpu"]),
                     ("p99 with GPU <= 1.05 x without", ratios["p99_with_vs_without_gpu"]))},
        "samples_s": {user: [round(t, 3) for t in samples] for user, samples in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--spawns", type=int, default=30, help="timed spawns per user")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(bench(args)), indent=2))


if __name__ == "__main__":
    main()
