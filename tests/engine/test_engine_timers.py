"""The tick's timers fire for every lease that has one, whichever way the lease got there:
the tick looks only at the leases it indexed as timed (queued, granted, releasing), so a lease
that reaches such a state after ticks that saw it bound must still be seen. Pure engine, no
broker."""

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
    GPUInfo,
    Heartbeat,
    LeaseReply,
    LeaseState,
    ReleaseReason,
    ReleaseRequest,
)
from tests.support.common import HUB, NODE

STOP_GRACE_S = 40.0


def beat(host: str, seq: int, at: float) -> Heartbeat:
    # Containers not listed (incomplete): the heartbeat says nothing about the lease's
    # container, so only the silence timer can end a release.
    return Heartbeat(host=host, agent_id=f"agent-{host}", seq=seq, sent_at=at, interval_s=2,
                     gpus=[GPUInfo(uuid=f"GPU-{host}-{i}", index=i, model="NVIDIA GeForce GTX 1070",
                                   memory_total_mib=8192) for i in range(2)],
                     containers=[], containers_complete=False, source="simulated")


def engine_with_bound_lease(tmp_path: Path) -> tuple[Engine, str]:
    settings = AllocatorSettings(ledger_path=tmp_path / "ledger.sqlite", allow_any_node_user=True,
                                 admin_users=["hub"], stop_grace_s=STOP_GRACE_S,
                                 node_down_after_s=STOP_GRACE_S / 2, bind_timeout_s=30)
    engine = Engine(settings, started_at=0.0)
    changes = Changes()
    engine.handle(beat("a", 0, 1.0), NODE, 1.0, changes)
    reply = engine.handle(AllocateRequest(request_key="k/", user="u"), HUB, 2.0, changes)
    assert isinstance(reply, LeaseReply)
    lease_id = reply.lease.lease_id
    engine.handle(ContainerEvent(host="a", container_id="c1", lease_id=lease_id,
                                 action=ContainerAction.START, at=2.0), NODE, 2.0, changes)
    assert engine.leases[lease_id].state is LeaseState.BOUND
    return engine, lease_id


def test_a_release_after_ticks_saw_the_lease_bound_ends_when_its_node_stays_silent(
        tmp_path: Path) -> None:
    engine, lease_id = engine_with_bound_lease(tmp_path)
    changes = Changes()
    for at in (3.0, 4.0):  # ticks while it is bound: nothing to time
        engine.tick(at, changes)
    engine.handle(beat("a", 1, 5.0), NODE, 5.0, changes)
    engine.handle(ReleaseRequest(lease_id=lease_id, by="hub"), HUB, 5.0, changes)
    assert engine.leases[lease_id].state is LeaseState.RELEASING
    engine.tick(5.0 + STOP_GRACE_S - 1, changes)
    assert engine.leases[lease_id].state is LeaseState.RELEASING  # not silent long enough
    engine.tick(5.0 + STOP_GRACE_S + 1, changes)
    assert lease_id not in engine.leases
    assert engine.recent[lease_id].release_reason is ReleaseReason.NODE_SILENT


def test_timers_fire_for_leases_loaded_from_the_ledger(tmp_path: Path) -> None:
    """A rebuilt engine (a restart, a takeover) times the leases it loaded: a grant never
    bound ends at its bind deadline, a queued request at the end of its wait."""
    settings = AllocatorSettings(ledger_path=tmp_path / "ledger.sqlite", allow_any_node_user=True,
                                 bind_timeout_s=30, start_fence_s=0, node_down_after_s=1000)
    engine = Engine(settings, started_at=0.0)
    changes = Changes()
    engine.handle(beat("a", 0, 1.0), NODE, 1.0, changes)
    granted = engine.handle(AllocateRequest(request_key="g/", user="u", count=2), HUB, 2.0,
                            changes)
    queued = engine.handle(AllocateRequest(request_key="q/", user="v", wait_s=60), HUB, 2.0,
                           changes)
    assert isinstance(granted, LeaseReply) and isinstance(queued, LeaseReply)
    assert queued.lease.state is LeaseState.QUEUED
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open()
    ledger.call(lambda: ledger.commit(changes))
    rebuilt = Engine(settings, started_at=3.0)
    rebuilt.load(ledger.call(ledger.load), 3.0)
    ledger.close()
    changes = Changes()
    rebuilt.handle(beat("a", 1, 33.0), NODE, 33.0, changes)
    rebuilt.tick(33.0, changes)  # past the bind deadline (32): the GPUs go to the queue
    assert rebuilt.recent[granted.lease.lease_id].release_reason is ReleaseReason.BIND_TIMEOUT
    assert rebuilt.leases[queued.lease.lease_id].state is LeaseState.GRANTED
