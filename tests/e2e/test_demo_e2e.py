"""``scripts/demo``, the README's first command, end to end as a newcomer runs it.

The hub demo runs in a state folder of the test's own (``SWARM_GPU_DEMO_DIR``) on a free port,
so a developer's own demo in the same checkout is left alone: the walk-through must pass, the
printed passwords must log in, the GPU page must show the user's lease, bob's notebook must
answer through the hub's proxy, and ``scripts/demo stop`` must leave nothing of it running:
no process, no notebook service, no vhost, no port. Bad ground (the port taken, no root)
gets one line that names what is missing and offers ``--cli``, which is tested too.

The first run on a machine builds the notebook image (a Debian base by mmdebstrap, then
jupyterhub-singleuser; cached in .images/ and the engine, shared with scripts/cluster), so
the hub test allows for a cold build.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
import pytest

from tests.support import services
from tests.support.other_user import NOBODY, copy_for
from tests.support.ports import free_port
from tests.support.services import REPO_ROOT, require_service

DEMO = REPO_ROOT / "scripts" / "demo"
DEMO_SCRIPTS = ("scripts",)
"""What ``scripts/demo`` reads before it checks its ground: itself and the scripts it sources."""
COLD_DEMO_S = 600
"""A cold scripts/demo builds the base and notebook images: about 3 min on a 2-core machine."""


def run_demo(args: list[str], env: dict[str, str], timeout: float, user: int | None = None,
             checkout: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    """``scripts/demo ARGS`` of ``checkout`` (as ``user``, a uid, when given)."""
    command = ["bash", str(checkout / DEMO.relative_to(REPO_ROOT)), *args]
    if user is not None:
        command = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *command]
    return subprocess.run(command, cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, check=False)


def demo_env(state: Path, port: int) -> dict[str, str]:
    return {**os.environ, "SWARM_GPU_DEMO_DIR": str(state), "SWARM_GPU_DEMO_PORT": str(port)}


def demo_processes(state: Path) -> list[int]:
    """Pids of processes that the demo in ``state`` started (marked in their environment)."""
    marks = {f"SWARM_GPU_DEMO_PROCESS={state}".encode(),
             f"SWARM_GPU_PAGE_HISTORY_PATH={state}/hub/gpu-page-history.sqlite".encode()}
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        with contextlib.suppress(OSError):
            if marks & set(environ.read_bytes().split(b"\0")):
                found.append(int(environ.parent.name))
    return found


def exported(env_file: Path) -> dict[str, str]:
    """The ``export NAME=VALUE`` lines of the demo's env file."""
    values = {}
    for line in env_file.read_text().splitlines():
        words = shlex.split(line)
        if len(words) == 2 and words[0] == "export":
            name, _, value = words[1].partition("=")
            values[name] = value
    return values


def demo_vhost(state: Path) -> str:
    """The demo's vhost, from the admin's broker URL that its env file points to."""
    url = Path(exported(state / "env")["SWARM_GPU_AMQP_URL_FILE"]).read_text().strip()
    return url.rsplit("/", 1)[1]


def vhost_users(broker: services.RabbitMQ, vhost: str) -> set[str]:
    """The broker users with any right on ``vhost``."""
    return {entry["user"] for entry in
            broker.api("GET", f"/api/vhosts/{urllib.parse.quote(vhost, safe='')}/permissions")}


def assert_only_the_demos_users(broker: services.RabbitMQ, vhost: str, agents: int) -> set[str]:
    """Only the demo's own users (the shipped roles, one agent a host) have rights on its
    vhost, and guest, whose password everyone knows, cannot even open it."""
    users = vhost_users(broker, vhost)
    (admin,) = [user for user in users if user.endswith("-admin")]
    prefix = admin.removesuffix("admin")
    assert re.fullmatch(r"demo-[0-9a-f]{6}-", prefix), users
    assert all(user.startswith(prefix) for user in users), users
    assert sorted(user.removeprefix(prefix) for user in users if "-agent-" not in user) == [
        "admin", "allocator", "hub"], users
    assert sum("-agent-" in user for user in users) == agents, users

    async def guest_opens_the_vhost() -> None:
        connection = await aio_pika.connect(
            f"amqp://guest:guest@{broker.host}:{broker.port}/{vhost}", timeout=10)
        await connection.close()

    # The broker answers the open with Connection.Close (NOT_ALLOWED); aiormq reports it as
    # a cancelled open whose cause names the frame.
    with pytest.raises((asyncio.CancelledError, aio_pika.exceptions.AMQPError)) as refused:
        asyncio.run(guest_opens_the_vhost())
    assert "Connection.Close" in repr(refused.value) + repr(refused.value.__cause__)
    return users


def broker_users(broker: services.RabbitMQ) -> set[str]:
    return {user["name"] for user in broker.api("GET", "/api/users")}


@pytest.fixture
def hub_demo(tmp_path: Path, docker_engine: str) -> Iterator[tuple[Path, int]]:
    """The demo's state folder and port; ``scripts/demo stop`` afterwards whatever happened."""
    if os.geteuid() != 0:
        require_service("scripts/demo", "the hub demo runs a Docker engine, which needs root")
    state, port = tmp_path / "demo", free_port()
    yield state, port
    run_demo(["stop"], demo_env(state, port), timeout=120)


async def log_in(session: aiohttp.ClientSession, hub: str, user: str, password: str) -> int:
    """Log in through the hub's login form as a browser does; the login's HTTP status."""
    async with session.get(f"{hub}/hub/login") as response:
        await response.text()
    xsrf = next((c.value for c in session.cookie_jar if c.key == "_xsrf"), "")
    async with session.post(f"{hub}/hub/login?next=",
                            data={"username": user, "password": password, "_xsrf": xsrf},
                            allow_redirects=False) as response:
        return response.status


@pytest.mark.docker
@pytest.mark.hub
@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(2 * COLD_DEMO_S + 300)
async def test_the_demo_starts_gpu_notebooks_from_the_hub_and_stops_clean(
        hub_demo: tuple[Path, int], docker_engine: str, chromium_path: Path,
        tmp_path: Path) -> None:
    state, port = hub_demo
    if services.chp_path() is None:
        require_service("configurable-http-proxy", "not installed")
    env = demo_env(state, port)
    # A first run left running (as an interrupted one would leave it): the next run takes
    # over from it, whatever it left.
    first = run_demo(["--no-walkthrough"], env, timeout=COLD_DEMO_S)
    assert first.returncode == 0, (first.stdout + first.stderr)[-6000:]
    assert "walk-through" not in first.stdout
    left_running = demo_processes(state)
    assert left_running
    demo = run_demo([], env, timeout=COLD_DEMO_S)
    output = demo.stdout + demo.stderr
    assert demo.returncode == 0, output[-6000:]
    hub = f"http://127.0.0.1:{port}"
    assert f"JupyterHub at  {hub}" in demo.stdout

    # The walk-through: alice's grant, bob queued behind it, the hand-over after the kill.
    assert "NVIDIA_VISIBLE_DEVICES=GPU-" in demo.stdout
    assert "queued (position 1)" in demo.stdout
    assert "walk-through passed" in demo.stdout
    assert not set(left_running) & set(demo_processes(state))
    timings = json.loads(demo.stdout.strip().splitlines()[-1])["walkthrough"]
    assert timings["handover_s"] > 0 and timings["walkthrough_s"] >= timings["handover_s"]
    print(f"scripts/demo: {timings}")

    # The printed passwords log in; a wrong one does not.
    passwords = dict(re.findall(r"^\s+(?:log in as)?\s*(admin|alice|bob)\s+/\s+(\S+)",
                                demo.stdout, re.MULTILINE))
    assert set(passwords) == {"admin", "alice", "bob"}, demo.stdout
    jar = aiohttp.CookieJar(unsafe=True)
    async with aiohttp.ClientSession(cookie_jar=jar,
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        assert await log_in(session, hub, "bob", passwords["alice"]) == 403
        assert await log_in(session, hub, "bob", passwords["bob"]) == 302
        # The GPU page (OAuth through the hub) shows bob the A100 he now holds.
        async with session.get(f"{hub}/services/gpu/") as response:
            page = await response.text()
            assert response.status == 200, page[:500]
        assert "A100" in page

        # bob's notebook answers through the hub's proxy, with a token the hub gave him.
        admin_token = (state / "secrets" / "swarm-gpu-hub-api-token").read_text().strip()
        async with session.post(f"{hub}/hub/api/users/bob/tokens",
                                headers={"Authorization": f"token {admin_token}"},
                                json={"note": "test", "expires_in": 600}) as response:
            assert response.status == 201
            token = (await response.json())["token"]
        async with session.get(f"{hub}/user/bob/api/status",
                               headers={"Authorization": f"token {token}"}) as response:
            assert response.status == 200
            status: dict[str, Any] = await response.json()
        assert "started" in status

    await asyncio.to_thread(browse, hub, passwords, tmp_path, chromium_path)

    settings = exported(state / "env")
    vhost = demo_vhost(state)
    prefix = settings["SWARM_GPU_DEMO_PREFIX"]
    broker = services.rabbitmq_from_env()
    assert services.vhost_exists(broker, vhost)
    users = await asyncio.to_thread(assert_only_the_demos_users, broker, vhost, 1)
    assert demo_processes(state)

    stop = run_demo(["stop"], env, timeout=120)
    assert stop.returncode == 0, stop.stdout + stop.stderr
    assert demo_processes(state) == []
    assert not services.port_open("127.0.0.1", port)
    assert not services.vhost_exists(broker, vhost)
    assert not users & broker_users(broker)
    code, body = services.docker_api(docker_engine, "GET", "/services")
    assert code == 200
    assert [s["Spec"]["Name"] for s in json.loads(body)
            if s["Spec"]["Name"].startswith(f"{prefix}-")] == []


def browse(hub: str, passwords: dict[str, str], tmp_path: Path, chromium: Path) -> None:
    """The spawn page as the admin sees it, and the GPU page as bob sees it, in Chromium;
    with SWARM_GPU_UPDATE_DOCS=1 the screenshots become the README's pictures."""
    from tests.support.hub_browser import Browser

    shots = {"spawn": tmp_path / "demo-spawn-page.png", "page": tmp_path / "demo-gpu-page.png"}
    with Browser(chromium, tmp_path / "chromium", height=900) as browser:
        tab = browser.page()
        browser.log_in(tab, hub, "admin", passwords["admin"])
        browser.navigate(tab, f"{hub}/hub/spawn")
        spawn = browser.evaluate(tab, """({
            models: [...document.querySelectorAll('#sg-model option')].map(o => o.value),
            text: document.body.innerText,
        })""")
        browser.screenshot(tab, shots["spawn"], full_page=True)
        browser.navigate(tab, f"{hub}/hub/logout")
        browser.log_in(tab, hub, "bob", passwords["bob"])
        browser.navigate(tab, f"{hub}/services/gpu/")
        page_text = str(browser.evaluate(tab, "document.body.innerText"))
        browser.screenshot(tab, shots["page"], full_page=True)
    assert "NVIDIA A100-SXM4-40GB" in spawn["models"], spawn
    assert "NVIDIA GeForce RTX 3090" in spawn["models"], spawn
    assert "Available now" in spawn["text"]
    assert "A100" in page_text and "bob" in page_text, page_text[:1000]
    for shot in shots.values():
        assert shot.stat().st_size > 10_000
        if os.environ.get("SWARM_GPU_UPDATE_DOCS") == "1":
            shutil.copyfile(shot, REPO_ROOT / "docs" / shot.name)


@pytest.mark.slow
def test_a_taken_port_is_named_and_the_cli_demo_offered(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = int(taken.getsockname()[1])
        env = demo_env(tmp_path / "demo", port)
        try:
            demo = run_demo([], env, timeout=60)
        finally:  # a demo that did not refuse must not outlive the test
            if (tmp_path / "demo").exists():
                run_demo(["stop"], env, timeout=120)
    assert demo.returncode == 1
    lines = demo.stderr.strip().splitlines()
    assert f"port {port} on 127.0.0.1 is taken" in lines[0]
    assert "scripts/demo --cli" in lines[-1]
    assert not (tmp_path / "demo").exists()  # refused before anything was started


@pytest.mark.slow
def test_without_root_the_hub_demo_says_so_and_offers_the_cli_demo() -> None:
    if os.geteuid() != 0:
        require_service("another user (setpriv)", "running the demo as another user needs root")
    # The checkout itself may be closed to other users (a clone in a 0700 folder): the
    # unprivileged user runs a copy of what the check needs, in a folder it owns, so that the
    # demo could make its state folder there if it went on.
    with copy_for(NOBODY, DEMO_SCRIPTS) as checkout:
        state = checkout / "demo"
        demo = run_demo([], demo_env(state, free_port()), timeout=60, user=NOBODY,
                        checkout=checkout)
        assert not state.exists()
    assert demo.returncode == 1, demo.stderr
    assert "needs root" in demo.stderr
    assert "--engine" in demo.stderr and "scripts/demo --cli" in demo.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_cli_demo_allocates_without_docker(tmp_path: Path) -> None:
    broker = services.rabbitmq_from_env()
    problem = services.check_rabbitmq(broker)
    if problem:
        require_service("RabbitMQ", problem)
    env = demo_env(tmp_path / "demo", free_port())
    try:
        demo = run_demo(["--cli"], env, timeout=180)
        assert demo.returncode == 0, (demo.stdout + demo.stderr)[-4000:]
        assert re.search(r'"lease_id": "[0-9a-f]+"', demo.stdout), demo.stdout
        assert "unknown_model" in demo.stdout + demo.stderr
        assert demo_processes(tmp_path / "demo")
        users = assert_only_the_demos_users(broker, demo_vhost(tmp_path / "demo"), agents=3)
    finally:
        stop = run_demo(["stop"], env, timeout=120)
    assert stop.returncode == 0
    assert demo_processes(tmp_path / "demo") == []
    assert not users & broker_users(broker)
