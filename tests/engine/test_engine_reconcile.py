"""Heartbeat reconciliation looks at the heartbeat's own host only (the engine's per-host index),
also after the engine was rebuilt from the ledger. Pure engine, no broker."""

from __future__ import annotations

from pathlib import Path

from allocator.config import AllocatorSettings
from allocator.engine import Engine
from allocator.ledger.changes import Changes
from allocator.ledger.store import Ledger
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerAction,
    ContainerEvent,
    ContainerInfo,
    GPUInfo,
    Heartbeat,
    LeaseReply,
    LeaseState,
    ReleaseReason,
)
from tests.support.common import HUB, NODE


def beat(host: str, seq: int, at: float, containers: list[ContainerInfo]) -> Heartbeat:
    return Heartbeat(host=host, agent_id=f"agent-{host}", seq=seq, sent_at=at, interval_s=2,
                     gpus=[GPUInfo(uuid=f"GPU-{host}", index=0, model="NVIDIA GeForce GTX 1070",
                                   memory_total_mib=8192)],
                     containers=containers, containers_complete=True, source="simulated")


def test_a_heartbeat_releases_only_its_own_hosts_leases(tmp_path: Path) -> None:
    settings = AllocatorSettings(ledger_path=tmp_path / "ledger.sqlite", allow_any_node_user=True,
                                 container_gone_grace_s=1.0)
    engine = Engine(settings, started_at=0.0)
    changes = Changes()
    for host in ("a", "b"):
        engine.handle(beat(host, 0, 1.0, []), NODE, 1.0, changes)
    leases = {}
    for host in ("a", "b"):
        reply = engine.handle(AllocateRequest(request_key=f"k-{host}", user="u", host=host),
                              HUB, 2.0, changes)
        assert isinstance(reply, LeaseReply)
        leases[host] = reply.lease.lease_id
        engine.handle(ContainerEvent(host=host, container_id=f"c-{host}",
                                     lease_id=leases[host], action=ContainerAction.START,
                                     at=2.0), NODE, 2.0, changes)
    running = {h: [ContainerInfo(container_id=f"c-{h}", lease_id=leases[h])] for h in "ab"}

    # b's complete listing without a's container says nothing about a.
    engine.handle(beat("b", 1, 10.0, running["b"]), NODE, 10.0, changes)
    assert engine.leases[leases["a"]].state is LeaseState.BOUND

    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open()
    ledger.call(lambda: ledger.commit(changes))
    rebuilt = Engine(settings, started_at=11.0)
    rebuilt.load(ledger.call(ledger.load), 11.0)
    ledger.close()
    for engine_ in (engine, rebuilt):
        changes = Changes()
        engine_.handle(beat("b", 2, 12.0, running["b"]), NODE, 12.0, changes)
        assert engine_.leases[leases["a"]].state is LeaseState.BOUND
        engine_.handle(beat("a", 1, 12.0, []), NODE, 12.0, changes)
        assert leases["a"] not in engine_.leases
        assert engine_.recent[leases["a"]].release_reason is ReleaseReason.CONTAINER_GONE
        assert engine_.leases[leases["b"]].state is LeaseState.BOUND
