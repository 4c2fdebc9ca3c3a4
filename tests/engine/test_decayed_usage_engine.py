"""Fair share that remembers, through the real engine and a real ledger file: waiters of equal
priority are served least recent use first, reclaim takes the heaviest recent user's busy
borrowed lease first, and the usage survives a restart (rebuilt, as the service does, from
the ledger's recently ended leases).

Each scenario runs with ``usage_half_life_h`` set and with it 0, and the two must differ:
with 0 the order is today's (first come first served; the newest grant reclaimed first).
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from allocator.admin import ledger_cli
from allocator.config import AllocatorSettings
from allocator.engine import Engine
from allocator.ledger.changes import Changes
from allocator.ledger.store import Ledger
from allocator.service.memory import Memory
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerAction,
    ContainerEvent,
    ContainerInfo,
    GPUInfo,
    Heartbeat,
    LeaseReply,
    LeaseState,
    ProcessUse,
    QueueReply,
    QueueRequest,
    ReleaseRequest,
)
from tests.support.common import ADMIN, HUB, NODE

HOST = "gpu-a"
MODEL = "NVIDIA GeForce GTX 1070"
HOUR = 3600.0


class Site:
    """One host of ``gpus`` GPUs, the engine over a ledger file every step is committed to,
    and a clock the test moves."""

    def __init__(self, tmp_path: Path, gpus: int, **settings: Any) -> None:
        self.settings = AllocatorSettings(
            ledger_path=tmp_path / "ledger.sqlite", allow_any_node_user=True,
            start_fence_s=0, node_down_after_s=3 * HOUR, **settings)
        self.ledger = Ledger(self.settings.ledger_path)
        self.ledger.open()
        self.engine = Engine(self.settings, started_at=0.0)
        self.gpus = gpus
        self.now = 1_000_000.0
        self.seq = 0
        self.changes = Changes()
        self.running: dict[str, ContainerInfo] = {}
        self.pct: dict[str, float] = {}
        self.positions: dict[str, int | None] = {}
        """User -> the queue position its last queued request's reply gave."""
        self.beat()

    def close(self) -> None:
        self.ledger.close()

    def commit(self) -> None:
        changes, self.changes = self.changes, Changes()
        self.ledger.call(lambda: self.ledger.commit(changes))

    def send(self, message: Any, sender: Any = HUB) -> Any:
        reply = self.engine.handle(message, sender, self.now, self.changes)
        self.commit()
        return reply

    def tick(self) -> None:
        self.engine.tick(self.now, self.changes)
        self.commit()

    def beat(self) -> None:
        """A heartbeat listing the running containers, each busy at its set utilization."""
        self.seq += 1
        containers = [info.model_copy(update={"gpu_use": [
            ProcessUse(gpu_uuid=u, memory_used_mib=700, utilization_pct=self.pct[lease_id])
            for u in self.engine.leases[lease_id].gpu_uuids]})
            for lease_id, info in self.running.items() if lease_id in self.engine.leases]
        self.send(Heartbeat(
            host=HOST, agent_id="a1", seq=self.seq, sent_at=self.now, interval_s=2,
            gpus=[GPUInfo(uuid=f"GPU-{i}", index=i, model=MODEL, memory_total_mib=8192)
                  for i in range(self.gpus)],
            containers=containers, source="simulated"), NODE)

    def pass_time(self, seconds: float, step: float = 10.0) -> None:
        end = self.now + seconds
        while self.now < end:
            self.now = min(self.now + step, end)
            self.beat()
            self.tick()

    def hold(self, user: str, pct: float = 80.0) -> str:
        """A bound lease of ``user``, its processes busy at ``pct`` %."""
        reply = self.send(AllocateRequest(request_key=f"hub/{user}/", user=user))
        assert isinstance(reply, LeaseReply) and reply.lease.state is LeaseState.GRANTED, reply
        lease_id = reply.lease.lease_id
        self.send(ContainerEvent(host=HOST, container_id=f"c-{lease_id}", lease_id=lease_id,
                                 action=ContainerAction.START, at=self.now), NODE)
        self.running[lease_id] = ContainerInfo(container_id=f"c-{lease_id}", lease_id=lease_id)
        self.pct[lease_id] = pct
        return lease_id

    def wait(self, user: str) -> str:
        reply = self.send(AllocateRequest(request_key=f"hub/{user}/", user=user, wait_s=HOUR))
        assert isinstance(reply, LeaseReply) and reply.lease.state is LeaseState.QUEUED, reply
        self.positions[user] = reply.lease.queue_position
        return reply.lease.lease_id

    def end(self, lease_id: str) -> None:
        """The hub stops the server; its container dies."""
        self.send(ReleaseRequest(lease_id=lease_id))
        info = self.running.pop(lease_id)
        self.send(ContainerEvent(host=HOST, container_id=info.container_id, lease_id=lease_id,
                                 action=ContainerAction.DIE, at=self.now), NODE)
        assert lease_id in self.engine.recent

    def restart(self) -> None:
        """A new allocator process: a fresh engine rebuilt from the ledger file by the
        service's own reload (which reads the recently ended leases for decayed usage)."""
        self.engine = Engine(self.settings, started_at=self.now)

        async def noop() -> None:
            return None

        memory = Memory(self.ledger, self.engine, lambda: self.now, noop)
        asyncio.run(memory.reload())
        self.beat()

    def queue(self) -> list[str]:
        reply = self.send(QueueRequest(), ADMIN)
        assert isinstance(reply, QueueReply), reply
        return [lease.user for lease in reply.leases]


@pytest.fixture
def site_factory(tmp_path: Path) -> Iterator[Callable[..., Site]]:
    made: list[Site] = []

    def make(gpus: int, **settings: Any) -> Site:
        site = Site(tmp_path / str(len(made)), gpus, **settings)
        made.append(site)
        return site

    yield make
    for site in made:
        site.close()


@pytest.mark.parametrize("restart", [False, True], ids=["running", "after-restart"])
@pytest.mark.parametrize(("half_life_h", "first"), [(24.0, "bob"), (0.0, "alice")],
                         ids=["remembering", "off"])
def test_of_two_waiters_of_equal_priority_the_one_with_less_recent_use_is_granted_first(
        site_factory: Any, tmp_path: Path, restart: bool, half_life_h: float,
        first: str) -> None:
    site = site_factory(1, usage_half_life_h=half_life_h)
    # alice held the only GPU for 6 hours this morning; bob has used nothing.
    morning = site.hold("alice")
    site.pass_time(6 * HOUR, step=600)
    site.end(morning)
    site.pass_time(HOUR, step=600)
    if restart:
        site.restart()
    carol = site.hold("carol")
    site.pass_time(60)
    alice = site.wait("alice")  # alice asks first...
    site.now += 1
    bob = site.wait("bob")  # ...bob a second later, with the same priority
    later = "alice" if first == "bob" else "bob"
    assert site.queue() == [first, later]
    assert site.positions == {"alice": 1, "bob": 1 if first == "bob" else 2}
    site.end(carol)
    granted = {bob: "bob", alice: "alice"}
    held = [name for lease_id, name in granted.items()
            if site.engine.leases[lease_id].state is LeaseState.GRANTED]
    assert held == [first]
    assert site.queue() == [later]
    if restart and half_life_h:
        # What the ledger file says after the restart is what the engine remembered.
        assert site.engine.decayed.usages.users["alice"].value > 5.0


def test_priority_still_goes_before_recent_use(site_factory: Any) -> None:
    site = site_factory(1, usage_half_life_h=24.0)
    morning = site.hold("alice")
    site.pass_time(6 * HOUR, step=600)
    site.end(morning)
    site.hold("carol")
    site.send(AllocateRequest(request_key="hub/alice/", user="alice", wait_s=HOUR,
                              priority=5))
    site.now += 1
    site.wait("bob")
    assert site.queue() == ["alice", "bob"]


@pytest.mark.parametrize(("half_life_h", "victim"), [(24.0, "alice"), (0.0, "bob")],
                         ids=["remembering", "off"])
def test_reclaim_takes_the_heaviest_recent_users_busy_borrowed_lease_first(
        site_factory: Any, half_life_h: float, victim: str) -> None:
    site = site_factory(2, usage_half_life_h=half_life_h,
                        user_quota={"alice": 0, "bob": 0, "carol": 1},
                        user_borrow_limit={"alice": 1, "bob": 1, "carol": 1},
                        reclaim_grace_s=60.0, idle_window_s=30.0)
    # alice held a GPU for 8 hours this morning; then alice and bob each borrow one, both
    # busy: bob's is the newest grant (today's victim), alice the heaviest recent user.
    morning = site.hold("alice")
    site.pass_time(8 * HOUR, step=600)
    site.end(morning)
    site.restart()
    leases = {"alice": site.hold("alice", pct=90.0)}
    site.pass_time(60)
    leases["bob"] = site.hold("bob", pct=90.0)
    site.pass_time(60)
    assert all(site.engine.leases[lease_id].borrowed for lease_id in leases.values())
    site.wait("carol")  # within carol's guarantee: a borrowed lease must go
    site.tick()
    warned = [user for user, lease_id in leases.items()
              if site.engine.leases[lease_id].reclaim_at is not None]
    assert warned == [victim]


def test_gpu_ledger_fairshare_shows_the_usage_the_engine_orders_by(
        site_factory: Any, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    site = site_factory(2, usage_half_life_h=24.0)
    morning = site.hold("alice")
    site.pass_time(6 * HOUR, step=600)
    site.end(morning)
    bob = site.hold("bob")  # still held: counted up to now
    site.pass_time(2 * HOUR, step=600)
    by_user, _ = site.engine.decayed.usage(site.engine.book.charged_holding(), site.now)
    assert by_user["alice"] > by_user["bob"] > 0
    assert ledger_cli.main(["fairshare", "--ledger", str(site.settings.ledger_path),
                            "--half-life", "24", "--at", str(site.now), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [(row["user"], row["held_gpus"]) for row in shown["users"]] == [
        ("bob", 1.0), ("alice", 0.0)]
    for row in shown["users"]:
        assert row["usage_gpu_hours"] == pytest.approx(by_user[row["user"]], rel=1e-6)
    # 6 hours held, 2 to 8 hours ago, with a half-life of 24 h: by hand,
    # 24/ln2 * (2^(-2/24) - 2^(-8/24)) GPU-hours.
    assert by_user["alice"] == pytest.approx(
        24 / math.log(2) * (2 ** (-2 / 24) - 2 ** (-8 / 24)), rel=1e-6)
    assert site.engine.leases[bob].state is LeaseState.BOUND
    assert ledger_cli.main(["fairshare", "--ledger", str(site.settings.ledger_path),
                            "--half-life", "24", "--at", str(site.now)]) == 0
    table = capsys.readouterr().out
    assert "Decayed usage by user" in table and "Decayed usage by group" in table
    assert table.index("bob") < table.index("alice")  # least first
    assert f"{by_user['alice']:.2f}" in table
    assert ledger_cli.main(["fairshare", "--ledger", str(site.settings.ledger_path),
                            "--half-life", "0"]) == 2
    assert "no half-life" in capsys.readouterr().err
    # The allocator's setting from the environment, as the stack's containers have it.
    monkeypatch.setenv("SWARM_GPU_USAGE_HALF_LIFE_H", "24")
    assert ledger_cli.main(["fairshare", "--ledger", str(site.settings.ledger_path),
                            "--at", str(site.now), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == shown
    monkeypatch.setenv("SWARM_GPU_USAGE_HALF_LIFE_H", "a week")
    assert ledger_cli.main(["fairshare", "--ledger", str(site.settings.ledger_path)]) == 2
    assert "'a week' is not a number of hours" in capsys.readouterr().err
