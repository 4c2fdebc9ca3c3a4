"""A lease's claims on its GPUs: the only changes placement makes to a cluster."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction

from allocator.placement.cluster import Claim, Cluster
from allocator.placement.demand import Demand, Placement


def apply_placement(cluster: Cluster, placement: Placement, lease_id: str, demand: Demand) -> None:
    """Record the lease's claims on its GPUs: with :func:`claim_gpus`, the only changes here."""
    claim_gpus(cluster, lease_id, demand.user, demand.groups, placement.gpu_uuids,
               shared=placement.shared, memory_mib=placement.memory_mib, units=placement.units)


def claim_gpus(cluster: Cluster, lease_id: str, user: str | None, groups: tuple[str, ...],
               gpu_uuids: Sequence[str], *, shared: bool, memory_mib: int | None,
               units: Fraction) -> None:
    """Record one lease's claims on its GPUs (a new grant, or a lease loaded from the ledger).
    ``user`` None and no ``groups``: the claims count against no quota.

    An exclusive claim promises each GPU's whole memory and counts 1; a slice its budget and
    ``units`` (1/slots). ``units`` is the lease's total, split evenly over its GPUs.
    """
    per_gpu = units / len(gpu_uuids) if gpu_uuids else units
    for uuid in gpu_uuids:
        gpu = cluster.gpus.get(uuid)
        whole = gpu.memory_total_mib if gpu is not None else 0
        memory = (memory_mib or 0) if shared else whole
        cluster.add_claim(uuid, Claim(
            lease_id=lease_id, user=user, groups=groups, exclusive=not shared,
            memory_mib=memory, units=per_gpu,
        ))
