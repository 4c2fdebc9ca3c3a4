"""Refused node messages write at most ``refused_events_per_minute`` ledger events per sender
(and host): one agent's credential flooding the allocator leaves the ledger bounded, and
every refusal is still counted."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aio_pika
import pytest

from allocator.config import AllocatorSettings
from allocator.engine import Engine
from allocator.engine.nodes import EventBudget
from allocator.ledger.store import Changes, Ledger
from allocator.metrics.counters import Count
from allocator.service import AllocatorService
from allocator.wire.protocol import AllocateRequest, ContainerInfo, encode
from allocator.wire.topology import NODES_EXCHANGE, heartbeat_routing_key
from tests.support import services
from tests.support.broker_definitions import TEMPLATE, Broker, agent_beat, loaded_broker
from tests.support.common import GTX1070, NODE, gpus, heartbeat, wait_until

PER_MINUTE = 5


def test_the_budget_is_per_key_and_per_minute() -> None:
    budget = EventBudget(3)
    minute = 60 * 31_666_000 + 20.0  # 20 s into a minute
    assert [budget.take(("agent-a", None), minute + i) for i in range(5)] == [
        True, True, True, False, False]
    assert budget.take(("agent-a", "gpu-a"), minute), "another host has its own budget"
    assert budget.take(("agent-b", None), minute), "another sender has its own budget"
    assert budget.take(("agent-a", None), minute + 40), "the next minute starts afresh"
    assert not EventBudget(0).take(("agent-a", None), minute), "0: counted only"


def test_an_anomaly_a_host_repeats_in_every_report_writes_a_bounded_number_of_events(
        tmp_path: Path) -> None:
    """A host that lists another up host's GPU, and a container of a lease nobody holds, in
    every heartbeat: each repetition is counted, but the ledger gets at most the budget's
    events a minute for that host, and the next minute again."""
    settings = AllocatorSettings(ledger_path=tmp_path / "ledger.sqlite",
                                 allow_any_node_user=True, refused_events_per_minute=PER_MINUTE)
    engine = Engine(settings, started_at=0.0)
    owner_gpus, own_gpus = gpus("owner", GTX1070, 1), gpus("noisy", GTX1070, 1)
    stolen = owner_gpus[0].model_copy(update={"index": 1})
    stranger = ContainerInfo(container_id="c" * 12, lease_id="lease-nobody-holds")
    events: Counter[str] = Counter()
    for second in range(120):  # two minutes, a report of each host every second
        changes = Changes()
        engine.handle(heartbeat("owner", owner_gpus, agent_id="agent-owner",
                                sent_at=float(second)), NODE, float(second), changes)
        engine.handle(heartbeat("noisy", [*own_gpus, stolen], [stranger], agent_id="agent-noisy",
                                sent_at=float(second), containers_complete=True),
                      NODE, float(second), changes)
        events.update(str(event["kind"]) for event in changes.events)
    assert engine.counters[Count.DUPLICATE_GPU] == 120
    assert engine.counters[Count.UNKNOWN_LEASE_CONTAINER] == 120
    assert events["duplicate_gpu"] + events["unknown_lease_container"] == 2 * PER_MINUTE
    assert engine.counters[Count.NODE_EVENTS_UNRECORDED] == 240 - 2 * PER_MINUTE


@pytest.fixture
def broker(rabbitmq: services.RabbitMQ) -> Iterator[Broker]:
    with loaded_broker(rabbitmq, TEMPLATE, "flood") as loaded:
        yield loaded


@pytest.fixture
async def running(broker: Broker, ledger_path: Path) -> AsyncIterator[AllocatorService]:
    service = AllocatorService(broker.settings(ledger_path).model_copy(
        update={"refused_events_per_minute": PER_MINUTE}))
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


def ledger_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*")
               if not p.name.endswith(".lock"))


async def test_one_agent_credential_flooding_refused_messages_keeps_the_ledger_bounded(
        broker: Broker, running: AllocatorService, ledger_path: Path) -> None:
    agent = broker.prefix + "agent-gpu-a"
    beats, requests = 1000, 100
    counters = running.engine.counters
    size_before = ledger_bytes(ledger_path)
    connection = await aio_pika.connect(broker.url("agent-gpu-a"), timeout=10)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(NODES_EXCHANGE, ensure=False)
        # Its own routing key (the broker lets that through), other hosts in the body, and
        # requests through the nodes exchange: every one refused by the allocator.
        bodies = [agent_beat(f"gpu-b{i % 50}") for i in range(beats)]
        bodies += [encode(AllocateRequest(request_key=f"x/{i}/", user="x"))
                   for i in range(requests)]
        for start in range(0, len(bodies), 100):  # 100 confirms awaited at a time
            await asyncio.gather(*(
                exchange.publish(aio_pika.Message(body, user_id=agent),
                                 routing_key=heartbeat_routing_key("gpu-a"))
                for body in bodies[start:start + 100]))

    async def all_refused() -> bool:
        return (counters["heartbeat_rejected"] == beats
                and counters[Count.REQUEST_FROM_NODE_EXCHANGE.value] == requests)
    await wait_until(all_refused, within=60)

    reader = Ledger(ledger_path)
    reader.open()
    try:
        events = reader.call(lambda: reader.db.conn.execute(
            "SELECT kind, at FROM events WHERE kind IN ('heartbeat_rejected', "
            "'request_refused')").fetchall())
    finally:
        reader.close()
    per_minute = Counter(int(at // 60) for _, at in events)
    # Both kinds share the sender's budget for hosts it does not report for.
    assert events and max(per_minute.values()) <= PER_MINUTE, per_minute
    assert len(events) <= PER_MINUTE * len(per_minute)
    assert len(events) + counters[Count.NODE_EVENTS_UNRECORDED.value] == beats + requests
    # Without the budget each refusal wrote a row (about 200 bytes with its indexes): the
    # flood would have added over 200 KiB; the file grew by a few pages at most.
    assert ledger_bytes(ledger_path) - size_before < 64 * 1024, (size_before,
                                                                 ledger_bytes(ledger_path))
