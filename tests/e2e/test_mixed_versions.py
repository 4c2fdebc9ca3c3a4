"""Mixed versions from the project's own history: the last commit of release 0.1.0 against
this tree, as real processes on the real broker (docs/protocol.md, "Compatibility";
CHANGELOG.md, the 0.2.0 upgrade notes).

- One allocator, one agent, one client of different releases, both ways: (a) this
  allocator with a 0.1.0 agent and a 0.1.0 client (``allocator.cli ask``); (b) a 0.1.0
  allocator with this agent and this client. Heartbeats keep the host up, a request is
  granted and released.
- Kill -> free, both ways: a lease-labelled container on a real Docker engine binds the lease
  it carries; ``docker kill`` frees its GPU, and the next request gets that GPU.
- Two replicas of different releases on one replicated ledger log (``ledger_log =
  "stream"``), each on a ledger file of its own, both ways: the first is active, the other
  follows it as standby; the active one is killed; the standby takes over holding every
  lease the first granted; both releases' clients release a lease each through it. Then the
  killed replica comes back on this release and on its own ledger, as the second step of a
  rolling update: it migrates its ledger and catches up with what the other one wrote. A
  0.1.0 replica put back on that ledger is refused (its schema is newer than 0.1.0's).

Where 0.1.0 is too old for something, the test uses what 0.1.0 has:

- The lease container carries only the lease label, which is all a 0.1.0 agent reads (this
  release's spawner also sets grant labels; this release's agent and allocator bind a
  container on the lease label alone). It is a plain container on a Docker engine of the
  module's own (``services.private_docker``, no Swarm) rather than a Swarm service on the
  shared engine: binding and death are the same for the agent, and the shared engine's
  tests, the suite's longest chain, do not wait for this module.
- 0.1.0 writes schema 5 and refuses a ledger of a later schema, so the replicas never share a
  file: each has its own, as with the ledger log anyway, and the killed replica comes back
  on this release (0.1.0 on that file is refused, which is checked). The notes' promise is
  what is checked: a 0.1.0 replica follows this release's batches and snapshots (each
  writer appends one at its first batch and per 4 KiB of log here) without stopping, and
  takes over; its ledger stays schema 5 and records no owner; this release's ledger is of
  its schema (6 or later), with the owner of the leases it granted and none for the leases
  0.1.0 granted (anyone's, as in 0.1.0).
- 0.1.0 knows no lease owners: every client here is the broker user ``guest``, so a release
  through either client is allowed whoever granted the lease.
- Loading a snapshot of the other release to catch up (a replica whose place in the log is
  gone) is not run here; tests/ledger/test_lease_owner.py runs 0.1.0's own ledger code on this
  release's change sets and snapshots.

0.1.0 is installed once into a virtual environment under the services folder, keyed by its
commit (about a minute the first time; reused after).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from allocator.amqp.client import AllocatorClient
from allocator.ledger.readonly import open_readonly
from allocator.ledger.schema import SCHEMA_VERSION
from allocator.wire.protocol import AllocateRequest, Lease, LeaseState, ReleaseReason
from nodeagent.simulated import make_gpu, write_inventory
from tests.support import services
from tests.support.common import RTX3090, LabelledDocker, beat_until, gpus, wait_until
from tests.support.faults import REPO_ROOT, AllocatorProcess
from tests.support.services import require_service

pytestmark = pytest.mark.slow

RELEASE_0_1_0 = "86a59a1"
"""The last commit of release 0.1.0."""

GTX1070 = "NVIDIA GeForce GTX 1070"

LEDGER_LOG: dict[str, Any] = {"ledger_log": "stream", "ledger_log_snapshot_bytes": 4096,
                              "node_down_after_s": 30, "tick_s": 0.2}
"""Replicas on one log; a snapshot every 4 KiB of log, so each writer appends some that the
other release follows over."""

LOG_HOSTS = {"gpu-a": gpus("gpu-a", RTX3090, 2), "gpu-b": gpus("gpu-b", RTX3090, 2)}


@pytest.fixture(scope="session")
def release_0_1_0() -> Path:
    """A worktree of 0.1.0 with its own virtual environment: the folder of both."""
    git = shutil.which("git")
    if git is None:
        require_service("git", "not found")
    found = subprocess.run([git, "-C", str(REPO_ROOT), "rev-parse", "--verify", "--quiet",
                            f"{RELEASE_0_1_0}^{{commit}}"], capture_output=True, check=False)
    if found.returncode != 0:
        require_service(f"commit {RELEASE_0_1_0} (0.1.0)", "not in this clone's history")
    base = services.services_dir() / "old-releases" / RELEASE_0_1_0
    src, venv, done = base / "src", base / "venv", base / "venv" / "installed"
    if not done.exists():
        base.mkdir(parents=True, exist_ok=True)
        if not (src / "pyproject.toml").exists():
            subprocess.run([git, "-C", str(REPO_ROOT), "worktree", "prune"], check=False)
            subprocess.run([git, "-C", str(REPO_ROOT), "worktree", "add", "--detach",
                            str(src), RELEASE_0_1_0], check=True, capture_output=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        installed = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "-e",
                                    f"{src}[agent]"], capture_output=True, text=True,
                                   check=False, timeout=600)
        if installed.returncode != 0:
            require_service("0.1.0's packages", installed.stderr[-2000:])
        done.touch()
    return base


@pytest.fixture(scope="module")
def lease_engine() -> Iterator[services.PrivateDocker]:
    """A Docker engine of the module's own, with the busybox image, for lease containers."""
    with services.private_docker() as engine:
        yield engine


class OldAllocator(AllocatorProcess):
    """``allocator.cli serve`` of release 0.1.0, from its worktree and virtual environment."""

    def __init__(self, release: Path, name: str, amqp_url: str, ledger_path: Path,
                 log_dir: Path, **settings: Any) -> None:
        super().__init__(name, amqp_url, ledger_path, log_dir, **settings)
        self.env.pop("PYTHONPATH", None)  # this tree's packages must not shadow 0.1.0's
        self.release = release

    async def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: ASYNC230, SIM115 - handed to the child
        try:
            self.process = await asyncio.create_subprocess_exec(
                str(self.release / "venv" / "bin" / "python"), "-m", "allocator.cli", "serve",
                cwd=self.release / "src", env=self.env, stdin=asyncio.subprocess.DEVNULL,
                stdout=log, stderr=asyncio.subprocess.STDOUT)
        finally:
            log.close()


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SWARM_GPU_") and k != "PYTHONPATH"}
    env.update(extra, PYTHONUNBUFFERED="1")
    return env


@contextlib.asynccontextmanager
async def _agent(python: Path, cwd: Path, host: str, amqp_url: str, tmp: Path,
                 extra: dict[str, str] | None = None, *,
                 docker_url: str | None = None) -> AsyncIterator[Path]:
    """A node agent process (of the release whose ``python`` and ``cwd`` are given) with one
    simulated GTX 1070, watching the engine at ``docker_url`` (none: no Docker); yields its
    log file."""
    inventory = tmp / f"{host}.json"
    write_inventory(inventory, {host: [make_gpu(host, 0, GTX1070)]})
    log = tmp / f"agent-{host}.log"
    docker = {"SWARM_GPU_AGENT_DOCKER": "false"} if docker_url is None else {
        "SWARM_GPU_AGENT_DOCKER": "true", "SWARM_GPU_AGENT_DOCKER_URL": docker_url}
    env = _env({"SWARM_GPU_AGENT_HOST": host, "SWARM_GPU_AGENT_AMQP_URL": amqp_url,
                "SWARM_GPU_AGENT_INVENTORY": "simulated",
                "SWARM_GPU_AGENT_SIMULATED_FILE": str(inventory),
                "SWARM_GPU_AGENT_INTERVAL_S": "0.5", **docker, **(extra or {})})
    with open(log, "wb") as out:  # noqa: ASYNC230 - handed to the child
        process = await asyncio.create_subprocess_exec(
            str(python), "-m", "nodeagent", cwd=cwd, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=out, stderr=asyncio.subprocess.STDOUT)
    try:
        yield log
    finally:
        if process.returncode is None:
            process.terminate()
            try:
                async with asyncio.timeout(10):
                    await process.wait()
            except TimeoutError:
                process.kill()
                await process.wait()


def _old_agent(release: Path, host: str, amqp_url: str, tmp: Path, *,
               docker_url: str | None = None) -> contextlib.AbstractAsyncContextManager[Path]:
    return _agent(release / "venv" / "bin" / "python", release / "src", host, amqp_url, tmp,
                  docker_url=docker_url)


def _this_agent(host: str, amqp_url: str, tmp: Path, *,
                docker_url: str | None = None) -> contextlib.AbstractAsyncContextManager[Path]:
    return _agent(Path(sys.executable), REPO_ROOT, host, amqp_url, tmp,
                  {"SWARM_GPU_AGENT_METRICS_PORT": "0"}, docker_url=docker_url)


async def _old_cli(release: Path, amqp_url: str, *args: str) -> dict[str, Any]:
    """``gpu-allocator ARGS --json`` of release 0.1.0: the lease it prints."""
    ran = await asyncio.create_subprocess_exec(
        str(release / "venv" / "bin" / "python"), "-m", "allocator.cli", *args,
        "--amqp", amqp_url, "--json", cwd=release / "src", env=_env({}),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await ran.communicate()
    assert ran.returncode == 0, (out + err).decode()
    lease: dict[str, Any] = json.loads(out)
    return lease


async def _up_for(client: AllocatorClient, host: str, seconds: float) -> None:
    """The host comes up, then stays up for ``seconds`` (several node_down_after_s)."""
    deadline = time.monotonic() + 20
    while True:
        nodes = {node.host: node.up for node in (await client.inventory()).nodes}
        if nodes.get(host):
            break
        assert time.monotonic() < deadline, f"{host} never came up: {nodes}"
        await asyncio.sleep(0.2)
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        nodes = {node.host: node.up for node in (await client.inventory()).nodes}
        assert nodes.get(host), f"{host} went down: {nodes}"
        await asyncio.sleep(0.5)


async def in_state(client: AllocatorClient, lease_id: str, state: LeaseState) -> Lease | None:
    lease = await client.status(lease_id=lease_id)
    return lease if lease.state is state else None


# ------------------------------------------------------- one allocator, agent and client


@contextlib.asynccontextmanager
async def _serving(release: Path | None, amqp_url: str, tmp_path: Path,
                   **settings: Any) -> AsyncIterator[AllocatorProcess]:
    """One allocator (of 0.1.0 from ``release``; of this tree without) on a ledger of its
    own, consuming for the block and stopped after it; its log has no traceback."""
    common: dict[str, Any] = {"start_fence_s": 0, "tick_s": 0.2, **settings}
    ledger = tmp_path / "ledger.sqlite"
    allocator = (AllocatorProcess("new", amqp_url, ledger, tmp_path, **common) if release is None
                 else OldAllocator(release, "old", amqp_url, ledger, tmp_path, **common))
    await allocator.start()
    try:
        await allocator.wait_consuming()
        yield allocator
    finally:
        await allocator.stop()
    assert "Traceback" not in allocator.log(), allocator.log()[-3000:]


async def test_this_allocator_with_a_0_1_0_agent_and_client(release_0_1_0: Path, amqp_vhost,
                                                            tmp_path: Path) -> None:
    url = amqp_vhost.url
    async with _serving(None, url, tmp_path, node_down_after_s=3), \
            _old_agent(release_0_1_0, "gpu-old", url, tmp_path) as log, \
            AllocatorClient(url, timeout_s=10) as client:
        await _up_for(client, "gpu-old", 6.0)
        granted = await _old_cli(release_0_1_0, url, "ask", "--user", "alice")
        assert (granted["state"], granted["host"]) == ("granted", "gpu-old")
        lease = await client.status(request_key="cli/alice/")
        assert lease.state is LeaseState.GRANTED, log.read_text()[-2000:]


async def test_a_0_1_0_allocator_with_this_agent_and_client(release_0_1_0: Path, amqp_vhost,
                                                            tmp_path: Path) -> None:
    url = amqp_vhost.url
    async with _serving(release_0_1_0, url, tmp_path, node_down_after_s=3), \
            _this_agent("gpu-new", url, tmp_path), \
            AllocatorClient(url, timeout_s=10) as client:
        await _up_for(client, "gpu-new", 6.0)
        lease = await client.allocate(AllocateRequest(request_key="hub/bob/", user="bob"))
        assert lease.state is LeaseState.GRANTED and lease.host == "gpu-new"
        released = await client.release(request_key="hub/bob/")
        assert released.state in (LeaseState.RELEASING, LeaseState.RELEASED)
        await _up_for(client, "gpu-new", 2.0)


# ------------------------------------------------------------------------- kill -> free


async def _kill_frees_the_gpu(client: AllocatorClient, host: str, docker_url: str) -> None:
    """A lease on ``host``, its container started, bound, killed: the lease ends with the
    container and the next request gets the very GPU."""
    await _up_for(client, host, 0.0)
    lease = await client.allocate(AllocateRequest(request_key="hub/alice/", user="alice",
                                                  host=host))
    assert lease.state is LeaseState.GRANTED and lease.host == host
    docker = LabelledDocker(docker_url)
    try:
        container = await docker.start_labelled(lease.lease_id, services.BUSYBOX_IMAGE,
                                                ["sleep", "300"], stop_signal="SIGKILL")
        bound = await wait_until(lambda: in_state(client, lease.lease_id, LeaseState.BOUND),
                                 within=20)
        assert bound.container_id == container
        await docker.containers.container(container).kill()
        released = await wait_until(
            lambda: in_state(client, lease.lease_id, LeaseState.RELEASED), within=20)
        assert released.release_reason is ReleaseReason.CONTAINER_EXITED
    finally:
        await docker.close()
    after = await client.allocate(AllocateRequest(request_key="hub/bob/", user="bob",
                                                  host=host))
    assert after.state is LeaseState.GRANTED and after.gpu_uuids == lease.gpu_uuids


@pytest.mark.docker
@pytest.mark.parametrize("old", ["agent", "allocator"], ids=["0.1.0-agent", "0.1.0-allocator"])
async def test_kill_frees_the_gpu_across_releases(
        release_0_1_0: Path, lease_engine: services.PrivateDocker, amqp_vhost, tmp_path: Path,
        old: str) -> None:
    """(a) a 0.1.0 agent and this allocator; (b) this agent and a 0.1.0 allocator."""
    url, host = amqp_vhost.url, f"gpu-kill-{old}"
    agent = (_old_agent(release_0_1_0, host, url, tmp_path, docker_url=lease_engine.url)
             if old == "agent" else _this_agent(host, url, tmp_path, docker_url=lease_engine.url))
    async with _serving(release_0_1_0 if old == "allocator" else None, url, tmp_path,
                        container_gone_grace_s=0.5), \
            agent, AllocatorClient(url, timeout_s=10) as client:
        await _kill_frees_the_gpu(client, host, lease_engine.url)


# ------------------------------------------------------- two replicas on one ledger log


def _ledger(path: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """A replica's ledger: its schema version, and its leases by id."""
    conn = open_readonly(path)
    try:
        conn.row_factory = sqlite3.Row
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        leases = {row["lease_id"]: dict(row) for row in conn.execute("SELECT * FROM leases")}
    finally:
        conn.close()
    return version, leases


async def _applied(path: Path, states: dict[str, str]) -> dict[str, dict[str, Any]] | None:
    """The ledger's leases once each lease of ``states`` is in its state there."""
    if not await asyncio.to_thread(path.exists):
        return None
    _, leases = await asyncio.to_thread(_ledger, path)
    if all(leases.get(lease_id, {}).get("state") == state for lease_id, state in states.items()):
        return leases
    return None


@pytest.mark.parametrize("first_is_old", [True, False], ids=["0.1.0-active", "0.1.0-standby"])
async def test_replicas_of_both_releases_on_one_ledger_log(
        release_0_1_0: Path, amqp_vhost, tmp_path: Path, first_is_old: bool) -> None:
    """The first replica active, the other release's standby following it; the first killed,
    the standby holding its leases; releases through both clients; the first back on this
    release, caught up."""
    url = amqp_vhost.url
    ledger_first, ledger_second = (tmp_path / "first" / "ledger.sqlite",
                                   tmp_path / "second" / "ledger.sqlite")
    old, new = (OldAllocator(release_0_1_0, "old", url,
                             ledger_first if first_is_old else ledger_second, tmp_path,
                             **LEDGER_LOG),
                AllocatorProcess("new", url, ledger_second if first_is_old else ledger_first,
                                 tmp_path, **LEDGER_LOG))
    first, second = (old, new) if first_is_old else (new, old)
    stop_beating = asyncio.Event()
    beating = asyncio.create_task(beat_until(url, LOG_HOSTS, stop_beating, 0.3))
    try:
        await first.start()
        await first.wait_consuming()
        await second.start()
        await second.wait_consuming()
        async with AllocatorClient(url, timeout_s=10) as client:
            async def both_up() -> bool:
                return sum(n.up for n in (await client.inventory()).nodes) == len(LOG_HOSTS)
            await wait_until(both_up, within=20)
            # One lease through each release's client, from the first replica.
            by_old = await _old_cli(release_0_1_0, url, "ask", "--user", "alice")
            by_new = await client.allocate(AllocateRequest(request_key="hub/bob/", user="bob"))
            assert by_old["state"] == "granted" and by_new.state is LeaseState.GRANTED
            granted = {by_old["lease_id"]: "granted", by_new.lease_id: "granted"}
            await wait_until(lambda: _applied(ledger_second, granted), within=20)
            assert "snapshot of the ledger at offset" in first.log(), \
                "no snapshot in the log for the other release to follow over"
            assert second.process is not None and second.process.returncode is None, \
                f"the standby stopped:\n{second.log()[-3000:]}"

            first.kill()
            assert first.process is not None
            await first.process.wait()
            # The standby takes over with both leases: same lease, GPUs and host.
            took = await wait_until(lambda: in_state(client, by_new.lease_id,
                                                      LeaseState.GRANTED), within=20)
            assert (took.host, took.gpu_uuids) == (by_new.host, by_new.gpu_uuids)
            taken_old = await client.status(lease_id=by_old["lease_id"])
            assert taken_old.state is LeaseState.GRANTED
            assert (taken_old.host, taken_old.gpu_uuids) == (by_old["host"],
                                                               by_old["gpu_uuids"])

            # A release through each release's client, to the replica that took over.
            released_old = await _old_cli(release_0_1_0, url, "release", by_new.lease_id)
            assert released_old["state"] in ("releasing", "released")
            released_new = await client.release(lease_id=by_old["lease_id"])
            assert released_new.state in (LeaseState.RELEASING, LeaseState.RELEASED)
            async def both_released() -> bool:
                states = [(await client.status(lease_id=lease_id)).state
                          for lease_id in granted]
                return states == [LeaseState.RELEASED] * len(granted)
            await wait_until(both_released, within=20)

            # The second step of a rolling update: the killed replica comes back on this
            # release, on its own ledger, and catches up with what the other one wrote.
            back = AllocatorProcess("back", url, ledger_first, tmp_path, **LEDGER_LOG)
            await back.start()
            try:
                await back.wait_consuming()
                released = dict.fromkeys(granted, "released")
                await wait_until(lambda: _applied(ledger_first, released), within=30)
            finally:
                stopped = await back.stop()
            assert stopped == 0 and "Traceback" not in back.log(), back.log()[-3000:]
            if first_is_old:
                # Rolling that replica back to 0.1.0 on the same file is refused: this
                # release has migrated it to a schema 0.1.0 does not know.
                rollback = OldAllocator(release_0_1_0, "rollback", url, ledger_first,
                                        tmp_path, **LEDGER_LOG)
                await rollback.start()
                assert rollback.process is not None
                try:
                    async with asyncio.timeout(30):
                        refused = await rollback.process.wait()
                finally:
                    await rollback.stop()
                assert refused != 0 and "newer than this release understands" in \
                    rollback.log(), rollback.log()[-3000:]
    finally:
        stop_beating.set()
        await beating
        for replica in (first, second):
            await replica.stop()

    # The first replica's file is on this release now (it came back on it): its schema. The
    # second's is schema 5 where 0.1.0 ran on it, with no owner column; leases granted by
    # 0.1.0 have no owner in this release's ledgers, those granted by this release do.
    first_version, first_leases = _ledger(ledger_first)
    second_version, second_leases = _ledger(ledger_second)
    ours = SCHEMA_VERSION
    assert (first_version, second_version) == ((ours, ours) if first_is_old else (ours, 5))
    assert set(first_leases) == set(second_leases) == set(granted)
    owner = None if first_is_old else "guest"
    for leases in (first_leases, second_leases) if first_is_old else (first_leases,):
        assert {lease_id: row["owner"] for lease_id, row in leases.items()} == \
            dict.fromkeys(granted, owner)
    if not first_is_old:
        assert all("owner" not in row for row in second_leases.values())
    for replica in (first, second):
        assert "Traceback" not in replica.log(), replica.log()[-3000:]
