"""Could a demand ever fit: ``unsatisfiable`` (or ``unknown_host``) when not even an idle
cluster would do."""

from __future__ import annotations

from collections.abc import Sequence

from allocator.placement.cluster import GPU, Cluster
from allocator.placement.demand import Demand, Refusal, models_text
from allocator.placement.gpu_sets import DEMANDED_LEVEL, GpuSet
from allocator.placement.links import choose, worst_or_none
from allocator.placement.matching import (
    big_enough,
    capability_text,
    capable,
    describe,
    of_model,
    slice_fits_size,
)
from allocator.wire import capacity
from allocator.wire.protocol import ErrorCode


def feasible(demand: Demand, cluster: Cluster) -> Refusal | None:
    """Whether the demand could ever fit: ``unsatisfiable`` if not even an idle cluster would do.

    Claims, health, drain and whether nodes are up are ignored (they change); only present
    GPUs count, with their model, memory and share slots.
    """
    if demand.host is not None and demand.host not in cluster.nodes:
        return Refusal(
            ErrorCode.UNKNOWN_HOST,
            f"No GPU node is called {demand.host!r}.",
            {"host": demand.host, "known": sorted(cluster.nodes)},
        )
    hosts = [demand.host] if demand.host is not None else sorted(cluster.nodes)
    where = f"on {demand.host}" if demand.host is not None else "in the cluster"
    # A GPU in MIG mode is no unit of its own: only its instances are.
    present = [gpu for host in hosts for gpu in cluster.gpus_of(host)
               if gpu.present and gpu.allocatable]
    if not present:
        return Refusal(
            ErrorCode.UNSATISFIABLE, f"No GPU has been reported {where}.", {"host": demand.host}
        )

    matching = [gpu for gpu in present if of_model(demand, gpu)]
    if not matching:
        there = sorted({gpu.model for gpu in present})
        assert demand.models is not None  # any-model demands match every present GPU
        return Refusal(
            ErrorCode.UNSATISFIABLE,
            f"There is no GPU of {models_text(demand.models)} {where}; "
            f"models there: {', '.join(there)}.",
            {"models": list(demand.models), "available": there},
        )

    if demand.min_compute_capability is not None or demand.architecture is not None:
        suited = [gpu for gpu in matching if capable(demand, gpu)]
        if not suited:
            there = sorted({f"{gpu.model} ({gpu.compute_capability or '?'}, "
                            f"{gpu.architecture or '?'})" for gpu in matching})
            of = f" of {models_text(demand.models)}" if demand.models else ""
            return Refusal(
                ErrorCode.UNSATISFIABLE,
                f"No GPU{of} {where} has {capability_text(demand)}; "
                f"there: {', '.join(there)}.",
                {"available": there},
            )
        matching = suited

    big = [gpu for gpu in matching if big_enough(demand, gpu)]
    if not big:
        largest = max(gpu.memory_total_mib for gpu in matching)
        of = f" of {models_text(demand.models)}" if demand.models else ""
        return Refusal(
            ErrorCode.UNSATISFIABLE,
            f"No GPU{of} {where} has at least {demand.min_memory_mib} MiB; "
            f"the largest has {largest} MiB.",
            {"min_memory_mib": demand.min_memory_mib, "largest_mib": largest},
        )

    if demand.shared:
        shareable = [gpu for gpu in big if gpu.share_slots > 1]
        if not shareable:
            return Refusal(
                ErrorCode.UNSATISFIABLE,
                f"No GPU {where} that matches can be shared: "
                f"{', '.join(sorted({g.model for g in big}))} are exclusive only there.",
                {"models": sorted({g.model for g in big})},
            )
        if not any(slice_fits_size(demand, gpu) for gpu in shareable):
            largest = max(gpu.memory_total_mib for gpu in shareable)
            return Refusal(
                ErrorCode.UNSATISFIABLE,
                f"A slice of {demand.share_memory_mib} MiB does not fit any shareable GPU "
                f"{where}; the largest has {largest} MiB.",
                {"memory_mib": demand.share_memory_mib, "largest_mib": largest},
            )
        return None

    if demand.count is None:
        # "all" needs only one matching GPU on some host (and a demanded level kept there).
        return links_feasible(demand, cluster, big, where)

    # One rule with the hub (allocator.wire.capacity): a count is GPUs of one model on one host.
    group = capacity.largest_group(capacity.gpu_groups(
        ((gpu.host, gpu.model) for gpu in big), any_model=demand.models is None))
    # big is not empty, and a count never mixes models
    assert group is not None and group.model is not None
    host, model, most = group.host, group.model, group.gpus
    if most >= demand.count:
        return links_feasible(demand, cluster, big, where)
    if demand.models is not None and len(demand.models) == 1:
        of, biggest = f"of model {demand.models[0]}", f"{most} ({host})"
    elif demand.models is not None:
        of = f"of one model among {', '.join(demand.models)}"
        biggest = f"{most} of {model} ({host})"
    else:
        of, biggest = "of one model", f"{most} of {model} ({host})"
    if demand.min_memory_mib is not None:
        of += f" with at least {demand.min_memory_mib} MiB"
    scope = f"Host {demand.host} does not have" if demand.host is not None else "No host has"
    return Refusal(
        ErrorCode.UNSATISFIABLE,
        f"{scope} {demand.count} GPUs {of}; the largest has {biggest}.",
        {"count": demand.count, "largest": {"host": host, "model": model, "count": most}},
    )


def links_feasible(demand: Demand, cluster: Cluster, big: Sequence[GPU],
                   where: str) -> Refusal | None:
    """``unsatisfiable`` when a demanded level could not be kept even on an idle cluster:
    no host with reported links has enough whole GPUs of one matching model joined at it.

    Links are in memory only, so just after a restart, until the agents report again, such a
    request is refused this way (the agents answer the ``hello`` within a heartbeat)."""
    if not demand.demands_links:
        return None
    assert demand.topology is not None
    by_host: dict[str, dict[str, list[str]]] = {}
    for gpu in big:
        if gpu.mig_parent_uuid is None:
            by_host.setdefault(gpu.host, {}).setdefault(gpu.model, []).append(gpu.uuid)
    reported = 0
    closest: str | None = None
    for host, models in sorted(by_host.items()):
        node = cluster.nodes.get(host)
        links = node.interconnect if node is not None else None
        if links is None:
            continue
        reported += 1
        for uuids in models.values():
            if demand.count is None:
                worst = worst_or_none(links, uuids)
                if worst is not None and worst <= DEMANDED_LEVEL[demand.topology]:
                    return None
                if worst is not None and closest is None:
                    closest = f"all {len(uuids)} GPUs of {host} are joined only by {worst.words}"
                elif worst is None:
                    return None  # one GPU: nothing to keep
                continue
            chosen = choose(links, uuids, demand.count, demand.topology)
            if isinstance(chosen, GpuSet):
                return None
            if chosen is not None and closest is None:
                closest = f"{host}: {chosen.reason}"
    level = DEMANDED_LEVEL[demand.topology]
    if not reported:
        why = (f"no host {where} has reported how its GPUs are joined (agents before 0.3.0 "
               f"do not), so none can promise GPUs joined by {level.words}")
    else:
        why = (f"no host {where} has GPUs joined by {level.words} for this request, even "
               f"idle" + (f" ({closest})" if closest else ""))
    return Refusal(
        ErrorCode.UNSATISFIABLE, f"{describe(demand)} cannot be granted: {why}.",
        {"topology": demand.topology, "hosts_with_links": reported})
