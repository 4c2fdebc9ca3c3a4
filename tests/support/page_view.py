"""An inventory for what one viewer of the GPU page sees: a cluster built to order at a fixed
time."""

from __future__ import annotations

from allocator.wire.protocol import InventoryReply, Lease
from hubplugin.page.view import Window
from tests.support.hub_inventory import GTX1070, RTX3090, inventory

NOW = 1_800_000_000.0


WINDOW = Window(span_s=3 * 3600, gap_s=75)


def cluster_with(leases: list[Lease]) -> InventoryReply:
    """gpu-a: two GTX 1070, gpu-b: four RTX 3090; the leases hold what they name."""
    reply = inventory({"gpu-a": [(GTX1070, False)] * 2, "gpu-b": [(RTX3090, False)] * 4})
    holders: dict[str, list[str]] = {}
    for held in leases:
        for uuid in held.gpu_uuids:
            holders.setdefault(uuid, []).append(held.lease_id)
    gpus = [gpu.model_copy(update={
        "holders": holders.get(gpu.uuid, []),
        "utilization_pct": 64.0 if gpu.uuid in holders else 0.0,
        "memory_used_mib": 2048 if gpu.uuid in holders else 0,
    }) for gpu in reply.gpus]
    return reply.model_copy(update={"gpus": gpus, "leases": leases, "at": NOW})
