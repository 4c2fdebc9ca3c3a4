"""The placement policy: pure functions over a :class:`~allocator.placement.cluster.Cluster`.

Nothing here does I/O or reads the clock (``now`` is passed in), so every rule can be tested
directly. The allocator calls, in order: :func:`make_demand` (validate and resolve the
request), :func:`feasible` (could it ever fit?), :func:`place` (where does it fit now?),
:func:`check_quota` (may this user take it?), :func:`apply_placement` (record the claims)
and :func:`lease_env` (what the container gets).

Rules, as in ``docs/design.md``:

* All GPUs of one lease are on one host, which is up and not drained; unhealthy, drained
  and no-longer-present GPUs never fit.
* A GPU in MIG mode is never a unit: its MIG instances are, each under NVML's name for it
  (``NVIDIA A100-SXM4-40GB MIG 1g.5gb``) as its model, so ``count=n`` of a profile is *n*
  instances of one host.
* ``min_compute_capability`` and ``architecture`` keep only GPUs the agent reported with at
  least that capability and that architecture (an instance has its parent's).
* Exclusive ``count=n``: *n* free GPUs of one model. ``count=None`` ("all"): every present
  GPU of the host that matches the request must be free and placeable (at least one); such a
  lease mixes models only when no model was asked for. How many GPUs one host can give one
  request is :mod:`allocator.wire.capacity`'s rule, the hub's too.
* Model names a person typed are matched by :mod:`allocator.wire.model_names`, the rule the hub
  uses too. Acceptable models are tried in order of preference: the first that fits anywhere
  wins.
* Best fit: the host with the fewest free placeable GPUs, so whole hosts stay free for "all"
  requests; ties by host name, then the lowest GPU indices.
* Links (:mod:`allocator.placement.gpu_sets`), on a host whose agent reported how its GPUs are
  joined (``Node.interconnect``; a host that did not is placed exactly as before): an exclusive
  request takes the best-connected free GPUs of the host (one GPU: the one whose taking
  leaves the best sets whole), and its container sees them best-connected adjacent. For
  ``count > 1`` the host is chosen among the first :data:`TOPOLOGY_LOOKAHEAD` fitting hosts
  in best-fit order: first those where the grant leaves the host's free all-NVLink set of
  4 GPUs whole (or that had none), then the one whose best set has the best worst link (a
  host without reported links counts as joined across sockets), ties in best-fit order. A
  demanded level (``topology``) is never broken: only hosts with reported links whose free
  GPUs keep it fit, and one GPU always keeps it (it has no link). Whole-host requests keep
  their GPUs and get the container's order; slices and MIG instances are not placed by links.
* A shared slice takes one slot and a memory budget of one GPU whose model has more than one
  slot and which no exclusive lease holds; slices are packed onto GPUs already shared.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from allocator.config import PolicySettings
from allocator.placement.cluster import GPU, Claim, Cluster
from allocator.placement.gpu_sets import (
    DEMANDED_LEVEL,
    GpuSet,
    TopologyDemand,
    Unmet,
    best_set_cost,
    choose_gpus,
    lists_all,
    numa_nodes,
    visible_order,
    worst_link,
)
from allocator.wire import capacity, lease_container
from allocator.wire.interconnect import HostInterconnect, LinkLevel
from allocator.wire.model_names import ModelNameError, ModelNames
from allocator.wire.protocol import AllocateRequest, ErrorCode, ModelSummary, capability_tuple

TOPOLOGY_LOOKAHEAD = 4
"""Fitting hosts, in best-fit order, a request for several GPUs compares by their best set's
worst link. Few, so that a grant looks at a handful of hosts, and the placement index
(:mod:`allocator.placement.index`) hands the policy as many candidates per model."""

# Quotas are floats in the settings; a quota of "one slice of three" is written 0.333...,
# which must compare equal to 1/3. Slots are at most 64, so a bounded denominator is exact
# for every sensible quota.
_QUOTA_DENOMINATOR = 1_000_000


# --------------------------------------------------------------------------- data


@dataclass(frozen=True)
class Demand:
    """A validated request with its models resolved to canonical names."""

    user: str
    groups: tuple[str, ...]
    models: tuple[str, ...] | None
    """Canonical model names in order of preference; None = any model."""
    min_memory_mib: int | None
    count: int | None
    """GPUs wanted; None = every matching GPU of one host. Always 1 for a shared slice."""
    host: str | None
    shared: bool
    share_memory_mib: int | None
    """Budget of a slice; None = the GPU's memory divided by its share slots."""
    min_compute_capability: tuple[int, int] | None = None
    """Only GPUs of at least this CUDA compute capability (major, minor)."""
    architecture: str | None = None
    """Only GPUs of this architecture (lower case)."""
    topology: TopologyDemand | None = None
    """Every pair of the GPUs joined at this level or better
    (:mod:`allocator.placement.gpu_sets`)."""

    @property
    def demands_links(self) -> bool:
        """Whether a demanded level restricts the choice: several GPUs (or "all") and a
        ``topology``; one GPU has no link to keep."""
        return self.topology is not None and self.count != 1 and not self.shared


@dataclass(frozen=True)
class Refusal:
    """Why a request cannot be done, for programs (``code``, ``details``) and people."""

    code: ErrorCode
    message: str
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Placement:
    """Where a demand goes: GPUs of one host."""

    host: str
    gpu_uuids: tuple[str, ...]
    """In the order the container sees them: best-connected adjacent on a host that reported
    its links (:func:`allocator.placement.gpu_sets.visible_order`), else by GPU index."""
    shared: bool
    memory_mib: int | None
    """The slice budget of a shared placement, else None."""
    units: Fraction
    """Quota units: the GPU count for exclusive leases, 1/share_slots for a slice."""
    numa_nodes: tuple[int, ...] = ()
    """The GPUs' NUMA nodes, sorted, where the host reported them (``SWARM_GPU_NUMA_NODES``)."""


# --------------------------------------------------------------------------- models


def canonical_models(cluster: Cluster, aliases: Mapping[str, str]) -> dict[str, str]:
    """Every accepted spelling (lowercase) of every known model -> its canonical NVML name.

    Known models are those of the cluster's GPUs (present or not) and the targets of the
    configured aliases; the spellings are :mod:`allocator.wire.model_names`' rule. Callers with
    user input should use :func:`resolve_models`, which also normalises spaces.
    """
    return dict(model_names(cluster, aliases).spellings)


def model_names(cluster: Cluster, aliases: Mapping[str, str]) -> ModelNames:
    """The names of the cluster's models (present or not) and of the configured aliases."""
    return ModelNames.build((gpu.model for gpu in cluster.gpus.values()), aliases)


def resolve_models(
    requested: Sequence[str] | None, cluster: Cluster, aliases: Mapping[str, str]
) -> tuple[str, ...] | Refusal | None:
    """Resolve requested names or aliases to canonical models, keeping the order of preference.

    None means any model and stays None. Duplicates are dropped. Unknown or ambiguous names
    give ``unknown_model`` with the known models (and their aliases) in the message.
    """
    if requested is None:
        return None
    resolved = model_names(cluster, aliases).resolve(requested)
    if isinstance(resolved, ModelNameError):
        return Refusal(resolved.code, resolved.message, resolved.details)
    return resolved


def share_slots_for(model: str, settings: PolicySettings) -> int:
    """Share slots a GPU of this canonical model has (1 = exclusive only)."""
    return max(int(settings.share_slots.get(model, settings.default_share_slots)), 1)


# --------------------------------------------------------------------------- demand


def _models_text(models: Sequence[str]) -> str:
    return " or ".join(models)


def make_demand(
    request: AllocateRequest, cluster: Cluster, settings: PolicySettings
) -> Demand | Refusal:
    """Validate a request against the cluster and settings and resolve its models.

    Refuses unknown models (``unknown_model``), unknown hosts (``unknown_host``), slices of
    models configured exclusive-only (``not_shareable``), an empty slice budget
    (``bad_request``) and a slice budget larger than every shareable GPU (``unsatisfiable``).
    For a slice, models that cannot be shared are dropped from the list of preferences.
    """
    models = resolve_models(request.acceptable_models, cluster, settings.aliases)
    if isinstance(models, Refusal):
        return models

    if request.host is not None and request.host not in cluster.nodes:
        hosts = ", ".join(sorted(cluster.nodes)) or "none yet"
        return Refusal(
            ErrorCode.UNKNOWN_HOST,
            f"No GPU node is called {request.host!r}. Known hosts: {hosts}.",
            {"host": request.host, "known": sorted(cluster.nodes)},
        )

    count = None if request.count == "all" else int(request.count)
    share_memory: int | None = None
    if request.share is not None:
        count = 1
        known = sorted({gpu.model for gpu in cluster.gpus.values()} | set(models or ()))
        shareable = [m for m in known if share_slots_for(m, settings) > 1]
        if models is not None:
            wanted = tuple(m for m in models if share_slots_for(m, settings) > 1)
            if not wanted:
                return Refusal(
                    ErrorCode.NOT_SHAREABLE,
                    f"{_models_text(models)} cannot be shared (exclusive only). "
                    + (
                        f"Shareable models: {', '.join(shareable)}."
                        if shareable
                        else "No model in the cluster is configured for sharing."
                    ),
                    {"models": list(models), "shareable": shareable},
                )
            models = wanted
        elif not shareable:
            return Refusal(
                ErrorCode.NOT_SHAREABLE,
                "No GPU model in the cluster is configured for sharing; ask for a whole GPU.",
                {"shareable": []},
            )
        share_memory = request.share.memory_mib
        if share_memory is not None:
            if share_memory < 1:
                return Refusal(
                    ErrorCode.BAD_REQUEST,
                    "A shared slice needs a memory budget of at least 1 MiB; "
                    "leave it out for an equal share of the GPU.",
                    {"memory_mib": share_memory},
                )
            candidates = models if models is not None else tuple(shareable)
            sizes = [g.memory_total_mib for g in cluster.gpus.values() if g.model in candidates]
            if sizes and share_memory > max(sizes):
                return Refusal(
                    ErrorCode.UNSATISFIABLE,
                    f"A slice of {share_memory} MiB is larger than any shareable GPU; "
                    f"the largest has {max(sizes)} MiB.",
                    {"memory_mib": share_memory, "largest_mib": max(sizes)},
                )

    return Demand(
        user=request.user,
        groups=tuple(request.groups),
        models=models,
        min_memory_mib=request.min_memory_mib,
        count=count,
        host=request.host,
        shared=request.share is not None,
        share_memory_mib=share_memory,
        min_compute_capability=(None if request.min_compute_capability is None
                                else capability_tuple(request.min_compute_capability)),
        architecture=request.architecture,
        topology=request.topology,
    )


def _slice_budget(demand: Demand, gpu: GPU) -> int:
    if demand.share_memory_mib is not None:
        return demand.share_memory_mib
    return gpu.memory_total_mib // max(gpu.share_slots, 1)


def _big_enough(demand: Demand, gpu: GPU) -> bool:
    return demand.min_memory_mib is None or gpu.memory_total_mib >= demand.min_memory_mib


def capable(demand: Demand, gpu: GPU) -> bool:
    """Whether the GPU has the compute capability and architecture the demand asks for.

    A GPU whose agent did not report them does not match a demand that names them.
    """
    if demand.min_compute_capability is not None and (
        gpu.compute_capability is None
        or capability_tuple(gpu.compute_capability) < demand.min_compute_capability
    ):
        return False
    return demand.architecture is None or gpu.architecture == demand.architecture


def _suits(demand: Demand, gpu: GPU) -> bool:
    """Memory, compute capability and architecture: everything but the model."""
    return _big_enough(demand, gpu) and capable(demand, gpu)


def _capability_text(demand: Demand) -> str:
    parts = []
    if demand.min_compute_capability is not None:
        major, minor = demand.min_compute_capability
        parts.append(f"compute capability {major}.{minor} or higher")
    if demand.architecture is not None:
        parts.append(f"architecture {demand.architecture}")
    return " and ".join(parts)


def _of_model(demand: Demand, gpu: GPU) -> bool:
    return demand.models is None or gpu.model in demand.models


def _slice_fits_size(demand: Demand, gpu: GPU) -> bool:
    """Whether a slice of this demand could ever fit this GPU (ignoring other claims)."""
    budget = _slice_budget(demand, gpu)
    return gpu.share_slots > 1 and 1 <= budget <= gpu.memory_total_mib


def _describe(demand: Demand) -> str:
    """The demand in words: "2 GPUs of NVIDIA A100 with at least 40000 MiB on gpu-a"."""
    models = _models_text(demand.models) if demand.models else None
    if demand.shared:
        size = f"{demand.share_memory_mib} MiB " if demand.share_memory_mib is not None else ""
        text = f"a {size}shared slice" + (f" of {models}" if models else "")
    elif demand.count is None:
        text = "all GPUs of one host" + (f" of model {models}" if models else "")
    else:
        plural = "s" if demand.count != 1 else ""
        text = f"{demand.count} GPU{plural}"
        if models:
            text += f" of {models}"
        elif demand.count > 1:
            text += " of one model"
    if demand.min_memory_mib is not None:
        text += f" with at least {demand.min_memory_mib} MiB"
    if demand.min_compute_capability is not None or demand.architecture is not None:
        text += f" of {_capability_text(demand)}"
    if demand.demands_links:
        assert demand.topology is not None
        text += f" all joined by {DEMANDED_LEVEL[demand.topology].words}"
    if demand.host is not None:
        text += f" on {demand.host}"
    return text


# --------------------------------------------------------------------------- feasibility


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

    matching = [gpu for gpu in present if _of_model(demand, gpu)]
    if not matching:
        there = sorted({gpu.model for gpu in present})
        assert demand.models is not None  # any-model demands match every present GPU
        return Refusal(
            ErrorCode.UNSATISFIABLE,
            f"There is no GPU of {_models_text(demand.models)} {where}; "
            f"models there: {', '.join(there)}.",
            {"models": list(demand.models), "available": there},
        )

    if demand.min_compute_capability is not None or demand.architecture is not None:
        suited = [gpu for gpu in matching if capable(demand, gpu)]
        if not suited:
            there = sorted({f"{gpu.model} ({gpu.compute_capability or '?'}, "
                            f"{gpu.architecture or '?'})" for gpu in matching})
            of = f" of {_models_text(demand.models)}" if demand.models else ""
            return Refusal(
                ErrorCode.UNSATISFIABLE,
                f"No GPU{of} {where} has {_capability_text(demand)}; "
                f"there: {', '.join(there)}.",
                {"available": there},
            )
        matching = suited

    big = [gpu for gpu in matching if _big_enough(demand, gpu)]
    if not big:
        largest = max(gpu.memory_total_mib for gpu in matching)
        of = f" of {_models_text(demand.models)}" if demand.models else ""
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
        if not any(_slice_fits_size(demand, gpu) for gpu in shareable):
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
        return _links_feasible(demand, cluster, big, where)

    # One rule with the hub (allocator.wire.capacity): a count is GPUs of one model on one host.
    group = capacity.largest_group(capacity.gpu_groups(
        ((gpu.host, gpu.model) for gpu in big), any_model=demand.models is None))
    # big is not empty, and a count never mixes models
    assert group is not None and group.model is not None
    host, model, most = group.host, group.model, group.gpus
    if most >= demand.count:
        return _links_feasible(demand, cluster, big, where)
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


def _links_feasible(demand: Demand, cluster: Cluster, big: Sequence[GPU],
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
                worst = _worst_or_none(links, uuids)
                if worst is not None and worst <= DEMANDED_LEVEL[demand.topology]:
                    return None
                if worst is not None and closest is None:
                    closest = f"all {len(uuids)} GPUs of {host} are joined only by {worst.words}"
                elif worst is None:
                    return None  # one GPU: nothing to keep
                continue
            chosen = _choose(links, uuids, demand.count, demand.topology)
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
        ErrorCode.UNSATISFIABLE, f"{_describe(demand)} cannot be granted: {why}.",
        {"topology": demand.topology, "hosts_with_links": reported})


def _worst_or_none(links: HostInterconnect, uuids: Sequence[str]) -> LinkLevel | None:
    try:
        return worst_link(links, uuids)
    except ValueError:  # a GPU the report of links does not list: nothing to promise
        return LinkLevel.SYSTEM


def _choose(links: HostInterconnect, uuids: Sequence[str], count: int,
            demand: TopologyDemand | None) -> GpuSet | Unmet | None:
    """:func:`choose_gpus`, None where the links do not list every one of the GPUs (a host
    that changed its GPUs since it reported them)."""
    try:
        return choose_gpus(links, uuids, count, demand)
    except ValueError:
        return None


# --------------------------------------------------------------------------- placement


@dataclass
class _View:
    """What is placeable right now, computed once per call."""

    hosts: list[str]
    """Candidate hosts that are up and not drained, sorted."""
    placeable: dict[str, list[GPU]]
    """Host -> its placeable GPUs, by index."""
    host_free: dict[str, int]
    """Host -> placeable GPUs with no claim at all."""


def _usable(cluster: Cluster, host: str, now: float, down_after_s: float) -> bool:
    node = cluster.nodes.get(host)
    return node is not None and node.is_up(now, down_after_s) and not node.drained


def _view(cluster: Cluster, hosts: Sequence[str], now: float, down_after_s: float) -> _View:
    usable = sorted(h for h in hosts if _usable(cluster, h, now, down_after_s))
    placeable = {
        host: sorted((gpu for gpu in cluster.gpus_of(host) if gpu.placeable),
                     key=lambda g: g.order)
        for host in usable
    }
    host_free = {
        host: sum(1 for gpu in gpus if cluster.is_free(gpu)) for host, gpus in placeable.items()
    }
    return _View(usable, placeable, host_free)


def _preferences(demand: Demand) -> list[str | None]:
    """Models to try, one at a time in order of preference; [None] = all models at once."""
    return list(demand.models) if demand.models is not None else [None]


def _host_links(cluster: Cluster, host: str, gpus: Sequence[GPU]) -> HostInterconnect | None:
    """The host's reported links, where they list every one of these GPUs (whole GPUs only:
    a MIG instance is not placed by links)."""
    node = cluster.nodes.get(host)
    links = node.interconnect if node is not None else None
    if links is None or any(g.mig_parent_uuid is not None for g in gpus):
        return None
    return links if lists_all(links, (g.uuid for g in gpus)) else None


def _exclusive(demand: Demand, count: int, cluster: Cluster, view: _View) -> Placement | None:
    """Best fit; by links where the host reported them (see the module's docstring)."""
    by_links = count > 1 or demand.demands_links
    for wanted in _preferences(demand):
        best: tuple[tuple[int, str, int, str], list[GPU]] | None = None
        fitting: list[tuple[tuple[int, str, int, str], list[GPU]]] = []
        for host in view.hosts:
            if demand.demands_links and cluster.nodes[host].interconnect is None:
                continue  # a host that did not report its links cannot promise a level
            by_model: dict[str, list[GPU]] = {}
            for gpu in view.placeable[host]:
                if (
                    (wanted is None or gpu.model == wanted)
                    and _suits(demand, gpu)
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
            linked = _best_linked(demand, count, cluster, fitting)
            best, chosen = linked if linked is not None else (None, None)
        if best is not None:
            return _exclusive_placement(demand, count, cluster, best[0][1], best[1], chosen)
    return None


def _best_linked(demand: Demand, count: int, cluster: Cluster,
                 fitting: list[tuple[tuple[int, str, int, str], list[GPU]]]
                 ) -> tuple[tuple[tuple[int, str, int, str], list[GPU]], GpuSet | None] | None:
    """Among the first :data:`TOPOLOGY_LOOKAHEAD` fitting candidates in best-fit order (with a
    demanded level: those that keep it): first those where the grant leaves the host's free
    NVLink set of :data:`PROTECTED_NVLINK_SET` GPUs whole (or the host had none), then the
    one whose best set has the best worst link; a host without reported links counts as
    :attr:`LinkLevel.SYSTEM` and breaks no set. Ties: best fit.

    Why the first rule: ranked by the link alone, a pair goes to the first host offering
    NVLink, which is often the only kind of host with an NVLink 4-set (an HGX board), and the
    next 4-GPU NVLink request finds none (``bench/fragmentation.py``)."""
    fitting.sort(key=lambda candidate: candidate[0])
    ranked: list[tuple[bool, int, int]] = []
    chosen_at: dict[int, GpuSet] = {}
    """Position -> the set chosen there, kept so that the placement does not choose again."""
    for position, (key, gpus) in enumerate(fitting[:TOPOLOGY_LOOKAHEAD]):
        links = _host_links(cluster, key[1], gpus)
        demand_here = demand.topology if demand.demands_links else None
        if links is None:
            if demand_here is not None:
                continue  # MIG instances, or GPUs the report of links does not list
            ranked.append((False, int(LinkLevel.SYSTEM), position))
            continue
        free = [g.uuid for g in gpus]
        chosen = _choose(links, free, count, demand_here)
        if not isinstance(chosen, GpuSet):
            continue  # the demanded level cannot be kept here now
        chosen_at[position] = chosen
        ranked.append((_breaks_nvlink_set(links, free, chosen.gpus),
                       int(chosen.worst_level if chosen.worst_level is not None
                           else LinkLevel.NVLINK), position))
    if not ranked:
        return None
    position = min(ranked)[2]
    return fitting[position], chosen_at.get(position)


PROTECTED_NVLINK_SET = 4
"""The size of the all-NVLink set that host choice avoids breaking (the largest that
:data:`allocator.placement.gpu_sets.PROTECTED_SIZES` protects within a host)."""


def _breaks_nvlink_set(links: HostInterconnect, free: Sequence[str],
                       taken: Sequence[str]) -> bool:
    """Whether taking ``taken`` of the host's ``free`` GPUs leaves no all-NVLink set of
    :data:`PROTECTED_NVLINK_SET` where there was one."""
    before = best_set_cost(links, free, PROTECTED_NVLINK_SET)
    if before is None or before.worst != LinkLevel.NVLINK:
        return False
    taken_set = set(taken)
    left = [uuid for uuid in free if uuid not in taken_set]
    after = best_set_cost(links, left, PROTECTED_NVLINK_SET)
    return after is None or after.worst != LinkLevel.NVLINK


def _exclusive_placement(demand: Demand, count: int, cluster: Cluster, host: str,
                         gpus: list[GPU], chosen: GpuSet | Unmet | None = None) -> Placement:
    """``count`` of the host's fitting ``gpus``: by links where it reported them (``chosen``:
    the set :func:`_best_linked` already chose there), else the lowest indices."""
    links = _host_links(cluster, host, gpus) if chosen is None else None
    if links is not None:
        chosen = _choose(links, [g.uuid for g in gpus], count,
                         demand.topology if demand.demands_links else None)
    if isinstance(chosen, GpuSet):
        uuids, numa = chosen.gpus, chosen.numa_nodes
    else:
        # No links (or, by _best_linked's check, never an Unmet for a demanded level).
        uuids, numa = tuple(gpu.uuid for gpu in gpus[:count]), ()
    return Placement(host=host, gpu_uuids=uuids, shared=False, memory_mib=None,
                     units=Fraction(count), numa_nodes=numa)


def _whole_host(demand: Demand, cluster: Cluster, view: _View) -> Placement | None:
    for wanted in _preferences(demand):
        best: tuple[tuple[int, str], list[GPU]] | None = None
        for host in view.hosts:
            gpus = [
                gpu
                for gpu in cluster.gpus_of(host)
                if gpu.present
                and gpu.allocatable
                and (wanted is None or gpu.model == wanted)
                and _suits(demand, gpu)
            ]
            # Every matching GPU must be free and placeable: "all" means all of them, and a
            # lease that silently got fewer would be a surprise.
            if not gpus or not all(gpu.placeable and cluster.is_free(gpu) for gpu in gpus):
                continue
            if demand.demands_links and not _keeps_level(demand, cluster, host, gpus):
                continue
            key = (view.host_free[host], host)
            if best is None or key < best[0]:
                best = (key, sorted(gpus, key=lambda g: g.order))
        if best is not None:
            host, gpus = best[0][1], best[1]
            uuids = tuple(gpu.uuid for gpu in gpus)
            numa: tuple[int, ...] = ()
            links = _host_links(cluster, host, gpus)
            if links is not None:
                uuids, numa = visible_order(links, uuids), numa_nodes(links, uuids)
            return Placement(host=host, gpu_uuids=uuids, shared=False, memory_mib=None,
                             units=Fraction(len(gpus)), numa_nodes=numa)
    return None


def _keeps_level(demand: Demand, cluster: Cluster, host: str, gpus: Sequence[GPU]) -> bool:
    """Whether these GPUs of the host are all joined at the demanded level (one GPU is)."""
    assert demand.topology is not None
    if len(gpus) == 1:
        return True
    links = _host_links(cluster, host, gpus)
    if links is None:
        return False
    worst = worst_link(links, [g.uuid for g in gpus])
    return worst is None or worst <= DEMANDED_LEVEL[demand.topology]


def _slice(demand: Demand, cluster: Cluster, view: _View) -> Placement | None:
    for wanted in _preferences(demand):
        best: tuple[tuple[bool, int, int, str, tuple[int, int]], GPU] | None = None
        for host in view.hosts:
            for gpu in view.placeable[host]:
                if wanted is not None and gpu.model != wanted:
                    continue
                if not (_suits(demand, gpu) and _slice_fits_size(demand, gpu)):
                    continue
                slots = cluster.free_slots(gpu)  # 0 under an exclusive claim
                if slots < 1 or cluster.free_memory_mib(gpu) < _slice_budget(demand, gpu):
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
                memory_mib=_slice_budget(demand, gpu),
                units=Fraction(1, gpu.share_slots),
            )
    return None


def free_by_model(
    cluster: Cluster, now: float, down_after_s: float
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]]]:
    """Free placeable GPUs and free slices, each as {model: {host: n}} (only non-zero)."""
    free: dict[str, dict[str, int]] = {}
    slots: dict[str, dict[str, int]] = {}
    view = _view(cluster, sorted(cluster.nodes), now, down_after_s)
    for host in view.hosts:
        for gpu in view.placeable[host]:
            if cluster.is_free(gpu):
                per_host = free.setdefault(gpu.model, {})
                per_host[host] = per_host.get(host, 0) + 1
            if gpu.share_slots > 1 and cluster.free_slots(gpu) > 0:
                per_host = slots.setdefault(gpu.model, {})
                per_host[host] = per_host.get(host, 0) + cluster.free_slots(gpu)
    return (
        {m: dict(sorted(h.items())) for m, h in sorted(free.items())},
        {m: dict(sorted(h.items())) for m, h in sorted(slots.items())},
    )


def _free_text(label: str, free: dict[str, dict[str, int]]) -> str:
    parts = [
        f"{model}: " + ", ".join(f"{n} on {host}" for host, n in hosts.items())
        for model, hosts in free.items()
    ]
    return f"{label}: " + "; ".join(parts) + "."


def _no_capacity(demand: Demand, cluster: Cluster, now: float, down_after_s: float) -> Refusal:
    free, slots = free_by_model(cluster, now, down_after_s)
    sentences = [f"Nothing free fits {_describe(demand)} right now."]
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
    view = _view(cluster, hosts, now, down_after_s)
    unreported = 0
    for host in view.hosts:
        by_model: dict[str, list[GPU]] = {}
        for gpu in view.placeable[host]:
            if _of_model(demand, gpu) and _suits(demand, gpu) and cluster.is_free(gpu):
                by_model.setdefault(gpu.model, []).append(gpu)
        for gpus in by_model.values():
            if demand.count is not None and len(gpus) < demand.count:
                continue
            links = _host_links(cluster, host, gpus)
            if links is None:
                unreported += 1
                continue
            count = demand.count if demand.count is not None else len(gpus)
            chosen = _choose(links, [g.uuid for g in gpus], count, demand.topology)
            if isinstance(chosen, Unmet):
                return f"On {host}, {chosen.reason}."
    level = DEMANDED_LEVEL[demand.topology].words
    if unreported:
        return (f"{unreported} host(s) with enough free GPUs have not reported how their GPUs "
                f"are joined, so they cannot promise {level}.")
    return f"No host has enough free GPUs joined by {level} now."


def nothing_fits_now() -> Refusal:
    """The refusal of a placement asked without an explanation (:func:`place`)."""
    return Refusal(ErrorCode.NO_CAPACITY, "Nothing free fits this request right now.")


def place(demand: Demand, cluster: Cluster, now: float, down_after_s: float, *,
          explain: bool = True) -> Placement | Refusal:
    """Where the demand fits now (best fit), or why not.

    ``unknown_host``/``unsatisfiable`` (from :func:`feasible`) when it could never fit,
    else ``no_capacity`` naming what is free instead, with ``details["free"]`` as
    ``{model: {host: free GPUs}}`` (and ``details["free_slots"]`` for slices). Without
    ``explain`` a demand that does not fit gets :func:`nothing_fits_now`: finding why, and
    what is free instead, looks at every GPU of the cluster, and a queued request that is
    tried again whenever something changed needs only to know whether it fits.
    """
    if demand.host is not None and demand.host not in cluster.nodes:
        refusal = feasible(demand, cluster)
        assert refusal is not None
        return refusal
    hosts = [demand.host] if demand.host is not None else sorted(cluster.nodes)
    view = _view(cluster, hosts, now, down_after_s)
    found: Placement | None
    if demand.shared:
        found = _slice(demand, cluster, view)
    elif demand.count is None:
        found = _whole_host(demand, cluster, view)
    else:
        found = _exclusive(demand, demand.count, cluster, view)
    if found is not None:
        return found
    if not explain:
        return nothing_fits_now()
    # Only on failure: an impossible request must not queue forever as "no capacity".
    return feasible(demand, cluster) or _no_capacity(demand, cluster, now, down_after_s)


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


# --------------------------------------------------------------------------- quota


def _fmt_units(units: Fraction | float) -> str:
    """1 -> "1", 1/4 -> "0.25", 1/3 -> "0.333"."""
    value = Fraction(units)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.3f}".rstrip("0")


def _gpus(units: Fraction | float) -> str:
    return f"{_fmt_units(units)} GPU" + ("" if Fraction(units) == 1 else "s")


def _limit(value: float | None) -> Fraction | None:
    if value is None or not math.isfinite(value):
        return None  # unlimited (a NaN quota is a typo, not a ban)
    return Fraction(value).limit_denominator(_QUOTA_DENOMINATOR)


@dataclass(frozen=True)
class QuotaStanding:
    """One quota that applies to a user (their own, or one of their groups') and its use."""

    scope: str
    """``user`` or ``group``."""
    name: str
    limit: Fraction | None
    """GPUs that may be held at once, borrowed ones included (a slice counts 1/slots); None =
    no limit. This is the borrow limit; without one configured, the guarantee."""
    held: Fraction
    """Held now by the user, or by all members of the group together."""
    guarantee: Fraction | None = None
    """GPUs held within it are never reclaimed; beyond it (up to ``limit``) they are
    borrowed. None = no limit (nothing counted here is borrowed)."""
    model: str | None = None
    """A per-model quota's model (it counts only GPUs of that model); None: every model."""


def _user_limits(user: str, settings: PolicySettings) -> tuple[Fraction | None, Fraction | None]:
    """(guarantee, borrow limit) of a user: ``user_quota`` or ``default_user_quota``, and the
    borrow limit configured for them, else the guarantee."""
    guarantee: float | None
    borrow: float | None
    if user in settings.user_quota:
        guarantee = settings.user_quota[user]
        borrow = settings.user_borrow_limit.get(user, guarantee)
    else:
        guarantee = settings.default_user_quota
        borrow = settings.user_borrow_limit.get(user, settings.default_user_borrow_limit)
        if borrow is None:
            borrow = guarantee
    return _limit(guarantee), _limit(borrow)


@dataclass(frozen=True)
class QuotaScope:
    """One quota: whose (a user, or a group's members together), of which model (None: of
    every model), its guarantee and its borrow limit (None: unlimited)."""

    scope: str
    name: str
    guarantee: Fraction | None
    borrow_limit: Fraction | None
    model: str | None = None

    def counts(self, claim: Claim, cluster: Cluster, uuid: str) -> bool:
        """Whether a claim on GPU ``uuid`` counts against this quota."""
        mine = claim.user == self.name if self.scope == "user" else self.name in claim.groups
        if not mine or self.model is None:
            return mine
        gpu = cluster.gpus.get(uuid)
        return gpu is not None and gpu.model == self.model


def _model_scopes(scope: str, name: str, guarantees: Mapping[str, Mapping[str, float]],
                  limits: Mapping[str, Mapping[str, float]], aliases: Mapping[str, str],
                  model: str | None, every_model: bool) -> list[QuotaScope]:
    found = []
    configured = guarantees.get(name, {})
    # A per-model key is a name an admin typed ("gtx 1070", an alias): matched to the grant's
    # model by the same rule as a user's request (allocator.wire.model_names), not by equality.
    names = ModelNames.build([model], aliases) if configured and model is not None else None
    for key, guarantee in configured.items():
        if names is not None and names.canonical(key) == model:
            canonical = model
        elif every_model:
            canonical = aliases.get(key, key)
        else:
            continue
        borrow = limits.get(name, {}).get(key, guarantee)
        found.append(QuotaScope(scope, name, _limit(guarantee), _limit(borrow), canonical))
    return found


def quota_scopes(user: str, groups: Sequence[str], settings: PolicySettings, *,
                 model: str | None = None, every_model: bool = False) -> list[QuotaScope]:
    """The quotas of the user, then of each of their groups with one (each once, in the order
    given): the whole-cluster ones, and the per-model ones (``user_model_quota``,
    ``group_model_quota``) of ``model`` (a grant's one model), or of every model."""
    guarantee, borrow = _user_limits(user, settings)
    scopes = [QuotaScope("user", user, guarantee, borrow)]
    scopes += _model_scopes("user", user, settings.user_model_quota,
                            settings.user_model_borrow_limit, settings.aliases, model,
                            every_model)
    for group in dict.fromkeys(groups):
        if group in settings.group_quota:
            group_guarantee = settings.group_quota[group]
            scopes.append(QuotaScope("group", group, _limit(group_guarantee), _limit(
                settings.group_borrow_limit.get(group, group_guarantee))))
        scopes += _model_scopes("group", group, settings.group_model_quota,
                                settings.group_model_borrow_limit, settings.aliases, model,
                                every_model)
    return scopes


def quota_standings(user: str, groups: Sequence[str], cluster: Cluster,
                    settings: PolicySettings, *, limited_only: bool = False,
                    model: str | None = None, every_model: bool = False
                    ) -> list[QuotaStanding]:
    """The user's own quota, then one per group of theirs that has one (each group once, in
    the order given), with what each holds now; per-model quotas as :func:`quota_scopes`.

    Holdings are the claims in the cluster: one per GPU a lease holds (1 unit each for
    exclusive leases, 1/slots for a slice); a per-model quota counts the claims on GPUs of its
    model. The user's guarantee is ``user_quota[user]``, else ``default_user_quota`` (None =
    unlimited); each of the user's groups in ``group_quota`` guarantees what all claims
    carrying that group hold together. The limit of each is its borrow limit
    (``user_borrow_limit``, ``group_borrow_limit``, ``default_user_borrow_limit``, and the
    ``*_model_borrow_limit`` ones), the guarantee where none is set. ``limited_only`` leaves
    out the unlimited ones, and counts nothing when none is limited.
    """
    scopes = quota_scopes(user, groups, settings, model=model, every_model=every_model)
    if limited_only:
        scopes = [scope for scope in scopes if scope.borrow_limit is not None]
        if not scopes:
            return []  # no quota applies: no need to count what everybody holds
    claims = [(uuid, claim) for uuid, held in cluster.claims.items() for claim in held]
    return [
        QuotaStanding(scope.scope, scope.name, scope.borrow_limit, sum(
            (c.units for uuid, c in claims if scope.counts(c, cluster, uuid)), Fraction(0)),
            scope.guarantee, scope.model)
        for scope in scopes
    ]


def would_borrow(demand_units: Fraction, standings: Sequence[QuotaStanding]) -> bool:
    """Whether granting ``demand_units`` more would go beyond one of the guarantees."""
    return any(s.guarantee is not None and s.held + demand_units > s.guarantee
               for s in standings)


def check_quota(
    demand_units: Fraction,
    user: str,
    groups: Sequence[str],
    cluster: Cluster,
    settings: PolicySettings,
    model: str | None = None,
) -> Refusal | None:
    """``quota_exceeded`` if granting ``demand_units`` more (of ``model``, the grant's one
    model) would pass a user or group quota (see :func:`quota_standings`)."""
    for standing in quota_standings(user, groups, cluster, settings, limited_only=True,
                                    model=model):
        assert standing.limit is not None
        if standing.held + demand_units <= standing.limit:
            continue
        who = (f"User {user} may" if standing.scope == "user"
               else f"Group {standing.name} may")
        of = f" of {standing.model}" if standing.model is not None else ""
        holds = "holds" if standing.scope == "user" else "its members hold"
        return Refusal(
            ErrorCode.QUOTA_EXCEEDED,
            f"{who} hold {_gpus(standing.limit)}{of} at once and {holds} "
            f"{_fmt_units(standing.held)}; this request asks for {_fmt_units(demand_units)} more.",
            {
                "scope": standing.scope,
                "name": standing.name,
                "limit": float(standing.limit),
                "held": float(standing.held),
                "asked": float(demand_units),
                **({"model": standing.model} if standing.model is not None else {}),
            },
        )
    return None


# --------------------------------------------------------------------------- queue, env, summary


def queue_order_key(priority: int, enqueued_at: float, lease_id: str) -> tuple[int, float, str]:
    """Sort key of queued requests: higher priority first, then first come first served.

    The lease id only breaks exact ties so the order is total and stable across restarts.
    """
    return (-priority, enqueued_at, lease_id)


def placement_model(placement: Placement, cluster: Cluster) -> str | None:
    """The one model of a placement's GPUs, or None when it mixes models."""
    models = {cluster.gpus[u].model for u in placement.gpu_uuids}
    return models.pop() if len(models) == 1 else None


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
            if not (gpu.placeable and _usable(cluster, host, now, down_after_s)):
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
