"""The ledger's schema as data: its version, every table's columns and their types (each
migration's written once), the primary keys and the JSON columns. Pure: no SQLite here; the
migrations that create it are :mod:`allocator.ledger.store`'s."""

from __future__ import annotations

SCHEMA_VERSION = 8
"""The schema this code writes. Bump it and append to
:data:`allocator.ledger.store.MIGRATIONS` together."""

LEASE_JSON_COLUMNS = ("groups", "gpu_uuids", "env", "request")

# The columns each migration creates, written once: the migrations create them and
# :data:`COLUMNS` (the current schema) is their union. A released migration's columns never
# change; a new column is a new migration with a constant of its own.
NODES_V1: dict[str, type] = {
    "host": str, "agent_id": str, "agent_user": str, "first_seen": float,
    "last_heartbeat": float, "drained": int, "drain_reason": str, "drained_by": str,
    "drained_at": float,
}
GPUS_V1: dict[str, type] = {
    "uuid": str, "host": str, "idx": int, "model": str, "memory_total_mib": int,
    "memory_used_mib": int, "utilization_pct": float, "temperature_c": float,
    "power_w": float, "health": str, "health_reasons": str, "drained": int,
    "present": int, "share_slots": int, "first_seen": float, "updated_at": float,
}
GPUS_V2: dict[str, type] = {
    "compute_capability": str, "architecture": str, "mig_enabled": int, "mig_parent_uuid": str,
    "mig_profile": str, "mig_index": int,
}
LEASES_V1: dict[str, type] = {
    "lease_id": str, "request_key": str, "user": str, "groups": str, "state": str,
    "created_at": float, "request": str, "priority": int, "host": str,
    "gpu_uuids": str, "model": str, "shared": int, "memory_mib": int, "units": float,
    "units_num": int, "units_den": int, "env": str, "enqueued_at": float,
    "wait_until": float, "granted_at": float, "bind_deadline": float, "bound_at": float,
    "container_id": str, "releasing_at": float, "released_at": float,
    "release_reason": str, "released_by": str, "release_note": str,
}
LEASES_V4: dict[str, type] = {
    "borrowed": int, "reclaim_at": float, "reclaim_reason": str, "reclaim_for": str,
    "reclaim_stopped_at": float, "idle_since": float, "idle_gpu_s": float,
}
LEASES_V6: dict[str, type] = {"owner": str}
LEASES_V8: dict[str, type] = {
    "usage_since": float, "energy_j": float, "sm_s": float, "memory_s": float,
    "peak_memory_mib": int, "usage_run_energy_j": float, "usage_run_sm_s": float,
    "usage_run_memory_s": float,
}
HISTORY_V1: dict[str, type] = {
    "id": int, "lease_id": str, "at": float, "from_state": str, "to_state": str, "reason": str,
    "by": str,
}
EVENTS_V1: dict[str, type] = {
    "id": int, "at": float, "kind": str, "host": str, "lease_id": str, "user": str,
    "gpu_uuid": str, "detail": str,
}
LOG_POSITION_V3: dict[str, type] = {
    "id": int, "log_id": str, "log_offset": int, "entry_id": str, "epoch": int, "writer": str,
}
LOG_POSITION_V5: dict[str, type] = {"snapshot_from": int, "bytes_since_snapshot": int}
BOOKINGS_V7: dict[str, type] = {
    "name": str, "booking": str, "created_at": float, "created_by": str, "removed_at": float,
    "removed_by": str,
}
COLUMNS: dict[str, dict[str, type]] = {
    "nodes": NODES_V1,
    "gpus": {**GPUS_V1, **GPUS_V2},
    "leases": {**LEASES_V1, **LEASES_V4, **LEASES_V6, **LEASES_V8},
    "lease_history": HISTORY_V1,
    "events": EVENTS_V1,
    "log_position": {**LOG_POSITION_V3, **LOG_POSITION_V5},
    "bookings": BOOKINGS_V7,
}
"""Every table of the schema this code writes (:data:`SCHEMA_VERSION`), with its columns and
their types in order of creation. No other table or column name ever reaches SQL: a change
set naming another is refused (:class:`~allocator.ledger.change_set.ChangeSet`)."""


PRIMARY_KEYS = {"nodes": "host", "gpus": "uuid", "leases": "lease_id", "lease_history": "id",
                "events": "id", "log_position": "id", "bookings": "name"}
JSON_COLUMNS: dict[str, tuple[str, ...]] = {"leases": LEASE_JSON_COLUMNS,
                                            "gpus": ("health_reasons",),
                                            "bookings": ("booking",)}
"""Text columns holding JSON: a change set carries their values as lists and objects."""
