"""One broker node of three killed under load: no decision lost, the allocator carries on.

Three RabbitMQ nodes of this machine's rabbitmq-server form one cluster (fixture
``rabbitmq_cluster``: own node names, ports on 127.0.0.1, data folders, one Erlang cookie).
A real allocator process (``python -m allocator.admin.cli serve``) with the replicated ledger log
(``ledger_log = "stream"``) and the clients use one AMQP URL naming the three nodes
(``amqp://guest:guest@127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3/``); the heartbeats go to node
3, which stays up. Queues are declared once the three nodes run, so the inbound quorum queue
and the log's stream have a member on each node, their leaders on node 1 (declared there).

Under a stream of allocate/release calls node 1 is killed with SIGKILL: the allocator's and
the clients' connections drop, the queue and the stream elect new leaders on the two nodes
left, and the allocator reconnects to the next node of the URL. Clients retry a call that
timed out, found no broker or got ``storage_error`` with the **same** request key.

Promises checked: every request is answered in the end, with exactly one lease per request
key, the one the client was told about; invariants hold and no GPU is held twice; the
allocator answers again after the kill (time to first answer and the longest gap between
answers are measured); and a new replica on an empty ledger, replaying the log from the two
nodes left, ends with the same leases as the allocator: no decision was lost from the log.

The first test pins down what the load test found on a loaded machine (RabbitMQ 3.10,
:func:`allocator.amqp.broker.is_refused`): a client or a node agent that reconnects to a surviving
node while the inbound quorum queue elects its new leader gets a channel whose every publish
to the queue is refused (nacked, or dropped without a trace without confirms). Each test
starts by starting again a node an earlier test killed, and declares its queues anew (the
first in a vhost of its own), so their leaders are on node 1 whatever ran before.

Only with the replicated log, as the stack deploys a three-node broker: then the log's
stream leader goes with the killed node too, the harder case; the inbound queue's failover,
the rest of it, is the same without the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import aio_pika
import pytest

from allocator.amqp.client import AllocatorClient
from allocator.service import declare_topology
from allocator.wire.protocol import GPUInfo
from allocator.wire.topology import ALLOCATOR_QUEUE
from nodeagent.publisher import Publisher
from tests.support.common import RTX3090, gpus, heartbeat, wait_until
from tests.support.faults import (
    AllocatorProcess,
    CycleLoad,
    assert_one_lease_per_answer,
    assert_sound,
    audit_ledger,
    cycle,
    lease_states,
    report,
    running_allocator,
)

pytestmark = pytest.mark.slow  # three broker nodes and real processes: a minute or two

HOSTS = ("gpu-a", "gpu-b")
GPUS_PER_HOST = 4
WORKERS = 4
"""At most one lease each at a time: the GPUs never run out."""
CYCLES_AFTER_KILL = 8
"""Allocate/release cycles every worker completes after the kill."""
RUN_BOUND_S = 120.0
SETTINGS = {"ledger_log": "stream", "node_down_after_s": 60, "container_gone_grace_s": 0.5}


LEADER_LOST_VHOST = "leader-lost"
ANSWER_BOUND_S = 10.0
"""How long a call, or the first heartbeat through, may take after the kill (the election
takes well under a second, a few seconds on a loaded machine; a channel that kept asking
the dead node would never get through)."""


async def beat_as_agents(url: str, inventory: dict[str, list[GPUInfo]], stop: asyncio.Event,
                         agents: list[Publisher], interval_s: float = 0.5) -> None:
    """Heartbeats for every host of ``inventory`` every ``interval_s`` until ``stop`` is set,
    through the node agent's publisher (one per host, added to ``agents``): a heartbeat that
    fails is counted and the next one follows, as in a real agent."""
    for host in inventory:
        agent = Publisher(url, host, timeout_s=5)
        await agent.start()
        agents.append(agent)
    try:
        while not stop.is_set():
            for agent in agents:
                await agent.publish_heartbeat(heartbeat(agent.host, inventory[agent.host]))
            await asyncio.sleep(interval_s)
    finally:
        for agent in agents:
            await agent.stop()


@pytest.mark.slow
async def test_reconnecting_while_the_inbound_queue_elects_a_leader_loses_no_request(
        rabbitmq_cluster, tmp_path: Path) -> None:
    """A client and a node agent connecting to a surviving node at once after the node of
    the inbound queue's leader is killed: the call is answered and the heartbeats arrive."""
    await asyncio.to_thread(rabbitmq_cluster.ensure_running)
    first, second, third = rabbitmq_cluster.nodes
    await asyncio.to_thread(rabbitmq_cluster.add_vhost, LEADER_LOST_VHOST)
    # The allocator's queues, declared through node 1: their leaders are there.
    declaring = await aio_pika.connect(first.vhost_url(LEADER_LOST_VHOST), timeout=30)
    async with declaring:
        await declare_topology(declaring, ALLOCATOR_QUEUE)
    # The allocator is on node 3 and keeps its connection: only the queue's leader is lost.
    async with running_allocator(third.vhost_url(LEADER_LOST_VHOST), tmp_path / "ledger.sqlite"):
        await asyncio.to_thread(first.kill)
        killed = time.monotonic()
        # At once, as a client and an agent whose connections were on node 1 do.
        url = second.vhost_url(LEADER_LOST_VHOST)
        agent = Publisher(url, "gpu-a", timeout_s=5)
        async with AllocatorClient(url, timeout_s=ANSWER_BOUND_S, connect_timeout_s=5) as client:
            await agent.start()
            try:
                inventory = await client.inventory()
                answered_s = time.monotonic() - killed
                assert inventory.nodes == []

                async def agent_known() -> bool:
                    await agent.publish_heartbeat(heartbeat("gpu-a", gpus("gpu-a", RTX3090, 1)))
                    return [n.host for n in (await client.inventory()).nodes] == ["gpu-a"]
                await wait_until(agent_known, within=ANSWER_BOUND_S, interval=0.25)
                heartbeat_s = time.monotonic() - killed
            finally:
                await agent.stop()
    report("clients_reconnecting_during_leader_election", first_answer_after_kill_s=round(
        answered_s, 2), first_heartbeat_after_kill_s=round(heartbeat_s, 2),
        requests_refused=client.requests_refused, heartbeats_failed=agent.heartbeat_failures)


@pytest.mark.slow
async def test_one_broker_node_of_three_killed_under_load_loses_no_decision(
        rabbitmq_cluster, tmp_path: Path) -> None:
    await asyncio.to_thread(rabbitmq_cluster.ensure_running)
    url = rabbitmq_cluster.url
    first, _, kept = rabbitmq_cluster.nodes
    ledger = tmp_path / "active" / "ledger.sqlite"
    replayed_ledger = tmp_path / "replay" / "ledger.sqlite"
    active = AllocatorProcess("active", url, ledger, tmp_path, **SETTINGS)
    replay = AllocatorProcess("replay", url, replayed_ledger, tmp_path, **SETTINGS)
    stop_beating = asyncio.Event()
    beating: asyncio.Task[None] | None = None
    load = CycleLoad()
    agents: list[Publisher] = []
    try:
        await active.start()
        await active.wait_consuming()
        inventory = {host: gpus(host, RTX3090, GPUS_PER_HOST) for host in HOSTS}
        beating = asyncio.create_task(beat_as_agents(kept.url, inventory, stop_beating, agents))
        async with AllocatorClient(url, timeout_s=5) as client:
            async def up() -> bool:
                return sum(n.up for n in (await client.inventory()).nodes) == len(HOSTS)
            await wait_until(up, within=30)

        async def under_load() -> bool:
            return len(load.granted) >= 20

        async with asyncio.timeout(RUN_BOUND_S):
            workers = [asyncio.create_task(cycle(n, url, load,
                                                 cycles_after_fault=CYCLES_AFTER_KILL))
                       for n in range(WORKERS)]
            await wait_until(under_load, within=60)
            answered_before = len(load.answers_at)
            await asyncio.to_thread(first.kill)
            load.fault_at = time.monotonic()
            await asyncio.gather(*workers)
        assert active.process is not None and active.process.returncode is None, \
            active.log()[-3000:]
        after = load.answered_after_fault()
        assert after, "the allocator answered after the kill"
        running = rabbitmq_cluster.running_nodes(via=kept)
        assert first.node not in running and len(running) == 2, running

        # Every stopped server's GPU comes free (releasing -> released by the heartbeats).
        async with AllocatorClient(url, timeout_s=5) as client:
            async def settled() -> bool:
                leases = (await client.inventory(include_leases=True)).leases or []
                return not leases
            await wait_until(settled, within=30)
        stop_beating.set()
        await beating
        assert await active.stop() == 0, active.log()[-3000:]

        # A new replica on an empty ledger replays the log from the two nodes left.
        expected = lease_states(ledger)
        await replay.start()
        await replay.wait_consuming()

        async def replayed() -> bool:
            with contextlib.suppress(Exception):  # not created yet, or mid-way
                return lease_states(replayed_ledger) == expected
            return False
        await wait_until(replayed, within=60, interval=0.5)
        assert await replay.stop() == 0, replay.log()[-3000:]
    finally:
        stop_beating.set()
        if beating is not None and not beating.done():
            beating.cancel()
        for process in (active, replay):
            await process.stop()

    audit = audit_ledger(ledger)
    assert_sound(audit)
    assert_one_lease_per_answer(audit, load)
    report("broker_node_of_three_killed", requests=len(load.granted) * 2, calls=load.calls,
           answered_before_kill=answered_before, answered_after_kill=len(after),
           retried=dict(load.retried), refused=load.refused,
           heartbeats=sum(a.heartbeats_sent for a in agents),
           heartbeats_failed=sum(a.heartbeat_failures for a in agents),
           first_answer_after_kill_s=round(after[0], 2),
           longest_gap_s=round(load.longest_gap_s(), 2), lost=0,
           double_booked=len(audit.double_booked),
           replayed_leases_equal=True, leases=len(expected))
