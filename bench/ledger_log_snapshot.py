"""Snapshots of the replicated ledger log: their size and what they cost the writer, and a new
replica's catch-up from the newest snapshot against a replay of the log from its start.

    python3 bench/ledger_log_snapshot.py [--hosts 1000] [--gpus-per-host 8] [--leases 20000]

On the local broker (a vhost of its own per run, tests/support/services.py) with real SQLite files.
A writer (:class:`allocator.ledger.replication.ReplicatedLog`, as the allocator uses it) builds the
ledger through the log as an allocator would: one batch per host registering its GPUs, then
the leases in batches of ``--leases-per-batch`` (granted, and all but one per GPU released
again, so the ledger has a past), then rounds of GPU telemetry (one batch per
``--telemetry-hosts`` hosts). It takes a snapshot whenever one is due (``snapshot_bytes``),
as the service does after each batch. Two runs, the same batches in each:

- ``snapshot``: retention four snapshots' worth (``ledger_log_snapshot_bytes`` set to the
  size the first snapshot would have, the least the settings allow around it): telemetry
  rounds go on until RabbitMQ has dropped the log's start; then an empty replica catches up.
- ``replay``: the default retention (20 GiB, nothing dropped, no snapshot due): an empty
  replica replays the whole log.

Catch-up is timed from the replica's start to its position reaching the writer's. Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import aio_pika
from common import machine, services

from allocator.config import AllocatorSettings
from allocator.ledger.changes import Changes
from allocator.ledger.lease import LeaseRecord
from allocator.ledger.log_rules import ENTRY_OVERHEAD_BYTES
from allocator.ledger.log_snapshot import encode_parts
from allocator.ledger.replication import SNAPSHOT_PART_BYTES, ReplicatedLog
from allocator.ledger.store import Ledger
from allocator.placement.cluster import GPU, Node
from allocator.wire.protocol import LeaseState, ReleaseReason
from allocator.wire.topology import LEDGER_LOG_STREAM
from tests.support.faults import first_kept_offset

STREAM = LEDGER_LOG_STREAM
MODEL = "NVIDIA A100-SXM4-80GB"
SEGMENT_BYTES = 4 << 20


def host_batch(host: int, gpus: int, now: float) -> Changes:
    changes = Changes()
    node = Node(host=f"gpu-{host:04d}", last_heartbeat=now, agent_id=f"agent-{host:04d}")
    changes.node(node, agent_user=f"agent-gpu-{host:04d}", first_seen=now)
    for index in range(gpus):
        changes.gpu(GPU(uuid=gpu_uuid(host, index), host=node.host, index=index, model=MODEL,
                        memory_total_mib=81920, utilization_pct=3.0, temperature_c=35.0,
                        power_w=60.0, compute_capability="8.0", architecture="ampere"),
                    now, first_seen=now)
    return changes


def gpu_uuid(host: int, index: int) -> str:
    return f"GPU-{host:04d}{index:04d}-0000-0000-0000-{host * 100 + index:012d}"


def lease(n: int, hosts: int, gpus: int, now: float, *, released: bool) -> LeaseRecord:
    host, index = divmod(n % (hosts * gpus), gpus)
    record = LeaseRecord(
        lease_id=f"{n:08d}-0000-4000-8000-000000000000", request_key=f"hub/user{n % 997}/s{n}",
        user=f"user{n % 997}", groups=("students", f"course-{n % 13}"), state=LeaseState.BOUND,
        created_at=now, request={"model": "a100", "count": 1, "wait_s": 0},
        host=f"gpu-{host:04d}", gpu_uuids=(gpu_uuid(host, index),), model=MODEL,
        env={"NVIDIA_VISIBLE_DEVICES": gpu_uuid(host, index),
             "SWARM_GPU_LEASE": f"{n:08d}-0000-4000-8000-000000000000"},
        granted_at=now, bind_deadline=now + 120, bound_at=now + 2,
        container_id=f"{n:064x}")
    if released:
        record.state = LeaseState.RELEASED
        record.released_at = now + 3600
        record.release_reason = ReleaseReason.CONTAINER_GONE
    return record


def lease_batch(first: int, count: int, total: int, hosts: int, gpus: int,
                now: float) -> Changes:
    changes = Changes()
    for n in range(first, first + count):
        # All but the newest lease of each GPU are over: a ledger with a past.
        released = n + hosts * gpus < total
        record = lease(n, hosts, gpus, now, released=released)
        changes.transition(record, None, now, "granted")
        changes.event(now, "granted", lease_id=record.lease_id, user=record.user,
                      host=record.host)
        if released:
            changes.history.append({"lease_id": record.lease_id, "at": now + 3600,
                                    "from_state": "bound", "to_state": "released",
                                    "reason": "container_gone", "by": ""})
    return changes


def telemetry_batch(first_host: int, count: int, gpus: int, now: float, round_: int) -> Changes:
    changes = Changes()
    for host in range(first_host, first_host + count):
        node = Node(host=f"gpu-{host:04d}", last_heartbeat=now, agent_id=f"agent-{host:04d}")
        changes.node(node)
        for index in range(gpus):
            changes.gpu(GPU(uuid=gpu_uuid(host, index), host=node.host, index=index,
                            model=MODEL, memory_total_mib=81920,
                            memory_used_mib=(round_ * 977 + index) % 81920,
                            utilization_pct=float((round_ * 7 + index) % 100),
                            temperature_c=40.0 + round_ % 30, power_w=200.0 + index,
                            compute_capability="8.0", architecture="ampere"), now)
    return changes


class Writer:
    """A writer that snapshots when due, and counts what it appended."""

    def __init__(self, log: ReplicatedLog) -> None:
        self.log = log
        self.entries = 0
        self.bytes = 0
        self.snapshots: list[dict[str, Any]] = []

    async def write(self, changes: Changes) -> None:
        self.entries += 1
        self.bytes += len(json.dumps(changes.to_json())) + ENTRY_OVERHEAD_BYTES
        await self.log.append(changes)
        if self.log.snapshot_due():
            taken = await self.log.take_snapshot()
            assert taken.whole, taken
            self.snapshots.append({"parts": taken.parts, "payload_bytes": taken.payload_bytes,
                                   "stored_bytes": taken.stored_bytes,
                                   "seconds": round(taken.seconds, 3)})


async def replica(url: str, path: Path, **options: Any) -> tuple[ReplicatedLog, Any]:
    ledger = Ledger(path, synchronous="normal")
    ledger.open()
    connection = await aio_pika.connect_robust(url, timeout=10)
    log = ReplicatedLog(ledger, STREAM, timeout_s=60, **options)
    await log.start(connection)
    return log, connection


async def close(log: ReplicatedLog, connection: Any) -> None:
    await log.stop()
    await connection.close()
    log.ledger.close()


async def run(args: argparse.Namespace, tmp: Path, mode: str, options: dict[str, Any],
              telemetry_rounds: int | None) -> dict[str, Any]:
    """One run in a vhost of its own; ``telemetry_rounds`` None: until the start is dropped."""
    broker = services.rabbitmq_from_env()
    now = time.time()
    with services.temporary_vhost(broker) as vhost:
        log, connection = await replica(vhost.url, tmp / f"{mode}-writer.sqlite", **options)
        writer = Writer(log)
        built = time.monotonic()
        await log.claim()
        for host in range(args.hosts):
            await writer.write(host_batch(host, args.gpus_per_host, now))
        for first in range(0, args.leases, args.leases_per_batch):
            await writer.write(lease_batch(first, min(args.leases_per_batch,
                                                      args.leases - first),
                                           args.leases, args.hosts, args.gpus_per_host, now))
        rounds = 0
        while (rounds < telemetry_rounds if telemetry_rounds is not None
               else await first_kept_offset(vhost.url) == 0):
            for first in range(0, args.hosts, args.telemetry_hosts):
                await writer.write(telemetry_batch(first, min(args.telemetry_hosts,
                                                              args.hosts - first),
                                                   args.gpus_per_host, now, rounds))
            rounds += 1
        build_s = time.monotonic() - built
        first_kept = await first_kept_offset(vhost.url)
        assert log.position is not None
        began = time.monotonic()
        new, new_connection = await replica(vhost.url, tmp / f"{mode}-new.sqlite", **options)
        try:
            loaded_s = None
            while new.position is None or new.position.offset < log.position.offset:
                assert new.mismatch is None, new.mismatch
                if loaded_s is None and new.snapshots_loaded:
                    loaded_s = time.monotonic() - began
                await asyncio.sleep(0.05)
            catch_up_s = time.monotonic() - began
            result = {"catch_up_s": round(catch_up_s, 2),
                      "snapshot_loaded_after_s": None if loaded_s is None
                      else round(loaded_s, 2),
                      "entries_applied_by_the_new_replica": new.entries_applied,
                      "snapshots_loaded": new.snapshots_loaded}
        finally:
            await close(new, new_connection)
        await close(log, connection)
    return {"mode": mode, "entries_written": writer.entries,
            "log_bytes_written": writer.bytes, "first_offset_kept": first_kept,
            "telemetry_rounds": rounds, "build_s": round(build_s, 1),
            "snapshots_taken": len(writer.snapshots), "snapshots": writer.snapshots[-3:],
            **result}


def ledger_figures(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """The ledger's snapshot without the broker: how long reading and encoding take."""
    ledger = Ledger(tmp / "alone.sqlite", synchronous="normal")
    ledger.open()
    now = time.time()
    for host in range(args.hosts):
        ledger.call(partial(ledger.commit, host_batch(host, args.gpus_per_host, now)))
    for first in range(0, args.leases, args.leases_per_batch):
        ledger.call(partial(ledger.commit, lease_batch(
            first, min(args.leases_per_batch, args.leases - first), args.leases, args.hosts,
            args.gpus_per_host, now)))
    began = time.monotonic()
    _, tables = ledger.call(lambda: ledger.snapshot_tables(trail=False))
    read_s = time.monotonic() - began
    began = time.monotonic()
    parts = encode_parts(tables, SNAPSHOT_PART_BYTES)
    encode_s = time.monotonic() - began
    _, with_trail = ledger.call(lambda: ledger.snapshot_tables(trail=True))
    trail_bytes = sum(map(len, encode_parts(with_trail, SNAPSHOT_PART_BYTES)))
    ledger.close()
    return {"rows": {name: len(table.rows) for name, table in with_trail.items()},
            "snapshot_payload_bytes": sum(map(len, parts)), "parts": len(parts),
            "read_s": round(read_s, 3), "encode_s": round(encode_s, 3),
            "with_trail_payload_bytes": trail_bytes,
            "ledger_file_bytes": (tmp / "alone.sqlite").stat().st_size}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--gpus-per-host", type=int, default=8)
    parser.add_argument("--leases", type=int, default=20000)
    parser.add_argument("--leases-per-batch", type=int, default=20)
    parser.add_argument("--telemetry-hosts", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarm-gpu-snapshot-") as name:
        tmp = Path(name)
        alone = ledger_figures(args, tmp)
        stored = alone["snapshot_payload_bytes"] + alone["parts"] * 400
        snapshot_bytes = max(stored, 1 << 20)
        small = {"max_bytes": 4 * snapshot_bytes + 2 * SEGMENT_BYTES,
                 "segment_bytes": SEGMENT_BYTES, "snapshot_bytes": snapshot_bytes}
        snapshot = await run(args, tmp, "snapshot", small, None)
        defaults = {name: AllocatorSettings.model_fields[f"ledger_log_{name}"].default
                    for name in ("max_bytes", "segment_bytes", "snapshot_bytes")}
        replay = await run(args, tmp, "replay", defaults, snapshot["telemetry_rounds"])
    print(json.dumps({"machine": machine(), "hosts": args.hosts,
                      "gpus_per_host": args.gpus_per_host, "leases": args.leases,
                      "ledger": alone, "retention_of_the_snapshot_run": small,
                      "runs": [snapshot, replay]}, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
