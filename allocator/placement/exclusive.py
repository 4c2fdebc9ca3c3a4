"""Exclusive placement: ``count`` whole GPUs of one model on one host, or every matching GPU of
one host ("all"), best fit and by links where the host reported them."""

from __future__ import annotations

from fractions import Fraction

from allocator.placement.cluster import GPU, Cluster
from allocator.placement.demand import Demand, Placement
from allocator.placement.gpu_sets import GpuSet, Unmet, numa_nodes, visible_order
from allocator.placement.links import best_linked, choose, host_links, keeps_level
from allocator.placement.matching import suits
from allocator.placement.placeable import View, preferences


def place_exclusive(demand: Demand, count: int, cluster: Cluster, view: View) -> Placement | None:
    """Best fit; by links where the host reported them (the rules in
    :mod:`allocator.placement.policy`)."""
    by_links = count > 1 or demand.demands_links
    for wanted in preferences(demand):
        best: tuple[tuple[int, str, int, str], list[GPU]] | None = None
        fitting: list[tuple[tuple[int, str, int, str], list[GPU]]] = []
        for host in view.hosts:
            if demand.demands_links and cluster.nodes[host].interconnect is None:
                continue  # a host that did not report its links cannot promise a level
            by_model: dict[str, list[GPU]] = {}
            for gpu in view.placeable[host]:
                if (
                    (wanted is None or gpu.model == wanted)
                    and suits(demand, gpu)
                    and cluster.is_free(gpu)
                ):
                    by_model.setdefault(gpu.model, []).append(gpu)
            for model, gpus in by_model.items():
                if len(gpus) < count:
                    continue
                # Fewest free GPUs on the host first; with any model allowed, also prefer the
                # model with the fewest free GPUs there, so larger groups stay whole.
                key = (view.host_free[host], host, len(gpus), model)
                if by_links:
                    fitting.append((key, gpus))
                elif best is None or key < best[0]:
                    best = (key, gpus)
        chosen: GpuSet | None = None
        if by_links:
            linked = best_linked(demand, count, cluster, fitting)
            best, chosen = linked if linked is not None else (None, None)
        if best is not None:
            return _exclusive_placement(demand, count, cluster, best[0][1], best[1], chosen)
    return None


def _exclusive_placement(demand: Demand, count: int, cluster: Cluster, host: str,
                         gpus: list[GPU], chosen: GpuSet | Unmet | None = None) -> Placement:
    """``count`` of the host's fitting ``gpus``: by links where it reported them (``chosen``:
    the set :func:`best_linked` already chose there), else the lowest indices."""
    links = host_links(cluster, host, gpus) if chosen is None else None
    if links is not None:
        chosen = choose(links, [g.uuid for g in gpus], count,
                        demand.topology if demand.demands_links else None)
    if isinstance(chosen, GpuSet):
        uuids, numa = chosen.gpus, chosen.numa_nodes
    else:
        # No links (or, by best_linked's check, never an Unmet for a demanded level).
        uuids, numa = tuple(gpu.uuid for gpu in gpus[:count]), ()
    return Placement(host=host, gpu_uuids=uuids, shared=False, memory_mib=None,
                     units=Fraction(count), numa_nodes=numa)


def place_whole_host(demand: Demand, cluster: Cluster, view: View) -> Placement | None:
    for wanted in preferences(demand):
        best: tuple[tuple[int, str], list[GPU]] | None = None
        for host in view.hosts:
            gpus = [
                gpu
                for gpu in cluster.gpus_of(host)
                if gpu.present
                and gpu.allocatable
                and (wanted is None or gpu.model == wanted)
                and suits(demand, gpu)
            ]
            # Every matching GPU must be free and placeable: "all" means all of them, and a
            # lease that silently got fewer would be a surprise.
            if not gpus or not all(gpu.placeable and cluster.is_free(gpu) for gpu in gpus):
                continue
            if demand.demands_links and not keeps_level(demand, cluster, host, gpus):
                continue
            key = (view.host_free[host], host)
            if best is None or key < best[0]:
                best = (key, sorted(gpus, key=lambda g: g.order))
        if best is not None:
            host, gpus = best[0][1], best[1]
            uuids = tuple(gpu.uuid for gpu in gpus)
            numa: tuple[int, ...] = ()
            links = host_links(cluster, host, gpus)
            if links is not None:
                uuids, numa = visible_order(links, uuids), numa_nodes(links, uuids)
            return Placement(host=host, gpu_uuids=uuids, shared=False, memory_mib=None,
                             units=Fraction(len(gpus)), numa_nodes=numa)
    return None
