"""Which GPUs suit a demand, apart from whether they are free: memory, compute capability,
architecture, model, a slice's budget; and the demand in words for refusals."""

from __future__ import annotations

from allocator.placement.cluster import GPU
from allocator.placement.demand import Demand, models_text
from allocator.placement.gpu_sets import DEMANDED_LEVEL
from allocator.wire.protocol import capability_tuple


def slice_budget(demand: Demand, gpu: GPU) -> int:
    if demand.share_memory_mib is not None:
        return demand.share_memory_mib
    return gpu.memory_total_mib // max(gpu.share_slots, 1)


def big_enough(demand: Demand, gpu: GPU) -> bool:
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


def suits(demand: Demand, gpu: GPU) -> bool:
    """Memory, compute capability and architecture, and not of a model the quota refused
    (``Demand.refused_models``): everything but the model asked for."""
    return (big_enough(demand, gpu) and capable(demand, gpu)
            and gpu.model not in demand.refused_models)


def capability_text(demand: Demand) -> str:
    parts = []
    if demand.min_compute_capability is not None:
        major, minor = demand.min_compute_capability
        parts.append(f"compute capability {major}.{minor} or higher")
    if demand.architecture is not None:
        parts.append(f"architecture {demand.architecture}")
    return " and ".join(parts)


def of_model(demand: Demand, gpu: GPU) -> bool:
    return demand.models is None or gpu.model in demand.models


def slice_fits_size(demand: Demand, gpu: GPU) -> bool:
    """Whether a slice of this demand could ever fit this GPU (ignoring other claims)."""
    budget = slice_budget(demand, gpu)
    return gpu.share_slots > 1 and 1 <= budget <= gpu.memory_total_mib


def describe(demand: Demand) -> str:
    """The demand in words: "2 GPUs of NVIDIA A100 with at least 40000 MiB on gpu-a"."""
    models = models_text(demand.models) if demand.models else None
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
        text += f" of {capability_text(demand)}"
    if demand.demands_links:
        assert demand.topology is not None
        text += f" all joined by {DEMANDED_LEVEL[demand.topology].words}"
    if demand.host is not None:
        text += f" on {demand.host}"
    return text


