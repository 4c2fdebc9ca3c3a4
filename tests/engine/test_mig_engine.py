"""MIG in the engine and the ledger: a GPU in MIG mode stays no unit of its own after the
allocator is rebuilt from its ledger, before its node reports again; a layout change is
applied from the heartbeat. Pure engine and a real SQLite ledger, no broker."""

from __future__ import annotations

import contextlib
from pathlib import Path

from allocator.config import AllocatorSettings
from allocator.engine import Engine
from allocator.ledger.changes import Changes
from allocator.ledger.store import Ledger
from allocator.wire.protocol import AllocateRequest, ErrorReply, LeaseReply
from tests.support.common import A100_40GB as A100
from tests.support.common import HUB, NODE
from tests.support.mig import PARENT, mig_beat


def test_mig_fields_survive_a_rebuild_from_the_ledger(tmp_path: Path) -> None:
    settings = AllocatorSettings(ledger_path=tmp_path / "ledger.sqlite", allow_any_node_user=True)
    engine = Engine(settings, started_at=0.0)
    changes = Changes()
    engine.handle(mig_beat(1, 1.0, ["1g.5gb", "1g.5gb"]), NODE, 1.0, changes)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open()
    ledger.call(lambda: ledger.commit(changes))
    rebuilt = Engine(settings, started_at=2.0)
    rebuilt.load(ledger.call(ledger.load), 2.0)
    ledger.close()

    parent = rebuilt.cluster.gpus[PARENT]
    assert parent.mig_enabled and not parent.placeable
    assert (parent.compute_capability, parent.architecture) == ("8.0", "ampere")
    instance = rebuilt.cluster.gpus["MIG-1g.5gb-1"]
    assert (instance.mig_parent_uuid, instance.mig_profile, instance.mig_index) == (
        PARENT, "1g.5gb", 1)
    assert [rebuilt.cluster.gpus[u].mig_index for u in rebuilt.cluster.nodes["m"].gpu_uuids] \
        == [None, 0, 1]
    # Before the node reports again: every unit can be granted, the parent never.
    granted: list[str] = []
    for n in range(3):
        reply = rebuilt.handle(AllocateRequest(request_key=f"k{n}", user="u"), HUB, 2.5,
                               Changes())
        if isinstance(reply, ErrorReply):
            break
        assert isinstance(reply, LeaseReply)
        granted += reply.lease.gpu_uuids
    assert sorted(granted) == ["MIG-1g.5gb-0", "MIG-1g.5gb-1"]


def test_mig_mode_off_makes_the_gpu_a_unit_again(tmp_path: Path) -> None:
    settings = AllocatorSettings(ledger_path=tmp_path / "ledger.sqlite", allow_any_node_user=True)
    engine = Engine(settings, started_at=0.0)
    engine.handle(mig_beat(1, 1.0, ["7g.40gb"]), NODE, 1.0, Changes())
    refused = engine.handle(AllocateRequest(request_key="k", user="u", model=A100), HUB, 1.5,
                            Changes())
    assert isinstance(refused, ErrorReply)
    engine.handle(mig_beat(2, 2.0, [], mig_mode=False), NODE, 2.0, Changes())
    reply = engine.handle(AllocateRequest(request_key="k", user="u", model=A100), HUB, 2.5,
                          Changes())
    assert isinstance(reply, LeaseReply) and reply.lease.gpu_uuids == [PARENT]
    assert not engine.cluster.gpus["MIG-7g.40gb-0"].present


def test_a_ledger_of_schema_1_is_migrated_and_keeps_its_gpus(tmp_path: Path) -> None:
    import sqlite3

    import sqlite_utils

    from allocator.ledger.schema import SCHEMA_VERSION
    from allocator.ledger.store import MIGRATIONS

    path = tmp_path / "old.sqlite"
    db = sqlite_utils.Database(sqlite3.connect(str(path)))
    MIGRATIONS[0](db)
    db.execute("PRAGMA user_version = 1")
    db.table("gpus").insert({"uuid": "GPU-old", "host": "m", "idx": 0, "model": A100,
                       "memory_total_mib": 40960, "health": "healthy", "present": 1,
                       "share_slots": 1, "drained": 0})
    db.table("nodes").insert({"host": "m", "drained": 0})
    db.conn.commit()
    db.conn.close()
    ledger = Ledger(path)
    ledger.open()
    try:
        loaded = ledger.call(ledger.load)
    finally:
        ledger.close()
    with contextlib.closing(sqlite3.connect(str(path))) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    (gpu,) = loaded.gpus
    assert gpu.uuid == "GPU-old" and not gpu.mig_enabled and gpu.compute_capability is None
