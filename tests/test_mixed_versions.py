"""Mixed versions from the project's own history: the last commit of release 0.1.0 against
this tree, as real processes on the real broker (docs/protocol.md, "Compatibility").

(a) this allocator with a 0.1.0 agent and a 0.1.0 client (``allocator.cli ask``);
(b) a 0.1.0 allocator with this agent and this client.

0.1.0 is installed once into a virtual environment under the services folder, keyed by its
commit (about a minute the first time; reused after). Kill -> free with a lease container
needs Docker and is not covered here (tests/test_release_e2e.py covers it within one version).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import services
from faults import REPO_ROOT, AllocatorProcess, allocator_env
from services import require_service

from allocator.client import AllocatorClient
from allocator.protocol import AllocateRequest, LeaseState
from nodeagent.simulated import make_gpu, write_inventory

pytestmark = pytest.mark.slow

RELEASE_0_1_0 = "86a59a1"
"""The last commit of release 0.1.0."""

GTX1070 = "NVIDIA GeForce GTX 1070"


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


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SWARM_GPU_") and k != "PYTHONPATH"}
    env.update(extra, PYTHONUNBUFFERED="1")
    return env


@contextlib.asynccontextmanager
async def _agent(python: Path, cwd: Path, host: str, amqp_url: str, tmp: Path,
                 extra: dict[str, str] | None = None) -> AsyncIterator[Path]:
    """A node agent process (of the release whose ``python`` and ``cwd`` are given) with one
    simulated GTX 1070 and no Docker; yields its log file."""
    inventory = tmp / f"{host}.json"
    write_inventory(inventory, {host: [make_gpu(host, 0, GTX1070)]})
    log = tmp / f"agent-{host}.log"
    env = _env({"SWARM_GPU_AGENT_HOST": host, "SWARM_GPU_AGENT_AMQP_URL": amqp_url,
                "SWARM_GPU_AGENT_INVENTORY": "simulated",
                "SWARM_GPU_AGENT_SIMULATED_FILE": str(inventory),
                "SWARM_GPU_AGENT_DOCKER": "false", "SWARM_GPU_AGENT_INTERVAL_S": "1",
                **(extra or {})})
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


async def test_this_allocator_with_a_0_1_0_agent_and_client(release_0_1_0: Path, amqp_vhost,
                                                            tmp_path: Path) -> None:
    old_python, old_src = release_0_1_0 / "venv" / "bin" / "python", release_0_1_0 / "src"
    allocator = AllocatorProcess("new", amqp_vhost.url, tmp_path / "ledger.sqlite", tmp_path,
                                 start_fence_s=0, node_down_after_s=3, tick_s=0.2)
    await allocator.start()
    try:
        await allocator.wait_consuming()
        async with _agent(old_python, old_src, "gpu-old", amqp_vhost.url, tmp_path) as log, \
                AllocatorClient(amqp_vhost.url, timeout_s=10) as client:
            await _up_for(client, "gpu-old", 6.0)
            asked = await asyncio.create_subprocess_exec(
                str(old_python), "-m", "allocator.cli", "ask", "--amqp", amqp_vhost.url,
                "--user", "alice", "--json", cwd=old_src, env=_env({}),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
            out, _ = await asked.communicate()
            assert asked.returncode == 0, out.decode()
            assert '"granted"' in out.decode() and "gpu-old" in out.decode()
            lease = await client.status(request_key="cli/alice/")
            assert lease.state is LeaseState.GRANTED, log.read_text()[-2000:]
    finally:
        await allocator.stop()
    assert "Traceback" not in allocator.log()


async def test_a_0_1_0_allocator_with_this_agent_and_client(release_0_1_0: Path, amqp_vhost,
                                                            tmp_path: Path) -> None:
    old_python, old_src = release_0_1_0 / "venv" / "bin" / "python", release_0_1_0 / "src"
    env = allocator_env(amqp_vhost.url, tmp_path / "ledger.sqlite", start_fence_s=0,
                        node_down_after_s=3, tick_s=0.2)
    env.pop("PYTHONPATH", None)
    log_path = tmp_path / "allocator-old.log"
    with open(log_path, "wb") as out:  # noqa: ASYNC230 - handed to the child
        process = await asyncio.create_subprocess_exec(
            str(old_python), "-m", "allocator.cli", "serve", cwd=old_src, env=env,
            stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while "allocator consuming" not in log_path.read_text(errors="replace"):
            assert process.returncode is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            await asyncio.sleep(0.05)
        async with _agent(Path(sys.executable), REPO_ROOT, "gpu-new", amqp_vhost.url, tmp_path,
                          {"SWARM_GPU_AGENT_METRICS_PORT": "0"}), \
                AllocatorClient(amqp_vhost.url, timeout_s=10) as client:
            await _up_for(client, "gpu-new", 6.0)
            lease = await client.allocate(AllocateRequest(request_key="hub/bob/", user="bob"))
            assert lease.state is LeaseState.GRANTED and lease.host == "gpu-new"
            released = await client.release(request_key="hub/bob/")
            assert released.state in (LeaseState.RELEASING, LeaseState.RELEASED)
            await _up_for(client, "gpu-new", 2.0)
    finally:
        if process.returncode is None:
            process.terminate()
            await process.wait()
    assert "Traceback" not in log_path.read_text(errors="replace")
