"""The Docker labels a lease container carries: the lease id and the whole grant.

Part of the allocator's public surface, like :mod:`allocator.protocol`: the hub's spawner
writes these labels (:func:`grant_labels`) and the node agent reads them back
(:func:`grant_from_labels`), so both follow one rule. The labels are set through the Docker
API when the service is created; a process inside the container cannot change them.

Why the whole grant and not only the lease id: the ledger can be lost (a deleted file, a
restored backup, an allocator started on an empty volume). A node then still runs the
containers, and their labels say which GPUs each one was given, so the allocator claims them
again (``adopted``) instead of handing them out a second time.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import ValidationError

from allocator.protocol import ContainerGrant, Lease, describe_validation_error

LEASE_LABEL = "swarm-gpu.lease"
"""The lease id. Node agents watch and report the containers that carry it."""
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

GRANT_LABELS = (HOST_LABEL, GPUS_LABEL, SHARED_LABEL, MEMORY_LABEL, USER_LABEL, SERVER_LABEL,
                REQUEST_KEY_LABEL)
"""Every label of the grant besides :data:`LEASE_LABEL`."""


def grant_labels(lease: Lease, server_name: str = "") -> dict[str, str]:
    """The labels of a container that runs for ``lease`` (lease id and grant)."""
    labels = {
        LEASE_LABEL: lease.lease_id,
        HOST_LABEL: lease.host or "",
        GPUS_LABEL: ",".join(lease.gpu_uuids),
        SHARED_LABEL: "1" if lease.shared else "0",
        USER_LABEL: lease.user,
        SERVER_LABEL: server_name,
        REQUEST_KEY_LABEL: lease.request_key,
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
    try:
        return ContainerGrant(
            host=labels.get(HOST_LABEL, ""),
            gpu_uuids=[u for u in labels.get(GPUS_LABEL, "").split(",") if u],
            shared=labels.get(SHARED_LABEL) == "1",
            memory_mib=memory_mib,
            user=labels.get(USER_LABEL, ""),
            server_name=labels.get(SERVER_LABEL, ""),
            request_key=labels.get(REQUEST_KEY_LABEL, ""),
        )
    except ValidationError as exc:
        return describe_validation_error(exc)
