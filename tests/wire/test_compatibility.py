"""The compatibility rule of docs/protocol.md ("Compatibility"), on the real broker.

Readers ignore fields they do not know (replies, node messages, requests) and check the ones
they know as strictly as ever; a client that still cannot read the answer to its allocate
gives back what the allocator may have granted it; an allocator that cannot read a heartbeat
still takes it as a sign of life from the host's own broker user.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import aio_pika
import aio_pika.abc
import pytest

from allocator.amqp.client import AllocatorClient, UnreadableReply
from allocator.wire.interconnect import HostGpu, HostInterconnect
from allocator.wire.protocol import (
    CLIENT_RELEASE_HEADER,
    REPLY_ADAPTER,
    AllocateRequest,
    ErrorReply,
    Heartbeat,
    LeaseReply,
    LeaseState,
    decode_inbound,
    encode,
    release_tuple,
)
from allocator.wire.topology import (
    DIRECT_REPLY_TO,
    NODES_EXCHANGE,
    RPC_EXCHANGE,
    RPC_ROUTING_KEY,
    heartbeat_routing_key,
)
from tests.support.common import GTX1070, NodeSimulator, gpus, heartbeat
from tests.support.faults import running_allocator
from tests.support.raw_client import RawClient


def _with_new_fields(body: bytes) -> bytes:
    """``body`` with a field no reader knows added at the top and in every nested object."""
    # Objects that are maps of the message's own (env, hosts, details), not its fields.
    maps = {"env", "hosts", "details"}

    def grow(value: object) -> object:
        if isinstance(value, dict):
            return {**{k: v if k in maps else grow(v) for k, v in value.items()},
                    "added_in_v9": {"x": [1]}}
        if isinstance(value, list):
            return [grow(item) for item in value]
        return value
    return json.dumps(grow(json.loads(body))).encode()


def test_readers_ignore_unknown_fields_and_check_known_ones() -> None:
    beat = heartbeat("gpu-a", gpus("gpu-a", GTX1070, 2))
    read = decode_inbound(_with_new_fields(encode(beat)))
    assert read == beat
    request = AllocateRequest(request_key="k/a/", user="alice", model="1070")
    assert decode_inbound(_with_new_fields(encode(request))) == request
    # Known fields stay strict: a string for a number is still refused.
    wrong = json.loads(encode(request))
    wrong["count"] = "1"
    refused = decode_inbound(json.dumps(wrong).encode())
    assert isinstance(refused, ErrorReply) and refused.error.code == "bad_request"
    # Python code still may not build a message with a field that does not exist.
    with pytest.raises(ValueError, match="added_in_v9"):
        Heartbeat(**{**beat.model_dump(), "added_in_v9": 1})


class _NewerAllocator:
    """Stands between a client and the real allocator as an allocator of a newer protocol
    would look to it: each request is passed on and the real answer comes back, except that
    answers to ``allocate`` come back in a form this client cannot read (a lease state it
    does not know). What the real allocator did, it did."""

    ROUTING_KEY = "newer-allocator"

    def __init__(self, amqp_url: str) -> None:
        self.amqp_url = amqp_url
        self.kinds: list[str] = []
        self._connection: aio_pika.abc.AbstractRobustConnection | None = None

    async def __aenter__(self) -> _NewerAllocator:
        self._connection = await aio_pika.connect_robust(self.amqp_url, timeout=10)
        channel = await self._connection.channel()
        exchange = await channel.get_exchange(RPC_EXCHANGE, ensure=False)
        inbox = await channel.declare_queue("", exclusive=True)
        await inbox.bind(exchange, routing_key=self.ROUTING_KEY)
        answers: dict[str, tuple[aio_pika.abc.AbstractIncomingMessage, str]] = {}

        async def on_answer(answer: aio_pika.abc.AbstractIncomingMessage) -> None:
            asked = answers.pop(answer.correlation_id or "", None)
            if asked is None:
                return
            caller, kind = asked
            body = answer.body
            if kind == "allocate":
                data = json.loads(body)
                data["lease"]["state"] = "granted_elsewhere"
                body = json.dumps(data).encode()
            await channel.default_exchange.publish(
                aio_pika.Message(body, correlation_id=caller.correlation_id,
                                 content_type="application/json"),
                routing_key=caller.reply_to or "")

        replies = await channel.get_queue(DIRECT_REPLY_TO, ensure=False)
        await replies.consume(on_answer, no_ack=True)

        async def on_request(request: aio_pika.abc.AbstractIncomingMessage) -> None:
            async with request.process():
                kind = json.loads(request.body).get("kind", "")
                self.kinds.append(kind)
                answers[request.correlation_id or ""] = (request, kind)
                await exchange.publish(
                    aio_pika.Message(request.body, correlation_id=request.correlation_id,
                                     reply_to=DIRECT_REPLY_TO, content_type="application/json",
                                     user_id=request.user_id),
                    routing_key=RPC_ROUTING_KEY)

        await inbox.consume(on_request)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._connection is not None:
            await self._connection.close()


async def test_a_client_that_cannot_read_its_grant_gives_it_back(amqp_vhost,
                                                                 tmp_path: Path) -> None:
    async with running_allocator(amqp_vhost.url, tmp_path / "ledger.sqlite",
                                 start_fence_s=0) as allocator, \
            NodeSimulator(amqp_vhost.url) as nodes, _NewerAllocator(amqp_vhost.url) as newer:
        await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 1))
        async with AllocatorClient(amqp_vhost.url, timeout_s=10) as plain, \
                AllocatorClient(amqp_vhost.url, timeout_s=10,
                                routing_key=_NewerAllocator.ROUTING_KEY) as old:
            async def placeable() -> bool:
                return (await plain.inventory()).models[0].free == 1
            deadline = time.monotonic() + 10
            while not await placeable():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            with pytest.raises(UnreadableReply) as caught:
                await old.allocate(AllocateRequest(request_key="hub/alice/", user="alice"))
            message = str(caught.value)
            assert "\n" not in message, "one line"
            assert "hub/alice/" in message and "released it" in message
            assert "lease.state" in message and "compatibility" in message
            # The real allocator had granted it; the client's release by request key reached it.
            assert newer.kinds == ["allocate", "release"]
            lease = await plain.status(request_key="hub/alice/")
            assert lease.state in (LeaseState.RELEASING, LeaseState.RELEASED)
            # Releasing until the node's next listing shows no container of it: then free.
            await nodes.beat("gpu-a")
            deadline = time.monotonic() + 10
            while not await placeable():
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            lease = await plain.status(request_key="hub/alice/")
            assert lease.state is LeaseState.RELEASED
            assert allocator.engine.counters["granted"] == 1


async def test_a_reply_with_fields_this_client_does_not_know_is_read(amqp_vhost,
                                                                    tmp_path: Path) -> None:
    async with running_allocator(amqp_vhost.url, tmp_path / "ledger.sqlite",
                                 start_fence_s=0), NodeSimulator(amqp_vhost.url) as nodes, \
            AllocatorClient(amqp_vhost.url, timeout_s=10) as client:
        await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 1))
        inventory = await client.inventory(include_leases=True)
        grown = REPLY_ADAPTER.validate_json(
            _with_new_fields(encode(inventory)), extra="ignore")
        assert grown == inventory
        lease = (await client.allocate(AllocateRequest(request_key="k/b/", user="bob")))
        reply = LeaseReply(lease=lease)
        assert REPLY_ADAPTER.validate_json(_with_new_fields(encode(reply)),
                                           extra="ignore") == reply


async def test_an_unreadable_heartbeat_keeps_its_host_up_and_is_counted(amqp_vhost,
                                                                       tmp_path: Path) -> None:
    async with running_allocator(amqp_vhost.url, tmp_path / "ledger.sqlite", start_fence_s=0,
                                 node_down_after_s=1.5) as allocator, \
            NodeSimulator(amqp_vhost.url) as nodes, \
            AllocatorClient(amqp_vhost.url, timeout_s=10) as client, \
            await aio_pika.connect(amqp_vhost.url) as connection:
        await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 1))
        await nodes.beat("gpu-b", gpus("gpu-b", GTX1070, 1))
        channel = await connection.channel()
        exchange = await channel.get_exchange(NODES_EXCHANGE, ensure=False)
        for _ in range(16):  # 4 s: well past node_down_after_s
            # A heartbeat of a newer agent whose known field this allocator cannot read.
            body = json.loads(encode(heartbeat("gpu-a", gpus("gpu-a", GTX1070, 1))))
            body["gpus"][0]["health"] = "degraded"
            await exchange.publish(aio_pika.Message(json.dumps(body).encode(),
                                                    user_id="guest"),
                                   routing_key=heartbeat_routing_key("gpu-a"))
            await asyncio.sleep(0.25)
        inventory = await client.inventory()
        up = {node.host: node.up for node in inventory.nodes}
        assert up == {"gpu-a": True, "gpu-b": False}
        assert allocator.engine.counters["heartbeats_unreadable"] >= 12
        assert allocator.stats.counters["invalid_bad_request"] >= 12
        assert allocator.stats.counters["dead_lettered"] >= 12  # refused all the same
        # Nothing it says is believed: its GPU's health is as the last readable report said.
        assert [gpu.health for gpu in inventory.gpus if gpu.host == "gpu-a"] == ["healthy"]


async def test_replies_carry_the_fields_of_the_release_the_client_reads(amqp_vhost,
                                                                       tmp_path: Path) -> None:
    """A request without the swarm-gpu-release header (a 0.1.0 client) gets 0.1.0's fields
    only, in its reply and in the push after a queued answer; with the header, the fields of
    that release: the keys themselves, whatever their values."""
    # Each reply object's fields added after 0.1.0, with the release that added them.
    added = {
        "lease": {"outside_grant": "0.2.0", "over_budget_since": "0.2.0", "link": "0.3.0"},
        "gpu": {"process_state": "0.2.0", "processes": "0.2.0"},
        "node": {"interconnect": "0.3.0"},
    }

    def fields_match(kind: str, body: dict[str, Any], reads: str) -> bool:
        """``body`` has exactly the fields added up to release ``reads``."""
        wanted = {name for name, since in added[kind].items()
                  if release_tuple(since) <= release_tuple(reads)}  # type: ignore[operator]
        return {name for name in added[kind] if name in body} == wanted

    the_gpu = gpus("gpu-a", GTX1070, 1)
    links = HostInterconnect(gpus=(HostGpu(uuid=the_gpu[0].uuid, numa_node=0),), links=())
    async with running_allocator(amqp_vhost.url, tmp_path / "ledger.sqlite",
                                 start_fence_s=0), NodeSimulator(amqp_vhost.url) as nodes:
        nodes.inventory["gpu-a"] = the_gpu
        await nodes.publish(heartbeat("gpu-a", the_gpu).model_copy(
            update={"interconnect": links}))
        for n, (headers, reads) in enumerate((
                (None, "0.1.0"), ({CLIENT_RELEASE_HEADER: "0.1.0"}, "0.1.0"),
                ({CLIENT_RELEASE_HEADER: "not a release"}, "0.1.0"),
                ({CLIENT_RELEASE_HEADER: "0.2.0"}, "0.2.0"),
                ({CLIENT_RELEASE_HEADER: "0.3.0"}, "0.3.0"),
                ({CLIENT_RELEASE_HEADER: "7.0.0"}, "7.0.0"))):
            async with RawClient(amqp_vhost.url, headers) as client:
                granted = await client.call(kind="allocate", request_key=f"a/{n}/",
                                            user="alice")
                assert granted["lease"]["state"] == "granted", granted
                assert fields_match("lease", granted["lease"], reads), (headers, granted)
                # Queued behind the first: the answer says queued, the push says granted.
                queued = await client.call(kind="allocate", request_key=f"b/{n}/",
                                           user="bob", wait_s=30)
                assert queued["lease"]["state"] == "queued", queued
                inventory = await client.call(kind="inventory", include_leases=True)
                for gpu in inventory["gpus"]:
                    assert fields_match("gpu", gpu, reads), (headers, gpu)
                for lease in inventory["leases"]:
                    assert fields_match("lease", lease, reads), (headers, lease)
                (node,) = inventory["nodes"]
                assert fields_match("node", node, reads), (headers, node)
                if "interconnect" in node:  # as the agent reported it, for a 0.3.0 reader
                    assert HostInterconnect.model_validate_json(
                        json.dumps(node["interconnect"])) == links
                await client.call(kind="release", request_key=f"a/{n}/")
                await nodes.beat("gpu-a")  # no container of it: the release ends
                pushed = await client.next_answer()
                assert pushed["lease"]["state"] == "granted", pushed
                assert fields_match("lease", pushed["lease"], reads), (headers, pushed)
                await client.call(kind="release", request_key=f"b/{n}/")
                await nodes.beat("gpu-a")
