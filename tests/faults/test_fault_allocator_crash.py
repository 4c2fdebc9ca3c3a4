"""``kill -9`` of the active allocator under a stream of requests: the standby takes over.

Two real allocator processes (``python -m allocator.admin.cli serve``) consume one quorum queue with
single-active-consumer; the second is a standby. Both ways of keeping the ledger
(``ledger_log``): one ledger file they share (``off``), or the replicated log (``stream``),
each process applying it to a file of its own; there the standby takes over by claiming the
log, and the replacement started without a standby carries on from the killed one's file and
the log. Sixteen clients
allocate with distinct request keys (half of them stop their server again right away) and
retry with the **same** request key whenever a call times out or the broker is unavailable.
The active allocator is killed with SIGKILL in the middle of the stream.

Two ways back are tested: a standby already waiting (it takes over as soon as the broker
sees the dead consumer's connection close), and no standby, with a replacement started
a few seconds later (every call in flight times out and is retried with its request key;
the requests that waited past their deadline are dropped unanswered, never granted).

Promises checked: every request ends with exactly one lease, the one its client was told
about; no lease exists that no client asked for; no GPU is in two leases; the GPUs held are
exactly those of the leases still held; the invariant checker finds nothing. The takeover
time (kill -> first reply from the standby) is measured and bounded.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from allocator.amqp.client import AllocatorClient, AllocatorTimeout, AllocatorUnavailable
from allocator.wire.protocol import AllocateRequest, Lease, LeaseState, ReleaseReason
from tests.support.common import RTX3090, NodeSimulator, gpus, wait_until
from tests.support.faults import (
    LEDGER_LOGS,
    AllocatorProcess,
    assert_sound,
    audit_ledger,
    fault_name,
    gpu_ledger_check,
    replica_ledger,
    report,
)

pytestmark = pytest.mark.slow  # real processes, brokers and engines: seconds each

HOSTS = 12
GPUS_PER_HOST = 16
WORKERS = 16
REQUESTS_PER_WORKER = 12
CALL_TIMEOUT_S = 2.0
KILL_AFTER_ANSWERS = 60
TAKEOVER_BOUND_S = 5.0
"""The standby must answer within this of the kill (measured: well under a second)."""
RESTART_DELAY_S = 2.5
"""Without a standby, the replacement starts this long after the kill (> a call timeout)."""
RUN_BOUND_S = 120.0


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    retried: int = 0
    unavailable: int = 0
    granted: dict[str, Lease] = field(default_factory=dict)
    """request key -> the lease its client was told about (first and only answer)."""
    released: set[str] = field(default_factory=set)


async def call_until_answered(tally: Tally, call):
    """Call until the allocator answers; a timeout or outage is retried as it is."""
    while True:
        tally.sent += 1
        try:
            result = await call()
        except AllocatorTimeout:
            tally.retried += 1
            continue
        except AllocatorUnavailable:
            tally.retried += 1
            tally.unavailable += 1
            await asyncio.sleep(0.1)
            continue
        tally.answered += 1
        return result


async def worker(number: int, url: str, tally: Tally, answered: asyncio.Event) -> None:
    async with AllocatorClient(url, timeout_s=CALL_TIMEOUT_S, connect_timeout_s=2) as client:
        for i in range(REQUESTS_PER_WORKER):
            key = f"hub/user{number}/server{i}"
            request = AllocateRequest(request_key=key, user=f"user{number}")
            lease = await call_until_answered(tally, lambda r=request: client.allocate(r))
            assert key not in tally.granted
            assert lease.request_key == key and lease.state is LeaseState.GRANTED
            tally.granted[key] = lease
            if len(tally.granted) >= KILL_AFTER_ANSWERS:
                answered.set()
            if i % 2:
                # The hub stops this server again: the lease becomes releasing, and the next
                # heartbeat (which lists no container for it) frees its GPU.
                stopped = await call_until_answered(
                    tally, lambda i=lease.lease_id: client.release(lease_id=i))
                assert stopped.lease_id == lease.lease_id
                tally.released.add(key)


async def heartbeats(url: str, stop: asyncio.Event) -> None:
    async with NodeSimulator(url) as nodes:
        inventory = {f"gpu-{h:02d}": gpus(f"gpu-{h:02d}", RTX3090, GPUS_PER_HOST)
                     for h in range(HOSTS)}
        while not stop.is_set():
            for host, gpu_list in inventory.items():
                await nodes.beat(host, gpu_list)
            await asyncio.sleep(0.5)


async def first_answer_after(url: str, since: float) -> float:
    """Seconds from ``since`` (monotonic) to the first reply of any allocator."""
    async with AllocatorClient(url, timeout_s=0.5, connect_timeout_s=2) as probe:
        while True:
            try:
                await probe.inventory()
            except (AllocatorTimeout, AllocatorUnavailable):
                continue
            return time.monotonic() - since


@pytest.mark.slow
@pytest.mark.parametrize("ledger_log", LEDGER_LOGS)
@pytest.mark.parametrize("recovery", ["standby", "restart"])
async def test_kill_9_of_the_allocator_loses_nothing_and_doubles_nothing(
        amqp_vhost, tmp_path: Path, ledger_path: Path, recovery: str, ledger_log: str) -> None:
    url = amqp_vhost.url
    settings = {"container_gone_grace_s": 0.5, "node_down_after_s": 30,
                "ledger_log": ledger_log}
    # The replacement started without a standby is the killed task restarted on its node:
    # its ledger file is the killed one's. A standby is another replica, on its own disk.
    survivor_ledger = replica_ledger(ledger_path, "second", ledger_log) \
        if recovery == "standby" else ledger_path
    active = AllocatorProcess("active", url, ledger_path, tmp_path, **settings)
    second = AllocatorProcess("second", url, survivor_ledger, tmp_path, **settings)
    stop_beating = asyncio.Event()
    beating: asyncio.Task[None] | None = None
    try:
        await active.start()
        await active.wait_consuming()
        beating = asyncio.create_task(heartbeats(url, stop_beating))
        async with AllocatorClient(url, timeout_s=5) as client:
            async def cluster_up():
                inventory = await client.inventory()
                return sum(node.up for node in inventory.nodes) == HOSTS
            await wait_until(cluster_up, within=20)
        if recovery == "standby":
            # Started second: single-active-consumer keeps it waiting while the first lives.
            await second.start()
            await second.wait_consuming()

        tally = Tally()
        answered = asyncio.Event()
        async with asyncio.timeout(RUN_BOUND_S):
            workers = [asyncio.create_task(worker(n, url, tally, answered))
                       for n in range(WORKERS)]
            await answered.wait()
            active.kill()
            killed_at = time.monotonic()
            answered_before_kill = len(tally.granted)
            if recovery == "restart":
                await asyncio.sleep(RESTART_DELAY_S)
                await second.start()
            takeover_s = await first_answer_after(url, killed_at)
            await asyncio.gather(*workers)
            run_s = time.monotonic() - killed_at
        assert answered_before_kill < WORKERS * REQUESTS_PER_WORKER, "killed mid-stream"
        bound = TAKEOVER_BOUND_S + (RESTART_DELAY_S + 10 if recovery == "restart" else 0)
        assert takeover_s < bound

        # Let heartbeats finish the stopped servers, then stop everything for the audit.
        async with AllocatorClient(url, timeout_s=5) as client:
            async def settled():
                leases = (await client.inventory(include_leases=True)).leases or []
                return not any(lease.state is LeaseState.RELEASING for lease in leases)
            await wait_until(settled, within=20)
        stop_beating.set()
        await beating
        assert await second.stop() == 0, second.log()[-3000:]
    finally:
        stop_beating.set()
        if beating is not None and not beating.done():
            beating.cancel()
        for process in (active, second):
            await process.stop()

    audit = audit_ledger(survivor_ledger)
    assert_sound(audit)
    checked = gpu_ledger_check(survivor_ledger)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    keys = {f"hub/user{n}/server{i}" for n in range(WORKERS) for i in range(REQUESTS_PER_WORKER)}
    assert set(tally.granted) == keys, "every request was answered in the end"
    # Exactly one lease per request, and it is the one the client was told about: no lease
    # granted twice, none granted to nobody.
    assert set(audit.leases_per_key) == keys
    assert set(audit.leases_per_key.values()) == {1}, "a request key with two leases"
    assert {row["request_key"]: lease_id for lease_id, row in audit.leases.items()} == {
        key: lease.lease_id for key, lease in tally.granted.items()}
    holding = audit.holding()
    kept = {tally.granted[k].lease_id for k in keys - tally.released}
    leaked = [u for i, row in holding.items() if i not in kept for u in row["gpu_uuids"]]
    assert leaked == [], "GPUs held by leases whose server was stopped"
    for lease_id, row in audit.leases.items():
        if row["request_key"] in tally.released:
            assert (row["state"], row["release_reason"]) == (
                "released", ReleaseReason.STOPPED.value), (lease_id, row)
        else:
            assert row["state"] == "granted", (lease_id, row)
    assert set(holding) == kept
    assert len(audit.held_gpus) == len(kept), "GPUs held == leases granted and kept"
    if recovery == "restart":
        assert tally.retried > 0, "calls in flight at the kill were retried"

    report(fault_name(f"allocator_kill_9_{recovery}", ledger_log), requests=len(keys),
           calls_sent=tally.sent, answered=tally.answered, retried=tally.retried,
           unavailable=tally.unavailable,
           answered_before_kill=answered_before_kill, leases=len(audit.leases),
           held_gpus=len(audit.held_gpus), leaked=len(leaked),
           double_booked=len(audit.double_booked), takeover_s=round(takeover_s, 3),
           finish_after_kill_s=round(run_s, 2))
