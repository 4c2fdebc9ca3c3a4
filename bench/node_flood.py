"""Hub request latency while one agent credential floods its heartbeats, against no flood,
in one run, on the real broker with the shipped definitions.

    python bench/node_flood.py [--seconds 60] [--flooders 4] [--window 256]

Loads ``compose/rabbitmq-definitions.json`` (its users with fresh passwords, two agents:
``gpu-a`` and ``gpu-b``) into a fresh vhost of the local broker and starts the real allocator
(``gpu-allocator serve``) in its own process with its user. Then, each for ``--seconds``:

- *quiet*: one hub client (the hub's user) calls the allocator in a loop (``queue``: a request
  through the same queue, batch and reply as every other); ``gpu-b``'s agent beats every 2 s;
- *flood*: the same, while ``--flooders`` processes log in as ``gpu-a``'s agent (its one
  credential, within its connection limit) and publish full heartbeats of ``gpu-a`` as fast
  as the broker confirms them (``--window`` unconfirmed each).

Prints one JSON object: p50/p99/max of the hub calls in each phase and their ratios
(flood/quiet), the calls that failed, what the flooders got published and refused, how many
of ``gpu-b``'s heartbeats the broker refused, and whether ``gpu-b`` stayed up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import aio_pika
import aiormq.exceptions
from common import allocator_command, machine, processes, start_process, summary_ms

from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.wire.protocol import GPUInfo, Heartbeat, encode
from allocator.wire.topology import NODES_EXCHANGE, heartbeat_routing_key
from nodeagent.publisher import Publisher
from tests.support import services
from tests.support.broker_definitions import TEMPLATE, loaded_broker

GPUS_PER_HOST = 8


def beat(host: str, seq: int) -> Heartbeat:
    """A full heartbeat of ``host`` with :data:`GPUS_PER_HOST` GPUs."""
    return Heartbeat(host=host, agent_id=f"bench-{host}", seq=seq, sent_at=time.time(),
                     interval_s=2.0, source="simulated",
                     gpus=[GPUInfo(uuid=f"GPU-{host}-{i}", index=i,
                                   model="NVIDIA GeForce GTX 1070", memory_total_mib=8192)
                           for i in range(GPUS_PER_HOST)])


def flooder(url: str, user_id: str, seconds: float, window: int, out: Any) -> None:
    """One flooding process: publishes ``heartbeat.gpu-a`` as fast as confirmed."""
    out.put(asyncio.run(flood(url, user_id, seconds, window)))


async def flood(url: str, user_id: str, seconds: float, window: int) -> dict[str, int]:
    published = refused = 0
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(NODES_EXCHANGE, ensure=False)
        body = encode(beat("gpu-a", 1))
        key = heartbeat_routing_key("gpu-a")
        deadline = time.monotonic() + seconds

        async def one() -> None:
            nonlocal published, refused
            try:
                await exchange.publish(aio_pika.Message(body, user_id=user_id), routing_key=key,
                                       timeout=30)
                published += 1
            except aiormq.exceptions.DeliveryError:
                refused += 1

        while time.monotonic() < deadline:
            await asyncio.gather(*(one() for _ in range(window)))
    return {"published": published, "refused": refused}


async def calls(url: str, seconds: float) -> tuple[list[float], int]:
    """Hub calls in a loop for ``seconds``: each one's latency, and how many failed."""
    latencies: list[float] = []
    failed = 0
    async with AllocatorClient(url, timeout_s=30) as client:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            began = time.monotonic()
            try:
                await client.queue()
                latencies.append(time.monotonic() - began)
            except AllocatorError:
                failed += 1
    return latencies, failed


async def other_host(publisher: Publisher, stop: asyncio.Event) -> None:
    """``gpu-b``'s agent: a full heartbeat every 2 s."""
    seq = 0
    while not stop.is_set():
        seq += 1
        await publisher.publish_heartbeat(beat("gpu-b", seq))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 2.0)


async def gpu_b_up(url: str) -> bool:
    async with AllocatorClient(url, timeout_s=60) as client:
        nodes = (await client.inventory()).nodes
    return any(node.host == "gpu-b" and node.up for node in nodes)


async def phase(hub: str, agent_b: str, seconds: float,
                flood_args: tuple[str, str, int, int] | None) -> dict[str, Any]:
    publisher = Publisher(agent_b, "gpu-b", timeout_s=10)
    await publisher.start()
    stop = asyncio.Event()
    beats = asyncio.create_task(other_host(publisher, stop))
    spawn = multiprocessing.get_context("spawn")
    workers: list[Any] = []
    results: Any = spawn.Queue()
    if flood_args is not None:
        url, user_id, count, window = flood_args
        for _ in range(count):
            worker = spawn.Process(
                target=flooder, args=(url, user_id, seconds, window, results))
            worker.start()
            workers.append(worker)
        await asyncio.sleep(1.0)  # the flood is under way before the first measured call
    latencies, failed = await calls(hub, seconds)
    flooded = {"published": 0, "refused": 0}
    for worker in workers:
        got = await asyncio.to_thread(results.get, True, seconds + 120)
        flooded = {key: flooded[key] + got[key] for key in flooded}
        worker.join()
    up_after = await gpu_b_up(hub)
    stop.set()
    await beats
    await publisher.stop()
    return {"hub_calls": summary_ms(latencies), "hub_calls_failed": failed,
            "flood": flooded if flood_args is not None else None,
            "gpu_b_heartbeats_refused": publisher.publishes_refused,
            "gpu_b_up_at_end": up_after}


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    rabbitmq = services.rabbitmq_from_env()
    with loaded_broker(rabbitmq, TEMPLATE, "bench-flood") as loaded, \
            tempfile.TemporaryDirectory() as folder, processes() as started:
        env = {"SWARM_GPU_AMQP_URL": loaded.url("allocator"),
               "SWARM_GPU_LEDGER_PATH": str(Path(folder) / "ledger.sqlite"),
               "SWARM_GPU_ALLOW_ANY_NODE_USER": "false",
               "SWARM_GPU_NODE_USER_TEMPLATE": loaded.prefix + "agent-{host}",
               "SWARM_GPU_ADMIN_USERS": json.dumps([loaded.prefix + "admin"]),
               "SWARM_GPU_START_FENCE_S": "0"}
        started.append(start_process(allocator_command(), env, Path(folder) / "allocator.log"))
        hub, agent_b = loaded.url("hub"), loaded.url("agent-gpu-b")
        deadline = time.monotonic() + 60
        while True:
            try:
                if await gpu_b_up(hub):
                    break
            except AllocatorError:
                pass
            publisher = Publisher(agent_b, "gpu-b", timeout_s=10)
            await publisher.start()
            await publisher.publish_heartbeat(beat("gpu-b", 0))
            await publisher.stop()
            if time.monotonic() > deadline:
                raise RuntimeError("the allocator did not start or did not see gpu-b")
            await asyncio.sleep(0.5)
        quiet = await phase(hub, agent_b, args.seconds, None)
        flooded = await phase(hub, agent_b, args.seconds,
                              (loaded.url("agent-gpu-a"), loaded.prefix + "agent-gpu-a",
                               args.flooders, args.window))
    ratio: dict[str, float | None] = {}
    for key in ("p50_ms", "p99_ms"):
        a, b = quiet["hub_calls"].get(key), flooded["hub_calls"].get(key)
        ratio[key.replace("_ms", "")] = round(b / a, 2) if a and b else None
    return {"benchmark": "node_flood", "seconds_each": args.seconds,
            "flooders": args.flooders, "window": args.window,
            "quiet": quiet, "flood": flooded, "ratio_flood_vs_quiet": ratio,
            "machine": machine()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--flooders", type=int, default=4,
                        help="flooding processes, each one connection of gpu-a's agent user")
    parser.add_argument("--window", type=int, default=256,
                        help="unconfirmed publishes each flooder keeps in flight")
    args = parser.parse_args()
    os.environ.setdefault("SWARM_GPU_LOG_LEVEL", "WARNING")
    print(json.dumps(asyncio.run(bench(args)), indent=2))


if __name__ == "__main__":
    main()
