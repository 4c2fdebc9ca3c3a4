"""The cluster's status: from the ledger (:func:`ledger_status`) or from the running
allocator's replies (:func:`live_status`), as data; ``gpu-ledger status`` renders it."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from allocator.admin.reports import HOLDING_STATES, json_list
from allocator.placement.queue_order import queue_order_key
from allocator.wire.protocol import InventoryReply, Lease, LeaseState


@dataclass(frozen=True)
class SlotHolder:
    """A lease holding (part of) a GPU."""

    lease_id: str
    user: str
    state: str
    shared: bool
    memory_mib: int | None = None
    over_budget_since: float | None = None
    """A slice over its memory budget past the grace since then (live status only)."""
    outside_grant: tuple[str, ...] = ()
    """GPUs its container uses that it was not granted (live status only)."""


@dataclass(frozen=True)
class GPUProcessStatus:
    """A process using a GPU, as its agent reported it (live status only)."""

    pid: int
    memory_used_mib: int | None
    container_id: str | None
    container_name: str
    image: str
    lease_id: str | None

    def describe(self) -> str:
        """``pid 42 in container stray (lab/x:1)``, ``pid 42 of lease abc12345``, ``pid 42 on
        the host``."""
        if self.container_id is None:
            where = "on the host"
        elif self.lease_id is not None:
            where = f"of lease {self.lease_id[:8]}"
        else:
            where = f"in container {self.container_name or self.container_id[:12]}" + (
                f" ({self.image})" if self.image else "")
        return f"pid {self.pid} {where}"


@dataclass
class GPUStatus:
    """One GPU as the status report shows it."""

    uuid: str
    host: str
    index: int
    model: str
    memory_total_mib: int
    memory_used_mib: int | None
    utilization_pct: float | None
    temperature_c: float | None
    health: str
    health_reasons: list[str]
    drained: bool
    share_slots: int
    holders: list[SlotHolder] = field(default_factory=list)
    process_state: str | None = None
    """``draining``, ``stuck_process`` or ``outside_use`` (live status only: memory of the
    running allocator, not in the ledger)."""
    processes: list[GPUProcessStatus] | None = None
    """The processes on it, newest report (live status only; None: not known)."""

    @property
    def state(self) -> str:
        """``stuck_process``, ``outside_use``, ``held``, ``draining``, ``unhealthy``,
        ``drained`` or ``free``, the first that applies (as the GPU-state metric orders
        them)."""
        if self.process_state in ("stuck_process", "outside_use"):
            return self.process_state
        if self.holders:
            return "held"
        if self.process_state == "draining":
            return "draining"
        if self.health != "healthy":
            return "unhealthy"
        return "drained" if self.drained else "free"


@dataclass(frozen=True)
class HostStatus:
    """One node."""

    host: str
    up: bool
    drained: bool
    last_heartbeat: float | None
    gpus: int


@dataclass(frozen=True)
class QueuedRequest:
    """A request waiting for GPUs, in serving order."""

    position: int
    lease_id: str
    user: str
    request_key: str
    models: list[str] | None
    count: int | str
    shared: bool
    priority: int
    enqueued_at: float | None
    wait_until: float | None


@dataclass
class ClusterStatus:
    """The cluster at a glance, from the ledger or from the live allocator."""

    at: float
    source: str
    hosts: list[HostStatus]
    gpus: list[GPUStatus]
    queued: list[QueuedRequest]

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (for ``gpu-ledger status --json``)."""
        return {
            "at": self.at, "source": self.source,
            "hosts": [vars(h) for h in self.hosts],
            "gpus": [{**{k: v for k, v in vars(g).items() if k not in ("holders", "processes")},
                      "state": g.state, "holders": [vars(h) for h in g.holders],
                      "processes": None if g.processes is None
                      else [vars(p) for p in g.processes]}
                     for g in self.gpus],
            "queued": [vars(q) for q in self.queued],
        }


def ledger_status(conn: sqlite3.Connection, *, now: float,
                  down_after_s: float = 15.0) -> ClusterStatus:
    """The cluster as the ledger records it.

    A node counts as up when its last recorded heartbeat is within ``down_after_s`` of
    ``now`` (the running allocator writes each heartbeat's receipt time).
    """
    hosts = [
        HostStatus(host=host, up=last is not None and now - last <= down_after_s,
                   drained=bool(drained), last_heartbeat=last, gpus=int(count or 0))
        for host, last, drained, count in conn.execute(
            "SELECT n.host, n.last_heartbeat, n.drained, "
            "(SELECT COUNT(*) FROM gpus g WHERE g.host = n.host AND g.present) "
            "FROM nodes n ORDER BY n.host")
    ]
    holders: dict[str, list[SlotHolder]] = {}
    marks = ", ".join("?" for _ in HOLDING_STATES)
    for lease_id, user, state, shared, memory, uuids in conn.execute(
            f"SELECT lease_id, user, state, shared, memory_mib, gpu_uuids FROM leases "
            f"WHERE state IN ({marks}) ORDER BY created_at", HOLDING_STATES):
        for gpu_uuid in json_list(uuids):
            holders.setdefault(str(gpu_uuid), []).append(
                SlotHolder(lease_id, user, state, bool(shared), memory))
    gpus = [
        GPUStatus(uuid=row[0], host=row[1], index=row[2], model=row[3],
                  memory_total_mib=row[4] or 0, memory_used_mib=row[5],
                  utilization_pct=row[6], temperature_c=row[7], health=row[8] or "healthy",
                  health_reasons=[str(r) for r in json_list(row[9])], drained=bool(row[10]),
                  share_slots=row[11] or 1, holders=holders.get(row[0], []))
        for row in conn.execute(
            "SELECT uuid, host, idx, model, memory_total_mib, memory_used_mib, utilization_pct,"
            " temperature_c, health, health_reasons, drained, share_slots FROM gpus "
            "WHERE present ORDER BY host, idx")
    ]
    queued_rows = list(conn.execute(
        "SELECT lease_id, user, request_key, request, priority, enqueued_at, created_at, "
        "wait_until FROM leases WHERE state = ?", (LeaseState.QUEUED.value,)))
    queued_rows.sort(key=lambda r: queue_order_key(r[4] or 0, r[5] or r[6], r[0]))
    queued = []
    for position, (lease_id, user, key, request_json, priority, enqueued, _created,
                   wait_until) in enumerate(queued_rows, start=1):
        request = _json_object(request_json)
        queued.append(QueuedRequest(
            position=position, lease_id=lease_id, user=user, request_key=key,
            models=_requested_models(request), count=request.get("count", 1),
            shared=request.get("share") is not None, priority=priority or 0,
            enqueued_at=enqueued, wait_until=wait_until))
    return ClusterStatus(at=now, source="ledger", hosts=hosts, gpus=gpus, queued=queued)


def live_status(inventory: InventoryReply, queue: Iterable[Lease]) -> ClusterStatus:
    """The cluster as the running allocator reports it (inventory with leases, and queue)."""
    leases = {lease.lease_id: lease for lease in inventory.leases or []}
    hosts = [HostStatus(host=n.host, up=n.up, drained=n.drained,
                        last_heartbeat=n.last_heartbeat, gpus=n.gpus) for n in inventory.nodes]
    gpus = []
    for g in inventory.gpus:
        holders = []
        for lease_id in g.holders:
            lease = leases.get(lease_id)
            holders.append(SlotHolder(
                lease_id, lease.user if lease else "?", lease.state.value if lease else "?",
                lease.shared if lease else False, lease.memory_mib if lease else None,
                over_budget_since=lease.over_budget_since if lease else None,
                outside_grant=tuple(lease.outside_grant) if lease else ()))
        processes = None if g.processes is None else [
            GPUProcessStatus(pid=p.pid, memory_used_mib=p.memory_used_mib,
                             container_id=p.container_id, container_name=p.container_name,
                             image=p.image, lease_id=p.lease_id) for p in g.processes]
        gpus.append(GPUStatus(
            uuid=g.uuid, host=g.host, index=g.index, model=g.model,
            memory_total_mib=g.memory_total_mib, memory_used_mib=g.memory_used_mib,
            utilization_pct=g.utilization_pct, temperature_c=g.temperature_c,
            health=g.health.value, health_reasons=list(g.health_reasons), drained=g.drained,
            share_slots=g.share_slots, holders=holders,
            process_state=None if g.process_state is None else g.process_state.value,
            processes=processes))
    queued = []
    for position, lease in enumerate(queue, start=1):
        queued.append(QueuedRequest(
            position=lease.queue_position or position, lease_id=lease.lease_id,
            user=lease.user, request_key=lease.request_key, models=None, count="?",
            shared=lease.shared, priority=0, enqueued_at=lease.created_at,
            wait_until=lease.wait_until))
    return ClusterStatus(at=inventory.at, source="live", hosts=hosts, gpus=gpus, queued=queued)


def _json_object(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _requested_models(request: dict[str, Any]) -> list[str] | None:
    if request.get("model"):
        return [str(request["model"])]
    models = request.get("models")
    return [str(m) for m in models] if isinstance(models, list) else None
