"""Serving the queue: each waiting request's demand is kept between tries, and resolved again
when the cluster's models change. Pure engine, no broker."""

from __future__ import annotations

from pathlib import Path

from allocator.config import AllocatorSettings
from allocator.engine import Engine
from allocator.ledger.changes import Changes
from allocator.ledger.loaded import LoadedState
from allocator.wire.protocol import AllocateRequest, GPUInfo, Heartbeat, LeaseReply, LeaseState
from tests.support.common import HUB, NODE

A100 = "NVIDIA A100-SXM4-80GB"
GTX1070 = "NVIDIA GeForce GTX 1070"


def report(host: str, model: str, memory_mib: int, at: float) -> Heartbeat:
    return Heartbeat(host=host, agent_id=f"agent-{host}", seq=1, sent_at=at, interval_s=2,
                     gpus=[GPUInfo(uuid=f"GPU-{host}", index=0, model=model,
                                   memory_total_mib=memory_mib)],
                     containers=[], containers_complete=True, source="simulated")


def test_a_request_queued_for_a_model_not_seen_yet_is_granted_when_it_appears(
        tmp_path: Path) -> None:
    """After a fenced start on an empty ledger an A100 request waits (the nodes that have it
    may not have reported yet). A node without one reports, and the queue is tried: the
    request does not resolve. Then a node with an A100 joins: the request's demand must be
    resolved again on the new models, not taken from the try before, and it is granted."""
    settings = AllocatorSettings(ledger_path=tmp_path / "ledger.sqlite",
                                 allow_any_node_user=True, start_fence_s=30)
    engine = Engine(settings, started_at=0.0)
    engine.load(LoadedState(nodes=[], gpus=[], leases=[], agent_users={}), 0.0, fenced=True)
    changes = Changes()
    asked = engine.handle(AllocateRequest(request_key="k/", user="u", model=A100, wait_s=60),
                          HUB, 1.0, changes)
    assert isinstance(asked, LeaseReply) and asked.lease.state is LeaseState.QUEUED
    engine.handle(report("small", GTX1070, 8192, 2.0), NODE, 2.0, changes)
    assert engine.leases[asked.lease.lease_id].state is LeaseState.QUEUED
    engine.handle(report("big", A100, 81920, 3.0), NODE, 3.0, changes)
    granted = engine.leases[asked.lease.lease_id]
    assert granted.state is LeaseState.GRANTED and granted.host == "big"
