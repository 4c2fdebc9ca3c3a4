"""No sequence of messages ever breaks the ledger: a hypothesis state machine over the engine.

Each step applies one message (allocate, release, container event, heartbeat, drain, tick)
to a real :class:`~allocator.engine.Engine`, commits its changes to a real SQLite ledger, and
then checks: the invariant checker finds nothing on disk; no GPU holds more than its slots,
more budget than its memory, or an exclusive claim beside another; and an engine rebuilt
from the ledger holds exactly what the running one holds (memory never runs ahead of disk).
Every stop command the engine decides names a container of a lease that is being released or
is finished, never one a live lease holds; the simulated node obeys it (the container dies).
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from allocator.config import AllocatorSettings
from allocator.engine import Engine, Sender
from allocator.ledger.changes import Changes
from allocator.ledger.invariants import check_ledger
from allocator.ledger.store import Ledger
from allocator.ledger.usage_history import ended_since
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerAction,
    ContainerEvent,
    ContainerInfo,
    DrainRequest,
    GPUInfo,
    Health,
    Heartbeat,
    LeaseState,
    ReleaseRequest,
    ShareRequest,
)
from tests.support.common import ADMIN, NODE
from tests.support.engine_models import BIG, MEMORY, SMALL

HOSTS = {"h0": [SMALL, SMALL, BIG], "h1": [BIG, BIG], "h2": [SMALL] * 4}
HUB = ADMIN
"""The hub's requests come from an admin here, so that force-releases are allowed too."""


class LedgerMachine(RuleBasedStateMachine):
    """The allocator's engine and ledger under random traffic."""

    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="swarm-gpu-props-"))
        self.settings = AllocatorSettings(
            ledger_path=self.folder / "ledger.sqlite", allow_any_node_user=True,
            admin_users=["admin"], share_slots={SMALL: 3}, bind_timeout_s=30,
            container_gone_grace_s=1, node_down_after_s=20, stop_grace_s=40,
            user_quota={"quota-user": 1}, usage_half_life_h=1.0,
        )
        self.now = 1_000_000.0
        self.ledger = Ledger(self.settings.ledger_path)
        self.ledger.open()
        ids = itertools.count(1)
        self.engine = Engine(self.settings, started_at=self.now,
                             new_lease_id=lambda: f"lease-{next(ids):05d}")
        self.seq = 0
        self.zombies = 0
        self.health: dict[str, Health] = {}
        self.containers: dict[str, str] = {}
        """lease id -> container id, for containers 'running' on the simulated nodes."""
        for host in HOSTS:
            self._beat(host)

    def teardown(self) -> None:
        self.ledger.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    # ------------------------------------------------------------------ plumbing

    def _apply(self, message, sender: Sender):
        changes = Changes()
        reply = self.engine.handle(message, sender, self.now, changes)
        self.ledger.call(lambda: self.ledger.commit(changes))
        self._obey_stops()
        return reply

    def _obey_stops(self) -> None:
        """Check the engine's stop commands, then do what the node agent would."""
        for command in self.engine.take_commands():
            record = (self.engine.leases.get(command.lease_id)
                      or self.engine.recent.get(command.lease_id))
            assert record is not None, command
            assert record.state is LeaseState.RELEASING or record.state.final, (
                command, record.state)
            assert record.host in (None, command.host), (command, record.host)
            if self.containers.get(command.lease_id) == command.container_id:
                del self.containers[command.lease_id]
                self._apply(ContainerEvent(host=command.host, container_id=command.container_id,
                                           lease_id=command.lease_id, action=ContainerAction.DIE,
                                           at=self.now), NODE)

    def _gpu_uuid(self, host: str, index: int) -> str:
        return f"GPU-{host}-{index}"

    def _beat(self, host: str, drop: str | None = None) -> None:
        self.seq += 1
        gpus = [
            GPUInfo(uuid=self._gpu_uuid(host, i), index=i, model=model,
                    memory_total_mib=MEMORY[model],
                    health=self.health.get(self._gpu_uuid(host, i), Health.HEALTHY))
            for i, model in enumerate(HOSTS[host])
        ]
        running = [
            ContainerInfo(container_id=container, lease_id=lease_id)
            for lease_id, container in self.containers.items()
            if lease_id != drop and self._host_of(lease_id) == host
        ]
        self._apply(Heartbeat(host=host, agent_id="a", seq=self.seq, sent_at=self.now,
                              interval_s=2, gpus=gpus, containers=running), NODE)

    def _host_of(self, lease_id: str) -> str | None:
        record = self.engine.leases.get(lease_id) or self.engine.recent.get(lease_id)
        return record.host if record else None

    @staticmethod
    def _pick(data: st.DataObject, ids: list[str]) -> str:
        # Lease ids are random uuids: draw a position, not an id, so that hypothesis can
        # replay the same choices (sampled_from over changing ids is "flaky" to it).
        return ids[data.draw(st.integers(0, len(ids) - 1))]

    def _holding(self) -> list[str]:
        return sorted(i for i, r in self.engine.leases.items() if r.state.holds_gpus)

    # ------------------------------------------------------------------ rules

    @rule(user=st.sampled_from(["ann", "bob", "quota-user"]), server=st.integers(0, 3),
          model=st.sampled_from([None, SMALL, BIG]), count=st.sampled_from([1, 1, 2, 3, "all"]),
          shared=st.booleans(), wait=st.sampled_from([0.0, 0.0, 15.0]),
          host=st.sampled_from([None, None, "h0", "h2"]))
    def allocate(self, user, server, model, count, shared, wait, host) -> None:
        share = ShareRequest(memory_mib=2048) if shared else None
        self._apply(AllocateRequest(
            request_key=f"hub/{user}/{server}", user=user, model=model,
            count=1 if shared else count, share=share, wait_s=wait, host=host), HUB)

    @precondition(lambda self: self.engine.leases)
    @rule(data=st.data(), force=st.booleans())
    def release(self, data, force) -> None:
        lease_id = self._pick(data, list(self.engine.leases))
        self._apply(ReleaseRequest(lease_id=lease_id, force=force), HUB)

    @precondition(lambda self: any(r.state is LeaseState.GRANTED
                                   for r in self.engine.leases.values()))
    @rule(data=st.data())
    def container_starts(self, data) -> None:
        granted = [i for i, r in self.engine.leases.items() if r.state is LeaseState.GRANTED]
        lease_id = self._pick(data, granted)
        container = f"c-{lease_id}"
        self.containers[lease_id] = container
        host = self._host_of(lease_id)
        assert host is not None
        self._apply(ContainerEvent(host=host, container_id=container, lease_id=lease_id,
                                   action=ContainerAction.START, at=self.now), NODE)

    @precondition(lambda self: any(r.host for r in self.engine.recent.values()))
    @rule(data=st.data())
    def zombie_starts(self, data) -> None:
        """A container starts for a lease that is finished already: it is stopped at once."""
        finished = sorted(i for i, r in self.engine.recent.items()
                          if r.host and i not in self.containers)
        if not finished:
            return
        lease_id = self._pick(data, finished)
        self.zombies += 1
        container = f"z{self.zombies}-{lease_id}"
        self.containers[lease_id] = container
        host = self._host_of(lease_id)
        assert host is not None
        self._apply(ContainerEvent(host=host, container_id=container, lease_id=lease_id,
                                   action=ContainerAction.START, at=self.now), NODE)
        assert lease_id not in self.containers, "the zombie was asked to stop"

    @precondition(lambda self: self.containers)
    @rule(data=st.data(), action=st.sampled_from([ContainerAction.DIE, ContainerAction.OOM,
                                                  ContainerAction.DESTROY, None]))
    def container_ends(self, data, action) -> None:
        lease_id = self._pick(data, list(self.containers))
        container = self.containers.pop(lease_id)
        host = self._host_of(lease_id)
        if host is None:
            return
        if action is None:  # the event was lost: only the next heartbeat tells
            self.now += 2
            self._beat(host)
        else:
            self._apply(ContainerEvent(host=host, container_id=container, lease_id=lease_id,
                                       action=action, at=self.now), NODE)

    @rule(host=st.sampled_from(sorted(HOSTS)), index=st.integers(0, 3),
          health=st.sampled_from(list(Health)))
    def gpu_health(self, host, index, health) -> None:
        if index < len(HOSTS[host]):
            self.health[self._gpu_uuid(host, index)] = health
        self._beat(host)

    @rule(host=st.sampled_from(sorted(HOSTS)), drained=st.booleans())
    def drain(self, host, drained) -> None:
        self._apply(DrainRequest(host=host, drained=drained), HUB)

    @rule(seconds=st.sampled_from([0.5, 5.0, 31.0]), beat=st.booleans())
    def time_passes(self, seconds, beat) -> None:
        self.now += seconds
        if beat:
            for host in HOSTS:
                self._beat(host)
        releasing = {lease_id for lease_id, record in self.engine.leases.items()
                     if record.state is LeaseState.RELEASING}
        changes = Changes()
        self.engine.tick(self.now, changes)
        self.ledger.call(lambda: self.ledger.commit(changes))
        self._obey_stops()
        self._no_timer_overdue(releasing)

    def _no_timer_overdue(self, releasing_before: set[str]) -> None:
        """After a tick no lease is past its timer: whatever sequence brought each lease into
        its state, the tick saw it (the engine looks only at leases it indexed as timed)."""
        for record in self.engine.leases.values():
            if record.state is LeaseState.QUEUED:
                assert record.wait_until is None or record.wait_until > self.now, record
            elif record.state is LeaseState.GRANTED:
                assert record.bind_deadline is not None and record.bind_deadline > self.now
            elif record.lease_id in releasing_before and record.host is not None:
                silent_s = self.engine.nodes.silent_for(record.host, self.now)
                assert silent_s <= self.settings.stop_grace_s, record

    # ------------------------------------------------------------------ invariants

    @invariant()
    def ledger_is_consistent(self) -> None:
        violations = self.ledger.call(lambda: check_ledger(self.ledger.db.conn))
        assert violations == [], violations

    @invariant()
    def no_gpu_is_over_committed(self) -> None:
        cluster = self.engine.cluster
        for uuid, claims in cluster.claims.items():
            gpu = cluster.gpus[uuid]
            exclusive = [c for c in claims if c.exclusive]
            assert not exclusive or len(claims) == 1, f"{uuid}: exclusive claim shared"
            assert len(claims) <= gpu.share_slots, f"{uuid}: over its slots"
            assert sum(c.memory_mib for c in claims) <= gpu.memory_total_mib
            for claim in claims:
                record = self.engine.leases[claim.lease_id]
                assert record.state.holds_gpus and uuid in record.gpu_uuids

    @invariant()
    def every_holder_has_its_claims(self) -> None:
        for lease_id in self._holding():
            record = self.engine.leases[lease_id]
            assert record.gpu_uuids
            for uuid in record.gpu_uuids:
                assert lease_id in {c.lease_id for c in self.engine.cluster.claims_on(uuid)}

    @invariant()
    def disk_holds_what_memory_holds(self) -> None:
        rebuilt = Engine(self.settings, started_at=self.now)
        since = rebuilt.usage_history_since(self.now)
        assert since is not None
        rebuilt.load(self.ledger.call(self.ledger.load), self.now, usage_history=self.ledger.call(
            lambda: ended_since(self.ledger.db.conn, since)))
        assert sorted(rebuilt.leases) == sorted(self.engine.leases)
        for lease_id, record in self.engine.leases.items():
            again = rebuilt.leases[lease_id]
            assert (again.state, again.gpu_uuids, again.host) == (
                record.state, record.gpu_uuids, record.host)
        assert {u: sorted(c.lease_id for c in cs) for u, cs in rebuilt.cluster.claims.items()} \
            == {u: sorted(c.lease_id for c in cs) for u, cs in self.engine.cluster.claims.items()}
        # Decayed usage rebuilt from the ledger's ended leases is what memory folded.
        usage = self.engine.decayed.usage(self.engine.book.charged_holding(), self.now)
        again_usage = rebuilt.decayed.usage(rebuilt.book.charged_holding(), self.now)
        for side, again_side in zip(usage, again_usage, strict=True):
            for name in side.keys() | again_side.keys():
                assert again_side.get(name, 0.0) == pytest.approx(
                    side.get(name, 0.0), rel=1e-9, abs=1e-12), name


LedgerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30,
                                           deadline=None)
test_engine_never_breaks_the_ledger = LedgerMachine.TestCase
