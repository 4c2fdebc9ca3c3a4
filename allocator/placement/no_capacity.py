"""Why nothing fits now: the ``no_capacity`` refusal, naming what is free instead."""

from __future__ import annotations

from typing import Any

from allocator.placement.cluster import GPU, Cluster
from allocator.placement.demand import Demand, Refusal
from allocator.placement.gpu_sets import DEMANDED_LEVEL, Unmet
from allocator.placement.links import choose, host_links
from allocator.placement.matching import describe, of_model, suits
from allocator.placement.placeable import current_view, free_by_model
from allocator.wire.protocol import ErrorCode


def _free_text(label: str, free: dict[str, dict[str, int]]) -> str:
    parts = [
        f"{model}: " + ", ".join(f"{n} on {host}" for host, n in hosts.items())
        for model, hosts in free.items()
    ]
    return f"{label}: " + "; ".join(parts) + "."


def no_capacity(demand: Demand, cluster: Cluster, now: float, down_after_s: float) -> Refusal:
    free, slots = free_by_model(cluster, now, down_after_s)
    sentences = [f"Nothing free fits {describe(demand)} right now."]
    details: dict[str, Any] = {"free": free}
    if demand.host is not None:
        node = cluster.nodes[demand.host]
        if node.drained:
            sentences.append(f"Host {demand.host} is drained by an admin.")
            details["host_drained"] = True
        elif not node.is_up(now, down_after_s):
            sentences.append(f"Host {demand.host} is not reporting (no recent heartbeat).")
            details["host_up"] = False
    if demand.shared:
        details["free_slots"] = slots
        if slots:
            sentences.append(_free_text("Free slices now", slots))
    if free:
        sentences.append(_free_text("Free GPUs now", free))
    elif not (demand.shared and slots):
        sentences.append("No GPU is free anywhere at the moment.")
    if demand.demands_links:
        sentences.append(_links_unmet_now(demand, cluster, now, down_after_s))
        details["topology"] = demand.topology
    return Refusal(ErrorCode.NO_CAPACITY, " ".join(sentences), details)


def _links_unmet_now(demand: Demand, cluster: Cluster, now: float, down_after_s: float) -> str:
    """Why a demanded level cannot be kept now, in one sentence: the first host (by name)
    with enough free GPUs of one matching model, and what :func:`choose_gpus` says of it."""
    assert demand.topology is not None
    hosts = [demand.host] if demand.host is not None else sorted(cluster.nodes)
    view = current_view(cluster, hosts, now, down_after_s)
    unreported = 0
    for host in view.hosts:
        by_model: dict[str, list[GPU]] = {}
        for gpu in view.placeable[host]:
            if of_model(demand, gpu) and suits(demand, gpu) and cluster.is_free(gpu):
                by_model.setdefault(gpu.model, []).append(gpu)
        for gpus in by_model.values():
            if demand.count is not None and len(gpus) < demand.count:
                continue
            links = host_links(cluster, host, gpus)
            if links is None:
                unreported += 1
                continue
            count = demand.count if demand.count is not None else len(gpus)
            chosen = choose(links, [g.uuid for g in gpus], count, demand.topology)
            if isinstance(chosen, Unmet):
                return f"On {host}, {chosen.reason}."
    level = DEMANDED_LEVEL[demand.topology].words
    if unreported:
        return (f"{unreported} host(s) with enough free GPUs have not reported how their GPUs "
                f"are joined, so they cannot promise {level}.")
    return f"No host has enough free GPUs joined by {level} now."


def nothing_fits_now() -> Refusal:
    """The refusal of a placement asked without an explanation
    (:func:`allocator.placement.policy.place`)."""
    return Refusal(ErrorCode.NO_CAPACITY, "Nothing free fits this request right now.")
