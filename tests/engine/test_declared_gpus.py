"""What the site declares a node has (``declared_gpus``) bounds what its agent can draw
placements to: GPUs a host reports beyond the declaration are a conflict, shown and not
placed. The rule alone (pure), the engine with time passed in, then a real allocator
through the real broker."""

from __future__ import annotations

from pathlib import Path

import pytest

from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.config import AllocatorSettings
from allocator.engine import Engine
from allocator.ledger.changes import Changes
from allocator.ledger.store import Ledger
from allocator.metrics.counters import Count
from allocator.placement.cluster import GPU
from allocator.placement.declared import beyond_declared
from allocator.service import AllocatorService
from allocator.wire.protocol import (
    AllocateRequest,
    ErrorCode,
    ErrorReply,
    InventoryReply,
    InventoryRequest,
    LeaseReply,
)
from tests.support import services
from tests.support.common import (
    A100,
    GTX1070,
    HUB,
    NODE,
    NodeSimulator,
    gpus,
    heartbeat,
    started,
    wait_until,
)


def gpu(uuid: str, index: int, model: str = GTX1070, parent: str | None = None) -> GPU:
    return GPU(uuid=uuid, host="a", index=index, model=model, memory_total_mib=8192,
               mig_parent_uuid=parent)


def test_the_first_gpus_of_each_declared_model_are_placed_the_rest_are_beyond() -> None:
    listed = [gpu("g0", 0), gpu("g1", 1), gpu("g2", 2, A100), gpu("g3", 3),
              gpu("g3-mig", 3, "1g.5gb", parent="g3")]
    beyond = beyond_declared("a", listed, {"1070": 2}, {"1070": GTX1070})
    assert set(beyond) == {"g2", "g3", "g3-mig"}, "an alias counts; undeclared models too"
    assert "declares 0" in beyond["g2"] and "3rd" in beyond["g3"]
    assert beyond["g3-mig"] == beyond["g3"], "an instance follows its GPU"
    assert beyond_declared("a", listed, {GTX1070: 3, A100: 1}, {}) == {}


def engine_of(tmp_path: Path) -> Engine:
    return Engine(AllocatorSettings(
        ledger_path=tmp_path / "ledger.sqlite", allow_any_node_user=True, start_fence_s=0.0,
        declared_gpus={"a": {GTX1070: 2}}), started_at=0.0)


def test_gpus_beyond_the_declaration_are_conflicts_not_placement_targets(
        tmp_path: Path) -> None:
    """Host a is declared with two GTX 1070; its agent reports six GPUs (four GTX 1070, two
    A100 that do not exist). Only the first two 1070 are placed; the others show their
    conflict in the inventory, once as an event each; a host not declared is as reported."""
    engine = engine_of(tmp_path)
    reported = gpus("a", GTX1070, 4) + gpus("a", A100, 2, start_index=4)
    changes = Changes()
    engine.handle(heartbeat("a", reported, sent_at=1.0), NODE, 1.0, changes)
    engine.handle(heartbeat("b", gpus("b", A100, 1), sent_at=1.0), NODE, 1.0, changes)
    inventory = engine.handle(InventoryRequest(), HUB, 1.5, changes)
    assert isinstance(inventory, InventoryReply)
    conflicts = {g.uuid: g.conflict for g in inventory.gpus if g.conflict}
    assert set(conflicts) == {g.uuid for g in reported[2:]}
    assert "declared_gpus" in conflicts[reported[2].uuid]
    assert [e["gpu_uuid"] for e in changes.events if e["kind"] == "undeclared_gpu"] == [
        g.uuid for g in reported[2:]]
    assert engine.counters[Count.UNDECLARED_GPU] == 4
    two = engine.handle(AllocateRequest(request_key="hub/x/", user="x", model=GTX1070,
                                        count=2), HUB, 2.0, changes)
    assert isinstance(two, LeaseReply) and set(two.lease.gpu_uuids) == {
        reported[0].uuid, reported[1].uuid}
    more = engine.handle(AllocateRequest(request_key="hub/y/", user="y", model=GTX1070),
                         HUB, 2.0, changes)
    assert isinstance(more, ErrorReply) and more.error.code is ErrorCode.NO_CAPACITY
    a100 = engine.handle(AllocateRequest(request_key="hub/z/", user="z", model=A100,
                                         count=2), HUB, 2.0, changes)
    assert isinstance(a100, ErrorReply), "a's A100s do not exist; b has one"
    capacity = engine.bookings.capacity(2.0)
    assert (capacity.on(GTX1070), capacity.on(A100)) == (2, 1), "bookings count none"
    # The next reports change nothing and write nothing more.
    again = Changes()
    engine.handle(heartbeat("a", reported, sent_at=3.0), NODE, 3.0, again)
    assert not [e for e in again.events if e["kind"] == "undeclared_gpu"]
    assert engine.counters[Count.UNDECLARED_GPU] == 4


def test_a_reload_judges_the_declaration_before_anything_is_placed(tmp_path: Path) -> None:
    """After a rebuild from the ledger (GPUs without their marks), the declaration holds at
    once, not only from the host's next report."""
    engine = engine_of(tmp_path)
    reported = gpus("a", GTX1070, 3)
    changes = Changes()
    engine.handle(heartbeat("a", reported, sent_at=1.0), NODE, 1.0, changes)
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open()
    try:
        ledger.call(lambda: ledger.commit(changes))
        engine.load(ledger.call(ledger.load), 2.0)
    finally:
        ledger.close()
    assert engine.cluster.gpus[reported[2].uuid].undeclared is not None
    three = engine.handle(AllocateRequest(request_key="hub/x/", user="x", model=GTX1070,
                                          count=3), HUB, 2.5, Changes())
    assert isinstance(three, ErrorReply)


async def test_through_the_real_broker_a_host_is_placed_as_declared(
        amqp_vhost: services.AmqpVhost, ledger_path: Path, nodes: NodeSimulator) -> None:
    """A real allocator declaring one GTX 1070 for gpu-a; gpu-a's agent reports two. The
    hub's inventory shows the second as a conflict, and two GPUs are not granted there."""
    settings = AllocatorSettings(
        amqp_url=amqp_vhost.url, ledger_path=ledger_path, allow_any_node_user=True,
        tick_s=0.1, start_fence_s=0, aliases={"1070": GTX1070},
        declared_gpus={"gpu-a": {"1070": 1}})
    reported = gpus("gpu-a", GTX1070, 2)
    async with started(AllocatorService(settings)), \
            AllocatorClient(amqp_vhost.url, timeout_s=10) as client:
        await nodes.beat("gpu-a", reported)

        async def listed() -> bool:
            return len((await client.inventory()).gpus) == 2
        await wait_until(listed)
        inventory = await client.inventory()
        assert [g.conflict is not None for g in inventory.gpus] == [False, True]
        with pytest.raises(AllocatorError) as refused:
            await client.allocate(AllocateRequest(request_key="hub/a/", user="a",
                                                  model="1070", count=2))
        assert refused.value.code in (ErrorCode.NO_CAPACITY, ErrorCode.UNSATISFIABLE)
        one = await client.allocate(AllocateRequest(request_key="hub/b/", user="b",
                                                    model="1070"))
        assert one.gpu_uuids == [reported[0].uuid]
