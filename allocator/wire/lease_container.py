"""What a lease's container carries: its labels (the lease and its whole grant), and its
environment.

Part of the allocator's public surface. The allocator computes a granted lease's environment
(:func:`lease_env`, sent in the lease's ``env``); the hub puts exactly that into the container
and :func:`grant_labels` on it (:func:`lease_labels` on its service); the node agent reports
the containers that carry :data:`LEASE_LABEL`, with the grant their labels describe
(:func:`grant_from_labels`). Each name is defined here once, so the three cannot drift apart.

Why the whole grant and not only the lease id: the ledger can be lost (a deleted file, a
restored backup, an allocator started on an empty volume). A node then still runs the
containers, and their labels say which GPUs each one was given, so the allocator claims them
again (``adopted``) instead of handing them out a second time. The labels are set through the
Docker API when the service is created; a process inside the container cannot change them,
but whoever may use a node's Docker API can put them on any container, so the allocator lets
a label do little (it never binds a queued lease; a conflict lasts while its container runs
and names it): see :mod:`allocator.placement.adoption`.

The builders return new dicts, so a new label or variable is one more entry here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from pydantic import ValidationError

from allocator.wire.protocol import ContainerGrant, Lease, describe_validation_error

LEASE_LABEL = "swarm-gpu.lease"
"""Container (and service) label carrying the lease id. Node agents report containers with it."""

NO_GPU_DEVICES = "void"
"""``NVIDIA_VISIBLE_DEVICES`` value that gives a container no GPU at all."""

ENV_PREFIX = "SWARM_GPU_"
"""Prefix of the variables swarm-gpu itself sets."""

DRIVER_CAPABILITIES = "compute,utility"
"""``NVIDIA_DRIVER_CAPABILITIES`` of a lease container: CUDA and nvidia-smi."""


HOST_LABEL = "swarm-gpu.host"
"""The node the GPUs were granted on."""
GPUS_LABEL = "swarm-gpu.gpus"
"""The granted GPU uuids, comma-separated (a uuid never holds a comma)."""
SHARED_LABEL = "swarm-gpu.shared"
"""``1`` for a shared slice, ``0`` for whole GPUs."""
MEMORY_LABEL = "swarm-gpu.memory-mib"
"""A shared slice's memory budget in MiB (shared slices only)."""
USER_LABEL = "swarm-gpu.user"
"""The user the lease was granted to."""
SERVER_LABEL = "swarm-gpu.server"
"""The server name (empty for a user's default server)."""
REQUEST_KEY_LABEL = "swarm-gpu.request-key"
"""The request key the lease was granted for (idempotency after an adoption too)."""
GROUPS_LABEL = "swarm-gpu.groups"
"""The user's groups the lease was asked with, a JSON list (group names may hold commas):
an adopted lease counts against its groups' quotas and guarantees again."""

GRANT_LABELS = (HOST_LABEL, GPUS_LABEL, SHARED_LABEL, MEMORY_LABEL, USER_LABEL, SERVER_LABEL,
                REQUEST_KEY_LABEL, GROUPS_LABEL)
"""Every label of the grant besides :data:`LEASE_LABEL`."""


def grant_labels(lease: Lease, server_name: str = "",
                 groups: Sequence[str] = ()) -> dict[str, str]:
    """The labels of a container that runs for ``lease`` (lease id and grant); ``groups``:
    the user's groups the lease was asked with."""
    labels = {
        LEASE_LABEL: lease.lease_id,
        HOST_LABEL: lease.host or "",
        GPUS_LABEL: ",".join(lease.gpu_uuids),
        SHARED_LABEL: "1" if lease.shared else "0",
        USER_LABEL: lease.user,
        SERVER_LABEL: server_name,
        REQUEST_KEY_LABEL: lease.request_key,
        GROUPS_LABEL: json.dumps(sorted(groups), separators=(",", ":")),
    }
    if lease.shared and lease.memory_mib is not None:
        labels[MEMORY_LABEL] = str(lease.memory_mib)
    return labels


def grant_from_labels(labels: Mapping[str, str]) -> ContainerGrant | str | None:
    """The grant a container's labels describe; None when it carries no grant labels (only
    the lease id, or nothing), or one sentence saying why the labels do not make a grant."""
    if not labels.get(HOST_LABEL) and not labels.get(GPUS_LABEL):
        return None
    memory = labels.get(MEMORY_LABEL)
    try:
        memory_mib = int(memory) if memory not in (None, "") else None
    except ValueError:
        return f"{MEMORY_LABEL} is not a whole number: {memory!r}"
    groups = _groups(labels.get(GROUPS_LABEL))
    if isinstance(groups, str):
        return groups
    try:
        return ContainerGrant(
            host=labels.get(HOST_LABEL, ""),
            gpu_uuids=[u for u in labels.get(GPUS_LABEL, "").split(",") if u],
            shared=labels.get(SHARED_LABEL) == "1",
            memory_mib=memory_mib,
            user=labels.get(USER_LABEL, ""),
            server_name=labels.get(SERVER_LABEL, ""),
            request_key=labels.get(REQUEST_KEY_LABEL, ""),
            groups=groups,
        )
    except ValidationError as exc:
        return describe_validation_error(exc)


def _groups(text: str | None) -> list[str] | str:
    """The groups of :data:`GROUPS_LABEL` (none when absent: containers labelled before it),
    or why the label is not a list of names."""
    if text in (None, ""):
        return []
    try:
        groups = json.loads(text)
    except ValueError:
        return f"{GROUPS_LABEL} is not JSON: {text[:100]!r}"
    if not isinstance(groups, list) or not all(isinstance(g, str) for g in groups):
        return f"{GROUPS_LABEL} is not a list of group names: {text[:100]!r}"
    return groups


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
              memory_total_mib: int | None, numa_nodes: Sequence[int] = ()) -> dict[str, str]:
    """The environment of a granted lease's container.

    Always the devices (in ``gpu_uuids``' order: CUDA numbers them so), the driver
    capabilities and ``SWARM_GPU_LEASE``, ``_HOST``, ``_GPU_COUNT``, ``_SHARED`` (and
    ``_MODEL`` when the lease has one model; ``_NUMA_NODES``, a comma list, where the host
    reported its GPUs' NUMA nodes: a hint for pinning threads, not a pinning). A slice also
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
    if numa_nodes:
        env[f"{ENV_PREFIX}NUMA_NODES"] = ",".join(str(node) for node in numa_nodes)
    if shared and memory_mib is not None and gpu_uuids:
        env.update({
            f"{ENV_PREFIX}MEMORY_LIMIT_MIB": str(memory_mib),
            "XLA_PYTHON_CLIENT_MEM_FRACTION": memory_fraction(memory_mib, memory_total_mib or 0),
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
            "TF_FORCE_GPU_ALLOW_GROWTH": "true",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        })
    return env
