"""Heartbeat deltas: an agent's deltas rebuild its full reports exactly, an engine fed deltas
holds what an engine fed the full reports holds, a gap is detected and repaired by the next full
report, a delta never ends a running container's lease, and deltas alone keep a node alive.

The pure parts (:mod:`allocator.wire.heartbeat_delta`) and the engine over real SQLite ledgers; the
end-to-end test with a real agent and allocator is in ``tests/e2e/test_heartbeat_delta_e2e.py``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.config import AllocatorSettings
from allocator.engine import Engine
from allocator.ledger.changes import Changes
from allocator.ledger.store import Ledger
from allocator.metrics.counters import Count
from allocator.wire.heartbeat_delta import EXACT, Thresholds, apply_delta, delta_between
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerAction,
    ContainerEvent,
    ContainerInfo,
    GPUInfo,
    GPUProcess,
    Health,
    Heartbeat,
    HeartbeatDelta,
    LeaseReply,
    LeaseState,
    ProcessUse,
    ReleaseRequest,
)
from tests.support.common import HUB, NODE

HOST = "h"
MODEL = "NVIDIA GeForce GTX 1070"
GPU_UUIDS = [f"GPU-{HOST}-{i}" for i in range(3)]


def gpu(index: int, *, used: int = 0, util: float | None = 0.0, temp: float | None = 40.0,
        healthy: bool = True, xids: tuple[int, ...] = (),
        processes: Sequence[tuple[int, int | None, str | None]] | None = None) -> GPUInfo:
    """A GPU entry; ``processes``: (pid, memory, container) each, None: not known."""
    listed = None if processes is None else [
        GPUProcess(pid=pid, memory_used_mib=memory, name="python", container_id=container)
        for pid, memory, container in processes]
    return GPUInfo(uuid=GPU_UUIDS[index], index=index, model=MODEL, memory_total_mib=8192,
                   memory_used_mib=used, utilization_pct=util, temperature_c=temp, power_w=30.0,
                   recent_xids=list(xids),
                   health=Health.HEALTHY if healthy else Health.UNHEALTHY,
                   health_reasons=[] if healthy else ["overheated"], processes=listed)


def container(lease_id: str, *, used: int = 0, util: float | None = None) -> ContainerInfo:
    return ContainerInfo(container_id=f"c-{lease_id}", lease_id=lease_id,
                         name=f"jupyter-{lease_id}", started_at=5.0,
                         gpu_use=[ProcessUse(gpu_uuid=GPU_UUIDS[0], memory_used_mib=used,
                                             utilization_pct=util)] if used else [])


def beat(seq: int, at: float, gpus: list[GPUInfo], containers: list[ContainerInfo], *,
         agent_id: str = "agent-1", complete: bool = True) -> Heartbeat:
    return Heartbeat(host=HOST, agent_id=agent_id, seq=seq, sent_at=at, interval_s=2.0,
                     gpus=gpus, containers=containers, containers_complete=complete,
                     source="simulated")


class Agent:
    """The agent's side of the protocol, as nodeagent.agent does it: a delta of the report
    the allocator holds when one can say what changed, else the full heartbeat."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.thresholds = thresholds
        self.reported: Heartbeat | None = None

    def message(self, current: Heartbeat) -> Heartbeat | HeartbeatDelta:
        delta = (delta_between(self.reported, current, self.thresholds)
                 if self.reported is not None else None)
        if delta is None:
            self.reported = current
            return current
        assert self.reported is not None
        self.reported = apply_delta(self.reported, delta)
        return delta


# ------------------------------------------------------------------------ the pure parts

telemetry = st.fixed_dictionaries({
    "used": st.integers(0, 8192), "util": st.one_of(st.none(), st.floats(0, 100)),
    "temp": st.one_of(st.none(), st.floats(20, 95)), "healthy": st.booleans(),
    "xids": st.sampled_from([(), (13,), (79,)]),
    # Not known, or up to three of three processes (of a lease container, another one, the
    # host), in the agent's order: the most memory first.
    "processes": st.one_of(st.none(), st.lists(
        st.tuples(st.sampled_from([101, 102, 103]), st.one_of(st.none(), st.integers(0, 4096)),
                  st.sampled_from([None, "c-lease-0", "f" * 64])),
        max_size=3, unique_by=lambda entry: entry[0]).map(
            lambda entries: sorted(entries, key=lambda e: (-(e[1] if e[1] is not None else -1),
                                                           e[0])))),
})
host_state = st.fixed_dictionaries({
    "gpus": st.lists(telemetry, min_size=3, max_size=3),
    # Which of three lease containers run (as a set change forces a full report), and their use.
    "containers": st.lists(st.tuples(st.booleans(), st.integers(0, 4096),
                                     st.one_of(st.none(), st.floats(0, 100))),
                           min_size=3, max_size=3),
    "complete": st.booleans(),
})


def heartbeats_of(states: list[dict[str, Any]]) -> list[Heartbeat]:
    beats = []
    for seq, state in enumerate(states):
        gpus = [gpu(i, **g) for i, g in enumerate(state["gpus"])]
        running = [container(f"lease-{i}", used=used, util=util)
                   for i, (on, used, util) in enumerate(state["containers"]) if on]
        beats.append(beat(seq, 100.0 + 2 * seq, gpus, running,
                          complete=bool(state["complete"])))
    return beats


def rebuilt(agent: Agent, beats: list[Heartbeat]) -> Iterator[tuple[Heartbeat, Heartbeat]]:
    """(the report the allocator rebuilds from the agent's message, the full heartbeat) for
    each beat."""
    held: Heartbeat | None = None
    for current in beats:
        message = agent.message(current)
        if isinstance(message, HeartbeatDelta):
            assert held is not None
            held = apply_delta(held, message)
        else:
            held = message
        assert held is not None
        yield held, current


@settings(max_examples=300, deadline=None)
@given(st.lists(host_state, min_size=1, max_size=12))
def test_deltas_rebuild_every_full_report_exactly(states: list[dict[str, Any]]) -> None:
    """With exact thresholds, the report the allocator rebuilds from the messages equals the
    full heartbeat the agent built, after every beat; and some beats do go out as deltas."""
    agent = Agent(EXACT)
    for held, current in rebuilt(agent, heartbeats_of(states)):
        assert held == current
        assert agent.reported == current


@settings(max_examples=200, deadline=None)
@given(st.lists(host_state, min_size=1, max_size=12))
def test_with_thresholds_only_telemetry_lags_and_never_beyond_its_threshold(
        states: list[dict[str, Any]]) -> None:
    thresholds = Thresholds()
    for held, current in rebuilt(Agent(thresholds), heartbeats_of(states)):
        assert [c.container_id for c in held.containers] == [
            c.container_id for c in current.containers]
        assert held.containers_complete == current.containers_complete
        for old, new in zip(held.gpus, current.gpus, strict=True):
            lagging = {"memory_used_mib", "utilization_pct", "temperature_c", "processes"}
            assert old.model_dump(exclude=lagging) == new.model_dump(exclude=lagging)
            assert abs(old.memory_used_mib - new.memory_used_mib) < thresholds.memory_mib
            # The same processes in the same containers; only their memory lags, as little.
            if old.processes is None or new.processes is None:
                assert old.processes is new.processes
            else:
                before = {p.pid: p for p in old.processes}
                after = {p.pid: p for p in new.processes}
                assert before.keys() == after.keys()
                for pid, process in after.items():
                    assert before[pid].container_id == process.container_id
                    was, now = before[pid].memory_used_mib, process.memory_used_mib
                    if was is None or now is None:
                        assert was is now
                    else:
                        assert abs(was - now) < thresholds.memory_mib
            if old.utilization_pct is None or new.utilization_pct is None:
                assert old.utilization_pct is new.utilization_pct
            else:
                assert abs(old.utilization_pct - new.utilization_pct) < thresholds.utilization_pct
                # On the same side of every multiple of the threshold (the idle line at 5 %).
                assert (old.utilization_pct < 5) == (new.utilization_pct < 5)


def test_a_steady_host_sends_empty_deltas_and_a_changed_gpu_alone() -> None:
    first = beat(0, 100.0, [gpu(0), gpu(1), gpu(2)], [container("a", used=1000)])
    steady = first.model_copy(update={"seq": 1, "sent_at": 102.0,
                                      "gpus": [gpu(0, util=3.0), gpu(1), gpu(2)]})
    delta = delta_between(first, steady, Thresholds())
    assert delta is not None and delta.gpus == [] and delta.containers == []
    hot = steady.model_copy(update={"seq": 2, "gpus": [gpu(0), gpu(1, healthy=False), gpu(2)],
                                    "containers": [container("a", used=1500, util=80.0)]})
    delta = delta_between(steady, hot, Thresholds())
    assert delta is not None
    assert [g.uuid for g in delta.gpus] == [GPU_UUIDS[1]]
    assert [c.container_id for c in delta.containers] == ["c-a"]  # gpu_use went on flowing
    # A container that came or went, or an incomplete listing: only a full report says it.
    assert delta_between(hot, hot.model_copy(update={"seq": 3, "containers": []}),
                         Thresholds()) is None
    assert delta_between(hot, hot.model_copy(update={"seq": 3, "containers_complete": False}),
                         Thresholds()) is None


def test_a_gpu_is_sent_again_when_its_processes_change() -> None:
    """A pid that comes or goes, moves to another container, or uses memory beyond the
    threshold; and processes that become known or not known. Memory within the threshold,
    or the same processes in another order, send nothing."""
    listed = [(101, 900, "c-lease-0"), (102, 300, None)]
    first = beat(0, 100.0, [gpu(0, processes=listed), gpu(1, processes=[]), gpu(2)], [])

    def changed(**gpu0: Any) -> list[str]:
        current = first.model_copy(update={"seq": 1, "gpus": [gpu(0, **gpu0), *first.gpus[1:]]})
        delta = delta_between(first, current, Thresholds())
        assert delta is not None
        return [g.uuid for g in delta.gpus]

    assert changed(processes=listed) == []
    assert changed(processes=[(101, 1000, "c-lease-0"), (102, 300, None)]) == []
    assert changed(processes=[(102, 300, None), (101, 900, "c-lease-0")]) == []
    for different in ([(101, 900, "c-lease-0")],  # one went
                      [*listed, (103, 0, None)],  # one came
                      [(101, 900, "f" * 64), (102, 300, None)],  # another container's
                      [(101, 1200, "c-lease-0"), (102, 300, None)],  # beyond the threshold
                      [(101, None, "c-lease-0"), (102, 300, None)]):  # no longer measured
        assert changed(processes=different) == [GPU_UUIDS[0]], different
    assert changed(processes=None) == [GPU_UUIDS[0]]  # the listing failed: not known
    omitted = first.gpus[0].model_copy(update={"processes_omitted": 4})
    delta = delta_between(first, first.model_copy(update={
        "seq": 1, "gpus": [omitted, *first.gpus[1:]]}), Thresholds())
    assert delta is not None and [g.uuid for g in delta.gpus] == [GPU_UUIDS[0]]


def test_a_delta_that_does_not_follow_the_report_held_does_not_apply() -> None:
    base = beat(4, 100.0, [gpu(0), gpu(1), gpu(2)], [container("a")])
    fits = HeartbeatDelta(host=HOST, agent_id="agent-1", seq=5, sent_at=102.0, interval_s=2.0)
    assert apply_delta(base, fits) is not None
    assert apply_delta(base, fits.model_copy(update={"seq": 6})) is None  # one was lost
    assert apply_delta(base, fits.model_copy(update={"seq": 4})) is None
    assert apply_delta(base, fits.model_copy(update={"agent_id": "agent-2"})) is None
    stranger = container("b")
    assert apply_delta(base, fits.model_copy(update={"containers": [stranger]})) is None
    moved = gpu(0).model_copy(update={"index": 7})
    assert apply_delta(base, fits.model_copy(update={"gpus": [moved]})) is None


# ---------------------------------------------------------------------------- the engine


def engine_on(path: Path, **overrides: object) -> tuple[Engine, Ledger]:
    options: dict[str, object] = {"ledger_path": path, "allow_any_node_user": True,
                                  "container_gone_grace_s": 1.0, "node_down_after_s": 10.0}
    options.update(overrides)
    settings_ = AllocatorSettings(**options)  # type: ignore[arg-type]
    ledger = Ledger(path)
    ledger.open()
    return Engine(settings_, started_at=0.0), ledger


def apply(engine: Engine, ledger: Ledger, message: object, now: float) -> object:
    changes = Changes()
    reply = engine.handle(message, NODE if isinstance(  # type: ignore[arg-type]
        message, Heartbeat | HeartbeatDelta | ContainerEvent) else HUB, now, changes)
    ledger.call(lambda: ledger.commit(changes))
    return reply


def comparable(engine: Engine, ledger: Ledger, now: float) -> tuple[object, object]:
    """The engine's inventory with its leases, and the lease book on disk."""
    inventory = engine.inventory(now, include_leases=True).model_dump()
    on_disk = ledger.call(ledger.load)
    leases = sorted((r.lease_id, r.state.value, r.container_id, r.release_reason)
                    for r in [*on_disk.leases, *on_disk.finished])
    return inventory, leases


@settings(max_examples=40, deadline=None)
@given(st.lists(host_state, min_size=2, max_size=10))
def test_an_engine_fed_deltas_holds_what_one_fed_full_reports_holds(
        states: list[dict[str, Any]]) -> None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="swarm-gpu-delta-") as folder:
        full, full_ledger = engine_on(Path(folder) / "full.sqlite")
        deltas, delta_ledger = engine_on(Path(folder) / "deltas.sqlite")
        try:
            agent = Agent(EXACT)
            beats = heartbeats_of(states)
            for step, current in enumerate(beats):
                now = current.sent_at + 0.1
                if step == 1:
                    # Three leases (granted, or queued behind unhealthy GPUs), bound or ended by
                    # the containers the heartbeats list; the same lease ids in both engines.
                    replies = []
                    for engine, ledger in ((full, full_ledger), (deltas, delta_ledger)):
                        engine.new_lease_id = iter(f"lease-{i}" for i in range(3)).__next__
                        replies.append([apply(engine, ledger, AllocateRequest(
                            request_key=f"k{i}", user=f"u{i}", host=HOST, wait_s=600), now)
                            for i in range(3)])
                    assert all(isinstance(r, LeaseReply) for r in replies[0])
                    assert replies[0] == replies[1]
                apply(full, full_ledger, current, now)
                apply(deltas, delta_ledger, agent.message(current), now)
                assert comparable(full, full_ledger, now) == comparable(deltas, delta_ledger, now)
            assert deltas.counters[Count.HEARTBEATS.value] == len(beats)
        finally:
            full_ledger.close()
            delta_ledger.close()


def test_a_gap_is_not_applied_and_the_next_full_report_repairs_it(tmp_path: Path) -> None:
    engine, ledger = engine_on(tmp_path / "ledger.sqlite")
    try:
        gpus = [gpu(0), gpu(1), gpu(2)]
        apply(engine, ledger, beat(0, 100.0, gpus, []), 100.0)
        hot = HeartbeatDelta(host=HOST, agent_id="agent-1", seq=1, sent_at=102.0,
                             interval_s=2.0, gpus=[gpu(1, healthy=False)])
        apply(engine, ledger, hot, 102.0)
        assert engine.counters[Count.HEARTBEAT_DELTAS.value] == 1
        assert engine.cluster.gpus[GPU_UUIDS[1]].health is Health.UNHEALTHY
        # seq 2 was lost: seq 3 says GPU 2 overheated, onto a report the engine does not have.
        lost_after = HeartbeatDelta(host=HOST, agent_id="agent-1", seq=3, sent_at=106.0,
                                    interval_s=2.0, gpus=[gpu(2, healthy=False)])
        apply(engine, ledger, lost_after, 106.0)
        apply(engine, ledger, lost_after.model_copy(update={"seq": 4, "sent_at": 108.0}), 108.0)
        assert engine.counters[Count.HEARTBEAT_DELTA_GAPS.value] == 1
        assert engine.counters[Count.HEARTBEAT_DELTAS_UNAPPLIED.value] == 1
        assert engine.counters[Count.HEARTBEAT_DELTAS.value] == 1
        assert engine.cluster.gpus[GPU_UUIDS[2]].health is Health.HEALTHY  # not applied
        assert engine.cluster.nodes[HOST].last_heartbeat == 108.0  # but alive
        # The next full report is the truth again, and deltas apply onto it.
        apply(engine, ledger, beat(5, 110.0, [gpu(0), gpu(1), gpu(2, healthy=False)], []), 110.0)
        assert engine.cluster.gpus[GPU_UUIDS[1]].health is Health.HEALTHY
        assert engine.cluster.gpus[GPU_UUIDS[2]].health is Health.UNHEALTHY
        apply(engine, ledger, HeartbeatDelta(host=HOST, agent_id="agent-1", seq=6,
                                             sent_at=112.0, interval_s=2.0,
                                             gpus=[gpu(2)]), 112.0)
        assert engine.counters[Count.HEARTBEAT_DELTAS.value] == 2
        assert engine.cluster.gpus[GPU_UUIDS[2]].health is Health.HEALTHY
        # A delta of an unknown host brings nothing in; a replayed one is stale.
        apply(engine, ledger, HeartbeatDelta(host="other", agent_id="x", seq=1, sent_at=112.0,
                                             interval_s=2.0), 112.5)
        assert "other" not in engine.cluster.nodes
        apply(engine, ledger, hot, 113.0)
        assert engine.counters[Count.HEARTBEAT_STALE.value] == 1
    finally:
        ledger.close()


def test_no_delta_ever_ends_a_running_containers_lease(tmp_path: Path) -> None:
    engine, ledger = engine_on(tmp_path / "ledger.sqlite")
    try:
        gpus = [gpu(0), gpu(1), gpu(2)]
        apply(engine, ledger, beat(0, 100.0, gpus, []), 100.0)
        reply = apply(engine, ledger, AllocateRequest(request_key="k", user="u", host=HOST),
                      100.5)
        assert isinstance(reply, LeaseReply)
        lease_id = reply.lease.lease_id
        apply(engine, ledger, ContainerEvent(host=HOST, container_id=f"c-{lease_id}",
                                             lease_id=lease_id, action=ContainerAction.START,
                                             at=101.0), 101.0)
        apply(engine, ledger, beat(1, 102.0, gpus, [container(lease_id)]), 102.0)
        assert engine.leases[lease_id].state is LeaseState.BOUND
        # Deltas long past container_gone_grace_s: empty ones, GPU changes, a gap, a container
        # the report does not have, and one with the running container's new use.
        messages = [
            HeartbeatDelta(host=HOST, agent_id="agent-1", seq=2, sent_at=110.0, interval_s=2.0),
            HeartbeatDelta(host=HOST, agent_id="agent-1", seq=3, sent_at=120.0, interval_s=2.0,
                           gpus=[gpu(0, used=4000, util=90.0)]),
            HeartbeatDelta(host=HOST, agent_id="agent-1", seq=4, sent_at=130.0, interval_s=2.0,
                           containers=[container(lease_id, used=3000, util=70.0)]),
            HeartbeatDelta(host=HOST, agent_id="agent-1", seq=9, sent_at=140.0, interval_s=2.0),
            HeartbeatDelta(host=HOST, agent_id="agent-1", seq=10, sent_at=150.0, interval_s=2.0,
                           containers=[container("someone-else")]),
        ]
        for message in messages:
            apply(engine, ledger, message, message.sent_at)
            assert engine.leases[lease_id].state is LeaseState.BOUND
            engine.tick(message.sent_at, Changes())
        assert engine.counters[Count.HEARTBEAT_DELTAS.value] == 3
        # Only a full report that no longer lists it ends it.
        apply(engine, ledger, beat(11, 160.0, gpus, []), 160.0)
        assert lease_id not in engine.leases
    finally:
        ledger.close()


def test_deltas_alone_keep_a_node_alive(tmp_path: Path) -> None:
    engine, ledger = engine_on(tmp_path / "ledger.sqlite", node_down_after_s=10.0)
    try:
        apply(engine, ledger, beat(0, 100.0, [gpu(0), gpu(1), gpu(2)], []), 100.0)
        apply(engine, ledger, beat(0, 100.0, [gpu(0)], [], agent_id="quiet").model_copy(
            update={"host": "quiet", "gpus": [GPUInfo(uuid="GPU-q", index=0, model=MODEL,
                                                      memory_total_mib=8192)]}), 100.0)
        # Every 5 s for 60 s: deltas only, some after a gap (liveness only).
        seq = 0
        for at in range(105, 165, 5):
            seq += 2 if at == 130 else 1
            apply(engine, ledger, HeartbeatDelta(host=HOST, agent_id="agent-1", seq=seq,
                                                 sent_at=float(at), interval_s=2.0), float(at))
            engine.tick(float(at) + 0.5, Changes())
        assert engine.counters[Count.HEARTBEAT_DELTA_GAPS.value] == 1
        assert engine.counters[Count.HEARTBEAT_DELTAS_UNAPPLIED.value] > 0
        views = {node.host: node for node in engine.inventory(161.0).nodes}
        assert views[HOST].up
        assert not views["quiet"].up  # the node that sent nothing went down meanwhile
        on_disk = {node.host: node.last_heartbeat for node in ledger.call(ledger.load).nodes}
        assert on_disk[HOST] == 160.0  # a standby taking over sees it alive too
        # A down node that sends a delta is up again at once.
        apply(engine, ledger, HeartbeatDelta(host="quiet", agent_id="quiet", seq=1,
                                             sent_at=170.0, interval_s=2.0), 170.0)
        assert {node.host: node for node in engine.inventory(170.5).nodes}["quiet"].up
    finally:
        ledger.close()


def test_an_empty_delta_does_exactly_what_the_full_report_it_stands_for_does(
        tmp_path: Path) -> None:
    """An empty delta is not liveness alone: the report it stands for still drives the rules
    that depend on time (use samples and idle spells, the stop a released lease's running
    container is asked again, telemetry written now and then), so both engines must agree."""
    # Telemetry written every 5 s, a stop asked again at every 2 s heartbeat.
    options: dict[str, object] = {"telemetry_persist_s": 5.0, "container_stop_grace_s": 0.5,
                                  "container_stop_retry_s": 0.5}
    full, full_ledger = engine_on(tmp_path / "full.sqlite", **options)
    deltas, delta_ledger = engine_on(tmp_path / "deltas.sqlite", **options)
    engines = ((full, full_ledger), (deltas, delta_ledger))
    gpus = [gpu(0, used=4000, util=90.0), gpu(1), gpu(2)]
    try:
        for engine, ledger in engines:
            engine.new_lease_id = iter(f"lease-{i}" for i in range(2)).__next__
            apply(engine, ledger, beat(0, 100.0, gpus, []), 100.0)
            for i in range(2):
                reply = apply(engine, ledger, AllocateRequest(
                    request_key=f"k{i}", user=f"u{i}", host=HOST), 100.5)
                assert isinstance(reply, LeaseReply)
                apply(engine, ledger, ContainerEvent(
                    host=HOST, container_id=f"c-lease-{i}", lease_id=f"lease-{i}",
                    action=ContainerAction.START, at=101.0), 101.0)
        running = [container("lease-0", used=4000, util=90.0), container("lease-1")]
        for engine, ledger in engines:
            apply(engine, ledger, beat(1, 102.0, gpus, running), 102.0)
            assert engine.leases["lease-1"].state is LeaseState.BOUND
        for seq in range(2, 10):
            at = 100.0 + 2 * seq
            if seq == 4:
                for engine, ledger in engines:
                    apply(engine, ledger, ReleaseRequest(lease_id="lease-1"), at - 1)
                    assert engine.leases["lease-1"].state is LeaseState.RELEASING
            apply(full, full_ledger, beat(seq, at, gpus, running), at + 0.1)
            empty = HeartbeatDelta(host=HOST, agent_id="agent-1", seq=seq, sent_at=at,
                                   interval_s=2.0)
            apply(deltas, delta_ledger, empty, at + 0.1)
            assert deltas.counters[Count.HEARTBEAT_DELTAS.value] == seq - 1
            assert deltas.cluster.nodes[HOST].last_heartbeat == at + 0.1
            assert (deltas.nodes.newest_beat[HOST] == full.nodes.newest_beat[HOST]
                    == ("agent-1", seq, at))
            assert deltas.nodes.reported[HOST] == full.nodes.reported[HOST]
            assert comparable(full, full_ledger, at) == comparable(deltas, delta_ledger, at)
            assert full_ledger.call(full_ledger.load) == delta_ledger.call(delta_ledger.load)
            assert [(c.lease_id, c.reason) for c in full.commands] == [
                (c.lease_id, c.reason) for c in deltas.commands]
            for lease_id in ("lease-0", "lease-1"):
                assert full.use.latest(lease_id) == deltas.use.latest(lease_id)
                assert full.use.history(lease_id) == deltas.use.history(lease_id)
        # Each heartbeat asked again for the stop of the released lease's running container.
        assert [c.lease_id for c in deltas.commands].count("lease-1") >= 6
        # Every counter alike but the deltas' own.
        assert {name: deltas.counters[name] for name in deltas.counters
                if name != Count.HEARTBEAT_DELTAS.value} == {
                    name: full.counters[name] for name in full.counters}
    finally:
        full_ledger.close()
        delta_ledger.close()
