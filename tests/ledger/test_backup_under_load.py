"""A backup taken under the load of 64 clients restores to a ledger that ``gpu-ledger check
--live`` finds consistent once the allocator has adopted what runs (docs/operations.md, "Back
up and restore the ledger"), in both ways of keeping the ledger (``ledger_log``).

A real allocator process on the real broker; a real node agent with simulated GPUs, watching
a Docker engine of the module's own (``services.private_docker``: only this module's
containers run there, so the agent's listings are this test's alone); lease containers
labelled with their whole grant, as the spawner labels them
(:func:`allocator.wire.lease_container.grant_labels`).

1. Two notebooks run (``nb0``, ``nb1``, one RTX 3090 each). 64 clients allocate and release
   GTX 1070s as fast as they are answered; a third spawn is granted but has no container yet
   (``spawning``, the last 3090); ``gpu-ledger backup`` (the console command, as an admin
   runs it) copies the ledger while the clients go on.
2. After the backup: ``nb0``'s container ends, the ``spawning`` lease is given back, and two
   new notebooks (``late1``, ``late2``) get the two 3090s these freed and run; the load goes
   on. So the backup is behind on the very GPUs that run notebooks now: it holds ``nb0`` bound
   and ``spawning`` granted on the GPUs of ``late1`` and ``late2``.
3. The allocator is stopped and ``gpu-ledger restore`` puts the backup back:
   ``off`` (one ledger file, no log); ``stream`` onto the existing stream (the position kept:
   the allocator catches up from the log, nothing to adopt); ``stream`` with ``--new-log``
   onto a fresh stream, the old one deleted (lost with the broker's data: the allocator
   starts a new log from the restored ledger, and adoption brings back what runs).
4. A new allocator process starts on it. Promises checked: exactly the running containers'
   leases hold GPUs (``nb1`` kept, ``late1`` and ``late2`` held again with their GPUs and
   containers, adopted where the ledger lost them), ``nb0`` and ``spawning`` hold nothing,
   no GPU is held twice, a request for an RTX 3090 is refused (all three run notebooks), the
   invariant checker and ``gpu-ledger check --live`` find nothing. Where the restored ledger
   has ``spawning`` granted, its GPU (the container of a ``late`` runs there) stays held
   until its bind deadline, and the container is adopted only then (``bind_timeout_s``,
   short here): the wait docs/operations.md describes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aio_pika
import pytest

from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.wire.lease_container import grant_labels
from allocator.wire.protocol import AllocateRequest, ErrorCode, Lease, LeaseState
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.simulated import make_gpu, write_inventory
from tests.support import services
from tests.support.common import GTX1070, RTX3090, LabelledDocker, wait_until
from tests.support.faults import (
    REPO_ROOT,
    AllocatorProcess,
    assert_sound,
    audit_ledger,
    gpu_ledger_check,
    replica_ledger,
    report,
)

pytestmark = pytest.mark.slow

CLIENTS = 64
LOAD_GPUS = 16
"""GTX 1070s for the load: fewer than the clients, so some are refused ``no_capacity``."""
NOTEBOOK_GPUS = 3
"""RTX 3090s for the notebooks: all three run one at the end."""
STREAM = "swarm-gpu.ledger-log"
GPU_LEDGER = Path(sys.executable).parent / "gpu-ledger"

SETTINGS = {"tick_s": 0.2, "container_gone_grace_s": 0.5, "start_fence_s": 30,
            # A restored grant without a container (``spawning``) holds its GPU until its
            # bind deadline: short here, so that the container running there now is adopted
            # within the test (300 s by default).
            "bind_timeout_s": 10}

RESTORES = [("off", "none"), ("stream", "kept"), ("stream", "new-log")]
"""(ledger_log, what ``restore`` does with the backup's log position: it has none without
the log; kept, onto the existing stream; cleared by ``--new-log``, onto a fresh stream)."""
SAYS = {"none": "ledger log: none in the backup", "kept": "ledger log: position kept",
        "new-log": "ledger log: position cleared (--new-log"}
"""What ``restore`` prints about the position in each case."""


@pytest.fixture(scope="module")
def lease_engine() -> Iterator[services.PrivateDocker]:
    """A Docker engine of the module's own, with the busybox image, for lease containers."""
    with services.private_docker() as engine:
        yield engine


class Notebooks(LabelledDocker):
    """Lease containers labelled with their whole grant, as the spawner labels them."""

    async def start_for(self, lease: Lease) -> str:
        container = await self.containers.run(
            config={"Image": services.BUSYBOX_IMAGE, "Cmd": ["sleep", "600"],
                    "StopSignal": "SIGKILL", "HostConfig": {"NetworkMode": "host"},
                    "Labels": grant_labels(lease, server_name=lease.request_key.split("/")[2])},
            name=f"backup-{lease.lease_id[:12]}")
        self._labelled.append(container.id)
        return str(container.id)


@dataclass
class Load:
    """What the load's clients were answered, and when."""

    stop: asyncio.Event = field(default_factory=asyncio.Event)
    answers: Counter[int] = field(default_factory=Counter)
    """client number -> calls answered"""
    answered_at: list[float] = field(default_factory=list)
    granted: int = 0
    refused: int = 0

    def answered_between(self, began: float, ended: float) -> int:
        return sum(began <= t <= ended for t in self.answered_at)

    async def every_client_answered(self) -> bool:
        return len(self.answers) == CLIENTS

    async def answered_since(self, since: float, at_least: int) -> bool:
        return sum(t > since for t in self.answered_at) >= at_least


async def churn(number: int, url: str, load: Load) -> None:
    """One client: allocate a GTX 1070 (a new request key each time) and release it at once,
    until told to stop; ``no_capacity`` is an answer too."""
    async with AllocatorClient(url, timeout_s=20, connect_timeout_s=20) as client:
        cycle = 0
        while not load.stop.is_set():
            request = AllocateRequest(request_key=f"hub/load{number}/c{cycle}",
                                      user=f"load{number}", model=GTX1070)
            try:
                lease = await client.allocate(request)
            except AllocatorError as exc:
                assert exc.code is ErrorCode.NO_CAPACITY, exc
                load.refused += 1
            else:
                load.granted += 1
                await client.release(lease_id=lease.lease_id, force=True, by="load",
                                     reason="cycle")
            load.answers[number] += 1
            load.answered_at.append(time.monotonic())
            cycle += 1


async def gpu_ledger(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """The ``gpu-ledger`` console command, as an admin runs it."""
    ran = await asyncio.create_subprocess_exec(
        str(GPU_LEDGER), *map(str, args), cwd=REPO_ROOT, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(ran.communicate(), 120)
    assert ran.returncode is not None
    return subprocess.CompletedProcess(args, ran.returncode, out.decode(), err.decode())


async def all_in_state(client: AllocatorClient, state: LeaseState, *leases: Lease) -> bool:
    states = [(await client.status(lease_id=lease.lease_id)).state for lease in leases]
    return all(found is state for found in states)


def read(path: Path, sql: str, *params: str) -> list[tuple[str, ...]]:
    """The rows of a query on a ledger or backup file, opened read-only."""
    with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as conn:
        return conn.execute(sql, params).fetchall()


def lease_rows(path: Path) -> dict[str, tuple[str, str]]:
    """lease id -> (state, request key)."""
    return {lease_id: (state, key) for lease_id, state, key in read(
        path, "SELECT lease_id, state, request_key FROM leases")}


async def delete_stream(url: str) -> None:
    """The ledger log's stream is lost (as with the broker's data)."""
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        channel = await connection.channel()
        await channel.queue_delete(STREAM, if_unused=False, if_empty=False)


def agent_settings(host: str, url: str, inventory: Path, docker_url: str) -> AgentSettings:
    return AgentSettings(
        host=host, amqp_url=url, inventory="simulated", simulated_file=inventory,
        interval_s=0.25, publish_timeout_s=2.0, amqp_reconnect_s=0.2, docker=True,
        docker_url=docker_url, docker_backoff_s=0.1, docker_backoff_max_s=0.5,
        docker_replay_grace_s=0.5, docker_timeout_s=5.0, command_users=["guest"],
        metrics_port=0,
        # A full report well within the 1.5 s `gpu-ledger check --live` listens.
        full_report_s=0.5)


@pytest.mark.parametrize(("ledger_log", "position"), RESTORES,
                         ids=["off", "stream-position-kept", "stream-new-log"])
async def test_a_backup_under_load_restores_to_a_consistent_ledger_after_adoption(
        amqp_vhost: services.AmqpVhost, tmp_path: Path, ledger_path: Path,
        lease_engine: services.PrivateDocker, ledger_log: str, position: str) -> None:
    url = amqp_vhost.url
    began = time.monotonic()
    ledger = replica_ledger(ledger_path, "a", ledger_log)
    settings = {**SETTINGS, "ledger_log": ledger_log}
    host = f"backup-{uuid.uuid4().hex[:8]}"
    inventory = tmp_path / "inventory.json"
    write_inventory(inventory, {host: [make_gpu(host, i, GTX1070) for i in range(LOAD_GPUS)]
                                + [make_gpu(host, LOAD_GPUS + i, RTX3090)
                                   for i in range(NOTEBOOK_GPUS)]})
    first = AllocatorProcess("first", url, ledger, tmp_path, **settings)
    second = AllocatorProcess("second", url, ledger, tmp_path, **settings)
    agent = NodeAgent(agent_settings(host, url, inventory, lease_engine.url))
    notebooks = Notebooks(lease_engine.url)
    backup = tmp_path / "backups" / "ledger-backup.sqlite"
    backup.parent.mkdir()
    load = Load()
    workers: list[asyncio.Task[None]] = []
    try:
        await first.start()
        await first.wait_consuming()
        await agent.start()
        async with AllocatorClient(url, timeout_s=20) as hub:
            async def host_up() -> bool:
                return any(n.host == host and n.up for n in (await hub.inventory()).nodes)
            await wait_until(host_up, within=30)

            async def notebook(name: str) -> tuple[Lease, str]:
                lease = await hub.allocate(AllocateRequest(
                    request_key=f"hub/{name}/nb", user=name, model=RTX3090))
                return lease, await notebooks.start_for(lease)

            # 1. Two notebooks run, a third spawn is granted; then the load, and the backup.
            nb0, nb0_container = await notebook("nb0")
            nb1, nb1_container = await notebook("nb1")
            await wait_until(lambda: all_in_state(hub, LeaseState.BOUND, nb0, nb1), within=30)
            workers = [asyncio.create_task(churn(n, url, load)) for n in range(CLIENTS)]
            await wait_until(load.every_client_answered, within=60)
            # Granted just before the backup, so that its bind deadline has not passed in it.
            spawning = await hub.allocate(AllocateRequest(
                request_key="hub/spawning/nb", user="spawning", model=RTX3090))
            backup_began = time.monotonic()
            taken = await gpu_ledger("backup", backup, "--ledger", ledger)
            backup_ended = time.monotonic()
            assert taken.returncode == 0, taken
            assert f"to {backup}" in taken.stdout, taken.stdout
            during_backup = load.answered_between(backup_began, backup_ended)
            assert during_backup > 0, "the load was answered while the backup ran"
            backed_up = lease_rows(backup)
            assert backed_up[nb0.lease_id][0] == backed_up[nb1.lease_id][0] == "bound"
            assert backed_up[spawning.lease_id][0] == "granted", (
                "the spawn's grant is in the backup, its bind deadline not yet passed")

            # 2. After the backup: nb0 ends, the spawn is given back, two notebooks run on
            #    their GPUs; the load goes on.
            await notebooks.containers.container(nb0_container).delete(force=True)
            await wait_until(lambda: all_in_state(hub, LeaseState.RELEASED, nb0), within=30)
            await hub.release(lease_id=spawning.lease_id, by="hub", reason="spawn failed",
                              force=True)
            late1, late1_container = await notebook("late1")
            late2, late2_container = await notebook("late2")
            assert {*late1.gpu_uuids, *late2.gpu_uuids} == {*nb0.gpu_uuids,
                                                            *spawning.gpu_uuids}
            await wait_until(lambda: all_in_state(hub, LeaseState.BOUND, late1, late2),
                             within=30)
            await wait_until(lambda: load.answered_since(backup_ended, CLIENTS), within=60)
            load.stop.set()
            await asyncio.gather(*workers)
            live = audit_ledger(ledger)
            assert_sound(live)
            assert len(live.leases) > len(backed_up), "the backup is behind the ledger"

            # 3. Stop the allocator, restore the backup.
            stopped = await first.stop()
            assert stopped == 0, first.log()[-3000:]
            if position == "new-log":
                await delete_stream(url)
                restored = await gpu_ledger("restore", backup, "--ledger", ledger,
                                            "--new-log")
            else:
                restored = await gpu_ledger("restore", backup, "--ledger", ledger)
            assert restored.returncode == 0, restored
            assert SAYS[position] in restored.stdout, restored.stdout
            assert lease_rows(ledger) == backed_up, "the ledger is the backup again"

            # 4. A new allocator on the restored ledger takes back what runs.
            restarted_at = time.monotonic()
            await second.start()
            await second.wait_consuming()
            running = {nb1.lease_id: (nb1, nb1_container),
                       late1.lease_id: (late1, late1_container),
                       late2.lease_id: (late2, late2_container)}

            async def only_running_leases_hold() -> bool:
                holding = audit_ledger(ledger).holding()
                return set(holding) == set(running) and all(
                    row["state"] == "bound" for row in holding.values())
            await wait_until(only_running_leases_hold, within=45, interval=0.2)
            settled_s = time.monotonic() - restarted_at
            for lease_id, (lease, container) in running.items():
                now = await hub.status(lease_id=lease_id)
                assert (now.state, now.gpu_uuids, now.container_id, now.user) == (
                    LeaseState.BOUND, lease.gpu_uuids, container, lease.user)
            for gone in (nb0, spawning):
                assert not (await hub.status(lease_id=gone.lease_id)).state.holds_gpus
            with pytest.raises(AllocatorError) as refused:
                await hub.allocate(AllocateRequest(request_key="hub/after/nb", user="after",
                                                   model=RTX3090))
            assert refused.value.code is ErrorCode.NO_CAPACITY, refused.value

        checked = await asyncio.to_thread(gpu_ledger_check, ledger, live_amqp=url,
                                          listen_s=1.5)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        assert json.loads(checked.stdout) == {"ledger": str(ledger), "violations": [],
                                              "hosts_reported": [host]}, checked.stdout
    finally:
        load.stop.set()
        for worker in workers:
            worker.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await notebooks.close()
        await agent.stop()
        for process in (first, second):
            await process.stop()
    audit = audit_ledger(ledger)
    assert_sound(audit)
    taken_back = {lease_id for (lease_id,) in read(
        ledger, "SELECT lease_id FROM lease_history WHERE reason = 'adopted'")}
    (spawn_end,), = read(ledger, "SELECT release_reason FROM leases WHERE lease_id = ?",
                         spawning.lease_id)
    if position == "kept":
        assert taken_back == set(), "the log gave every lease back: nothing to adopt"
        assert spawn_end == "admin", "given back after the backup, as the log says"
    else:
        assert taken_back == {late1.lease_id, late2.lease_id}
        # The backup's grant held late's GPU until its bind deadline (the container was
        # adopted only then: docs/operations.md).
        assert spawn_end == "bind_timeout"
    report(f"backup_under_load_{ledger_log}_position_{position}", clients=CLIENTS,
           answers=len(load.answered_at), answered_during_backup=during_backup,
           granted=load.granted, refused=load.refused, leases_in_backup=len(backed_up),
           leases_at_stop=len(live.leases), adopted=len(taken_back),
           settled_after_restart_s=round(settled_s, 2),
           run_s=round(time.monotonic() - began, 1))

