"""Fair share end to end: a real allocator, a real node agent (simulated inventory whose
``leases`` set each lease's GPU use), the real broker and the real Docker engine running the
lease containers, which the agent stops when the allocator reclaims them.

Bounds, not speed: every wait is for a condition, with bounds a loaded machine meets.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from allocator.amqp.client import AllocatorClient
from allocator.config import AllocatorSettings
from allocator.metrics.counters import Family
from allocator.service import AllocatorService
from allocator.wire.protocol import AllocateRequest, Lease, LeaseState, ReclaimReason, ReleaseReason
from tests.support.common import GTX1070, started, wait_until
from tests.support.fairshare_site import Site, bound_lease
from tests.support.plain_containers import plain_containers

pytestmark = pytest.mark.docker

IDLE_WINDOW_S = 2.0


async def cli_lines(amqp_url: str, *args: str) -> list[str]:
    """Run ``gpu-allocator ARGS`` against the broker; its output lines."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "allocator.admin.cli", *args, "--amqp", amqp_url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 0, err.decode()
    return out.decode().splitlines()


def fair_settings(amqp_url: str, ledger_path: Path, **extra: Any) -> AllocatorSettings:
    values: dict[str, Any] = dict(
        amqp_url=amqp_url, ledger_path=ledger_path, allow_any_node_user=True,
        admin_users=["guest"], tick_s=0.1, start_fence_s=5.0, container_stop_grace_s=2.0,
        user_quota={"alice": 1, "bob": 1, "carol": 0, "dave": 0},
        user_borrow_limit={"alice": 2, "carol": 1, "dave": 1},
        idle_window_s=IDLE_WINDOW_S, reclaim_grace_s=3.0)
    values.update(extra)
    return AllocatorSettings(**values)


def running_allocator(
    settings: AllocatorSettings,
) -> contextlib.AbstractAsyncContextManager[AllocatorService]:
    return started(AllocatorService(settings))


async def idle_for_the_window(client: AllocatorClient, lease_id: str) -> Lease | None:
    view = (await client.leases()).leases
    lease = next(le for le in view if le.lease_id == lease_id)
    if lease.idle_since is not None and time.time() - lease.idle_since > IDLE_WINDOW_S + 1.0:
        return lease
    return None


async def warned(client: AllocatorClient, lease_id: str) -> Lease | None:
    lease = await client.status(lease_id=lease_id)
    return lease if lease.reclaim_at is not None else None


async def test_an_idle_borrower_is_warned_stopped_and_its_gpu_granted_to_a_guaranteed_waiter(
        amqp_vhost, ledger_path, tmp_path, busybox_image, docker_engine):
    site = Site(tmp_path)
    # A grace long enough for the command line's listing to see the warning.
    settings = fair_settings(amqp_vhost.url, ledger_path, reclaim_grace_s=10.0)
    async with running_allocator(settings) as service, \
            AllocatorClient(amqp_vhost.url, timeout_s=10) as client, \
            site.agent(amqp_vhost.url), \
            plain_containers(docker_engine, busybox_image) as docker:
        own = await bound_lease(client, docker, site, "alice", "own", 80.0)
        extra = await bound_lease(client, docker, site, "alice", "extra", 0.0)
        assert (own.borrowed, extra.borrowed) == (False, True)
        containers = {le.lease_id: (await client.status(lease_id=le.lease_id)).container_id
                      for le in (own, extra)}
        # Idle for the window, borrowed, and nobody waits: nobody is warned.
        idle = await wait_until(lambda: idle_for_the_window(client, extra.lease_id), within=30)
        assert idle.utilization_pct == 0.0 and idle.gpu_memory_used_mib == 600
        assert (await client.status(lease_id=own.lease_id)).idle_since is None
        assert idle.reclaim_at is None
        assert not service.engine.counters.of(Family.RECLAIM_WARNED)

        # What the spawn form asks before: bob's GPU would be his guarantee, alice's a third
        # borrowed one beyond her borrow limit of 2 (a refusal, not a borrowing).
        bob_asks = await client.quota("bob", count=1, model=GTX1070)
        alice_asks = await client.quota("alice", count=1, model=GTX1070)
        assert (bob_asks.would_borrow, alice_asks.would_borrow) == (False, True)
        assert (alice_asks.quotas[0].held, alice_asks.quotas[0].borrow_limit) == (2.0, 2.0)
        queued_at = time.time()
        waiting = await client.allocate(AllocateRequest(request_key="e2e/bob/", user="bob",
                                                        host=site.host, wait_s=120))
        assert waiting.state is LeaseState.QUEUED
        warning = await wait_until(lambda: warned(client, extra.lease_id), within=30)
        assert warning.reclaim_reason is ReclaimReason.RECLAIMED
        assert warning.reclaim_at is not None and warning.reclaim_at >= queued_at + 10.0
        assert (await client.status(lease_id=own.lease_id)).reclaim_at is None
        listed = await cli_lines(amqp_vhost.url, "leases", "--user", "alice")

        async def granted() -> Lease | None:
            lease = await client.status(lease_id=waiting.lease_id)
            return lease if lease.state is LeaseState.GRANTED else None
        grant = await wait_until(granted, within=60)
        # What an admin saw meanwhile: the borrowed lease with its warning, the other not.
        lines = {line.split()[0]: line for line in listed}
        assert "borrowed" in lines[extra.lease_id[:12]]
        assert "reclaimed in " in lines[extra.lease_id[:12]]
        assert "guaranteed" in lines[own.lease_id[:12]]
        assert "reclaimed in" not in lines[own.lease_id[:12]]
        assert grant.gpu_uuids == extra.gpu_uuids
        assert not grant.borrowed
        ended = await client.status(lease_id=extra.lease_id)
        assert (ended.state, ended.release_reason) == (LeaseState.RELEASED,
                                                       ReleaseReason.RECLAIMED)
        assert ended.reclaim_at == warning.reclaim_at
        stopped_at = service.engine.recent[extra.lease_id].reclaim_stopped_at
        assert stopped_at is not None and stopped_at >= warning.reclaim_at
        # The container is stopped, by the agent; the guaranteed lease's still runs.
        assert not await docker.is_running(containers[extra.lease_id])
        assert await docker.is_running(containers[own.lease_id])
        assert (await client.status(lease_id=own.lease_id)).state is LeaseState.BOUND


async def test_a_busy_borrower_is_kept_while_an_idle_one_exists(
        amqp_vhost, ledger_path, tmp_path, busybox_image, docker_engine):
    site = Site(tmp_path)
    async with running_allocator(fair_settings(amqp_vhost.url, ledger_path)), \
            AllocatorClient(amqp_vhost.url, timeout_s=10) as client, \
            site.agent(amqp_vhost.url), \
            plain_containers(docker_engine, busybox_image) as docker:
        idle = await bound_lease(client, docker, site, "dave", "", 0.0)
        busy = await bound_lease(client, docker, site, "carol", "", 90.0)  # the newest grant
        assert idle.borrowed and busy.borrowed
        await wait_until(lambda: idle_for_the_window(client, idle.lease_id), within=30)
        await client.allocate(AllocateRequest(request_key="e2e/bob/", user="bob",
                                              host=site.host, wait_s=120))
        warning = await wait_until(lambda: warned(client, idle.lease_id), within=30)
        assert warning.reclaim_reason is ReclaimReason.RECLAIMED

        async def reclaimed() -> Lease | None:
            lease = await client.status(lease_id=idle.lease_id)
            return lease if lease.state is LeaseState.RELEASED else None
        await wait_until(reclaimed, within=60)
        kept = await client.status(lease_id=busy.lease_id)
        assert (kept.state, kept.reclaim_at) == (LeaseState.BOUND, None)


async def test_an_allocator_restart_during_the_grace_keeps_the_deadline(
        amqp_vhost, ledger_path, tmp_path, busybox_image, docker_engine):
    site = Site(tmp_path)
    settings = fair_settings(amqp_vhost.url, ledger_path, reclaim_grace_s=15.0)
    async with AllocatorClient(amqp_vhost.url, timeout_s=10) as client, \
            site.agent(amqp_vhost.url), \
            plain_containers(docker_engine, busybox_image) as docker:
        async with running_allocator(settings):
            await bound_lease(client, docker, site, "alice", "own", 80.0)
            extra = await bound_lease(client, docker, site, "alice", "extra", 0.0)
            await wait_until(lambda: idle_for_the_window(client, extra.lease_id), within=30)
            waiting = await client.allocate(AllocateRequest(
                request_key="e2e/bob/", user="bob", host=site.host, wait_s=120))
            warning = await wait_until(lambda: warned(client, extra.lease_id), within=30)
        assert warning.reclaim_at is not None
        assert time.time() < warning.reclaim_at, "the grace ran out before the restart"
        async with running_allocator(settings) as restarted:
            after = await client.status(lease_id=extra.lease_id)
            assert after.reclaim_at == warning.reclaim_at  # the same deadline, not a new one

            async def granted() -> Lease | None:
                lease = await client.status(lease_id=waiting.lease_id)
                return lease if lease.state is LeaseState.GRANTED else None
            await wait_until(granted, within=60)
            record = restarted.engine.recent[extra.lease_id]
            assert record.release_reason is ReleaseReason.RECLAIMED
            assert record.reclaim_stopped_at is not None
            assert record.reclaim_stopped_at >= warning.reclaim_at
