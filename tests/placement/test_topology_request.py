"""The ``topology`` field of an allocate request and the ``link`` of a lease, on the wire."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from allocator.config import AllocatorSettings
from allocator.engine import Engine
from allocator.ledger.changes import Changes
from allocator.ledger.loaded import LoadedState
from allocator.wire.protocol import (
    AllocateRequest,
    ErrorCode,
    ErrorReply,
    Heartbeat,
    Lease,
    LeaseReply,
    LeaseState,
    decode_inbound,
    encode,
)
from nodeagent.simulated import preset_interconnect
from tests.support.common import A100, HUB, NODE, gpus


def body(**fields: object) -> bytes:
    return json.dumps({"v": 1, "kind": "allocate", "request_key": "hub/alice/",
                       "user": "alice", **fields}).encode()


@pytest.mark.parametrize("level", ["nvlink", "pcie-switch", "socket"])
def test_each_level_is_read(level: str) -> None:
    request = decode_inbound(body(count=2, topology=level))
    assert isinstance(request, AllocateRequest) and request.topology == level


def test_no_topology_is_none() -> None:
    request = decode_inbound(body(count=2))
    assert isinstance(request, AllocateRequest) and request.topology is None


@pytest.mark.parametrize("value", ["nvswitch", "NVLink", "", 1, True, ["nvlink"]])
def test_a_bad_level_is_a_bad_request_that_names_the_field_and_the_levels(value: object) -> None:
    refused = decode_inbound(body(count=2, topology=value))
    assert isinstance(refused, ErrorReply) and refused.error.code is ErrorCode.BAD_REQUEST
    assert "topology" in refused.error.message
    assert all(level in refused.error.message for level in ("nvlink", "pcie-switch", "socket"))


def test_another_level_is_another_request() -> None:
    plain = AllocateRequest(request_key="k", user="u", count=2)
    assert plain.what_is_asked() != plain.model_copy(update={"topology": "nvlink"}).what_is_asked()


def test_a_retry_with_another_level_is_a_conflict_and_no_level_is_not_stored(
        tmp_path: Path) -> None:
    """An allocator before 0.3.0 refuses a stored request with a field it does not know:
    a request without a level is stored without the key."""
    engine = Engine(AllocatorSettings(ledger_path=tmp_path / "l.sqlite",
                                      allow_any_node_user=True), started_at=0.0)
    engine.load(LoadedState(nodes=[], gpus=[], leases=[], agent_users={}), 0.0)
    two = gpus("h", A100, 2)
    engine.handle(Heartbeat(host="h", agent_id="a", seq=1, sent_at=0.5, interval_s=2, gpus=two,
                            containers=[], containers_complete=True, source="simulated",
                            interconnect=preset_interconnect("hgx", [g.uuid for g in two])),
                  NODE, 0.5, Changes())
    first = engine.handle(AllocateRequest(request_key="first/", user="u", count=2), HUB, 0.6,
                          Changes())
    assert isinstance(first, LeaseReply) and first.lease.state is LeaseState.GRANTED
    queued = engine.handle(AllocateRequest(request_key="k/", user="u", count=2, wait_s=60),
                           HUB, 1.0, Changes())
    assert isinstance(queued, LeaseReply) and queued.lease.state is LeaseState.QUEUED
    assert "topology" not in engine.leases[queued.lease.lease_id].request
    again = engine.handle(AllocateRequest(request_key="k/", user="u", count=2, wait_s=60,
                                          topology="nvlink"), HUB, 1.1, Changes())
    assert isinstance(again, ErrorReply) and again.error.code is ErrorCode.CONFLICT
    level = engine.handle(AllocateRequest(request_key="l/", user="u", count=2, wait_s=60,
                                          topology="nvlink"), HUB, 1.2, Changes())
    assert isinstance(level, LeaseReply)
    assert engine.leases[level.lease.lease_id].request["topology"] == "nvlink"


def test_the_link_goes_only_to_a_reader_of_0_3_0() -> None:
    lease = Lease(lease_id="l", request_key="k", user="u", state=LeaseState.GRANTED,
                  created_at=1.0, link="nvlink")
    assert json.loads(encode(LeaseReply(lease=lease), release=(0, 3, 0)))["lease"]["link"] \
        == "nvlink"
    assert "link" not in json.loads(encode(LeaseReply(lease=lease), release=(0, 2, 0)))["lease"]


def test_no_level_leaves_the_field_off_the_wire() -> None:
    """A 0.1.0 allocator refuses a request with a field it does not know: a request that asks
    no level must read as one of 0.2.0."""
    plain = json.loads(encode(AllocateRequest(request_key="k", user="u", count=2)))
    assert "topology" not in plain
    asked = json.loads(encode(AllocateRequest(request_key="k", user="u", count=2,
                                              topology="socket")))
    assert asked["topology"] == "socket"
