"""High availability across nodes: allocator replicas, each with its own ledger, share the
replicated ledger log (``ledger_log = "stream"``, a RabbitMQ stream).

Real allocator processes (``python -m allocator.admin.cli serve``), the real broker, nodes simulated
by their heartbeats. Each replica has a ledger folder of its own, as on two machines.

- **active and its disk lost**: the active process is killed with SIGKILL and its ledger
  folder removed; the standby, on its own ledger, takes over with the whole ledger: granted
  but unbound leases, the queue in order, history. Bounded: first answer <= 5 s.
- **two actives** (the active stopped with SIGSTOP until the broker closed its connection,
  the standby took over, then SIGCONT): the resumed one decides nothing of what it held and
  never writes again; both ledgers hold one history.
- **standby on another, an empty or an older ledger** (the double booking measured before
  the log existed: a standby with its own ledger took over and granted GPUs the active one
  had granted): another cluster's ledger is refused (the process exits saying why and never
  serves); an empty one replays the log; an older copy catches up. 0 double-booked.

Only with the replicated log: every fault here is one of the log (a claim, a stream's
retention, a replica's place in the log), which does not exist without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from allocator.amqp.client import AllocatorClient, AllocatorError, AllocatorTimeout
from allocator.ledger.changes import Changes
from allocator.ledger.store import Ledger
from allocator.wire.protocol import AllocateRequest, ErrorCode, Lease, LeaseState
from tests.support.common import RTX3090, beat_until, gpus, wait_until
from tests.support.faults import (
    AllocatorProcess,
    CycleLoad,
    assert_one_lease_per_answer,
    assert_sound,
    audit_ledger,
    backup_ledger,
    cycle,
    first_kept_offset,
    lease_states,
    report,
)

HOSTS = ("gpu-a", "gpu-b")
GPUS_PER_HOST = 4
TAKEOVER_BOUND_S = 5.0
LOG: dict[str, Any] = {"ledger_log": "stream", "node_down_after_s": 30,
                       "container_gone_grace_s": 0.5}


async def beat_forever(url: str, stop: asyncio.Event) -> None:
    await beat_until(url, {h: gpus(h, RTX3090, GPUS_PER_HOST) for h in HOSTS}, stop, 0.3)


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



async def fill_the_rest(client, granted, ask) -> int:
    """Grant every GPU left free (GPUS_PER_HOST of them), check that one more finds none, and
    return how many of the new grants hold a GPU one of ``granted`` holds (double-booked)."""
    held = {u for lease in granted for u in lease.gpu_uuids}
    more = [await client.allocate(ask(f"new{n}")) for n in range(GPUS_PER_HOST)]
    with pytest.raises(AllocatorError) as full:
        await client.allocate(ask("one-too-many"))
    assert full.value.code is ErrorCode.NO_CAPACITY
    return sum(len(held & set(lease.gpu_uuids)) for lease in more)

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
            double_booked = await fill_the_rest(client, granted, ask)
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


HEARTBEAT_S = 2
"""The AMQP heartbeat the stopped allocator asks for: the broker closes its connection after
about two heartbeats missed (aio-pika's default is 60 s)."""
WORKERS = 2
CYCLES_AFTER_RESUME = 6
WRITER_LINE = "this allocator is the writer (epoch {epoch})"


async def logged(process: AllocatorProcess, text: str, within: float) -> float:
    """Seconds until ``text`` is in the process's log."""
    started = time.monotonic()
    while text not in process.log():
        assert time.monotonic() - started < within, \
            f"{process.name} did not log {text!r} within {within}s:\n{process.log()[-3000:]}"
        await asyncio.sleep(0.1)
    return time.monotonic() - started


@pytest.mark.slow
async def test_two_actives_the_one_stopped_past_its_heartbeat_timeout_does_not_write_again(
        amqp_vhost, tmp_path: Path) -> None:
    """Two actives as real processes. The active allocator is stopped (SIGSTOP) under a
    stream of requests, with the requests the broker had given it in hand, until the broker
    closes its connection (heartbeat timeout): single-active-consumer hands the queue to the
    standby, which claims the log (epoch 2) and serves. Then the stopped one resumes
    (SIGCONT), still holding those requests and the belief that it writes (epoch 1). It must
    not decide them (the broker gave them to the new active one), and nothing it might still
    append is applied (epoch 1 is fenced by 2). Clients retry with their request keys."""
    url = amqp_vhost.url
    ledger_a, ledger_b = tmp_path / "a" / "ledger.sqlite", tmp_path / "b" / "ledger.sqlite"
    first = AllocatorProcess("first", f"{url}?heartbeat={HEARTBEAT_S}", ledger_a, tmp_path,
                             **LOG)
    second = AllocatorProcess("second", url, ledger_b, tmp_path, **LOG)
    load = CycleLoad()
    try:
        await first.start()
        await first.wait_consuming()
        async with heartbeats(url), AllocatorClient(url, timeout_s=5) as client:
            await cluster_up(client)
            await second.start()
            await second.wait_consuming()

            async def under_load() -> bool:
                return len(load.granted) >= 10

            async with asyncio.timeout(180):
                workers = [asyncio.create_task(cycle(
                    n, url, load, cycles_after_fault=CYCLES_AFTER_RESUME))
                    for n in range(WORKERS)]
                await wait_until(under_load, within=60)
                assert first.process is not None
                first.process.send_signal(signal.SIGSTOP)
                stopped_at = time.monotonic()
                takeover_s = await logged(second, WRITER_LINE.format(epoch=2), within=60)
                before = len(load.answers_at)

                async def served_meanwhile() -> bool:
                    return len(load.answers_at) >= before + 20
                await wait_until(served_meanwhile, within=60)
                answered_while_stopped = len(load.answers_at) - before
                first.process.send_signal(signal.SIGCONT)
                stopped_s = time.monotonic() - stopped_at
                load.fault_at = time.monotonic()
                await asyncio.gather(*workers)
            assert first.process.returncode is None, first.log()[-3000:]
            # The resumed one never claimed the log again while the other was active, and
            # the new active one was never deposed.
            first_log, second_log = first.log(), second.log()
            assert WRITER_LINE.format(epoch=3) not in first_log + second_log
            assert "batch fenced" not in second_log
            # It is a working standby: with the other stopped it takes over and serves.
            stopping = time.monotonic()
            assert await second.stop() == 0, second_log[-3000:]
            await logged(first, WRITER_LINE.format(epoch=3), within=60)
            handover_s = time.monotonic() - stopping
            key = "hub/after/"
            load.granted[key] = await client.allocate(AllocateRequest(request_key=key,
                                                                      user="after"))
            await client.release(lease_id=load.granted[key].lease_id, force=True, by="test")
        assert await first.stop() == 0, first.log()[-3000:]
    finally:
        for process in (first, second):
            if process.process is not None and process.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.process.send_signal(signal.SIGCONT)
            await process.stop()
    stale = sum(int(n) for n in re.findall(r"dropped (\d+) message\(s\) whose channel", first_log))
    fenced = second_log.count("skipped a batch of writer")
    audit = audit_ledger(ledger_a)
    assert_sound(audit)
    assert_one_lease_per_answer(audit, load)
    # One history in both copies (the second stopped before the last lease).
    after = load.granted[key].lease_id
    assert {i: v for i, v in lease_states(ledger_a).items() if i != after} == \
        lease_states(ledger_b)
    assert_sound(audit_ledger(ledger_b))
    report("two_actives_stopped_past_heartbeat_timeout", stopped_s=round(stopped_s, 2),
           takeover_after_stop_s=round(takeover_s, 2), handover_back_s=round(handover_s, 2),
           answered_by_the_new_active_while_stopped=answered_while_stopped,
           stale_deliveries_dropped_on_resume=stale, batches_fenced_by_epoch=fenced,
           requests=len(load.granted) * 2, calls=load.calls, retried=dict(load.retried),
           longest_gap_s=round(load.longest_gap_s(), 2), double_booked=len(audit.double_booked))


SMALL_LOG: dict[str, Any] = {**LOG, "ledger_log_max_bytes": 256 << 10,
                             "ledger_log_segment_bytes": 16 << 10,
                             "ledger_log_snapshot_bytes": 48 << 10}
"""A log stream RabbitMQ really truncates within the test: 256 KiB kept in 16 KiB segments,
a snapshot every 48 KiB."""


@pytest.mark.slow
async def test_a_standby_that_caught_up_from_a_snapshot_takes_over_without_double_booking(
        amqp_vhost, tmp_path: Path) -> None:
    """The log's start is gone from the stream before the standby first starts, on an empty
    ledger: it loads the newest snapshot and follows the log from there. Then the active one
    is killed: the standby serves with the granted-but-unbound leases and the queue it got
    from the snapshot and the entries after it, and grants no GPU twice."""
    url = amqp_vhost.url
    ledger_a, ledger_b = tmp_path / "a" / "ledger.sqlite", tmp_path / "b" / "ledger.sqlite"
    active = AllocatorProcess("a", url, ledger_a, tmp_path, **SMALL_LOG)
    standby = AllocatorProcess("b", url, ledger_b, tmp_path, **SMALL_LOG)
    try:
        await active.start()
        await active.wait_consuming()
        async with heartbeats(url), AllocatorClient(url, timeout_s=5) as client:
            await cluster_up(client)
            # History, until RabbitMQ has dropped the log's oldest segments.
            past = 0
            while past % 10 or await first_kept_offset(url) == 0:
                done = await client.allocate(ask(f"past{past}"))
                await client.release(lease_id=done.lease_id, force=True, by="test",
                                     reason="history")
                past += 1
                assert past < 1000, "the log stream is not truncated"
            granted = [await client.allocate(ask(f"g{n}", host="gpu-a")) for n in range(4)]
            queued = [await client.allocate(ask(f"q{n}", host="gpu-a", wait_s=600))
                      for n in range(2)]
            assert all(q.state is LeaseState.QUEUED for q in queued)
            started = time.monotonic()
            await standby.start()
            await standby.wait_consuming()
            await logged(standby, "loaded the snapshot", within=60)
            catch_up_s = time.monotonic() - started
            assert "catching up from the log's newest snapshot" in standby.log()
            before = {lease.lease_id: lease for lease in
                      (await client.inventory(include_leases=True)).leases or []}
            order = [lease.lease_id for lease in await client.queue()]

            active.kill()
            killed_at = time.monotonic()
            await active.process.wait()  # type: ignore[union-attr]
            takeover_s = await first_answer_after(client, killed_at)
            assert takeover_s <= TAKEOVER_BOUND_S

            after = {lease.lease_id: lease for lease in
                     (await client.inventory(include_leases=True)).leases or []}
            assert {i: (lease.state, lease.host, lease.gpu_uuids) for i, lease in after.items()} \
                == {i: (lease.state, lease.host, lease.gpu_uuids) for i, lease in before.items()}
            assert [lease.lease_id for lease in await client.queue()] == order
            oldest = await client.status(request_key="hub/past0/")
            assert oldest.state is LeaseState.RELEASED, "finished leases are in the snapshot"
            double_booked = await fill_the_rest(client, granted, ask)
            assert double_booked == 0
        assert await standby.stop() == 0, standby.log()[-3000:]
    finally:
        for process in (active, standby):
            await process.stop()
    audit = audit_ledger(ledger_b)
    assert_sound(audit)
    assert len(audit.leases) == past + len(granted) + len(queued) + GPUS_PER_HOST
    report("standby_caught_up_from_snapshot_takes_over", history_leases=past,
           catch_up_s=round(catch_up_s, 2), takeover_s=round(takeover_s, 3),
           leases_kept=len(after), queued_kept_in_order=len(order), lost=0,
           double_booked=double_booked)
