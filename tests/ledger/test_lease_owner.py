"""A lease belongs to the broker user that asked for it (its hub): another hub's release,
status, allocate retry or listing does not reach it; admins (``admin_users``) do; a lease
whose owner is not known (from before owners were recorded, or adopted from its
container's labels) is anyone's, as before.

The engine alone first (each request kind), then the ledger and its replicated log (the
owner recorded, carried beside the lease rows, read by release 0.1.0's own code), then two
hubs as two real broker users with their own passwords and permissions on the real broker.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.config import AllocatorSettings
from allocator.engine import Engine, Sender
from allocator.ledger.change_set import BrokenChanges, ChangeSet
from allocator.ledger.changes import LEASE_OWNERS, Changes
from allocator.ledger.lease import ADOPTED_OWNER
from allocator.ledger.log_entries import Batch, decode_entry
from allocator.ledger.log_position import LogPosition
from allocator.ledger.log_snapshot import decode_parts, encode_parts
from allocator.ledger.store import Ledger
from allocator.service import AllocatorService
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerAction,
    ContainerEvent,
    ContainerGrant,
    ContainerInfo,
    ErrorCode,
    ErrorReply,
    GPUInfo,
    Heartbeat,
    InventoryReply,
    InventoryRequest,
    LeaseReply,
    LeasesReply,
    LeasesRequest,
    LeaseState,
    QueueReply,
    QueueRequest,
    QuotaReply,
    QuotaRequest,
    ReleaseReason,
    ReleaseRequest,
    StatusRequest,
    encode,
)
from allocator.wire.topology import NODES_EXCHANGE, event_routing_key, heartbeat_routing_key
from nodeagent.commands import CommandConsumer
from nodeagent.containers import StopOutcome
from tests.support import services
from tests.support.broker_definitions import (
    SHIPPED_USERS,
    TEMPLATE,
    Broker,
    agent_beat,
    loaded_broker,
    publish,
)
from tests.support.common import wait_until
from tests.support.services import require_service

REPO = Path(__file__).resolve().parents[2]
RELEASE_0_1_0 = "86a59a1"
"""The last commit of release 0.1.0 (as in tests/e2e/test_mixed_versions.py)."""

HOST = "gpu-a"
MODEL = "NVIDIA GeForce GTX 1070"
HUB_A = Sender(user_id="hub-a", via_nodes_exchange=False)
HUB_B = Sender(user_id="hub-b", via_nodes_exchange=False)
ADMIN = Sender(user_id="admin", via_nodes_exchange=False)
NO_USER = Sender(user_id=None, via_nodes_exchange=False)
"""A request whose publisher set no AMQP user_id (the broker then vouches for nobody)."""
NODE = Sender(user_id="agent", via_nodes_exchange=True)


# ----------------------------------------------------------------------------- the engine


class Cluster:
    """One engine with one host of four GPUs, a clock, and the batch's changes."""

    def __init__(self, tmp_path: Path) -> None:
        self.engine = Engine(AllocatorSettings(
            ledger_path=tmp_path / "ledger.sqlite", allow_any_node_user=True,
            admin_users=["admin"], start_fence_s=0.0), started_at=0.0)
        self.now = 1.0
        self.seq = 0
        self.changes = Changes()
        self.beat([])

    def apply(self, message: Any, sender: Sender) -> Any:
        self.now += 0.1
        return self.engine.handle(message, sender, self.now, self.changes)

    def beat(self, containers: list[ContainerInfo]) -> None:
        self.seq += 1
        self.apply(Heartbeat(
            host=HOST, agent_id="a1", seq=self.seq, sent_at=self.now, interval_s=2,
            gpus=[GPUInfo(uuid=f"GPU-{i}", index=i, model=MODEL, memory_total_mib=8192)
                  for i in range(4)],
            containers=containers, containers_complete=True, source="simulated"), NODE)

    def allocate(self, sender: Sender, user: str, **fields: Any) -> LeaseReply:
        reply = self.apply(AllocateRequest(request_key=f"{sender.user_id}/{user}/", user=user,
                                           **fields), sender)
        assert isinstance(reply, LeaseReply), reply
        return reply

    def bound(self, sender: Sender, user: str) -> str:
        lease_id = self.allocate(sender, user).lease.lease_id
        self.apply(ContainerEvent(host=HOST, container_id=f"c-{user}", lease_id=lease_id,
                                  action=ContainerAction.START, at=self.now), NODE)
        assert self.engine.leases[lease_id].state is LeaseState.BOUND
        return lease_id

    def died(self, lease_id: str) -> None:
        """The node reports the lease's container dead."""
        record = self.engine.find(lease_id, None)
        assert record is not None and record.container_id is not None
        self.apply(ContainerEvent(host=HOST, container_id=record.container_id,
                                  lease_id=lease_id, action=ContainerAction.DIE,
                                  at=self.now), NODE)


def forbidden(reply: object, *words: str) -> None:
    """``reply`` is a ``forbidden`` error whose message names each of ``words``."""
    assert isinstance(reply, ErrorReply), reply
    assert reply.error.code is ErrorCode.FORBIDDEN, reply
    for word in words:
        assert word in reply.error.message, (word, reply.error.message)


def not_found(reply: object) -> None:
    """``reply`` is a ``not_found`` error: a request key of another hub names nothing."""
    assert isinstance(reply, ErrorReply), reply
    assert reply.error.code is ErrorCode.NOT_FOUND, reply


def test_a_lease_records_the_broker_user_that_asked_in_the_ledger(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    lease_id = cluster.allocate(HUB_A, "alice").lease.lease_id
    assert cluster.engine.leases[lease_id].owner == "hub-a"
    assert cluster.changes.leases[lease_id]["owner"] == "hub-a"
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open()
    try:
        ledger.call(lambda: ledger.commit(cluster.changes))
        stored = ledger.call(lambda: ledger.find_lease(lease_id))
        loaded = ledger.call(ledger.load)
    finally:
        ledger.close()
    assert stored is not None and stored.owner == "hub-a"
    assert [lease.owner for lease in loaded.leases] == ["hub-a"]


def test_another_hub_may_not_release_a_lease_nor_stop_its_container(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    lease_id = cluster.bound(HUB_A, "alice")
    cluster.engine.take_commands()
    history = len(cluster.changes.history)
    for request in (ReleaseRequest(lease_id=lease_id),
                    ReleaseRequest(lease_id=lease_id, force=True)):
        forbidden(cluster.apply(request, HUB_B), lease_id, "'hub-a'", "'hub-b'", "release")
    # Its request key is hub A's: in hub B's keys it names nothing.
    not_found(cluster.apply(ReleaseRequest(request_key="hub-a/alice/"), HUB_B))
    assert cluster.engine.leases[lease_id].state is LeaseState.BOUND
    assert cluster.engine.take_commands() == [], "its container is not stopped"
    assert len(cluster.changes.history) == history, "nothing written"
    assert cluster.engine.counters["foreign_lease"] == 2
    # Its own hub may; force stays the admins'.
    forbidden(cluster.apply(ReleaseRequest(lease_id=lease_id, force=True), HUB_A),
              "force-release is for admins")
    released = cluster.apply(ReleaseRequest(lease_id=lease_id), HUB_A)
    assert isinstance(released, LeaseReply) and released.lease.state is LeaseState.RELEASING
    assert [c.lease_id for c in cluster.engine.take_commands()] == [lease_id]


def test_an_admin_may_release_any_hubs_lease(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    plain, forced = cluster.bound(HUB_A, "alice"), cluster.bound(HUB_A, "bob")
    cluster.engine.take_commands()
    released = cluster.apply(ReleaseRequest(lease_id=plain, by="ops"), ADMIN)
    assert isinstance(released, LeaseReply) and released.lease.state is LeaseState.RELEASING
    ended = cluster.apply(ReleaseRequest(lease_id=forced, force=True, by="ops"), ADMIN)
    assert isinstance(ended, LeaseReply) and ended.lease.state is LeaseState.RELEASED
    assert ended.lease.release_reason is ReleaseReason.ADMIN
    assert [c.lease_id for c in cluster.engine.take_commands()] == [plain, forced]
    assert cluster.engine.counters["foreign_lease"] == 0


def test_another_hub_may_not_see_a_lease_active_or_finished(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    lease_id = cluster.bound(HUB_A, "alice")
    by_id, by_key = StatusRequest(lease_id=lease_id), StatusRequest(request_key="hub-a/alice/")
    for request in (by_id, by_key):
        for sender in (HUB_A, ADMIN):
            seen = cluster.apply(request, sender)
            assert isinstance(seen, LeaseReply) and seen.lease.lease_id == lease_id
    forbidden(cluster.apply(by_id, HUB_B), lease_id, "'hub-a'", "see")
    not_found(cluster.apply(by_key, HUB_B))
    cluster.apply(ReleaseRequest(lease_id=lease_id), HUB_A)
    cluster.died(lease_id)
    assert cluster.engine.recent[lease_id].state is LeaseState.RELEASED
    forbidden(cluster.apply(by_id, HUB_B), lease_id)
    not_found(cluster.apply(by_key, HUB_B))
    # Releasing a finished lease twice is a no-op for its owner, and still no answer for
    # another hub (it would show the lease).
    forbidden(cluster.apply(ReleaseRequest(lease_id=lease_id), HUB_B), lease_id)
    again = cluster.apply(ReleaseRequest(lease_id=lease_id), HUB_A)
    assert isinstance(again, LeaseReply) and again.lease.state is LeaseState.RELEASED


def test_another_hub_may_not_withdraw_a_queued_request_nor_wait_on_it(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    cluster.allocate(HUB_A, "alice", count=4)
    queued = cluster.allocate(HUB_A, "bob", wait_s=600)
    assert queued.lease.state is LeaseState.QUEUED
    lease_id = queued.lease.lease_id
    forbidden(cluster.apply(ReleaseRequest(lease_id=lease_id), HUB_B), "release")
    not_found(cluster.apply(ReleaseRequest(request_key="hub-a/bob/"), HUB_B))
    forbidden(cluster.apply(StatusRequest(lease_id=lease_id), HUB_B), "see")
    assert cluster.engine.leases[lease_id].state is LeaseState.QUEUED
    assert cluster.engine.book.queue_position(lease_id) == 1
    cancelled = cluster.apply(ReleaseRequest(lease_id=lease_id), HUB_A)
    assert isinstance(cancelled, LeaseReply)
    assert cancelled.lease.release_reason is ReleaseReason.CANCELLED


def test_request_keys_are_each_hubs_own(tmp_path: Path) -> None:
    """Request keys are free text: hub B may send the very key hub A uses (by mistake, or
    to squat it with a long wait). Each is then a key of its own hub: B gets a lease of its
    own, and A's retries, status and release under the key reach A's lease alone, never
    ``forbidden`` (before, A's spawns got ``forbidden`` for as long as B kept it)."""
    cluster = Cluster(tmp_path)
    ask = AllocateRequest(request_key="hub/alice/", user="alice", wait_s=86_400)
    squat = cluster.apply(ask, HUB_B)
    assert isinstance(squat, LeaseReply)
    mine = cluster.apply(ask, HUB_A)
    assert isinstance(mine, LeaseReply), mine
    assert mine.lease.lease_id != squat.lease.lease_id
    assert cluster.engine.leases[mine.lease.lease_id].owner == "hub-a"
    assert set(cluster.engine.by_key) == {("hub-a", "hub/alice/"), ("hub-b", "hub/alice/")}
    retry = cluster.apply(ask, HUB_A)
    assert isinstance(retry, LeaseReply) and retry.lease.lease_id == mine.lease.lease_id
    status = cluster.apply(StatusRequest(request_key="hub/alice/"), HUB_A)
    assert isinstance(status, LeaseReply) and status.lease.lease_id == mine.lease.lease_id
    released = cluster.apply(ReleaseRequest(request_key="hub/alice/"), HUB_A)
    assert isinstance(released, LeaseReply) and released.lease.lease_id == mine.lease.lease_id
    assert cluster.engine.leases[squat.lease.lease_id].state is LeaseState.GRANTED
    # Released, A's key names A's finished lease; a new allocate under it is a new lease.
    status = cluster.apply(StatusRequest(request_key="hub/alice/"), HUB_A)
    assert isinstance(status, LeaseReply) and status.lease.lease_id == mine.lease.lease_id
    again = cluster.apply(ask, HUB_A)
    assert isinstance(again, LeaseReply) and again.lease.lease_id not in (
        mine.lease.lease_id, squat.lease.lease_id)
    assert cluster.engine.counters["foreign_lease"] == 0
    # An admin's lookup by key finds a lease of any hub's.
    seen = cluster.apply(StatusRequest(request_key="hub/alice/"), ADMIN)
    assert isinstance(seen, LeaseReply) and seen.lease.state is LeaseState.GRANTED


def test_a_key_whose_lease_has_no_known_owner_is_still_everyones(tmp_path: Path) -> None:
    """A lease of a ledger from before owners (no owner): a hub's retry under its key finds
    it, as before, rather than making a second lease for the same server."""
    cluster = Cluster(tmp_path)
    ask = AllocateRequest(request_key="hub/old/", user="old")
    first = cluster.apply(ask, NO_USER)
    assert isinstance(first, LeaseReply)
    retry = cluster.apply(ask, HUB_A)
    assert isinstance(retry, LeaseReply) and retry.lease.lease_id == first.lease.lease_id


def test_a_hub_learns_the_quota_use_of_its_own_leases_only(tmp_path: Path) -> None:
    """Two hubs' "alice" are one user to the quota, but a hub asking about a user sees held
    only what its own leases hold (and leases of no known owner); an admin sees all."""
    cluster = Cluster(tmp_path)
    cluster.engine.settings = cluster.engine.settings.model_copy(
        update={"user_quota": {"alice": 3}})
    cluster.bound(HUB_A, "alice")
    cluster.apply(AllocateRequest(request_key="b/alice/1", user="alice", count=2), HUB_B)

    def held(sender: Sender) -> float:
        reply = cluster.apply(QuotaRequest(user="alice"), sender)
        assert isinstance(reply, QuotaReply)
        return reply.quotas[0].held
    assert (held(HUB_A), held(HUB_B), held(ADMIN)) == (1.0, 2.0, 3.0)
    assert held(NO_USER) == 0.0


def test_listings_show_a_hub_its_own_leases_and_admins_every_lease(tmp_path: Path) -> None:
    cluster = Cluster(tmp_path)
    mine = cluster.bound(HUB_A, "alice")
    theirs = cluster.bound(HUB_B, "bob")
    cluster.allocate(HUB_B, "carol", count=2)  # the cluster is full now
    waiting_a = cluster.allocate(HUB_A, "dave", wait_s=600).lease.lease_id
    waiting_b = cluster.allocate(HUB_B, "erin", wait_s=600).lease.lease_id

    def listed(sender: Sender) -> dict[str, set[str]]:
        inventory = cluster.apply(InventoryRequest(include_leases=True), sender)
        queue = cluster.apply(QueueRequest(), sender)
        leases = cluster.apply(LeasesRequest(), sender)
        alice = cluster.apply(LeasesRequest(user="alice"), sender)
        assert isinstance(inventory, InventoryReply) and isinstance(queue, QueueReply)
        assert isinstance(leases, LeasesReply) and isinstance(alice, LeasesReply)
        # The GPUs and counts are the whole cluster's, whoever asks.
        assert sum(len(gpu.holders) for gpu in inventory.gpus) == 4
        assert inventory.queued == 2
        return {"inventory": {lease.lease_id for lease in inventory.leases or []},
                "queue": {lease.lease_id for lease in queue.leases},
                "leases": {lease.lease_id for lease in leases.leases},
                "alice": {lease.lease_id for lease in alice.leases}}

    a = listed(HUB_A)
    assert a["queue"] == {waiting_a} and a["alice"] == {mine}
    assert a["inventory"] == a["leases"] and mine in a["leases"] and theirs not in a["leases"]
    assert {cluster.engine.leases[i].owner for i in a["leases"]} == {"hub-a"}
    b = listed(HUB_B)
    assert b["queue"] == {waiting_b} and b["alice"] == set() and theirs in b["leases"]
    assert not a["leases"] & b["leases"]
    everything = listed(ADMIN)
    assert everything["leases"] == a["leases"] | b["leases"] == set(cluster.engine.leases)
    assert everything["queue"] == {waiting_a, waiting_b}
    # The queue position counts every waiter, shown or not.
    queue = cluster.apply(QueueRequest(), HUB_B)
    assert [lease.queue_position for lease in queue.leases] == [2]


def test_a_lease_whose_owner_is_unknown_is_anyones_as_before(tmp_path: Path) -> None:
    """Asked for without an AMQP user_id: no owner; any broker user may see and release it.
    A request without a user_id acts on no owned lease. A lease adopted from its container's
    grant labels is no hub's: only admins see and release it (the labels may be forged)."""
    cluster = Cluster(tmp_path)
    grant = ContainerGrant(host=HOST, gpu_uuids=["GPU-3"], user="frank",
                           request_key="hub-a/frank/")
    cluster.beat([ContainerInfo(container_id="c-frank", lease_id="lost", grant=grant,
                                started_at=0.5)])
    adopted = cluster.engine.leases["lost"]
    assert adopted.state is LeaseState.BOUND and adopted.owner == ADOPTED_OWNER
    anonymous = cluster.allocate(NO_USER, "gina").lease.lease_id
    assert cluster.engine.leases[anonymous].owner is None
    owned = cluster.bound(HUB_A, "hank")
    for sender in (HUB_A, HUB_B, NO_USER):
        listing = cluster.apply(LeasesRequest(), sender)
        assert anonymous in {lease.lease_id for lease in listing.leases}
        assert "lost" not in {lease.lease_id for lease in listing.leases}
        forbidden(cluster.apply(ReleaseRequest(lease_id="lost"), sender), "lost")
    listing = cluster.apply(LeasesRequest(), ADMIN)
    assert {"lost", anonymous, owned} <= {lease.lease_id for lease in listing.leases}
    forbidden(cluster.apply(StatusRequest(lease_id=owned), NO_USER), "without a broker user")
    forbidden(cluster.apply(ReleaseRequest(lease_id=owned), NO_USER), "without a broker user")
    for lease_id, sender in (("lost", ADMIN), (anonymous, HUB_A)):
        released = cluster.apply(ReleaseRequest(lease_id=lease_id), sender)
        assert isinstance(released, LeaseReply), released
        assert released.lease.state in (LeaseState.RELEASING, LeaseState.RELEASED)


def test_the_ledger_finds_a_key_in_the_askers_key_space(tmp_path: Path) -> None:
    """A status by key of a lease that left memory is read from the ledger: there too, the
    key names the asker's own lease (or one of no known owner), an admin's any."""
    cluster = Cluster(tmp_path)
    ask = AllocateRequest(request_key="hub/alice/", user="alice")
    ours = cluster.apply(ask, HUB_A)
    theirs = cluster.apply(ask, HUB_B)
    assert isinstance(ours, LeaseReply) and isinstance(theirs, LeaseReply)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open()
    try:
        ledger.call(lambda: ledger.commit(cluster.changes))

        def newest(asker: str | None, every_owner: bool) -> str | None:
            found = ledger.call(lambda: ledger.latest_lease_for_key(
                "hub/alice/", asker=asker, every_owner=every_owner))
            return None if found is None else found.lease_id
        assert newest("hub-a", False) == ours.lease.lease_id
        assert newest("hub-b", False) == theirs.lease.lease_id
        assert newest("hub-c", False) is None
        assert newest(None, True) == theirs.lease.lease_id
    finally:
        ledger.close()


# ----------------------------------------------------------------------------- the ledger log


def owned_changes() -> Changes:
    """A batch of two new leases, one owned by hub-a and one whose owner is unknown."""
    from allocator.ledger.lease import LeaseRecord

    changes = Changes()
    for lease_id, owner in (("l-owned", "hub-a"), ("l-unknown", None)):
        record = LeaseRecord(lease_id=lease_id, request_key=f"k/{lease_id}/", user="u",
                             groups=(), state=LeaseState.QUEUED, created_at=1.0,
                             request={"count": 1}, owner=owner)
        changes.transition(record, None, 1.0, "requested", by="u")
    return changes


def test_the_owner_travels_beside_the_lease_rows_and_back(tmp_path: Path) -> None:
    """In the log a lease row has only the columns 0.1.0 knows; the owner is in the change
    set's ``lease_owners``, and a replica of this release writes it to its ledger."""
    data = owned_changes().to_json()
    assert all("owner" not in row for row in data["leases"])
    assert data[LEASE_OWNERS] == {"l-owned": "hub-a"}
    entry = decode_entry(Batch(log_id="log", entry_id="e", epoch=1, writer="w",
                               changes=ChangeSet.of(owned_changes())).encode())
    assert isinstance(entry, Batch)
    ledger = Ledger(tmp_path / "replica.sqlite")
    ledger.open()
    try:
        ledger.call(lambda: ledger.commit(entry.changes.to_changes()))
        state = ledger.call(ledger.load)
    finally:
        ledger.close()
    assert {r.lease_id: r.owner for r in state.leases} == {"l-owned": "hub-a",
                                                          "l-unknown": None}
    # A batch without owners is written as before (no empty field).
    assert LEASE_OWNERS not in json.loads(Batch(
        log_id="log", entry_id="e", epoch=1, writer="w",
        changes=ChangeSet.of(Changes())).encode())["changes"]


def test_an_owner_of_a_lease_the_change_set_does_not_write_is_a_broken_entry() -> None:
    data = owned_changes().to_json()
    data[LEASE_OWNERS]["l-elsewhere"] = "hub-b"
    with pytest.raises(BrokenChanges, match="l-elsewhere"):
        Changes.from_json(data)
    data = owned_changes().to_json()
    data[LEASE_OWNERS]["l-owned"] = ""
    with pytest.raises(BrokenChanges, match="lease_owners"):
        Changes.from_json(data)


def test_a_snapshot_carries_the_owners_beside_the_leases(tmp_path: Path) -> None:
    source = Ledger(tmp_path / "writer.sqlite")
    source.open()
    try:
        source.call(lambda: source.commit(owned_changes()))
        _, tables = source.call(lambda: source.snapshot_tables(trail=False))
    finally:
        source.close()
    assert "owner" not in tables["leases"].columns
    assert tables[LEASE_OWNERS].rows == [["l-owned", "hub-a"]]
    replica = Ledger(tmp_path / "replica.sqlite")
    replica.open()
    try:
        position = LogPosition("log", 7, "e7", 1, "w")
        loaded = decode_parts(encode_parts(tables, 4096))
        replica.call(lambda: replica.load_snapshot(loaded, position, loaded_at=2.0))
        state = replica.call(replica.load)
    finally:
        replica.close()
    assert {r.lease_id: r.owner for r in state.leases} == {"l-owned": "hub-a",
                                                          "l-unknown": None}


_OLD_REPLICA = """
import json, sys
from pathlib import Path
from allocator.ledger import Changes, Ledger, LogPosition
from allocator.log_snapshot import decode_parts
ledger = Ledger(sys.argv[1])
ledger.open()
batch = json.loads(Path(sys.argv[2]).read_text())
ledger.call(lambda: ledger.commit(Changes.from_json(batch), position=LogPosition(
    "log", 1, "e1", 1, "w")))
parts = [Path(p).read_bytes() for p in sys.argv[3:]]
ledger.call(lambda: ledger.load_snapshot(decode_parts(parts), LogPosition(
    "log", 2, "e2", 1, "w", 1, 0)))
print(json.dumps(sorted(r.lease_id for r in ledger.call(ledger.load).leases)))
ledger.close()
"""


@pytest.fixture(scope="module")
def release_0_1_0_code() -> Iterator[Path]:
    """The ``allocator`` package of release 0.1.0, from the project's history."""
    git = shutil.which("git")
    if git is None:
        require_service("git", "not found")
    with tempfile.TemporaryDirectory() as folder:
        archive = subprocess.run([git, "-C", str(REPO), "archive", RELEASE_0_1_0, "allocator"],
                                 capture_output=True, check=False)
        if archive.returncode != 0:
            require_service(f"commit {RELEASE_0_1_0} (0.1.0)", archive.stderr.decode()[-500:])
        subprocess.run(["tar", "-x", "-C", folder], input=archive.stdout, check=True)
        yield Path(folder)


def test_a_replica_of_0_1_0_follows_batches_and_snapshots_with_owners(
        tmp_path: Path, release_0_1_0_code: Path) -> None:
    """0.1.0's own ledger code, on its own schema (5), applies a change set and loads a
    snapshot of this release's, owners and all: it keeps the leases and knows no owner."""
    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps(json.loads(Batch(
        log_id="log", entry_id="e1", epoch=1, writer="w",
        changes=ChangeSet.of(owned_changes())).encode())["changes"]))
    writer = Ledger(tmp_path / "writer.sqlite")
    writer.open()
    try:
        writer.call(lambda: writer.commit(owned_changes()))
        _, tables = writer.call(lambda: writer.snapshot_tables(trail=False))
    finally:
        writer.close()
    parts = []
    for number, payload in enumerate(encode_parts(tables, 512)):
        parts.append(tmp_path / f"part-{number}")
        parts[-1].write_bytes(payload)
    old = tmp_path / "old.sqlite"
    env = {**os.environ, "PYTHONPATH": str(release_0_1_0_code)}
    run = subprocess.run([sys.executable, "-c", _OLD_REPLICA, str(old), str(batch), *map(
        str, parts)], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout) == ["l-owned", "l-unknown"]
    with sqlite3.connect(old) as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 5
        columns = {row[1] for row in conn.execute("PRAGMA table_info(leases)")}
    assert "owner" not in columns


# ----------------------------------------------------------------------------- two real hubs


@pytest.fixture
def two_hubs(rabbitmq: services.RabbitMQ) -> Iterator[Broker]:
    """The committed definitions with a second hub user, ``hub-b``, made as the shipped
    ``hub`` is (its own password, the same permissions), on a vhost of this test's own."""
    template = json.loads(json.dumps(TEMPLATE))
    for section, key in (("users", "name"), ("permissions", "user"),
                         ("topic_permissions", "user")):
        template[section] += [{**entry, key: "hub-b"} for entry in template.get(section, [])
                              if entry.get(key) == "hub"]
    with loaded_broker(rabbitmq, template, "owners", (*SHIPPED_USERS, "hub-b")) as loaded:
        yield loaded


@contextlib.asynccontextmanager
async def serving(settings: AllocatorSettings) -> AsyncIterator[AllocatorService]:
    """An allocator service with ``settings``, started, and stopped afterwards."""
    service = AllocatorService(settings)
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


@pytest.fixture
async def allocator_of(two_hubs: Broker, ledger_path: Path) -> AsyncIterator[AllocatorService]:
    async with serving(two_hubs.settings(ledger_path)) as service:
        yield service


@contextlib.asynccontextmanager
async def reported_cluster(
        broker: Broker) -> AsyncIterator[tuple[AllocatorClient, AllocatorClient,
                                               AllocatorClient]]:
    """gpu-a reported by its own agent user; then the clients of hub A (the shipped ``hub``
    user), hub B and an admin, once the allocator lists the node."""
    await publish(broker.url("agent-gpu-a"), NODES_EXCHANGE, heartbeat_routing_key("gpu-a"),
                  agent_beat("gpu-a"), user_id=broker.prefix + "agent-gpu-a")
    async with AllocatorClient(broker.url("hub"), timeout_s=10) as hub_a, \
            AllocatorClient(broker.url("hub-b"), timeout_s=10) as hub_b, \
            AllocatorClient(broker.url("admin"), timeout_s=10) as admin:
        async def reported() -> object:
            return (await hub_a.inventory()).nodes
        await wait_until(reported)
        yield hub_a, hub_b, admin


async def test_two_hubs_on_the_real_broker_act_only_on_their_own_leases(
        two_hubs: Broker, allocator_of: AllocatorService) -> None:
    """Hub A allocates two leases whose containers run; hub B's release and status of them
    are ``forbidden`` and the agent is asked to stop nothing; B's inventory lists none of
    them. An admin releases one (its container is stopped), hub A the other."""
    broker, agent_user = two_hubs, two_hubs.prefix + "agent-gpu-a"
    stopped: list[str] = []

    async def stopper(container_id: str, lease_id: str, grace_s: float) -> StopOutcome:
        stopped.append(lease_id)
        return StopOutcome.STOPPED

    consumer = CommandConsumer(broker.url("agent-gpu-a"), "gpu-a", stopper,
                               command_users=[broker.prefix + "allocator"], timeout_s=5)
    assert await consumer.start(wait_s=10), consumer.last_error
    try:
        async with reported_cluster(broker) as (hub_a, hub_b, admin):
            leases = [await hub_a.allocate(AllocateRequest(request_key=f"a/{user}/", user=user))
                      for user in ("alice", "bob")]
            for lease in leases:
                await publish(broker.url("agent-gpu-a"), NODES_EXCHANGE,
                              event_routing_key("gpu-a"), encode(ContainerEvent(
                                  host="gpu-a", container_id=f"c-{lease.user}",
                                  lease_id=lease.lease_id, action=ContainerAction.START,
                                  at=time.time())), user_id=agent_user)

                async def bound(lease_id: str = lease.lease_id) -> bool:
                    return (await hub_a.status(lease_id=lease_id)).state is LeaseState.BOUND
                await wait_until(bound)
            alice, bob = leases
            for call in (hub_b.release(lease_id=alice.lease_id),
                         hub_b.release(lease_id=alice.lease_id, force=True),
                         hub_b.status(lease_id=alice.lease_id),
                         hub_b.status(lease_id=bob.lease_id)):
                with pytest.raises(AllocatorError) as refused:
                    await call
                assert refused.value.code is ErrorCode.FORBIDDEN
                assert broker.prefix + "hub-b" in str(refused.value)
            # Hub A's request keys are its own: in hub B's they name nothing.
            for call in (hub_b.release(request_key="a/alice/", force=True),
                         hub_b.status(request_key="a/bob/")):
                with pytest.raises(AllocatorError) as refused:
                    await call
                assert refused.value.code is ErrorCode.NOT_FOUND
            assert (await hub_a.status(lease_id=alice.lease_id)).state is LeaseState.BOUND
            assert (await hub_b.inventory(include_leases=True)).leases == []
            every = {lease.lease_id for lease in
                     (await admin.inventory(include_leases=True)).leases or []}
            assert every == {alice.lease_id, bob.lease_id}

            released = await admin.release(lease_id=alice.lease_id, reason="owner test")
            assert released.state is LeaseState.RELEASING

            async def asked() -> list[str]:
                return stopped
            # Still bound after hub B's tries (a release makes it releasing at once), and
            # the one stop the agent got for it is the admin's.
            assert await wait_until(asked) == [alice.lease_id]
            own = await hub_a.release(lease_id=bob.lease_id)
            assert own.state is LeaseState.RELEASING

            async def both() -> bool:
                return len(stopped) == 2
            await wait_until(both)
            assert stopped == [alice.lease_id, bob.lease_id]
    finally:
        await consumer.stop()
    assert allocator_of.engine.counters["foreign_lease"] == 4


@pytest.fixture
async def quota_allocator(two_hubs: Broker,
                          ledger_path: Path) -> AsyncIterator[AllocatorService]:
    async with serving(two_hubs.settings(ledger_path).model_copy(update={
            "user_quota": {"victim": 1}, "group_quota": {"lab": 1},
            "start_fence_s": 0.0})) as service:
        yield service


async def test_a_forged_label_on_the_real_broker_takes_nothing_from_its_user(
        two_hubs: Broker, quota_allocator: AllocatorService) -> None:
    """Root on gpu-a starts a container labelled for ``victim`` (her group, her hub's request
    key); the agent reports it with its own credential and the allocator adopts it. Victim,
    held to one GPU, still gets one through her hub under her own key; no hub may release
    the forged lease (it would stop a container no hub asked for); an admin may."""
    broker, agent_user = two_hubs, two_hubs.prefix + "agent-gpu-a"
    hub_user = broker.prefix + "hub"
    async with reported_cluster(broker) as (hub_a, hub_b, admin):
        free = [gpu.uuid for gpu in (await hub_a.inventory()).gpus]
        grant = ContainerGrant(host="gpu-a", gpu_uuids=[free[0]], user="victim",
                               groups=["lab"], request_key="hub/victim/")
        await publish(broker.url("agent-gpu-a"), NODES_EXCHANGE, event_routing_key("gpu-a"),
                      encode(ContainerEvent(host="gpu-a", container_id="f" * 64,
                                            lease_id="forged", action=ContainerAction.START,
                                            at=time.time(), grant=grant)),
                      user_id=agent_user)

        async def adopted() -> bool:
            return (await admin.status(lease_id="forged")).state is LeaseState.BOUND
        await wait_until(adopted)
        mine = await hub_a.allocate(AllocateRequest(request_key="hub/victim/", user="victim",
                                                    groups=["lab"]))
        assert mine.state is LeaseState.GRANTED and mine.lease_id != "forged"
        assert mine.gpu_uuids == [free[1]]
        assert quota_allocator.engine.leases[mine.lease_id].owner == hub_user
        for client in (hub_a, hub_b):
            with pytest.raises(AllocatorError) as refused:
                await client.release(lease_id="forged")
            assert refused.value.code is ErrorCode.FORBIDDEN
            assert "adopted" in str(refused.value)
        assert (await admin.status(lease_id="forged")).state is LeaseState.BOUND
        released = await admin.release(lease_id="forged", reason="forged label")
        assert released.state is LeaseState.RELEASING


async def test_another_hub_on_the_real_broker_cannot_squat_a_request_key(
        two_hubs: Broker, allocator_of: AllocatorService) -> None:
    """Hub B (its own broker user) queues under hub A's key for alice with a day's wait, on
    a cluster hub A has filled; hub A's spawn for alice under that key still queues a lease
    of its own (before: ``forbidden`` for the day), gets its own lease's status and
    withdrawal by the key, and hub B's quota answer about alice counts only hub B's lease."""
    broker = two_hubs
    async with reported_cluster(broker) as (hub_a, hub_b, admin):
        full = await hub_a.allocate(AllocateRequest(request_key="hub/bob/", user="bob",
                                                    count="all"))
        assert full.state is LeaseState.GRANTED
        squat = await hub_b.allocate(AllocateRequest(request_key="hub/alice/", user="alice",
                                                     wait_s=86_400))
        assert squat.state is LeaseState.QUEUED
        own = await hub_a.allocate(AllocateRequest(request_key="hub/alice/", user="alice",
                                                   wait_s=600))
        assert own.state is LeaseState.QUEUED and own.lease_id != squat.lease_id
        assert allocator_of.engine.leases[own.lease_id].owner == broker.prefix + "hub"
        assert (await hub_a.status(request_key="hub/alice/")).lease_id == own.lease_id
        assert (await hub_b.status(request_key="hub/alice/")).lease_id == squat.lease_id
        assert (await hub_b.quota("bob")).quotas[0].held == 0.0
        assert (await hub_a.quota("bob")).quotas[0].held == float(len(full.gpu_uuids))
        assert (await admin.quota("bob")).quotas[0].held == float(len(full.gpu_uuids))
        withdrawn = await hub_a.release(request_key="hub/alice/")
        assert withdrawn.lease_id == own.lease_id and withdrawn.state is LeaseState.RELEASED
        assert (await hub_b.status(lease_id=squat.lease_id)).state is LeaseState.QUEUED
        await hub_b.release(lease_id=squat.lease_id)
