"""High availability across nodes: allocator replicas, each with its own ledger, share the
replicated ledger log (``ledger_log = "stream"``, a RabbitMQ stream).

Real allocator processes (``python -m allocator.cli serve``), the real broker, nodes simulated
by their heartbeats. Each replica has a ledger folder of its own, as on two machines.

- **active and its disk lost**: the active process is killed with SIGKILL and its ledger
  folder removed; the standby, on its own ledger, takes over with the whole ledger: granted
  but unbound leases, the queue in order, history. Bounded: first answer <= 5 s.
- **standby on another, an empty or an older ledger** (the double booking measured before
  the log existed: a standby with its own ledger took over and granted GPUs the active one
  had granted): another cluster's ledger is refused (the process exits saying why and never
  serves); an empty one replays the log; an older copy catches up. 0 double-booked.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from faults import AllocatorProcess, assert_sound, audit_ledger, backup_ledger, report
from support import RTX3090, NodeSimulator, gpus, wait_until

from allocator.client import AllocatorClient, AllocatorError, AllocatorTimeout
from allocator.ledger import Changes, Ledger
from allocator.protocol import AllocateRequest, ErrorCode, Lease, LeaseState

HOSTS = ("gpu-a", "gpu-b")
GPUS_PER_HOST = 4
TAKEOVER_BOUND_S = 5.0
LOG: dict[str, Any] = {"ledger_log": "stream", "node_down_after_s": 30,
                       "container_gone_grace_s": 0.5}


async def beat_forever(url: str, stop: asyncio.Event) -> None:
    async with NodeSimulator(url) as nodes:
        inventory = {h: gpus(h, RTX3090, GPUS_PER_HOST) for h in HOSTS}
        while not stop.is_set():
            for host, gpu_list in inventory.items():
                await nodes.beat(host, gpu_list)
            await asyncio.sleep(0.3)


@contextlib.asynccontextmanager
async def heartbeats(url: str):
    stop = asyncio.Event()
    task = asyncio.create_task(beat_forever(url, stop))
    try:
        yield
    finally:
        stop.set()
        await task


async def first_answer_after(client: AllocatorClient, since: float) -> float:
    while True:
        try:
            await client.inventory(timeout_s=0.5)
            return time.monotonic() - since
        except AllocatorTimeout:
            continue


async def cluster_up(client: AllocatorClient) -> None:
    async def up() -> bool:
        inventory = await client.inventory()
        return sum(n.up for n in inventory.nodes) == len(HOSTS)
    await wait_until(up, within=30)


def ask(user: str, **fields: Any) -> AllocateRequest:
    return AllocateRequest.model_validate({"request_key": f"hub/{user}/", "user": user,
                                           **fields})


@pytest.mark.slow
async def test_the_active_and_its_disk_lost_the_standby_takes_over_with_the_whole_ledger(
        amqp_vhost, tmp_path: Path) -> None:
    url = amqp_vhost.url
    ledger_a, ledger_b = tmp_path / "a" / "ledger.sqlite", tmp_path / "b" / "ledger.sqlite"
    active = AllocatorProcess("a", url, ledger_a, tmp_path, **LOG)
    standby = AllocatorProcess("b", url, ledger_b, tmp_path, **LOG)
    try:
        await active.start()
        await active.wait_consuming()
        async with heartbeats(url), AllocatorClient(url, timeout_s=5) as client:
            await cluster_up(client)
            await standby.start()
            await standby.wait_consuming()
            # History: three leases granted and force-released again.
            for n in range(3):
                done = await client.allocate(ask(f"past{n}"))
                await client.release(lease_id=done.lease_id, force=True, by="test",
                                     reason="history")
            # gpu-a full with four granted leases no container has bound yet, and two
            # requests waiting for gpu-a in the queue.
            granted = [await client.allocate(ask(f"g{n}", host="gpu-a")) for n in range(4)]
            queued = [await client.allocate(ask(f"q{n}", host="gpu-a", wait_s=600))
                      for n in range(2)]
            assert all(q.state is LeaseState.QUEUED for q in queued)
            before = {lease.lease_id: lease for lease in
                      (await client.inventory(include_leases=True)).leases or []}
            order = [lease.lease_id for lease in await client.queue()]

            active.kill()
            killed_at = time.monotonic()
            await active.process.wait()  # type: ignore[union-attr]
            await asyncio.to_thread(shutil.rmtree, ledger_a.parent)
            takeover_s = await first_answer_after(client, killed_at)
            assert takeover_s <= TAKEOVER_BOUND_S

            after = {lease.lease_id: lease for lease in
                     (await client.inventory(include_leases=True)).leases or []}
            assert {i: (lease.state, lease.host, lease.gpu_uuids) for i, lease in after.items()} \
                == {i: (lease.state, lease.host, lease.gpu_uuids) for i, lease in before.items()}
            assert [lease.lease_id for lease in await client.queue()] == order
            for n in range(3):
                past = await client.status(request_key=f"hub/past{n}/")
                assert past.state is LeaseState.RELEASED, "history came along"
            # New grants avoid every GPU the lost active had granted.
            held = {u for lease in granted for u in lease.gpu_uuids}
            double_booked = 0
            more = [await client.allocate(ask(f"new{n}")) for n in range(GPUS_PER_HOST)]
            double_booked += sum(len(held & set(lease.gpu_uuids)) for lease in more)
            with pytest.raises(AllocatorError) as full:
                await client.allocate(ask("one-too-many"))
            assert full.value.code is ErrorCode.NO_CAPACITY
            assert double_booked == 0
        assert await standby.stop() == 0, standby.log()[-3000:]
    finally:
        for process in (active, standby):
            await process.stop()
    audit = audit_ledger(ledger_b)
    assert_sound(audit)
    assert len(audit.leases) == len(before) + 3 + GPUS_PER_HOST
    report("active_and_disk_lost", takeover_s=round(takeover_s, 3), leases_kept=len(after),
           granted_unbound_kept=len(granted), queued_kept_in_order=len(order),
           history_kept=3, lost=0, double_booked=double_booked)


def another_clusters_ledger(path: Path) -> None:
    """A ledger that was never part of this log (another cluster's, an old single-node one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(path)
    ledger.open()
    changes = Changes()
    changes.nodes["gpu-a"] = {"host": "gpu-a", "agent_id": "x", "last_heartbeat": 1.0,
                              "drained": 0}
    ledger.call(lambda: ledger.commit(changes))
    ledger.close()


@pytest.mark.slow
@pytest.mark.parametrize("ledger", ["another", "empty", "older"])
async def test_a_standby_on_another_empty_or_older_ledger_never_double_books(
        amqp_vhost, tmp_path: Path, ledger: str) -> None:
    url = amqp_vhost.url
    ledger_a, ledger_b = tmp_path / "a" / "ledger.sqlite", tmp_path / "b" / "ledger.sqlite"
    active = AllocatorProcess("a", url, ledger_a, tmp_path, **LOG)
    standby = AllocatorProcess("b", url, ledger_b, tmp_path, **LOG)
    if ledger == "another":
        another_clusters_ledger(ledger_b)
    try:
        await active.start()
        await active.wait_consuming()
        async with heartbeats(url), AllocatorClient(url, timeout_s=5) as client:
            await cluster_up(client)
            granted: list[Lease] = []
            for n in range(len(HOSTS) * GPUS_PER_HOST):
                if n == GPUS_PER_HOST and ledger == "older":
                    await asyncio.to_thread(backup_ledger, ledger_a, ledger_b)
                granted.append(await client.allocate(ask(f"user{n}")))
            held = {u for lease in granted for u in lease.gpu_uuids}
            assert len(held) == len(HOSTS) * GPUS_PER_HOST  # every GPU granted, none bound
            await standby.start()
            if ledger == "another":
                assert await asyncio.wait_for(standby.process.wait(), 30) == 1  # type: ignore[union-attr]
                assert "not the history" in standby.log()
            else:
                await standby.wait_consuming()
            active.kill()
            await active.process.wait()  # type: ignore[union-attr]
            killed_at = time.monotonic()
            answered: list[Lease] = []
            refused = unanswered = 0
            for n in range(20):
                try:
                    answered.append(await client.allocate(ask(f"after{n}"), timeout_s=1.0))
                except AllocatorTimeout:
                    unanswered += 1
                except AllocatorError as exc:
                    assert exc.code is ErrorCode.NO_CAPACITY, exc
                    refused += 1
            double_booked = sum(len(held & set(lease.gpu_uuids)) for lease in answered)
            assert double_booked == 0
            if ledger == "another":
                assert unanswered == 20, "nobody serves from a ledger that is not the log's"
            else:
                assert refused == 20, "the replica knows every GPU is granted"
                for lease in granted:
                    kept = await client.status(lease_id=lease.lease_id)
                    assert (kept.state, kept.gpu_uuids) == (LeaseState.GRANTED, lease.gpu_uuids)
            seconds = time.monotonic() - killed_at
    finally:
        for process in (active, standby):
            await process.stop()
    if ledger != "another":
        assert_sound(audit_ledger(ledger_b))
    report(f"standby_on_{ledger}_ledger", granted_before=len(granted), answered=len(answered),
           refused=refused, unanswered=unanswered, double_booked=double_booked,
           served=ledger != "another", after_kill_s=round(seconds, 2))
