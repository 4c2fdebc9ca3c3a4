"""The allocator's own CPU per unit of work, in process: no broker, no disk wait, no sockets.

    python bench/engine.py [--hosts 1000] [--gpus-per-host 8] [--leases 10000] [--calls 600]
                           [--topology none|hgx|pcie-two-socket|nvlink-pairs]

The wall-clock benchmarks (``rpc.py``, ``cluster.py``) measure what users see, and on a
shared machine they move with everything else that runs. This one measures the part that is
the allocator's alone, as **CPU time of the measuring thread** (``time.thread_time``), which
other processes on the machine hardly change: a profile that can be compared from run to run
and before and after a change. It builds a ledger with the real engine and ledger code (the
same as ``cluster.py``: ``--hosts`` hosts, ``--leases`` bound leases, half of them shared
slices), then times, each over many repetitions:

- ``allocate``: one grant on the loaded cluster (the engine's decision, without the commit);
- ``allocate_two``: one grant of two GPUs (a third as many repetitions), the same way;
- ``heartbeat_full``: one host's full report (its GPUs and its lease containers), applied
  by the engine;
- ``heartbeat_delta`` / ``heartbeat_delta_full_path``: one empty delta (nothing changed) of
  a steady host, through the engine's short path, and through the full report's code (as
  every delta before the short path), the two in turn host by host over every host;
- ``heartbeat_delta_gpu``: a delta with one GPU's utilization changed (the full report's
  path);
- ``tick``: one pass of the timers over every lease;
- ``scrape``: what one scrape of the metrics endpoint reads on the event loop
  (:func:`allocator.metrics.exporter.read_scrape`), against ``inventory``: the inventory reply
  built in full, which the scrape read before 2026-12-04;
- ``commit_allocate``: one grant's rows written to SQLite with ``synchronous = FULL`` on the
  ledger's thread (the fsync is the disk's; its wait is not CPU and not counted);
- ``cold_load``: reading the whole ledger (``Ledger.load``) and rebuilding the engine
  (``Engine.load``), the CPU a cold start spends before it can answer;
- ``full_collection_ms``: one full collection of Python's cycle collector with the loaded
  engine in memory (the event loop stalls for it whenever Python starts one), as loaded and
  with the rebuilt state frozen as ``gpu-allocator serve`` freezes it
  (:mod:`allocator.service.heap`), in milliseconds;
- ``fenced_start``: a restart with requests waiting: the engine rebuilt fenced (no node
  placeable before its first complete report), ``--queued`` requests of the hub clients'
  mix queued behind the fence, then every host's first full report applied; the CPU of all
  those reports (each lifts its host's fence and tries the queue again) and how many of the
  requests were granted by the end (it stops after ``--fenced-cap-s`` of CPU, saying how many
  reports it applied).

With ``--topology``, every host's full reports carry that interconnect (the simulated agent's
preset, :func:`nodeagent.simulated.preset_interconnect`), so grants choose GPUs by their links;
``none`` (the default) sends none, as an agent before 0.3.0 (and the code before links can run
this script so).

Prints one JSON object; the figures are medians in microseconds (``cold_load`` in seconds),
with the ratios of each delta to a full heartbeat, all measured in this run.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
from cluster import SHARE_SLOTS, SHARED_MODEL, build_ledger, gpu_infos, host_name, request_for

from allocator.config import AllocatorSettings
from allocator.engine import Engine, Sender
from allocator.ledger.changes import Changes
from allocator.ledger.store import Ledger
from allocator.metrics.exporter import read_scrape
from allocator.service import heap
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerInfo,
    GPUInfo,
    Heartbeat,
    HeartbeatDelta,
)
from tests.support.scraped import EngineOnly

NODE = Sender(user_id="admin", via_nodes_exchange=True)
HUB = Sender(user_id="admin", via_nodes_exchange=False)
COMMITS = 200
"""Grants whose rows are committed one at a time (after the timed allocations)."""


def cpu_us(step: Callable[[], object], repeat: int) -> float:
    """Median CPU microseconds of one ``step`` (each timed alone)."""
    samples = []
    for _ in range(repeat):
        started = time.thread_time()
        step()
        samples.append(time.thread_time() - started)
    return round(statistics.median(samples) * 1e6, 1)


def cpu_us_batched(step: Callable[[], object], repeat: int, per_sample: int = 20) -> float:
    """Median CPU microseconds of one ``step``, timed ``per_sample`` at a time: a single step
    can be shorter than the thread clock's resolution."""
    samples = []
    for _ in range(max(repeat // per_sample, 1)):
        started = time.thread_time()
        for _ in range(per_sample):
            step()
        samples.append((time.thread_time() - started) / per_sample)
    return round(statistics.median(samples) * 1e6, 1)


def bench(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ledger.sqlite"
        built = time.perf_counter()
        containers = build_ledger(path, args.hosts, args.gpus_per_host, args.leases)
        built_s = time.perf_counter() - built
        settings = AllocatorSettings(
            ledger_path=path, allow_any_node_user=True, share_slots={SHARED_MODEL: SHARE_SLOTS},
            max_hosts_per_node_user=max(args.hosts, 4096), node_down_after_s=86400)
        ledger = Ledger(path)
        ledger.open()
        try:
            loads = []
            engine = SwitchableEngine(settings, started_at=time.time())
            for _ in range(3):
                def timed_load() -> tuple[Any, float]:
                    started = time.thread_time()
                    state = ledger.load()
                    return state, time.thread_time() - started
                state, read_s = ledger.call(timed_load)
                started = time.thread_time()
                engine = SwitchableEngine(settings, started_at=time.time())
                engine.load(state, time.time())
                loads.append((read_s, time.thread_time() - started))
            del state  # as the service drops the rows once the engine holds them
            collection = full_collection_ms()
            state = ledger.call(ledger.load)  # fenced_start's, read before measure commits
            figures = measure(engine, ledger, containers, args)
            fenced = fenced_start(settings, state, containers, args)
        finally:
            ledger.close()
    return {
        "benchmark": "engine",
        "inventory": {"hosts": args.hosts, "gpus": args.hosts * args.gpus_per_host,
                      "bound_leases": args.leases, "topology": args.topology},
        "machine": common.machine(),
        "ledger_built_s": round(built_s, 1),
        "cpu_us": figures,
        "cold_load_cpu_s": {
            "ledger_load": round(statistics.median(r for r, _ in loads), 3),
            "engine_load": round(statistics.median(e for _, e in loads), 3),
        },
        "fenced_start": fenced,
        "full_collection_ms": collection,
        "ratios": {
            "heartbeat_delta_vs_full": round(
                figures["heartbeat_delta"] / figures["heartbeat_full"], 3),
            "heartbeat_delta_vs_full_path": round(
                figures["heartbeat_delta"] / figures["heartbeat_delta_full_path"], 3),
            "heartbeat_delta_gpu_vs_full": round(
                figures["heartbeat_delta_gpu"] / figures["heartbeat_full"], 3)},
    }


def full_collection_ms(repeat: int = 3) -> dict[str, float]:
    """One full collection of the cycle collector with the loaded engine in memory (the
    event loop's stall when Python starts one), as it is and once the rebuilt state is
    frozen as ``serve`` freezes it (:mod:`allocator.service.heap`); medians in ms."""
    def median_ms() -> float:
        times = []
        for _ in range(repeat):
            started = time.perf_counter()
            gc.collect()
            times.append(time.perf_counter() - started)
        return round(statistics.median(times) * 1000, 2)

    before = median_ms()
    with heap.rebuilding():
        pass  # the rebuild is done: what it leaves is frozen
    try:
        return {"as_loaded": before, "frozen": median_ms(),
                "objects_frozen": gc.get_freeze_count()}
    finally:
        gc.unfreeze()  # the steps measured next run as they did before this figure


class SwitchableEngine(Engine):
    """The engine, with its short path for a delta that changes nothing switched off while
    ``short_path`` is false (the reference: every delta through the full report's code)."""

    short_path = True

    def _liveness_only(self, base: Heartbeat, beat: Heartbeat, sender: Sender, now: float,
                       changes: Changes) -> bool:
        return self.short_path and super()._liveness_only(base, beat, sender, now, changes)


def measure(engine: SwitchableEngine, ledger: Ledger, containers: dict[str, list[list[str]]],
            args: argparse.Namespace) -> dict[str, float]:
    """The per-operation CPU medians on a loaded engine."""
    now = time.time()
    seq: dict[str, int] = {}

    links: dict[int, dict[str, Any]] = {}
    if args.topology != "none":
        from nodeagent.simulated import preset_interconnect  # 0.3.0: the code before has none
        for h in range(args.hosts):
            links[h] = {"interconnect": preset_interconnect(
                args.topology, [g.uuid for g in gpu_infos(h, args.gpus_per_host)])}

    def full(index: int) -> Heartbeat:
        host = host_name(index % args.hosts)
        seq[host] = seq.get(host, 0) + 1
        return Heartbeat(
            host=host, agent_id="bench", seq=seq[host], sent_at=now, interval_s=2,
            source="simulated", gpus=gpu_infos(index % args.hosts, args.gpus_per_host),
            containers=[ContainerInfo(container_id=c, lease_id=lease_id)
                        for c, lease_id in containers.get(host, [])],
            containers_complete=True, **links.get(index % args.hosts, {}))

    def delta(index: int, gpu: GPUInfo | None = None) -> HeartbeatDelta:
        host = host_name(index % args.hosts)
        seq[host] += 1
        return HeartbeatDelta(host=host, agent_id="bench", seq=seq[host], sent_at=now,
                              interval_s=2, gpus=[gpu] if gpu is not None else [])

    def gpu_delta(index: int) -> HeartbeatDelta:
        # Another utilization at every call: each is a change the delta must carry.
        gpu = gpu_infos(index % args.hosts, args.gpus_per_host)[0]
        return delta(index, gpu.model_copy(update={"utilization_pct": float(index % 90 + 5)}))

    # Every host reports once (the start fence), then the figures; the messages are built
    # outside the timed steps (decoding is the wire's cost, measured by rpc.py and cluster.py).
    for index in range(args.hosts):
        engine.handle(full(index), NODE, now, Changes())
    fulls = iter([full(i) for i in range(args.calls)])
    full_us = cpu_us(lambda: engine.handle(next(fulls), NODE, now, Changes()), args.calls)
    # Empty deltas of every host, the short path and the full one in turn host by host: the
    # same engine, data and caches for both (on the code before the short path, where both
    # are the full path, the two figures came out equal within 1 %).
    # Every host steady first: a report whose GPU upsert changed nothing (the hosts past
    # ``--calls`` have had only their first one, which added their GPUs).
    for index in range(args.calls, args.hosts):
        engine.handle(full(index), NODE, now, Changes())
    samples: dict[bool, list[float]] = {True: [], False: []}
    for index, message in enumerate([delta(i) for i in range(args.hosts)]):
        engine.short_path = index % 2 == 0
        started = time.thread_time()
        engine.handle(message, NODE, now, Changes())
        samples[engine.short_path].append(time.thread_time() - started)
    engine.short_path = True
    delta_us, delta_full_path_us = (round(statistics.median(samples[short]) * 1e6, 1)
                                    for short in (True, False))
    gpu_deltas = iter([gpu_delta(i) for i in range(args.calls)])
    gpu_delta_us = cpu_us(lambda: engine.handle(next(gpu_deltas), NODE, now, Changes()),
                          args.calls)
    requests = iter([AllocateRequest(request_key=f"bench/{i}", user=f"u{i % 64}")
                     for i in range(args.calls + COMMITS)])
    last = Changes()

    def allocate() -> None:
        nonlocal last
        last = Changes()
        engine.handle(next(requests), HUB, now, last)

    allocate_us = cpu_us(allocate, args.calls)
    pairs = iter([AllocateRequest(request_key=f"bench/two/{i}", user=f"u{i % 64}", count=2)
                  for i in range(args.calls // 3)])
    allocate_two_us = cpu_us(lambda: engine.handle(next(pairs), HUB, now, Changes()),
                             args.calls // 3)
    commits = []
    for _ in range(COMMITS):
        allocate()
        batch = last

        def commit(batch: Changes = batch) -> float:
            started = time.thread_time()
            ledger.commit(batch)
            return time.thread_time() - started
        commits.append(ledger.call(commit))
    tick_us = cpu_us_batched(lambda: engine.tick(now, Changes()), 100, per_sample=5)
    observed = EngineOnly(engine)
    scrape_us = cpu_us(lambda: read_scrape(observed, now), 10)
    inventory_us = cpu_us(lambda: engine.inventory(now), 10)
    return {"allocate": allocate_us, "allocate_two": allocate_two_us,
            "heartbeat_full": full_us, "heartbeat_delta": delta_us,
            "heartbeat_delta_full_path": delta_full_path_us,
            "heartbeat_delta_gpu": gpu_delta_us, "tick": tick_us,
            "scrape": scrape_us, "inventory": inventory_us,
            "commit_allocate": round(statistics.median(commits) * 1e6, 1)}


def fenced_start(settings: AllocatorSettings, state: Any,
                 containers: dict[str, list[list[str]]], args: argparse.Namespace
                 ) -> dict[str, float]:
    """A restart with ``--queued`` requests waiting behind the start fence: the CPU of every
    host's first full report (see the module's docstring)."""
    now = time.time()
    engine = Engine(settings, started_at=now)
    engine.load(state, now, fenced=True)
    rng = random.Random("fenced-start")
    requests = [request_for(rng, f"fenced/{n}", f"hub-user-{n}").model_copy(
        update={"wait_s": 60.0}) for n in range(args.queued)]
    for request in requests:
        engine.handle(request, HUB, now, Changes())
    queued = len(engine._queue)
    started = time.thread_time()
    applied = 0
    for index in range(args.hosts):
        if time.thread_time() - started > args.fenced_cap_s:
            break  # a pathological case must still end: report how far it got
        applied += 1
        host = host_name(index)
        engine.handle(Heartbeat(
            host=host, agent_id="bench-restart", seq=1, sent_at=now, interval_s=2,
            source="simulated", gpus=gpu_infos(index, args.gpus_per_host),
            containers=[ContainerInfo(container_id=c, lease_id=lease_id)
                        for c, lease_id in containers.get(host, [])],
            containers_complete=True), NODE, now, Changes())
    cpu_s = time.thread_time() - started
    return {"queued_behind_fence": queued, "first_reports": applied,
            "cpu_s": round(cpu_s, 3), "cpu_us_per_report": round(cpu_s / applied * 1e6, 1),
            "granted_by_the_end": queued - len(engine._queue)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=1000)
    parser.add_argument("--gpus-per-host", type=int, default=8)
    parser.add_argument("--leases", type=int, default=10_000, help="bound leases in the ledger")
    parser.add_argument("--calls", type=int, default=600, help="repetitions of each step")
    parser.add_argument("--queued", type=int, default=64,
                        help="requests waiting behind the start fence in fenced_start")
    parser.add_argument("--fenced-cap-s", type=float, default=60.0,
                        help="fenced_start stops applying first reports after this much CPU")
    parser.add_argument("--topology", default="none",
                        choices=["none", "hgx", "pcie-two-socket", "nvlink-pairs"],
                        help="the interconnect every host reports (none: no links reported)")
    print(json.dumps(bench(parser.parse_args()), indent=2))


if __name__ == "__main__":
    main()
