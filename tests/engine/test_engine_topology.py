"""Placement by links through the real engine: heartbeats carry each host's interconnect, the
engine places with it, a request that demands a level waits for it and is granted when the
GPUs that keep it are free, replies name the lease's worst link, and after a reload from the
ledger the container's env is kept while the link waits for the host's next report.

Pure engine and a real SQLite ledger, no broker.
"""

from __future__ import annotations

from pathlib import Path

from allocator.config import AllocatorSettings
from allocator.engine import Engine
from allocator.ledger.changes import Changes
from allocator.ledger.store import Ledger
from allocator.wire.interconnect import HostInterconnect
from allocator.wire.protocol import (
    AllocateRequest,
    ErrorCode,
    ErrorReply,
    GPUInfo,
    Heartbeat,
    LeaseReply,
    LeaseState,
    ReleaseRequest,
)
from nodeagent.simulated import preset_interconnect
from tests.support.common import A100, ADMIN, HUB, NODE, gpus


class Hosts:
    """An engine with a ledger, and hosts that report their GPUs and (optionally) links."""

    def __init__(self, tmp_path: Path) -> None:
        self.settings = AllocatorSettings(ledger_path=tmp_path / "ledger.sqlite",
                                          allow_any_node_user=True, admin_users=["admin"],
                                          start_fence_s=0, bind_timeout_s=600)
        self.ledger = Ledger(self.settings.ledger_path)
        self.ledger.open()
        self.engine = Engine(self.settings, started_at=0.0)
        self.now = 1.0
        self.seq = 0
        self.gpus: dict[str, list[GPUInfo]] = {}
        self.links: dict[str, HostInterconnect | None] = {}

    def apply(self, message: object, sender: object) -> object:
        self.now += 0.1
        changes = Changes()
        reply = self.engine.handle(message, sender, self.now, changes)  # type: ignore[arg-type]
        self.ledger.call(lambda: self.ledger.commit(changes))
        return reply

    def host(self, host: str, count: int, preset: str | None) -> list[str]:
        self.gpus[host] = gpus(host, A100, count)
        uuids = [g.uuid for g in self.gpus[host]]
        self.links[host] = (None if preset is None
                            else preset_interconnect(preset, uuids))  # type: ignore[arg-type]
        self.beat(host)
        return uuids

    def beat(self, host: str, *, links: bool = True) -> None:
        self.seq += 1
        self.apply(Heartbeat(host=host, agent_id=f"a-{host}", seq=self.seq, sent_at=self.now,
                             interval_s=2, gpus=self.gpus[host], containers=[],
                             containers_complete=True, source="simulated",
                             interconnect=self.links[host] if links else None), NODE)

    def allocate(self, user: str, **fields: object) -> LeaseReply | ErrorReply:
        reply = self.apply(AllocateRequest(request_key=f"hub/{user}/", user=user, **fields), HUB)
        assert isinstance(reply, LeaseReply | ErrorReply), reply
        return reply

    def release(self, lease_id: str) -> None:
        reply = self.apply(ReleaseRequest(lease_id=lease_id, force=True, by="t"), ADMIN)
        assert isinstance(reply, LeaseReply), reply

    def reload(self) -> None:
        self.engine = Engine(self.settings, started_at=self.now)
        self.engine.load(self.ledger.call(self.ledger.load), self.now)


def test_the_engine_places_by_links_and_names_the_leases_link(tmp_path: Path) -> None:
    hosts = Hosts(tmp_path)
    pcie = hosts.host("pcie", 8, "pcie-two-socket")
    hosts.host("plain", 2, None)
    two = hosts.allocate("alice", count=2, model=A100)
    assert isinstance(two, LeaseReply) and two.lease.state is LeaseState.GRANTED
    # "plain" fits best (2 free) but counts as joined across sockets; a switch pair wins.
    assert two.lease.host == "pcie" and two.lease.link == "pcie-switch"
    assert set(two.lease.gpu_uuids) in ({pcie[0], pcie[1]}, {pcie[2], pcie[3]},
                                        {pcie[4], pcie[5]}, {pcie[6], pcie[7]})
    assert two.lease.env["NVIDIA_VISIBLE_DEVICES"] == ",".join(two.lease.gpu_uuids)
    assert two.lease.env["SWARM_GPU_NUMA_NODES"] in ("0", "1")
    one = hosts.allocate("bob", count=1, model=A100)
    assert isinstance(one, LeaseReply) and one.lease.link is None
    four = hosts.allocate("carol", count=4, model=A100)
    assert isinstance(four, LeaseReply) and four.lease.host == "pcie"
    assert four.lease.link in ("socket", "system")


def test_a_demanded_level_waits_and_is_granted_when_it_can_be_kept(tmp_path: Path) -> None:
    hosts = Hosts(tmp_path)
    pairs = hosts.host("ws", 4, "nvlink-pairs")
    held = [hosts.allocate(f"u{i}", count=1) for i in range(2)]
    taken = {uuid for reply in held if isinstance(reply, LeaseReply)
             for uuid in reply.lease.gpu_uuids}
    assert taken == {pairs[0], pairs[1]}  # the second GPU kept the pair 2-3 whole
    holder = next(r for r in held if isinstance(r, LeaseReply) and pairs[0] in r.lease.gpu_uuids)
    assert isinstance(holder, LeaseReply)
    # 2-3 free: an NVLink pair is granted; a second one waits for 0-1.
    first = hosts.allocate("alice", count=2, topology="nvlink")
    assert isinstance(first, LeaseReply) and first.lease.link == "nvlink"
    busy = hosts.allocate("now", count=2, topology="nvlink")
    assert isinstance(busy, ErrorReply) and busy.error.code is ErrorCode.NO_CAPACITY
    waiting = hosts.allocate("bob", count=2, topology="nvlink", wait_s=600)
    assert isinstance(waiting, LeaseReply) and waiting.lease.state is LeaseState.QUEUED
    hosts.release(holder.lease.lease_id)  # frees GPU 0 only: 0 and 1 are not both free
    assert hosts.engine.leases[waiting.lease.lease_id].state is LeaseState.QUEUED
    other = next(r for r in held if isinstance(r, LeaseReply) and r is not holder)
    hosts.release(other.lease.lease_id)
    granted = hosts.engine.leases[waiting.lease.lease_id]
    assert granted.state is LeaseState.GRANTED
    assert set(granted.gpu_uuids) == {pairs[0], pairs[1]}


def test_a_host_without_links_cannot_meet_a_demand_until_it_reports_them(
        tmp_path: Path) -> None:
    hosts = Hosts(tmp_path)
    uuids = hosts.host("h", 8, None)
    refused = hosts.allocate("alice", count=2, topology="socket")
    assert isinstance(refused, ErrorReply) and refused.error.code is ErrorCode.UNSATISFIABLE
    assert "reported how its GPUs are joined" in refused.error.message
    hosts.links["h"] = preset_interconnect("hgx", uuids)
    hosts.beat("h")
    granted = hosts.allocate("alice", count=2, topology="socket")
    assert isinstance(granted, LeaseReply) and granted.lease.link == "nvlink"


def test_after_a_reload_the_env_is_kept_and_the_link_waits_for_the_hosts_report(
        tmp_path: Path) -> None:
    hosts = Hosts(tmp_path)
    hosts.host("h", 8, "hgx")
    hosts.allocate("x", count=3)  # taken first: the next lease spans both NUMA nodes
    granted = hosts.allocate("alice", count=2, model=A100)
    assert isinstance(granted, LeaseReply)
    lease = granted.lease
    hosts.reload()
    record = hosts.engine.leases[lease.lease_id]
    assert record.env == lease.env and record.gpu_uuids == tuple(lease.gpu_uuids)
    assert hosts.engine.book.view(record).link is None  # links are in memory only
    hosts.beat("h")
    assert hosts.engine.book.view(record).link == "nvlink"
