"""What may be placed on right now: up, undrained hosts and their placeable GPUs, computed once
per placement; and what is free, by model and host."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from allocator.placement.cluster import GPU, Cluster
from allocator.placement.demand import Demand


@dataclass
class View:
    """What is placeable right now, computed once per call."""

    hosts: list[str]
    """Candidate hosts that are up and not drained, sorted."""
    placeable: dict[str, list[GPU]]
    """Host -> its placeable GPUs, by index."""
    host_free: dict[str, int]
    """Host -> placeable GPUs with no claim at all."""


def usable(cluster: Cluster, host: str, now: float, down_after_s: float) -> bool:
    node = cluster.nodes.get(host)
    return node is not None and node.is_up(now, down_after_s) and not node.drained


def current_view(cluster: Cluster, hosts: Sequence[str], now: float, down_after_s: float) -> View:
    hosts_up = sorted(h for h in hosts if usable(cluster, h, now, down_after_s))
    placeable = {
        host: sorted((gpu for gpu in cluster.gpus_of(host) if gpu.placeable),
                     key=lambda g: g.order)
        for host in hosts_up
    }
    host_free = {
        host: sum(1 for gpu in gpus if cluster.is_free(gpu)) for host, gpus in placeable.items()
    }
    return View(hosts_up, placeable, host_free)


def preferences(demand: Demand) -> list[str | None]:
    """Models to try, one at a time in order of preference; [None] = all models at once."""
    return list(demand.models) if demand.models is not None else [None]


def free_by_model(
    cluster: Cluster, now: float, down_after_s: float
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """Free placeable GPUs and free slices, each as {model: {host: n}} (only non-zero)."""
    free: dict[str, dict[str, int]] = {}
    slots: dict[str, dict[str, int]] = {}
    view = current_view(cluster, sorted(cluster.nodes), now, down_after_s)
    for host in view.hosts:
        for gpu in view.placeable[host]:
            if cluster.is_free(gpu):
                per_host = free.setdefault(gpu.model, {})
                per_host[host] = per_host.get(host, 0) + 1
            if gpu.share_slots > 1 and cluster.free_slots(gpu) > 0:
                per_host = slots.setdefault(gpu.model, {})
                per_host[host] = per_host.get(host, 0) + cluster.free_slots(gpu)
    return (
        {m: dict(sorted(h.items())) for m, h in sorted(free.items())},
        {m: dict(sorted(h.items())) for m, h in sorted(slots.items())},
    )
