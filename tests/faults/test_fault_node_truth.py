"""The ledger lost or rolled back under running notebooks: node truth gives it back.

A real allocator process, a real node agent against the real Docker engine, real containers
labelled with their whole grant (``allocator.wire.lease_container.grant_labels``, what the spawner
sets). Then the allocator is killed with SIGKILL and

- **deleted**: its ledger file (with ``-wal`` and ``-shm``) is removed, or
- **restored**: the ledger is replaced by a backup (``VACUUM INTO``, as docs/operations.md
  says) taken before the last grants,

and a new allocator process starts on it. Both ways of keeping the ledger (``ledger_log``):
without the replicated log the node's containers are the only record left of what the file
lost; with it (``stream``) the new process replays the log onto the empty or restored file,
and nothing needs adopting. Promises checked: every running container's lease is bound again
with the same GPUs (those the ledger forgot as ``adopted``), before anything else is granted
on the node; then 200 allocations of every shape land only on GPUs no
container holds (0 double-booked); the invariant checker and ``gpu-ledger check --live``
find nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Any

import aiodocker
import pytest

from allocator.amqp.client import AllocatorClient, AllocatorError, AllocatorTimeout
from allocator.wire.lease_container import grant_labels
from allocator.wire.protocol import AllocateRequest, ErrorCode, Lease, LeaseState, ShareRequest
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.simulated import make_gpu, write_inventory
from tests.support.common import GTX1070, wait_until
from tests.support.faults import (
    LEDGER_LOGS,
    AllocatorProcess,
    assert_sound,
    audit_ledger,
    backup_ledger,
    fault_name,
    gpu_ledger_check,
    report,
)

GPUS = 8
ALLOCATIONS = 200
SETTINGS: dict[str, Any] = {"container_gone_grace_s": 0.5, "share_slots": {GTX1070: 2},
                            "start_fence_s": 30}


def agent_settings(host: str, url: str, inventory: Path, docker_url: str) -> AgentSettings:
    return AgentSettings(
        host=host, amqp_url=url, inventory="simulated", simulated_file=inventory,
        interval_s=0.25, publish_timeout_s=1.0, amqp_reconnect_s=0.2, docker=True,
        docker_url=docker_url, docker_backoff_s=0.1, docker_backoff_max_s=0.5,
        docker_replay_grace_s=0.5, docker_timeout_s=3.0, xid_poll_s=0.2,
        # Deltas in between, but a full report well within the 1.5 s that `gpu-ledger check
        # --live` listens (it counts a host once heard in full).
        full_report_s=0.5)


@contextlib.asynccontextmanager
async def lease_containers(docker_url: str, image: str):
    """Starts a container per lease with the grant labels the spawner sets; removed after."""
    docker = aiodocker.Docker(url=docker_url)
    started: list[str] = []

    async def run(lease: Lease) -> str:
        container = await docker.containers.run(
            config={"Image": image, "Cmd": ["sleep", "600"], "StopSignal": "SIGKILL",
                    "Labels": grant_labels(lease, server_name=lease.request_key.split("/")[2]),
                    "HostConfig": {"NetworkMode": "host"}},
            name=f"nodetruth-{lease.lease_id[:12]}")
        started.append(container.id)
        return container.id

    try:
        yield run
    finally:
        for container_id in started:
            with contextlib.suppress(aiodocker.DockerError, OSError):
                await docker.containers.container(container_id).delete(force=True)
        await docker.close()


def ask(user: str, host: str, *, share: bool = False) -> AllocateRequest:
    return AllocateRequest(request_key=f"hub/{user}/nb", user=user, host=host,
                           share=ShareRequest() if share else None)


async def first_answer(url: str) -> tuple[AllocatorClient, float]:
    began = time.monotonic()
    client = AllocatorClient(url, timeout_s=5)
    await client.connect()
    while True:
        try:
            await client.inventory(timeout_s=0.5)
            return client, time.monotonic() - began
        except AllocatorTimeout:
            continue


def lose_ledger(ledger: Path, restore_from: Path | None) -> None:
    """The ledger file is gone (with its -wal and -shm); or replaced by a backup, as
    docs/operations.md restores one."""
    for suffix in ("", "-wal", "-shm"):
        Path(f"{ledger}{suffix}").unlink(missing_ok=True)
    if restore_from is not None:
        restore_from.rename(ledger)


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.parametrize("ledger_log", LEDGER_LOGS)
@pytest.mark.parametrize("loss", ["deleted", "restored"])
async def test_a_lost_ledger_gets_its_running_leases_back_and_doubles_nothing(
        amqp_vhost, tmp_path: Path, ledger_path: Path, docker_engine: str, busybox_image: str,
        loss: str, ledger_log: str) -> None:
    url = amqp_vhost.url
    settings = {**SETTINGS, "ledger_log": ledger_log}
    host = f"nodetruth-{uuid.uuid4().hex[:8]}"
    inventory = tmp_path / "inventory.json"
    write_inventory(inventory, {host: [make_gpu(host, i, GTX1070) for i in range(GPUS)]})
    first = AllocatorProcess("first", url, ledger_path, tmp_path, **settings)
    second = AllocatorProcess("second", url, ledger_path, tmp_path, **settings)
    agent = NodeAgent(agent_settings(host, url, inventory, docker_engine))
    saved = tmp_path / "backup.sqlite"
    try:
        await first.start()
        await first.wait_consuming()
        await agent.start()
        async with (AllocatorClient(url, timeout_s=5) as client,
                    lease_containers(docker_engine, busybox_image) as run):
            async def host_up() -> bool:
                return any(n.host == host and n.up for n in (await client.inventory()).nodes)
            await wait_until(host_up, within=30)
            # Four whole GPUs and two slices of one more: GPUs 0-4 are taken in full.
            users = [("ann", False), ("ben", False), ("cat", False), ("dan", False),
                     ("eve", True), ("fay", True)]
            before_backup = 2 if loss == "restored" else 0
            leases: dict[str, Lease] = {}
            containers: dict[str, str] = {}
            for number, (user, share) in enumerate(users):
                if number == before_backup and loss == "restored":
                    await asyncio.to_thread(backup_ledger, ledger_path, saved)
                lease = await client.allocate(ask(user, host, share=share))
                leases[lease.lease_id] = lease
                containers[lease.lease_id] = await run(lease)

            async def all_bound() -> bool:
                states = [(await client.status(lease_id=i)).state for i in leases]
                return all(s is LeaseState.BOUND for s in states)
            await wait_until(all_bound, within=30)
            taken = {u for lease in leases.values() for u in lease.gpu_uuids}
            assert len(taken) == 5

            first.kill()
            await first.process.wait()  # type: ignore[union-attr]
            await asyncio.to_thread(lose_ledger, ledger_path, saved if loss == "restored"
                                    else None)
            restarted_at = time.monotonic()
            await second.start()
            await second.wait_consuming()
            probe, first_answer_s = await first_answer(url)
            async with probe:
                # Asked at once, before or as the node first reports: three GPUs fit only
                # on the three no container holds, and never on a taken one.
                early = await probe.allocate(AllocateRequest(
                    request_key="hub/early/", user="early", host=host, count=3))
                early_queued = early.state is LeaseState.QUEUED
                if early_queued:
                    early = await probe.wait_for_grant("hub/early/", wait_s=30)
                assert not taken & set(early.gpu_uuids), early
                await probe.release(lease_id=early.lease_id, force=True, by="test",
                                    reason="next allocation")

                async def taken_back() -> bool:
                    states = [(await probe.status(lease_id=i)).state for i in leases]
                    return all(s is LeaseState.BOUND for s in states)
                await wait_until(taken_back, within=30)
                adopted_s = time.monotonic() - restarted_at
                for lease_id, lease in leases.items():
                    now = await probe.status(lease_id=lease_id)
                    assert (now.state, now.gpu_uuids, now.container_id, now.user) == (
                        LeaseState.BOUND, lease.gpu_uuids, containers[lease_id], lease.user)

                granted = refused = double_booked = 0
                shapes: list[dict[str, Any]] = [{"count": 1}, {"count": 2}, {"count": 3},
                                                {"count": "all"}, {"share": {}}, {"count": 4}]
                for number in range(ALLOCATIONS):
                    shape = shapes[number % len(shapes)]
                    request = AllocateRequest.model_validate(
                        {"request_key": f"hub/load{number}/", "user": f"load{number}",
                         "host": host, **shape})
                    try:
                        lease = await probe.allocate(request)
                    except AllocatorError as exc:
                        assert exc.code is ErrorCode.NO_CAPACITY, exc
                        refused += 1
                        continue
                    granted += 1
                    double_booked += len(taken & set(lease.gpu_uuids))
                    await probe.release(lease_id=lease.lease_id, force=True, by="test",
                                        reason="next allocation")
                assert double_booked == 0
                assert granted > 0 and refused > 0, (granted, refused)
        checked = await asyncio.to_thread(gpu_ledger_check, ledger_path, live_amqp=url,
                                          listen_s=1.5)
        found = json.loads(checked.stdout)
        assert found["hosts_reported"] == [host]
        # The agent lists every lease container of the engine, which other test runs share:
        # only what concerns this run's leases (or its GPUs) counts.
        ours = [v for v in found["violations"] if v["lease_id"] in leases
                or v["lease_id"] is None]
        assert ours == [], checked.stdout
    finally:
        await agent.stop()
        for process in (first, second):
            await process.stop()
    audit = audit_ledger(ledger_path)
    assert_sound(audit)
    adopted = _adopted(ledger_path)
    if ledger_log == "off":
        assert adopted == {lease_id for i, lease_id in enumerate(leases) if i >= before_backup}
    else:
        assert adopted == set(), "the log gave every lease back: nothing to adopt"
    report(fault_name(f"ledger_{loss}", ledger_log), running_leases=len(leases),
           adopted=len(adopted), kept_from_backup=before_backup,
           first_answer_s=round(first_answer_s, 3),
           allocations=ALLOCATIONS, granted=granted, refused=refused,
           double_booked=double_booked, all_bound_after_restart_s=round(adopted_s, 2),
           early_request_queued_first=early_queued)


def _adopted(ledger: Path) -> set[str]:
    conn = sqlite3.connect(ledger)
    try:
        return {row[0] for row in conn.execute(
            "SELECT lease_id FROM lease_history WHERE reason = 'adopted'")}
    finally:
        conn.close()
