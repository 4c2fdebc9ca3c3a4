"""Turn a lease into what the Swarm service needs: environment, placement, labels.

Pure functions over plain data, like kubespawner's ``objects.py``: given a
:class:`~allocator.wire.protocol.Lease` (or None for "no GPU") and the admin's own
``SwarmSpawner`` settings, they return new dicts and never modify their inputs.

- environment: the lease's own env, exactly as the allocator computed it
  (:func:`allocator.wire.lease_container.lease_env`), checked for control characters;
  ``NVIDIA_VISIBLE_DEVICES=void`` without a GPU, so the NVIDIA runtime exposes none;
- placement: the admin's constraints plus ``node.hostname == <lease host>``;
- labels: :func:`allocator.wire.lease_container.grant_labels` on the container (the lease id, what
  node agents look for, and the whole grant, which they report so that an allocator that lost
  the lease adopts it), :func:`allocator.wire.lease_container.lease_labels`
  (``swarm-gpu.lease=<lease id>``) on the service (for ``docker service ls --filter label=...``);
- restart policy: ``none`` for a service that holds a lease. Swarm's default restarts a dead
  task in a *new* container with the same environment, but the lease was released the moment
  the old container died and its GPUs may already be someone else's.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from allocator.wire.lease_container import (
    GRANT_LABELS,
    LEASE_LABEL,
    grant_labels,
    lease_labels,
    no_gpu_env,
)
from allocator.wire.protocol import Lease, LeaseState

__all__ = [
    "LEASE_LABEL", "BuildError", "ServiceGPUSpec", "build_service_spec", "describe_lease",
    "gpu_env", "placement_constraints",
]

_HOSTNAME_CONSTRAINT = re.compile(r"^\s*node\.hostname\s*(==|!=)\s*(.+?)\s*$")
_SAFE_VALUE = re.compile(r"[^\x00-\x1f\x7f]*")


class BuildError(ValueError):
    """The lease and the admin's settings cannot make a runnable service."""


@dataclass(frozen=True)
class ServiceGPUSpec:
    """What the spawner puts into the service for one start."""

    env: dict[str, str]
    extra_container_spec: dict[str, Any]
    extra_placement_spec: dict[str, Any]
    extra_create_kwargs: dict[str, Any]
    extra_task_spec: dict[str, Any] = field(default_factory=dict)
    lease_id: str | None = None
    host: str | None = None
    summary: str = field(default="no GPU")


def _check_value(name: str, value: str) -> str:
    if not _SAFE_VALUE.fullmatch(value):
        raise BuildError(f"{name} contains control characters: {value[:60]!r}")
    return value


def _usable(lease: Lease) -> None:
    if lease.state not in (LeaseState.GRANTED, LeaseState.BOUND):
        raise BuildError(f"lease {lease.lease_id} is {lease.state.value}, not granted")
    if not lease.host:
        raise BuildError(f"lease {lease.lease_id} has no host")
    if not lease.gpu_uuids:
        raise BuildError(f"lease {lease.lease_id} has no GPU")
    for uuid in lease.gpu_uuids:
        if not uuid or "," in uuid or not _SAFE_VALUE.fullmatch(uuid):
            raise BuildError(f"lease {lease.lease_id} has a malformed GPU uuid {uuid!r}")


def gpu_env(lease: Lease | None) -> dict[str, str]:
    """Environment for the container of a lease (or of a server without GPU).

    The allocator's own env of the lease, checked, with ``NVIDIA_VISIBLE_DEVICES`` always the
    lease's GPUs (whatever the env says), so the container sees exactly what was granted.
    """
    if lease is None:
        return no_gpu_env()
    _usable(lease)
    env: dict[str, str] = {}
    for key, value in lease.env.items():
        env[_check_value(key, key)] = _check_value(key, str(value))
    env["NVIDIA_VISIBLE_DEVICES"] = ",".join(lease.gpu_uuids)
    return env


def placement_constraints(admin_constraints: Sequence[str] | None, host: str | None) -> list[str]:
    """The admin's constraints plus ``node.hostname == host`` (deduplicated, order kept).

    An admin constraint that pins another hostname (or excludes this one) would leave the
    service pending forever, so it is an error rather than a silent hang.
    """
    constraints = [str(c) for c in (admin_constraints or [])]
    if host is None:
        return list(dict.fromkeys(constraints))
    _check_value("host", host)
    kept: list[str] = []
    for constraint in constraints:
        match = _HOSTNAME_CONSTRAINT.match(constraint)
        if match:
            op, value = match.groups()
            if op == "==" and value != host:
                raise BuildError(
                    f"the spawner's placement constraint '{constraint}' excludes host "
                    f"'{host}', where the GPUs were granted"
                )
            if op == "!=" and value == host:
                raise BuildError(
                    f"the spawner's placement constraint '{constraint}' excludes host "
                    f"'{host}', where the GPUs were granted"
                )
            if op == "==":
                continue  # same host: ours below
        kept.append(constraint)
    kept.append(f"node.hostname == {host}")
    return list(dict.fromkeys(kept))


def _with_labels(spec: Mapping[str, Any], key: str, ours: Mapping[str, str]) -> dict[str, Any]:
    """The admin's labels with ours on top: never a stale or forged lease or grant label."""
    out = copy.deepcopy(dict(spec))
    labels = dict(out.get(key) or {})
    for name in (LEASE_LABEL, *GRANT_LABELS):
        labels.pop(name, None)
    labels.update({name: _check_value(name, value) for name, value in ours.items()})
    if labels or key in out:
        out[key] = labels
    return out


def build_service_spec(
    lease: Lease | None,
    *,
    extra_container_spec: Mapping[str, Any] | None = None,
    extra_placement_spec: Mapping[str, Any] | None = None,
    extra_create_kwargs: Mapping[str, Any] | None = None,
    extra_task_spec: Mapping[str, Any] | None = None,
    server_name: str = "",
    groups: Sequence[str] = (),
) -> ServiceGPUSpec:
    """Everything the service needs for this lease, merged with the admin's settings.

    The admin's dicts are copied, never modified. The container carries the whole grant
    (:func:`~allocator.wire.lease_container.grant_labels`, with ``server_name``, the JupyterHub
    server's name, empty for a user's default server, and the user's ``groups`` the lease was
    asked with), the service the lease label. Without
    a lease the placement is the admin's own and any stale lease or grant label is removed.
    """
    env = gpu_env(lease)
    lease_id = lease.lease_id if lease is not None else None
    host = lease.host if lease is not None else None
    container = _with_labels(extra_container_spec or {}, "labels",
                             grant_labels(lease, server_name, groups)
                             if lease is not None else {})
    create = _with_labels(extra_create_kwargs or {}, "labels",
                          lease_labels(lease_id) if lease_id is not None else {})
    placement = copy.deepcopy(dict(extra_placement_spec or {}))
    if host is not None or placement.get("constraints"):
        placement["constraints"] = placement_constraints(placement.get("constraints"), host)
    task = copy.deepcopy(dict(extra_task_spec or {}))
    if lease_id is not None:
        task["restart_policy"] = {"Condition": "none"}
    return ServiceGPUSpec(
        env=env,
        extra_container_spec=container,
        extra_placement_spec=placement,
        extra_create_kwargs=create,
        extra_task_spec=task,
        lease_id=lease_id,
        host=host,
        summary=describe_lease(lease),
    )


def describe_lease(lease: Lease | None) -> str:
    """A short human description, for progress messages and logs."""
    if lease is None:
        return "no GPU"
    n = len(lease.gpu_uuids)
    model = lease.model or "GPU"
    if lease.shared:
        budget = f" ({lease.memory_mib} MiB)" if lease.memory_mib else ""
        return f"a shared slice of one {model}{budget} on {lease.host}"
    what = f"1 {model}" if n == 1 else f"{n} x {model}"
    return f"{what} on {lease.host}"
