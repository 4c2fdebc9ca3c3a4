"""A GPU reported by another host than its own: a duplicate while its host holds it, a move
conflict (placed on no host) while it does not, and a move only once one host alone has
claimed it for ``gpu_move_after_s`` with a complete report. Pure engine, time passed in; the
forged heartbeat through the real broker is in tests/faults/test_fault_node_truth_labels.py."""

from __future__ import annotations

import json
from pathlib import Path

from allocator.config import AllocatorSettings
from allocator.engine import Engine
from allocator.ledger.changes import Changes
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerInfo,
    ErrorReply,
    GPUInfo,
    Heartbeat,
    LeaseReply,
    LeaseState,
)
from tests.support.common import GTX1070, HUB, NODE, gpus, heartbeat

MOVE_AFTER_S = 600.0
DOWN_AFTER_S = 15.0

A_GPUS = gpus("a", GTX1070, 2)
B_GPUS = gpus("b", GTX1070, 1)
C_GPUS = gpus("c", GTX1070, 1)
MOVING = A_GPUS[0]
"""The GPU a's record has and b (and in one test c) reports too."""
MOVED = MOVING.model_copy(update={"index": 1})
"""MOVING as b and c report it: index 0 is their own GPU's."""


def engine_with_a_down(tmp_path: Path) -> Engine:
    """Hosts a (2 GPUs), b and c (1 GPU each) reported at 0; a has been silent since and is
    down at 20 (b and c heard from at 19)."""
    settings = AllocatorSettings(ledger_path=tmp_path / "ledger.sqlite",
                                 allow_any_node_user=True, gpu_move_after_s=MOVE_AFTER_S,
                                 node_down_after_s=DOWN_AFTER_S)
    engine = Engine(settings, started_at=0.0)
    changes = Changes()
    for host, gpu_list in (("a", A_GPUS), ("b", B_GPUS), ("c", C_GPUS)):
        engine.handle(report(host, gpu_list, 0.0), NODE, 0.0, changes)
    for host, gpu_list in (("b", B_GPUS), ("c", C_GPUS)):
        engine.handle(report(host, gpu_list, 19.0), NODE, 19.0, changes)
    engine.tick(20.0, changes)
    assert "a" in engine.nodes.down
    return engine


def report(host: str, gpu_list: list[GPUInfo], at: float, *, complete: bool = True,
           containers: list[ContainerInfo] | None = None) -> Heartbeat:
    return heartbeat(host, gpu_list, containers, agent_id=f"agent-{host}", sent_at=at,
                     containers_complete=complete)


def beat_at(engine: Engine, host: str, gpu_list: list[GPUInfo], at: float, *,
            complete: bool = True) -> Changes:
    changes = Changes()
    engine.handle(report(host, gpu_list, at, complete=complete), NODE, at, changes)
    return changes


def keep_reporting(engine: Engine, host: str, gpu_list: list[GPUInfo], start: float,
                   end: float) -> Changes:
    """Reports every 10 s from ``start`` to before ``end`` (a host that stays up); the
    changes of them all."""
    changes = Changes()
    at = start
    while at < end:
        engine.handle(report(host, gpu_list, at), NODE, at, changes)
        at += 10.0
    return changes


def kinds(changes: Changes, kind: str) -> list[dict[str, object]]:
    """The events of one kind, their details (a JSON column) merged in."""
    return [{**e, **json.loads(e["detail"] or "{}")} for e in changes.events
            if e["kind"] == kind]


def owner(engine: Engine, gpu: GPUInfo) -> str:
    return engine.cluster.gpus[gpu.uuid].host


def conflict_of(engine: Engine, gpu: GPUInfo, at: float) -> str | None:
    shown = [g for g in engine.inventory(at).gpus if g.uuid == gpu.uuid]
    assert len(shown) == 1, "one GPU row, on one host"
    return shown[0].conflict


def ask_on(engine: Engine, host: str, key: str, at: float,
           count: int = 1) -> LeaseReply | ErrorReply:
    reply = engine.handle(AllocateRequest(request_key=key, user=key, host=host, count=count),
                          HUB, at, Changes())
    assert isinstance(reply, LeaseReply | ErrorReply)
    return reply


def test_a_down_hosts_gpu_moves_only_after_gpu_move_after_s(tmp_path: Path) -> None:
    engine = engine_with_a_down(tmp_path)
    first = beat_at(engine, "b", [*B_GPUS, MOVED], 30.0)
    # A move conflict, not a move: the GPU stays on a's record, shown as such.
    assert owner(engine, MOVING) == "a"
    assert MOVING.uuid not in engine.cluster.nodes["b"].gpu_uuids
    shown = conflict_of(engine, MOVING, 30.0)
    assert shown is not None and "reported by b since" in shown and "a is down" in shown
    assert engine.counters["gpu_move_conflict"] == 1
    [event] = kinds(first, "gpu_move_conflict")
    assert (event["host"], event["gpu_uuid"]) == ("b", MOVING.uuid)
    assert engine.conflicted_gpus().keys() == {MOVING.uuid}
    # Placed on neither host: b's own GPU goes, then nothing more fits on b.
    taken = ask_on(engine, "b", "u1", 31.0)
    assert isinstance(taken, LeaseReply) and taken.lease.gpu_uuids == [B_GPUS[0].uuid]
    refused = ask_on(engine, "b", "u2", 31.0)
    assert isinstance(refused, ErrorReply), refused
    # b keeps reporting it: still no move before the claim has stood gpu_move_after_s.
    later = keep_reporting(engine, "b", [*B_GPUS, MOVED], 40.0, 630.0)
    beat_at(engine, "b", [*B_GPUS, MOVED], 629.0)
    assert owner(engine, MOVING) == "a"
    assert not kinds(later, "gpu_move_conflict"), "one event per claim, not per report"
    assert engine.counters["gpu_move_conflict"] == 1
    moved = beat_at(engine, "b", [*B_GPUS, MOVED], 630.0)
    assert owner(engine, MOVING) == "b"
    assert [e["old_host"] for e in kinds(moved, "gpu_moved")] == ["a"]
    assert MOVING.uuid not in engine.cluster.nodes["a"].gpu_uuids
    assert conflict_of(engine, MOVING, 630.0) is None
    assert engine.conflicted_gpus() == {}
    placed = ask_on(engine, "b", "u3", 631.0)
    assert isinstance(placed, LeaseReply) and placed.lease.gpu_uuids == [MOVING.uuid]


def test_an_incomplete_report_moves_nothing(tmp_path: Path) -> None:
    """Due, but the claimant's report is not complete: its containers not listed, or another
    of its GPUs skipped (a GPU its up host holds), or one of its own GPUs gone missing."""
    engine = engine_with_a_down(tmp_path)
    keep_reporting(engine, "b", [*B_GPUS, MOVED], 30.0, 630.0)
    beat_at(engine, "b", [*B_GPUS, MOVED], 630.0, complete=False)
    assert owner(engine, MOVING) == "a", "containers not listed"
    beat_at(engine, "c", C_GPUS, 631.0)
    duplicate = beat_at(engine, "b", [*B_GPUS, MOVED, C_GPUS[0].model_copy(update={"index": 2})],
                        632.0)
    assert owner(engine, MOVING) == "a", "c's GPU, held by c, is in the report too"
    assert len(kinds(duplicate, "duplicate_gpu")) == 1
    beat_at(engine, "b", [MOVED], 633.0)
    assert owner(engine, MOVING) == "a", "b's own GPU went missing in this report"
    beat_at(engine, "b", [*B_GPUS, MOVED], 634.0)
    assert owner(engine, MOVING) == "b"


def test_the_old_host_back_keeps_its_gpu_and_ends_the_claim(tmp_path: Path) -> None:
    engine = engine_with_a_down(tmp_path)
    beat_at(engine, "b", [*B_GPUS, MOVED], 30.0)
    back = beat_at(engine, "a", A_GPUS, 100.0)
    assert [e["host"] for e in kinds(back, "gpu_move_withdrawn")] == ["b"]
    assert conflict_of(engine, MOVING, 100.0) is None
    placed = ask_on(engine, "a", "u1", 101.0, count=2)
    assert isinstance(placed, LeaseReply) and MOVING.uuid in placed.lease.gpu_uuids
    # b's claim, once due, finds a up and holding it: a duplicate, never a move.
    beat_at(engine, "a", A_GPUS, 699.0)
    late = beat_at(engine, "b", [*B_GPUS, MOVED], 700.0)
    assert owner(engine, MOVING) == "a"
    assert len(kinds(late, "duplicate_gpu")) == 1
    assert MOVING.uuid not in engine.gpus.claims


def test_two_claimants_move_it_to_neither_until_one_withdraws(tmp_path: Path) -> None:
    engine = engine_with_a_down(tmp_path)
    beat_at(engine, "b", [*B_GPUS, MOVED], 30.0)
    beat_at(engine, "c", [*C_GPUS, MOVED], 35.0)
    shown = conflict_of(engine, MOVING, 35.0)
    assert shown is not None and "b since" in shown and "c since" in shown
    keep_reporting(engine, "b", [*B_GPUS, MOVED], 40.0, 710.0)
    keep_reporting(engine, "c", [*C_GPUS, MOVED], 45.0, 710.0)
    assert owner(engine, MOVING) == "a"
    withdrawn = beat_at(engine, "c", C_GPUS, 711.0)
    assert [e["host"] for e in kinds(withdrawn, "gpu_move_withdrawn")] == ["c"]
    beat_at(engine, "b", [*B_GPUS, MOVED], 712.0)
    assert owner(engine, MOVING) == "b"


def test_a_claim_stands_only_while_its_claimant_reports_it(tmp_path: Path) -> None:
    """A claimant that stops naming the GPU, or was down itself, starts its claim again."""
    engine = engine_with_a_down(tmp_path)
    beat_at(engine, "b", [*B_GPUS, MOVED], 30.0)
    beat_at(engine, "b", B_GPUS, 31.0)
    assert MOVING.uuid not in engine.gpus.claims
    assert conflict_of(engine, MOVING, 31.0) is None
    beat_at(engine, "b", [*B_GPUS, MOVED], 32.0)
    # b itself falls silent past node_down_after_s; on its return its claim starts anew.
    engine.tick(100.0, Changes())
    again = beat_at(engine, "b", [*B_GPUS, MOVED], 640.0)
    assert owner(engine, MOVING) == "a"
    assert len(kinds(again, "gpu_move_conflict")) == 1
    keep_reporting(engine, "b", [*B_GPUS, MOVED], 650.0, 1239.0)
    beat_at(engine, "b", [*B_GPUS, MOVED], 1239.0)
    assert owner(engine, MOVING) == "a"
    beat_at(engine, "b", [*B_GPUS, MOVED], 1240.0)
    assert owner(engine, MOVING) == "b"


def test_a_gpu_its_up_host_no_longer_lists_waits_too(tmp_path: Path) -> None:
    """A GPU that fell off its host's bus (the host up, not listing it) is not taken at once
    by whoever names it: the claim waits like any other, and is shown."""
    engine = engine_with_a_down(tmp_path)
    beat_at(engine, "a", A_GPUS[1:], 25.0)
    assert not engine.cluster.gpus[MOVING.uuid].present
    beat_at(engine, "b", [*B_GPUS, MOVED], 30.0)
    assert owner(engine, MOVING) == "a"
    shown = conflict_of(engine, MOVING, 30.0)
    assert shown is not None and "a no longer lists it" in shown
    keep_reporting(engine, "a", A_GPUS[1:], 35.0, 630.0)
    keep_reporting(engine, "b", [*B_GPUS, MOVED], 40.0, 630.0)
    assert owner(engine, MOVING) == "a"
    beat_at(engine, "b", [*B_GPUS, MOVED], 630.0)
    assert owner(engine, MOVING) == "b"


def test_a_held_gpu_keeps_its_lease_through_a_conflict(tmp_path: Path) -> None:
    """The lease bound on a (down) keeps its GPU while b claims it: nothing is released or
    given away for a claim."""
    engine = engine_with_a_down(tmp_path)
    beat_at(engine, "a", A_GPUS, 21.0)
    held = ask_on(engine, "a", "holder", 21.5)
    assert isinstance(held, LeaseReply)
    [claimed] = [g for g in A_GPUS if g.uuid in held.lease.gpu_uuids]
    running = [ContainerInfo(container_id="c-holder", lease_id=held.lease.lease_id)]
    engine.handle(report("a", A_GPUS, 22.0, containers=running), NODE, 22.0, Changes())
    engine.tick(40.0, Changes())
    assert "a" in engine.nodes.down
    beat_at(engine, "b", [*B_GPUS, claimed.model_copy(update={"index": 1})], 45.0)
    assert owner(engine, claimed) == "a"
    assert engine.leases[held.lease.lease_id].state is LeaseState.BOUND
    assert [c.lease_id for c in engine.cluster.claims_on(claimed.uuid)] == [
        held.lease.lease_id]
