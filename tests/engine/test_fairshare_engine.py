"""Fair share in the engine: borrowed leases, the quota reply's guarantee, the leases listing,
idle measured from the agents' per-container use, and the configuration checks.

Pure engine, no broker: the engine is driven with messages and a clock.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from allocator.config import AllocatorSettings, guarantee_problem
from allocator.engine import Engine
from allocator.ledger.changes import Changes
from allocator.ledger.store import Ledger
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerAction,
    ContainerEvent,
    ContainerInfo,
    ErrorReply,
    GPUInfo,
    GPUProcess,
    Heartbeat,
    LeaseReply,
    LeasesReply,
    LeasesRequest,
    LeaseState,
    ProcessUse,
    QuotaReply,
    QuotaRequest,
    ReleaseRequest,
)
from tests.support.common import HUB, NODE

HOST = "gpu-a"
MODEL = "NVIDIA GeForce GTX 1070"


class FairCluster:
    """One engine over one host of ``gpus`` GPUs, with a clock the test moves."""

    def __init__(self, tmp_path: Path, gpus: int = 3, *, processes_known: bool = False,
                 **settings: Any) -> None:
        self.settings = AllocatorSettings(
            ledger_path=tmp_path / "ledger.sqlite", allow_any_node_user=True,
            start_fence_s=0, **settings)
        self.engine = Engine(self.settings, started_at=0.0)
        self.gpus = gpus
        self.now = 10.0
        self.seq = 0
        self.changes = Changes()
        self.running: dict[str, ContainerInfo] = {}
        self.pct: dict[str, float] = {}
        self.processes_known = processes_known
        """Whether heartbeats list each GPU's processes (one per running container on it)."""
        self.left_behind: dict[str, list[str]] = {}
        """Container id -> the GPUs a process of it is still listed on after its death."""
        self.beat()

    def tick(self) -> None:
        self.engine.tick(self.now, self.changes)

    def send(self, message: Any, sender: Any = HUB) -> Any:
        return self.engine.handle(message, sender, self.now, self.changes)

    def beat(self, use: dict[str, list[ProcessUse]] | None = None) -> None:
        """A heartbeat listing the running containers, with per-lease GPU use."""
        self.seq += 1
        use = use or {}
        containers = [info.model_copy(update={"gpu_use": use.get(lease_id, [])})
                      for lease_id, info in self.running.items()]
        self.send(Heartbeat(
            host=HOST, agent_id="a1", seq=self.seq, sent_at=self.now, interval_s=2,
            gpus=[GPUInfo(uuid=f"GPU-{i}", index=i, model=MODEL, memory_total_mib=8192,
                          processes=self._processes_on(f"GPU-{i}"))
                  for i in range(self.gpus)],
            containers=containers, source="simulated"), NODE)

    def _processes_on(self, gpu_uuid: str) -> list[GPUProcess] | None:
        if not self.processes_known:
            return None
        on_it = [info.container_id for lease_id, info in self.running.items()
                 if lease_id in self.engine.leases
                 and gpu_uuid in self.engine.leases[lease_id].gpu_uuids]
        on_it += [c for c, uuids in self.left_behind.items() if gpu_uuid in uuids]
        return [GPUProcess(pid=100 + n, memory_used_mib=700, name="python", container_id=c)
                for n, c in enumerate(on_it)]

    def grant(self, user: str, server: str = "", **fields: Any) -> LeaseReply:
        reply = self.send(AllocateRequest(request_key=f"hub/{user}/{server}", user=user,
                                          **fields))
        assert isinstance(reply, LeaseReply), reply
        return reply

    def run(self, lease_id: str) -> None:
        """The lease's container starts."""
        container_id = f"c-{lease_id}"
        self.send(ContainerEvent(host=HOST, container_id=container_id, lease_id=lease_id,
                                 action=ContainerAction.START, at=self.now), NODE)
        self.running[lease_id] = ContainerInfo(container_id=container_id, lease_id=lease_id)

    def leases(self, **fields: Any) -> LeasesReply:
        reply = self.send(LeasesRequest(**fields))
        assert isinstance(reply, LeasesReply), reply
        return reply


def busy(lease: LeaseReply, pct: float) -> list[ProcessUse]:
    return [ProcessUse(gpu_uuid=u, memory_used_mib=900, utilization_pct=pct)
            for u in lease.lease.gpu_uuids]


def test_a_grant_beyond_the_guarantee_is_borrowed_up_to_the_borrow_limit(tmp_path: Path):
    cluster = FairCluster(tmp_path, user_quota={"alice": 1}, user_borrow_limit={"alice": 2})
    first = cluster.grant("alice", "a")
    second = cluster.grant("alice", "b")
    assert (first.lease.borrowed, second.lease.borrowed) == (False, True)
    third = cluster.send(AllocateRequest(request_key="hub/alice/c", user="alice"))
    assert third.error.code == "quota_exceeded"


def test_group_guarantees_mark_borrowing_too(tmp_path: Path):
    cluster = FairCluster(tmp_path, group_quota={"lab": 1}, group_borrow_limit={"lab": 3})
    assert not cluster.grant("alice", groups=["lab"]).lease.borrowed
    assert cluster.grant("bob", groups=["lab"]).lease.borrowed
    assert not cluster.grant("carol").lease.borrowed  # not a member: no guarantee applies


def test_without_borrow_limits_nothing_is_borrowed_and_quotas_refuse_as_before(tmp_path: Path):
    cluster = FairCluster(tmp_path, user_quota={"alice": 1})
    assert not cluster.grant("alice", "a").lease.borrowed
    assert cluster.send(AllocateRequest(request_key="hub/alice/b",
                                        user="alice")).error.code == "quota_exceeded"
    assert not cluster.grant("bob").lease.borrowed


def test_quota_reply_gives_guarantee_borrow_limit_and_whether_a_count_would_borrow(
        tmp_path: Path):
    cluster = FairCluster(tmp_path, user_quota={"alice": 1}, user_borrow_limit={"alice": 3})
    ask = cluster.send(QuotaRequest(user="alice", count=1))
    assert isinstance(ask, QuotaReply)
    assert (ask.quotas[0].guaranteed, ask.quotas[0].borrow_limit, ask.would_borrow) == (
        1.0, 3.0, False)
    cluster.grant("alice")
    after = cluster.send(QuotaRequest(user="alice", count=1))
    assert (after.quotas[0].held, after.would_borrow) == (1.0, True)
    assert cluster.send(QuotaRequest(user="alice")).would_borrow is None


def test_leases_lists_one_users_leases_queued_first_then_newest_grant(tmp_path: Path):
    cluster = FairCluster(tmp_path, gpus=2)
    older = cluster.grant("alice", "a").lease.lease_id
    cluster.now += 1
    newer = cluster.grant("alice", "b").lease.lease_id
    cluster.grant("bob", "x", wait_s=60)  # no GPU left: bob's request queues
    queued = cluster.grant("alice", "c", wait_s=60).lease.lease_id
    mine = cluster.leases(user="alice")
    assert [lease.lease_id for lease in mine.leases] == [queued, newer, older]
    everyone = cluster.leases()
    assert {lease.user for lease in everyone.leases} == {"alice", "bob"}


def test_leases_include_recently_finished_ones_on_request(tmp_path: Path):
    cluster = FairCluster(tmp_path)
    lease_id = cluster.grant("alice").lease.lease_id
    cluster.run(lease_id)
    cluster.now += 5
    cluster.send(ContainerEvent(host=HOST, container_id=f"c-{lease_id}", lease_id=lease_id,
                                action=ContainerAction.DIE, at=cluster.now), NODE)
    assert cluster.leases(user="alice").leases == []
    recent = cluster.leases(user="alice", include_finished_s=60).leases
    assert [(lease.lease_id, lease.state) for lease in recent] == [
        (lease_id, LeaseState.RELEASED)]
    cluster.now += 120
    assert cluster.leases(user="alice", include_finished_s=60).leases == []


def test_idle_is_measured_from_the_leases_own_processes(tmp_path: Path):
    cluster = FairCluster(tmp_path, idle_utilization_pct=5.0)
    lease = cluster.grant("alice")
    cluster.run(lease.lease.lease_id)
    cluster.beat({lease.lease.lease_id: busy(lease, 80.0)})
    view = cluster.leases(user="alice").leases[0]
    assert (view.idle_since, view.utilization_pct, view.gpu_memory_used_mib) == (None, 80.0, 900)
    cluster.now += 2
    idle_at = cluster.now
    cluster.beat({lease.lease.lease_id: busy(lease, 1.0)})
    cluster.now += 30
    cluster.beat({lease.lease.lease_id: busy(lease, 0.0)})
    assert cluster.leases(user="alice").leases[0].idle_since == idle_at
    cluster.now += 2
    cluster.beat({lease.lease.lease_id: busy(lease, 50.0)})
    record = cluster.engine.leases[lease.lease.lease_id]
    assert record.idle_since is None
    assert record.idle_gpu_s == pytest.approx(32.0)  # one GPU idle from idle_at to the busy beat


def test_a_container_with_no_gpu_process_is_idle_and_unknown_utilization_is_not(
        tmp_path: Path):
    cluster = FairCluster(tmp_path)
    lease = cluster.grant("alice")
    cluster.run(lease.lease.lease_id)
    unknown = [ProcessUse(gpu_uuid=lease.lease.gpu_uuids[0], memory_used_mib=10)]
    cluster.beat({lease.lease.lease_id: unknown})
    assert cluster.engine.leases[lease.lease.lease_id].idle_since is None
    cluster.beat({})
    assert cluster.engine.leases[lease.lease.lease_id].idle_since == cluster.now


def test_memory_threshold_when_configured(tmp_path: Path):
    cluster = FairCluster(tmp_path, idle_memory_mib=500)
    lease = cluster.grant("alice")
    cluster.run(lease.lease.lease_id)
    cluster.beat({lease.lease.lease_id: busy(lease, 0.0)})  # 900 MiB held: not idle
    assert cluster.engine.leases[lease.lease.lease_id].idle_since is None


def test_usage_history_is_per_minute(tmp_path: Path):
    cluster = FairCluster(tmp_path)
    lease = cluster.grant("alice")
    cluster.run(lease.lease.lease_id)
    cluster.now = 600.0
    for pct in (10.0, 30.0):
        cluster.beat({lease.lease.lease_id: busy(lease, pct)})
        cluster.now += 10
    cluster.now = 660.0
    cluster.beat({lease.lease.lease_id: busy(lease, 0.0)})
    usage = cluster.leases(user="alice", include_usage=True).leases[0].usage
    assert usage is not None
    assert [(u.at, u.utilization_pct, u.memory_used_mib) for u in usage] == [
        (600.0, 20.0, 900), (660.0, 0.0, 900)]
    assert cluster.leases(user="alice").leases[0].usage is None


@pytest.mark.parametrize(("settings", "fragment"), [
    ({"user_quota": {"alice": 2}, "user_borrow_limit": {"alice": 1}},
     "user_borrow_limit['alice'] = 1 is below its guarantee user_quota['alice'] = 2"),
    ({"group_quota": {"lab": 4}, "group_borrow_limit": {"lab": 3}},
     "group_borrow_limit['lab'] = 3 is below"),
    ({"user_borrow_limit": {"bob": 2}}, "has no guarantee to borrow above"),
    ({"default_user_quota": 2, "default_user_borrow_limit": 1},
     "default_user_borrow_limit = 1 is below default_user_quota = 2"),
])
def test_a_borrow_limit_below_its_guarantee_is_refused(settings: dict[str, Any], fragment: str):
    with pytest.raises(ValidationError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        AllocatorSettings(**settings)


def test_strict_guarantees_must_fit_the_cluster():
    settings = AllocatorSettings(user_quota={"alice": 2, "bob": 2}, group_quota={"lab": 3})
    assert guarantee_problem(settings, 4) is None
    problem = guarantee_problem(settings, 3)
    assert problem is not None and "user guarantees (user_quota) add up to 4 GPUs" in problem
    assert "group" in (guarantee_problem(settings.model_copy(update={"user_quota": {}}), 2) or "")


def test_strict_per_model_guarantees_must_fit_that_models_gpus():
    ledger_gpus = {MODEL: 2, "NVIDIA A100-SXM4-40GB": 4}
    fits = AllocatorSettings(user_model_quota={"alice": {"gtx 1070": 1}, "bob": {MODEL: 1},
                                               "carol": {"a100-sxm4-40gb": 4}})
    assert guarantee_problem(fits, 6, ledger_gpus) is None
    # Three spellings of one model: together 3 of its 2 GPUs, however many A100s there are.
    over = fits.model_copy(update={"user_model_quota": {
        **fits.user_model_quota, "dave": {"GTX-1070": 1}}})
    assert guarantee_problem(over, 6, ledger_gpus) == (
        f"the user guarantees of model {MODEL} (user_model_quota) add up to 3 GPUs, more than the "
        "cluster has of that model: 2 (strict_guarantees is set)")
    assert guarantee_problem(over.model_copy(update={"cluster_model_gpus": {"gtx1070": 3}}),
                             6, ledger_gpus) is None
    groups = AllocatorSettings(group_model_quota={"lab": {"1070": 2}, "ml": {"gtx 1070": 1}},
                               aliases={"1070": MODEL})
    problem = guarantee_problem(groups, 6, ledger_gpus)
    assert problem is not None and f"group guarantees of model {MODEL}" in problem
    assert "add up to 3 GPUs" in problem and "of that model: 2 " in problem
    # A model the cluster has none of cannot be guaranteed.
    unknown = AllocatorSettings(user_model_quota={"alice": {"H100": 1}})
    assert "model H100 (user_model_quota) add up to 1 GPUs" in (
        guarantee_problem(unknown, 6, ledger_gpus) or "")


@pytest.mark.parametrize(("toml", "line"), [
    ('[user_quota]\nalice = 2\n[user_borrow_limit]\nalice = 1\n',
     "gpu-allocator: invalid settings: user_borrow_limit['alice'] = 1 is below its guarantee "
     "user_quota['alice'] = 2"),
    ('strict_guarantees = true\ncluster_gpus = 2\n[user_quota]\nalice = 2\nbob = 1\n',
     "gpu-allocator: the user guarantees (user_quota) add up to 3 GPUs, more than the "
     "cluster's 2 (strict_guarantees is set)"),
    ('strict_guarantees = true\ncluster_gpus = 4\n[cluster_model_gpus]\n"GTX-1070" = 1\n'
     '[user_model_quota.alice]\n"gtx 1070" = 1\n[user_model_quota.bob]\n'
     '"NVIDIA GeForce GTX 1070" = 1\n',
     "gpu-allocator: the user guarantees of model gtx 1070 (user_model_quota) add up to 2 GPUs, "
     "more than the cluster has of that model: 1 (strict_guarantees is set)"),
])
def test_the_allocator_stops_at_start_with_one_clear_line(tmp_path: Path, toml: str, line: str):
    assert serve_error_lines(tmp_path, toml) == [line]


def serve_error_lines(tmp_path: Path, toml: str) -> list[str]:
    """``gpu-allocator serve`` over tmp_path's ledger with ``toml``: it must exit 1, with these
    lines on stderr."""
    config = tmp_path / "allocator.toml"
    config.write_text(f'ledger_path = "{tmp_path / "ledger.sqlite"}"\n{toml}')
    done = subprocess.run([sys.executable, "-m", "allocator.admin.cli", "serve", "--config",
                           str(config)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SWARM_GPU_AMQP_URL": "amqp://127.0.0.1:1/"})
    assert done.returncode == 1
    return done.stderr.strip().splitlines()


def test_strict_per_model_guarantees_are_checked_against_the_ledgers_gpus(tmp_path: Path):
    cluster = FairCluster(tmp_path, gpus=2)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open()
    try:
        ledger.call(lambda: ledger.commit(cluster.changes))
    finally:
        ledger.close()
    toml = 'strict_guarantees = true\n[user_model_quota.alice]\n"gtx 1070" = 3\n'
    assert serve_error_lines(tmp_path, toml) == [
        f"gpu-allocator: the user guarantees of model {MODEL} (user_model_quota) add up to 3 "
        "GPUs, more than the cluster has of that model: 2 (strict_guarantees is set)"]


# --------------------------------------------------------------------------- reclaim

RECLAIMING = {"user_quota": {"alice": 1, "bob": 1, "carol": 1},
              "user_borrow_limit": {"alice": 2, "bob": 2, "carol": 2},
              "reclaim_grace_s": 60.0, "idle_window_s": 30.0}


def reclaim_cluster(tmp_path: Path, **settings: Any) -> FairCluster:
    return FairCluster(tmp_path, gpus=2, **{**RECLAIMING, **settings})


def hold(cluster: FairCluster, user: str, server: str, pct: float) -> str:
    """A bound lease of ``user`` whose processes run at ``pct`` % from now on."""
    lease = cluster.grant(user, server)
    cluster.run(lease.lease.lease_id)
    cluster.pct[lease.lease.lease_id] = pct
    return lease.lease.lease_id


def heartbeats(cluster: FairCluster, seconds: float, step: float = 5.0) -> None:
    """Heartbeats (with each lease's set utilization) and ticks over ``seconds``."""
    end = cluster.now + seconds
    while cluster.now < end:
        cluster.now = min(cluster.now + step, end)
        cluster.beat({lease_id: [ProcessUse(gpu_uuid=u, memory_used_mib=700,
                                            utilization_pct=cluster.pct[lease_id])
                                 for u in cluster.engine.leases[lease_id].gpu_uuids]
                      for lease_id in cluster.running if lease_id in cluster.engine.leases})
        cluster.tick()


def died(cluster: FairCluster, lease_id: str) -> None:
    info = cluster.running.pop(lease_id)
    cluster.send(ContainerEvent(host=HOST, container_id=info.container_id, lease_id=lease_id,
                                action=ContainerAction.DIE, at=cluster.now), NODE)


def test_a_guaranteed_waiter_gets_an_idle_borrowed_gpu_after_a_warning(tmp_path: Path):
    cluster = reclaim_cluster(tmp_path)
    hold(cluster, "alice", "own", 90.0)
    borrowed = hold(cluster, "alice", "extra", 0.0)
    assert cluster.engine.leases[borrowed].borrowed
    heartbeats(cluster, 40)  # the borrowed lease is idle for the window
    waiter = cluster.grant("bob", wait_s=3600).lease.lease_id
    cluster.tick()
    warned = cluster.engine.leases[borrowed]
    assert (warned.reclaim_reason, warned.reclaim_at) == ("reclaimed", cluster.now + 60.0)
    assert warned.reclaim_for == waiter
    assert cluster.engine.take_commands() == []
    heartbeats(cluster, 55)
    assert cluster.engine.take_commands() == []  # still within the grace
    heartbeats(cluster, 10)
    stops = cluster.engine.take_commands()
    assert [(s.lease_id, s.reason) for s in stops] == [(borrowed, "reclaimed")]
    died(cluster, borrowed)
    ended = cluster.engine.recent[borrowed]
    assert (ended.state, ended.release_reason) == (LeaseState.RELEASED, "reclaimed")
    assert cluster.engine.leases[waiter].state is LeaseState.GRANTED
    assert not cluster.engine.leases[waiter].borrowed


def test_an_idle_borrower_goes_before_a_busy_one(tmp_path: Path):
    cluster = reclaim_cluster(tmp_path, user_quota={"alice": 0, "bob": 0, "carol": 1},
                              user_borrow_limit={"alice": 1, "bob": 1, "carol": 1})
    idle_lease = hold(cluster, "bob", "", 0.0)
    cluster.now += 1
    busy_lease = hold(cluster, "alice", "", 70.0)  # the newest grant, yet the idle one goes
    heartbeats(cluster, 40)
    cluster.grant("carol", wait_s=3600)
    cluster.tick()
    assert cluster.engine.leases[idle_lease].reclaim_at is not None
    assert cluster.engine.leases[busy_lease].reclaim_at is None


def test_without_an_idle_borrower_the_newest_borrowed_grant_goes(tmp_path: Path):
    cluster = reclaim_cluster(tmp_path, user_quota={"alice": 0, "bob": 0, "carol": 1},
                              user_borrow_limit={"alice": 1, "bob": 1, "carol": 1})
    older = hold(cluster, "alice", "", 70.0)
    cluster.now += 1
    newer = hold(cluster, "bob", "", 70.0)
    heartbeats(cluster, 40)
    cluster.grant("carol", wait_s=3600)
    cluster.tick()
    assert cluster.engine.leases[newer].reclaim_at is not None
    assert cluster.engine.leases[older].reclaim_at is None


def test_nobody_is_reclaimed_when_nobody_waits(tmp_path: Path):
    cluster = reclaim_cluster(tmp_path)
    hold(cluster, "alice", "own", 0.0)
    borrowed = hold(cluster, "alice", "extra", 0.0)
    heartbeats(cluster, 600)
    assert cluster.engine.leases[borrowed].reclaim_at is None
    assert cluster.engine.take_commands() == []
    assert not [e for e in cluster.changes.events if e["kind"] == "reclaim_warning"]


def test_a_borrowing_waiter_reclaims_nothing(tmp_path: Path):
    cluster = reclaim_cluster(tmp_path)
    hold(cluster, "alice", "own", 0.0)
    borrowed = hold(cluster, "alice", "extra", 0.0)
    hold_bob = cluster.grant("bob", "own", wait_s=3600).lease.lease_id  # bob: within
    cluster.tick()
    assert cluster.engine.leases[borrowed].reclaim_at is not None
    cluster.send(AllocateRequest(request_key="hub/carol/", user="carol", wait_s=3600))
    # carol is within her guarantee too, but the only borrowed GPU is already promised to bob
    heartbeats(cluster, 30)
    assert [r.lease_id for r in cluster.engine.leases.values() if r.reclaim_at] == [borrowed]
    assert cluster.engine.leases[borrowed].reclaim_for == hold_bob


def test_a_warning_is_withdrawn_when_the_waiter_leaves_and_kept_when_busy_again(
        tmp_path: Path):
    cluster = reclaim_cluster(tmp_path)
    hold(cluster, "alice", "own", 0.0)
    borrowed = hold(cluster, "alice", "extra", 0.0)
    heartbeats(cluster, 40)
    waiter = cluster.grant("bob", wait_s=3600).lease.lease_id
    cluster.tick()
    deadline = cluster.engine.leases[borrowed].reclaim_at
    assert deadline is not None
    cluster.pct[borrowed] = 95.0  # the warned notebook works again: still needed, still goes
    heartbeats(cluster, 30)
    assert cluster.engine.leases[borrowed].reclaim_at == deadline
    cluster.send(ReleaseRequest(lease_id=waiter))  # bob gives up waiting
    cluster.tick()
    record = cluster.engine.leases[borrowed]
    assert (record.reclaim_at, record.reclaim_reason) == (None, None)
    assert [e["kind"] for e in cluster.changes.events if e["kind"].startswith("reclaim")] == [
        "reclaim_warning", "reclaim_withdrawn"]
    heartbeats(cluster, 120)
    assert cluster.engine.take_commands() == []


def test_a_lease_moves_within_the_guarantee_when_an_older_one_ends(tmp_path: Path):
    cluster = reclaim_cluster(tmp_path)
    own = hold(cluster, "alice", "own", 50.0)
    extra = hold(cluster, "alice", "extra", 0.0)
    assert cluster.engine.leases[extra].borrowed
    died(cluster, own)
    cluster.tick()
    assert not cluster.engine.leases[extra].borrowed
    cluster.grant("bob", wait_s=3600)
    heartbeats(cluster, 120)
    assert cluster.engine.leases[extra].reclaim_at is None


def test_idle_release_is_off_by_default_and_releases_an_idle_guaranteed_lease_when_on(
        tmp_path: Path):
    off = reclaim_cluster(tmp_path / "off", user_borrow_limit={})
    idle = hold(off, "alice", "", 0.0)
    hold(off, "carol", "", 0.0)
    heartbeats(off, 400)
    off.grant("bob", wait_s=3600)
    heartbeats(off, 60)
    assert off.engine.leases[idle].reclaim_at is None
    on = reclaim_cluster(tmp_path / "on", user_borrow_limit={}, idle_release_after_s=300.0)
    busy_lease = hold(on, "carol", "", 80.0)
    idle = hold(on, "alice", "", 0.0)
    on.grant("bob", wait_s=3600)
    heartbeats(on, 250)
    assert on.engine.leases[idle].reclaim_at is None  # idle, but not yet for 300 s
    heartbeats(on, 60)
    record = on.engine.leases[idle]
    assert record.reclaim_reason == "idle" and on.engine.leases[busy_lease].reclaim_at is None
    heartbeats(on, 60)
    assert [(s.lease_id, s.reason) for s in on.engine.take_commands()] == [(idle, "idle")]
    died(on, idle)
    assert on.engine.recent[idle].release_reason == "idle"


def test_a_restart_during_the_grace_keeps_the_deadline(tmp_path: Path):
    cluster = reclaim_cluster(tmp_path)
    hold(cluster, "alice", "own", 0.0)
    borrowed = hold(cluster, "alice", "extra", 0.0)
    heartbeats(cluster, 40)
    cluster.grant("bob", wait_s=3600)
    cluster.tick()
    deadline = cluster.engine.leases[borrowed].reclaim_at
    assert deadline is not None
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open()
    try:
        ledger.call(lambda: ledger.commit(cluster.changes))
        cluster.now += 20
        restarted = Engine(cluster.settings, started_at=cluster.now)
        restarted.load(ledger.call(ledger.load), cluster.now, fenced=False)
    finally:
        ledger.close()
    cluster.engine = restarted
    cluster.changes = Changes()
    heartbeats(cluster, 30)
    assert cluster.engine.leases[borrowed].reclaim_at == deadline
    assert cluster.engine.take_commands() == []
    heartbeats(cluster, deadline - cluster.now + 1)
    assert [s.lease_id for s in cluster.engine.take_commands()] == [borrowed]


def test_a_queued_request_is_planned_for_at_once_and_without_grace_stopped_at_once(
        tmp_path: Path):
    cluster = reclaim_cluster(tmp_path, reclaim_grace_s=0.0)
    hold(cluster, "alice", "own", 50.0)
    borrowed = hold(cluster, "alice", "extra", 50.0)
    cluster.engine.take_commands()
    cluster.grant("bob", wait_s=3600)  # no tick in between
    assert [(s.lease_id, s.reason) for s in cluster.engine.take_commands()] == [
        (borrowed, "reclaimed")]
    assert cluster.engine.leases[borrowed].state is LeaseState.RELEASING


def test_per_model_guarantees_borrow_and_reclaim_within_their_model(tmp_path: Path):
    settings = AllocatorSettings(
        ledger_path=tmp_path / "ledger.sqlite", allow_any_node_user=True, start_fence_s=0,
        reclaim_grace_s=0.0, aliases={"big": "NVIDIA A100-SXM4-40GB"},
        user_model_quota={"alice": {"big": 1}, "bob": {"big": 1}},
        user_model_borrow_limit={"alice": {"big": 2}})
    engine = Engine(settings, started_at=0.0)
    changes = Changes()
    gpus = [GPUInfo(uuid=f"GPU-{i}", index=i, model=model, memory_total_mib=8192)
            for i, model in enumerate(("NVIDIA A100-SXM4-40GB",) * 3 + (MODEL,))]
    engine.handle(Heartbeat(host=HOST, agent_id="a", seq=1, sent_at=10.0, interval_s=2,
                            gpus=gpus, source="simulated"), NODE, 10.0, changes)

    def ask(user: str, key: str, model: str, wait_s: float = 0.0) -> LeaseReply:
        reply = engine.handle(AllocateRequest(request_key=key, user=user, model=model,
                                              wait_s=wait_s), HUB, 11.0, changes)
        assert isinstance(reply, LeaseReply), reply
        return reply

    first = ask("alice", "a1", "big")
    second = ask("alice", "a2", "big")
    other_model = ask("alice", "a3", MODEL)  # no quota on the 1070: neither limited nor borrowed
    assert (first.lease.borrowed, second.lease.borrowed, other_model.lease.borrowed) == (
        False, True, False)
    refused = engine.handle(AllocateRequest(request_key="a4", user="alice", model="big"), HUB,
                            11.0, changes)
    assert isinstance(refused, ErrorReply)
    assert refused.error.code == "quota_exceeded" and "of NVIDIA A100" in refused.error.message
    ask("carol", "c1", "big")  # the last A100: carol has no quota at all
    quota = engine.handle(QuotaRequest(user="bob", count=1, model="big"), HUB, 11.0, changes)
    assert isinstance(quota, QuotaReply) and quota.would_borrow is False
    assert [(q.model, q.guaranteed) for q in quota.quotas if q.model] == [
        ("NVIDIA A100-SXM4-40GB", 1.0)]
    ask("bob", "b1", "big", wait_s=60)  # within his A100 guarantee: alice's borrowed one goes
    assert engine.take_commands() == []  # granted, never bound: nothing to stop, ended at once
    assert second.lease.lease_id not in engine.leases
    assert engine.recent[second.lease.lease_id].release_reason == "reclaimed"
    assert engine.leases[first.lease.lease_id].state is LeaseState.GRANTED
    bobs = engine.find(None, "b1")
    assert bobs is not None and bobs.state is LeaseState.GRANTED


def test_an_any_model_request_goes_to_a_model_its_per_model_quota_allows(tmp_path: Path):
    """Best fit would put alice's any-model request on the last free A100 (the model with the
    fewest free GPUs), which her A100 quota refuses; the 1070s are free and hers to take."""
    settings = AllocatorSettings(
        ledger_path=tmp_path / "ledger.sqlite", allow_any_node_user=True, start_fence_s=0,
        aliases={"big": "NVIDIA A100-SXM4-40GB"}, user_model_quota={"alice": {"big": 1}})
    engine = Engine(settings, started_at=0.0)
    changes = Changes()
    gpus = [GPUInfo(uuid=f"GPU-{i}", index=i, model=model, memory_total_mib=8192)
            for i, model in enumerate(("NVIDIA A100-SXM4-40GB",) * 2 + (MODEL,) * 2)]
    engine.handle(Heartbeat(host=HOST, agent_id="a", seq=1, sent_at=10.0, interval_s=2,
                            gpus=gpus, source="simulated"), NODE, 10.0, changes)
    held = engine.handle(AllocateRequest(request_key="a1", user="alice", model="big"), HUB,
                         11.0, changes)
    assert isinstance(held, LeaseReply) and held.lease.model == "NVIDIA A100-SXM4-40GB"
    anyone = engine.handle(AllocateRequest(request_key="a2", user="alice"), HUB, 11.0, changes)
    assert isinstance(anyone, LeaseReply), anyone
    assert anyone.lease.model == MODEL
    # Only A100s asked for: refused by the same quota, as before.
    refused = engine.handle(AllocateRequest(request_key="a3", user="alice", model="big"), HUB,
                            11.0, changes)
    assert isinstance(refused, ErrorReply) and refused.error.code == "quota_exceeded"
    # Nothing she may take is free: the A100 quota's refusal, not "no capacity".
    engine.handle(AllocateRequest(request_key="a4", user="alice"), HUB, 11.0, changes)
    last = engine.handle(AllocateRequest(request_key="a5", user="alice"), HUB, 11.0, changes)
    assert isinstance(last, ErrorReply) and last.error.code == "quota_exceeded"
    assert "of NVIDIA A100" in last.error.message


@pytest.mark.parametrize(("settings", "fragment"), [
    ({"user_model_quota": {"alice": {"a100": 2}},
      "user_model_borrow_limit": {"alice": {"a100": 1}}},
     "user_model_borrow_limit['alice']['a100'] = 1 is below its guarantee"),
    ({"group_model_borrow_limit": {"lab": {"a100": 1}}}, "has no guarantee to borrow above"),
])
def test_a_per_model_borrow_limit_below_its_guarantee_is_refused(settings: dict[str, Any],
                                                                  fragment: str):
    with pytest.raises(ValidationError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        AllocatorSettings(**settings)


def idle_borrower_stopped(tmp_path: Path, **fields: Any) -> tuple[FairCluster, str, str, str]:
    """An idle and a busy borrower, and carol's queued request that the idle one's reclaim is
    for, past the grace: the idle lease's stop has just gone out. The cluster and the idle,
    busy and waiting lease ids."""
    cluster = reclaim_cluster(tmp_path, user_quota={"alice": 0, "bob": 0, "carol": 1},
                              user_borrow_limit={"alice": 1, "bob": 1, "carol": 1}, **fields)
    idle_lease = hold(cluster, "bob", "", 0.0)
    cluster.now += 1
    busy_lease = hold(cluster, "alice", "", 70.0)
    heartbeats(cluster, 40)
    waiter = cluster.grant("carol", wait_s=3600).lease.lease_id
    heartbeats(cluster, 65)
    assert [s.lease_id for s in cluster.engine.take_commands()] == [idle_lease]
    return cluster, idle_lease, busy_lease, waiter


def test_nobody_else_is_warned_while_a_reclaimed_container_stops(tmp_path: Path):
    """Between the reclaim's stop command and the container's death the waiter still does not
    fit, but the stopping lease's GPU is already its: a busy borrower gets no warning."""
    cluster, idle_lease, busy_lease, waiter = idle_borrower_stopped(tmp_path)
    assert cluster.engine.leases[idle_lease].state is LeaseState.RELEASING
    heartbeats(cluster, 30)  # the container takes its time to stop
    assert cluster.engine.leases[busy_lease].reclaim_at is None
    assert not [e for e in cluster.changes.events
                if e["kind"] == "reclaim_warning" and e.get("lease_id") == busy_lease]
    died(cluster, idle_lease)
    assert cluster.engine.leases[waiter].state is LeaseState.GRANTED
    assert cluster.engine.leases[busy_lease].state is LeaseState.BOUND


def test_nobody_else_is_warned_while_a_reclaimed_gpu_drains(tmp_path: Path):
    """After the reclaimed container's death its GPU drains until a report no longer lists
    the container's processes. The waiter still does not fit then, yet the GPU is already
    its: the busy borrower gets no warning, and the waiter gets the GPU once it is clean."""
    cluster, idle_lease, busy_lease, waiter = idle_borrower_stopped(tmp_path,
                                                                    processes_known=True)
    reclaimed_gpus = list(cluster.engine.leases[idle_lease].gpu_uuids)
    container_id = cluster.running[idle_lease].container_id
    died(cluster, idle_lease)
    cluster.left_behind[container_id] = reclaimed_gpus  # its process is listed a while yet
    heartbeats(cluster, 6, step=2)  # three reports, within release_verify_s
    assert cluster.engine.leases[waiter].state is LeaseState.QUEUED  # the GPU still drains
    assert cluster.engine.leases[busy_lease].reclaim_at is None
    assert not [e for e in cluster.changes.events
                if e["kind"] == "reclaim_warning" and e.get("lease_id") == busy_lease]
    del cluster.left_behind[container_id]
    heartbeats(cluster, 2, step=2)
    assert cluster.engine.leases[waiter].state is LeaseState.GRANTED
    assert list(cluster.engine.leases[waiter].gpu_uuids) == reclaimed_gpus
    assert cluster.engine.leases[busy_lease].state is LeaseState.BOUND
    assert cluster.engine.leases[busy_lease].reclaim_at is None


def test_a_per_model_guarantee_applies_however_the_admin_spelled_the_model(tmp_path: Path):
    """Per-model keys are matched as a user's request is (allocator.wire.model_names): "gtx 1070"
    is the reported "NVIDIA GeForce GTX 1070"."""
    cluster = FairCluster(tmp_path, gpus=3, user_model_quota={"alice": {"gtx 1070": 1}},
                          user_model_borrow_limit={"alice": {"gtx 1070": 2}})
    first, second = cluster.grant("alice", "a"), cluster.grant("alice", "b")
    assert (first.lease.borrowed, second.lease.borrowed) == (False, True)
    third = cluster.send(AllocateRequest(request_key="hub/alice/c", user="alice"))
    assert isinstance(third, ErrorReply) and third.error.code == "quota_exceeded"
