"""What a container's grant labels can do, narrowed: anyone who may use a node's Docker API can
set them, so a label never binds a queued lease, and a conflict it makes lasts only while its
container runs and names that container. Pure engine, time passed in; a real Docker container
through the real broker is in tests/faults/test_fault_node_truth_labels.py."""

from __future__ import annotations

import json
from pathlib import Path

from allocator.config import AllocatorSettings
from allocator.engine import Engine, Sender
from allocator.ledger.changes import Changes
from allocator.ledger.lease import ADOPTED_OWNER
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerAction,
    ContainerEvent,
    ContainerGrant,
    ContainerInfo,
    ErrorCode,
    ErrorReply,
    Heartbeat,
    LeaseReply,
    LeaseState,
    QuotaReply,
    QuotaRequest,
    ReleaseRequest,
    StatusRequest,
)
from tests.support.common import GTX1070, HUB, NODE, gpus, heartbeat

GPUS = gpus("a", GTX1070, 2)
STARTED = 1_790_000_000.0
"""When the forged container started (2026-09-21T14:13:20Z)."""


def engine_with_a_waiter(tmp_path: Path) -> tuple[Engine, str, str]:
    """Host a with two GPUs: alice holds one, bob waits for two. Returns (engine, alice's
    lease id, bob's queued lease id)."""
    settings = AllocatorSettings(ledger_path=tmp_path / "ledger.sqlite",
                                 allow_any_node_user=True, container_gone_grace_s=1.0)
    engine = Engine(settings, started_at=0.0)
    changes = Changes()
    engine.handle(beat(1.0, []), NODE, 1.0, changes)
    alice = ask(engine, "alice", 2.0)
    assert isinstance(alice, LeaseReply) and alice.lease.state is LeaseState.GRANTED
    engine.handle(beat(3.0, [ContainerInfo(container_id="c-alice",
                                           lease_id=alice.lease.lease_id)]), NODE, 3.0,
                  changes)
    assert engine.leases[alice.lease.lease_id].state is LeaseState.BOUND
    bob = ask(engine, "bob", 4.0, count=2, wait_s=3600)
    assert isinstance(bob, LeaseReply) and bob.lease.state is LeaseState.QUEUED
    return engine, alice.lease.lease_id, bob.lease.lease_id


def beat(at: float, containers: list[ContainerInfo], *, complete: bool = True) -> Heartbeat:
    return heartbeat("a", GPUS, containers, agent_id="agent-a", sent_at=at,
                     containers_complete=complete)


def ask(engine: Engine, user: str, at: float, **fields: object) -> LeaseReply | ErrorReply:
    reply = engine.handle(AllocateRequest.model_validate(
        {"request_key": f"hub/{user}/", "user": user, "host": "a", **fields}), HUB, at,
        Changes())
    assert isinstance(reply, LeaseReply | ErrorReply)
    return reply


def forged(lease_id: str, gpu_index: int, *, user: str = "bob") -> ContainerInfo:
    """A container someone with the node's Docker API started, labelled for ``lease_id``."""
    return ContainerInfo(
        container_id="f0f0f0f0f0f0aaaabbbbcccc", lease_id=lease_id, name="not-a-notebook",
        started_at=STARTED,
        grant=ContainerGrant(host="a", gpu_uuids=[GPUS[gpu_index].uuid], user=user,
                             request_key=f"hub/{user}/"))


def events(changes: Changes, kind: str) -> list[dict[str, object]]:
    return [{**e, **json.loads(e["detail"] or "{}")} for e in changes.events
            if e["kind"] == kind]


def conflict_on(engine: Engine, index: int) -> str | None:
    return engine.cluster.gpus[GPUS[index].uuid].conflict


def test_a_container_naming_a_queued_lease_does_not_bind_it(tmp_path: Path) -> None:
    engine, alice, bob = engine_with_a_waiter(tmp_path)
    holder = ContainerInfo(container_id="c-alice", lease_id=alice)
    listing = Changes()
    engine.handle(beat(5.0, [holder, forged(bob, 1)]), NODE, 5.0, listing)
    assert engine.leases[bob].state is LeaseState.QUEUED, "a label does not bind a waiter"
    assert engine.leases[bob].container_id is None
    assert engine.counters["adopted"] == 0
    # The GPU it names is kept out of placement while it runs, and the conflict says who.
    shown = conflict_on(engine, 1)
    assert shown is not None
    for part in ("f0f0f0f0f0f0", "'not-a-notebook'", "2026-09-21T14:13:20Z", bob, "queued"):
        assert part in shown, part
    [event] = [e for e in events(listing, "adoption_conflict") if e["gpu_uuid"]]
    assert (event["conflict"], event["container_id"], event["container_name"]) == (
        "queued_lease", "f0f0f0f0f0f0aaaabbbbcccc", "not-a-notebook")
    carol = ask(engine, "carol", 6.0)
    assert isinstance(carol, ErrorReply), "the named GPU is not placed meanwhile"
    # The same through a start event: no bind either.
    engine.handle(ContainerEvent(host="a", container_id="f1", lease_id=bob,
                                 action=ContainerAction.START, at=7.0,
                                 grant=forged(bob, 1).grant), NODE, 7.0, Changes())
    assert engine.leases[bob].state is LeaseState.QUEUED
    # Once the container is gone the GPU is placeable again, and bob still waits for two.
    engine.handle(beat(8.0, [holder]), NODE, 8.0, Changes())
    assert conflict_on(engine, 1) is None
    dave = ask(engine, "dave", 9.0)
    assert isinstance(dave, LeaseReply) and dave.lease.gpu_uuids == [GPUS[1].uuid]
    assert engine.leases[bob].state is LeaseState.QUEUED


def test_a_conflict_lasts_only_while_its_container_runs(tmp_path: Path) -> None:
    """A label naming alice's GPU is a conflict while its container runs (an incomplete
    listing says nothing about that), and ends with it; it names the container."""
    engine, alice, _ = engine_with_a_waiter(tmp_path)
    holder = ContainerInfo(container_id="c-alice", lease_id=alice)
    intruder = forged("made-up-lease", 0, user="mallory")
    engine.handle(beat(5.0, [holder, intruder]), NODE, 5.0, Changes())
    shown = conflict_on(engine, 0)
    assert shown is not None and "f0f0f0f0f0f0" in shown and "not-a-notebook" in shown
    assert "made-up-lease" not in engine.leases
    engine.handle(beat(6.0, [holder], complete=False), NODE, 6.0, Changes())
    assert conflict_on(engine, 0) == shown, "a listing that could not see it proves nothing"
    engine.handle(ContainerEvent(host="a", container_id=intruder.container_id,
                                 lease_id="made-up-lease", action=ContainerAction.DIE,
                                 at=7.0), NODE, 7.0, Changes())
    assert conflict_on(engine, 0) is None
    assert engine.leases[alice].state is LeaseState.BOUND
    # Listed again, then gone from a complete listing: the conflict ends with it again.
    engine.handle(beat(8.0, [holder, intruder]), NODE, 8.0, Changes())
    assert conflict_on(engine, 0) is not None
    engine.handle(beat(9.0, [holder]), NODE, 9.0, Changes())
    assert conflict_on(engine, 0) is None
    assert engine.conflicted_gpus() == {}


def test_a_forged_container_counts_against_nobodys_quota_nor_takes_a_request_key(
        tmp_path: Path) -> None:
    """A container labelled for user ``victim`` (her groups, her hub's request key) on a free
    GPU: adopted, so its GPU is not handed out twice, but charged to nobody. Victim's own
    request under her own key is granted within her quota of one GPU (before, it was
    refused ``quota_exceeded``, or answered with the forged lease), and her group's
    guarantee does not see it either."""
    settings = AllocatorSettings(ledger_path=tmp_path / "ledger.sqlite",
                                 allow_any_node_user=True, start_fence_s=0.0,
                                 user_quota={"victim": 1}, group_quota={"lab": 1})
    engine = Engine(settings, started_at=0.0)
    label = forged("forged-1", 0, user="victim").model_copy(update={"grant": ContainerGrant(
        host="a", gpu_uuids=[GPUS[0].uuid], user="victim", groups=["lab"],
        request_key="hub/victim/")})
    engine.handle(beat(1.0, [label]), NODE, 1.0, Changes())
    adopted = engine.leases["forged-1"]
    assert adopted.state is LeaseState.BOUND and adopted.owner == ADOPTED_OWNER
    assert engine.cluster.claims_on(GPUS[0].uuid), "its GPU stays held"
    quota = engine.handle(QuotaRequest(user="victim", groups=["lab"]), HUB, 1.5, Changes())
    assert isinstance(quota, QuotaReply)
    assert [view.held for view in quota.quotas] == [0.0, 0.0]
    mine = ask(engine, "victim", 2.0, groups=["lab"])
    assert isinstance(mine, LeaseReply), mine
    assert mine.lease.lease_id != "forged-1" and mine.lease.gpu_uuids == [GPUS[1].uuid]
    assert engine.leases[mine.lease.lease_id].owner == HUB.user_id
    assert not engine.leases[mine.lease.lease_id].borrowed


def test_a_forged_container_is_released_by_admins_alone(tmp_path: Path) -> None:
    """No hub may release (stop) or see an adopted lease: the labels name no hub, and a hub
    could otherwise stop another hub's notebook adopted after a lost ledger. An admin may;
    the container's own end ends it as any lease."""
    settings = AllocatorSettings(ledger_path=tmp_path / "ledger.sqlite",
                                 allow_any_node_user=True, start_fence_s=0.0,
                                 admin_users=["admin"])
    engine = Engine(settings, started_at=0.0)
    engine.handle(beat(1.0, [forged("forged-1", 0, user="victim")]), NODE, 1.0, Changes())
    engine.take_commands()
    for request in (ReleaseRequest(lease_id="forged-1"), StatusRequest(lease_id="forged-1")):
        refused = engine.handle(request, HUB, 2.0, Changes())
        assert isinstance(refused, ErrorReply) and refused.error.code is ErrorCode.FORBIDDEN
    by_key = engine.handle(ReleaseRequest(request_key="hub/victim/"), HUB, 2.0, Changes())
    assert isinstance(by_key, ErrorReply) and by_key.error.code is ErrorCode.NOT_FOUND, (
        "its request key is no hub's")
    assert engine.leases["forged-1"].state is LeaseState.BOUND
    assert engine.take_commands() == []
    admin = Sender(user_id="admin", via_nodes_exchange=False)
    released = engine.handle(ReleaseRequest(lease_id="forged-1"), admin, 3.0, Changes())
    assert isinstance(released, LeaseReply) and released.lease.state is LeaseState.RELEASING
    assert [c.lease_id for c in engine.take_commands()] == ["forged-1"]


def test_adoptions_beyond_a_hosts_budget_wait_as_conflicts(tmp_path: Path) -> None:
    """One adoption a minute for host a: the second labelled container waits as a conflict,
    its GPU kept out of placement (not handed out twice), and is adopted at the host's first
    report of the next minute."""
    settings = AllocatorSettings(ledger_path=tmp_path / "ledger.sqlite",
                                 allow_any_node_user=True, start_fence_s=0.0,
                                 node_events_per_minute=1)
    engine = Engine(settings, started_at=0.0)
    first = forged("forged-1", 0, user="u1").model_copy(update={"container_id": "c1"})
    second = forged("forged-2", 1, user="u2").model_copy(update={"container_id": "c2"})
    engine.handle(beat(1.0, [first, second]), NODE, 1.0, Changes())
    assert "forged-1" in engine.leases and "forged-2" not in engine.leases
    assert conflict_on(engine, 1) is not None and "node_events_per_minute" in str(
        conflict_on(engine, 1))
    refused = ask(engine, "carol", 2.0)
    assert isinstance(refused, ErrorReply), "neither GPU is free to give"
    engine.handle(beat(61.0, [first, second]), NODE, 61.0, Changes())
    assert engine.leases["forged-2"].state is LeaseState.BOUND
    assert conflict_on(engine, 1) is None
