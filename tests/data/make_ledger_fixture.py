"""Write a small ledger with the ``allocator`` package that is importable: run it with an
older release's code to make the fixture of that release's schema.

    git worktree add /tmp/old-v1 93c7617
    PYTHONPATH=/tmp/old-v1 .venv/bin/python tests/data/make_ledger_fixture.py \\
        tests/data/ledger-v1.db
    git worktree remove /tmp/old-v1

The commits each fixture was made with are in ``tests/ledger/test_ledger_migrations.py``
(``FIXTURES``). Everything is written through that release's own ``Ledger.commit`` (its
``Changes``, ``LeaseRecord``, ``GPU`` and ``Node``), so the rows are what that release wrote;
only features the release has are used (a log position from schema 3 on). The contents, for
the tests to check after the migration: two hosts, four GPUs, five leases (bound, a bound
slice, granted, queued, released; owned by the broker user ``hub`` from schema 6 on), their
history and three events (from schema 7 on, two bookings, one of them removed, and a fourth
event; from schema 8 on, the released lease's measured usage); all times fixed.
"""

from __future__ import annotations

import dataclasses
import inspect
import sqlite3
import sys
from fractions import Fraction
from pathlib import Path

try:  # the layout of 0.3.0 on
    import allocator.ledger.store as ledger_module
    from allocator.ledger.lease import LeaseRecord
    from allocator.placement.cluster import GPU, Node
    from allocator.wire.protocol import LeaseState, ReleaseReason
except ImportError:  # a release before 0.3.0: one flat package
    from allocator.cluster import GPU, Node  # type: ignore[no-redef,import-not-found]
    from allocator.lease import LeaseRecord  # type: ignore[no-redef,import-not-found]
    from allocator.protocol import (  # type: ignore[no-redef,import-not-found]
        LeaseState,
        ReleaseReason,
    )

    import allocator.ledger as ledger_module  # type: ignore[no-redef]
Ledger = ledger_module.Ledger
try:  # the batch's writes in a module of their own
    from allocator.ledger.changes import Changes
except ImportError:  # before: in the store's module (or the flat package's)
    Changes = ledger_module.Changes  # type: ignore[attr-defined,misc]

T0 = 1_750_000_000.0
GTX1070 = "NVIDIA GeForce GTX 1070"
RTX3090 = "NVIDIA GeForce RTX 3090"


def lease(lease_id: str, user: str, state: LeaseState, **fields: object) -> LeaseRecord:
    """A lease with what every release's LeaseRecord has."""
    known = {f.name for f in dataclasses.fields(LeaseRecord)}
    values: dict[str, object] = {
        "lease_id": lease_id, "request_key": f"hub/{user}/", "user": user, "groups": ("lab",),
        "state": state, "created_at": T0 + 10, "request": {"user": user, "count": 1},
        "owner": "hub",  # the broker user that asked (schema 6 on)
    }
    values.update(fields)
    return LeaseRecord(**{k: v for k, v in values.items() if k in known})  # type: ignore[arg-type]


def main() -> None:
    path = Path(sys.argv[1])
    path.unlink(missing_ok=True)
    ledger = Ledger(path)
    ledger.open()
    changes = Changes()
    a = Node(host="gpu-a", agent_id="agent-a", last_heartbeat=T0 + 100)
    b = Node(host="gpu-b", agent_id="agent-b", last_heartbeat=T0 + 100)
    changes.node(a, agent_user="agent-gpu-a", first_seen=T0)
    changes.node(b, agent_user="agent-gpu-b", first_seen=T0)
    gpus = [GPU(uuid="GPU-a0", host="gpu-a", index=0, model=GTX1070, memory_total_mib=8192,
                share_slots=2),
            GPU(uuid="GPU-a1", host="gpu-a", index=1, model=GTX1070, memory_total_mib=8192,
                share_slots=2),
            GPU(uuid="GPU-b0", host="gpu-b", index=0, model=RTX3090, memory_total_mib=24576),
            GPU(uuid="GPU-b1", host="gpu-b", index=1, model=GTX1070, memory_total_mib=8192)]
    for gpu in gpus:
        changes.gpu(gpu, T0 + 100, first_seen=T0)
    leases = [
        lease("L-bound", "alice", LeaseState.BOUND, host="gpu-b", gpu_uuids=("GPU-b0",),
              model=RTX3090, units=Fraction(1), granted_at=T0 + 11, bind_deadline=T0 + 71,
              bound_at=T0 + 15, container_id="c-alice",
              env={"NVIDIA_VISIBLE_DEVICES": "GPU-b0", "SWARM_GPU_LEASE": "L-bound"}),
        lease("L-slice", "bob", LeaseState.BOUND, host="gpu-a", gpu_uuids=("GPU-a0",),
              model=GTX1070, shared=True, memory_mib=4096, units=Fraction(1, 2),
              granted_at=T0 + 21, bind_deadline=T0 + 81, bound_at=T0 + 25,
              container_id="c-bob", env={"NVIDIA_VISIBLE_DEVICES": "GPU-a0"}),
        lease("L-granted", "carol", LeaseState.GRANTED, host="gpu-a", gpu_uuids=("GPU-a1",),
              model=GTX1070, units=Fraction(1), granted_at=T0 + 31, bind_deadline=T0 + 91),
        lease("L-queued", "dave", LeaseState.QUEUED, enqueued_at=T0 + 41,
              wait_until=T0 + 641, request={"user": "dave", "model": "3090", "count": 1}),
        lease("L-done", "erin", LeaseState.RELEASED, host="gpu-b", gpu_uuids=("GPU-b1",),
              model=GTX1070, units=Fraction(1), granted_at=T0 + 1, bind_deadline=T0 + 61,
              bound_at=T0 + 3, container_id="c-erin", released_at=T0 + 50,
              release_reason=ReleaseReason.CONTAINER_EXITED, released_by="node gpu-b",
              # its measured usage (schema 8 on): 47 s of one GPU, 12 kJ, half of it busy
              usage_since=T0 + 3, energy_j=12_000.0, sm_s=23.5, memory_s=4.7,
              peak_memory_mib=3100, usage_run_energy_j=12_000.0, usage_run_sm_s=23.5,
              usage_run_memory_s=4.7),
    ]
    for record in leases:
        changes.transition(record, None, record.created_at, "requested")
    changes.event(T0, "node_joined", host="gpu-a")
    changes.event(T0, "node_joined", host="gpu-b")
    changes.event(T0 + 50, "lease_released", lease_id="L-done", user="erin", host="gpu-b",
                  reason="container_exited")
    booking_row = getattr(ledger_module, "BookingRow", None)
    if booking_row is not None:  # schema 7 on: a weekly lab, and one removed
        lab = {"name": "CS101 lab", "group": "lab", "users": None,
               "gpus": {"model": GTX1070, "mig_profile": None, "count": 2, "host": None},
               "zone": "Europe/Berlin",
               "window": {"kind": "weekly", "weekdays": ["tue"], "start": "10:00:00",
                          "duration_s": 7200, "starts_on": None, "until": "2025-08-26"},
               "lead_s": 900, "quota_applies": True, "created_by": "admin"}
        changes.booking(booking_row("CS101 lab", lab, T0 + 5, "admin (admin)"))
        changes.booking(booking_row("old lab", {**lab, "name": "old lab"}, T0 + 6,
                                    "admin (admin)", removed_at=T0 + 7,
                                    removed_by="admin (admin)"))
        changes.event(T0 + 5, "booking_added", booking="CS101 lab", by="admin (admin)")
    position_class = getattr(ledger_module, "LogPosition", None)
    if position_class is not None and "position" in inspect.signature(Ledger.commit).parameters:
        position = position_class(log_id="log-fixture", offset=41, entry_id="entry-41",
                                  epoch=2, writer="allocator-1")
        ledger.call(lambda: ledger.commit(changes, position=position))
    else:
        ledger.call(lambda: ledger.commit(changes))
    ledger.close()
    # Small: one file (no -wal), small pages (each table and index takes one), none free.
    conn = sqlite3.connect(path)
    try:
        conn.execute("PRAGMA journal_mode = DELETE")
        conn.execute("PRAGMA page_size = 512")
        conn.execute("VACUUM")
    finally:
        conn.close()


if __name__ == "__main__":
    main()
