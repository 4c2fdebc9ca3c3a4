"""What a lease's container carries: the label node agents look for, and its environment.

Part of the allocator's public surface. The allocator computes a granted lease's environment
(:func:`lease_env`, sent in the lease's ``env``); the hub puts exactly that into the container
and :func:`lease_labels` on it; the node agent reports the containers that carry
:data:`LEASE_LABEL`. Each name is defined here once, so the three cannot drift apart.

The builders return new dicts, so a new label or variable is one more entry here.
"""

from __future__ import annotations

from collections.abc import Sequence

LEASE_LABEL = "swarm-gpu.lease"
"""Container (and service) label carrying the lease id. Node agents report containers with it."""

NO_GPU_DEVICES = "void"
"""``NVIDIA_VISIBLE_DEVICES`` value that gives a container no GPU at all."""

ENV_PREFIX = "SWARM_GPU_"
"""Prefix of the variables swarm-gpu itself sets."""

DRIVER_CAPABILITIES = "compute,utility"
"""``NVIDIA_DRIVER_CAPABILITIES`` of a lease container: CUDA and nvidia-smi."""


def lease_labels(lease_id: str) -> dict[str, str]:
    """The labels a lease's container (and its service) carries."""
    return {LEASE_LABEL: lease_id}


def no_gpu_env() -> dict[str, str]:
    """The environment of a server that asked for no GPU: the NVIDIA runtime exposes none."""
    return {"NVIDIA_VISIBLE_DEVICES": NO_GPU_DEVICES}


def memory_fraction(budget_mib: int, total_mib: int) -> str:
    """A slice's share of its GPU's memory as ``"0.25"``, rounded down.

    Integer arithmetic so the fraction is rounded down exactly: rounding up would let XLA
    preallocate more than the budget.
    """
    hundredths = budget_mib * 100 // total_mib if total_mib > 0 else 0
    hundredths = min(hundredths, 100)
    return f"{hundredths // 100}.{hundredths % 100:02d}"


def lease_env(*, lease_id: str, host: str, gpu_uuids: Sequence[str], model: str | None,
              shared: bool, memory_mib: int | None,
              memory_total_mib: int | None) -> dict[str, str]:
    """The environment of a granted lease's container.

    Always the devices, the driver capabilities and ``SWARM_GPU_LEASE``, ``_HOST``,
    ``_GPU_COUNT``, ``_SHARED`` (and ``_MODEL`` when the lease has one model). A slice also
    gets its budget (``SWARM_GPU_MEMORY_LIMIT_MIB``) and framework hints that keep JAX,
    TensorFlow and PyTorch from taking the whole GPU.
    """
    env = {
        "NVIDIA_VISIBLE_DEVICES": ",".join(gpu_uuids),
        "NVIDIA_DRIVER_CAPABILITIES": DRIVER_CAPABILITIES,
        f"{ENV_PREFIX}LEASE": lease_id,
        f"{ENV_PREFIX}HOST": host,
        f"{ENV_PREFIX}GPU_COUNT": str(len(gpu_uuids)),
        f"{ENV_PREFIX}SHARED": "1" if shared else "0",
    }
    if model:
        env[f"{ENV_PREFIX}MODEL"] = model
    if shared and memory_mib is not None and gpu_uuids:
        env.update({
            f"{ENV_PREFIX}MEMORY_LIMIT_MIB": str(memory_mib),
            "XLA_PYTHON_CLIENT_MEM_FRACTION": memory_fraction(memory_mib, memory_total_mib or 0),
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
            "TF_FORCE_GPU_ALLOW_GROWTH": "true",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        })
    return env
