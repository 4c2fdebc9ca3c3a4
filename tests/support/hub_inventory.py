"""Inventory replies and leases as the allocator sends them, for the hub plugin's pure tests."""

from __future__ import annotations

import time
from collections import defaultdict

from allocator.wire.protocol import (
    GPUView,
    Health,
    InventoryReply,
    Lease,
    LeaseState,
    ModelSummary,
    NodeView,
)

GTX1070 = "NVIDIA GeForce GTX 1070"
RTX3090 = "NVIDIA GeForce RTX 3090"
A100 = "NVIDIA A100-SXM4-80GB"
MEMORY = {GTX1070: 8192, RTX3090: 24576, A100: 81920}
ALIASES = {GTX1070: ["1070", "gtx1070"], RTX3090: ["3090"], A100: ["a100"]}
SLOTS = {GTX1070: 4, RTX3090: 1, A100: 1}


def inventory(
    hosts: dict[str, list[tuple[str, bool]]] | None = None, *, queued: int = 0
) -> InventoryReply:
    """Hosts -> list of (model, busy).

    Default: gpu-a 2x1070 (one busy), gpu-b 4x3090, gpu-c 8xA100.
    """
    if hosts is None:
        hosts = {
            "gpu-a": [(GTX1070, False), (GTX1070, True)],
            "gpu-b": [(RTX3090, False)] * 4,
            "gpu-c": [(A100, False)] * 8,
        }
    gpus: list[GPUView] = []
    nodes: list[NodeView] = []
    for host, entries in hosts.items():
        nodes.append(NodeView(host=host, up=True, drained=False, last_heartbeat=time.time(),
                              gpus=len(entries)))
        for i, (model, busy) in enumerate(entries):
            slots = SLOTS.get(model, 1)
            gpus.append(GPUView(
                uuid=f"GPU-{host}-{i}", host=host, index=i, model=model,
                memory_total_mib=MEMORY.get(model, 16384), memory_used_mib=0,
                health=Health.HEALTHY, share_slots=slots, holders=["L1"] if busy else [],
                free_slots=0 if busy else slots,
                free_memory_mib=0 if busy else MEMORY.get(model, 16384),
            ))
    by_model: dict[str, list[GPUView]] = defaultdict(list)
    for gpu in gpus:
        by_model[gpu.model].append(gpu)
    models = []
    for model, views in sorted(by_model.items()):
        host_free: dict[str, int] = {}
        for v in views:
            host_free[v.host] = host_free.get(v.host, 0) + (0 if v.holders else 1)
        models.append(ModelSummary(
            model=model, aliases=ALIASES.get(model, []), memory_total_mib=views[0].memory_total_mib,
            total=len(views), free=sum(1 for v in views if not v.holders),
            share_slots=views[0].share_slots, free_slots=sum(v.free_slots for v in views),
            hosts=host_free,
        ))
    return InventoryReply(at=time.time(), nodes=nodes, gpus=gpus, models=models, queued=queued)


def lease(**overrides: object) -> Lease:
    """A granted lease of one GTX 1070 on gpu-a."""
    data: dict[str, object] = dict(
        lease_id="L-42", request_key="hub/alice/", user="alice", state=LeaseState.GRANTED,
        host="gpu-a", gpu_uuids=["GPU-aaaa"], gpu_indices=[0], model=GTX1070, shared=False,
        env={"SWARM_GPU_LEASE": "L-42"}, created_at=time.time(), granted_at=time.time(),
    )
    data.update(overrides)
    return Lease.model_validate(data)
