"""Slice placement: one slot and a memory budget of a shareable GPU no exclusive lease holds,
packed onto GPUs already shared."""

from __future__ import annotations

from fractions import Fraction

from allocator.placement.cluster import GPU, Cluster
from allocator.placement.demand import Demand, Placement
from allocator.placement.matching import slice_budget, slice_fits_size, suits
from allocator.placement.placeable import View, preferences


def place_slice(demand: Demand, cluster: Cluster, view: View) -> Placement | None:
    for wanted in preferences(demand):
        best: tuple[tuple[bool, int, int, str, tuple[int, int]], GPU] | None = None
        for host in view.hosts:
            for gpu in view.placeable[host]:
                if wanted is not None and gpu.model != wanted:
                    continue
                if not (suits(demand, gpu) and slice_fits_size(demand, gpu)):
                    continue
                slots = cluster.free_slots(gpu)  # 0 under an exclusive claim
                if slots < 1 or cluster.free_memory_mib(gpu) < slice_budget(demand, gpu):
                    continue
                # Pack: GPUs already shared first, then the fewest free slots, so untouched
                # GPUs stay whole for exclusive leases.
                key = (cluster.is_free(gpu), slots, view.host_free[host], host, gpu.order)
                if best is None or key < best[0]:
                    best = (key, gpu)
        if best is not None:
            gpu = best[1]
            return Placement(
                host=best[0][3],
                gpu_uuids=(gpu.uuid,),
                shared=True,
                memory_mib=slice_budget(demand, gpu),
                units=Fraction(1, gpu.share_slots),
            )
    return None
