"""Benchmark: how well multi-GPU grants are joined after a long random mix of requests and
releases, the placement by links (0.3.0) against the release before, in the real policy.

A fleet of simulated hosts (``allocator.wire.interconnect``'s builders: 8-GPU HGX boards, 8-GPU
two-socket PCIe servers, 4-GPU workstations with two NVLink pairs) takes a random stream of
1-, 2- and 4-GPU requests (any model) and releases of running leases. Every policy is
:func:`allocator.placement.policy.place` on a :class:`~allocator.placement.cluster.Cluster`, its
grants recorded with :func:`allocator.placement.claims.apply_placement` and its releases dropping
the lease's claims; a request that does not fit is counted as refused (not queued). The policies:

- ``release_before``: no node carries ``interconnect`` (what every host looks like to 0.2.0,
  whose rule this code path keeps: best fit, the lowest GPU indices);
- ``links_host_by_best_fit``: links on every node, but
  :data:`allocator.placement.links.TOPOLOGY_LOOKAHEAD` set to 1, so the host is best fit's and only
  the GPUs within it are chosen by links (this bench's figures before the host choice was built);
- ``links``: links on every node and the policy as released: one GPU by what its taking
  leaves whole, several GPUs on the best-joined of the first ``TOPOLOGY_LOOKAHEAD`` fitting
  hosts.

Every seed draws the same events for every policy: per event, one number for release or
request, one for the request's size and one for which running lease a release ends (its
position among them), whether or not the state uses them.

Measured, per policy and seed: the share of 2- and 4-GPU grants joined at the best level their
host allows (its best set when empty: NVLink on HGX and for a workstation's pair, one PCIe
switch for a pair on the PCIe server, ...) and joined by NVLink, the mean worst link level of
multi-GPU grants (``LinkLevel``: 0 NVLink ... 6 across sockets); after every event, whether
some host could grant 4 GPUs joined by NVLink, and 4 GPUs at its host's best level; requests
refused, by size; grants by size and kind of host; and the thread CPU time of ``place`` plus
``apply_placement`` per grant. Medians over the seeds with their ranges, and the ratios
against ``release_before``. The policies take turns within each seed (the order rotates), so
a busy minute hits all of them.
Prints ONE JSON object.

``python bench/fragmentation.py [--seeds 5] [--events 4000] [--hgx 2] [--pcie 2] [--pairs 4]``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from allocator.placement import links as link_placement
from allocator.placement.claims import apply_placement
from allocator.placement.cluster import GPU, Cluster, Node
from allocator.placement.demand import Demand, Placement
from allocator.placement.gpu_sets import GpuSet, choose_gpus, set_cost
from allocator.placement.policy import place
from allocator.wire.interconnect import (
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

POLICIES = ("release_before", "links_host_by_best_fit", "links")
BASELINE = "release_before"
DOWN_AFTER_S = 1e9
"""Every host stays up: the bench is about where grants go, not about hosts failing."""


@dataclass(frozen=True)
class HostKind:
    """One kind of host in the fleet: its links and the model its GPUs report."""

    name: str
    model: str
    memory_mib: int


HGX = HostKind("hgx", "NVIDIA H100 80GB HBM3", 81_559)
PCIE = HostKind("pcie", "NVIDIA L40S", 46_068)
PAIRS = HostKind("pairs", "NVIDIA RTX A6000", 49_140)
KINDS = (HGX, PCIE, PAIRS)


def fleet(hgx: int, pcie: int, pairs: int) -> dict[str, tuple[HostKind, HostInterconnect]]:
    """Host name -> its kind and links; new objects on every call (the link matrices and
    their memory are per interconnect object, so no run inherits another's)."""
    hosts: dict[str, tuple[HostKind, HostInterconnect]] = {}
    for i in range(hgx):
        hosts[f"hgx-{i}"] = (HGX, hgx_host(f"GPU-hgx{i}"))
    for i in range(pcie):
        hosts[f"pcie-{i}"] = (PCIE, pcie_two_socket_host(f"GPU-pcie{i}"))
    for i in range(pairs):
        hosts[f"pairs-{i}"] = (PAIRS, nvlink_pairs_host(f"GPU-pairs{i}"))
    return hosts


def build_cluster(hosts: dict[str, tuple[HostKind, HostInterconnect]], *,
                  with_links: bool) -> Cluster:
    """Every host up, every GPU healthy and free; ``interconnect`` set only ``with_links``."""
    cluster = Cluster()
    for name, (kind, links) in hosts.items():
        cluster.nodes[name] = Node(host=name, last_heartbeat=0.0, gpu_uuids=list(links.uuids),
                                   interconnect=links if with_links else None)
        for index, uuid in enumerate(links.uuids):
            cluster.gpus[uuid] = GPU(uuid=uuid, host=name, index=index, model=kind.model,
                                     memory_total_mib=kind.memory_mib)
    return cluster


def demand_of(count: int) -> Demand:
    """An exclusive request for ``count`` GPUs of any model, on any host."""
    return Demand(user="bench", groups=(), models=None, min_memory_mib=None,
                  count=count, host=None, shared=False, share_memory_mib=None)


@contextmanager
def lookahead(hosts: int) -> Iterator[None]:
    """The policy's host lookahead set to ``hosts`` for the duration (1: best fit's host)."""
    before = link_placement.TOPOLOGY_LOOKAHEAD
    link_placement.TOPOLOGY_LOOKAHEAD = hosts
    try:
        yield
    finally:
        link_placement.TOPOLOGY_LOOKAHEAD = before


def best_level(host: HostInterconnect, free: Sequence[str], count: int) -> int | None:
    """The worst link of the best ``count``-set among ``free``; None when too few."""
    if len(free) < count:
        return None
    found = choose_gpus(host, free, count)
    assert isinstance(found, GpuSet) and found.worst_level is not None
    return int(found.worst_level)


@dataclass
class Tally:
    """One run's counts."""

    grants: dict[int, int] = field(default_factory=lambda: {2: 0, 4: 0})
    at_best: dict[int, int] = field(default_factory=lambda: {2: 0, 4: 0})
    on_nvlink: dict[int, int] = field(default_factory=lambda: {2: 0, 4: 0})
    worst_levels: list[int] = field(default_factory=list)
    probes: int = 0
    four_nvlink_possible: int = 0
    four_best_possible: int = 0
    refused: dict[int, int] = field(default_factory=lambda: dict.fromkeys(SIZES, 0))
    all_grants: int = 0
    grant_cpu_s: float = 0.0
    by_kind: dict[str, int] = field(default_factory=lambda: {
        f"grants_{count}_on_{kind.name}": 0 for count in SIZES for kind in KINDS})
    """Where the grants went: by size and the kind of host."""

    def figures(self) -> dict[str, float]:
        """The run's figures, by name."""
        return {
            "pair_grants_at_host_best": round(self.at_best[2] / max(1, self.grants[2]), 4),
            "four_grants_at_host_best": round(self.at_best[4] / max(1, self.grants[4]), 4),
            "pair_grants_on_nvlink": round(self.on_nvlink[2] / max(1, self.grants[2]), 4),
            "four_grants_on_nvlink": round(self.on_nvlink[4] / max(1, self.grants[4]), 4),
            "mean_worst_level_multi_gpu": round(statistics.fmean(self.worst_levels), 4),
            "four_nvlink_could_be_met": round(self.four_nvlink_possible / self.probes, 4),
            "four_at_host_best_could_be_met": round(self.four_best_possible / self.probes, 4),
            "refused": sum(self.refused.values()),
            "refused_1": self.refused[1],
            "refused_2": self.refused[2],
            "refused_4": self.refused[4],
            "grants": self.all_grants,
            "cpu_us_per_grant": round(self.grant_cpu_s * 1e6 / max(1, self.all_grants), 2),
            **self.by_kind,
        }


def events_of(seed: int, events: int) -> list[tuple[float, int, float]]:
    """The seed's draws, the same for every policy: (release or request, size, which lease)."""
    rng = random.Random(seed)
    return [(rng.random(), rng.choices(SIZES, SIZE_WEIGHTS)[0], rng.random())
            for _ in range(events)]


def simulate(draws: list[tuple[float, int, float]], fleet_sizes: tuple[int, int, int],
             name: str) -> Tally:
    """One run of ``draws`` under the policy ``name``."""
    hosts = fleet(*fleet_sizes)
    cluster = build_cluster(hosts, with_links=name != BASELINE)
    links = {host: interconnect for host, (_, interconnect) in hosts.items()}
    empty_best = {host: {n: best_level(h, h.uuids, n) for n in (2, 4)}
                  for host, h in links.items()}
    leases: list[tuple[str, Placement]] = []
    demands = {count: demand_of(count) for count in SIZES}
    tally = Tally()
    with lookahead(1 if name == "links_host_by_best_fit" else link_placement.TOPOLOGY_LOOKAHEAD):
        for number, (kind, count, pick) in enumerate(draws):
            if leases and kind < RELEASE_SHARE:
                lease_id, placement = leases.pop(int(pick * len(leases)))
                cluster.drop_claims(lease_id, list(placement.gpu_uuids))
            else:
                demand = demands[count]
                began = time.thread_time()
                found = place(demand, cluster, 0.0, DOWN_AFTER_S, explain=False)
                if isinstance(found, Placement):
                    lease_id = f"lease-{number}"
                    apply_placement(cluster, found, lease_id, demand)
                    tally.grant_cpu_s += time.thread_time() - began
                    leases.append((lease_id, found))
                    tally.all_grants += 1
                    tally.by_kind[f"grants_{count}_on_{hosts[found.host][0].name}"] += 1
                    if count > 1:
                        worst = set_cost(links[found.host], found.gpu_uuids).worst
                        tally.grants[count] += 1
                        tally.at_best[count] += worst == empty_best[found.host][count]
                        tally.on_nvlink[count] += worst == LinkLevel.NVLINK
                        tally.worst_levels.append(worst)
                else:
                    tally.refused[count] += 1
            tally.probes += 1
            four = {host: best_level(h, [g.uuid for g in cluster.gpus_of(host)
                                         if cluster.is_free(g)], 4)
                    for host, h in links.items()}
            tally.four_nvlink_possible += any(
                level == LinkLevel.NVLINK for level in four.values())
            tally.four_best_possible += any(
                level is not None and level == empty_best[host][4]
                for host, level in four.items())
    return tally


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median and range."""
    return {"median": round(statistics.median(values), 4), "min": min(values),
            "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--events", type=int, default=4000)
    parser.add_argument("--hgx", type=int, default=2, help="8-GPU HGX boards")
    parser.add_argument("--pcie", type=int, default=2, help="8-GPU two-socket PCIe servers")
    parser.add_argument("--pairs", type=int, default=4,
                        help="4-GPU workstations with two NVLink pairs")
    args = parser.parse_args()
    fleet_sizes = (args.hgx, args.pcie, args.pairs)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in POLICIES}
    began = time.perf_counter()
    for seed in range(1, args.seeds + 1):
        draws = events_of(seed, args.events)
        turn = (seed - 1) % len(POLICIES)
        for name in POLICIES[turn:] + POLICIES[:turn]:
            runs[name].append({"seed": seed, **simulate(draws, fleet_sizes, name).figures()})
    keys = [k for k in runs[BASELINE][0] if k != "seed"]
    summary = {name: {k: spread([r[k] for r in rows]) for k in keys}
               for name, rows in runs.items()}
    result = {
        "benchmark": "fragmentation: allocator.placement.policy.place with links (0.3.0) against "
                     "without (the release before)",
        "fleet": {"hgx_8_gpu": args.hgx, "pcie_2_socket_8_gpu": args.pcie,
                  "nvlink_pairs_4_gpu": args.pairs},
        "gpus": 8 * (args.hgx + args.pcie) + 4 * args.pairs,
        "topology_lookahead": link_placement.TOPOLOGY_LOOKAHEAD,
        "request_sizes": dict(zip(map(str, SIZES), SIZE_WEIGHTS, strict=True)),
        "release_share": RELEASE_SHARE,
        "events_per_seed": args.events,
        "seeds": args.seeds,
        "summary": summary,
        "ratio_over_release_before": {
            name: {k: round(summary[name][k]["median"] / summary[BASELINE][k]["median"], 3)
                   if summary[BASELINE][k]["median"] else None for k in keys}
            for name in POLICIES if name != BASELINE},
        "runs": runs,
        "wall_s": round(time.perf_counter() - began, 1),
        "python": sys.version.split()[0],
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
