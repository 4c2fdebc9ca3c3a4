"""One broker node of three killed under load: no decision lost, the allocator carries on.

Three RabbitMQ nodes of this machine's rabbitmq-server form one cluster (fixture
``rabbitmq_cluster``: own node names, ports on 127.0.0.1, data folders, one Erlang cookie).
A real allocator process (``python -m allocator.cli serve``) with the replicated ledger log
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
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import pytest
from faults import (
    AllocatorProcess,
    CycleLoad,
    assert_one_lease_per_answer,
    assert_sound,
    audit_ledger,
    cycle,
    lease_states,
    report,
)
from support import RTX3090, beat_until, gpus, wait_until

from allocator.client import AllocatorClient

pytestmark = pytest.mark.slow  # three broker nodes and real processes: a minute or two

HOSTS = ("gpu-a", "gpu-b")
GPUS_PER_HOST = 4
WORKERS = 4
"""At most one lease each at a time: the GPUs never run out."""
CYCLES_AFTER_KILL = 8
"""Allocate/release cycles every worker completes after the kill."""
RUN_BOUND_S = 120.0
SETTINGS = {"ledger_log": "stream", "node_down_after_s": 60, "container_gone_grace_s": 0.5}


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason=(
    "known, not fixed (docs/reliability.md, broker cluster): on a loaded machine, after the "
    "kill, the allocator keeps consuming and committing heartbeats but the clients' calls "
    "time out (requests or replies lost between the reconnected clients and the allocator); "
    "the run bound ends it."))
async def test_one_broker_node_of_three_killed_under_load_loses_no_decision(
        rabbitmq_cluster, tmp_path: Path) -> None:
    url = rabbitmq_cluster.url
    first, _, kept = rabbitmq_cluster.nodes
    ledger = tmp_path / "active" / "ledger.sqlite"
    replayed_ledger = tmp_path / "replay" / "ledger.sqlite"
    active = AllocatorProcess("active", url, ledger, tmp_path, **SETTINGS)
    replay = AllocatorProcess("replay", url, replayed_ledger, tmp_path, **SETTINGS)
    stop_beating = asyncio.Event()
    beating: asyncio.Task[None] | None = None
    load = CycleLoad()
    try:
        await active.start()
        await active.wait_consuming()
        inventory = {host: gpus(host, RTX3090, GPUS_PER_HOST) for host in HOSTS}
        beating = asyncio.create_task(beat_until(kept.url, inventory, stop_beating))
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
           retried=dict(load.retried), first_answer_after_kill_s=round(after[0], 2),
           longest_gap_s=round(load.longest_gap_s(), 2), lost=0,
           double_booked=len(audit.double_booked),
           replayed_leases_equal=True, leases=len(expected))
