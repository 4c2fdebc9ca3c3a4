"""The allocator over the real broker: every request kind, idempotency, queueing, release."""

from __future__ import annotations

import asyncio
import time

import pytest

from allocator.amqp.client import AllocatorClient, AllocatorError, StillQueued
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerAction,
    ContainerInfo,
    ErrorCode,
    LeaseState,
    ReleaseReason,
    ShareRequest,
)
from tests.support.common import A100, GTX1070, RTX3090, gpus, wait_until


async def cluster_ready(client: AllocatorClient, hosts: int) -> None:
    async def ready():
        inventory = await client.inventory()
        return sum(node.up for node in inventory.nodes) >= hosts
    await wait_until(ready)


@pytest.fixture
async def mixed(client, nodes):
    """gpu-a: 4x GTX 1070; gpu-b: 2x RTX 3090; gpu-c: 8x A100."""
    await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 4))
    await nodes.beat("gpu-b", gpus("gpu-b", RTX3090, 2))
    await nodes.beat("gpu-c", gpus("gpu-c", A100, 8))
    await cluster_ready(client, 3)
    return nodes


def ask(user: str = "alice", server: str = "", **fields) -> AllocateRequest:
    return AllocateRequest(request_key=f"hub/{user}/{server}", user=user, **fields)


async def test_allocate_by_alias_sets_visible_devices(client, mixed):
    lease = await client.allocate(ask(model="1070"))
    assert lease.state is LeaseState.GRANTED
    assert lease.host == "gpu-a"
    assert lease.model == GTX1070
    assert len(lease.gpu_uuids) == 1
    assert lease.env["NVIDIA_VISIBLE_DEVICES"] == lease.gpu_uuids[0]
    assert lease.env["SWARM_GPU_LEASE"] == lease.lease_id


async def test_retry_with_same_request_key_returns_same_lease(client, mixed):
    first = await client.allocate(ask(model="3090"))
    again = await client.allocate(ask(model="3090"))
    assert again.lease_id == first.lease_id
    inventory = await client.inventory(include_leases=True)
    assert [lease.lease_id for lease in inventory.leases] == [first.lease_id]


async def test_all_gpus_of_a_host(client, mixed):
    lease = await client.allocate(ask(model=A100, count="all"))
    assert lease.host == "gpu-c" and len(lease.gpu_uuids) == 8
    with pytest.raises(AllocatorError) as refused:
        await client.allocate(ask(user="bob", model=A100))
    assert refused.value.code is ErrorCode.NO_CAPACITY


async def test_unknown_model_lists_known_ones(client, mixed):
    with pytest.raises(AllocatorError) as refused:
        await client.allocate(ask(model="H100"))
    assert refused.value.code is ErrorCode.UNKNOWN_MODEL
    assert GTX1070 in refused.value.message and A100 in refused.value.message


async def test_count_beyond_any_host_is_unsatisfiable(client, mixed):
    with pytest.raises(AllocatorError) as refused:
        await client.allocate(ask(model="3090", count=3))
    assert refused.value.code is ErrorCode.UNSATISFIABLE


async def test_unknown_host(client, mixed):
    with pytest.raises(AllocatorError) as refused:
        await client.allocate(ask(host="gpu-z"))
    assert refused.value.code is ErrorCode.UNKNOWN_HOST
    assert "gpu-a" in refused.value.message


async def test_shared_slices_pack_and_respect_budget(client, mixed):
    leases = [await client.allocate(ask(user=f"u{i}", model="1070",
                                        share=ShareRequest(memory_mib=2048)))
              for i in range(4)]
    assert len({lease.gpu_uuids[0] for lease in leases}) == 1, "slices pack onto one GPU"
    assert all(lease.shared and lease.memory_mib == 2048 for lease in leases)
    assert leases[0].env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.25"
    fifth = await client.allocate(ask(user="u5", model="1070", share=ShareRequest(memory_mib=2048)))
    assert fifth.gpu_uuids[0] != leases[0].gpu_uuids[0]


async def test_share_of_exclusive_model_is_refused(client, mixed):
    with pytest.raises(AllocatorError) as refused:
        await client.allocate(ask(model="3090", share=ShareRequest(memory_mib=1024)))
    assert refused.value.code is ErrorCode.NOT_SHAREABLE


async def test_release_then_container_exit_frees_the_gpu(client, mixed):
    lease = await client.allocate(ask(model="3090", count=2))
    await mixed.event("gpu-b", lease.lease_id, ContainerAction.START, container_id="c1")
    bound = await wait_until(lambda: _state_is(client, lease.lease_id, LeaseState.BOUND))
    assert bound.container_id == "c1"
    stopping = await client.release(lease_id=lease.lease_id)
    assert stopping.state is LeaseState.RELEASING
    again = await client.release(lease_id=lease.lease_id)
    assert again.state is LeaseState.RELEASING, "releasing twice is a no-op"
    await mixed.event("gpu-b", lease.lease_id, ContainerAction.DIE, container_id="c1")
    done = await wait_until(lambda: _state_is(client, lease.lease_id, LeaseState.RELEASED))
    assert done.release_reason is ReleaseReason.CONTAINER_EXITED
    next_lease = await client.allocate(ask(user="bob", model="3090", count=2))
    assert next_lease.state is LeaseState.GRANTED


async def test_heartbeat_without_the_container_releases_it(client, mixed):
    lease = await client.allocate(ask(model="3090"))
    container = ContainerInfo(container_id="c2", lease_id=lease.lease_id)
    await mixed.beat("gpu-b", containers=[container], sent_at=time.time() - 10)
    await wait_until(lambda: _state_is(client, lease.lease_id, LeaseState.BOUND))
    await mixed.beat("gpu-b", containers=[])
    done = await wait_until(lambda: _state_is(client, lease.lease_id, LeaseState.RELEASED))
    assert done.release_reason is ReleaseReason.CONTAINER_GONE


async def test_queue_waits_in_order_and_reports_position(client, mixed):
    holder = await client.allocate(ask(model="3090", count=2))
    first = await client.allocate(ask(user="bob", model="3090", wait_s=30))
    second = await client.allocate(ask(user="carol", model="3090", wait_s=30))
    assert (first.state, first.queue_position) == (LeaseState.QUEUED, 1)
    assert (second.state, second.queue_position) == (LeaseState.QUEUED, 2)
    await client.release(lease_id=holder.lease_id, force=True)
    granted = await client.wait_for_grant("hub/bob/", wait_s=5)
    assert granted.state is LeaseState.GRANTED
    carol = await client.status(request_key="hub/carol/")
    assert carol.state is LeaseState.GRANTED, "the second 3090 went to the next in line"


async def test_a_wait_that_runs_out_first_on_the_callers_side_is_still_queued(client, mixed):
    await client.allocate(ask(model="3090", count=2))
    queued = await client.allocate(ask(user="bob", model="3090", wait_s=60))
    assert queued.state is LeaseState.QUEUED
    with pytest.raises(StillQueued) as raised:
        await client.wait_for_grant("hub/bob/", wait_s=0.2)
    assert raised.value.code is ErrorCode.TIMEOUT and raised.value.wait_s == 0.2
    assert (await client.status(request_key="hub/bob/")).state is LeaseState.QUEUED


async def test_queued_request_expires(client, mixed):
    await client.allocate(ask(model="3090", count=2))
    queued = await client.allocate(ask(user="bob", model="3090", wait_s=0.3))
    assert queued.state is LeaseState.QUEUED
    expired = await wait_until(lambda: _state_is(client, queued.lease_id, LeaseState.EXPIRED))
    assert expired.release_reason is ReleaseReason.WAIT_EXPIRED


async def test_status_of_unknown_lease_is_not_found(client, mixed):
    with pytest.raises(AllocatorError) as refused:
        await client.status(lease_id="nope")
    assert refused.value.code is ErrorCode.NOT_FOUND


async def test_status_of_a_lease_gone_from_memory_comes_from_the_ledger(
        client, mixed, allocator):
    lease = await client.allocate(ask(model="3090"))
    await client.release(lease_id=lease.lease_id)
    await mixed.beat("gpu-b", containers=[])  # no container: the release completes
    await wait_until(lambda: _state_is(client, lease.lease_id, LeaseState.RELEASED))
    allocator.engine.recent.clear()  # as if many leases had finished since
    by_id = await client.status(lease_id=lease.lease_id)
    by_key = await client.status(request_key=lease.request_key)
    assert by_id.lease_id == by_key.lease_id == lease.lease_id
    assert by_id.state is by_key.state is LeaseState.RELEASED


async def _state_is(client: AllocatorClient, lease_id: str, state: LeaseState):
    lease = await client.status(lease_id=lease_id)
    return lease if lease.state is state else None


async def test_request_key_of_another_user_is_a_conflict(client, mixed):
    await client.allocate(ask(user="alice", server="x", model="1070"))
    with pytest.raises(AllocatorError) as refused:
        await client.allocate(AllocateRequest(request_key="hub/alice/x", user="mallory"))
    assert refused.value.code is ErrorCode.CONFLICT


async def test_drain_keeps_new_leases_off_a_host_and_undrain_serves_the_queue(client, mixed):
    await client.drain("gpu-b", reason="driver upgrade")
    with pytest.raises(AllocatorError) as refused:
        await client.allocate(ask(model="3090"))
    assert refused.value.code is ErrorCode.NO_CAPACITY
    assert RTX3090 not in refused.value.details["free"], "a drained host's GPUs are not free"
    queued = await client.allocate(ask(user="bob", model="3090", wait_s=30))
    assert queued.state is LeaseState.QUEUED
    await client.drain("gpu-b", drained=False)
    granted = await client.status(lease_id=queued.lease_id)
    assert granted.state is LeaseState.GRANTED and granted.host == "gpu-b"


async def test_draining_one_gpu(client, mixed):
    inventory = await client.inventory()
    first = next(g for g in inventory.gpus if g.host == "gpu-b" and g.index == 0)
    await client.drain("gpu-b", gpu_uuid=first.uuid)
    lease = await client.allocate(ask(model="3090", count=1))
    assert lease.gpu_uuids != [first.uuid]
    with pytest.raises(AllocatorError) as refused:
        await client.allocate(ask(user="bob", model="3090", count=2))
    assert refused.value.code is ErrorCode.NO_CAPACITY


async def test_unknown_host_or_gpu_in_drain(client, mixed):
    with pytest.raises(AllocatorError) as refused:
        await client.drain("gpu-z")
    assert refused.value.code is ErrorCode.UNKNOWN_HOST
    with pytest.raises(AllocatorError) as refused:
        await client.drain("gpu-a", gpu_uuid="GPU-nope")
    assert refused.value.code is ErrorCode.NOT_FOUND


@pytest.fixture
async def strict_allocator(amqp_vhost, ledger_path):
    """An allocator with quotas, where guest is not an admin."""
    from allocator.config import AllocatorSettings
    from allocator.service import AllocatorService

    settings = AllocatorSettings(
        amqp_url=amqp_vhost.url, ledger_path=ledger_path, allow_any_node_user=True,
        admin_users=["admin"], share_slots={GTX1070: 4}, user_quota={"alice": 2},
        default_user_quota=1, group_quota={"students": 2},
    )
    async with AllocatorService(settings) as service:
        yield service


@pytest.fixture
async def strict(strict_allocator, amqp_vhost, nodes):
    await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 4))
    await nodes.beat("gpu-c", gpus("gpu-c", A100, 8))
    async with AllocatorClient(amqp_vhost.url) as rpc:
        await cluster_ready(rpc, 2)
        yield rpc


async def test_user_quota(strict):
    await strict.allocate(ask(user="alice", server="1", model=A100))
    await strict.allocate(ask(user="alice", server="2", model=A100))
    with pytest.raises(AllocatorError) as refused:
        await strict.allocate(ask(user="alice", server="3", model=A100))
    assert refused.value.code is ErrorCode.QUOTA_EXCEEDED
    assert "alice" in refused.value.message and "2" in refused.value.message
    with pytest.raises(AllocatorError):  # the default quota of 1 for everyone else
        await strict.allocate(ask(user="bob", server="1", model=A100, count=2))


async def test_a_slice_counts_its_share_of_the_quota(strict):
    for server in "1234":  # four slices of a 4-slot GPU = one GPU: bob's default quota
        await strict.allocate(ask(user="bob", server=server, model=GTX1070,
                                  share=ShareRequest(memory_mib=1024)))
    with pytest.raises(AllocatorError) as refused:
        await strict.allocate(ask(user="bob", server="5", model=GTX1070,
                                  share=ShareRequest(memory_mib=1024)))
    assert refused.value.code is ErrorCode.QUOTA_EXCEEDED


async def test_group_quota(strict):
    await strict.allocate(ask(user="s1", groups=["students"], model=A100))
    await strict.allocate(ask(user="s2", groups=["students"], model=A100))
    with pytest.raises(AllocatorError) as refused:
        await strict.allocate(ask(user="s3", groups=["students"], model=A100))
    assert refused.value.code is ErrorCode.QUOTA_EXCEEDED
    assert "students" in refused.value.message


async def test_admin_actions_need_an_admin(strict):
    lease = await strict.allocate(ask(user="carol", model=A100))
    with pytest.raises(AllocatorError) as refused:
        await strict.release(lease_id=lease.lease_id, force=True)
    assert refused.value.code is ErrorCode.FORBIDDEN
    with pytest.raises(AllocatorError) as refused:
        await strict.drain("gpu-a")
    assert refused.value.code is ErrorCode.FORBIDDEN
    assert (await strict.status(lease_id=lease.lease_id)).state is LeaseState.GRANTED


async def test_a_node_with_a_skewed_clock_stays_up_and_is_reported(client, mixed, allocator):
    # Liveness is judged by when the allocator received the heartbeat, not the node's stamp.
    await mixed.beat("gpu-a", sent_at=time.time() + 3600)
    await mixed.beat("gpu-b", sent_at=time.time() - 3600)

    async def counted():
        return allocator.engine.counters["heartbeat_clock_skew"] >= 2
    await wait_until(counted)
    inventory = await client.inventory()
    assert all(node.up for node in inventory.nodes)
    lease = await client.allocate(ask(model="1070"))
    assert lease.host == "gpu-a"


async def test_a_standby_neither_writes_nor_reloads_while_the_active_one_works(
        allocator, client, mixed, amqp_vhost):
    from allocator.service import AllocatorService

    settings = allocator.settings.model_copy(update={"standby_after_s": 0.5})
    async with AllocatorService(settings) as standby:
        for i in range(4):
            await client.allocate(ask(user=f"s{i}", model="1070"))
            await mixed.beat("gpu-a")
            await asyncio.sleep(0.3)
        assert await standby.is_standby()
        assert standby.stats.counters["takeovers"] == 0, "a standby does not reload"
        assert standby.stats.counters["received"] == 0
        assert allocator.stats.counters["takeovers"] == 0, "nor does it write under the active"


@pytest.mark.parametrize(("mode", "pragma"), [("full", 2), ("normal", 1)])
def test_ledger_synchronous_setting(tmp_path, mode, pragma):
    from allocator.ledger.store import Ledger

    ledger = Ledger(tmp_path / "ledger.sqlite", synchronous=mode)
    ledger.open()
    try:
        assert ledger.call(lambda: ledger.db.execute("PRAGMA synchronous").fetchone()[0]) == pragma
        assert ledger.call(lambda: ledger.db.execute("PRAGMA journal_mode").fetchone()[0]) == "wal"
    finally:
        ledger.close()


async def test_another_request_under_a_used_request_key_is_a_conflict(allocator, client, nodes):
    """A retry is the same request; a different one under a key in use is a client bug, and
    the answer names the lease that holds the key instead of quietly returning it."""
    await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 2))
    await nodes.beat("gpu-b", gpus("gpu-b", RTX3090, 1))

    async def both():
        return len((await client.inventory()).nodes) == 2
    await wait_until(both)
    first = await client.allocate(AllocateRequest(request_key="hub/alice/", user="alice",
                                                  model="1070", wait_s=5))
    retry = await client.allocate(AllocateRequest(request_key="hub/alice/", user="alice",
                                                  model="1070", wait_s=60, priority=3))
    assert retry.lease_id == first.lease_id
    with pytest.raises(AllocatorError) as refused:
        await client.allocate(AllocateRequest(request_key="hub/alice/", user="alice",
                                              model="3090"))
    assert refused.value.code is ErrorCode.CONFLICT
    assert first.lease_id in str(refused.value)
    assert refused.value.details["lease_id"] == first.lease_id
    assert refused.value.details["differs"] == ["model"]
    leases = (await client.inventory(include_leases=True)).leases
    assert [lease.lease_id for lease in leases] == [first.lease_id]


async def test_quota_request_shows_limits_and_what_is_held(amqp_vhost, ledger_path):
    """A form can say "you hold 1.25 of 2" before the allocator refuses quota_exceeded."""
    from tests.support.common import NodeSimulator
    from tests.support.faults import running_allocator

    async with (running_allocator(amqp_vhost.url, ledger_path, user_quota={"alice": 2},
                                  group_quota={"students": 4, "staff": 10},
                                  share_slots={GTX1070: 4}),
                AllocatorClient(amqp_vhost.url, timeout_s=10) as client,
                NodeSimulator(amqp_vhost.url) as nodes):
        await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 4))

        async def up():
            return (await client.inventory()).nodes
        await wait_until(up)
        empty = await client.quota("alice", ["students", "nobody-limits-this"])
        assert [(q.scope, q.name, q.limit, q.held, q.free) for q in empty.quotas] == [
            ("user", "alice", 2.0, 0.0, 2.0), ("group", "students", 4.0, 0.0, 4.0)]
        await client.allocate(AllocateRequest(request_key="h/alice/1", user="alice",
                                              groups=["students"]))
        await client.allocate(AllocateRequest(request_key="h/alice/2", user="alice",
                                              groups=["students"], share=ShareRequest()))
        await client.allocate(AllocateRequest(request_key="h/bob/", user="bob",
                                              groups=["students"]))
        alice = await client.quota("alice", ["students"])
        assert alice.user == "alice"
        assert [(q.scope, q.name, q.limit, q.held, q.free) for q in alice.quotas] == [
            ("user", "alice", 2.0, 1.25, 0.75), ("group", "students", 4.0, 2.25, 1.75)]
        bob = await client.quota("bob")
        assert [(q.scope, q.limit, q.held, q.free) for q in bob.quotas] == [
            ("user", None, 1.0, None)]
        with pytest.raises(AllocatorError) as refused:
            await client.allocate(AllocateRequest(request_key="h/alice/3", user="alice"))
        assert refused.value.code is ErrorCode.QUOTA_EXCEEDED
        assert refused.value.details["held"] == alice.quotas[0].held


async def test_a_lease_released_unbound_on_a_node_without_container_listing_comes_free(
        amqp_vhost, ledger_path):
    """A node without Docker never sends a complete container list, so no heartbeat can say
    the released lease's container is gone: it ends stop_grace_s after the release
    (``stopped``), while the node keeps heartbeating; a node that lists containers frees its
    own at once."""
    from tests.support.common import NodeSimulator
    from tests.support.faults import await_state, running_allocator

    # No start fence: this node's listings are never complete, so the fence would hold it
    # for start_fence_s (test_engine_node_truth.py tests that).
    async with (running_allocator(amqp_vhost.url, ledger_path, stop_grace_s=1.0,
                                  node_down_after_s=60, start_fence_s=0),
                AllocatorClient(amqp_vhost.url, timeout_s=10) as client,
                NodeSimulator(amqp_vhost.url) as nodes):
        await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 1), containers_complete=False)
        await cluster_ready(client, 1)
        lease = await client.allocate(AllocateRequest(request_key="h/alice/", user="alice"))
        releasing = await client.release(lease_id=lease.lease_id)
        assert releasing.state is LeaseState.RELEASING

        async def beating() -> None:
            while True:
                await nodes.beat("gpu-a", containers_complete=False)
                await asyncio.sleep(0.2)
        heartbeats = asyncio.create_task(beating())
        try:
            done, waited = await await_state(client, lease.lease_id, LeaseState.RELEASED)
        finally:
            heartbeats.cancel()
        assert done.release_reason is ReleaseReason.STOPPED
        assert waited >= 0.5  # not at once: the grace comes first
        assert (await client.inventory()).models[0].free == 1
