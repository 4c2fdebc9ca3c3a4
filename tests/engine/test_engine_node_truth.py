"""Node truth in the engine: running containers give a lost ledger its leases back (adoption),
contradicting grants keep their GPUs out of placement, and a fenced start grants nothing on a
node before its first complete report. Pure engine plus a real SQLite ledger and the invariant
checker; the processes, broker and Docker engine are in tests/faults/test_fault_node_truth.py."""

from __future__ import annotations

import itertools
import sqlite3
from pathlib import Path

from allocator.config import AllocatorSettings
from allocator.engine import Engine, Sender
from allocator.ledger.changes import Changes
from allocator.ledger.invariants import NodeReport, check_ledger
from allocator.ledger.loaded import LoadedState
from allocator.ledger.store import Ledger
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerAction,
    ContainerEvent,
    ContainerGrant,
    ContainerInfo,
    ErrorReply,
    GPUInfo,
    Heartbeat,
    LeaseReply,
    LeaseState,
    QuotaReply,
    QuotaRequest,
    ReleaseReason,
)

NODE = Sender(user_id="agent", via_nodes_exchange=True)
HUB = Sender(user_id="hub", via_nodes_exchange=False)
MODEL = "NVIDIA A100-SXM4-40GB"
SEQ = itertools.count()


def uuid(host: str, index: int) -> str:
    return f"GPU-{host}-{index}"


def beat(host: str, at: float, containers: list[ContainerInfo], *, gpus: int = 2,
         complete: bool = True) -> Heartbeat:
    return Heartbeat(host=host, agent_id=f"agent-{host}", seq=next(SEQ), sent_at=at,
                     interval_s=2, containers=containers, containers_complete=complete,
                     gpus=[GPUInfo(uuid=uuid(host, i), index=i, model=MODEL,
                                   memory_total_mib=40960) for i in range(gpus)],
                     source="simulated")


def grant(host: str, *indices: int, shared: bool = False, memory_mib: int | None = None,
          key: str = "hub/alice/", groups: tuple[str, ...] = ()) -> ContainerGrant:
    return ContainerGrant(host=host, gpu_uuids=[uuid(host, i) for i in indices], shared=shared,
                          memory_mib=memory_mib, user="alice", request_key=key,
                          groups=list(groups))


def running(lease_id: str, container_id: str, labels: ContainerGrant | None,
            started_at: float = 1.0) -> ContainerInfo:
    return ContainerInfo(container_id=container_id, lease_id=lease_id, grant=labels,
                         started_at=started_at)


def settings(tmp_path: Path, **values: object) -> AllocatorSettings:
    base: dict[str, object] = {"ledger_path": tmp_path / "ledger.sqlite",
                               "allow_any_node_user": True, "start_fence_s": 20.0,
                               "share_slots": {MODEL: 4}}
    base.update(values)
    return AllocatorSettings.model_validate(base)


def allocate(engine: Engine, key: str, now: float, changes: Changes, **fields: object
             ) -> LeaseReply | ErrorReply:
    reply = engine.handle(AllocateRequest.model_validate(
        {"request_key": key, "user": key.split("/")[1], **fields}), HUB, now, changes)
    assert isinstance(reply, LeaseReply | ErrorReply)
    return reply


def committed(tmp_path: Path, changes: Changes) -> sqlite3.Connection:
    """The batch written to a real ledger file, opened for the invariant checker."""
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open()
    ledger.call(lambda: ledger.commit(changes))
    ledger.close()
    return sqlite3.connect(tmp_path / "ledger.sqlite")


def test_an_empty_ledger_adopts_running_containers_before_granting(tmp_path: Path) -> None:
    engine = Engine(settings(tmp_path), started_at=0.0)
    engine.load(_empty_state(tmp_path), 0.0, fenced=True)
    changes = Changes()
    # Before any report: the request waits (it is not refused as an unknown model).
    early = allocate(engine, "hub/bob/", 0.5, changes, model=MODEL, count=2)
    assert isinstance(early, LeaseReply) and early.lease.state is LeaseState.QUEUED
    exclusive = running("lease-x", "c-x", grant("a", 0), started_at=0.1)
    engine.handle(beat("a", 1.0, [exclusive]), NODE, 1.0, changes)
    adopted = engine.leases["lease-x"]
    assert (adopted.state, adopted.gpu_uuids, adopted.user, adopted.request_key) == (
        LeaseState.BOUND, (uuid("a", 0),), "alice", "hub/alice/")
    # GPU 0 is held again: the request for two GPUs of this 2-GPU host does not fit, and
    # since it asked not to wait, it ends once the first node reported (this ledger knew none).
    ended = engine.recent[early.lease.lease_id]
    assert (ended.state, ended.release_reason) == (LeaseState.EXPIRED,
                                                   ReleaseReason.WAIT_EXPIRED)
    one = allocate(engine, "hub/carol/", 1.5, changes, model=MODEL)
    assert isinstance(one, LeaseReply)
    assert one.lease.gpu_uuids == [uuid("a", 1)], "only the GPU no container holds"
    assert [e["kind"] for e in changes.events].count("adopted") == 1
    history = [h for h in changes.history if h["lease_id"] == "lease-x"]
    assert [(h["from_state"], h["to_state"], h["reason"]) for h in history] == [
        (None, "bound", "adopted")]
    conn = committed(tmp_path, changes)
    report = NodeReport.from_heartbeat(beat("a", 9.0, [exclusive]), 9.0)
    assert check_ledger(conn, {"a": report}, grace_s=1.0) == []
    # The adopted lease ends like any other when its container dies.
    changes = Changes()
    engine.handle(ContainerEvent(host="a", container_id="c-x", lease_id="lease-x",
                                 action=ContainerAction.DIE, at=3.0), NODE, 3.0, changes)
    assert engine.recent["lease-x"].release_reason is ReleaseReason.CONTAINER_EXITED


def test_an_adopted_lease_holds_its_gpu_but_counts_against_no_quota(tmp_path: Path) -> None:
    """The groups travel in the grant labels, and are kept to show; but a label cannot be
    told from a forged one, so after a lost ledger the GPU a running notebook holds stays
    held (nobody else gets it) and counts against no user's or group's quota."""
    engine = Engine(settings(tmp_path, group_quota={"students": 1}), started_at=0.0)
    engine.load(_empty_state(tmp_path), 0.0, fenced=True)
    changes = Changes()
    labelled = running("lease-s", "c-s", grant("a", 0, groups=("students",)), started_at=0.1)
    engine.handle(beat("a", 1.0, [labelled]), NODE, 1.0, changes)
    assert engine.leases["lease-s"].groups == ("students",)
    granted = allocate(engine, "hub/bob/", 1.5, changes, model=MODEL, groups=["students"])
    assert isinstance(granted, LeaseReply), granted
    assert granted.lease.gpu_uuids == [uuid("a", 1)], "not the adopted lease's GPU"
    quota = engine.handle(QuotaRequest(user="carol", groups=["students"]), HUB, 1.6, changes)
    assert isinstance(quota, QuotaReply)
    assert [(view.name, view.held) for view in quota.quotas if view.scope == "group"] == [
        ("students", 1.0)], "bob's own lease counts, the adopted one does not"


def _empty_state(tmp_path: Path) -> LoadedState:
    ledger = Ledger(tmp_path / "empty.sqlite")
    ledger.open()
    try:
        return ledger.call(ledger.load)
    finally:
        ledger.close()


def test_conflicts_keep_their_gpus_out_of_placement_and_stop_nothing(tmp_path: Path) -> None:
    engine = Engine(settings(tmp_path), started_at=0.0)
    engine.load(_empty_state(tmp_path), 0.0, fenced=True)
    changes = Changes()
    containers = [
        running("first", "c-1", grant("a", 0, key="hub/alice/1"), started_at=0.1),
        # a second container on the same exclusive GPU: the later one is the conflict
        running("second", "c-2", grant("a", 0, key="hub/alice/2"), started_at=0.2),
        # slices over the memory of GPU 1: 30 GiB + 20 GiB of 40 GiB
        running("slice-1", "c-3", grant("a", 1, shared=True, memory_mib=30720,
                                        key="hub/alice/3"), started_at=0.3),
        running("slice-2", "c-4", grant("a", 1, shared=True, memory_mib=20480,
                                        key="hub/alice/4"), started_at=0.4),
        # a GPU the node does not have
        running("ghost", "c-5", grant("a", 7, key="hub/alice/5"), started_at=0.5),
    ]
    engine.handle(beat("a", 1.0, containers), NODE, 1.0, changes)
    assert set(engine.leases) == {"first", "slice-1"}
    conflicts = [(e["lease_id"], e["gpu_uuid"]) for e in changes.events
                 if e["kind"] == "adoption_conflict"]
    assert sorted(conflicts) == sorted([("second", uuid("a", 0)), ("slice-2", uuid("a", 1)),
                                        ("ghost", uuid("a", 7))])
    assert engine.counters["adoption_conflict"] == 3
    assert set(engine.conflicted_gpus()) == {uuid("a", 0), uuid("a", 1)}
    assert engine.commands == [], "nothing is stopped to resolve a conflict"
    # The slice GPU has memory and slots left by the ledger's count, but is not placeable.
    small = allocate(engine, "hub/dan/", 1.5, changes, model=MODEL,
                     share={"memory_mib": 1024}, wait_s=60)
    assert isinstance(small, LeaseReply) and small.lease.state is LeaseState.QUEUED
    inventory = engine.inventory(1.5)
    assert {g.uuid: g.conflict is not None for g in inventory.gpus} == {
        uuid("a", 0): True, uuid("a", 1): True}
    # The same listing again records no new conflict events.
    again = Changes()
    engine.handle(beat("a", 2.0, containers), NODE, 2.0, again)
    assert not [e for e in again.events if e["kind"] == "adoption_conflict"]
    # The live check reports what the nodes' labels contradict.
    conn = committed(tmp_path, changes)
    report = NodeReport.from_heartbeat(beat("a", 9.0, containers), 9.0)
    kinds = sorted(v.kind for v in check_ledger(conn, {"a": report}, grace_s=1.0))
    assert kinds.count("grant_conflict") == 3
    assert kinds.count("orphan_container") == 3
    # Once the second slice's container is gone, its GPU is placeable again and the
    # waiting request gets it.
    changes = Changes()
    engine.handle(beat("a", 3.0, [c for c in containers if c.lease_id != "slice-2"]), NODE,
                  3.0, changes)
    assert set(engine.conflicted_gpus()) == {uuid("a", 0)}
    assert engine.leases[small.lease.lease_id].state is LeaseState.GRANTED
    assert engine.leases[small.lease.lease_id].gpu_uuids == (uuid("a", 1),)


def test_a_fenced_node_gets_no_grant_before_its_first_complete_report(tmp_path: Path) -> None:
    """A restored ledger knows nodes a and b: nothing lands on either before it reported in
    full; requests that ask not to wait get their answer once every node has reported."""
    first = Engine(settings(tmp_path), started_at=0.0)
    changes = Changes()
    for host in ("a", "b"):
        first.handle(beat(host, 0.0, []), NODE, 0.0, changes)
    conn = committed(tmp_path, changes)
    conn.close()
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open()
    state = ledger.call(ledger.load)
    ledger.close()
    engine = Engine(settings(tmp_path), started_at=1.0)
    engine.load(state, 1.0, fenced=True)
    changes = Changes()
    waiting = allocate(engine, "hub/bob/", 1.1, changes, model=MODEL, count=2)
    assert isinstance(waiting, LeaseReply) and waiting.lease.state is LeaseState.QUEUED
    # a's listing is incomplete (its Docker engine did not answer): a stays fenced, but
    # what it did list is adopted already.
    adopted = running("lease-a", "c-a", grant("a", 0, key="hub/alice/a"))
    engine.handle(beat("a", 1.2, [adopted], complete=False), NODE, 1.2, changes)
    assert engine.leases["lease-a"].state is LeaseState.BOUND
    assert engine.leases[waiting.lease.lease_id].state is LeaseState.QUEUED
    # b reports in full: the request for two GPUs lands on b, not on a's free GPU 1.
    engine.handle(beat("b", 1.3, []), NODE, 1.3, changes)
    assert engine.leases[waiting.lease.lease_id].host == "b"
    no_wait = allocate(engine, "hub/carol/", 1.4, changes, model=MODEL, count=2)
    assert isinstance(no_wait, LeaseReply) and no_wait.lease.state is LeaseState.QUEUED
    # a reports in full: the fence closes; carol's request still does not fit (a has one
    # GPU free) and, since it asked not to wait, it ends now instead of waiting on.
    engine.handle(beat("a", 1.5, [adopted]), NODE, 1.5, changes)
    carol = engine.recent[no_wait.lease.lease_id]
    assert (carol.state, carol.release_reason) == (LeaseState.EXPIRED,
                                                   ReleaseReason.WAIT_EXPIRED)
    refused = allocate(engine, "hub/dave/", 1.6, changes, model=MODEL, count=2)
    assert isinstance(refused, ErrorReply) and refused.error.code.value == "no_capacity"


def test_a_zombie_of_a_lease_finished_before_a_restart_is_not_adopted(tmp_path: Path) -> None:
    engine = Engine(settings(tmp_path), started_at=0.0)
    changes = Changes()
    engine.handle(beat("a", 0.0, []), NODE, 0.0, changes)
    reply = allocate(engine, "hub/alice/", 0.1, changes, model=MODEL)
    assert isinstance(reply, LeaseReply)
    lease_id = reply.lease.lease_id
    engine.tick(1000.0, changes)  # never bound: reclaimed at the bind deadline
    assert engine.recent[lease_id].release_reason is ReleaseReason.BIND_TIMEOUT
    committed(tmp_path, changes).close()
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open()
    state = ledger.call(ledger.load)
    ledger.close()
    restarted = Engine(settings(tmp_path), started_at=1001.0)
    restarted.load(state, 1001.0, fenced=True)
    changes = Changes()
    late = running(lease_id, "c-late", grant("a", 0))
    restarted.handle(beat("a", 1001.0, [late]), NODE, 1001.0, changes)
    assert lease_id not in restarted.leases
    assert [e["kind"] for e in changes.events].count("zombie_container") == 1
    assert [c.lease_id for c in restarted.commands] == [lease_id]


def test_a_node_that_never_lists_its_containers_is_placed_after_the_fence(
        tmp_path: Path) -> None:
    """An agent that cannot list its containers (no Docker engine) never reports in full:
    its node is placed once start_fence_s ran out, and the waiting request gets it then."""
    first = Engine(settings(tmp_path), started_at=0.0)
    changes = Changes()
    first.handle(beat("a", 0.0, []), NODE, 0.0, changes)
    committed(tmp_path, changes).close()
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open()
    state = ledger.call(ledger.load)
    ledger.close()
    engine = Engine(settings(tmp_path, start_fence_s=5.0), started_at=1.0)
    engine.load(state, 1.0, fenced=True)
    changes = Changes()
    engine.handle(beat("a", 1.1, [], complete=False), NODE, 1.1, changes)
    waiting = allocate(engine, "hub/bob/", 1.2, changes, model=MODEL)
    assert isinstance(waiting, LeaseReply) and waiting.lease.state is LeaseState.QUEUED
    engine.tick(5.9, changes)
    assert engine.leases[waiting.lease.lease_id].state is LeaseState.QUEUED
    engine.tick(6.0, changes)
    assert engine.leases[waiting.lease.lease_id].state is LeaseState.GRANTED
    assert [e["kind"] for e in changes.events].count("start_fence_expired") == 1
