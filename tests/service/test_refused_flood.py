"""Node messages write a bounded number of ledger events: refused ones at most
``refused_events_per_minute`` per sender, accepted ones at most ``node_events_per_minute``
per sender and host, whatever they report. One agent's credential flooding the allocator
leaves the ledger bounded, and every event not written is still counted."""

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
from allocator.ledger.changes import Changes
from allocator.ledger.store import Ledger
from allocator.metrics.counters import Count
from allocator.service import AllocatorService
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerAction,
    ContainerEvent,
    ContainerGrant,
    ContainerInfo,
    Health,
    Heartbeat,
    encode,
)
from allocator.wire.topology import NODES_EXCHANGE, event_routing_key, heartbeat_routing_key
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
                                 allow_any_node_user=True, node_events_per_minute=PER_MINUTE)
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
        events.update(str(event["kind"]) for event in changes.events
                      if event["host"] == "noisy")
    assert engine.counters[Count.DUPLICATE_GPU] == 120
    assert engine.counters[Count.UNKNOWN_LEASE_CONTAINER] == 120
    # Its joining, then its anomalies, within the budget of each of the two minutes.
    assert events["node_joined"] == 1
    assert sum(events.values()) == 2 * PER_MINUTE
    assert engine.counters[Count.NODE_EVENTS_UNRECORDED] == 1 + 240 - 2 * PER_MINUTE


def flapping_reports(host: str, second: int) -> list[Heartbeat | ContainerEvent]:
    """What one agent credential can make its own host report each second, all of it
    accepted: a new agent id, a GPU whose health flips, and a container labelled with a
    grant of its own that starts and dies (adopted, then ended)."""
    gpu_list = gpus(host, GTX1070, 2)
    gpu_list[1] = gpu_list[1].model_copy(update={
        "health": Health.UNHEALTHY if second % 2 else Health.HEALTHY,
        "health_reasons": ["xid 79"] if second % 2 else []})
    lease_id = f"forged-{second}"
    grant = ContainerGrant(host=host, gpu_uuids=[gpu_list[0].uuid], user="victim",
                           request_key=f"hub/victim/{second}")
    return [
        heartbeat(host, gpu_list, agent_id=f"agent-{second}", sent_at=float(second)),
        ContainerEvent(host=host, container_id=f"c{second:011d}", lease_id=lease_id,
                       action=ContainerAction.START, at=float(second), grant=grant),
        ContainerEvent(host=host, container_id=f"c{second:011d}", lease_id=lease_id,
                       action=ContainerAction.DIE, at=float(second) + 0.5),
    ]


def test_events_of_accepted_reports_are_bounded_per_host_and_minute(tmp_path: Path) -> None:
    """One sender, 120 seconds of reports of its own host, every one accepted (new agent
    ids, GPU health flapping, containers adopted and ended): the ledger gets at most
    ``node_events_per_minute`` events of that host a minute; the rest are counted. Its
    adoptions (a lease row and its history each) are as many a minute at most: the other
    containers wait as conflicts (their GPUs kept out) until they end."""
    settings = AllocatorSettings(ledger_path=tmp_path / "ledger.sqlite",
                                 allow_any_node_user=True, start_fence_s=0.0,
                                 node_events_per_minute=PER_MINUTE)
    engine = Engine(settings, started_at=0.0)
    events: Counter[int] = Counter()
    written = history = 0
    for second in range(1, 121):
        for message in flapping_reports("noisy", second):
            changes = Changes()
            engine.handle(message, NODE, float(second), changes)
            events.update(int(event["at"] // 60) for event in changes.events)
            written += len(changes.events)
            history += len(changes.history)
    adopted = engine.counters[Count.ADOPTED]
    assert 0 < adopted <= PER_MINUTE * 3, "within the budget of each of the 3 minutes"
    assert adopted + engine.counters[Count.ADOPTION_CONFLICT] == 120
    assert history == 2 * adopted, "each adoption and its end are in the leases' history"
    assert max(events.values()) <= PER_MINUTE, events
    # Without the budget: an event per health change and per adoption, every second.
    assert written + engine.counters[Count.NODE_EVENTS_UNRECORDED] >= 2 * 119
    assert written == sum(events.values()) <= PER_MINUTE * 3


def test_a_quiet_host_keeps_its_budget_beside_a_noisy_one(tmp_path: Path) -> None:
    """The budget is the host's own: another host's flood uses none of it."""
    settings = AllocatorSettings(ledger_path=tmp_path / "ledger.sqlite",
                                 allow_any_node_user=True, start_fence_s=0.0,
                                 node_events_per_minute=PER_MINUTE)
    engine = Engine(settings, started_at=0.0)
    for second in range(1, 30):
        for message in flapping_reports("noisy", second):
            engine.handle(message, NODE, float(second), Changes())
    changes = Changes()
    engine.handle(heartbeat("quiet", gpus("quiet", GTX1070, 1), sent_at=30.0), NODE, 30.0,
                  changes)
    assert [event["kind"] for event in changes.events] == ["node_joined"]


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


@pytest.fixture
async def budgeted(broker: Broker, ledger_path: Path) -> AsyncIterator[AllocatorService]:
    service = AllocatorService(broker.settings(ledger_path).model_copy(
        update={"node_events_per_minute": PER_MINUTE, "start_fence_s": 0.0}))
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


async def test_one_agent_credential_flooding_its_own_host_keeps_the_ledger_bounded(
        broker: Broker, budgeted: AllocatorService, ledger_path: Path) -> None:
    """The real agent user of gpu-a, through the real broker: 150 seconds' worth of reports
    of its own host (each accepted: new agent ids, health flapping, containers adopted and
    ended), all at once. The events of gpu-a in the ledger, and its adoptions, stay within
    the budget of each minute of the allocator's clock; the rest are counted."""
    agent = broker.prefix + "agent-gpu-a"
    counters = budgeted.engine.counters
    rounds = 150
    connection = await aio_pika.connect(broker.url("agent-gpu-a"), timeout=10)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(NODES_EXCHANGE, ensure=False)
        for second in range(1, rounds + 1):
            for message in flapping_reports("gpu-a", second):
                key = (heartbeat_routing_key("gpu-a") if isinstance(message, Heartbeat)
                       else event_routing_key("gpu-a"))
                await exchange.publish(aio_pika.Message(encode(message), user_id=agent),
                                       routing_key=key)

    async def all_ended() -> bool:
        return counters["event_die"] == rounds
    await wait_until(all_ended, within=60)
    adopted = counters[Count.ADOPTED.value]
    assert adopted + counters[Count.ADOPTION_CONFLICT.value] == rounds

    reader = Ledger(ledger_path)
    reader.open()
    try:
        events = reader.call(lambda: reader.db.conn.execute(
            "SELECT at FROM events WHERE host = 'gpu-a'").fetchall())
        history = reader.call(lambda: reader.db.conn.execute(
            "SELECT at, reason FROM lease_history").fetchall())
    finally:
        reader.close()
    per_minute = Counter(int(at // 60) for (at,) in events)
    assert events and max(per_minute.values()) <= PER_MINUTE, per_minute
    assert len(history) == 2 * adopted, "every adoption and end is in the leases' history"
    adoptions = Counter(int(at // 60) for at, reason in history if reason == "adopted")
    assert 0 < max(adoptions.values()) <= PER_MINUTE, adoptions
    # An event per health change and per adoption, every second, had there been no budget.
    assert len(events) + counters[Count.NODE_EVENTS_UNRECORDED.value] >= 2 * (rounds - 1)
