"""Disk trouble under the ledger: full, or turned read-only by a disk error.

The ledger lives on a small ext4 filesystem of its own (a loop device, ``errors=remount-ro``),
which the test fills up, or makes the kernel remount read-only as it does on a disk error.

Promises checked:

- a request whose decision cannot be written is answered ``storage_error`` with a message
  that says so and that nothing was granted; nothing is granted that is not on disk (the
  allocator's memory and every lease a client was told about match the ledger);
- the consumer keeps answering throughout;
- disk full: when space returns, the same requests (same request keys) succeed, without
  restarting anything;
- read-only: after the operator's repair (unmount, fsck, mount) a restarted allocator
  carries on from what is on disk; an allocator started on a read-only ledger exits at once
  with a one-line error naming the ledger.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from faults import (
    REPO_ROOT,
    allocator_env,
    assert_sound,
    audit_ledger,
    report,
    running_allocator,
    small_disk,
)
from support import GTX1070, NodeSimulator, gpus, wait_until

from allocator.client import AllocatorClient, AllocatorError
from allocator.protocol import AllocateRequest, ErrorCode, Lease, LeaseState

pytestmark = pytest.mark.slow  # real processes, brokers and engines: seconds each

GPUS = 16


def ask(key: str) -> AllocateRequest:
    return AllocateRequest(request_key=f"hub/{key}/", user=key)


async def free_gpus(client: AllocatorClient) -> int:
    return sum(model.free for model in (await client.inventory()).models)


async def cluster(client: AllocatorClient, nodes: NodeSimulator) -> None:
    await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, GPUS))

    async def up():
        return [n for n in (await client.inventory()).nodes if n.up]
    await wait_until(up)


def storage_error_text(exc: AllocatorError) -> str:
    assert exc.code is ErrorCode.STORAGE_ERROR, exc
    assert "could not record" in exc.message and "nothing was granted" in exc.message
    return exc.message


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


async def test_read_only_disk_answers_storage_error_and_a_restart_carries_on(amqp_vhost,
                                                                            tmp_path: Path):
    with small_disk(tmp_path) as disk:
        ledger_path = disk.mountpoint / "ledger.sqlite"
        async with (AllocatorClient(amqp_vhost.url, timeout_s=10) as client,
                    NodeSimulator(amqp_vhost.url) as nodes):
            async with running_allocator(amqp_vhost.url, ledger_path):
                await cluster(client, nodes)
                first = await client.allocate(ask("first"))
                disk.fail()  # the kernel remounts the filesystem read-only
                with pytest.raises(AllocatorError) as refused:
                    await client.allocate(ask("second"))
                message = storage_error_text(refused.value)
                assert "read-only" in message, message
                # Still answering, and nothing of the refused request is in memory.
                assert await free_gpus(client) == GPUS - 1
                assert (await client.status(lease_id=first.lease_id)).state is \
                    LeaseState.GRANTED
            disk.repair()
            async with running_allocator(amqp_vhost.url, ledger_path):
                await nodes.beat("gpu-a")
                again = await client.allocate(ask("first"))
                assert again.lease_id == first.lease_id, "the restart carried on from the disk"
                second = await client.allocate(ask("second"))
                assert second.state is LeaseState.GRANTED
                assert await free_gpus(client) == GPUS - 2
        audit = audit_ledger(ledger_path)
    assert_sound(audit)
    assert sorted(audit.leases) == sorted([first.lease_id, second.lease_id])
    report("disk_read_only", message=message, leaked=0,
           double_booked=len(audit.double_booked))


async def test_allocator_refuses_to_start_on_a_read_only_ledger(amqp_vhost, tmp_path: Path):
    with small_disk(tmp_path) as disk:
        ledger_path = disk.mountpoint / "ledger.sqlite"
        async with running_allocator(amqp_vhost.url, ledger_path):
            pass  # creates the ledger
        disk.remount_readonly()
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "allocator.cli", "serve", cwd=REPO_ROOT,
            env=allocator_env(amqp_vhost.url, ledger_path), stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        try:
            async with asyncio.timeout(30):
                _, err = await process.communicate()
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    lines = err.decode().strip().splitlines()
    assert process.returncode == 1
    assert len(lines) == 1 and lines[0].startswith("gpu-allocator: "), lines
    assert str(ledger_path) in lines[0] and "read-only" in lines[0], lines[0]
    report("disk_read_only_at_start", exit_status=1, message=lines[0])
