"""What a lease uses of its GPUs at one moment: pure, from the allocator's inventory reply.

The allocator measures a bound lease's own processes on its GPUs (from the node agent's
per-container accounting): ``Lease.utilization_pct`` (mean over its GPUs) and
``Lease.gpu_memory_used_mib`` (their sum). Where it has no such numbers (a lease not bound yet,
a node that cannot tell processes apart) the GPUs' own numbers stand in: their mean
utilization and summed memory — exact for exclusive GPUs; for a shared slice they include the
other slices' processes, so the page marks them as the whole GPU's. Memory is measured against
what the lease may use: its GPUs' memory, or a shared slice's budget.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from allocator.wire.protocol import GPUView, Lease


@dataclass(frozen=True)
class UsagePoint:
    """One sample of one lease: when, and how busy its GPUs were."""

    at: float
    """Epoch seconds (the allocator's clock, from the inventory reply)."""
    utilization_pct: float | None
    """Mean utilization of its GPUs, 0..100; None when no GPU of it reported one."""
    memory_used_mib: int | None
    """GPU memory in use on its GPUs; None when none reported."""
    memory_total_mib: int | None
    """The memory the lease may use: its GPUs' total, or a shared slice's budget."""

    @property
    def memory_pct(self) -> float | None:
        """Memory in use as a share of :attr:`memory_total_mib`, 0..100 (capped)."""
        if self.memory_used_mib is None or not self.memory_total_mib:
            return None
        return min(100.0, 100.0 * self.memory_used_mib / self.memory_total_mib)


def lease_usage(lease: Lease, gpus: Mapping[str, GPUView], at: float) -> UsagePoint | None:
    """The use of a lease's GPUs at ``at``, or None when it holds no GPU that is reported."""
    held = [gpus[uuid] for uuid in lease.gpu_uuids if uuid in gpus]
    if not held:
        return None
    memory_total = lease.memory_mib if lease.shared and lease.memory_mib else \
        sum(g.memory_total_mib for g in held)
    if lease.utilization_pct is not None or lease.gpu_memory_used_mib is not None:
        return UsagePoint(at, lease.utilization_pct, lease.gpu_memory_used_mib, memory_total)
    utilizations = [g.utilization_pct for g in held if g.utilization_pct is not None]
    return UsagePoint(
        at=at,
        utilization_pct=sum(utilizations) / len(utilizations) if utilizations else None,
        memory_used_mib=sum(g.memory_used_mib for g in held),
        memory_total_mib=memory_total,
    )


def gpus_by_uuid(gpus: Iterable[GPUView]) -> dict[str, GPUView]:
    """The inventory's GPUs by uuid."""
    return {gpu.uuid: gpu for gpu in gpus}
