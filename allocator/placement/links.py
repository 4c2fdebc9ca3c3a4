"""Placement by links (:mod:`allocator.placement.gpu_sets`) on hosts whose agent reported how
their GPUs are joined: which host a request of several GPUs goes to, and whether a demanded
level is kept. A host that did not report its links is placed exactly as without them."""

from __future__ import annotations

from collections.abc import Sequence

from allocator.placement.cluster import GPU, Cluster
from allocator.placement.demand import Demand
from allocator.placement.gpu_sets import (
    DEMANDED_LEVEL,
    GpuSet,
    TopologyDemand,
    Unmet,
    best_set_cost,
    choose_gpus,
    lists_all,
    worst_link,
)
from allocator.wire.interconnect import HostInterconnect, LinkLevel

TOPOLOGY_LOOKAHEAD = 4
"""Fitting hosts, in best-fit order, a request for several GPUs compares by their best set's
worst link. Few, so that a grant looks at a handful of hosts, and the placement index
(:mod:`allocator.placement.index`) hands the policy as many candidates per model."""


def worst_or_none(links: HostInterconnect, uuids: Sequence[str]) -> LinkLevel | None:
    try:
        return worst_link(links, uuids)
    except ValueError:  # a GPU the report of links does not list: nothing to promise
        return LinkLevel.SYSTEM


def choose(links: HostInterconnect, uuids: Sequence[str], count: int,
           demand: TopologyDemand | None) -> GpuSet | Unmet | None:
    """:func:`choose_gpus`, None where the links do not list every one of the GPUs (a host
    that changed its GPUs since it reported them)."""
    try:
        return choose_gpus(links, uuids, count, demand)
    except ValueError:
        return None


def host_links(cluster: Cluster, host: str, gpus: Sequence[GPU]) -> HostInterconnect | None:
    """The host's reported links, where they list every one of these GPUs (whole GPUs only:
    a MIG instance is not placed by links)."""
    node = cluster.nodes.get(host)
    links = node.interconnect if node is not None else None
    if links is None or any(g.mig_parent_uuid is not None for g in gpus):
        return None
    return links if lists_all(links, (g.uuid for g in gpus)) else None


def best_linked(demand: Demand, count: int, cluster: Cluster,
                fitting: list[tuple[tuple[int, str, int, str], list[GPU]]]
                ) -> tuple[tuple[tuple[int, str, int, str], list[GPU]], GpuSet | None] | None:
    """Among the first :data:`TOPOLOGY_LOOKAHEAD` fitting candidates in best-fit order (with a
    demanded level: those that keep it): first those where the grant leaves the host's free
    NVLink set of :data:`PROTECTED_NVLINK_SET` GPUs whole (or the host had none), then the
    one whose best set has the best worst link; a host without reported links counts as
    :attr:`LinkLevel.SYSTEM` and breaks no set. Ties: best fit.

    Why the first rule: ranked by the link alone, a pair goes to the first host offering
    NVLink, which is often the only kind of host with an NVLink 4-set (an HGX board), and the
    next 4-GPU NVLink request finds none (``bench/fragmentation.py``)."""
    fitting.sort(key=lambda candidate: candidate[0])
    ranked: list[tuple[bool, int, int]] = []
    chosen_at: dict[int, GpuSet] = {}
    """Position -> the set chosen there, kept so that the placement does not choose again."""
    for position, (key, gpus) in enumerate(fitting[:TOPOLOGY_LOOKAHEAD]):
        links = host_links(cluster, key[1], gpus)
        demand_here = demand.topology if demand.demands_links else None
        if links is None:
            if demand_here is not None:
                continue  # MIG instances, or GPUs the report of links does not list
            ranked.append((False, int(LinkLevel.SYSTEM), position))
            continue
        free = [g.uuid for g in gpus]
        chosen = choose(links, free, count, demand_here)
        if not isinstance(chosen, GpuSet):
            continue  # the demanded level cannot be kept here now
        chosen_at[position] = chosen
        ranked.append((_breaks_nvlink_set(links, free, chosen.gpus),
                       int(chosen.worst_level if chosen.worst_level is not None
                           else LinkLevel.NVLINK), position))
    if not ranked:
        return None
    position = min(ranked)[2]
    return fitting[position], chosen_at.get(position)


PROTECTED_NVLINK_SET = 4
"""The size of the all-NVLink set that host choice avoids breaking (the largest that
:data:`allocator.placement.gpu_sets.PROTECTED_SIZES` protects within a host)."""


def _breaks_nvlink_set(links: HostInterconnect, free: Sequence[str],
                       taken: Sequence[str]) -> bool:
    """Whether taking ``taken`` of the host's ``free`` GPUs leaves no all-NVLink set of
    :data:`PROTECTED_NVLINK_SET` where there was one."""
    before = best_set_cost(links, free, PROTECTED_NVLINK_SET)
    if before is None or before.worst != LinkLevel.NVLINK:
        return False
    taken_set = set(taken)
    left = [uuid for uuid in free if uuid not in taken_set]
    after = best_set_cost(links, left, PROTECTED_NVLINK_SET)
    return after is None or after.worst != LinkLevel.NVLINK


def keeps_level(demand: Demand, cluster: Cluster, host: str, gpus: Sequence[GPU]) -> bool:
    """Whether these GPUs of the host are all joined at the demanded level (one GPU is)."""
    assert demand.topology is not None
    if len(gpus) == 1:
        return True
    links = host_links(cluster, host, gpus)
    if links is None:
        return False
    worst = worst_link(links, [g.uuid for g in gpus])
    return worst is None or worst <= DEMANDED_LEVEL[demand.topology]
