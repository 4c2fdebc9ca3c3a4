"""The writes of one batch (:class:`Changes`), which the engine fills and the ledger commits
in one transaction; pure, no SQLite."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from allocator.ledger.lease import LeaseRecord
from allocator.ledger.loaded import BookingRow
from allocator.ledger.schema import LEASES_V8
from allocator.placement.cluster import GPU, Node
from allocator.wire.protocol import LeaseState


@dataclass
class Changes:
    """Writes of one batch, committed together. Later writes of one row replace earlier ones."""

    leases: dict[str, dict[str, Any]] = field(default_factory=dict)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    gpus: dict[str, dict[str, Any]] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    bookings: dict[str, dict[str, Any]] = field(default_factory=dict)

    def lease(self, record: LeaseRecord) -> None:
        """Write the lease's current row."""
        self.leases[record.lease_id] = record.to_row()

    def transition(
        self, record: LeaseRecord, old: LeaseState | None, at: float, reason: str, by: str = ""
    ) -> None:
        """Write the lease and one line of its state history."""
        self.lease(record)
        self.history.append(
            {"lease_id": record.lease_id, "at": at, "from_state": old.value if old else None,
             "to_state": record.state.value, "reason": reason, "by": by}
        )

    def node(self, node: Node, *, agent_user: str | None = None, first_seen: float | None = None,
             drain_reason: str | None = None, drained_by: str | None = None,
             drained_at: float | None = None) -> None:
        """Write a node's row."""
        row = self.nodes.setdefault(node.host, {"host": node.host})
        row.update(agent_id=node.agent_id, last_heartbeat=node.last_heartbeat,
                   drained=int(node.drained))
        for key, value in (("agent_user", agent_user), ("first_seen", first_seen),
                           ("drain_reason", drain_reason), ("drained_by", drained_by),
                           ("drained_at", drained_at)):
            if value is not None:
                row[key] = value

    def gpu(self, gpu: GPU, at: float, *, first_seen: float | None = None) -> None:
        """Write a GPU's row (identity, state and its latest telemetry)."""
        row = {
            "uuid": gpu.uuid, "host": gpu.host, "idx": gpu.index, "model": gpu.model,
            "memory_total_mib": gpu.memory_total_mib, "memory_used_mib": gpu.memory_used_mib,
            "utilization_pct": gpu.utilization_pct, "temperature_c": gpu.temperature_c,
            "power_w": gpu.power_w, "health": gpu.health.value,
            "health_reasons": list(gpu.health_reasons), "drained": int(gpu.drained),
            "present": int(gpu.present), "share_slots": gpu.share_slots, "updated_at": at,
            "compute_capability": gpu.compute_capability, "architecture": gpu.architecture,
            "mig_enabled": int(gpu.mig_enabled), "mig_parent_uuid": gpu.mig_parent_uuid,
            "mig_profile": gpu.mig_profile, "mig_index": gpu.mig_index,
        }
        if first_seen is not None:
            row["first_seen"] = first_seen
        self.gpus.setdefault(gpu.uuid, {}).update(row)

    def event(self, at: float, kind: str, **detail: Any) -> None:
        """Append to the event log. ``host``, ``lease_id``, ``user``, ``gpu_uuid`` get columns."""
        row = {"at": at, "kind": kind}
        for column in ("host", "lease_id", "user", "gpu_uuid"):
            row[column] = detail.pop(column, None)
        row["detail"] = json.dumps(detail, default=str) if detail else None
        self.events.append(row)

    def booking(self, row: BookingRow) -> None:
        """Write a booking's row (added, or marked removed)."""
        self.bookings[row.name] = {
            "name": row.name, "booking": row.booking, "created_at": row.created_at,
            "created_by": row.created_by, "removed_at": row.removed_at,
            "removed_by": row.removed_by}

    def __bool__(self) -> bool:
        return bool(self.leases or self.nodes or self.gpus or self.history or self.events
                    or self.bookings)

    def to_json(self) -> dict[str, Any]:
        """The batch as plain JSON (rows are JSON-able already), for the replicated log: a
        lease's owner beside its row (:data:`LEASE_OWNERS`), never in it."""
        leases, owners, usage = [], {}, {}
        for row in self.leases.values():
            if OWNER_COLUMN in row or not USAGE_COLUMNS.isdisjoint(row):
                row = dict(row)
                owner = row.pop(OWNER_COLUMN, None)
                if owner is not None:  # an owner is set once, at the lease's making
                    owners[row["lease_id"]] = owner
                measured = {c: row.pop(c) for c in USAGE_COLUMNS if c in row}
                if any(value is not None for value in measured.values()):
                    usage[row["lease_id"]] = measured
            leases.append(row)
        data: dict[str, Any] = {"leases": leases, "nodes": list(self.nodes.values()),
                                "gpus": list(self.gpus.values()), "history": self.history,
                                "events": self.events}
        if owners:
            data[LEASE_OWNERS] = owners
        if usage:  # a batch without measured usage is written as before (0.2.0 reads it)
            data[LEASE_USAGE_BESIDE] = usage
        if self.bookings:  # a batch without bookings is written as before (0.2.0 reads it)
            data["bookings"] = list(self.bookings.values())
        return data

    @classmethod
    def from_json(cls, data: object) -> Changes:
        """The batch :meth:`to_json` made, checked against the schema
        (:class:`~allocator.ledger.change_set.ChangeSet`);
        :class:`~allocator.ledger.change_set.BrokenChanges` if it is not one this ledger can
        write."""
        # Here, not at the top: the change set makes Changes (ChangeSet.to_changes).
        from allocator.ledger.change_set import ChangeSet

        return ChangeSet.parse(data).to_changes()


OWNER_COLUMN = "owner"
"""The lease column that travels beside the lease rows in the replicated log."""


LEASE_OWNERS = "lease_owners"
"""Where a lease's owner travels in the replicated log: beside the lease rows, not in them
(a change set's ``lease_owners``, lease id -> owner; a snapshot's table of that name,
columns ``lease_id`` and ``owner``). Release 0.1.0 writes every key of a lease row as a
column, and a column its schema lacks stops it; it reads only the lists of a change set and
the tables of a snapshot it knows. So a 0.1.0 replica follows a log this release writes,
with no owner in its ledger (owner unknown: any hub may release, as in 0.1.0)."""


USAGE_COLUMNS = frozenset(LEASES_V8)
"""The lease columns of measured usage (schema 8), which travel beside the lease rows in the
replicated log, as the owner does."""

LEASE_USAGE_BESIDE = "lease_usage"
"""Where a lease's measured usage travels in the replicated log: beside the lease rows (a
change set's ``lease_usage``, lease id -> its usage columns; a snapshot's table of that name,
columns ``lease_id`` and :data:`USAGE_COLUMNS`), so that a replica of 0.2.0, whose schema has
no such column and which refuses a row with one, follows a log this release writes (without
the usage) just as 0.1.0 does with owners."""
