"""Hostile input against the live consumer: fuzzed with hypothesis, checked against a model.

One allocator serves the whole property run (its state carries from example to example, as
in production). Every example publishes one message, of any kind, to either exchange:
valid requests, valid requests with fields replaced by wrong types, huge numbers, deep JSON,
control characters, long strings, missing or unknown fields; raw garbage (invalid UTF-8,
deeply nested arrays, oversized bodies, JSON that is not an object, NaN and Infinity);
heartbeats and container events for other hosts, claiming other hosts' GPUs and leases,
from a broker user that does not own the host or from none. Then:

- a request with ``reply_to`` is answered exactly once, with a reply that parses, and its
  error code is the one the protocol gives that body (unless its own deadline had passed:
  then it is dropped unanswered); a node message that does not parse is dead-lettered;
- a request's answer agrees with a model of the leases the run created: a retry with the
  same request key gets the same lease, another user's request with that key, or another
  request under it, a ``conflict`` (naming the lease), a status never shows an active lease
  nobody was granted, a non-admin cannot drain or force-release;
- node messages for hosts the sender does not own are refused; no node message changes
  another host's GPUs or leases (two anchor leases, bound on two hosts, stay bound);
- the consumer answers after every example; at the end the invariant checker finds nothing
  and the ledger holds exactly the leases that allocate replies announced.

Further tests check replayed and reordered heartbeats, a forged ``user_id``, and
non-finite times, one by one.

Only without the replicated log: what a message may do is decided by the protocol and the
engine before anything is committed; with the log a batch's changes are checked once more as
every replica reads them (tests/ledger/test_log_entries.py and test_ledger_log.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika
import aio_pika.abc
import aiormq
import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

from allocator.amqp.client import AllocatorClient
from allocator.wire.protocol import (
    MAX_BODY_BYTES,
    REPLY_ADAPTER,
    AllocateRequest,
    ContainerAction,
    ContainerEvent,
    ContainerInfo,
    DrainRequest,
    ErrorCode,
    ErrorReply,
    Health,
    Heartbeat,
    InventoryReply,
    InventoryRequest,
    LeaseReply,
    LeaseState,
    QueueReply,
    QueueRequest,
    QuotaReply,
    QuotaRequest,
    ReleaseReason,
    ReleaseRequest,
    StatusRequest,
    decode_inbound,
    encode,
)
from allocator.wire.topology import DEAD_LETTER_QUEUE, NODES_EXCHANGE, RPC_EXCHANGE
from tests.support import services
from tests.support.broker_users import broker_user
from tests.support.common import (
    GTX1070,
    NodeSimulator,
    drain_queue,
    gpus,
    heartbeat,
    settled_dead_letters,
    wait_until,
)
from tests.support.faults import assert_sound, audit_ledger, await_state, report, running_allocator

pytestmark = pytest.mark.slow  # real processes, brokers and engines: seconds each

EXAMPLES = 500
"""Messages per property run (about 15 s on a loaded 2-core machine)."""
REPLY_WITHIN_S = 10.0

HOSTS = ("gpu-a", "gpu-b", "gpu-fuzz")
"""gpu-a (guest's) and gpu-b (another broker user's) hold the anchor leases; gpu-fuzz is
guest's too, and the fuzzed heartbeats that guest may send go there."""
ACTIVE = {LeaseState.QUEUED, LeaseState.GRANTED, LeaseState.BOUND}


# ------------------------------------------------------------------------ the wire


class Wire:
    """Publishes raw bytes to either exchange; collects replies by correlation id."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.replies: dict[str, bytes] = {}
        self._arrived = asyncio.Event()

    async def __aenter__(self) -> Wire:
        self.connection = await aio_pika.connect(self.url, timeout=10)
        self.channel = await self.connection.channel(publisher_confirms=False)
        reply_queue = await self.channel.get_queue("amq.rabbitmq.reply-to", ensure=False)
        await reply_queue.consume(self._on_reply, no_ack=True)
        self.rpc = await self.channel.get_exchange(RPC_EXCHANGE, ensure=False)
        self.nodes = await self.channel.get_exchange(NODES_EXCHANGE, ensure=False)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.connection.close()

    async def _on_reply(self, message: aio_pika.abc.AbstractIncomingMessage) -> None:
        self.replies[message.correlation_id or ""] = message.body
        self._arrived.set()

    async def send(self, body: bytes, *, to_nodes: bool = False, routing_key: str = "request",
                   reply: bool = True, user_id: str | None = "guest") -> str | None:
        correlation_id = uuid.uuid4().hex if reply else None
        exchange = self.nodes if to_nodes else self.rpc
        await exchange.publish(
            aio_pika.Message(body, correlation_id=correlation_id, user_id=user_id,
                             reply_to="amq.rabbitmq.reply-to" if reply else None),
            routing_key=routing_key, timeout=10)
        return correlation_id

    async def reply(self, correlation_id: str, within: float = REPLY_WITHIN_S) -> Any:
        async with asyncio.timeout(within):
            while correlation_id not in self.replies:
                self._arrived.clear()
                await self._arrived.wait()
        return REPLY_ADAPTER.validate_json(self.replies.pop(correlation_id))

    async def call(self, request: Any) -> Any:
        correlation_id = await self.send(encode(request))
        assert correlation_id is not None
        return await self.reply(correlation_id)

    async def sync(self) -> None:
        """Until everything published before has been applied (one queue, in order)."""
        assert isinstance(await self.call(QueueRequest()), QueueReply)


# ----------------------------------------------------------------------- the model


@dataclass
class Known:
    lease_id: str
    key: str
    user: str
    host: str | None
    state: LeaseState
    asked: dict[str, Any] | None = None
    """What the allocate that created it asked for: a retry must repeat it."""

    @property
    def volatile(self) -> bool:
        """May change without a request of ours: queued, or on the host fuzzing reports for."""
        return self.state is LeaseState.QUEUED or self.host == "gpu-fuzz"


@dataclass
class Model:
    active: dict[str, Known] = field(default_factory=dict)
    """request key -> its active lease (queued, granted, bound)."""
    leases: dict[str, Known] = field(default_factory=dict)
    """every lease an allocate reply announced, by id."""
    anchors: dict[str, str] = field(default_factory=dict)
    """lease id -> container id of the two leases no fuzzed message may touch."""
    figures: dict[str, int] = field(default_factory=lambda: {
        "messages": 0, "answered": 0, "dropped_past_deadline": 0, "dead_lettered": 0,
        "refused_node_messages": 0, "accepted_node_messages": 0, "leases_granted": 0})
    replies: Counter[str] = field(default_factory=Counter)
    """Replies by kind, errors by code."""

    def learn(self, lease: Any, asked: dict[str, Any] | None = None) -> None:
        earlier = self.leases.get(lease.lease_id)
        known = Known(lease.lease_id, lease.request_key, lease.user, lease.host, lease.state,
                      asked if asked is not None else earlier.asked if earlier else None)
        self.leases[lease.lease_id] = known
        if lease.state in ACTIVE:
            self.active[lease.request_key] = known
        elif self.active.get(lease.request_key, known).lease_id == lease.lease_id:
            self.active.pop(lease.request_key, None)


@dataclass
class Case:
    body: bytes
    to_nodes: bool
    user_id: str | None
    routing_key: str
    what: str


# ---------------------------------------------------------------------- strategies

DEEP = "__DEEP__"
BIGINT = "__BIGINT__"
SPECIAL = {
    '"__DEEP__"': "[" * 3000 + "]" * 3000,
    '"__BIGINT__"': "1" + "0" * 5000,
    '"__INF__"': "Infinity",
    '"__NAN__"': "NaN",
    '"__HUGEF__"': "1e400",
    '"__LONG__"': json.dumps("x" * (MAX_BODY_BYTES + 10)),
}

hostile_values = st.one_of(
    st.none(), st.booleans(), st.integers(), st.integers(min_value=2**62, max_value=2**70),
    st.integers(max_value=-1), st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(list(SPECIAL)).map(lambda token: token.strip('"')),
    st.text(max_size=20), st.text(st.characters(max_codepoint=0x1F), min_size=1, max_size=3),
    st.just("y" * 250), st.just(""), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)

names = st.one_of(st.sampled_from(["alice", "bob", "carol"]), st.sampled_from(["alice", "bob"]),
                  st.text(min_size=1, max_size=12))
keys = st.one_of(st.sampled_from([f"fuzz/k{i}/" for i in range(6)]),
                 st.sampled_from([f"fuzz/k{i}/" for i in range(6)]),
                 st.text(min_size=1, max_size=12))


def pick(draw: Any, items: list[str]) -> str:
    """One of ``items``, which change as the run goes: drawn with a fixed shape, since
    hypothesis requires the same draws for the same choices."""
    return items[draw(st.integers(0, 1 << 16)) % len(items)]


def render(body: Any) -> bytes:
    text = json.dumps(body)
    for token, replacement in SPECIAL.items():
        text = text.replace(token, replacement)
    return text.encode()


def deadline_value(draw: Any) -> Any:
    now = time.time()
    return draw(st.sampled_from([None, None, None, now - 1000, now + 1000]))


def valid_request(draw: Any, model: Model) -> dict[str, Any]:
    kind = draw(st.sampled_from(["allocate"] * 4 + ["release"] * 2
                                + ["status", "inventory", "queue", "drain", "quota"]))
    body: dict[str, Any] = {"v": 1, "kind": kind}
    ids = [*sorted(i for i in model.leases if i not in model.anchors), "no-such-lease"]
    if kind == "allocate":
        body.update(request_key=draw(keys), user=draw(names))
        if draw(st.booleans()):
            body["model"] = draw(st.sampled_from([GTX1070, "1070", "H100"]))
        if draw(st.booleans()):
            body["count"] = draw(st.sampled_from([1, 2, 3, "all", 64]))
        if draw(st.booleans()):
            body["host"] = draw(st.sampled_from([*HOSTS, "nowhere"]))
        if draw(st.booleans()):
            body["share"] = {"memory_mib": draw(st.integers(0, 9000))}
            body["count"] = 1
        if draw(st.booleans()):
            body["wait_s"] = draw(st.sampled_from([0.0, 3600.0]))
        if draw(st.booleans()):
            body["min_memory_mib"] = draw(st.integers(0, 100_000))
        body["priority"] = draw(st.integers(-1000, 1000))
    elif kind in ("release", "status"):
        if draw(st.booleans()):
            body["lease_id"] = pick(draw, ids)
        else:
            body["request_key"] = draw(keys)
        if kind == "release":
            body["force"] = draw(st.booleans())
    elif kind == "inventory":
        body["include_leases"] = draw(st.booleans())
    elif kind == "drain":
        body.update(host=draw(st.sampled_from(HOSTS)), drained=draw(st.booleans()))
    elif kind == "quota":
        body.update(user=draw(names), groups=draw(st.lists(names, max_size=2)))
    body["deadline"] = deadline_value(draw)
    return body


def valid_node_message(draw: Any, model: Model, known_gpus: list[str]) -> dict[str, Any]:
    host = draw(st.sampled_from(["gpu-b", "gpu-fuzz", "gpu-fuzz", "gpu-c"]))
    lease_ids = sorted(model.leases) or ["no-such-lease"]
    if draw(st.booleans()):
        count = draw(st.integers(0, 3))
        uuids = draw(st.lists(st.sampled_from([*known_gpus, "GPU-fuzz-0", "GPU-fuzz-1"]),
                              min_size=count, max_size=count, unique=True))
        return {
            "v": 1, "kind": "heartbeat", "host": host, "agent_id": draw(names),
            "seq": draw(st.integers(0, 2**40)), "sent_at": time.time() + draw(
                st.floats(-1e6, 1e6)), "interval_s": 2.0,
            "gpus": [{"uuid": u, "index": i, "model": GTX1070,
                      "memory_total_mib": draw(st.integers(0, 1 << 30)),
                      "health": draw(st.sampled_from(["healthy", "unhealthy"]))}
                     for i, u in enumerate(uuids)],
            "containers": [{"container_id": f"c{i}", "lease_id": pick(draw, lease_ids)}
                           for i in range(draw(st.integers(0, 2)))],
            "containers_complete": draw(st.booleans()), "source": "simulated",
        }
    return {"v": 1, "kind": "container_event", "host": host,
            "container_id": draw(st.sampled_from(["ca", "cb", "cz"])),
            "lease_id": pick(draw, lease_ids),
            "action": draw(st.sampled_from(["start", "die", "oom", "destroy"])),
            "at": time.time() + draw(st.floats(-1e6, 1e6)),
            "exit_code": draw(st.none() | st.integers(0, 255))}


def mutate(draw: Any, body: dict[str, Any]) -> dict[str, Any]:
    body = json.loads(json.dumps(body))
    for _ in range(draw(st.integers(1, 3))):
        target = body
        nested = body.get("gpus")
        if isinstance(nested, list) and nested and isinstance(nested[0], dict) \
                and nested[0] and draw(st.booleans()):
            target = nested[0]
        action = draw(st.sampled_from(["replace", "replace", "delete", "add"]))
        field_name = draw(st.sampled_from(sorted(target)))
        if action == "replace":
            target[field_name] = draw(hostile_values)
        elif action == "delete":
            target.pop(field_name, None)
        else:
            target[draw(st.text(min_size=1, max_size=8))] = draw(hostile_values)
    return body


garbage = st.one_of(
    st.binary(max_size=64),
    st.binary(min_size=1, max_size=32).map(lambda b: b"\xff\xfe" + b + b"\xc3"),
    st.integers(1, 20_000).map(lambda n: b"[" * n + b"]" * n),
    st.integers(1, 20_000).map(lambda n: b'{"a":' * n + b"1" + b"}" * n),
    st.sampled_from([b"", b"null", b"1", b'"text"', b"[]", b"{}", b"NaN", b'{"v": 1}',
                     b'{"v": 1, "kind": "allocate", "request_key": "k", "user": "u", '
                     b'"count": 1, "count": 2}',
                     b"{" + b" " * (MAX_BODY_BYTES + 1) + b"}"]),
)


@st.composite
def cases(draw: Any, model: Model, known_gpus: list[str]) -> Case:
    shape = draw(st.sampled_from(["request", "request", "mutated-request", "node", "node",
                                  "mutated-node", "garbage"]))
    to_nodes = shape in ("node", "mutated-node")
    if shape == "garbage":
        body = draw(garbage)
        to_nodes = draw(st.booleans())
    else:
        message = (valid_node_message(draw, model, known_gpus) if to_nodes
                   else valid_request(draw, model))
        if shape.startswith("mutated"):
            message = mutate(draw, message)
        body = render(message)
        # Now and then, send a message to the other exchange than it is meant for.
        if draw(st.integers(0, 9)) == 5:
            to_nodes = not to_nodes
    user_id = draw(st.sampled_from(["guest", "guest", None])) if to_nodes else "guest"
    routing_key = (draw(st.sampled_from(["heartbeat.gpu-fuzz", "event.gpu-b", "x", "#"]))
                   if to_nodes else "request")
    return Case(body, to_nodes, user_id, routing_key, shape)


# ---------------------------------------------------------------------- the harness


class Harness:
    def __init__(self, allocator: Any, wire: Wire, model: Model, owners: dict[str, str],
                 anchor_gpus: dict[str, tuple[str, bool]]) -> None:
        self.allocator = allocator
        self.wire = wire
        self.model = model
        self.owners = owners
        self.anchor_gpus = anchor_gpus
        """GPU uuid -> (host, present) of gpu-a and gpu-b: no fuzzed message may move them."""
        self.expected_dead_letters = 0

    def counter(self, name: str) -> int:
        return self.allocator.engine.counters[name] + self.allocator.stats.counters[name]

    async def refresh(self, lease_id: str | None, key: str | None) -> None:
        """Ask the allocator about a volatile lease before a request that depends on it."""
        known = (self.model.leases.get(lease_id) if lease_id is not None
                 else self.model.active.get(key or ""))
        if known is not None and known.volatile:
            reply = await self.wire.call(StatusRequest(lease_id=known.lease_id))
            assert isinstance(reply, LeaseReply), reply
            self.model.learn(reply.lease)

    async def run(self, case: Case) -> None:
        self.model.figures["messages"] += 1
        decoded = decode_inbound(case.body)
        if case.to_nodes:
            await self.run_node(case, decoded)
        else:
            await self.run_request(case, decoded)
        await self.check_anchors()

    async def run_request(self, case: Case, decoded: Any) -> None:
        target = (getattr(decoded, "lease_id", None), getattr(decoded, "request_key", None))
        if isinstance(decoded, AllocateRequest | ReleaseRequest | StatusRequest):
            await self.refresh(*target)
        before = self.model.active.get(target[1] or "") if target[1] else None
        if target[0] is not None:
            known = self.model.leases.get(target[0])
            before = known if known is not None and known.state in ACTIVE else None
        correlation_id = await self.wire.send(case.body)
        assert correlation_id is not None
        deadline = getattr(decoded, "deadline", None)
        if deadline is not None and deadline < time.time() - 5:
            await self.wire.sync()
            assert correlation_id not in self.wire.replies, "answered after its deadline"
            self.model.figures["dropped_past_deadline"] += 1
            return
        reply = await self.wire.reply(correlation_id)
        self.model.figures["answered"] += 1
        self.model.replies[reply.error.code.value if isinstance(reply, ErrorReply)
                           else reply.kind] += 1
        if isinstance(decoded, ErrorReply):
            assert isinstance(reply, ErrorReply), (case, reply)
            assert reply.error.code is decoded.error.code, (case, reply)
            return
        assert not (isinstance(reply, ErrorReply) and reply.error.code in (
            ErrorCode.INTERNAL_ERROR, ErrorCode.STORAGE_ERROR)), (case, reply)
        if isinstance(decoded, Heartbeat | ContainerEvent):
            assert isinstance(reply, ErrorReply) and reply.error.code is ErrorCode.FORBIDDEN
        elif isinstance(decoded, AllocateRequest):
            self.check_allocate(decoded, before, reply)
        elif isinstance(decoded, ReleaseRequest):
            self.check_release(decoded, before, reply)
        elif isinstance(decoded, StatusRequest):
            self.check_status(before, reply)
        elif isinstance(decoded, InventoryRequest):
            assert isinstance(reply, InventoryReply)
            for lease in reply.leases or []:
                assert lease.lease_id in self.model.leases or lease.lease_id in self.model.anchors
        elif isinstance(decoded, QueueRequest):
            assert isinstance(reply, QueueReply)
            assert {lease.lease_id for lease in reply.leases} <= set(self.model.leases)
        elif isinstance(decoded, DrainRequest):
            assert isinstance(reply, ErrorReply) and reply.error.code is ErrorCode.FORBIDDEN
        elif isinstance(decoded, QuotaRequest):
            assert isinstance(reply, QuotaReply) and reply.user == decoded.user, reply

    def check_allocate(self, request: AllocateRequest, before: Known | None, reply: Any) -> None:
        retry = (before is not None and before.user == request.user
                 and before.asked in (None, request.what_is_asked()))
        still_there = (isinstance(reply, LeaseReply) and before is not None
                       and reply.lease.lease_id == before.lease_id
                       if retry else
                       isinstance(reply, ErrorReply) and reply.error.code is ErrorCode.CONFLICT)
        if before is not None and before.state is LeaseState.QUEUED and not still_there:
            # Its wait ran out (a timer) between our look and this request: a new request.
            before.state = LeaseState.EXPIRED
            self.model.active.pop(before.key, None)
            before = None
        if before is not None:
            if retry:
                assert isinstance(reply, LeaseReply), reply
                assert reply.lease.lease_id == before.lease_id, "a retry got another lease"
                self.model.learn(reply.lease)
            else:  # another user's key, or another request under a used key
                assert isinstance(reply, ErrorReply), reply
                assert reply.error.code is ErrorCode.CONFLICT
                if before.user == request.user:
                    assert reply.error.details["lease_id"] == before.lease_id, reply
            return
        if isinstance(reply, LeaseReply):
            assert reply.lease.state in (LeaseState.GRANTED, LeaseState.QUEUED), reply
            assert reply.lease.lease_id not in self.model.leases, "an old lease came back"
            self.model.learn(reply.lease, request.what_is_asked())
            self.model.figures["leases_granted"] += 1
        else:
            assert isinstance(reply, ErrorReply), reply
            assert reply.error.code is not ErrorCode.CONFLICT, reply

    def check_release(self, request: ReleaseRequest, before: Known | None, reply: Any) -> None:
        if request.force:  # guest is no admin
            assert isinstance(reply, ErrorReply), reply
            assert reply.error.code in (ErrorCode.FORBIDDEN, ErrorCode.NOT_FOUND), reply
            if before is not None:
                assert reply.error.code is ErrorCode.FORBIDDEN
            return
        if before is not None:
            assert isinstance(reply, LeaseReply), reply
            assert reply.lease.lease_id == before.lease_id
            ended = {LeaseState.RELEASING, LeaseState.RELEASED}
            if before.state is LeaseState.QUEUED:
                ended.add(LeaseState.EXPIRED)  # its wait may run out just before
            assert reply.lease.state in ended, reply
            self.model.learn(reply.lease)
            return
        self.check_status(None, reply)

    def check_status(self, before: Known | None, reply: Any) -> None:
        if before is not None:
            assert isinstance(reply, LeaseReply), reply
            assert reply.lease.lease_id == before.lease_id
            assert reply.lease.state in ACTIVE or before.state is LeaseState.QUEUED, reply
            self.model.learn(reply.lease)
            return
        if isinstance(reply, ErrorReply):
            assert reply.error.code is ErrorCode.NOT_FOUND, reply
            return
        assert isinstance(reply, LeaseReply), reply
        lease = reply.lease
        if lease.lease_id in self.model.anchors:
            return
        assert lease.lease_id in self.model.leases, f"a lease nobody was granted: {lease}"
        assert lease.state not in ACTIVE or self.model.leases[lease.lease_id].volatile, (
            f"an active lease the model does not know as active: {lease}")
        self.model.learn(lease)

    async def run_node(self, case: Case, decoded: Any) -> None:
        if isinstance(decoded, Heartbeat | ContainerEvent):
            assume(decoded.host != "gpu-a")  # guest owns it: its reports are the truth
        counters = ("dead_lettered", "request_from_node_exchange", "heartbeat_rejected",
                    "container_event_rejected", "expired_dropped")
        before = {name: self.counter(name) for name in counters}
        await self.wire.send(case.body, to_nodes=True, routing_key=case.routing_key,
                             reply=False, user_id=case.user_id)
        await self.wire.sync()
        after = {name: self.counter(name) for name in counters}
        grew = {name for name in counters if after[name] != before[name]}
        if isinstance(decoded, ErrorReply):
            assert grew == {"dead_lettered"}, (case, decoded, grew)
            self.expected_dead_letters += 1
            self.model.figures["dead_lettered"] += 1
        elif isinstance(decoded, Heartbeat | ContainerEvent):
            owner = self.owners.get(decoded.host, f"agent-{decoded.host}")
            if case.user_id == owner:
                assert grew == set(), (case, grew)
                self.model.figures["accepted_node_messages"] += 1
            else:
                assert grew == {f"{decoded.kind}_rejected"}, (case, grew)
                self.model.figures["refused_node_messages"] += 1
        else:  # a request on the nodes exchange: ignored (or dropped, if already too late)
            late = (decoded.deadline or time.time()) < time.time() - 5
            assert grew == {"expired_dropped" if late else "request_from_node_exchange"}, (
                case, grew)

    async def check_anchors(self) -> None:
        for lease_id, container in self.model.anchors.items():
            reply = await self.wire.call(StatusRequest(lease_id=lease_id))
            assert isinstance(reply, LeaseReply), reply
            assert (reply.lease.state, reply.lease.container_id) == (LeaseState.BOUND, container)
        gpus_now = self.allocator.engine.cluster.gpus
        for uuid_, (host, present) in self.anchor_gpus.items():
            assert (gpus_now[uuid_].host, gpus_now[uuid_].present) == (host, present), uuid_


async def count_dead_letters(url: str) -> int:
    async with await aio_pika.connect(url, timeout=10) as connection:
        channel = await connection.channel()
        queue = await channel.get_queue(DEAD_LETTER_QUEUE)
        count = 0
        with contextlib.suppress(TimeoutError):
            async with queue.iterator(timeout=1.0) as messages:
                async for message in messages:
                    await message.ack()
                    count += 1
        return count


async def start_harness(stack: contextlib.AsyncExitStack, url: str, agent_b: tuple[str, str],
                        ledger_path: Path) -> Harness:
    owner_b, url_b = agent_b
    owners = {"gpu-a": "guest", "gpu-fuzz": "guest", "gpu-b": owner_b}
    allocator = await stack.enter_async_context(running_allocator(
        url, ledger_path, allow_any_node_user=False, node_users=owners,
        admin_users=["nobody-is-admin"], node_down_after_s=3600, stop_grace_s=3600,
        bind_timeout_s=3600, share_slots={GTX1070: 2}, aliases={"1070": GTX1070}))
    wire = await stack.enter_async_context(Wire(url))
    guest_nodes = await stack.enter_async_context(NodeSimulator(url))
    b_nodes = await stack.enter_async_context(NodeSimulator(url_b))
    a_gpus, b_gpus = gpus("gpu-a", GTX1070, 8), gpus("gpu-b", GTX1070, 8)
    await guest_nodes.publish(heartbeat("gpu-a", a_gpus))
    await b_nodes.publish(heartbeat("gpu-b", b_gpus), user_id=owner_b)
    client = await stack.enter_async_context(AllocatorClient(url, timeout_s=5))

    async def both_up():
        nodes = (await client.inventory()).nodes
        return sum(n.up for n in nodes if n.host in ("gpu-a", "gpu-b")) == 2
    await wait_until(both_up)
    model = Model()
    for host, container, nodes, user in (("gpu-a", "ca", guest_nodes, "guest"),
                                         ("gpu-b", "cb", b_nodes, owner_b)):
        lease = await client.allocate(AllocateRequest(request_key=f"anchor/{host}/",
                                                      user="anchor", host=host))
        await nodes.publish(ContainerEvent(host=host, container_id=container,
                                           lease_id=lease.lease_id,
                                           action=ContainerAction.START, at=time.time()),
                            user_id=user)
        await await_state(client, lease.lease_id, LeaseState.BOUND)
        model.anchors[lease.lease_id] = container
    anchor_gpus = {g.uuid: (host, True) for host, gpu_list in (("gpu-a", a_gpus),
                                                               ("gpu-b", b_gpus))
                   for g in gpu_list}
    return Harness(allocator, wire, model, owners, anchor_gpus)


@pytest.mark.slow
def test_fuzzed_messages_of_every_kind_against_the_live_consumer(rabbitmq, tmp_path: Path):
    ledger_path = tmp_path / "ledger.sqlite"
    loop = asyncio.new_event_loop()
    stack = contextlib.AsyncExitStack()
    started = time.monotonic()
    try:
        with services.temporary_vhost(rabbitmq) as vhost, broker_user(rabbitmq, vhost) as agent_b:
            try:
                harness = loop.run_until_complete(
                    start_harness(stack, vhost.url, agent_b, ledger_path))
                known_gpus = sorted(harness.anchor_gpus)

                # Generation only: the allocator's state carries from one example to the
                # next, so a failure is reported as it happened rather than shrunk on a
                # state that has moved on.
                @settings(max_examples=EXAMPLES, deadline=None, database=None,
                          suppress_health_check=list(HealthCheck), phases=[Phase.generate])
                @given(st.data())
                def one_message(data: st.DataObject) -> None:
                    case = data.draw(cases(harness.model, known_gpus))
                    loop.run_until_complete(harness.run(case))

                one_message()
                # The consumer still answers, the dead letters are where they should be.
                loop.run_until_complete(harness.wire.sync())
                dead = loop.run_until_complete(count_dead_letters(vhost.url))
                assert dead == harness.expected_dead_letters
                # No input made the engine raise (that would fail its whole batch).
                assert harness.allocator.stats.counters["batch_failures"] == 0
                assert harness.allocator.stats.counters["commit_failures"] == 0
            finally:
                loop.run_until_complete(stack.aclose())
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
    audit = audit_ledger(ledger_path)
    assert_sound(audit)
    # The ledger holds exactly the leases that allocate replies announced (and the anchors).
    model = harness.model
    assert set(audit.leases) == set(model.leases) | set(model.anchors)
    report("hostile_input_fuzz", **model.figures, replies=dict(model.replies),
           seconds=round(time.monotonic() - started, 1), leaked=0,
           double_booked=len(audit.double_booked))


# ------------------------------------------------------------------ one by one


async def one_gpu_up(client: AllocatorClient, nodes: NodeSimulator) -> list[Any]:
    """Report host gpu-a with one GTX 1070 and wait until the allocator has it up."""
    gpu_list = gpus("gpu-a", GTX1070, 1)
    await nodes.beat("gpu-a", gpu_list)

    async def up() -> list[Any]:
        return [n for n in (await client.inventory()).nodes if n.up]
    await wait_until(up)
    return gpu_list


async def test_replayed_and_reordered_heartbeats_never_undo_newer_facts(amqp_vhost, ledger_path):
    async with (running_allocator(amqp_vhost.url, ledger_path, container_gone_grace_s=0.5),
                AllocatorClient(amqp_vhost.url, timeout_s=5) as client,
                NodeSimulator(amqp_vhost.url) as nodes):
        gpu_list = gpus("gpu-a", GTX1070, 1)
        old = heartbeat("gpu-a", gpu_list, agent_id="agent-1", sent_at=time.time() - 30)
        await nodes.publish(old)

        async def up():
            return [n for n in (await client.inventory()).nodes if n.up]
        await wait_until(up)
        lease = await client.allocate(AllocateRequest(request_key="hub/alice/", user="alice"))
        running = [ContainerInfo(container_id="c1", lease_id=lease.lease_id)]
        newer = heartbeat("gpu-a", gpu_list, running, agent_id="agent-1")
        await nodes.publish(newer)
        await await_state(client, lease.lease_id, LeaseState.BOUND)

        later = time.time() + 5
        stale = [
            old,  # replayed: an older seq of the same agent
            Heartbeat(**{**newer.model_dump(), "seq": newer.seq, "containers": []}),  # same seq
            Heartbeat(**{**old.model_dump(), "seq": newer.seq - 1, "sent_at": later}),  # reordered
            # A replay that looks like a restarted agent: its news predate the bind.
            Heartbeat(**{**old.model_dump(), "agent_id": "agent-0"}),
        ]
        for beat in stale:
            await nodes.publish(beat)
            await asyncio.sleep(0.2)
            kept = await client.status(lease_id=lease.lease_id)
            assert (kept.state, kept.container_id) == (LeaseState.BOUND, "c1"), beat
        # Real news: the same agent, a newer seq, the container gone.
        await nodes.publish(heartbeat("gpu-a", gpu_list, [], agent_id="agent-1",
                                      sent_at=later))
        gone, _ = await await_state(client, lease.lease_id, LeaseState.RELEASED)
        assert gone.release_reason is ReleaseReason.CONTAINER_GONE
    assert_sound(audit_ledger(ledger_path))


async def test_a_captured_heartbeat_replayed_under_another_agent_id_is_stale(amqp_vhost,
                                                                             ledger_path):
    """A report older than the newest accepted for its host is stale, whatever agent id it
    claims; a restarted agent (a new agent id, sent now) is news."""
    async with (running_allocator(amqp_vhost.url, ledger_path) as allocator,
                AllocatorClient(amqp_vhost.url, timeout_s=5) as client,
                NodeSimulator(amqp_vhost.url) as nodes,
                Wire(amqp_vhost.url) as wire):
        healthy = gpus("gpu-a", GTX1070, 1)
        sick = gpus("gpu-a", GTX1070, 1, health=Health.UNHEALTHY)
        captured = heartbeat("gpu-a", sick, agent_id="agent-1", sent_at=time.time() - 3600)
        await nodes.publish(heartbeat("gpu-a", healthy, agent_id="agent-1"))
        await wire.sync()
        for replay in range(3):
            await nodes.publish(Heartbeat(**{**captured.model_dump(),
                                             "agent_id": f"replayer-{replay}"}))
        await wire.sync()
        assert allocator.engine.counters["heartbeat_stale"] == 3
        assert [g.health for g in (await client.inventory()).gpus] == [Health.HEALTHY]
        # The agent restarts: a new agent id, sent now, with news the allocator takes.
        await nodes.publish(heartbeat("gpu-a", sick, agent_id="agent-2"))
        await wire.sync()
        assert [g.health for g in (await client.inventory()).gpus] == [Health.UNHEALTHY]
        assert allocator.engine.counters["heartbeat_stale"] == 3
        report("replayed_heartbeats", replayed=3, stale=3, restart_accepted=1)
    assert_sound(audit_ledger(ledger_path))


async def test_a_forged_user_id_never_reaches_the_allocator(amqp_vhost, ledger_path):
    """The broker refuses a ``user_id`` that is not the connection's user, so an agent
    cannot pass for another host's agent."""
    async with (running_allocator(amqp_vhost.url, ledger_path, allow_any_node_user=False,
                                  node_users={"gpu-b": "agent-gpu-b"}) as allocator,
                AllocatorClient(amqp_vhost.url, timeout_s=5) as client,
                NodeSimulator(amqp_vhost.url) as nodes):
        with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
            await nodes.publish(heartbeat("gpu-b", gpus("gpu-b", GTX1070, 1)),
                                user_id="agent-gpu-b")
            await asyncio.sleep(0.5)  # the refusal closes the channel asynchronously
            await nodes.publish(heartbeat("gpu-b", gpus("gpu-b", GTX1070, 1)),
                                user_id="agent-gpu-b")
        inventory = await client.inventory()
        assert inventory.nodes == [] and inventory.gpus == []
        assert allocator.engine.counters["heartbeats"] == 0
    assert_sound(audit_ledger(ledger_path))


@pytest.mark.parametrize("body", [
    b'{"v":1,"kind":"container_event","host":"gpu-a","container_id":"c","lease_id":"L",'
    b'"action":"start","at":Infinity}',
    b'{"v":1,"kind":"container_event","host":"gpu-a","container_id":"c","lease_id":"L",'
    b'"action":"start","at":1e400}',
    b'{"v":1,"kind":"heartbeat","host":"gpu-a","agent_id":"a","seq":99,"sent_at":NaN,'
    b'"interval_s":1,"gpus":[],"containers_complete":false}',
    b'{"v":1,"kind":"heartbeat","host":"gpu-a","agent_id":"a","seq":99,"sent_at":1,'
    b'"interval_s":1,"gpus":[],"containers":[{"container_id":"c","lease_id":"L",'
    b'"started_at":-Infinity}],"containers_complete":false}',
], ids=["event-at-infinity", "event-at-1e400", "heartbeat-sent-at-nan",
        "container-started-at-minus-infinity"])
async def test_non_finite_times_are_refused(amqp_vhost, ledger_path, body):
    """A node time of NaN or infinity would pin a lease forever (``sent_at - inf`` is never
    past the grace, so a heartbeat could no longer release it): such a message is
    dead-lettered, and the lease is bound and released by the real news."""
    async with (running_allocator(amqp_vhost.url, ledger_path, container_gone_grace_s=0.2)
                as allocator,
                AllocatorClient(amqp_vhost.url, timeout_s=5) as client,
                NodeSimulator(amqp_vhost.url) as nodes,
                Wire(amqp_vhost.url) as wire):
        await one_gpu_up(client, nodes)
        lease = await client.allocate(AllocateRequest(request_key="hub/alice/", user="alice"))
        await wire.send(body.replace(b'"L"', json.dumps(lease.lease_id).encode()),
                        to_nodes=True, routing_key="event.gpu-a", reply=False)
        await wire.sync()
        assert allocator.stats.counters["dead_lettered"] == 1
        assert (await client.status(lease_id=lease.lease_id)).state is LeaseState.GRANTED
        await nodes.event("gpu-a", lease.lease_id, ContainerAction.START, container_id="c")
        await await_state(client, lease.lease_id, LeaseState.BOUND)
        await nodes.beat("gpu-a", containers=[], sent_at=time.time() + 2)
        gone, _ = await await_state(client, lease.lease_id, LeaseState.RELEASED)
        assert gone.release_reason is ReleaseReason.CONTAINER_GONE
    assert_sound(audit_ledger(ledger_path))


@pytest.mark.parametrize(("digits", "accepted"), [(3, True), (11, False), (4000, False),
                                                (5000, False)])
async def test_huge_integers_in_a_node_message_harm_nothing(amqp_vhost, ledger_path, digits,
                                                            accepted):
    """JSON integers have no size limit, and Python refuses to print one of more than 4300
    digits. An exit code is a 32-bit integer: one of 3 digits ends its lease like any other;
    one of 11 or 4000 digits is refused by the protocol, one of 5000 by the parser (each
    dead-lettered). None fails a batch."""
    async with (running_allocator(amqp_vhost.url, ledger_path) as allocator,
                AllocatorClient(amqp_vhost.url, timeout_s=5) as client,
                NodeSimulator(amqp_vhost.url) as nodes,
                Wire(amqp_vhost.url) as wire):
        await one_gpu_up(client, nodes)
        lease = await client.allocate(AllocateRequest(request_key="hub/alice/", user="alice"))
        await nodes.event("gpu-a", lease.lease_id, ContainerAction.START, container_id="c")
        await await_state(client, lease.lease_id, LeaseState.BOUND)
        body = (b'{"v":1,"kind":"container_event","host":"gpu-a","container_id":"c",'
                b'"lease_id":' + json.dumps(lease.lease_id).encode()
                + b',"action":"die","at":' + str(time.time()).encode()
                + b',"exit_code":1' + b"0" * (digits - 1) + b"}")
        await wire.send(body, to_nodes=True, routing_key="event.gpu-a", reply=False)
        await wire.sync()
        assert allocator.stats.counters["batch_failures"] == 0
        assert allocator.stats.counters["dead_lettered"] == (0 if accepted else 1)
        done = await client.status(lease_id=lease.lease_id)
        assert done.state is (LeaseState.RELEASED if accepted else LeaseState.BOUND)
    assert_sound(audit_ledger(ledger_path))


@pytest.mark.parametrize("field", ["health_reasons", "container_name", "recent_xids"])
async def test_oversized_strings_and_lists_in_a_heartbeat_are_refused(amqp_vhost, ledger_path,
                                                                      field):
    """One forged GPU with a 200 KB health reason would make every inventory reply 200 KB
    larger: a node message's strings and lists are bounded, and one past a bound is
    dead-lettered whole; the host's state stays what its last good heartbeat said."""
    async with (running_allocator(amqp_vhost.url, ledger_path) as allocator,
                AllocatorClient(amqp_vhost.url, timeout_s=5) as client,
                NodeSimulator(amqp_vhost.url) as nodes,
                Wire(amqp_vhost.url) as wire):
        gpu_list = await one_gpu_up(client, nodes)
        before = len((await wire.call(InventoryRequest())).model_dump_json())
        beat = json.loads(heartbeat("gpu-a", gpu_list).model_dump_json())
        if field == "health_reasons":
            beat["gpus"][0]["health_reasons"] = ["x" * 200_000]
        elif field == "container_name":
            beat["containers"] = [{"container_id": "c", "lease_id": "L", "name": "n" * 100_000}]
        else:
            beat["gpus"][0]["recent_xids"] = [2**40]
        await wire.send(json.dumps(beat).encode(), to_nodes=True, routing_key="heartbeat.gpu-a",
                        reply=False)
        await wire.sync()
        assert allocator.stats.counters["dead_lettered"] == 1
        assert allocator.stats.counters["invalid_bad_request"] == 1
        assert len((await wire.call(InventoryRequest())).model_dump_json()) < before + 100
    assert_sound(audit_ledger(ledger_path))


async def test_an_outsider_cannot_use_the_holes_replay_bloat_reply_to_dead_letters(
        amqp_vhost, ledger_path):
    """The holes an outside tester found, against one live allocator, counted: replayed
    heartbeats under other agent ids, oversized strings, invented hosts and cycling GPU
    uuids, reply_to naming queues of the vhost, and a flood of large unreadable messages
    into the dead-letter queue."""
    from allocator.wire.topology import DEAD_LETTER_MAX_BYTES

    replays, bloated, invented, cycled, hostile_replies = 20, 10, 10, 20, 20
    started = time.monotonic()
    async with (running_allocator(amqp_vhost.url, ledger_path, max_hosts_per_node_user=3,
                                  max_gpus_per_host=8) as allocator,
                AllocatorClient(amqp_vhost.url, timeout_s=10) as client,
                NodeSimulator(amqp_vhost.url) as nodes,
                Wire(amqp_vhost.url) as wire,
                await aio_pika.connect(amqp_vhost.url) as connection):
        healthy = gpus("gpu-a", GTX1070, 1)
        await nodes.publish(heartbeat("gpu-a", healthy, agent_id="agent-1"))
        await wire.sync()
        inventory_size = len((await wire.call(InventoryRequest())).model_dump_json())

        # 4. A captured hour-old heartbeat, replayed under other agent ids.
        sick = gpus("gpu-a", GTX1070, 1, health=Health.UNHEALTHY)
        captured = heartbeat("gpu-a", sick, agent_id="agent-1", sent_at=time.time() - 3600)
        for i in range(replays):
            await nodes.publish(Heartbeat(**{**captured.model_dump(), "agent_id": f"r{i}"}))
        # 5. Oversized strings, invented hosts, a new GPU uuid in every heartbeat.
        for _ in range(bloated):
            beat = json.loads(heartbeat("gpu-a", healthy, agent_id="agent-1").model_dump_json())
            beat["gpus"][0]["health_reasons"] = ["x" * 200_000]
            await wire.send(json.dumps(beat).encode(), to_nodes=True,
                            routing_key="heartbeat.gpu-a", reply=False)
        for i in range(invented):
            await nodes.publish(heartbeat(f"invented-{i}", gpus(f"invented-{i}", GTX1070, 1)))
        for i in range(cycled):
            fresh = gpus("gpu-a", GTX1070, 1, start_index=1 + i)
            await nodes.publish(heartbeat("gpu-a", healthy + fresh, agent_id="agent-1"))
        # 6. Replies asked into queues of the vhost, the allocator's own among them.
        channel = await connection.channel()
        victim = await channel.declare_queue("victim", auto_delete=False)
        for i in range(hostile_replies):
            target = ("victim", "swarm-gpu.allocator")[i % 2]
            await wire.rpc.publish(aio_pika.Message(
                encode(AllocateRequest(request_key=f"outsider/{i}/", user="mallory")),
                correlation_id=f"o{i}", reply_to=target), routing_key="request", timeout=10)
        # 7. Large unreadable messages, more bytes than the dead-letter queue keeps.
        flood = DEAD_LETTER_MAX_BYTES // (MAX_BODY_BYTES - 16) + 40
        for _ in range(flood):
            await wire.send(b"\x00" * (MAX_BODY_BYTES - 16), reply=False)
        await wire.sync()

        counters = allocator.engine.counters
        service = allocator.stats.counters
        assert counters["heartbeat_stale"] == replays
        inventory = await wire.call(InventoryRequest())
        assert next(g.health for g in inventory.gpus if g.host == "gpu-a") is Health.HEALTHY
        assert counters["host_limit"] == invented - 2  # gpu-a and two invented ones: 3 hosts
        assert len(inventory.nodes) == 3
        on_record = len(allocator.engine.cluster.nodes["gpu-a"].gpu_uuids)
        assert on_record == 8
        assert counters["gpu_limit"] > 0
        assert service["reply_to_refused"] == hostile_replies
        assert (await victim.declare()).message_count == 0
        assert len(inventory.model_dump_json()) < inventory_size + 2_000  # two small hosts more

        async def all_rejected():  # a batch's rejections follow its replies
            return service["dead_lettered"] == bloated + hostile_replies + flood
        await wait_until(all_rejected)
        kept = await settled_dead_letters(channel)
        dead_bytes = sum(map(len, await drain_queue(channel, DEAD_LETTER_QUEUE)))
        assert dead_bytes <= DEAD_LETTER_MAX_BYTES
        assert kept < bloated + hostile_replies + flood
        assert (await client.inventory(include_leases=True)).leases == []
    assert_sound(audit_ledger(ledger_path))
    report("outsider_holes", replayed_heartbeats=replays, stale=counters["heartbeat_stale"],
           oversized_heartbeats=bloated, dead_lettered_oversized=bloated,
           invented_hosts=invented, hosts_refused=counters["host_limit"],
           new_gpu_uuids=cycled, gpu_uuids_ignored=counters["gpu_limit"],
           gpus_on_record=on_record, hostile_reply_to=hostile_replies,
           reply_to_refused=service["reply_to_refused"], victim_messages=0,
           dead_letter_flood=flood, dead_letters_kept=kept,
           dead_letter_mib=round(dead_bytes / 2**20, 1),
           seconds=round(time.monotonic() - started, 1))
