"""The demand: a request validated against the cluster and the settings, its models resolved
to canonical names (:mod:`allocator.wire.model_names`' rule, the hub's too); and what placing one
gives, a :class:`Placement` or a :class:`Refusal`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from allocator.config import PolicySettings
from allocator.placement.cluster import Cluster
from allocator.placement.gpu_sets import TopologyDemand
from allocator.wire.model_names import ModelNameError, ModelNames
from allocator.wire.protocol import AllocateRequest, ErrorCode, capability_tuple


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
    refused_models: frozenset[str] = frozenset()
    """Models a per-model quota refuses this demand: never placed on
    (:func:`allocator.placement.quota.place_within_quota` sets them)."""

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


def models_text(models: Sequence[str]) -> str:
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
                    f"{models_text(models)} cannot be shared (exclusive only). "
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


def placement_model(placement: Placement, cluster: Cluster) -> str | None:
    """The one model of a placement's GPUs, or None when it mixes models."""
    models = {cluster.gpus[u].model for u in placement.gpu_uuids}
    return models.pop() if len(models) == 1 else None
