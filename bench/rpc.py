"""Allocation RPC throughput and latency, against the transport's own floor, in one run.

    python bench/rpc.py [--hosts 1000] [--gpus-per-host 8] [--calls 600] [--clients 64]
                        [--ledger-synchronous full|normal] [--ledger-log off|stream]
                        [--broker-cluster | --tls] [--profile DIR]

Starts, each in its own process on a fresh vhost of the local broker (``--broker-cluster``:
of three local RabbitMQ nodes clustered for the run, so the inbound queue, the echo queue and
the ledger log's stream are replicated by Raft as on a three-node broker):
- the real allocator (``gpu-allocator serve``) with a fresh ledger, fed 1,000 simulated
  hosts x 8 GPUs of mixed models by heartbeats;
- an echo server consuming a queue of the same type and arguments as the allocator's
  (quorum, single-active-consumer) and answering every call with a canned lease reply
  through direct reply-to — the floor no allocator on this transport can beat.

Then the same client code (:class:`allocator.amqp.client.AllocatorClient`) makes allocation
calls, first with one client, then with ``--clients`` concurrent clients (one connection
each), against each server. Prints one JSON object: calls/s, p50 and p99 per case, and the
allocator/floor ratios.

``--tls``: the cost of TLS to the broker. A RabbitMQ node of the run's own
(tests/support/services.py) with a plain and a TLS listener and certificates made for the run
(tests/support/tls_certs.py); the whole benchmark once over ``amqp://`` and once over ``amqps://``
(every connection: the allocator's, the echo server's, the clients'), each on a fresh vhost, and the
ratios TLS/plain of the allocator's and the floor's figures.

It also times one ``fsync`` of a 4 KiB write on the ledger's own disk (the folder the ledger
file is in), ``--fsyncs`` times, in the same run: a grant is on disk before its reply, so
one client can at best see the echo floor plus one fsync (``fsync_p50_ms``), and the ratio
``p50_1_client_vs_floor_plus_fsync`` says how far the allocator is from that limit.

Where the allocator's share of one client's call goes: the allocator's own metrics
(``swarm_gpu_batch_phase_seconds``, scraped before and after the one-client case; every call
is a batch of its own there) give the mean of each part of applying a batch: decide, commit
(with the hand-over to the ledger's thread), answer (reply and acknowledgement written); and of
the commit, the transaction on the ledger's thread (``ledger_write``, from
``swarm_gpu_ledger_write_seconds``) and the rest, the hand-over to that thread and back
(``handover``).

``--profile DIR``: py-spy samples the allocator during each of its two cases (without pausing
it; ``pip install py-spy``), writes the collapsed stacks to DIR and puts the busiest functions
into the JSON (``profile``: the share of on-CPU samples under each, and in each itself).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from common import Profiler  # noqa: E402

from allocator.amqp import broker  # noqa: E402
from allocator.amqp.client import AllocatorClient, AllocatorError  # noqa: E402
from allocator.wire.protocol import (  # noqa: E402
    AllocateRequest,
    GPUInfo,
    Heartbeat,
    Lease,
    LeaseReply,
    LeaseState,
    encode,
)
from allocator.wire.topology import (  # noqa: E402
    NODES_EXCHANGE,
    allocator_queue_spec,
    heartbeat_routing_key,
)
from tests.support import services  # noqa: E402  (creates and deletes vhosts)
from tests.support.ports import free_port  # noqa: E402

MODELS = [("NVIDIA GeForce GTX 1070", 8192), ("NVIDIA GeForce RTX 3090", 24576),
          ("NVIDIA A100-SXM4-80GB", 81920), ("NVIDIA RTX A6000", 49152)]
ECHO_EXCHANGE = "bench.echo"
ECHO_QUEUE = "bench.echo"


# ----------------------------------------------------------------------------- echo server


async def echo_server(amqp_url: str) -> None:
    """Answer every request on the echo queue with a canned lease, as fast as aio-pika can."""
    lease = Lease(lease_id="0" * 32, request_key="bench/echo/", user="echo",
                  state=LeaseState.GRANTED, host="gpu-0000", gpu_uuids=["GPU-echo"],
                  gpu_indices=[0], model=MODELS[0][0],
                  env={"NVIDIA_VISIBLE_DEVICES": "GPU-echo", "SWARM_GPU_LEASE": "0" * 32},
                  created_at=time.time(), granted_at=time.time())
    body = encode(LeaseReply(lease=lease))
    connection = await broker.connect_robust(amqp_url)
    channel = await connection.channel(publisher_confirms=False)
    await channel.set_qos(prefetch_count=256)
    exchange = await channel.declare_exchange(ECHO_EXCHANGE, aio_pika.ExchangeType.DIRECT,
                                              durable=True)
    spec = allocator_queue_spec(ECHO_QUEUE)
    queue = await channel.declare_queue(spec.name, durable=True, arguments=spec.arguments)
    await queue.bind(exchange, routing_key="request")

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        await channel.default_exchange.publish(
            aio_pika.Message(body, content_type="application/json",
                             correlation_id=message.correlation_id),
            routing_key=message.reply_to or "", mandatory=False)
        await message.ack()

    await queue.consume(on_message)
    print("ready", flush=True)
    await asyncio.Future()


# ----------------------------------------------------------------------------- clients


def batch_phases(metrics_port: int) -> dict[str, tuple[float, float]]:
    """phase -> (seconds summed, batches) from the allocator's metrics endpoint; the commit's
    transaction on the ledger's thread (``swarm_gpu_ledger_write_seconds``) as the phase
    ``ledger_write``, and what is left of the commit, the hand-over to that thread and back,
    as ``handover`` (means computed by :func:`phase_means_ms`)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                timeout=10) as response:
        text = response.read().decode()
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in ("swarm_gpu_batch_phase_seconds", "swarm_gpu_ledger_write_seconds"):
            continue
        for sample in family.samples:
            phase = sample.labels.get("phase", "ledger_write")
            if sample.name.endswith("_sum"):
                sums[phase] = sample.value
            elif sample.name.endswith("_count"):
                counts[phase] = sample.value
    return {phase: (sums[phase], counts.get(phase, 0.0)) for phase in sums}


def phase_means_ms(before: dict[str, tuple[float, float]],
                   after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """The mean milliseconds per batch of each phase between two scrapes."""
    means = {}
    for phase, (total, count) in after.items():
        total_before, count_before = before.get(phase, (0.0, 0.0))
        if count > count_before:
            means[phase] = round((total - total_before) / (count - count_before) * 1000, 3)
    if "commit" in means and "ledger_write" in means:
        means["handover"] = round(means["commit"] - means["ledger_write"], 3)
    return means


def percentile(values: list[float], fraction: float) -> float:
    """The value below which ``fraction`` of ``values`` lie (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


async def run_case(amqp_url: str, *, exchange: str, clients: int, calls: int,
                   prefix: str) -> dict[str, float]:
    """``calls`` allocations spread over ``clients`` concurrent clients; figures in ms."""
    connections = [AllocatorClient(amqp_url, timeout_s=30, exchange=exchange)
                   for _ in range(clients)]
    await asyncio.gather(*(c.connect() for c in connections))
    latencies: list[float] = []
    per_client = max(calls // clients, 1)

    async def worker(index: int, client: AllocatorClient) -> None:
        for call in range(per_client):
            request = AllocateRequest(request_key=f"{prefix}/{index}/{call}", user=f"u{index}")
            started = time.perf_counter()
            lease = await client.allocate(request)
            latencies.append(time.perf_counter() - started)
            assert lease.state is LeaseState.GRANTED, lease

    # Warm-up: connections, JIT-free but caches and the broker's queue leader.
    await asyncio.gather(*(connections[0].allocate(AllocateRequest(
        request_key=f"{prefix}/warm/{i}", user="warm")) for i in range(20)))
    started = time.perf_counter()
    await asyncio.gather(*(worker(i, c) for i, c in enumerate(connections)))
    elapsed = time.perf_counter() - started
    await asyncio.gather(*(c.close() for c in connections))
    return {
        "calls": len(latencies),
        "calls_per_s": round(len(latencies) / elapsed, 1),
        "p50_ms": round(statistics.median(latencies) * 1000, 3),
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 3),
    }


async def feed_inventory(amqp_url: str, hosts: int, gpus_per_host: int) -> None:
    """One heartbeat per simulated host, as their node agents would send."""
    connection = await broker.connect(amqp_url)
    channel = await connection.channel()
    exchange = await channel.declare_exchange(NODES_EXCHANGE, aio_pika.ExchangeType.TOPIC,
                                              durable=True)
    for h in range(hosts):
        host = f"gpu-{h:04d}"
        model, memory = MODELS[h % len(MODELS)]
        beat = Heartbeat(host=host, agent_id="bench", seq=1, sent_at=time.time(), interval_s=2,
                         source="simulated",
                         gpus=[GPUInfo(uuid=f"GPU-{h:04d}-{i}", index=i, model=model,
                                       memory_total_mib=memory) for i in range(gpus_per_host)])
        await exchange.publish(aio_pika.Message(encode(beat), user_id="guest"),
                               routing_key=heartbeat_routing_key(host))
    await connection.close()


async def wait_for_allocator(amqp_url: str) -> None:
    """Until the allocator answers (it declares the topology when it starts)."""
    for _ in range(100):
        try:
            async with AllocatorClient(amqp_url, timeout_s=1) as client:
                await client.inventory()
                return
        except AllocatorError:
            await asyncio.sleep(0.1)
    raise RuntimeError("the allocator did not start")


async def wait_for_inventory(amqp_url: str, gpus: int) -> None:
    async with AllocatorClient(amqp_url, timeout_s=30) as client:
        for _ in range(600):
            inventory = await client.inventory()
            if sum(model.total for model in inventory.models) >= gpus:
                return
            await asyncio.sleep(0.1)
    raise RuntimeError("the allocator did not take in the whole inventory")


def fsync_times(folder: Path, count: int) -> list[float]:
    """Seconds of each of ``count`` fsyncs after a 4 KiB append, in a file of ``folder``
    (as a WAL commit appends a frame and syncs it)."""
    path = folder / "fsync-probe"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    block = os.urandom(4096)
    times = []
    try:
        for index in range(count):
            os.pwrite(fd, block, index * len(block))
            started = time.perf_counter()
            os.fsync(fd)
            times.append(time.perf_counter() - started)
    finally:
        os.close(fd)
        path.unlink()
    return times


def start_process(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    """A server process whose output goes to a log file (a pipe nobody reads would block it)."""
    with log.open("w") as handle:
        return subprocess.Popen(args, env={**os.environ, **env}, stdout=handle,
                                stderr=subprocess.STDOUT, text=True, cwd=REPO)


def profile(pid: int, folder: str | None, case: str, mine: bool) -> Profiler | None:
    """py-spy on the allocator during one case (``--profile``), or None."""
    if folder is None or not mine:
        return None
    return Profiler(pid, Path(folder) / f"allocator-{case}.txt")


@contextlib.contextmanager
def broker_vhost(cluster: bool) -> Iterator[str]:
    """The AMQP URL of a fresh vhost: on the local broker, or (``cluster``) on three local
    RabbitMQ nodes clustered for this run (tests/support/services.py; its URL names all three)."""
    if not cluster:
        with services.temporary_vhost(services.rabbitmq_from_env()) as vhost:
            yield vhost.url
        return
    with tempfile.TemporaryDirectory() as base, \
            services.private_rabbitmq_cluster(Path(base)) as nodes:
        nodes.add_vhost("bench")
        yield f"{nodes.url}bench"


@contextlib.contextmanager
def tls_broker() -> Iterator[tuple[str, str]]:
    """(plain URL, TLS URL) of two fresh vhosts of a RabbitMQ node of this run's own that
    listens for both, its certificates made for the run."""
    from tests.support.tls_certs import issue, make_ca

    with tempfile.TemporaryDirectory() as base:
        folder = Path(base)
        ca, ca_key, ca_cert = make_ca(folder, "bench-ca")
        server = issue(folder, "broker", ca_key, ca_cert, server=True)
        port = free_port()
        config = (f"listeners.ssl.1 = 127.0.0.1:{port}\n"
                  f"ssl_options.cacertfile = {ca.cert}\nssl_options.certfile = {server.cert}\n"
                  f"ssl_options.keyfile = {server.key}\n")
        with services.private_rabbitmq(folder / "rabbitmq", config=config) as node:
            for vhost in ("plain", "tls"):
                node.ctl("add_vhost", vhost)
                node.ctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
            yield (node.vhost_url("plain"), broker.with_tls(
                f"amqps://guest:guest@127.0.0.1:{port}/tls", ca_file=ca.cert))


async def bench(args: argparse.Namespace) -> dict[str, object]:
    if not args.tls:
        with broker_vhost(args.broker_cluster) as url:
            return await bench_on(url, args)
    with tls_broker() as (plain_url, tls_url):
        plain = await bench_on(plain_url, args)
        tls = await bench_on(tls_url, args)
    many = f"{args.clients}_clients"
    ratios = {}
    for server in ("allocator", "floor"):
        ratios[f"{server}_p50_1_client_tls_vs_plain"] = round(
            tls[f"{server}_1_client"]["p50_ms"] / plain[f"{server}_1_client"]["p50_ms"], 3)
        ratios[f"{server}_throughput_{many}_tls_vs_plain"] = round(
            tls[f"{server}_{many}"]["calls_per_s"] / plain[f"{server}_{many}"]["calls_per_s"], 3)
    return {"benchmark": "rpc --tls", "broker": "one private node, plain and TLS listeners",
            "plain": plain, "tls": tls, "ratios_tls_vs_plain": ratios}


async def bench_on(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark against the broker of ``url``."""
    metrics_port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        allocator_env = {
            "SWARM_GPU_AMQP_URL": url,
            "SWARM_GPU_LEDGER_PATH": str(Path(tmp) / "ledger.sqlite"),
            "SWARM_GPU_ALLOW_ANY_NODE_USER": "true",
            "SWARM_GPU_NODE_DOWN_AFTER_S": "86400",
            "SWARM_GPU_STOP_GRACE_S": "86400",
            "SWARM_GPU_LEDGER_SYNCHRONOUS": args.ledger_synchronous,
            "SWARM_GPU_LEDGER_LOG": args.ledger_log,
            "SWARM_GPU_METRICS_PORT": str(metrics_port),
        }
        allocator_log, echo_log = Path(tmp) / "allocator.log", Path(tmp) / "echo.log"
        allocator = start_process([sys.executable, "-m", "allocator.admin.cli", "serve"],
                                  allocator_env, allocator_log)
        echo = start_process([sys.executable, __file__, "--echo-server", url], {}, echo_log)
        try:
            for _ in range(300):
                if "ready" in echo_log.read_text():
                    break
                await asyncio.sleep(0.05)
            else:
                raise RuntimeError(f"echo server did not start: {echo_log.read_text()}")
            await wait_for_allocator(url)
            await feed_inventory(url, args.hosts, args.gpus_per_host)
            await wait_for_inventory(url, args.hosts * args.gpus_per_host)
            results: dict[str, dict[str, Any]] = {}
            fsyncs = await asyncio.to_thread(fsync_times, Path(tmp), args.fsyncs)
            results["fsync"] = {
                "count": len(fsyncs), "disk_of": "the ledger's folder",
                "p50_ms": round(statistics.median(fsyncs) * 1000, 3),
                "p99_ms": round(percentile(fsyncs, 0.99) * 1000, 3),
            }
            for name, exchange in (("floor", ECHO_EXCHANGE), ("allocator", "swarm-gpu.rpc")):
                mine = name == "allocator"
                before = await asyncio.to_thread(batch_phases, metrics_port) if mine else {}
                profiler = profile(allocator.pid, args.profile, "1_client", mine)
                results[f"{name}_1_client"] = await run_case(
                    url, exchange=exchange, clients=1, calls=args.calls // 2,
                    prefix=f"{name}1")
                if profiler is not None:
                    results[f"{name}_1_client"]["profile"] = profiler.stop()
                if mine:
                    after = await asyncio.to_thread(batch_phases, metrics_port)
                    results[f"{name}_1_client"]["batch_phases_mean_ms"] = phase_means_ms(
                        before, after)
                profiler = profile(allocator.pid, args.profile, f"{args.clients}_clients", mine)
                results[f"{name}_{args.clients}_clients"] = await run_case(
                    url, exchange=exchange, clients=args.clients, calls=args.calls,
                    prefix=f"{name}{args.clients}")
                if profiler is not None:
                    results[f"{name}_{args.clients}_clients"]["profile"] = profiler.stop()
        except BaseException:
            print(allocator_log.read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            for process in (allocator, echo):
                process.terminate()
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
    many = f"{args.clients}_clients"
    floor_plus_fsync = results["floor_1_client"]["p50_ms"] + results["fsync"]["p50_ms"]
    return {
        "benchmark": "rpc",
        "inventory": {"hosts": args.hosts, "gpus": args.hosts * args.gpus_per_host},
        "ledger_synchronous": args.ledger_synchronous,
        "ledger_log": args.ledger_log,
        "broker": "three local nodes, one cluster" if args.broker_cluster else "one node",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        **results,
        "fsync_p50_ms": results["fsync"]["p50_ms"],
        "ratios": {
            "p50_1_client_vs_floor_plus_fsync": round(
                results["allocator_1_client"]["p50_ms"] / floor_plus_fsync, 3),
            f"throughput_{many}_vs_floor": round(
                results[f"allocator_{many}"]["calls_per_s"]
                / results[f"floor_{many}"]["calls_per_s"], 3),
            "p50_1_client_vs_floor": round(
                results["allocator_1_client"]["p50_ms"] / results["floor_1_client"]["p50_ms"], 3),
            "p99_1_client_vs_floor": round(
                results["allocator_1_client"]["p99_ms"] / results["floor_1_client"]["p99_ms"], 3),
        },
        "targets": {f"throughput_{many}_vs_floor": ">= 0.9", "p50_1_client_vs_floor": "<= 1.5",
                    "p50_1_client_vs_floor_plus_fsync": "<= 1.15"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--gpus-per-host", type=int, default=8)
    parser.add_argument("--calls", type=int, default=1280, help="calls in the many-client case")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--fsyncs", type=int, default=200,
                        help="fsyncs timed on the ledger's disk")
    parser.add_argument("--ledger-synchronous", choices=["full", "normal"], default="full",
                        help="the allocator's SQLite synchronous mode (default: full)")
    parser.add_argument("--ledger-log", choices=["off", "stream"], default="off",
                        help="the allocator's replicated ledger log (default: off); with "
                        "stream the local ledger is not fsynced (the stream is the record)")
    parser.add_argument("--broker-cluster", action="store_true",
                        help="run on three local RabbitMQ nodes clustered for the run (their "
                        "quorum queues and the log's stream replicated by Raft), not on the "
                        "local broker")
    parser.add_argument("--tls", action="store_true",
                        help="once over amqp:// and once over amqps:// on a private broker "
                        "node: the cost of TLS (ratios_tls_vs_plain)")
    parser.add_argument("--profile", metavar="DIR",
                        help="record the allocator with py-spy during each case (raw stacks "
                        "in DIR, its busiest functions in the JSON)")
    parser.add_argument("--echo-server", metavar="AMQP_URL", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tls and args.broker_cluster:
        parser.error("--tls and --broker-cluster: one at a time")
    if args.echo_server:
        asyncio.run(echo_server(args.echo_server))
        return
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        args.profile = str(Path(args.profile).resolve())
    print(json.dumps(asyncio.run(bench(args)), indent=2))


if __name__ == "__main__":
    main()
