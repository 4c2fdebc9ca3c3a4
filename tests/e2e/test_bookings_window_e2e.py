"""A booking's window end to end: a real allocator, a real node agent (simulated inventory),
the real broker and the real Docker engine running the lease containers. A borrower on the
booked GPU is warned ``lead_s`` before the window, its container is stopped at the start for
a member who waits, and the member's lease is granted on the freed GPU.

Bookings are in whole minutes of wall-clock time, so the allocator runs on a clock moved to
a few seconds before a whole minute (the service takes its clock, as the engine does); the
agent and Docker keep the real one. Bounds, not speed: every wait is for a condition.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from allocator.amqp.client import AllocatorClient
from allocator.config import AllocatorSettings
from allocator.service import AllocatorService
from allocator.wire.protocol import AllocateRequest, Lease, LeaseState, ReleaseReason
from tests.support.common import GTX1070, started, wait_until
from tests.support.fairshare_site import Site, bound_lease
from tests.support.plain_containers import plain_containers

pytestmark = pytest.mark.docker

LEAD_S = 6
"""The booking's lead: the borrower's warning comes this long before the window."""
BEFORE_LEAD_S = 20.0
"""Where the allocator's clock starts, before the lead: time to bind the borrowers' leases."""


async def test_a_borrower_is_warned_before_the_window_and_reclaimed_for_a_member(
        amqp_vhost: Any, ledger_path: Path, tmp_path: Path, busybox_image: str,
        docker_engine: str) -> None:
    site = Site(tmp_path)
    # The window's start: a whole minute that the allocator's clock reads LEAD_S +
    # BEFORE_LEAD_S seconds after this test starts. That clock runs behind the real one (by
    # less than a minute), never ahead: a request's deadline is the client's real time.
    real = time.time()
    start = int(real + LEAD_S + BEFORE_LEAD_S) // 60 * 60
    offset = start - (real + LEAD_S + BEFORE_LEAD_S)

    def clock() -> float:
        return time.time() + offset

    settings = AllocatorSettings(
        amqp_url=amqp_vhost.url, ledger_path=ledger_path, allow_any_node_user=True,
        admin_users=["guest"], tick_s=0.1, start_fence_s=5.0, container_stop_grace_s=2.0,
        group_quota={"cs101": 0}, group_borrow_limit={"cs101": 2}, reclaim_grace_s=3.0)
    local = datetime.fromtimestamp(start, UTC)
    booking: dict[str, Any] = {
        "name": "CS101", "group": "cs101", "gpus": {"model": GTX1070, "count": 1},
        "zone": "UTC", "lead_s": LEAD_S, "window": {
            "kind": "once", "start": f"{local:%Y-%m-%dT%H:%M}",
            "end": f"{datetime.fromtimestamp(start + 600, UTC):%Y-%m-%dT%H:%M}"}}
    async with started(AllocatorService(settings, clock=clock)) as service, \
            AllocatorClient(amqp_vhost.url, timeout_s=10) as client, \
            site.agent(amqp_vhost.url), \
            plain_containers(docker_engine, busybox_image) as docker:
        older = await bound_lease(client, docker, site, "bob", "a", 90.0)
        newer = await bound_lease(client, docker, site, "bob", "b", 90.0)
        containers = {le.lease_id: (await client.status(lease_id=le.lease_id)).container_id
                      for le in (older, newer)}
        await client.add_booking(booking, by="prof")
        assert clock() < start - LEAD_S, "binding took longer than the time before the lead"
        assert (await client.status(lease_id=newer.lease_id)).reclaim_at is None

        async def warned() -> Lease | None:
            lease = await client.status(lease_id=newer.lease_id)
            return lease if lease.reclaim_at is not None else None
        warning = await wait_until(warned, within=BEFORE_LEAD_S + 30)
        assert clock() >= start - LEAD_S - 1.0  # warned at the lead, not before
        assert warning.reclaim_at == start
        record = service.engine.leases[newer.lease_id]
        assert service.engine.windows.reclaim_for_booking[record.lease_id] == "CS101"
        assert (await client.status(lease_id=older.lease_id)).reclaim_at is None

        # A member asks before the window: the GPU is bob's until the start.
        waiting = await client.allocate(AllocateRequest(
            request_key="e2e/alice/", user="alice", groups=["cs101"], host=site.host,
            wait_s=120))
        assert waiting.state is LeaseState.QUEUED

        async def granted() -> Lease | None:
            lease = await client.status(lease_id=waiting.lease_id)
            return lease if lease.state is LeaseState.GRANTED else None
        grant = await wait_until(granted, within=LEAD_S + 60)
        assert clock() >= start
        assert grant.gpu_uuids == newer.gpu_uuids and not grant.borrowed
        ended = await client.status(lease_id=newer.lease_id)
        assert (ended.state, ended.release_reason) == (LeaseState.RELEASED,
                                                       ReleaseReason.RECLAIMED)
        stopped_at = service.engine.recent[newer.lease_id].reclaim_stopped_at
        assert stopped_at is not None and stopped_at >= start
        assert not await docker.is_running(containers[newer.lease_id])
        assert await docker.is_running(containers[older.lease_id])
        assert service.engine.windows.booking_of.get(waiting.lease_id) == "CS101"

