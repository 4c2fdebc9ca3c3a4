"""Cluster scale: 1,000 hosts x 8 GPUs heartbeating while 64 hub clients allocate and release.

    python bench/cluster.py            # about 3 minutes; prints one JSON object

What runs, each in its own process, on a fresh vhost of the local broker:

- the real allocator (``python -m allocator.admin.cli serve``), started on a ledger that already
  holds ``--leases`` (10,000) active leases: half exclusive GPUs, half shared slices of the
  GTX 1070s (4 slots each), all bound to containers — a busy cluster. The ledger is written
  by the allocator's own :class:`~allocator.engine.Engine` and
  :class:`~allocator.ledger.store.Ledger`, in this process, without the broker;
- a heartbeat simulator: one process publishing, for every host, every ``--interval`` seconds
  (phases spread evenly) what a node agent publishes (same routing key, ``user_id``,
  expiration of two intervals): in ``full`` phases the real
  :class:`~allocator.wire.protocol.Heartbeat` every time, with the host's 8 GPUs and the lease
  containers running there; in ``delta`` phases that full heartbeat every ``--full-report-s`` (as
  the agent's ``full_report_s``) and a :class:`~allocator.wire.protocol.HeartbeatDelta` in between:
  empty (a steady host), except one in four that carries one GPU whose utilization moved;
- here: 64 :class:`~allocator.amqp.client.AllocatorClient` connections, each in a loop of
  ``allocate`` (mixed: a model or any model, one GPU or two) then ``release(force=True)`` as
  an admin, so every GPU comes back at once.

Phases, in one run: ``idle`` (the same client loop with the heartbeats off: the baseline),
``full`` (every heartbeat full) and ``delta`` (deltas between full reports), alternated
``--rounds`` times (``--phases`` picks which); ``sink`` runs the clients while the simulator
publishes the delta phase's messages to an exchange of the benchmark's own that no queue is
bound to (the broker drops them there), a second baseline: on this 2-core machine the
simulator of 1,000 agents takes CPU that on a cluster is on 1,000 other machines, and
``delta`` against ``sink`` is what the allocator's queue and work cost, without it. ``floor``
sends the same messages through a queue declared as the allocator's (quorum,
single-active-consumer) to a bare consumer, a process of its own with the allocator's prefetch,
that decodes each body as JSON, acknowledges it and does nothing else: the broker's delivery of
the heartbeats, without the allocator's work; ``delta`` against ``floor`` is what applying them
costs, and the consumer's CPU per heartbeat is the floor of the allocator's. ``full-alone``
and ``delta-alone`` run the heartbeats without the clients, and ``idle-alone`` nothing at
all, for the allocator's CPU time per heartbeat (from /proc, less its CPU with nothing to do;
a busy machine distorts that far less than wall-clock ratios). Per phase: allocation
throughput and latency, allocator CPU (% of one core) and resident memory from /proc; with
heartbeats, how many the allocator applied per second and how long each took from being
published to being applied (the ledger's ``nodes.last_heartbeat`` is the allocator's clock
when it applied a node's heartbeat; it is read, read-only, every 0.25 s; a heartbeat is
identified as the newest one published before that time, which is exact while the delay stays
under one interval — the broker's queue depth, also sampled, says whether it did).

Before the rounds every host reports once (a full heartbeat), as in a cluster that has run
for a while: until then the start fence keeps hosts out of placement.

``--ledger-log stream`` runs the allocator as the stack ships it: every batch that writes
anything is appended to a stream in the run's vhost and read back before it is answered (the
default, ``off``, commits to the ledger file alone).

Then the cold start: with the simulator running (deltas, as agents send by default; agents do
not stop for an allocator restart), the allocator is stopped and started again on the same
ledger (the 10,000 active leases and all the history the phases added); measured: process
start to the first answered request, and to every host's first heartbeat after the restart
being applied.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import aio_pika
import aio_pika.abc
from common import (
    REPO,
    CpuMeters,
    ProcStat,
    Profiler,
    allocator_command,
    broker_pid,
    file_sizes_mib,
    machine,
    percentile,
    processes,
    read_ledger,
    services,
    start_process,
    stop_process,
    summary_ms,
    wait_for_allocator,
)

from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.config import AllocatorSettings
from allocator.engine import Engine, Sender
from allocator.ledger.changes import Changes
from allocator.ledger.store import Ledger
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerAction,
    ContainerEvent,
    ContainerInfo,
    GPUInfo,
    Heartbeat,
    HeartbeatDelta,
    LeaseReply,
    ShareRequest,
    decode_inbound,
    encode,
)
from allocator.wire.topology import NODES_EXCHANGE, allocator_queue_spec, heartbeat_routing_key

MODELS = [("NVIDIA GeForce GTX 1070", 8192), ("NVIDIA GeForce RTX 3090", 24576),
          ("NVIDIA A100-SXM4-80GB", 81920), ("NVIDIA RTX A6000", 49152)]
SHARED_MODEL = MODELS[0][0]
SHARE_SLOTS = 4
ADMIN = "guest"
"""The broker user of the benchmark (loopback guest), made an allocator admin to force-release."""


def allocator_env(amqp_url: str, ledger: Path, max_hosts: int,
                  ledger_log: str = "off") -> dict[str, str]:
    return {
        "SWARM_GPU_LEDGER_LOG": ledger_log,
        "SWARM_GPU_AMQP_URL": amqp_url,
        "SWARM_GPU_LEDGER_PATH": str(ledger),
        "SWARM_GPU_ALLOW_ANY_NODE_USER": "true",
        "SWARM_GPU_ADMIN_USERS": json.dumps([ADMIN]),
        "SWARM_GPU_SHARE_SLOTS": json.dumps({SHARED_MODEL: SHARE_SLOTS}),
        # One broker user reports for every simulated host.
        "SWARM_GPU_MAX_HOSTS_PER_NODE_USER": str(max_hosts),
        # The idle phases send no heartbeats: nodes must not go down meanwhile.
        "SWARM_GPU_NODE_DOWN_AFTER_S": "86400",
        "SWARM_GPU_STOP_GRACE_S": "86400",
    }


# ---------------------------------------------------------------------------- the ledger


def host_name(index: int) -> str:
    return f"gpu-{index:04d}"


def gpu_infos(index: int, gpus_per_host: int) -> list[GPUInfo]:
    model, memory = MODELS[index % len(MODELS)]
    return [GPUInfo(uuid=f"GPU-{index:04d}-{i}", index=i, model=model, memory_total_mib=memory,
                    utilization_pct=0.0, temperature_c=35.0, power_w=25.0)
            for i in range(gpus_per_host)]


def build_ledger(path: Path, hosts: int, gpus_per_host: int, leases: int
                 ) -> dict[str, list[list[str]]]:
    """A ledger of ``hosts`` nodes and ``leases`` bound leases, written by the real engine.

    Returns host -> [[container_id, lease_id], ...] of the lease containers "running" there.
    """
    settings = AllocatorSettings(
        ledger_path=path, allow_any_node_user=True, share_slots={SHARED_MODEL: SHARE_SLOTS},
        max_hosts_per_node_user=max(hosts, 4096),
        # Building 5,000 hosts takes longer than a node's heartbeat window on a busy machine:
        # hosts must not go down half-way (the allocator runs with the same setting).
        node_down_after_s=86400)
    engine = Engine(settings, started_at=time.time())
    ledger = Ledger(path)
    ledger.open()
    node = Sender(user_id=ADMIN, via_nodes_exchange=True)
    hub = Sender(user_id=ADMIN, via_nodes_exchange=False)
    changes = Changes()

    def flush() -> None:
        nonlocal changes
        batch, changes = changes, Changes()
        ledger.call(lambda: ledger.commit(batch))

    for h in range(hosts):
        engine.handle(Heartbeat(host=host_name(h), agent_id="builder", seq=0, sent_at=time.time(),
                                interval_s=2, source="simulated",
                                gpus=gpu_infos(h, gpus_per_host)),
                      node, time.time(), changes)
    flush()
    containers: dict[str, list[list[str]]] = {}
    exclusive_models = [m for m, _ in MODELS if m != SHARED_MODEL]
    for i in range(leases):
        if i % 2:
            request = AllocateRequest(request_key=f"prefill/{i}", user=f"user-{i % 997}",
                                      model=SHARED_MODEL, share=ShareRequest(memory_mib=2048))
        else:
            request = AllocateRequest(request_key=f"prefill/{i}", user=f"user-{i % 997}",
                                      model=exclusive_models[(i // 2) % len(exclusive_models)])
        now = time.time()
        reply = engine.handle(request, hub, now, changes)
        if not isinstance(reply, LeaseReply):
            raise RuntimeError(f"prefill lease {i} was refused: {reply}")
        lease = reply.lease
        assert lease.host is not None
        container_id = uuid.uuid4().hex + uuid.uuid4().hex
        engine.handle(ContainerEvent(host=lease.host, container_id=container_id,
                                     lease_id=lease.lease_id, action=ContainerAction.START,
                                     at=now), node, now, changes)
        containers.setdefault(lease.host, []).append([container_id, lease.lease_id])
        if i % 1000 == 999:
            flush()
    flush()
    ledger.close()
    return containers


# ---------------------------------------------------------------------- heartbeat simulator


async def simulate(args: argparse.Namespace) -> None:
    """Publish every host's heartbeat every interval until SIGTERM; then write what was sent."""
    plan = json.loads(await asyncio.to_thread(Path(args.plan).read_text))
    hosts: list[str] = [host_name(h) for h in range(plan["hosts"])]
    gpus = {host: gpu_infos(h, plan["gpus_per_host"]) for h, host in enumerate(hosts)}
    containers = {host: [ContainerInfo(container_id=c, lease_id=lease, name=f"jupyter-{lease[:8]}")
                         for c, lease in plan["containers"].get(host, [])] for host in hosts}
    interval = plan["interval_s"]
    # Every full heartbeat, then every delta in between.
    full_every = 1 if args.mode == "full" else max(1, round(plan["full_report_s"] / interval))
    # "sink": the delta phase's messages, published to an exchange of the benchmark's own that
    # nothing is bound to (the broker drops them there): the simulator's own CPU and the
    # broker's intake, without the allocator's queue and work. Not the nodes exchange: the
    # allocator's queue is bound there with "#", so every routing key would reach it.
    routing_key = heartbeat_routing_key
    # Each host's messages are the real models' JSON, built once; only seq and sent_at change
    # from one beat to the next (as on a host whose GPUs are idle and steady), so that the
    # simulator of 1,000 agents stays cheap next to the allocator on a 2-core machine.
    agent_ids = {host: uuid.uuid4().hex for host in hosts}
    full = {host: heartbeat_template(Heartbeat(
        host=host, agent_id=agent_ids[host], seq=SEQ_MARK, sent_at=SENT_MARK,
        interval_s=interval, gpus=gpus[host], containers=containers[host],
        containers_complete=True, source="simulated")) for host in hosts}
    empty = {host: heartbeat_template(HeartbeatDelta(
        host=host, agent_id=agent_ids[host], seq=SEQ_MARK, sent_at=SENT_MARK,
        interval_s=interval)) for host in hosts}
    busy = {host: heartbeat_template(HeartbeatDelta(
        host=host, agent_id=agent_ids[host], seq=SEQ_MARK, sent_at=SENT_MARK,
        interval_s=interval, gpus=[gpus[host][0].model_copy(update={"utilization_pct": 50.0})]))
        for host in hosts}
    sent: dict[str, list[float]] = {host: [] for host in hosts}
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    connection = await aio_pika.connect(plan["amqp_url"])
    channel = await connection.channel(publisher_confirms=False)
    if args.mode in ("sink", "floor"):
        # The floor's consumer (started first) has bound its queue to this exchange.
        exchange = await channel.declare_exchange(
            SINK_EXCHANGE if args.mode == "sink" else FLOOR_EXCHANGE,
            aio_pika.ExchangeType.TOPIC, durable=False)
    else:
        exchange = await channel.get_exchange(NODES_EXCHANGE, ensure=False)
    user = urllib.parse.unquote(urllib.parse.urlsplit(plan["amqp_url"]).username or "guest")
    start = loop.time() + 0.05
    due = [start + interval * i / len(hosts) for i in range(len(hosts))]
    seq = dict.fromkeys(hosts, 0)
    slips: list[float] = []
    bytes_sent = {"full": 0, "delta": 0}
    position = 0
    await asyncio.to_thread(Path(args.ready).write_text, "ready")
    while not stop.is_set():
        now = loop.time()
        published = 0
        while due[position] <= now and published < len(hosts):
            host = hosts[position]
            slips.append(now - due[position])
            number = seq[host]
            kind = "heartbeat" if number % full_every == 0 else "heartbeat_delta"
            head, middle, tail = (full[host] if kind == "heartbeat"
                                  else busy[host] if number % 4 == 3 else empty[host])
            sent_at = time.time()
            body = b"%s%d%s%r%s" % (head, number, middle, sent_at, tail)
            bytes_sent["full" if kind == "heartbeat" else "delta"] += len(body)
            await exchange.publish(
                aio_pika.Message(body, content_type="application/json", user_id=user,
                                 app_id="swarm-gpu-nodeagent", type=kind,
                                 timestamp=sent_at, expiration=2 * interval,
                                 delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT),
                routing_key=routing_key(host))
            sent[host].append(sent_at)
            seq[host] += 1
            due[position] += interval
            position = (position + 1) % len(hosts)
            published += 1
        await asyncio.sleep(max(0.0, min(0.01, due[position] - loop.time())))
    await connection.close()
    await asyncio.to_thread(Path(args.out).write_text, json.dumps({
        "sent": sent, "published": sum(len(v) for v in sent.values()),
        "full_every": full_every, "bytes": bytes_sent,
        "slip_p99_ms": round(percentile(slips, 0.99) * 1000, 2) if slips else None,
        "slip_max_ms": round(max(slips) * 1000, 2) if slips else None,
    }))


SINK_EXCHANGE = "swarm-gpu-bench.sink"
"""The sink phase's exchange: no queue is bound to it, so the broker drops what reaches it."""

FLOOR_EXCHANGE = "swarm-gpu-bench.floor"
"""The floor phase's exchange, bound to :data:`FLOOR_QUEUE` with ``#``."""
FLOOR_QUEUE = "swarm-gpu-bench.floor"
"""Declared with the allocator's inbound queue's arguments; a bare consumer empties it."""


async def floor_consumer(args: argparse.Namespace) -> None:
    """Consume :data:`FLOOR_QUEUE` as the allocator consumes its queue (its prefetch, manual
    acknowledgements), decode each body as JSON and acknowledge it, nothing else, until
    SIGTERM; then write how many it consumed."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    connection = await aio_pika.connect(args.floor_consume)
    channel = await connection.channel(publisher_confirms=False)
    await channel.set_qos(prefetch_count=AllocatorSettings.model_fields["prefetch"].default)
    exchange = await channel.declare_exchange(FLOOR_EXCHANGE, aio_pika.ExchangeType.TOPIC,
                                              durable=False)
    spec = allocator_queue_spec(FLOOR_QUEUE)
    queue = await channel.declare_queue(spec.name, durable=True, arguments=spec.arguments)
    await queue.bind(exchange, "#")
    consumed = 0

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        nonlocal consumed
        json.loads(message.body)
        consumed += 1
        await message.ack()

    await queue.consume(on_message)
    await asyncio.to_thread(Path(args.ready).write_text, "ready")
    await stop.wait()
    await connection.close()
    await asyncio.to_thread(Path(args.out).write_text, json.dumps({"consumed": consumed}))


SEQ_MARK = 987_654_321
SENT_MARK = 1_234_567.125


def heartbeat_template(beat: Heartbeat | HeartbeatDelta) -> tuple[bytes, bytes, bytes]:
    """The message's JSON split around its seq and sent_at, checked to decode back."""
    body = encode(beat)
    seq, sent = b'"seq":%d' % SEQ_MARK, b'"sent_at":%r' % SENT_MARK
    assert body.count(seq) == 1 and body.count(sent) == 1 and body.index(seq) < body.index(sent)
    head, rest = body.split(seq)
    middle, tail = rest.split(sent)
    parts = (head + b'"seq":', middle + b'"sent_at":', tail)
    decoded = decode_inbound(b"%s%d%s%r%s" % (parts[0], 7, parts[1], 8.5, parts[2]))
    assert decoded == beat.model_copy(update={"seq": 7, "sent_at": 8.5}), decoded
    return parts


class Simulator:
    """The heartbeat simulator (or, with ``consume``, the floor's consumer) as a child
    process."""

    def __init__(self, tmp: Path, plan: Path, name: str, mode: str,
                 consume: str | None = None):
        self.ready = tmp / f"{name}.ready"
        self.out = tmp / f"{name}.json"
        self.log = tmp / f"{name}.log"
        task = ["--floor-consume", consume] if consume else ["--simulate", str(plan),
                                                             "--mode", mode]
        self.args = [sys.executable, __file__, *task,
                     "--ready", str(self.ready), "--out", str(self.out)]
        self.process: Any = None
        self.started_at = 0.0

    async def start(self) -> None:
        self.process = start_process(self.args, {}, self.log)
        for _ in range(400):
            if self.ready.exists():
                self.started_at = time.time()
                return
            if self.process.poll() is not None:
                break
            await asyncio.sleep(0.05)
        raise RuntimeError(f"heartbeat simulator did not start: {self.log.read_text()[-2000:]}")

    def stop(self) -> dict[str, Any]:
        stop_process(self.process, timeout=30)
        if not self.out.exists():
            raise RuntimeError(f"heartbeat simulator failed: {self.log.read_text()[-2000:]}")
        result: dict[str, Any] = json.loads(self.out.read_text())
        return result


# ---------------------------------------------------------------------------- observers


class LedgerWatch:
    """Reads ``nodes.last_heartbeat`` every ``period`` s: which heartbeats were applied, when."""

    def __init__(self, ledger: Path, period: float = 0.25):
        self.ledger = ledger
        self.period = period
        self.applied: dict[str, set[float]] = {}

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            rows = await asyncio.to_thread(
                read_ledger, self.ledger, "SELECT host, last_heartbeat FROM nodes")
            for host, last in rows:
                if last is not None:
                    self.applied.setdefault(host, set()).add(last)
            await asyncio.sleep(self.period)


async def queue_depths(broker: services.RabbitMQ, vhost: str, stop: asyncio.Event,
                       out: list[int]) -> None:
    """Samples the allocator queue's depth (ready + unacknowledged) once a second."""
    path = (f"/api/queues/{urllib.parse.quote(vhost, safe='')}/"
            f"{urllib.parse.quote('swarm-gpu.allocator', safe='')}")
    while not stop.is_set():
        try:
            info = await asyncio.to_thread(broker.api, "GET", path)
            out.append(int(info.get("messages", 0) or 0))
        except Exception:  # the management API's figures are a check, not the measurement
            pass
        await asyncio.sleep(1.0)


def heartbeat_delays(sent: dict[str, list[float]], applied: dict[str, set[float]],
                     since: float, until: float, interval: float) -> dict[str, Any]:
    """Publish-to-apply delay of every heartbeat applied within [since, until]."""
    delays: list[float] = []
    for host, times in applied.items():
        published = sorted(sent.get(host, []))
        for at in times:
            if not since <= at <= until or not published:
                continue
            # The newest heartbeat published before it was applied (exact while delay < interval).
            index = max(0, _bisect_right(published, at) - 1)
            if published[index] <= at:
                delays.append(at - published[index])
    return {
        "applied": len(delays),
        "applied_per_s": round(len(delays) / max(until - since, 1e-9), 1),
        "delay": summary_ms(delays),
        "delay_over_interval": sum(1 for d in delays if d > interval),
    }


def _bisect_right(values: list[float], x: float) -> int:
    import bisect

    return bisect.bisect_right(values, x)


# ------------------------------------------------------------------------------- clients


def request_for(rng: random.Random, key: str, user: str) -> AllocateRequest:
    """The mix of the hub clients: mostly one GPU of a given model; some any model; some two."""
    roll = rng.random()
    model = MODELS[rng.randrange(len(MODELS))][0]
    if roll < 0.2:
        return AllocateRequest(request_key=key, user=user)
    if roll < 0.3:
        return AllocateRequest(request_key=key, user=user, model=model, count=2)
    return AllocateRequest(request_key=key, user=user, model=model)


async def client_phase(clients: list[AllocatorClient], seconds: float, prefix: str
                       ) -> dict[str, Any]:
    """Every client allocates then force-releases, in a loop, for ``seconds``."""
    allocate: list[float] = []
    release: list[float] = []
    errors: dict[str, int] = {}
    end = time.monotonic() + seconds

    async def worker(index: int, client: AllocatorClient) -> None:
        rng = random.Random(f"{prefix}/{index}")
        call = 0
        while time.monotonic() < end:
            call += 1
            request = request_for(rng, f"{prefix}/{index}/{call}", f"hub-user-{index}")
            started = time.perf_counter()
            try:
                lease = await client.allocate(request)
            except AllocatorError as exc:
                errors[exc.code.value] = errors.get(exc.code.value, 0) + 1
                continue
            allocate.append(time.perf_counter() - started)
            started = time.perf_counter()
            try:
                await client.release(lease_id=lease.lease_id, force=True, by="bench")
            except AllocatorError as exc:
                key = f"release_{exc.code.value}"
                errors[key] = errors.get(key, 0) + 1
                continue
            release.append(time.perf_counter() - started)

    started = time.monotonic()
    await asyncio.gather(*(worker(i, c) for i, c in enumerate(clients)))
    elapsed = time.monotonic() - started
    return {
        "seconds": round(elapsed, 1),
        "allocations_per_s": round(len(allocate) / elapsed, 1),
        "allocate": summary_ms(allocate),
        "release": summary_ms(release),
        "errors": errors,
    }


# ---------------------------------------------------------------------------------- main


async def cold_start(env: dict[str, str], tmp: Path, ledger: Path, lease_id: str,
                     hosts: int, run: int) -> dict[str, Any]:
    """Start the allocator on the ledger; time the first answer and every host's heartbeat."""
    async with AllocatorClient(env["SWARM_GPU_AMQP_URL"], timeout_s=60) as client:
        spawned = time.time()
        process = start_process(allocator_command(), env, tmp / f"allocator-cold-{run}.log")
        # Published at once: it waits in the queue (behind heartbeats) until the allocator reads.
        lease = await client.status(lease_id=lease_id)
        first_answer = time.time() - spawned
        assert lease.lease_id == lease_id
    # Each host's first heartbeat applied after the start (the ledger keeps the newest only,
    # so it is read often enough to see the first: every 50 ms, intervals are seconds).
    first_applied: dict[str, float] = {}
    deadline = time.monotonic() + 60
    while len(first_applied) < hosts:
        rows = await asyncio.to_thread(read_ledger, ledger,
                                       "SELECT host, last_heartbeat FROM nodes "
                                       "WHERE last_heartbeat > ?", (spawned,))
        for host, applied in rows:
            first_applied.setdefault(host, applied)
        if time.monotonic() > deadline:
            raise RuntimeError("heartbeats of every host were not applied after the restart")
        await asyncio.sleep(0.05)
    all_hosts = max(first_applied.values()) - spawned
    return {"process": process, "first_answer_s": round(first_answer, 3),
            "consuming_s": consuming_since(tmp / f"allocator-cold-{run}.log", spawned),
            "every_host_heartbeat_applied_s": round(all_hosts, 3)}


def consuming_since(log: Path, spawned: float) -> float | None:
    """Seconds from the process start to the allocator's "consuming" log line (ms precision):
    interpreter, imports, ledger load, broker connection. The rest of the first answer is
    the queue the request waited in."""
    for line in log.read_text().splitlines():
        if "allocator consuming" in line:
            stamp, _, millis = line[:23].partition(",")
            at = time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000
            return round(at - spawned, 3)
    return None


def active_leases(ledger: Path) -> int:
    rows = read_ledger(ledger, "SELECT count(*) FROM leases WHERE state IN "
                               "('queued', 'granted', 'bound', 'releasing')")
    return int(rows[0][0])


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    broker = services.rabbitmq_from_env()
    result: dict[str, Any] = {"benchmark": "cluster", "machine": machine()}
    with services.temporary_vhost(broker) as vhost, \
            tempfile.TemporaryDirectory(prefix="swarm-gpu-cluster-") as tmp_name, \
            processes() as started:
        tmp = Path(tmp_name)
        ledger = tmp / "ledger.sqlite"
        t0 = time.monotonic()
        containers = build_ledger(ledger, args.hosts, args.gpus_per_host, args.leases)
        build_s = time.monotonic() - t0
        plan = tmp / "plan.json"
        plan.write_text(json.dumps({"hosts": args.hosts, "gpus_per_host": args.gpus_per_host,
                                    "interval_s": args.interval, "amqp_url": vhost.url,
                                    "full_report_s": args.full_report_s,
                                    "containers": containers}))
        env = allocator_env(vhost.url, ledger, max(args.hosts, 4096), args.ledger_log)
        allocator = start_process(allocator_command(), env, tmp / "allocator.log")
        started.append(allocator)
        try:
            await wait_for_allocator(vhost.url)
            stat = ProcStat(allocator.pid)
            result["cluster"] = {
                "hosts": args.hosts, "gpus": args.hosts * args.gpus_per_host,
                "active_leases": active_leases(ledger),
                "shared_model": f"{SHARED_MODEL} ({SHARE_SLOTS} slots)",
                "heartbeat_interval_s": args.interval, "clients": args.clients,
                "ledger_log": args.ledger_log,
                "full_report_s": args.full_report_s,
                "ledger_build_s": round(build_s, 1),
                "allocator_rss_mib_loaded": stat.memory_mib()["rss_mib"],
            }
            clients = [AllocatorClient(vhost.url, timeout_s=30) for _ in range(args.clients)]
            await asyncio.gather(*(c.connect() for c in clients))
            # Every host reports once before the rounds, as in a cluster that has run for a
            # while: until a node's first complete report after the start, the start fence
            # keeps it out of placement, and the first phase would measure that window.
            warmup = Simulator(tmp, plan, "sim-warmup", "full")
            await warmup.start()
            await asyncio.sleep(args.interval * 1.5)
            warmup.stop()
            await client_phase(clients, 2.0, "warmup")
            phases: list[dict[str, Any]] = []
            for round_ in range(args.rounds):
                for kind in args.phases:
                    phases.append(await run_phase(kind, round_, args, tmp, plan, clients,
                                                  allocator.pid, ledger, broker, vhost.name))
            await asyncio.gather(*(c.close() for c in clients))
            result["phases"] = phases
            result["summary"] = summarize(phases, args)
            memory = stat.memory_mib()
            result["allocator_memory_mib"] = memory
            result["ledger"] = {
                "files_mib": file_sizes_mib(ledger),
                "rows": dict(zip(("leases", "lease_history", "events", "nodes", "gpus"),
                                 read_ledger(ledger, "SELECT (SELECT count(*) FROM leases), "
                                             "(SELECT count(*) FROM lease_history), "
                                             "(SELECT count(*) FROM events), "
                                             "(SELECT count(*) FROM nodes), "
                                             "(SELECT count(*) FROM gpus)")[0], strict=True)),
                "active_leases": active_leases(ledger),
            }
            # Cold start, with the agents still heartbeating.
            if args.cold_starts < 1:
                result["targets"] = targets(result)
                return result
            lease_id = next(iter(containers.values()))[0][1]
            simulator = Simulator(tmp, plan, "sim-cold", "delta")
            await simulator.start()
            await asyncio.sleep(args.interval)
            colds = []
            for run in range(args.cold_starts):
                stopping = time.monotonic()
                stop_process(allocator)
                stop_s = time.monotonic() - stopping
                before = active_leases(ledger)
                cold = await cold_start(env, tmp, ledger, lease_id, args.hosts, run)
                cold["previous_allocator_stop_s"] = round(stop_s, 3)
                allocator = cold.pop("process")
                started.append(allocator)
                await asyncio.sleep(args.interval)
                cold["active_leases_before"] = before
                cold["active_leases_after"] = active_leases(ledger)
                cold["allocator_rss_mib"] = ProcStat(allocator.pid).memory_mib()["rss_mib"]
                colds.append(cold)
            simulator.stop()
            released = read_ledger(ledger, "SELECT release_reason, count(*) FROM leases "
                                           "WHERE release_reason IS NOT NULL GROUP BY 1")
            result["cold_start"] = {
                "ledger_active_leases": colds[0]["active_leases_before"],
                "ledger_total_leases": result["ledger"]["rows"]["leases"],
                "runs": colds,
                "first_answer_s_median": statistics.median(c["first_answer_s"] for c in colds),
                "consuming_s_median": statistics.median(
                    c["consuming_s"] for c in colds if c["consuming_s"] is not None),
                "every_host_applied_s_median": statistics.median(
                    c["every_host_heartbeat_applied_s"] for c in colds),
            }
            result["release_reasons"] = dict(released)
        except BaseException:
            print((tmp / "allocator.log").read_text()[-3000:], file=sys.stderr)
            raise
    result["targets"] = targets(result)
    return result


async def run_phase(kind: str, round_: int, args: argparse.Namespace, tmp: Path, plan: Path,
                    clients: list[AllocatorClient], pid: int, ledger: Path,
                    broker: services.RabbitMQ, vhost: str) -> dict[str, Any]:
    simulator = None
    watch = LedgerWatch(ledger)
    depths: list[int] = []
    stop = asyncio.Event()
    mode, _, alone = kind.partition("-")
    consumer = None
    if mode == "floor":
        plan_data = json.loads(await asyncio.to_thread(plan.read_text))
        consumer = Simulator(tmp, plan, f"floor-{round_}", mode,
                             consume=plan_data["amqp_url"])
        await consumer.start()
    if mode != "idle":
        simulator = Simulator(tmp, plan, f"sim-{kind}-{round_}", mode)
        await simulator.start()
        # Warm up: every host has beaten once (new agent ids make the allocator write GPUs).
        await asyncio.sleep(args.interval * 1.5)
    observers = [asyncio.create_task(watch.run(stop)),
                 asyncio.create_task(queue_depths(broker, vhost, stop, depths))]
    profiler = (Profiler(pid, Path(args.profile) / f"{kind}-{round_}.txt")
                if args.profile else None)
    meters = CpuMeters({"allocator": pid, "broker": broker_pid(), "clients": os.getpid(),
                        "heartbeat_simulator": simulator.process.pid if simulator else None,
                        "floor_consumer": consumer.process.pid if consumer else None})
    meters.start()
    since = time.time()
    if alone:
        # No clients: the allocator's CPU is the heartbeats' (and its timers').
        await asyncio.sleep(args.seconds)
        figures: dict[str, Any] = {"seconds": args.seconds}
    else:
        figures = await client_phase(clients, args.seconds, f"{kind}{round_}")
    until = time.time()
    cpu = meters.stop()
    figures["allocator_cpu_pct"] = cpu.pop("allocator")
    figures["other_cpu_pct"] = cpu
    if profiler is not None:
        figures["profile"] = await asyncio.to_thread(profiler.stop)
    figures["allocator_memory_mib"] = ProcStat(pid).memory_mib()
    stop.set()
    await asyncio.gather(*observers)
    figures["queue_depth_max"] = max(depths, default=None)
    if simulator is not None and mode in ("sink", "floor"):
        sent = simulator.stop()
        figures[f"{mode}_published_per_s"] = round(
            sent["published"] / max(until - since, 1e-9), 1)
        if consumer is not None:
            consumed = consumer.stop()["consumed"]
            figures["floor_consumed"] = {"consumed": consumed, "published": sent["published"]}
            # Its CPU per heartbeat at the offered rate (it kept up if it consumed all
            # that was published).
            figures["floor_consumer_cpu_us_per_heartbeat"] = round(
                figures["other_cpu_pct"]["floor_consumer"] / 100 * 1e6
                / (args.hosts / args.interval), 1)
    elif simulator is not None:
        sent = simulator.stop()
        figures["heartbeats"] = heartbeat_delays(sent["sent"], watch.applied, since, until,
                                                 args.interval)
        figures["heartbeats"]["offered_per_s"] = round(args.hosts / args.interval, 1)
        figures["heartbeats"]["simulator_slip_p99_ms"] = sent["slip_p99_ms"]
        figures["heartbeats"]["full_every"] = sent["full_every"]
        figures["heartbeats"]["mean_body_bytes"] = round(
            sum(sent["bytes"].values()) / max(sent["published"], 1))
    return {"phase": kind, "round": round_, **figures}


def summarize(phases: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    def median_of(kind: str, *path: str) -> float:
        values = []
        for phase in phases:
            if phase["phase"] != kind:
                continue
            value: Any = phase
            for key in path:
                if key not in value:
                    # A phase where no allocation succeeded has no latencies: say why.
                    raise RuntimeError(f"phase {kind!r} (round {phase['round']}) has no "
                                       f"{'/'.join(path)}; its errors: {phase.get('errors')}")
                value = value[key]
            values.append(value)
        return round(statistics.median(values), 2)

    kinds = list(dict.fromkeys(p["phase"] for p in phases))
    out: dict[str, Any] = {}
    # The allocator's CPU with neither clients nor heartbeats (its timers): taken off the
    # heartbeat phases' CPU before dividing by the heartbeats.
    quiet = median_of("idle-alone", "allocator_cpu_pct") if "idle-alone" in kinds else 0.0
    for kind in kinds:
        if kind == "idle-alone":
            out[kind] = {"allocator_cpu_pct": quiet, "queue_depth_max": max(
                p["queue_depth_max"] or 0 for p in phases if p["phase"] == kind)}
            continue
        if kind.endswith("-alone"):
            # CPU time per heartbeat, from /proc: robust where wall-clock ratios are not (a
            # busy machine gives the allocator a varying share of a core).
            per_beat = [(p["allocator_cpu_pct"] - quiet) / 100 * 1e6 / max(
                p["heartbeats"]["applied_per_s"], 1e-9) for p in phases if p["phase"] == kind]
            out[kind] = {
                "allocator_cpu_pct": median_of(kind, "allocator_cpu_pct"),
                "heartbeats_applied_per_s": median_of(kind, "heartbeats", "applied_per_s"),
                "allocator_cpu_us_per_heartbeat": round(statistics.median(per_beat), 1),
                "heartbeat_delay_p99_ms": round(max(
                    p["heartbeats"]["delay"]["p99_ms"] for p in phases if p["phase"] == kind), 1),
                # A backlog left by the phase before makes the CPU figure meaningless.
                "queue_depth_max": max(p["queue_depth_max"] or 0 for p in phases
                                       if p["phase"] == kind),
            }
            continue
        out[kind] = {
            "allocations_per_s": median_of(kind, "allocations_per_s"),
            "allocate_p50_ms": median_of(kind, "allocate", "p50_ms"),
            "allocate_p99_ms": median_of(kind, "allocate", "p99_ms"),
            "allocator_cpu_pct": median_of(kind, "allocator_cpu_pct"),
        }
        if kind == "floor":
            out[kind]["floor_consumer_cpu_us_per_heartbeat"] = median_of(
                kind, "floor_consumer_cpu_us_per_heartbeat")
        beats = [p["heartbeats"] for p in phases if p["phase"] == kind and "heartbeats" in p]
        if not beats:
            continue
        out[kind].update({
            "heartbeats_applied_per_s": round(statistics.median(
                b["applied_per_s"] for b in beats), 1),
            "heartbeats_offered_per_s": round(args.hosts / args.interval, 1),
            "heartbeat_delay_p50_ms": round(statistics.median(
                b["delay"]["p50_ms"] for b in beats), 1),
            "heartbeat_delay_p99_ms": round(max(b["delay"]["p99_ms"] for b in beats), 1),
            "heartbeat_delay_max_ms": round(max(b["delay"]["max_ms"] for b in beats), 1),
            "mean_body_bytes": beats[0]["mean_body_bytes"],
        })
    # Ratios per round (an idle phase and the heartbeat phases right after it), then their
    # median: other work on the machine changes from minute to minute, so only phases
    # measured next to each other compare fairly.
    if "idle" not in kinds:
        return out
    rounds: list[dict[str, float]] = []
    for round_ in sorted({p["round"] for p in phases}):
        pair = {p["phase"]: p for p in phases if p["round"] == round_}
        idle = pair["idle"]
        ratios: dict[str, float] = {}
        for kind, loaded in pair.items():
            if kind.startswith("idle") or kind.endswith("-alone"):
                continue
            # Against idle, and against the sink phase (the same publishing load that nothing
            # receives): on a 2-core machine the simulator of 1,000 agents competes for the
            # CPU that on a cluster is on 1,000 other machines.
            bases = [("idle", idle)] + [(base, pair[base]) for base in ("sink", "floor")
                                        if base in pair and kind not in ("sink", "floor")]
            for base_name, base in bases:
                ratios[f"throughput_{kind}_vs_{base_name}"] = round(
                    loaded["allocations_per_s"] / base["allocations_per_s"], 3)
                for q in ("p50", "p99"):
                    ratios[f"{q}_{kind}_vs_{base_name}"] = round(
                        loaded["allocate"][f"{q}_ms"] / base["allocate"][f"{q}_ms"], 3)
        rounds.append(ratios)
    out["ratios"] = {key: round(statistics.median(r[key] for r in rounds), 3)
                     for key in rounds[0]}
    out["ratios_per_round"] = rounds
    if "floor" in out and "delta-alone" in out:
        # The allocator's CPU per heartbeat against a consumer that only decodes and acks.
        out["ratios"]["cpu_per_heartbeat_delta_vs_floor"] = round(
            out["delta-alone"]["allocator_cpu_us_per_heartbeat"]
            / out["floor"]["floor_consumer_cpu_us_per_heartbeat"], 3)
    if "full-alone" in out and "delta-alone" in out:
        out["ratios"]["cpu_per_heartbeat_delta_vs_full"] = round(
            out["delta-alone"]["allocator_cpu_us_per_heartbeat"]
            / out["full-alone"]["allocator_cpu_us_per_heartbeat"], 3)
    return out


def targets(result: dict[str, Any]) -> dict[str, Any]:
    """The targets of the heartbeats as agents send them by default (deltas)."""
    summary = result["summary"]
    ratios = summary.get("ratios", {})
    interval_ms = result["cluster"]["heartbeat_interval_s"] * 1000
    peak = result["allocator_memory_mib"]["peak_rss_mib"]
    cold = result["cold_start"]["first_answer_s_median"] if "cold_start" in result else None
    out: dict[str, Any] = {}
    for base in ("idle", "sink", "floor"):
        if f"throughput_delta_vs_{base}" in ratios:
            out[f"throughput_delta_vs_{base} >= 0.85"] = (
                ratios[f"throughput_delta_vs_{base}"] >= 0.85)
            out[f"p99_delta_vs_{base} <= 1.3"] = ratios[f"p99_delta_vs_{base}"] <= 1.3
    for kind in ("delta", "full"):
        if "heartbeat_delay_p99_ms" in summary.get(kind, {}):
            out[f"{kind}_heartbeat_delay_p99 <= interval"] = (
                summary[kind]["heartbeat_delay_p99_ms"] <= interval_ms)
    out["allocator_peak_rss <= 400 MiB"] = peak <= 400
    if cold is not None:
        out["cold_start_first_answer <= 3 s"] = cold <= 3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--gpus-per-host", type=int, default=8)
    parser.add_argument("--leases", type=int, default=10_000,
                        help="active leases in the ledger the allocator starts on")
    parser.add_argument("--interval", type=float, default=2.0, help="heartbeat interval (s)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of one phase")
    parser.add_argument("--rounds", type=int, default=4, help="rounds of the phases")
    parser.add_argument("--phases", default="idle,full,delta",
                        type=lambda text: [k for k in text.split(",") if k],
                        help="phases of a round, from idle, sink, floor, full, delta, "
                        "idle-alone, "
                        "full-alone, "
                        "delta-alone (without clients: the allocator's CPU per heartbeat, "
                        "less its CPU with nothing to do); default idle,full,delta")
    parser.add_argument("--full-report-s", type=float, default=20.0,
                        help="in delta phases, a full heartbeat this often (the agent's "
                        "full_report_s)")
    parser.add_argument("--cold-starts", type=int, default=3)
    parser.add_argument("--ledger-log", choices=["off", "stream"], default="off",
                        help="the allocator's replicated ledger log (default: off; the stack "
                        "ships stream): with stream every batch that writes anything is "
                        "appended to the vhost's stream and read back before it is answered")
    parser.add_argument("--profile", metavar="DIR",
                        help="record the allocator with py-spy during every phase (raw stacks "
                        "in DIR, busiest functions in the JSON)")
    parser.add_argument("--simulate", metavar="PLAN", help=argparse.SUPPRESS)
    parser.add_argument("--ready", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("full", "delta", "sink", "floor"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--floor-consume", metavar="AMQP_URL", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    unknown = set(args.phases) - {"idle", "sink", "floor", "full", "delta", "idle-alone",
                                  "full-alone", "delta-alone"}
    if unknown:
        parser.error(f"unknown phases: {', '.join(sorted(unknown))}")
    if args.simulate:
        args.plan = args.simulate
        asyncio.run(simulate(args))
        return
    if args.floor_consume:
        asyncio.run(floor_consumer(args))
        return
    os.chdir(REPO)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
        args.profile = str(Path(args.profile).resolve())
    print(json.dumps(asyncio.run(bench(args)), indent=2))


if __name__ == "__main__":
    main()
