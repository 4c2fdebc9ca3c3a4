"""Disk trouble under the ledger: full, or turned read-only by a disk error.

The ledger lives on a small ext4 filesystem of its own (a loop device, ``errors=remount-ro``),
which the test fills up, or makes the kernel remount read-only as it does on a disk error.

Both ways of keeping the ledger (``ledger_log``) where the fault means something in both.
Without the log (``off``) a decision is written to the ledger file before it is answered:

- a request whose decision cannot be written is answered ``storage_error`` with a message
  that says so and that nothing was granted; nothing is granted that is not on disk (the
  allocator's memory and every lease a client was told about match the ledger);
- the consumer keeps answering throughout;
- disk full: when space returns, the same requests (same request keys) succeed, without
  restarting anything;
- read-only: after the operator's repair (unmount, fsck, mount) a restarted allocator
  carries on from what is on disk; an allocator started on a read-only ledger exits at once
  with a one-line error naming the ledger.

With the replicated log (``stream``) a decision is in the log before any replica writes it to
its file: a disk that refuses the write is that replica's trouble, not the log's. The replica
stops serving (nothing is answered; the requests wait in the queue, or go to another replica),
keeps following the log, writes the entry again until its disk takes it, and serves again:
the entry applied once, and its requests, asked again with their keys, answered from it. It
does not stop for good (Swarm would restart it in a loop on the same disk).
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import pytest

from allocator.amqp.client import AllocatorClient, AllocatorError, AllocatorTimeout
from allocator.wire.protocol import AllocateRequest, ErrorCode, Lease, LeaseState
from tests.support.common import GTX1070, NodeSimulator, gpus, wait_until
from tests.support.faults import (
    LEDGER_LOGS,
    REPO_ROOT,
    allocator_env,
    assert_sound,
    audit_ledger,
    fault_name,
    lease_states,
    leases_granted_in,
    log_entries,
    report,
    running_allocator,
    small_disk,
)

pytestmark = pytest.mark.slow  # real processes, brokers and engines: seconds each

GPUS = 16

T = TypeVar("T")


def ask(key: str) -> AllocateRequest:
    return AllocateRequest(request_key=f"hub/{key}/", user=key)


async def free_gpus(client: AllocatorClient) -> int:
    return sum(model.free for model in (await client.inventory()).models)


async def cluster(client: AllocatorClient, nodes: NodeSimulator) -> None:
    await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, GPUS))

    async def up():
        return [n for n in (await client.inventory()).nodes if n.up]
    await wait_until(up)


async def answered(call: Callable[[], Awaitable[T]], within: float = 30.0) -> T:
    """``call()`` until it is answered (a timeout is asked again, as a client would)."""
    async with asyncio.timeout(within):
        while True:
            try:
                return await call()
            except AllocatorTimeout:
                continue


async def serve_once(env: dict[str, str]) -> tuple[int | None, list[str]]:
    """``gpu-allocator serve`` expected to exit at once: its exit status and its stderr lines."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "allocator.admin.cli", "serve", cwd=REPO_ROOT, env=env,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        async with asyncio.timeout(30):
            _, err = await process.communicate()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    return process.returncode, err.decode().strip().splitlines()


def storage_error_text(exc: AllocatorError) -> str:
    assert exc.code is ErrorCode.STORAGE_ERROR, exc
    assert "could not record" in exc.message and "nothing was granted" in exc.message
    return exc.message


# Without the log only: with it, a full disk stops the replica from serving instead
# (test_disk_full_in_stream_mode_..., below).
async def test_disk_full_answers_storage_error_grants_nothing_and_recovers(amqp_vhost,
                                                                          tmp_path: Path):
    with small_disk(tmp_path) as disk:
        ledger_path = disk.mountpoint / "ledger.sqlite"
        granted: dict[str, Lease] = {}
        refused: list[str] = []
        async with (running_allocator(amqp_vhost.url, ledger_path) as allocator,
                    AllocatorClient(amqp_vhost.url, timeout_s=10) as client,
                    NodeSimulator(amqp_vhost.url) as nodes):
            await cluster(client, nodes)
            granted["first"] = await client.allocate(ask("first"))
            filled = disk.fill()

            # SQLite may still find room in its write-ahead log for a few commits; those are
            # on disk. Ask until the disk says no, three times.
            for i in range(60):
                key = f"user{i}"
                try:
                    granted[key] = await client.allocate(ask(key))
                except AllocatorError as exc:
                    message = storage_error_text(exc)
                    refused.append(key)
                    if len(refused) == 3:
                        break
            assert len(refused) == 3, "the full disk never refused a write"
            assert "full" in message, message
            # Nothing granted that is not written: memory was rebuilt from the ledger.
            assert await free_gpus(client) == GPUS - len(granted)
            for lease in granted.values():
                assert (await client.status(lease_id=lease.lease_id)).state is LeaseState.GRANTED
            assert allocator.stats.counters["commit_failures"] >= 3

            disk.free()
            for key in refused:
                granted[key] = await client.allocate(ask(key))
            assert await free_gpus(client) == GPUS - len(granted)
        audit = audit_ledger(ledger_path)
    assert_sound(audit)
    # The ledger holds exactly the leases the clients were told about.
    assert {row["request_key"]: i for i, row in audit.leases.items()} == {
        f"hub/{key}/": lease.lease_id for key, lease in granted.items()}
    report("disk_full", filler_bytes=filled, granted_while_full=len(granted) - 1 - len(refused),
           storage_errors=len(refused), granted_after_space_returned=len(refused),
           message=message, leaked=0, double_booked=len(audit.double_booked))


@pytest.mark.parametrize("ledger_log", LEDGER_LOGS)
async def test_read_only_disk_answers_storage_error_and_a_restart_carries_on(
        amqp_vhost, tmp_path: Path, ledger_log: str):
    """``stream``: the replica stops serving instead of answering ``storage_error``; after
    the repair, the restarted replica applies the entry it could not write, and the refused
    request, asked again, is answered from it."""
    with small_disk(tmp_path) as disk:
        ledger_path = disk.mountpoint / "ledger.sqlite"
        async with (AllocatorClient(amqp_vhost.url, timeout_s=10) as client,
                    NodeSimulator(amqp_vhost.url) as nodes):
            async with running_allocator(amqp_vhost.url, ledger_path,
                                         ledger_log=ledger_log) as allocator:
                await cluster(client, nodes)
                first = await client.allocate(ask("first"))
                disk.fail()  # the kernel remounts the filesystem read-only
                if ledger_log == "off":
                    with pytest.raises(AllocatorError) as refused:
                        await client.allocate(ask("second"))
                    message = storage_error_text(refused.value)
                    # Still answering, and nothing of the refused request is in memory.
                    assert await free_gpus(client) == GPUS - 1
                    assert (await client.status(lease_id=first.lease_id)).state is \
                        LeaseState.GRANTED
                else:
                    with pytest.raises(AllocatorTimeout):
                        await client.allocate(ask("second"), timeout_s=2)
                    replicated = allocator.log
                    assert replicated is not None
                    message = str(replicated.store.failure)
                    assert await allocator.is_standby()
                    assert not allocator.failed.is_set(), allocator.failure
                assert "read-only" in message, message
            disk.repair()
            async with running_allocator(amqp_vhost.url, ledger_path, ledger_log=ledger_log):
                await nodes.beat("gpu-a")
                again = await client.allocate(ask("first"))
                assert again.lease_id == first.lease_id, "the restart carried on from the disk"
                second = await client.allocate(ask("second"))
                assert second.state is LeaseState.GRANTED
                assert await free_gpus(client) == GPUS - 2
        audit = audit_ledger(ledger_path)
    assert_sound(audit)
    assert sorted(audit.leases) == sorted([first.lease_id, second.lease_id])
    report(fault_name("disk_read_only", ledger_log), message=message, leaked=0,
           double_booked=len(audit.double_booked))


# Not in both modes: the ledger file is opened, and refused, before anything of the log
# is followed; the same open runs in either.
async def test_allocator_refuses_to_start_on_a_read_only_ledger(amqp_vhost, tmp_path: Path):
    with small_disk(tmp_path) as disk:
        ledger_path = disk.mountpoint / "ledger.sqlite"
        async with running_allocator(amqp_vhost.url, ledger_path):
            pass  # creates the ledger
        disk.remount_readonly()
        status, lines = await serve_once(allocator_env(amqp_vhost.url, ledger_path))
    assert status == 1
    assert len(lines) == 1 and lines[0].startswith("gpu-allocator: "), lines
    assert str(ledger_path) in lines[0] and "read-only" in lines[0], lines[0]
    report("disk_read_only_at_start", exit_status=1, message=lines[0])



@pytest.mark.parametrize("recovery", ["in_place", "restarted"])
async def test_disk_full_in_stream_mode_stops_serving_and_resumes_with_nothing_lost_or_doubled(
        amqp_vhost, tmp_path: Path, recovery: str):
    """With the replicated log a decision is in the log before this replica writes it: a full
    disk is this replica's trouble, not the log's. It follows without serving (its batch goes
    back to the queue, unanswered), writes the entry again until the disk takes it, and serves
    again: the entry applied once, its request answered from it. ``restarted``: the replica is
    stopped meanwhile; one started on the full disk exits at once with one line saying so (no
    crash: SQLite cannot even open a WAL database there), and one started once space is back
    applies the entry and answers from it."""
    url = amqp_vhost.url
    with small_disk(tmp_path) as disk:
        ledger_path = disk.mountpoint / "ledger.sqlite"
        granted: dict[str, Lease] = {}
        async with (contextlib.AsyncExitStack() as stack,
                    AllocatorClient(url, timeout_s=2) as client,
                    NodeSimulator(url) as nodes):
            allocator = await stack.enter_async_context(
                running_allocator(url, ledger_path, ledger_log="stream"))
            replicated = allocator.log
            assert replicated is not None
            await cluster(client, nodes)
            granted["first"] = await client.allocate(ask("first"))
            filled = disk.fill()
            # SQLite may still find room for a few commits; ask until one goes unanswered.
            stuck = None
            for i in range(60):
                key = f"user{i}"
                try:
                    granted[key] = await client.allocate(ask(key))
                except AllocatorTimeout:
                    stuck = key
                    break
            assert stuck is not None, "the full disk never stopped a write"
            assert not allocator.failed.is_set(), allocator.failure
            stalled_after = replicated.position
            assert stalled_after is not None
            async def retrying() -> bool:
                assert replicated is not None and not allocator.failed.is_set(), \
                    allocator.failure
                return replicated.store.retries >= 2
            await wait_until(retrying)
            failure = str(replicated.store.failure)
            assert "full" in failure, failure
            # Following without serving: not the writer, no consumer (nothing is answered),
            # nothing applied past the entry.
            assert await allocator.is_standby()
            with pytest.raises(AllocatorTimeout):
                await client.inventory(timeout_s=1)
            assert replicated.position == stalled_after
            assert not allocator.failed.is_set(), allocator.failure
            if recovery == "restarted":
                await stack.aclose()
                status, lines = await serve_once(allocator_env(url, ledger_path,
                                                               ledger_log="stream"))
                assert status == 1 and len(lines) == 1, (status, lines)
                assert "filesystem is full" in lines[0] and str(ledger_path) in lines[0]

            disk.free()
            freed_at = time.monotonic()
            if recovery == "restarted":
                allocator = await stack.enter_async_context(
                    running_allocator(url, ledger_path, ledger_log="stream"))
                replicated = allocator.log
                assert replicated is not None
            # The same request key again: answered from the entry the log held all along.
            granted[stuck] = await answered(lambda: client.allocate(ask(stuck)))
            answered_after_s = time.monotonic() - freed_at
            assert replicated.store.failure is None and not allocator.failed.is_set()
            granted["after"] = await client.allocate(ask("after"))
            assert await free_gpus(client) == GPUS - len(granted)
            fenced = allocator.stats.counters["fenced_batches"]
            retries = replicated.store.retries
            position = replicated.position
            assert position is not None
        entries = await log_entries(url, position.offset)
        audit = audit_ledger(ledger_path)
    assert_sound(audit)
    assert {row["request_key"]: i for i, row in audit.leases.items()} == {
        f"hub/{key}/": lease.lease_id for key, lease in granted.items()}
    # The log gave the stuck request one lease, in the entry this replica could not apply
    # (the one right after where it stopped), and that is the lease its client got.
    in_log = leases_granted_in(entries)
    assert in_log[f"hub/{stuck}/"] == {granted[stuck].lease_id: stalled_after.offset + 1}
    assert all(len(leases) == 1 for leases in in_log.values()), in_log
    assert fenced == 0, "a batch in the log is not a fenced one"
    report(f"disk_full_stream_{recovery}", filler_bytes=filled,
           granted_while_full=len(granted) - 3, stalled_entry_offset=stalled_after.offset + 1,
           retries=retries, answered_after_space_returned_s=round(answered_after_s, 2),
           message=failure, leaked=0, double_booked=len(audit.double_booked))


async def test_disk_full_in_stream_mode_the_other_replica_serves_from_the_entry(
        amqp_vhost, tmp_path: Path):
    """Two replicas, the active one's ledger on the small disk, the standby's on another: when
    the active one's disk fills, the standby is given the requests at once and answers them,
    the request whose entry the active one could not write from that entry (its client need
    not even ask again); the stalled replica catches up once space returns, a standby again."""
    url = amqp_vhost.url
    with small_disk(tmp_path) as disk:
        ledger_path = disk.mountpoint / "ledger.sqlite"
        other_ledger = tmp_path / "ledger-other.sqlite"
        granted: dict[str, Lease] = {}
        async with (running_allocator(url, ledger_path, ledger_log="stream") as active,
                    running_allocator(url, other_ledger, ledger_log="stream") as other,
                    AllocatorClient(url, timeout_s=10) as client,
                    NodeSimulator(url) as nodes):
            stalled, serving = active.log, other.log
            assert stalled is not None and serving is not None
            await cluster(client, nodes)
            granted["first"] = await client.allocate(ask("first"))
            assert not await active.is_standby() and await other.is_standby()
            filled = disk.fill()
            # Every request is answered (none times out); ask until the disk has said no.
            for i in range(60):
                key = f"user{i}"
                asked_at = time.monotonic()
                granted[key] = await client.allocate(ask(key))
                if stalled.store.failure is not None:
                    stuck_call_s = time.monotonic() - asked_at
                    break
            assert stalled.store.failure is not None, "the full disk never stopped a write"
            assert "full" in str(stalled.store.failure)
            stalled_after = stalled.position
            assert stalled_after is not None
            assert not await other.is_standby() and await active.is_standby()
            granted["during"] = await client.allocate(ask("during"))
            assert not active.failed.is_set() and not other.failed.is_set()

            disk.free()
            freed_at = time.monotonic()

            async def caught_up() -> bool:
                assert stalled is not None and serving is not None
                return stalled.store.failure is None and stalled.position == serving.position
            await wait_until(caught_up, within=30)
            caught_up_s = time.monotonic() - freed_at
            granted["after"] = await client.allocate(ask("after"))
            assert await active.is_standby() and not active.failed.is_set()
            position = serving.position
            assert position is not None
        entries = await log_entries(url, position.offset)
        audit = audit_ledger(other_ledger)
        same = lease_states(ledger_path) == lease_states(other_ledger)
    assert_sound(audit)
    assert {row["request_key"]: i for i, row in audit.leases.items()} == {
        f"hub/{key}/": lease.lease_id for key, lease in granted.items()}
    in_log = leases_granted_in(entries)
    assert all(len(leases) == 1 for leases in in_log.values()), in_log
    # The entry the stalled replica could not write gave a lease that a client was told of.
    stuck = [key for key, leases in in_log.items()
             if stalled_after.offset + 1 in leases.values()]
    assert len(stuck) == 1 and stuck[0] in {f"hub/{k}/" for k in granted}, (stuck, in_log)
    assert same, "the stalled replica's ledger holds what the serving one holds"
    report("disk_full_stream_other_replica_serves", filler_bytes=filled,
           stalled_entry_offset=stalled_after.offset + 1,
           stalled_call_answered_in_s=round(stuck_call_s, 2),
           caught_up_after_space_returned_s=round(caught_up_s, 2), leases=len(audit.leases),
           leaked=0, double_booked=len(audit.double_booked))
