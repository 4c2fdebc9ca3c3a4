"""The ledger's invariants, checked: no GPU lost or given twice, no lease in an impossible state.

:func:`check_ledger` reads a ledger (read-only) and returns every :class:`Violation` it finds;
an empty list means the ledger is sound. It is pure apart from reading the connection, so the
fault tests end with it and ``gpu-ledger check`` prints what it returns.

What is checked, with the violation ``kind`` each reports:

- ``exclusive_conflict``: a GPU held by an exclusive lease and by any other lease.
- ``over_slots``: more shared slices on a GPU than it has share slots.
- ``over_memory``: the memory budgets of the slices on a GPU add up to more than its memory.
- ``unknown_gpu``: a lease holds a GPU the ledger has never seen.
- ``wrong_host``: a lease holds a GPU of another host than its own (a lease is on one host).
- ``bad_state`` / ``bad_reason``: a state or release reason that does not exist.
- ``granted_without_gpus``: a lease that holds GPUs by its state but lists none, no host, or
  no grant time.
- ``queued_with_gpus``: a queued lease that lists GPUs.
- ``bound_without_container``: a bound lease without its container id or bind time.
- ``released_without_reason``: a final lease without a release reason or release time.
- ``bad_share``: a shared lease on more than one GPU, or without a memory budget.
- ``duplicate_request_key``: two active leases of one request key of one owner (one server,
  two leases; the same key of two hubs is two servers).

With what the nodes report (``reports``, e.g. from their heartbeats), also:

- ``bound_container_missing``: a bound lease whose host reported its containers, complete,
  after the bind (plus a grace), and did not list the lease's container.
- ``orphan_container``: a node runs a lease-labelled container whose lease holds no GPU: the
  GPU can be given to someone else while that container still uses it.
- ``grant_conflict``: the grants the running containers' labels carry contradict each other or
  the ledger on one GPU (two holders of which one is exclusive, slices over the GPU's memory),
  or name a GPU the ledger does not know on that host. The allocator keeps such a GPU out of
  placement and stops nothing; a person decides which container goes.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from allocator.wire.protocol import ContainerGrant, Heartbeat, LeaseState, ReleaseReason

_STATES = {s.value for s in LeaseState}
_HOLDING = {s.value for s in LeaseState if s.holds_gpus}
_ACTIVE = {s.value for s in LeaseState if s.active}
_FINAL = {s.value for s in LeaseState if s.final}
_REASONS = {r.value for r in ReleaseReason}


@dataclass(frozen=True)
class Violation:
    """One broken invariant: a stable ``kind`` for programs, a ``message`` for people."""

    kind: str
    message: str
    lease_id: str | None = None
    gpu_uuid: str | None = None
    host: str | None = None

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


@dataclass(frozen=True)
class NodeReport:
    """What one node last said runs on it: lease id -> container id."""

    host: str
    received_at: float
    """When the report was received (checker's clock; compare with the ledger's times)."""
    containers: dict[str, str] = field(default_factory=dict)
    complete: bool = True
    """False when the node could not list its containers; then nothing missing is a finding."""
    grants: dict[str, ContainerGrant] = field(default_factory=dict)
    """lease id -> the grant its container's labels carry (containers with grant labels)."""

    @classmethod
    def from_heartbeat(cls, beat: Heartbeat, received_at: float) -> NodeReport:
        """The report a heartbeat makes."""
        return cls(host=beat.host, received_at=received_at,
                   containers={c.lease_id: c.container_id for c in beat.containers},
                   complete=beat.containers_complete,
                   grants={c.lease_id: c.grant for c in beat.containers if c.grant is not None})


@dataclass
class _GPU:
    host: str
    memory_total_mib: int
    share_slots: int
    holders: list[tuple[str, bool, int | None]] = field(default_factory=list)
    """(lease id, shared, memory budget)"""


def check_ledger(conn: sqlite3.Connection, reports: Mapping[str, NodeReport] | None = None, *,
                 grace_s: float = 5.0) -> list[Violation]:
    """Every violated invariant of the ledger (and, with ``reports``, of the nodes' truth).

    ``grace_s`` bounds how stale a report may be compared with the ledger: a lease bound, or
    released, less than ``grace_s`` before a report was received is not judged on it, since
    the allocator may not have acted on that report yet.
    """
    violations: list[Violation] = []
    gpus: dict[str, _GPU] = {
        uuid: _GPU(host, memory or 0, slots or 1)
        for uuid, host, memory, slots in conn.execute(
            "SELECT uuid, host, memory_total_mib, share_slots FROM gpus")
    }
    active_keys: dict[tuple[str | None, str], str] = {}
    """(owner, request key) -> its active lease: request keys are each owner's own."""
    bound: dict[str, tuple[str | None, str | None, float | None]] = {}
    """lease id -> (host, container id, bound at), for the live check."""
    # A ledger from before owners (schema 5) is read as every owner unknown.
    columns = {row[1] for row in conn.execute("PRAGMA table_info(leases)")}
    owner = "owner" if "owner" in columns else "NULL"
    cursor = conn.execute(
        "SELECT lease_id, request_key, state, host, gpu_uuids, shared, memory_mib, granted_at, "
        f"bound_at, container_id, released_at, release_reason, {owner} FROM leases")
    cursor.arraysize = 1000
    while chunk := cursor.fetchmany():
        for row in chunk:
            _check_lease(row, gpus, active_keys, bound, violations)
    for uuid, gpu in gpus.items():
        _check_gpu(uuid, gpu, violations)
    if reports:
        _check_reports(conn, reports, bound, grace_s, violations)
    return violations


def _check_lease(row: tuple[Any, ...], gpus: dict[str, _GPU],
                 active_keys: dict[tuple[str | None, str], str],
                 bound: dict[str, tuple[str | None, str | None, float | None]],
                 violations: list[Violation]) -> None:
    (lease_id, key, state, host, uuids_json, shared, memory, granted_at, bound_at,
     container_id, released_at, reason, owner) = row

    def report(kind: str, message: str, **where: Any) -> None:
        violations.append(Violation(kind, f"lease {lease_id}: {message}", lease_id=lease_id,
                                    host=where.pop("host", host), **where))

    if state not in _STATES:
        report("bad_state", f"unknown state {state!r}")
        return
    uuids = _uuid_list(uuids_json)
    if uuids is None:
        report("granted_without_gpus", f"gpu_uuids is not a JSON list: {uuids_json!r}")
        uuids = []
    if state in _ACTIVE:
        other = active_keys.get((owner, key))
        if other is not None:
            report("duplicate_request_key",
                   f"request key {key!r} of owner {owner!r} has two active leases ({other} "
                   f"and {lease_id})")
        else:
            active_keys[(owner, key)] = lease_id
    if state == LeaseState.QUEUED.value and uuids:
        report("queued_with_gpus", f"queued but lists GPUs {uuids}")
    if state in _HOLDING:
        if not uuids or not host or granted_at is None:
            missing = [name for name, ok in (("GPUs", uuids), ("a host", host),
                                             ("a grant time", granted_at is not None)) if not ok]
            report("granted_without_gpus", f"{state} without {', '.join(missing)}")
        if shared and (len(uuids) > 1 or memory is None):
            report("bad_share", f"a shared slice on {len(uuids)} GPUs with budget {memory!r}")
        for gpu_uuid in uuids:
            gpu = gpus.get(gpu_uuid)
            if gpu is None:
                report("unknown_gpu", f"holds GPU {gpu_uuid}, which no node ever reported",
                       gpu_uuid=gpu_uuid)
                continue
            if host and gpu.host != host:
                report("wrong_host", f"is on {host} but holds GPU {gpu_uuid} of {gpu.host}",
                       gpu_uuid=gpu_uuid)
            gpu.holders.append((lease_id, bool(shared), memory))
    if state == LeaseState.BOUND.value:
        if not container_id or bound_at is None:
            report("bound_without_container",
                   "bound without " + ("a container id" if not container_id else "a bind time"))
        bound[lease_id] = (host, container_id, bound_at)
    if state in _FINAL:
        if not reason or released_at is None:
            report("released_without_reason",
                   f"{state} without " + ("a release reason" if not reason
                                          else "a release time"))
        elif reason not in _REASONS:
            report("bad_reason", f"unknown release reason {reason!r}")


def _check_gpu(uuid: str, gpu: _GPU, violations: list[Violation]) -> None:
    holders = gpu.holders
    if not holders:
        return
    exclusive = [lease for lease, shared, _ in holders if not shared]
    if exclusive and len(holders) > 1:
        names = ", ".join(f"{lease} ({'shared' if shared else 'exclusive'})"
                          for lease, shared, _ in holders)
        violations.append(Violation(
            "exclusive_conflict",
            f"GPU {uuid} on {gpu.host} is held exclusively and by others: {names}",
            gpu_uuid=uuid, host=gpu.host, lease_id=exclusive[0]))
        return
    slices = [(lease, memory or 0) for lease, shared, memory in holders if shared]
    if len(slices) > gpu.share_slots:
        violations.append(Violation(
            "over_slots",
            f"GPU {uuid} on {gpu.host} has {len(slices)} slices but {gpu.share_slots} slots",
            gpu_uuid=uuid, host=gpu.host))
    budget = sum(memory for _, memory in slices)
    if budget > gpu.memory_total_mib:
        violations.append(Violation(
            "over_memory",
            f"GPU {uuid} on {gpu.host} promises {budget} MiB to slices but has "
            f"{gpu.memory_total_mib} MiB",
            gpu_uuid=uuid, host=gpu.host))


def _check_reports(conn: sqlite3.Connection, reports: Mapping[str, NodeReport],
                   bound: dict[str, tuple[str | None, str | None, float | None]],
                   grace_s: float, violations: list[Violation]) -> None:
    for lease_id, (host, container_id, bound_at) in bound.items():
        report = reports.get(host or "")
        if report is None or not report.complete:
            continue
        if bound_at is not None and report.received_at < bound_at + grace_s:
            continue  # the report may predate the container
        listed = report.containers.get(lease_id)
        if listed is None:
            violations.append(Violation(
                "bound_container_missing",
                f"lease {lease_id} is bound to container {container_id} on {host}, but the "
                "node's report does not list it", lease_id=lease_id, host=host))
        elif container_id and listed != container_id:
            violations.append(Violation(
                "bound_container_missing",
                f"lease {lease_id} is bound to container {container_id} on {host}, but the "
                f"node runs {listed} for it", lease_id=lease_id, host=host))
    for host, report in reports.items():
        for lease_id, container_id in report.containers.items():
            row = conn.execute("SELECT state, released_at FROM leases WHERE lease_id = ?",
                               (lease_id,)).fetchone()
            if row is not None and row[0] in _HOLDING:
                continue
            if row is not None and row[1] is not None and report.received_at < row[1] + grace_s:
                continue  # released just now; the container may be stopping
            what = "no lease of that id" if row is None else f"its lease is {row[0]}"
            violations.append(Violation(
                "orphan_container",
                f"{host} runs container {container_id} for lease {lease_id}, but {what}: its "
                "GPUs may be given to someone else", lease_id=lease_id, host=host))
        _check_grants(conn, host, report, violations)


def _check_grants(conn: sqlite3.Connection, host: str, report: NodeReport,
                  violations: list[Violation]) -> None:
    """The reported grants of one host against each other and against the ledger's leases."""
    known = {uuid: memory or 0 for uuid, memory in conn.execute(
        "SELECT uuid, memory_total_mib FROM gpus WHERE host = ?", (host,))}
    holders: dict[str, dict[str, tuple[bool, int]]] = {}
    """GPU uuid -> lease id -> (shared, memory budget), reported and ledger holders together."""
    for lease_id, shared, memory, uuids_json in conn.execute(
            "SELECT lease_id, shared, memory_mib, gpu_uuids FROM leases WHERE host = ? AND "
            f"state IN ({', '.join('?' for _ in _HOLDING)})", (host, *sorted(_HOLDING))):
        for gpu_uuid in _uuid_list(uuids_json) or []:
            holders.setdefault(gpu_uuid, {})[lease_id] = (bool(shared), memory or 0)
    for lease_id, grant in sorted(report.grants.items()):
        for gpu_uuid in grant.gpu_uuids:
            if grant.host != host or gpu_uuid not in known:
                violations.append(Violation(
                    "grant_conflict",
                    f"{host} runs a container of lease {lease_id} whose labels grant GPU "
                    f"{gpu_uuid} of {grant.host}, which the ledger does not know on {host}",
                    lease_id=lease_id, host=host, gpu_uuid=gpu_uuid))
                continue
            holders.setdefault(gpu_uuid, {})[lease_id] = (grant.shared, grant.memory_mib or 0)
    for gpu_uuid, held in sorted(holders.items()):
        if len(held) < 2 or gpu_uuid not in known or not set(held) & set(report.grants):
            continue  # the ledger's own conflicts are exclusive_conflict / over_memory
        names = ", ".join(f"{lease} ({'shared' if shared else 'exclusive'})"
                          for lease, (shared, _) in sorted(held.items()))
        if not all(shared for shared, _ in held.values()):
            violations.append(Violation(
                "grant_conflict", f"GPU {gpu_uuid} on {host} is claimed by running containers "
                f"or leases of which one is exclusive: {names}", host=host, gpu_uuid=gpu_uuid))
        elif sum(memory for _, memory in held.values()) > known[gpu_uuid]:
            violations.append(Violation(
                "grant_conflict", f"GPU {gpu_uuid} on {host}: the slices of {names} add up to "
                f"more than its {known[gpu_uuid]} MiB", host=host, gpu_uuid=gpu_uuid))


def _uuid_list(text: str | None) -> list[str] | None:
    if not text:
        return []
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, list):
        return None
    return [str(v) for v in value]
