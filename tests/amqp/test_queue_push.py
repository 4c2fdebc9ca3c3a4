"""A queued request's outcome is pushed to the waiting client, over the real broker.

No polling: the allocator publishes the grant (or the end of the wait) to the reply address
of the request's ``queued`` answer once the decision is committed. Status calls are counted
on the allocator's side (its request histogram), never by the test's own client.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from allocator.amqp.broker import broker_user
from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.config import AllocatorSettings
from allocator.metrics.counters import Count
from allocator.service import AllocatorService
from allocator.service.waiters import ADDRESSES_PER_LEASE, ReplyAddress, Waiters
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerAction,
    ErrorCode,
    Lease,
    LeaseState,
    ReleaseReason,
)
from tests.support.common import RTX3090, RawRPC, gpus, wait_until

NO_RECHECK_S = 600.0
"""A re-check interval no test outlasts: an answer that arrives came by push."""


@pytest.fixture
async def two_gpus(client, nodes):
    """gpu-b with 2x RTX 3090, both held by alice; returns alice's lease."""
    await nodes.beat("gpu-b", gpus("gpu-b", RTX3090, 2))

    async def up() -> bool:
        return any(node.up for node in (await client.inventory()).nodes)
    await wait_until(up)
    holder = await client.allocate(ask("alice", count=2))
    assert holder.state is LeaseState.GRANTED
    return holder


def ask(user: str, **fields) -> AllocateRequest:
    return AllocateRequest(request_key=f"hub/{user}/", user=user, model=RTX3090, **fields)


def status_calls(service: AllocatorService) -> float:
    """Status requests this allocator applied (from its own request histogram)."""
    value = service.metrics.registry.get_sample_value(
        "swarm_gpu_request_seconds_count", {"kind": "status"})
    return value or 0.0


class Queued:
    """Collects the queued answers of a wait and says when the first came."""

    def __init__(self) -> None:
        self.leases: list[Lease] = []
        self.seen = asyncio.Event()

    def __call__(self, lease: Lease) -> None:
        self.leases.append(lease)
        self.seen.set()


async def test_the_grant_is_pushed_when_a_release_frees_the_gpu(client, two_gpus, allocator,
                                                                nodes):
    queued = Queued()
    waiting = asyncio.create_task(client.allocate_and_wait(
        ask("bob", wait_s=60), recheck_s=NO_RECHECK_S, on_queued=queued))
    await asyncio.wait_for(queued.seen.wait(), 10)
    assert queued.leases[0].queue_position == 1
    # Alice's server runs, then the hub stops it: releasing, and her container's die event
    # frees the GPUs.
    await nodes.event("gpu-b", two_gpus.lease_id, ContainerAction.START, container_id="c-alice")

    async def bound() -> bool:
        return (await client.inventory(include_leases=True)).leases[0].state is LeaseState.BOUND
    await wait_until(bound)
    await client.release(lease_id=two_gpus.lease_id)
    await nodes.event("gpu-b", two_gpus.lease_id, ContainerAction.DIE, container_id="c-alice")
    granted = await asyncio.wait_for(waiting, 30)
    assert granted.state is LeaseState.GRANTED
    assert granted.lease_id == queued.leases[0].lease_id
    assert status_calls(allocator) == 0, "the grant came without a status call"
    assert allocator.stats.counters[Count.PUSHES] == 1


async def test_the_end_of_a_wait_is_pushed(client, two_gpus, allocator):
    with pytest.raises(AllocatorError) as ended:
        await asyncio.wait_for(client.allocate_and_wait(
            ask("bob", wait_s=0.5), recheck_s=NO_RECHECK_S), 30)
    assert ended.value.code is ErrorCode.NO_CAPACITY
    assert ended.value.details["lease"]["state"] == LeaseState.EXPIRED.value
    assert status_calls(allocator) == 0


async def test_a_withdrawn_wait_is_pushed(client, two_gpus, allocator, amqp_vhost):
    queued = Queued()
    async with AllocatorClient(amqp_vhost.url, timeout_s=10) as hub:
        waiting = asyncio.create_task(hub.allocate_and_wait(
            ask("bob", wait_s=60), recheck_s=NO_RECHECK_S, on_queued=queued))
        await asyncio.wait_for(queued.seen.wait(), 10)
        await client.release(request_key="hub/bob/")  # the user cancelled the spawn
        with pytest.raises(AllocatorError) as ended:
            await asyncio.wait_for(waiting, 30)
    assert ended.value.details["lease"]["release_reason"] == ReleaseReason.CANCELLED.value
    assert status_calls(allocator) == 0


async def test_wire_every_answer_of_a_wait_carries_its_correlation_id(two_gpus, amqp_vhost,
                                                                     client):
    """What a client in another language sees: the queued reply, then the grant, both on the
    request's own correlation id and reply address."""
    async with RawRPC(amqp_vhost.url) as raw:
        body = ask("bob", wait_s=60).model_dump(mode="json", exclude_none=True)
        await raw.send(json.dumps(body).encode())
        first = await raw.reply_message()
        assert json.loads(first.body)["lease"]["state"] == "queued"
        await client.release(lease_id=two_gpus.lease_id, force=True)
        second = await raw.reply_message()
        pushed = json.loads(second.body)
        assert (pushed["kind"], pushed["lease"]["state"]) == ("lease", "granted")
        assert second.correlation_id == first.correlation_id == raw.last_correlation_id


async def test_another_callers_status_does_not_take_the_push_away(client, two_gpus, allocator,
                                                                   amqp_vhost):
    queued = Queued()
    async with AllocatorClient(amqp_vhost.url, timeout_s=10) as hub, \
            RawRPC(amqp_vhost.url) as admin:
        waiting = asyncio.create_task(hub.allocate_and_wait(
            ask("bob", wait_s=60), recheck_s=NO_RECHECK_S, on_queued=queued))
        await asyncio.wait_for(queued.seen.wait(), 10)
        # Its own broker user, as every caller sends (the allocator's admin here): a status
        # without one would be refused another's lease.
        await admin.send(json.dumps({"v": 1, "kind": "status",
                                     "request_key": "hub/bob/"}).encode(),
                         user_id=broker_user(amqp_vhost.url))
        assert json.loads((await admin.reply_message()).body)["lease"]["state"] == "queued"
        await client.release(lease_id=two_gpus.lease_id, force=True)
        granted = await asyncio.wait_for(waiting, 30)
        assert granted.state is LeaseState.GRANTED
        # Both callers were told: the hub on its allocate, the admin on its status.
        pushed = json.loads((await admin.reply_message()).body)["lease"]
        assert (pushed["state"], pushed["lease_id"]) == ("granted", granted.lease_id)
    assert status_calls(allocator) == 1, "the admin's status alone"
    assert allocator.stats.counters[Count.PUSHES] == 2


async def test_a_push_to_a_client_that_went_away_is_harmless(client, two_gpus, allocator,
                                                             amqp_vhost):
    async with RawRPC(amqp_vhost.url) as gone:  # a hub that goes away while it waits
        body = ask("bob", wait_s=60).model_dump(mode="json", exclude_none=True)
        await gone.send(json.dumps(body).encode())
        queued = json.loads((await gone.reply_message()).body)["lease"]
        assert queued["state"] == "queued"
    await client.release(lease_id=two_gpus.lease_id, force=True)

    async def pushed() -> bool:
        counters = allocator.stats.counters
        return counters[Count.PUSHES] + counters[Count.PUSH_FAILURES] >= 1
    await wait_until(pushed, within=30)
    # The allocator serves on, and the retry with the same key gets the grant.
    async with AllocatorClient(amqp_vhost.url, timeout_s=10) as back:
        retried = await back.allocate_and_wait(ask("bob", wait_s=60), recheck_s=NO_RECHECK_S)
    assert retried.state is LeaseState.GRANTED
    assert retried.lease_id == queued["lease_id"]
    assert allocator.engine.counters[Count.ALLOCATE_RETRY] >= 1


async def test_an_allocator_restart_during_the_wait(client, two_gpus, allocator, amqp_vhost,
                                                    ledger_path):
    """The new allocator does not know where to push; the client's one status call after
    ``recheck_s`` without news finds the grant (and tells it where to push)."""
    queued = Queued()
    async with AllocatorClient(amqp_vhost.url, timeout_s=10) as hub:
        waiting = asyncio.create_task(hub.allocate_and_wait(
            ask("bob", wait_s=120), recheck_s=1.0, on_queued=queued))
        await asyncio.wait_for(queued.seen.wait(), 10)
        await allocator.stop()
        settings: AllocatorSettings = allocator.settings
        restarted = AllocatorService(settings)
        await restarted.start()
        try:
            await client.release(lease_id=two_gpus.lease_id, force=True)
            granted = await asyncio.wait_for(waiting, 60)
            assert granted.state is LeaseState.GRANTED
            assert granted.lease_id == queued.leases[0].lease_id
            assert status_calls(restarted) >= 1, "found by the client's re-check"
        finally:
            await restarted.stop()


def test_a_queued_lease_keeps_its_newest_addresses_only():
    waiters = Waiters()
    for n in range(ADDRESSES_PER_LEASE + 2):
        waiters.remember("lease-1", ReplyAddress("amq.rabbitmq.reply-to.x", f"c{n}"))
    waiters.remember("lease-1", ReplyAddress("amq.rabbitmq.reply-to.x", "c3"))  # again: newest
    waiters.remember("lease-2", ReplyAddress("amq.rabbitmq.reply-to.y", "d0"))
    taken = waiters.take(["lease-1", "lease-3"])
    assert [address.correlation_id for _, address in taken] == ["c2", "c4", "c5", "c3"]
    assert {lease for lease, _ in taken} == {"lease-1"}
    assert "lease-1" not in waiters and "lease-2" in waiters and len(waiters) == 1
