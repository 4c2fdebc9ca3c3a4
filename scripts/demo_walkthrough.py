"""The walk-through ``scripts/demo`` runs on its hub: what a user sees, driven as a user would.

1. alice starts a notebook with the one A100 through the hub's REST API;
2. her container's ``NVIDIA_VISIBLE_DEVICES`` and swarm-gpu labels, read from the engine;
3. bob asks for an A100 too: all taken, so he is queued, and the spawn's progress says where;
4. alice's container is killed: its GPU comes back at once and bob's notebook starts on it
   (the hand-over is timed, from the kill to bob's server answering through the proxy);
5. bob's notebook answers ``/api/status`` through the hub's proxy;
6. ``gpu-ledger status`` shows the cluster.

Each step prints what it saw; a step that fails prints why and the script exits 1. The last
line is one JSON object of the timings, for ``docs/benchmarks.md`` and the demo's test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import aiodocker
import aiohttp

MODEL = "a100"
STEP_TIMEOUT_S = 90.0


class WalkthroughError(Exception):
    """A step did not do what the walk-through expects."""


class Hub:
    """The hub's REST API, as the admin's automation and each user with their own token."""

    def __init__(self, url: str, admin_token: str, session: aiohttp.ClientSession) -> None:
        self.url = url
        self.admin_token = admin_token
        self.session = session
        self.tokens: dict[str, str] = {}

    async def api(self, method: str, path: str, body: Any = None, *,
                  user: str | None = None) -> tuple[int, Any]:
        token = self.tokens[user] if user else self.admin_token
        async with self.session.request(
            method, f"{self.url}/hub/api{path}", headers={"Authorization": f"token {token}"},
            data=json.dumps(body) if body is not None else None,
        ) as response:
            text = await response.text()
            try:
                return response.status, json.loads(text) if text else None
            except ValueError:
                return response.status, text

    async def token_for(self, user: str) -> None:
        status, body = await self.api("POST", f"/users/{user}/tokens",
                                      {"note": "scripts/demo walk-through", "expires_in": 3600})
        if status != 201:
            raise WalkthroughError(f"a token for {user}: HTTP {status} {body}")
        self.tokens[user] = body["token"]

    async def spawn(self, user: str, options: dict[str, Any]) -> None:
        status, body = await self.api("POST", f"/users/{user}/server",
                                      {"user_options": options}, user=user)
        if status not in (201, 202):
            raise WalkthroughError(f"{user}'s spawn was refused: HTTP {status} {body}")

    async def server(self, user: str) -> dict[str, Any] | None:
        status, body = await self.api("GET", f"/users/{user}", user=user)
        if status != 200:
            raise WalkthroughError(f"GET /users/{user}: HTTP {status} {body}")
        server: dict[str, Any] | None = (body.get("servers") or {}).get("")
        return server

    async def wait_ready(self, user: str, within: float = STEP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            server = await self.server(user)
            if server and server.get("ready"):
                return
            if not server or not server.get("pending"):
                raise WalkthroughError(f"{user}'s server is not starting: {server}")
            await asyncio.sleep(0.1)
        raise WalkthroughError(f"{user}'s server was not ready within {within:g} s")

    async def queue_message(self, user: str, within: float = STEP_TIMEOUT_S) -> str:
        """The first progress message of the spawn that says it is queued."""
        headers = {"Authorization": f"token {self.tokens[user]}"}
        async with asyncio.timeout(within):
            while True:
                async with self.session.get(
                    f"{self.url}/hub/api/users/{user}/server/progress", headers=headers,
                    timeout=aiohttp.ClientTimeout(total=None, sock_read=within),
                ) as response:
                    if response.status == 404:  # not pending yet
                        await asyncio.sleep(0.1)
                        continue
                    async for raw in response.content:
                        line = raw.decode().strip()
                        if not line.startswith("data:"):
                            continue
                        event = json.loads(line[5:])
                        message = str(event.get("message", ""))
                        if "queued" in message:
                            return message
                        if event.get("failed") or event.get("ready"):
                            raise WalkthroughError(f"{user}'s spawn was not queued: {message}")
                    raise WalkthroughError(f"{user}'s progress ended without a queue position")

    async def notebook_status(self, user: str) -> dict[str, Any]:
        """The notebook's own ``/api/status``, through the hub's proxy."""
        async with self.session.get(
            f"{self.url}/user/{user}/api/status",
            headers={"Authorization": f"token {self.tokens[user]}"},
        ) as response:
            text = await response.text()
            if response.status != 200:
                raise WalkthroughError(
                    f"{user}'s notebook /api/status through the proxy: HTTP {response.status} "
                    f"{text[:200]}")
            status: dict[str, Any] = json.loads(text)
            return status


async def lease_container(docker: aiodocker.Docker, service: str,
                          within: float = STEP_TIMEOUT_S) -> dict[str, Any]:
    """The running container of a notebook's Swarm service, inspected."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        containers = await docker.containers.list(filters={
            "label": [f"com.docker.swarm.service.name={service}"], "status": ["running"]})
        if containers:
            info: dict[str, Any] = await containers[0].show()
            return info
        await asyncio.sleep(0.2)
    raise WalkthroughError(f"no running container of the service {service}")


def step(text: str) -> None:
    print(f"\n== {text}", flush=True)


async def walk(args: argparse.Namespace) -> dict[str, float]:
    demo_dir = Path(args.demo_dir)
    admin_token = (demo_dir / "secrets" / "swarm-gpu-hub-api-token").read_text().strip()
    engine = (demo_dir / "engine").read_text().strip()
    timings: dict[str, float] = {}
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session, \
            aiodocker.Docker(url=engine) as docker:
        hub = Hub(args.hub, admin_token, session)
        for user in ("alice", "bob"):
            await hub.token_for(user)

        step(f"alice starts a notebook with one GPU ({MODEL}) through the hub's REST API")
        options = {"mode": "exclusive", "model": MODEL, "count": 1}
        print(f"POST /hub/api/users/alice/server  user_options={json.dumps(options)}")
        t0 = time.monotonic()
        await hub.spawn("alice", options)
        await hub.wait_ready("alice")
        timings["alice_spawn_s"] = time.monotonic() - t0
        print(f"alice's server is ready in {timings['alice_spawn_s']:.1f} s")

        step("her container, as the engine runs it")
        container = await lease_container(docker, f"{args.prefix}-alice")
        env = dict(item.split("=", 1) for item in container["Config"]["Env"])
        labels = {k: v for k, v in container["Config"]["Labels"].items()
                  if k.startswith("swarm-gpu")}
        print(f"container {container['Name'].lstrip('/')} ({container['Id'][:12]})")
        print(f"  NVIDIA_VISIBLE_DEVICES={env.get('NVIDIA_VISIBLE_DEVICES')}")
        for key, value in sorted(labels.items()):
            print(f"  label {key}={value}")
        if env.get("NVIDIA_VISIBLE_DEVICES", "void") in ("void", ""):
            raise WalkthroughError("alice's container was given no GPU")

        step(f"bob asks for an {MODEL} too: all taken, so he waits in the queue")
        await hub.spawn("bob", options)
        message = await hub.queue_message("bob")
        print(f"bob's spawn page says: {message}")

        step("alice's container dies (docker kill): bob's notebook starts on the freed GPU")
        killed_at = time.monotonic()
        await docker.containers.container(container["Id"]).kill()
        await hub.wait_ready("bob")
        bob_status = await hub.notebook_status("bob")
        timings["handover_s"] = time.monotonic() - killed_at
        bob_container = await lease_container(docker, f"{args.prefix}-bob")
        bob_env = dict(item.split("=", 1) for item in bob_container["Config"]["Env"])
        print(f"bob's notebook answers {timings['handover_s']:.1f} s after the kill, on "
              f"NVIDIA_VISIBLE_DEVICES={bob_env.get('NVIDIA_VISIBLE_DEVICES')}")
        if bob_env.get("NVIDIA_VISIBLE_DEVICES") != env.get("NVIDIA_VISIBLE_DEVICES"):
            raise WalkthroughError("bob's notebook did not get the GPU alice's container freed")

        step("bob's notebook itself, through the hub's proxy")
        print(f"GET /user/bob/api/status -> {json.dumps(bob_status)}")

        step("gpu-ledger status")
        ledger = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "allocator.admin.ledger_cli", "status",
            "--ledger", str(demo_dir / "ledger.sqlite"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        async with asyncio.timeout(STEP_TIMEOUT_S):
            output, _ = await ledger.communicate()
        print(output.decode().rstrip())
        if ledger.returncode != 0:
            raise WalkthroughError(f"gpu-ledger status exited with {ledger.returncode}")
    timings["walkthrough_s"] = time.monotonic() - started
    return timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hub", required=True, help="the hub's public URL")
    parser.add_argument("--demo-dir", required=True, help="the demo's state folder (.demo)")
    parser.add_argument("--prefix", required=True, help="the notebook services' name prefix")
    args = parser.parse_args(argv)
    try:
        timings = asyncio.run(walk(args))
    except (WalkthroughError, TimeoutError, aiohttp.ClientError, aiodocker.DockerError) as exc:
        print(f"\nwalk-through failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"\nwalk-through passed in {timings['walkthrough_s']:.1f} s")
    print(json.dumps({"walkthrough": {k: round(v, 2) for k, v in timings.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
