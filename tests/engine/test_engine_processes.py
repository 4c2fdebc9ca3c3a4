"""Processes on a GPU, in the engine: a released GPU drains until a report shows its
container's processes gone, a process left behind keeps it out (stuck), a GPU used outside
swarm-gpu is never granted while that lasts, a lease using a GPU outside its grant is flagged,
slices over budget are warned then stopped, an agent that cannot list processes keeps the
rules before 0.2.0, and each agent is told once what the allocator reads. Pure engine with
heartbeats built here, on a real SQLite ledger; tests/e2e/test_processes_e2e.py has the broker.
"""

from __future__ import annotations

import io
import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from pydantic import ValidationError
from rich.console import Console

from allocator.admin.ledger_cli import render_status
from allocator.admin.status import live_status
from allocator.config import AllocatorSettings
from allocator.engine import Engine, Sender
from allocator.ledger.changes import Changes
from allocator.ledger.loaded import LoadedState
from allocator.ledger.store import Ledger
from allocator.metrics import exporter as metrics
from allocator.wire.protocol import (
    GPU_PROCESSES,
    INTERCONNECT,
    LEASE_USAGE,
    AllocateRequest,
    AllocatorHello,
    ContainerAction,
    ContainerEvent,
    ContainerInfo,
    GPUInfo,
    GPUProcess,
    GPUView,
    Heartbeat,
    HeartbeatDelta,
    LeaseReply,
    LeaseState,
    ProcessState,
    ProcessUse,
    ReleaseRequest,
    StopContainer,
    StopReason,
)
from tests.support.scraped import EngineOnly

NODE = Sender(user_id="agent", via_nodes_exchange=True)
HUB = Sender(user_id="hub", via_nodes_exchange=False)
MODEL = "NVIDIA A100-SXM4-40GB"
SEQ = itertools.count()
Processes = Mapping[int, Sequence[GPUProcess]]
"""GPU index -> its processes in a report (an index left out: none, or not known)."""


def uuid(index: int) -> str:
    return f"GPU-a-{index}"


def proc(pid: int, container_id: str | None, memory_mib: int = 500, **fields: str
         ) -> GPUProcess:
    return GPUProcess(pid=pid, container_id=container_id, memory_used_mib=memory_mib,
                      name="python", **fields)


def beat(at: float, containers: Sequence[ContainerInfo] = (), processes: Processes | None = None,
         *, gpus: int = 2, agent_id: str = "agent-a", known: bool = True) -> Heartbeat:
    """A complete report of host ``a``; ``known=False``: an agent that lists no processes."""
    listed = processes or {}
    return Heartbeat(
        host="a", agent_id=agent_id, seq=next(SEQ), sent_at=at, interval_s=2,
        containers=list(containers), containers_complete=True, source="simulated",
        gpus=[GPUInfo(uuid=uuid(i), index=i, model=MODEL, memory_total_mib=40960,
                      processes=list(listed[i]) if i in listed else ([] if known else None))
              for i in range(gpus)])


def running(lease_id: str, container_id: str, use: Sequence[ProcessUse] = ()
            ) -> ContainerInfo:
    return ContainerInfo(container_id=container_id, lease_id=lease_id, started_at=0.5,
                         gpu_use=list(use))


def settings(tmp_path: Path, **values: object) -> AllocatorSettings:
    base: dict[str, object] = {"ledger_path": tmp_path / "ledger.sqlite",
                               "allow_any_node_user": True, "share_slots": {MODEL: 4},
                               "release_verify_s": 10.0}
    base.update(values)
    return AllocatorSettings.model_validate(base)


def loaded(tmp_path: Path, **values: object) -> Engine:
    engine = Engine(settings(tmp_path, **values), started_at=0.0)
    engine.load(_empty_state(tmp_path), 0.0, fenced=False)
    return engine


def _empty_state(tmp_path: Path) -> LoadedState:
    ledger = Ledger(tmp_path / "empty.sqlite")
    ledger.open()
    try:
        return ledger.call(ledger.load)
    finally:
        ledger.close()


def allocate(engine: Engine, key: str, now: float, changes: Changes, **fields: object
             ) -> LeaseReply:
    request = AllocateRequest.model_validate({"request_key": key, "user": key.split("/")[1],
                                              "model": MODEL, **fields})
    reply = engine.handle(request, HUB, now, changes)
    assert isinstance(reply, LeaseReply), reply
    return reply


def died(engine: Engine, lease_id: str, container_id: str, at: float,
         changes: Changes) -> None:
    engine.handle(ContainerEvent(host="a", container_id=container_id, lease_id=lease_id,
                                 action=ContainerAction.DIE, at=at), NODE, at, changes)


def gpu_view(engine: Engine, index: int, now: float) -> GPUView:
    [view] = [g for g in engine.inventory(now).gpus if g.uuid == uuid(index)]
    return view


def status_text(engine: Engine, now: float) -> str:
    """``gpu-ledger status`` as it prints the live allocator's answer."""
    out = io.StringIO()
    render_status(live_status(engine.inventory(now, include_leases=True), []),
                  Console(file=out, width=200, soft_wrap=False))
    return out.getvalue()


def gpu_states(engine: Engine, now: float) -> dict[str, int]:
    """The GPU-state gauge (``swarm_gpu_gpus``): state -> GPUs, the zeros left out."""
    snap = metrics.read_scrape(EngineOnly(engine), now)
    return {state: count for (_, state), count in snap.gpus.items() if count}


def kinds(changes: Changes, kind: str) -> list[dict[str, object]]:
    return [e for e in changes.events if e["kind"] == kind]


def bound_lease(engine: Engine, changes: Changes, *, key: str = "hub/alice/", gpus: int = 2,
                processes: Processes | None = None, at: float = 1.0) -> tuple[str, str]:
    """A lease granted on host ``a`` and bound by its container ``c-<lease>``, whose process
    the report lists (on GPU 0 unless ``processes`` says otherwise)."""
    engine.handle(beat(at - 0.5, gpus=gpus), NODE, at - 0.5, changes)
    lease = allocate(engine, key, at, changes).lease
    container = f"c-{lease.lease_id}"
    listed = processes if processes is not None else {0: [proc(100, container)]}
    engine.handle(beat(at + 0.1, [running(lease.lease_id, container)], listed, gpus=gpus),
                  NODE, at + 0.1, changes)
    assert engine.leases[lease.lease_id].state is LeaseState.BOUND
    return lease.lease_id, container


# ------------------------------------------------------------------ verified release


def test_a_released_gpu_is_granted_only_once_a_report_shows_its_processes_gone(
        tmp_path: Path) -> None:
    engine = loaded(tmp_path)
    changes = Changes()
    lease_id, container = bound_lease(engine, changes, gpus=1)
    died(engine, lease_id, container, 2.0, changes)
    assert engine.recent[lease_id].state is LeaseState.RELEASED
    assert gpu_view(engine, 0, 2.0).process_state is ProcessState.DRAINING
    assert "draining" in status_text(engine, 2.0)
    assert gpu_states(engine, 2.0) == {"draining": 1}
    waiting = allocate(engine, "hub/bob/", 2.1, changes, wait_s=60).lease
    assert waiting.state is LeaseState.QUEUED, "a draining GPU is not granted"
    # A report still listing the process, within the bound: still draining.
    engine.handle(beat(3.0, processes={0: [proc(100, container)]}, gpus=1), NODE, 3.0,
                  changes)
    assert engine.leases[waiting.lease_id].state is LeaseState.QUEUED
    # The next report lists none of its processes: verified, and the queue gets it at once.
    engine.handle(beat(4.0, gpus=1), NODE, 4.0, changes)
    assert gpu_view(engine, 0, 4.0).process_state is None
    granted = engine.leases[waiting.lease_id]
    assert (granted.state, granted.gpu_uuids) == (LeaseState.GRANTED, (uuid(0),))
    assert kinds(changes, "stuck_process") == []


def test_the_report_that_ends_a_lease_verifies_its_release(tmp_path: Path) -> None:
    """A container missing from a complete report ends its lease; that report's processes
    (none of the container's) settle the drain in the same step."""
    engine = loaded(tmp_path, container_gone_grace_s=0.0)
    changes = Changes()
    lease_id, _ = bound_lease(engine, changes, gpus=1)
    engine.handle(beat(3.0, gpus=1), NODE, 3.0, changes)
    assert engine.recent[lease_id].state is LeaseState.RELEASED
    assert gpu_view(engine, 0, 3.0).process_state is None
    assert allocate(engine, "hub/bob/", 3.1, changes).lease.gpu_uuids == [uuid(0)]


def test_a_process_left_behind_is_stuck_until_it_goes(tmp_path: Path) -> None:
    engine = loaded(tmp_path)
    changes = Changes()
    lease_id, container = bound_lease(engine, changes, gpus=1)
    died(engine, lease_id, container, 2.0, changes)
    left = [proc(100, container, memory_mib=3000)]
    engine.handle(beat(5.0, processes={0: left}, gpus=1), NODE, 5.0, changes)
    assert gpu_view(engine, 0, 5.0).process_state is ProcessState.DRAINING
    # Past release_verify_s (10 s after the end) the report still lists it: stuck.
    engine.handle(beat(12.5, processes={0: left}, gpus=1), NODE, 12.5, changes)
    view = gpu_view(engine, 0, 12.5)
    assert view.process_state is ProcessState.STUCK_PROCESS
    assert view.processes is not None and [(p.pid, p.container_id, p.lease_id)
                                           for p in view.processes] == [
        (100, container, lease_id)]
    [stuck] = kinds(changes, "stuck_process")
    assert (stuck["gpu_uuid"], stuck["host"]) == (uuid(0), "a")
    assert '"pids": [100]' in str(stuck["detail"]) and container in str(stuck["detail"])
    assert engine.counters["stuck_process"] == 1
    assert gpu_states(engine, 12.5) == {"stuck_process": 1}
    shown = status_text(engine, 12.5)
    assert "stuck_process" in shown and f"pid 100 of lease {lease_id[:8]}" in shown
    waiting = allocate(engine, "hub/bob/", 13.0, changes, wait_s=600).lease
    for at in (20.0, 40.0):  # nothing is killed, and nothing is granted on it
        engine.handle(beat(at, processes={0: left}, gpus=1), NODE, at, changes)
        engine.tick(at, changes)
        assert engine.leases[waiting.lease_id].state is LeaseState.QUEUED
    assert engine.take_commands() == [], "nothing is stopped"
    assert len(kinds(changes, "stuck_process")) == 1, "one event, not one per report"
    engine.handle(beat(41.0, gpus=1), NODE, 41.0, changes)
    assert gpu_view(engine, 0, 41.0).process_state is None
    assert engine.leases[waiting.lease_id].state is LeaseState.GRANTED
    [gone] = kinds(changes, "stuck_process_gone")
    assert gone["gpu_uuid"] == uuid(0)


def test_the_bound_settles_a_drain_without_a_new_report(tmp_path: Path) -> None:
    """No report after the end: at release_verify_s the newest list decides, free when it
    showed none of the container's processes, stuck when it did."""
    engine = loaded(tmp_path)
    changes = Changes()
    # GPU 0's lease had no process listed any more; GPU 1's still had one.
    clean_id, clean = bound_lease(engine, changes, key="hub/alice/0", processes={})
    busy_id = allocate(engine, "hub/alice/1", 1.2, changes).lease.lease_id
    busy = f"c-{busy_id}"
    engine.handle(beat(1.3, [running(clean_id, clean), running(busy_id, busy)],
                       {1: [proc(7, busy)]}), NODE, 1.3, changes)
    died(engine, clean_id, clean, 2.0, changes)
    died(engine, busy_id, busy, 2.0, changes)
    engine.tick(11.9, changes)
    assert [gpu_view(engine, i, 11.9).process_state for i in (0, 1)] == [
        ProcessState.DRAINING, ProcessState.DRAINING]
    engine.tick(12.0, changes)
    assert [gpu_view(engine, i, 12.0).process_state for i in (0, 1)] == [
        None, ProcessState.STUCK_PROCESS]
    assert allocate(engine, "hub/bob/", 12.1, changes).lease.gpu_uuids == [uuid(0)]


def test_a_lease_whose_container_never_ran_has_nothing_to_verify(tmp_path: Path) -> None:
    engine = loaded(tmp_path)
    changes = Changes()
    engine.handle(beat(0.5, gpus=1), NODE, 0.5, changes)
    lease = allocate(engine, "hub/alice/", 1.0, changes).lease
    engine.handle(ReleaseRequest(lease_id=lease.lease_id), HUB, 2.0, changes)
    engine.tick(2.0 + engine.settings.stop_grace_s + 1, changes)  # ends, never bound
    engine.handle(beat(3.0, gpus=1), NODE, 3.0, changes)
    assert engine.recent[lease.lease_id].state is LeaseState.RELEASED
    assert gpu_view(engine, 0, 3.0).process_state is None
    assert allocate(engine, "hub/bob/", 3.1, changes).lease.gpu_uuids == [uuid(0)]


def test_a_shared_gpu_drains_for_new_slices_while_other_slices_keep_running(
        tmp_path: Path) -> None:
    engine = loaded(tmp_path)
    changes = Changes()
    engine.handle(beat(0.5, gpus=1), NODE, 0.5, changes)
    first = allocate(engine, "hub/alice/1", 1.0, changes, share={"memory_mib": 4096}).lease
    second = allocate(engine, "hub/alice/2", 1.0, changes, share={"memory_mib": 4096}).lease
    containers = [running(first.lease_id, "c-1"), running(second.lease_id, "c-2")]
    engine.handle(beat(1.5, containers, {0: [proc(1, "c-1"), proc(2, "c-2")]}, gpus=1),
                  NODE, 1.5, changes)
    died(engine, first.lease_id, "c-1", 2.0, changes)
    assert gpu_view(engine, 0, 2.0).process_state is ProcessState.DRAINING
    slice_ = allocate(engine, "hub/bob/", 2.1, changes, share={"memory_mib": 4096},
                      wait_s=60).lease
    assert slice_.state is LeaseState.QUEUED, "no new slice beside a process not yet gone"
    assert engine.leases[second.lease_id].state is LeaseState.BOUND, "the other slice runs"
    engine.handle(beat(3.0, [running(second.lease_id, "c-2")], {0: [proc(2, "c-2")]},
                       gpus=1), NODE, 3.0, changes)
    assert gpu_view(engine, 0, 3.0).process_state is None, "its own slice's process is fine"
    assert engine.leases[slice_.lease_id].state is LeaseState.GRANTED


# ------------------------------------------------------------------ outside use


def test_a_gpu_used_outside_swarm_gpu_is_never_granted_while_that_lasts(tmp_path: Path
                                                                        ) -> None:
    engine = loaded(tmp_path)
    changes = Changes()
    stray = proc(300, "stray", container_name="miner", image="evil/miner:1")
    host_process = proc(301, None)
    engine.handle(beat(1.0, processes={1: [stray], 0: [host_process]}), NODE, 1.0, changes)
    views = [gpu_view(engine, i, 1.0) for i in (0, 1)]
    assert [v.process_state for v in views] == [ProcessState.OUTSIDE_USE] * 2
    assert views[1].processes is not None
    assert [(p.pid, p.container_name, p.image, p.lease_id) for p in views[1].processes] == [
        (300, "miner", "evil/miner:1", None)]
    waiting = allocate(engine, "hub/alice/", 1.5, changes, wait_s=600).lease
    for at in (3.0, 5.0, 7.0):
        engine.handle(beat(at, processes={1: [stray], 0: [host_process]}), NODE, at, changes)
        engine.tick(at, changes)
        assert engine.leases[waiting.lease_id].state is LeaseState.QUEUED
    started = kinds(changes, "outside_use")
    assert sorted(str(e["gpu_uuid"]) for e in started) == [uuid(0), uuid(1)], "one each"
    assert "evil/miner:1" in str([e["detail"] for e in started])
    # The host process ends: GPU 0 is granted at once; GPU 1 stays out.
    engine.handle(beat(8.0, processes={1: [stray]}), NODE, 8.0, changes)
    assert engine.leases[waiting.lease_id].gpu_uuids == (uuid(0),)
    [ended] = kinds(changes, "outside_use_ended")
    assert ended["gpu_uuid"] == uuid(0)
    assert gpu_view(engine, 1, 8.0).process_state is ProcessState.OUTSIDE_USE


def test_a_lease_using_a_gpu_outside_its_grant_is_flagged_once(tmp_path: Path) -> None:
    engine = loaded(tmp_path)
    changes = Changes()
    lease_id, container = bound_lease(engine, changes, processes={})
    listing = [running(lease_id, container)]
    both = {0: [proc(5, container)], 1: [proc(5, container)]}
    for at in (2.0, 3.0):
        engine.handle(beat(at, listing, both), NODE, at, changes)
    lease = engine.lease_reply(engine.leases[lease_id]).lease
    assert lease.outside_grant == [uuid(1)]
    [flagged] = kinds(changes, "outside_grant")
    assert (flagged["lease_id"], flagged["host"]) == (lease_id, "a")
    assert uuid(1) in str(flagged["detail"])
    assert gpu_view(engine, 0, 3.0).process_state is None, "its own GPU"
    assert gpu_view(engine, 1, 3.0).process_state is ProcessState.OUTSIDE_USE
    shown = status_text(engine, 3.0)
    assert f"also uses {uuid(1)} (outside its grant)" in shown
    assert "outside_use" in shown and f"pid 5 of lease {lease_id[:8]}" in shown
    engine.handle(beat(4.0, listing, {0: [proc(5, container)]}), NODE, 4.0, changes)
    assert engine.lease_reply(engine.leases[lease_id]).lease.outside_grant == []


# ------------------------------------------------------------------ slice budgets


def _over_budget(tmp_path: Path, action: str) -> tuple[Engine, Changes, str]:
    engine = loaded(tmp_path, over_budget_grace_s=5.0, over_budget_action=action)
    changes = Changes()
    engine.handle(beat(0.5), NODE, 0.5, changes)
    lease = allocate(engine, "hub/alice/", 1.0, changes, share={"memory_mib": 1000}).lease
    [gpu] = lease.gpu_uuids
    for at in (2.0, 4.0, 6.9):  # over budget, within the grace
        engine.handle(beat(at, [running(lease.lease_id, "c-s", [
            ProcessUse(gpu_uuid=gpu, memory_used_mib=2500)])]), NODE, at, changes)
    assert kinds(changes, "over_budget") == []
    assert engine.lease_reply(engine.leases[lease.lease_id]).lease.over_budget_since is None
    return engine, changes, lease.lease_id


def test_a_slice_over_budget_past_the_grace_is_warned_once(tmp_path: Path) -> None:
    engine, changes, lease_id = _over_budget(tmp_path, "warn")
    gpu = engine.leases[lease_id].gpu_uuids[0]
    over = [running(lease_id, "c-s", [ProcessUse(gpu_uuid=gpu, memory_used_mib=2500)])]
    for at in (7.0, 9.0):
        engine.handle(beat(at, over), NODE, at, changes)
    [warned] = kinds(changes, "over_budget")
    assert warned["lease_id"] == lease_id and '"action": "warn"' in str(warned["detail"])
    assert engine.lease_reply(engine.leases[lease_id]).lease.over_budget_since == 2.0
    assert engine.leases[lease_id].state is LeaseState.BOUND
    assert engine.take_commands() == [], "warn stops nothing"
    assert "over budget 1970-01-01T00:00:02.000Z (7 s ago)" in status_text(engine, 9.0)
    # Back within the budget: the warning goes; a new spell waits out the grace again.
    engine.handle(beat(10.0, [running(lease_id, "c-s")]), NODE, 10.0, changes)
    assert engine.lease_reply(engine.leases[lease_id]).lease.over_budget_since is None
    engine.handle(beat(11.0, over), NODE, 11.0, changes)
    assert len(kinds(changes, "over_budget")) == 1


def test_a_slice_over_budget_past_the_grace_is_stopped_when_configured(tmp_path: Path
                                                                       ) -> None:
    engine, changes, lease_id = _over_budget(tmp_path, "stop")
    engine.take_commands()
    gpu = engine.leases[lease_id].gpu_uuids[0]
    engine.handle(beat(7.0, [running(lease_id, "c-s", [
        ProcessUse(gpu_uuid=gpu, memory_used_mib=2500)])]), NODE, 7.0, changes)
    assert engine.take_commands() == [StopContainer(
        host="a", lease_id=lease_id, container_id="c-s",
        grace_s=engine.settings.container_stop_grace_s, reason=StopReason.OVER_BUDGET)]
    assert engine.leases[lease_id].state is LeaseState.RELEASING
    assert '"action": "stop"' in str(kinds(changes, "over_budget")[0]["detail"])


# ------------------------------------------------------------------ not known, restarts


def test_processes_not_known_keep_the_rules_before_0_2_0(tmp_path: Path) -> None:
    engine = loaded(tmp_path)
    changes = Changes()
    engine.handle(beat(0.5, gpus=1, known=False), NODE, 0.5, changes)
    lease = allocate(engine, "hub/alice/", 1.0, changes).lease
    container = f"c-{lease.lease_id}"
    engine.handle(beat(1.5, [running(lease.lease_id, container)], gpus=1, known=False),
                  NODE, 1.5, changes)
    waiting = allocate(engine, "hub/bob/", 1.8, changes, wait_s=60).lease
    died(engine, lease.lease_id, container, 2.0, changes)
    # No report needed: granted the moment the container died, as before.
    assert engine.leases[waiting.lease_id].state is LeaseState.GRANTED
    view = gpu_view(engine, 0, 2.0)
    assert (view.process_state, view.processes) == (None, None)


def test_not_known_neither_starts_nor_ends_outside_use(tmp_path: Path) -> None:
    engine = loaded(tmp_path)
    changes = Changes()
    engine.handle(beat(1.0, processes={0: [proc(9, None)]}, gpus=1), NODE, 1.0, changes)
    engine.handle(beat(2.0, gpus=1, known=False), NODE, 2.0, changes)
    assert gpu_view(engine, 0, 2.0).process_state is ProcessState.OUTSIDE_USE
    assert kinds(changes, "outside_use_ended") == []


def test_after_a_reload_the_next_report_decides_by_the_outside_use_rule(tmp_path: Path
                                                                         ) -> None:
    engine = loaded(tmp_path)
    changes = Changes()
    lease_id, container = bound_lease(engine, changes, gpus=1)
    died(engine, lease_id, container, 2.0, changes)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open()
    try:
        ledger.call(lambda: ledger.commit(changes))
        state = ledger.call(ledger.load)
    finally:
        ledger.close()
    engine.load(state, 3.0)  # as a restart or a takeover would: draining is memory only
    changes = Changes()
    engine.handle(beat(4.0, processes={0: [proc(100, container)]}, gpus=1), NODE, 4.0, changes)
    assert gpu_view(engine, 0, 4.0).process_state is ProcessState.OUTSIDE_USE
    engine.handle(beat(5.0, gpus=1), NODE, 5.0, changes)
    assert gpu_view(engine, 0, 5.0).process_state is None


def test_a_mig_parent_is_not_judged_its_instances_are(tmp_path: Path) -> None:
    engine = loaded(tmp_path)
    changes = Changes()
    parent = GPUInfo(uuid="GPU-p", index=0, model=MODEL, memory_total_mib=40960,
                     mig_mode=True, processes=[proc(1, None)])
    instance = GPUInfo(uuid="MIG-p-1", index=0, model=MODEL, memory_total_mib=10240,
                       mig_parent_uuid="GPU-p", mig_profile="2g.10gb", mig_index=1,
                       processes=[proc(1, None)])
    engine.handle(Heartbeat(host="a", agent_id="agent-a", seq=next(SEQ), sent_at=1.0,
                            interval_s=2, gpus=[parent, instance], source="simulated"),
                  NODE, 1.0, changes)
    states = {g.uuid: g.process_state for g in engine.inventory(1.0).gpus}
    assert states == {"GPU-p": None, "MIG-p-1": ProcessState.OUTSIDE_USE}


# ------------------------------------------------------------------ the hello


def test_each_agent_is_told_once_what_the_allocator_reads(tmp_path: Path) -> None:
    engine = loaded(tmp_path)
    changes = Changes()
    hello = AllocatorHello(host="a", reads=[GPU_PROCESSES, INTERCONNECT, LEASE_USAGE])
    engine.handle(beat(1.0), NODE, 1.0, changes)
    assert engine.take_agent_commands() == [hello]
    engine.handle(beat(2.0), NODE, 2.0, changes)
    engine.handle(HeartbeatDelta(host="a", agent_id="agent-a", seq=next(SEQ), sent_at=3.0,
                                 interval_s=2), NODE, 3.0, changes)
    assert engine.take_agent_commands() == [], "once per agent"
    engine.handle(beat(4.0, agent_id="agent-a-restarted"), NODE, 4.0, changes)
    assert engine.take_agent_commands() == [hello], "a restarted agent is a new agent"
    engine.load(_empty_state(tmp_path), 5.0)  # a takeover, a restart, a failed commit
    engine.handle(beat(6.0, agent_id="agent-a-restarted"), NODE, 6.0, changes)
    assert engine.take_agent_commands() == [hello], "told again by the replica now active"
    # A host that may not report is not told anything.
    stranger = Sender(user_id="agent", via_nodes_exchange=True)
    refused = loaded(tmp_path, allow_any_node_user=False, node_users={"a": "agent-of-a"})
    refused.handle(beat(7.0), stranger, 7.0, Changes())
    assert refused.take_agent_commands() == []


def test_a_hello_that_did_not_go_out_is_decided_again_at_the_agents_next_message(
        tmp_path: Path) -> None:
    engine = loaded(tmp_path)
    changes = Changes()
    hello = AllocatorHello(host="a", reads=[GPU_PROCESSES, INTERCONNECT, LEASE_USAGE])
    engine.handle(beat(1.0), NODE, 1.0, changes)
    assert engine.take_agent_commands() == [hello]
    engine.hellos_not_sent(["a"])  # the broker did not take it
    engine.handle(HeartbeatDelta(host="a", agent_id="agent-a", seq=next(SEQ), sent_at=2.0,
                                 interval_s=2), NODE, 2.0, changes)
    assert engine.take_agent_commands() == [hello]
    engine.handle(beat(3.0), NODE, 3.0, changes)
    assert engine.take_agent_commands() == [], "sent this time: once per agent again"
    engine.hellos_not_sent(["b"])  # no agent of b has been greeted: nothing to do
    engine.handle(beat(4.0), NODE, 4.0, changes)
    assert engine.take_agent_commands() == []


def test_an_empty_delta_after_the_end_verifies_the_release(tmp_path: Path) -> None:
    """The report that first left the container out came before its die event (within
    container_gone_grace_s): the agent's next report changes nothing, an empty delta, and
    still settles the drain (the heartbeat's short path does not skip it)."""
    engine = loaded(tmp_path)
    changes = Changes()
    lease_id, container = bound_lease(engine, changes, gpus=1)
    engine.handle(beat(1.5, gpus=1), NODE, 1.5, changes)
    assert engine.leases[lease_id].state is LeaseState.BOUND, "within the grace"
    died(engine, lease_id, container, 2.0, changes)
    waiting = allocate(engine, "hub/bob/", 2.1, changes, wait_s=60).lease
    assert waiting.state is LeaseState.QUEUED
    engine.handle(HeartbeatDelta(host="a", agent_id="agent-a", seq=next(SEQ), sent_at=2.5,
                                 interval_s=2), NODE, 2.5, changes)
    assert engine.leases[waiting.lease_id].state is LeaseState.GRANTED


def test_a_granted_leases_process_before_its_bind_is_no_outside_use(tmp_path: Path) -> None:
    """A report that cannot list containers (Docker slow) shows the new container's process
    on its granted GPU: that GPU's own lease, not use outside swarm-gpu; a named container
    there is."""
    engine = loaded(tmp_path)
    changes = Changes()
    engine.handle(beat(0.5), NODE, 0.5, changes)
    lease = allocate(engine, "hub/alice/", 1.0, changes).lease
    [gpu] = lease.gpu_uuids
    index = int(gpu.rsplit("-", 1)[1])
    partial = beat(1.5, processes={index: [proc(8, "c-new")]}).model_copy(
        update={"containers_complete": False})
    engine.handle(partial, NODE, 1.5, changes)
    assert gpu_view(engine, index, 1.5).process_state is None
    named = beat(2.0, processes={index: [proc(9, "c-other", container_name="other")]})
    engine.handle(named.model_copy(update={"containers_complete": False}), NODE, 2.0, changes)
    assert gpu_view(engine, index, 2.0).process_state is ProcessState.OUTSIDE_USE


def test_a_report_that_left_processes_out_does_not_verify_a_release(tmp_path: Path) -> None:
    engine = loaded(tmp_path)
    changes = Changes()
    lease_id, container = bound_lease(engine, changes, gpus=1)
    died(engine, lease_id, container, 2.0, changes)
    partial = beat(3.0, gpus=1)
    partial.gpus[0] = partial.gpus[0].model_copy(update={"processes_omitted": 3})
    engine.handle(partial, NODE, 3.0, changes)
    assert gpu_view(engine, 0, 3.0).process_state is ProcessState.DRAINING
    engine.tick(12.0, changes)  # the bound: nothing of the container was listed, so free
    assert gpu_view(engine, 0, 12.0).process_state is None


def test_stopping_slices_over_budget_needs_stop_commands(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match='over_budget_action = "stop" needs '
                                              "stop_containers = true"):
        settings(tmp_path, over_budget_action="stop", stop_containers=False)
