"""Measured usage on the lease, in the engine over a real SQLite ledger file: the agents'
counters folded in (the growth within one measurement, all of a new one, nothing of an older
one), kept through a rebuild from the ledger and through a restart of the agent, on a lease
adopted from its container's labels, and in the replicated log beside the lease rows (so a
replica whose schema has no usage columns still follows it). ``fold_usage`` by hand-computed
values. The agent's side is in tests/agent/test_usage_meter.py and test_nodeagent.py."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from allocator.config import AllocatorSettings
from allocator.engine import Engine, Sender
from allocator.engine.idle import USAGE_WRITE_S
from allocator.engine.lease_use import fold_usage
from allocator.ledger.changes import LEASE_USAGE_BESIDE, Changes
from allocator.ledger.lease import LeaseRecord
from allocator.ledger.log_position import LogPosition
from allocator.ledger.store import Ledger
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerAction,
    ContainerEvent,
    ContainerGrant,
    ContainerInfo,
    GPUInfo,
    Heartbeat,
    LeaseReply,
    LeaseState,
    LeaseUsage,
)

NODE = Sender(user_id="agent", via_nodes_exchange=True)
HUB = Sender(user_id="hub", via_nodes_exchange=False)
MODEL = "NVIDIA A100-SXM4-40GB"
SEQ = itertools.count()


def usage(since: float, energy_j: float, sm_s: float = 0.0, memory_s: float = 0.0,
          peak: int = 0) -> LeaseUsage:
    return LeaseUsage(since=since, energy_j=energy_j, sm_s=sm_s, memory_s=memory_s,
                      peak_memory_mib=peak)


def beat(at: float, containers: Sequence[ContainerInfo] = (), agent_id: str = "agent-a"
         ) -> Heartbeat:
    return Heartbeat(host="a", agent_id=agent_id, seq=next(SEQ), sent_at=at, interval_s=2,
                     containers=list(containers), source="simulated",
                     gpus=[GPUInfo(uuid=f"GPU-a-{i}", index=i, model=MODEL,
                                   memory_total_mib=40960, processes=[]) for i in range(2)])


def running(lease_id: str, measured: LeaseUsage | None,
            grant: ContainerGrant | None = None) -> ContainerInfo:
    return ContainerInfo(container_id=f"c-{lease_id}", lease_id=lease_id, started_at=0.5,
                         usage=measured, grant=grant)


class Site:
    """An engine over a ledger file, committing each step as the service does."""

    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "ledger.sqlite"
        self.settings = AllocatorSettings.model_validate(
            {"ledger_path": self.path, "allow_any_node_user": True})
        self.engine = self.rebuilt(0.0)

    def rebuilt(self, now: float) -> Engine:
        """A new engine loaded from the ledger file (a restart or a takeover)."""
        ledger = Ledger(self.path)
        ledger.open()
        try:
            state = ledger.call(ledger.load)
        finally:
            ledger.close()
        engine = Engine(self.settings, started_at=now)
        engine.load(state, now, fenced=False)
        return engine

    def step(self, message: AllocateRequest | Heartbeat | ContainerEvent, now: float
             ) -> object:
        changes = Changes()
        reply = self.engine.handle(message, HUB if isinstance(message, AllocateRequest)
                                   else NODE, now, changes)
        ledger = Ledger(self.path)
        ledger.open()
        try:
            ledger.call(lambda: ledger.commit(changes))
        finally:
            ledger.close()
        return reply

    def stored(self, lease_id: str) -> LeaseRecord:
        ledger = Ledger(self.path)
        ledger.open()
        try:
            record = ledger.call(lambda: ledger.find_lease(lease_id))
        finally:
            ledger.close()
        assert record is not None
        return record


def totals(record: LeaseRecord) -> tuple[object, ...]:
    return (record.energy_j, record.sm_s, record.memory_s, record.peak_memory_mib)


def test_fold_adds_growth_a_new_measurement_whole_and_ignores_an_older_one() -> None:
    record = LeaseRecord(lease_id="L", request_key="hub/a/", user="a", groups=(),
                         state=LeaseState.BOUND, created_at=0.0, request={})
    assert fold_usage(record, usage(10.0, 100.0, 5.0, 1.0, 300))
    assert totals(record) == (100.0, 5.0, 1.0, 300)
    assert fold_usage(record, usage(10.0, 160.0, 8.0, 1.5, 200))
    assert totals(record) == (160.0, 8.0, 1.5, 300)
    assert not fold_usage(record, usage(10.0, 160.0, 8.0, 1.5, 200)), "nothing new"
    # The agent restarted: its new measurement counts from 0, and all of it is added.
    assert fold_usage(record, usage(50.0, 40.0, 2.0, 0.5, 900))
    assert totals(record) == (200.0, 10.0, 2.0, 900)
    # A late report of the old measurement adds nothing; a counter that went back neither.
    assert not fold_usage(record, usage(10.0, 999.0, 99.0, 9.0, 5000))
    assert fold_usage(record, usage(50.0, 30.0, 3.0, 0.5, 900))
    assert totals(record) == (200.0, 11.0, 2.0, 900)
    assert (record.usage_since, record.usage_run_energy_j) == (50.0, 30.0)


def test_usage_is_stored_with_the_lease_and_kept_through_a_rebuild(tmp_path: Path) -> None:
    site = Site(tmp_path)
    site.step(beat(0.5), 0.5)
    reply = site.step(AllocateRequest(request_key="hub/alice/", user="alice", model=MODEL), 1.0)
    assert isinstance(reply, LeaseReply)
    lease_id = reply.lease.lease_id
    site.step(beat(2.0, [running(lease_id, usage(1.5, 100.0, 10.0, 2.0, 500))]), 2.0)
    assert site.engine.leases[lease_id].state is LeaseState.BOUND
    assert totals(site.stored(lease_id)) == (100.0, 10.0, 2.0, 500)
    # Within USAGE_WRITE_S the growth is in memory only; the ledger keeps the last write.
    site.step(beat(4.0, [running(lease_id, usage(1.5, 150.0, 12.0, 2.0, 500))]), 4.0)
    assert totals(site.engine.leases[lease_id]) == (150.0, 12.0, 2.0, 500)
    assert totals(site.stored(lease_id)) == (100.0, 10.0, 2.0, 500)
    # A restart (rebuilt from the ledger) loses the memory, not the usage: the next report
    # adds its growth over what was written.
    site.engine = site.rebuilt(5.0)
    site.step(beat(6.0, [running(lease_id, usage(1.5, 180.0, 13.0, 3.0, 700))]), 6.0)
    assert totals(site.engine.leases[lease_id]) == (180.0, 13.0, 3.0, 700)
    # The agent restarted (a new measurement), and a write is due again.
    later = 6.0 + USAGE_WRITE_S
    site.step(beat(later, [running(lease_id, usage(later - 1, 20.0, 1.0, 0.0, 100))],
                   agent_id="agent-a2"), later)
    assert totals(site.stored(lease_id)) == (200.0, 14.0, 3.0, 700)
    # The lease ends: its usage so far is written with it.
    site.step(beat(later + 1, [running(lease_id, usage(later - 1, 25.0, 1.5, 0.0, 100))],
                   agent_id="agent-a2"), later + 1)
    site.step(ContainerEvent(host="a", container_id=f"c-{lease_id}", lease_id=lease_id,
                             action=ContainerAction.DIE, at=later + 2), later + 2)
    stored = site.stored(lease_id)
    assert stored.state is LeaseState.RELEASED
    assert totals(stored) == (205.0, 14.5, 3.0, 700)


def test_an_adopted_lease_takes_the_usage_its_container_reports(tmp_path: Path) -> None:
    site = Site(tmp_path)
    site.step(beat(0.5), 0.5)
    grant = ContainerGrant(host="a", gpu_uuids=["GPU-a-1"], user="bob",
                           request_key="hub/bob/")
    site.step(beat(1.0, [running("L-lost", usage(0.2, 4_000.0, 30.0, 6.0, 1200), grant)]), 1.0)
    adopted = site.engine.leases["L-lost"]
    assert adopted.state is LeaseState.BOUND
    assert totals(adopted) == (4_000.0, 30.0, 6.0, 1200)
    assert totals(site.stored("L-lost")) == (4_000.0, 30.0, 6.0, 1200)


def test_usage_travels_beside_the_lease_rows_in_the_log(tmp_path: Path) -> None:
    record = LeaseRecord(lease_id="L", request_key="hub/a/", user="a", groups=(),
                         state=LeaseState.BOUND, created_at=0.0, request={}, owner="hub")
    fold_usage(record, usage(1.0, 10.0, 2.0, 0.5, 64))
    changes = Changes()
    changes.lease(record)
    sent = changes.to_json()
    [row] = sent["leases"]
    assert "energy_j" not in row and "usage_since" not in row and "owner" not in row
    assert sent[LEASE_USAGE_BESIDE] == {"L": {
        "usage_since": 1.0, "energy_j": 10.0, "sm_s": 2.0, "memory_s": 0.5,
        "peak_memory_mib": 64, "usage_run_energy_j": 10.0, "usage_run_sm_s": 2.0,
        "usage_run_memory_s": 0.5}}
    back = Changes.from_json(sent).leases["L"]
    assert (back["energy_j"], back["peak_memory_mib"], back["owner"]) == (10.0, 64, "hub")
    # A snapshot carries them in a table of their own, and a replica loads them back.
    source = Ledger(tmp_path / "source.sqlite")
    source.open()
    try:
        source.call(lambda: source.commit(changes))
        position, tables = source.call(lambda: source.snapshot_tables(trail=False))
    finally:
        source.close()
    assert "energy_j" not in tables["leases"].columns
    assert tables[LEASE_USAGE_BESIDE].rows == [["L", 1.0, 10.0, 2.0, 0.5, 64, 10.0, 2.0, 0.5]]
    replica = Ledger(tmp_path / "replica.sqlite")
    replica.open()
    try:
        replica.call(lambda: replica.load_snapshot(
            tables, LogPosition("log", 5, "entry-5", 1, "writer")))
        copied = replica.call(lambda: replica.find_lease("L"))
    finally:
        replica.close()
    assert copied is not None and totals(copied) == (10.0, 2.0, 0.5, 64)
    assert position is None
