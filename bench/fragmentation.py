"""Benchmark: how well multi-GPU grants are joined after a long random mix of requests and
releases, today's choice of GPUs within a host against the topology-aware one.

A fleet of simulated hosts (``allocator.interconnect``'s builders: 8-GPU HGX boards, 8-GPU
two-socket PCIe servers, 4-GPU workstations with two NVLink pairs) takes a random stream of
1-, 2- and 4-GPU requests and releases of running leases. Both policies choose the **host** by
today's best fit (fewest free GPUs first, then the host name: ``allocator.policy``'s rule for
whole GPUs), so they see the same free counts at every step; they differ only in **which GPUs**
of the host a request gets:

- ``baseline``: the host's free GPUs in index order, the first N (what ``allocator.policy``
  does today: ``gpus[:count]`` of the placeable GPUs sorted by index);
- ``topology``: :func:`allocator.gpu_sets.choose_gpus` (best-connected set, then the choice
  that leaves the best 4-set and pair free).

Measured, per policy and seed: the share of 2- and 4-GPU grants joined at the best level their
host allows (its best set when empty: NVLink on HGX, one PCIe switch for a pair on the PCIe
server, ...), the mean worst link level of multi-GPU grants (``LinkLevel``: 0 NVLink ... 6
across sockets), and, after every event, whether some host could still grant a 4-GPU NVLink set
and a 4-GPU set at its host's best level. Medians over the seeds and the ratio
topology/baseline. Prints ONE JSON object.

``python bench/fragmentation.py [--seeds 5] [--events 4000]``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from allocator.gpu_sets import GpuSet, choose_gpus, set_cost
from allocator.interconnect import (
    HostInterconnect,
    LinkLevel,
    hgx_host,
    nvlink_pairs_host,
    pcie_two_socket_host,
)

SIZES = (1, 2, 4)
SIZE_WEIGHTS = (0.55, 0.30, 0.15)
RELEASE_SHARE = 0.45
"""Of the events, the share that release a running lease (the rest are requests)."""

Chooser = Callable[[HostInterconnect, list[str], int], tuple[str, ...]]


def fleet() -> dict[str, HostInterconnect]:
    hosts: dict[str, HostInterconnect] = {}
    for i in range(2):
        hosts[f"hgx-{i}"] = hgx_host(f"GPU-hgx{i}")
        hosts[f"pcie-{i}"] = pcie_two_socket_host(f"GPU-pcie{i}")
    for i in range(4):
        hosts[f"pairs-{i}"] = nvlink_pairs_host(f"GPU-pairs{i}")
    return hosts


def baseline(host: HostInterconnect, free: list[str], count: int) -> tuple[str, ...]:
    """Today: the first ``count`` free GPUs by index."""
    return tuple(sorted(free, key=host.index_of)[:count])


def topology(host: HostInterconnect, free: list[str], count: int) -> tuple[str, ...]:
    result = choose_gpus(host, free, count)
    assert isinstance(result, GpuSet)
    return result.gpus


def best_level(host: HostInterconnect, free: Sequence[str], count: int) -> int | None:
    """The worst link of the best ``count``-set among ``free``; None when too few."""
    if len(free) < count:
        return None
    found = choose_gpus(host, free, count)
    assert isinstance(found, GpuSet) and found.worst_level is not None
    return int(found.worst_level)


@dataclass
class Tally:
    grants: dict[int, int] = field(default_factory=lambda: {2: 0, 4: 0})
    at_best: dict[int, int] = field(default_factory=lambda: {2: 0, 4: 0})
    worst_levels: list[int] = field(default_factory=list)
    probes: int = 0
    four_nvlink_possible: int = 0
    four_best_possible: int = 0
    refused_no_room: int = 0
    all_grants: int = 0

    def figures(self) -> dict[str, float]:
        return {
            "pair_grants_at_host_best": round(self.at_best[2] / max(1, self.grants[2]), 4),
            "four_grants_at_host_best": round(self.at_best[4] / max(1, self.grants[4]), 4),
            "mean_worst_level_multi_gpu": round(statistics.fmean(self.worst_levels), 4),
            "four_nvlink_could_be_met": round(self.four_nvlink_possible / self.probes, 4),
            "four_at_host_best_could_be_met": round(self.four_best_possible / self.probes, 4),
        }


def simulate(seed: int, events: int, choose: Chooser) -> tuple[Tally, float]:
    """One run; the random stream depends on the seed only (both policies see the same one)."""
    rng = random.Random(seed)
    hosts = fleet()
    empty_best = {name: {n: best_level(h, h.uuids, n) for n in (2, 4)} for name, h in hosts.items()}
    free = {name: list(h.uuids) for name, h in hosts.items()}
    leases: list[tuple[str, tuple[str, ...]]] = []
    tally = Tally()
    spent = 0.0
    for _ in range(events):
        if leases and rng.random() < RELEASE_SHARE:
            host_name, gpus = leases.pop(rng.randrange(len(leases)))
            free[host_name].extend(gpus)
        else:
            count = rng.choices(SIZES, SIZE_WEIGHTS)[0]
            fitting = [(len(f), name) for name, f in free.items() if len(f) >= count]
            if not fitting:
                tally.refused_no_room += 1
            else:
                host_name = min(fitting)[1]
                host = hosts[host_name]
                began = time.perf_counter()
                gpus = choose(host, free[host_name], count)
                spent += time.perf_counter() - began
                free[host_name] = [u for u in free[host_name] if u not in gpus]
                leases.append((host_name, gpus))
                tally.all_grants += 1
                if count > 1:
                    worst = set_cost(host, gpus).worst
                    tally.grants[count] += 1
                    tally.at_best[count] += worst == empty_best[host_name][count]
                    tally.worst_levels.append(worst)
        tally.probes += 1
        four = {name: best_level(hosts[name], f, 4) for name, f in free.items()}
        tally.four_nvlink_possible += any(level == LinkLevel.NVLINK for level in four.values())
        tally.four_best_possible += any(
            level is not None and level == empty_best[name][4] for name, level in four.items())
    return tally, spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--events", type=int, default=4000)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "topology": []}
    choose_ms: dict[str, list[float]] = {"baseline": [], "topology": []}
    for seed in range(1, args.seeds + 1):
        for name, chooser in (("baseline", baseline), ("topology", topology)):
            tally, spent = simulate(seed, args.events, chooser)
            runs[name].append({"seed": seed, **tally.figures(),
                               "refused_no_room": tally.refused_no_room})
            choose_ms[name].append(spent * 1000 / max(1, tally.all_grants))
    keys = [k for k in runs["baseline"][0] if k not in ("seed", "refused_no_room")]
    medians = {name: {k: round(statistics.median(r[k] for r in rows), 4) for k in keys}
               for name, rows in runs.items()}
    result = {
        "benchmark": "fragmentation: GPUs chosen within a host, index order vs topology-aware",
        "fleet": {"hgx_8_gpu": 2, "pcie_2_socket_8_gpu": 2, "nvlink_pairs_4_gpu": 4},
        "request_sizes": dict(zip(map(str, SIZES), SIZE_WEIGHTS, strict=True)),
        "release_share": RELEASE_SHARE,
        "events_per_seed": args.events,
        "seeds": args.seeds,
        "median": medians,
        "ratio_topology_over_baseline": {
            k: round(medians["topology"][k] / medians["baseline"][k], 3)
            if medians["baseline"][k] else None for k in keys},
        "choice_ms_per_grant_median": {
            name: round(statistics.median(v), 4) for name, v in choose_ms.items()},
        "runs": runs,
        "python": sys.version.split()[0],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
