"""Broker restart while the hub's client, the allocator and a node agent are connected.

The broker here is a private RabbitMQ node (fixture ``private_rabbitmq``): the shared one on
5672 serves other tests at the same time and is never restarted. The node is stopped for
real (its Erlang VM exits, every connection drops) and started again on its own database.

Promises checked:

- calls pending when the broker goes away, and calls made while it is away, fail within
  their timeout (``AllocatorUnavailable`` or ``AllocatorTimeout``), never hang;
- after the restart, all three parts resume by themselves: the client's calls are answered
  (its reply consumer works), the allocator consumes its queue again, and the agent's
  heartbeats and container events reach the allocator;
- a request the allocator recorded but could not answer during the outage is found again
  by its request key (one lease, not two); the invariant checker finds nothing.

The restart runs in both ways of keeping the ledger (``ledger_log``): with the replicated log
(``stream``) the log's stream lives on the broker too, so the allocator must also follow it
again from where it was, and a decision appended just before the outage must be neither lost
nor applied twice. The wait for a broker that is not up yet is the same in both (the
allocator connects before anything of the log is followed) and runs once.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from allocator.amqp.client import AllocatorClient, AllocatorTimeout, AllocatorUnavailable
from allocator.config import AllocatorSettings
from allocator.service import AllocatorService
from allocator.wire.protocol import AllocateRequest, ContainerAction, ContainerEvent, LeaseState
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.simulated import make_gpu, write_inventory
from tests.support.common import wait_until
from tests.support.faults import (
    LEDGER_LOGS,
    AllocatorProcess,
    assert_sound,
    audit_ledger,
    fault_name,
    report,
)
from tests.support.services import port_open

pytestmark = pytest.mark.slow  # real processes, brokers and engines: seconds each

HOST = "gpu-restart"
CALL_TIMEOUT_S = 3.0
SLACK_S = 1.0
"""A failing call may take this much longer than its timeout (a loaded 2-core machine)."""
RECOVERY_BOUND_S = 20.0
"""Every part must be working again within this of the broker accepting connections."""


def ask(key: str) -> AllocateRequest:
    return AllocateRequest(request_key=f"hub/{key}/", user=key)


async def outcome(call: Any) -> tuple[str, float]:
    """How a call ended ('answered' or the exception's name) and how long it took."""
    started = time.monotonic()
    try:
        await call
    except (AllocatorTimeout, AllocatorUnavailable) as exc:
        return type(exc).__name__, time.monotonic() - started
    return "answered", time.monotonic() - started


async def recovered(client: AllocatorClient, up_at: float) -> dict[str, float]:
    """Wait until the client is answered and the agent's heartbeats reach the allocator
    again (each within the bound); how long each took after ``up_at``."""
    async def answered():
        name, _ = await outcome(client.inventory())
        return name == "answered"
    await wait_until(answered, within=RECOVERY_BOUND_S, interval=0.1)
    figures = {"client_answered_after_s": round(time.monotonic() - up_at, 2)}
    up_wall = time.time() - (time.monotonic() - up_at)

    async def fresh_heartbeat():
        nodes = (await client.inventory()).nodes
        return [n for n in nodes if n.host == HOST and (n.last_heartbeat or 0) > up_wall]
    await wait_until(fresh_heartbeat, within=RECOVERY_BOUND_S, interval=0.1)
    figures["heartbeat_after_s"] = round(time.monotonic() - up_at, 2)
    return figures


@pytest.mark.slow
@pytest.mark.parametrize("ledger_log", LEDGER_LOGS)
async def test_everything_resumes_after_a_broker_restart(private_rabbitmq, tmp_path: Path,
                                                         ledger_path: Path,
                                                         ledger_log: str) -> None:
    broker = private_rabbitmq
    url = broker.url
    inventory = tmp_path / "inventory.json"
    write_inventory(inventory, {HOST: [make_gpu(HOST, i, "NVIDIA GeForce RTX 3090")
                                       for i in range(4)]})
    allocator = AllocatorService(AllocatorSettings(
        amqp_url=url, ledger_path=ledger_path, allow_any_node_user=True, admin_users=["guest"],
        tick_s=0.1, node_down_after_s=60, stop_grace_s=60, ledger_log=ledger_log,
        start_fence_s=0))  # the agent watches no Docker engine: its listings never complete
    agent = NodeAgent(AgentSettings(
        host=HOST, amqp_url=url, inventory="simulated", simulated_file=inventory,
        interval_s=0.25, publish_timeout_s=1.0, amqp_reconnect_s=0.2, docker=False))
    client = AllocatorClient(url, timeout_s=CALL_TIMEOUT_S, connect_timeout_s=2.0)
    figures: dict[str, Any] = {}
    try:
        await allocator.start()
        await agent.start()
        await client.connect()

        async def host_known():
            return [n for n in (await client.inventory()).nodes if n.host == HOST and n.up]
        await wait_until(host_known, within=15)
        first = await client.allocate(ask("alice"))
        assert first.state is LeaseState.GRANTED

        # Calls in flight when the broker goes: hold the allocator's ledger thread (a slow
        # disk) until the broker is down, so that they are delivered but cannot be answered.
        # Held by an event, not a fixed sleep: stopping the broker takes seconds on a loaded
        # machine, and a stall that ends first lets the calls be answered.
        broker_down = threading.Event()
        stall = asyncio.create_task(allocator.ledger.run(lambda: broker_down.wait(60.0)))
        await asyncio.sleep(0.05)
        pending = [asyncio.create_task(outcome(c)) for c in (
            client.allocate(ask("bob")), client.status(lease_id=first.lease_id),
            client.inventory())]
        await asyncio.sleep(0.5)
        assert not any(task.done() for task in pending), "the calls are pending"
        stopped_at = time.monotonic()
        try:
            figures["broker_stop_s"] = round(await asyncio.to_thread(broker.stop), 2)
        finally:
            broker_down.set()
        results = await asyncio.gather(*pending)
        await stall
        for name, seconds in results:
            assert name in ("AllocatorUnavailable", "AllocatorTimeout"), results
            assert seconds < CALL_TIMEOUT_S + SLACK_S, results
        figures["pending_calls_failed_in_s"] = [round(s, 2) for _, s in results]
        figures["pending_calls_failed_with"] = sorted({name for name, _ in results})

        # While the broker is down, new calls fail within their timeout too.
        during = [await outcome(client.inventory()) for _ in range(2)]
        for name, seconds in during:
            assert name != "answered" and seconds < CALL_TIMEOUT_S + SLACK_S, during
        figures["calls_while_down_failed_in_s"] = [round(s, 2) for _, s in during]
        heartbeats_before = agent.heartbeats_sent
        # A container starts during the outage: the agent keeps the event until it can send.
        assert agent.publisher is not None
        agent.publisher.submit_event(ContainerEvent(
            host=HOST, container_id="c-alice", lease_id=first.lease_id,
            action=ContainerAction.START, at=time.time()))
        await asyncio.sleep(0.5)
        assert agent.heartbeats_sent == heartbeats_before, "nothing to publish to"
        assert agent.publisher.buffered == 1

        figures["broker_start_s"] = round(await asyncio.to_thread(broker.start), 2)
        up_at = time.monotonic()
        figures["outage_s"] = round(up_at - stopped_at, 2)
        figures.update(await recovered(client, up_at))

        # The event kept through the outage arrives: the first lease is bound.
        async def bound():
            lease = await client.status(lease_id=first.lease_id)
            return lease.state is LeaseState.BOUND
        await wait_until(bound, within=RECOVERY_BOUND_S, interval=0.1)
        assert agent.publisher.buffered == 0

        # bob's request may have been recorded before the outage: the retry with its key
        # finds that lease rather than making a second one; a new request works as ever.
        bob = await client.allocate(ask("bob"))
        carol = await client.allocate(ask("carol"))
        assert bob.state is carol.state is LeaseState.GRANTED
        assert len({first.lease_id, bob.lease_id, carol.lease_id}) == 3

        # A second outage, of the broker application only (the Erlang VM stays): robust
        # connections must come back a second time too.
        await asyncio.to_thread(broker.stop_app)
        name, seconds = await outcome(client.inventory())
        assert name != "answered" and seconds < CALL_TIMEOUT_S + SLACK_S
        await asyncio.to_thread(broker.start_app)
        again = await recovered(client, time.monotonic())
        figures["second_outage_client_answered_after_s"] = again["client_answered_after_s"]
        figures["second_outage_heartbeat_after_s"] = again["heartbeat_after_s"]
        dave = await client.allocate(ask("dave"))
        assert dave.state is LeaseState.GRANTED
    finally:
        with contextlib.suppress(Exception):
            await client.close()
        await agent.stop()
        await allocator.stop()

    audit = audit_ledger(ledger_path)
    assert_sound(audit)
    assert sorted(audit.leases_per_key) == ["hub/alice/", "hub/bob/", "hub/carol/", "hub/dave/"]
    assert len(audit.held_gpus) == 4
    report(fault_name("broker_restart", ledger_log), **figures)


def first_attempt_at(log: str) -> float:
    """When (epoch seconds) an allocator's log says its first broker attempt failed: the
    log's timestamps are local time, as ``datetime.timestamp`` reads a naive one."""
    found = re.search(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) .*not reachable "
                      r"\(attempt 1:", log, re.MULTILINE)
    assert found is not None, log[-2000:]
    return datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()


async def test_the_allocator_waits_for_a_broker_that_is_not_up_yet(
        private_rabbitmq, tmp_path: Path, ledger_path: Path) -> None:
    """A first deploy may start the allocator before the broker listens: it keeps trying,
    one log line per attempt without the password, for ``broker_wait_s`` and no longer."""
    broker = private_rabbitmq
    if not port_open("127.0.0.1", broker.port):  # an earlier test of the module left it down
        await asyncio.to_thread(broker.start_app if broker.running() else broker.start)
    await asyncio.to_thread(broker.stop_app)
    try:
        wait_s, attempt_timeout_s = 2.0, 5.0
        impatient = AllocatorProcess("impatient", broker.url, ledger_path, tmp_path,
                                     broker_wait_s=wait_s, request_timeout_s=attempt_timeout_s)
        await impatient.start()
        assert impatient.process is not None
        async with asyncio.timeout(30):
            status = await impatient.process.wait()
        exited_at = time.time()
        assert status != 0, "gave up: the task fails and Swarm restarts it"
        # Bounded by broker_wait_s: pauses of 1 s, then 1 s (what is left of the 2 s), then
        # the last attempt fails and the process exits.
        attempts = re.findall(r"not reachable \(attempt (\d+):", impatient.log())
        assert attempts[:2] == ["1", "2"] and len(attempts) <= 3, impatient.log()[-2000:]
        # Timed from the first attempt's log line, not from the process start (Python's
        # start-up alone takes seconds on a loaded machine): it keeps trying for
        # broker_wait_s, no less, and no longer than that plus its last attempt's timeout.
        tried_for = exited_at - first_attempt_at(impatient.log())
        assert wait_s - SLACK_S <= tried_for <= wait_s + attempt_timeout_s + SLACK_S, tried_for

        patient = AllocatorProcess("patient", broker.url, ledger_path, tmp_path,
                                   broker_wait_s=120)
        await patient.start()
        try:
            async def tried_twice() -> bool:
                return len(re.findall(r"not reachable \(attempt", patient.log())) >= 2
            await wait_until(tried_twice, within=90, interval=0.1)
            assert patient.process is not None and patient.process.returncode is None
            await asyncio.to_thread(broker.start_app)
            await patient.wait_consuming(within=60)
            async with AllocatorClient(broker.url, timeout_s=10) as client:
                inventory = await client.inventory()
            assert inventory.nodes == [], "answered by the allocator that waited"
            for line in patient.log().splitlines():
                if "not reachable" in line:
                    assert "guest:guest" not in line and "@" not in line, line
        finally:
            await patient.stop()
    finally:
        if not port_open("127.0.0.1", broker.port):
            await asyncio.to_thread(broker.start_app)
