"""The environment a lease's container gets."""

from __future__ import annotations

from allocator.placement.cluster import Cluster
from allocator.placement.demand import Placement, placement_model
from allocator.wire import lease_container


def lease_env(placement: Placement, cluster: Cluster, lease_id: str) -> dict[str, str]:
    """Environment the lease's container gets (:func:`allocator.wire.lease_container.lease_env`)."""
    first = cluster.gpus.get(placement.gpu_uuids[0]) if placement.gpu_uuids else None
    return lease_container.lease_env(
        lease_id=lease_id, host=placement.host, gpu_uuids=placement.gpu_uuids,
        model=placement_model(placement, cluster), shared=placement.shared,
        memory_mib=placement.memory_mib,
        memory_total_mib=first.memory_total_mib if first is not None else None,
        numa_nodes=placement.numa_nodes,
    )
