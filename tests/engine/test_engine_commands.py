"""The engine's outbox of stop commands: who is asked to stop what, and when nobody is.

Pure engine, no broker: each test drives the engine with messages and looks at what
:meth:`Engine.take_commands` hands the service after the batch.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from allocator.config import AllocatorSettings
from allocator.engine import Engine, Sender
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
    ReleaseRequest,
    StopContainer,
    StopReason,
)
from tests.support.common import ADMIN, HUB, NODE

HOST = "gpu-a"


class Cluster:
    """One engine with one host of two GPUs, a clock and a heartbeat sequence."""

    def __init__(self, tmp_path: Path, **settings: object) -> None:
        self.settings = AllocatorSettings(
            ledger_path=tmp_path / "ledger.sqlite", allow_any_node_user=True,
            admin_users=["admin"], bind_timeout_s=5.0, container_gone_grace_s=1.0,
            container_stop_grace_s=7.0, container_stop_retry_s=30.0,
            **settings)  # type: ignore[arg-type]
        self.engine = Engine(self.settings, started_at=0.0)
        self.now = 1.0
        self.seq = 0
        self.changes = Changes()
        self.beat([])
        assert self.engine.take_commands() == []

    def apply(self, message: object, sender: Sender) -> object:
        self.now += 0.1
        return self.engine.handle(message, sender, self.now, self.changes)  # type: ignore[arg-type]

    def beat(self, containers: list[ContainerInfo]) -> None:
        self.seq += 1
        self.apply(Heartbeat(
            host=HOST, agent_id="a1", seq=self.seq, sent_at=self.now, interval_s=2,
            gpus=[GPUInfo(uuid=f"GPU-{i}", index=i, model="NVIDIA GeForce GTX 1070",
                          memory_total_mib=8192) for i in range(2)],
            containers=containers, containers_complete=True, source="simulated"), NODE)

    def allocate(self, user: str, **fields: object) -> str:
        reply = self.apply(AllocateRequest(request_key=f"hub/{user}/", user=user, **fields), HUB)
        assert isinstance(reply, LeaseReply), reply
        return reply.lease.lease_id

    def event(self, lease_id: str, container_id: str, action: ContainerAction) -> None:
        self.apply(ContainerEvent(host=HOST, container_id=container_id, lease_id=lease_id,
                                  action=action, at=self.now), NODE)

    def bound(self, user: str) -> tuple[str, str]:
        lease_id = self.allocate(user)
        container_id = f"c-{user}"
        self.event(lease_id, container_id, ContainerAction.START)
        assert self.engine.leases[lease_id].state is LeaseState.BOUND
        return lease_id, container_id

    def release(self, lease_id: str, *, force: bool = False) -> LeaseReply:
        reply = self.apply(ReleaseRequest(lease_id=lease_id, force=force, by="t"),
                           ADMIN if force else HUB)
        assert isinstance(reply, LeaseReply), reply
        return reply


@pytest.fixture
def cluster(tmp_path: Path) -> Cluster:
    return Cluster(tmp_path)


def test_the_hubs_release_of_a_bound_lease_asks_its_node_to_stop_the_container(cluster):
    lease_id, container_id = cluster.bound("alice")
    assert cluster.engine.take_commands() == []
    assert cluster.release(lease_id).lease.state is LeaseState.RELEASING
    assert cluster.engine.take_commands() == [StopContainer(
        host=HOST, lease_id=lease_id, container_id=container_id, grace_s=7.0,
        reason=StopReason.RELEASED)]
    assert cluster.engine.take_commands() == [], "taken once"
    # Releasing twice is a no-op: no second command.
    cluster.release(lease_id)
    assert cluster.engine.take_commands() == []
    # The die event that follows frees the GPU and asks nothing more.
    cluster.event(lease_id, container_id, ContainerAction.DIE)
    assert cluster.engine.recent[lease_id].release_reason is ReleaseReason.CONTAINER_EXITED
    assert cluster.engine.take_commands() == []
    assert any(e["kind"] == "stop_container" and e["lease_id"] == lease_id
               for e in cluster.changes.events), "the decision is in the event log"


def test_force_release_of_a_lease_with_a_container_stops_it(cluster):
    lease_id, container_id = cluster.bound("bob")
    reply = cluster.release(lease_id, force=True)
    assert reply.lease.state is LeaseState.RELEASED
    assert reply.lease.release_reason is ReleaseReason.ADMIN
    [command] = cluster.engine.take_commands()
    assert (command.host, command.lease_id, command.container_id, command.reason) == (
        HOST, lease_id, container_id, StopReason.FORCE_RELEASED)


def test_force_release_after_the_hubs_release_asks_again(cluster):
    lease_id, _ = cluster.bound("bob")
    cluster.release(lease_id)
    cluster.engine.take_commands()
    cluster.release(lease_id, force=True)
    assert [c.reason for c in cluster.engine.take_commands()] == [StopReason.FORCE_RELEASED]


def test_a_zombie_start_is_stopped(cluster):
    """A granted lease reclaimed at its bind deadline, then its container starts after all."""
    lease_id = cluster.allocate("carol")
    cluster.now += 10
    cluster.engine.tick(cluster.now, cluster.changes)
    assert cluster.engine.recent[lease_id].release_reason is ReleaseReason.BIND_TIMEOUT
    assert cluster.engine.take_commands() == [], "no container known: nothing to stop"
    cluster.event(lease_id, "c-late", ContainerAction.START)
    [command] = cluster.engine.take_commands()
    assert (command.lease_id, command.container_id, command.reason) == (
        lease_id, "c-late", StopReason.LEASE_FINISHED)
    assert cluster.engine.counters["zombie_container"] == 1


def test_a_zombie_listed_by_heartbeats_is_asked_once_then_again_after_the_retry(cluster):
    lease_id, container_id = cluster.bound("dave")
    cluster.release(lease_id, force=True)
    assert len(cluster.engine.take_commands()) == 1
    listed = [ContainerInfo(container_id=container_id, lease_id=lease_id)]
    cluster.beat(listed)
    cluster.beat(listed)
    assert cluster.engine.take_commands() == [], "asked a moment ago"
    cluster.now += 7.0 + 30.0  # grace + retry
    cluster.beat(listed)
    [again] = cluster.engine.take_commands()
    assert (again.container_id, again.reason) == (container_id, StopReason.LEASE_FINISHED)
    cluster.beat(listed)
    assert cluster.engine.take_commands() == []


def test_a_zombie_heartbeat_listing_is_stopped_at_once(cluster):
    lease_id = cluster.allocate("erin")
    cluster.now += 10
    cluster.engine.tick(cluster.now, cluster.changes)
    cluster.beat([ContainerInfo(container_id="c-erin", lease_id=lease_id)])
    assert [c.reason for c in cluster.engine.take_commands()] == [StopReason.LEASE_FINISHED]


def test_a_container_that_starts_after_the_hub_released_is_stopped(cluster):
    """The hub stopped the server while the lease was granted, then its container started."""
    lease_id = cluster.allocate("fay")
    assert cluster.release(lease_id).lease.state is LeaseState.RELEASING
    assert cluster.engine.take_commands() == [], "granted, never bound: nothing to stop yet"
    cluster.event(lease_id, "c-fay", ContainerAction.START)
    [command] = cluster.engine.take_commands()
    assert (command.container_id, command.reason) == ("c-fay", StopReason.RELEASED)
    # The next heartbeat listing it does not ask again.
    cluster.beat([ContainerInfo(container_id="c-fay", lease_id=lease_id)])
    assert cluster.engine.take_commands() == []


def test_no_command_for_a_granted_release_a_queued_cancel_or_a_death(cluster):
    granted = cluster.allocate("gus")
    cluster.release(granted)
    assert cluster.engine.leases[granted].state is LeaseState.RELEASING
    taken, _ = cluster.bound("hal")
    queued = cluster.allocate("ivy", wait_s=60)
    assert cluster.engine.leases[queued].state is LeaseState.QUEUED
    cluster.release(queued)
    assert cluster.engine.recent[queued].release_reason is ReleaseReason.CANCELLED
    cluster.release(queued, force=True)
    cluster.event(taken, "c-hal", ContainerAction.DIE)
    assert cluster.engine.recent[taken].release_reason is ReleaseReason.CONTAINER_EXITED
    # A lease nobody knows (another cluster's container on a shared engine) is left alone.
    cluster.event("not-ours", "c-other", ContainerAction.START)
    cluster.beat([ContainerInfo(container_id="c-other", lease_id="not-ours")])
    assert cluster.engine.counters["unknown_lease_container"] == 2
    # A force-release of a granted lease without a container: nothing to stop either.
    other = cluster.allocate("jo")
    cluster.release(other, force=True)
    assert cluster.engine.take_commands() == []


def test_switched_off(tmp_path):
    cluster = Cluster(tmp_path, stop_containers=False)
    lease_id, _ = cluster.bound("kim")
    cluster.release(lease_id)
    cluster.release(lease_id, force=True)
    cluster.event(lease_id, "c-zombie", ContainerAction.START)
    assert cluster.engine.take_commands() == []


def test_a_reload_forgets_commands_of_an_uncommitted_batch(tmp_path, cluster):
    lease_id, container_id = cluster.bound("lou")
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open()
    try:
        ledger.call(lambda: ledger.commit(cluster.changes))
        cluster.changes = Changes()
        cluster.release(lease_id)
        assert cluster.engine.commands, "decided, not yet committed"
        # The commit fails: the service rebuilds the engine from the ledger.
        cluster.engine.load(ledger.call(ledger.load), cluster.now)
    finally:
        ledger.close()
    assert cluster.engine.take_commands() == []
    assert cluster.engine.leases[lease_id].state is LeaseState.BOUND
    # Asked again when the hub's release is applied again.
    cluster.release(lease_id)
    assert [c.container_id for c in cluster.engine.take_commands()] == [container_id]
