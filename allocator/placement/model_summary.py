"""What the form shows of each model: present, free GPUs and slices, hosts."""

from __future__ import annotations

from allocator.config import PolicySettings
from allocator.placement.cluster import GPU, Cluster
from allocator.placement.demand import model_names, share_slots_for
from allocator.placement.placeable import usable
from allocator.wire.protocol import ModelSummary, capability_tuple


def summarize_models(
    cluster: Cluster, settings: PolicySettings, now: float, down_after_s: float
) -> list[ModelSummary]:
    """Per canonical model with at least one present GPU, sorted by name: what the form shows.

    ``free`` counts placeable GPUs on up, undrained nodes with no claim; ``free_slots`` sums
    the free slots of those placeable GPUs; ``hosts`` gives every host with a present GPU of
    the model and its free GPUs (0 included, so the form can show it).
    """
    index = model_names(cluster, settings.aliases)
    present: dict[str, list[tuple[str, GPU]]] = {}
    for host in sorted(cluster.nodes):
        for gpu in cluster.gpus_of(host):
            if gpu.present and gpu.allocatable:
                present.setdefault(gpu.model, []).append((host, gpu))
    summaries = []
    for model in sorted(present):
        gpus = present[model]
        free = 0
        free_slots = 0
        hosts: dict[str, int] = {}
        for host, gpu in gpus:
            hosts.setdefault(host, 0)
            if not (gpu.placeable and usable(cluster, host, now, down_after_s)):
                continue
            free_slots += cluster.free_slots(gpu)
            if cluster.is_free(gpu):
                free += 1
                hosts[host] += 1
        capabilities = sorted(
            (gpu.compute_capability for _, gpu in gpus if gpu.compute_capability is not None),
            key=capability_tuple)
        parent = cluster.gpus.get(gpus[0][1].mig_parent_uuid or "")
        summaries.append(
            ModelSummary(
                model=model,
                compute_capability=capabilities[0] if capabilities else None,
                architecture=gpus[0][1].architecture,
                mig_profile=gpus[0][1].mig_profile,
                mig_parent_model=None if parent is None else parent.model,
                aliases=index.aliases.get(model, []),
                memory_total_mib=max(gpu.memory_total_mib for _, gpu in gpus),
                total=len(gpus),
                free=free,
                share_slots=share_slots_for(model, settings),
                free_slots=free_slots,
                hosts=hosts,
            )
        )
    return summaries
