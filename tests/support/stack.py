"""The shipped stack deployed on the real Swarm: its cluster, brought up and torn down."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import shlex
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from tests.support.services import REQUIRE_ENV, require_service

REPO_ROOT = Path(__file__).resolve().parents[2]


CLUSTER_SCRIPT = REPO_ROOT / "scripts" / "cluster"


LEASE_LABEL = "swarm-gpu.lease"


GTX1070 = "NVIDIA GeForce GTX 1070"


RTX3090 = "NVIDIA GeForce RTX 3090"


NODES = ("manager-1", "gpu-1", "gpu-2")


ALLOCATOR_NODES = {"gpu-1", "gpu-2"}
"""The nodes labelled swarm-gpu.allocator by scripts/cluster: a replica on each."""


WRITER_LINE = re.compile(r"this allocator is the writer \(epoch (\d+)\)")


UP_TIMEOUT_S = 1500
"""A cold ``scripts/cluster up`` (base image, four images, deploy) on a loaded 2-core machine."""


WITHIN_S = 90.0
"""Bound on anything the cluster is waited for (a spawn, a free GPU, a converged service)."""


T = TypeVar("T")


def eventually(probe: Callable[[], T | None], what: str, within: float = WITHIN_S,
               interval: float = 0.5) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + within
    last: Any = None
    while True:
        try:
            last = probe()
        except (AssertionError, subprocess.CalledProcessError) as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {within}s (last: {last!r})")
        time.sleep(interval)


@dataclass
class Cluster:
    """The running cluster: ``docker`` on each node, the hub's API, ``gpu-ledger``."""

    dir: Path
    env: dict[str, str]
    _active: tuple[str, str] | None = None
    """The active allocator replica last found: (node, container)."""

    @property
    def hub_url(self) -> str:
        return self.env["SWARM_GPU_CLUSTER_HUB_URL"]

    @property
    def stack(self) -> str:
        return self.env["SWARM_GPU_CLUSTER_STACK"]

    def prometheus(self, path: str) -> Any:
        """The ``data`` of an answer of Prometheus's HTTP API (``/api/v1`` + ``path``)."""
        url = f"{self.env['SWARM_GPU_CLUSTER_PROMETHEUS_URL']}/api/v1{path}"
        with urllib.request.urlopen(url, timeout=30) as response:
            answer = json.loads(response.read())
        assert answer["status"] == "success", answer
        return answer["data"]

    def alerts(self, name: str) -> dict[str, str]:
        """host -> state (``pending``, ``firing``) of each active alert ``name``."""
        return {alert["labels"].get("host", ""): alert["state"]
                for alert in self.prometheus("/alerts")["alerts"]
                if alert["labels"]["alertname"] == name}

    def secret(self, name: str) -> str:
        return (self.dir / "secrets" / name).read_text().strip()

    @property
    def broker_ca(self) -> Path:
        """The CA that signed the broker's certificate (scripts/certs, secret
        swarm-gpu-broker-ca): what an admin's client checks the broker with."""
        return self.dir / "secrets" / "tls" / "ca.pem"

    def broker_api(self, path: str) -> Any:
        """RabbitMQ's HTTP API (HTTPS only) on the manager's broker node, as the admin."""
        address = self.env["SWARM_GPU_MANAGER_ADDR"]
        request = urllib.request.Request(f"https://{address}:15682/api{path}")
        login = base64.b64encode(f"admin:{self.secret('broker-passwords/admin')}".encode())
        request.add_header("Authorization", f"Basic {login.decode()}")
        tls = ssl.create_default_context(cafile=str(self.broker_ca))
        with urllib.request.urlopen(request, timeout=30, context=tls) as response:
            return json.loads(response.read())

    def script(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(CLUSTER_SCRIPT), *args], capture_output=True, text=True,
                              timeout=timeout, env=script_env(self.dir), stdin=subprocess.DEVNULL)

    def docker(self, node: str, *args: str, timeout: float = 120, check: bool = True,
               stdin_text: str | None = None) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, **self.env,
               "DOCKER_HOST": self.env[f"SWARM_GPU_CLUSTER_DOCKER_{node.replace('-', '_')}"]}
        result = subprocess.run(["docker", *args], capture_output=True, text=True, env=env,
                                timeout=timeout, input=stdin_text,
                                stdin=subprocess.DEVNULL if stdin_text is None else None)
        if check and result.returncode != 0:
            raise AssertionError(f"docker {shlex.join(args)} on {node}: {result.stderr}")
        return result

    def manager(self, *args: str, **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return self.docker("manager-1", *args, **kwargs)

    def allocators(self) -> dict[str, str]:
        """node -> the allocator container running there (a stopped node has none)."""
        found = {}
        for node in NODES:
            result = self.docker(node, "ps", "-q", "-f", f"name={self.stack}_allocator",
                                 check=False, timeout=30)
            ids = result.stdout.split() if result.returncode == 0 else []
            if ids:
                found[node] = ids[0]
        return found

    def writer_epoch(self, node: str, container: str) -> int | None:
        """The newest ledger-log epoch this replica logged it writes in (None: never)."""
        logs = self.docker(node, "logs", container, check=False, timeout=60)
        epochs = WRITER_LINE.findall(logs.stdout + logs.stderr)
        return int(epochs[-1]) if epochs else None

    def active_allocator(self) -> tuple[str, str]:
        """(node, container) of the active replica: the one that claimed the newest epoch of
        the ledger log (every replica logs its claims)."""
        claims = {(epoch, node, container) for node, container in self.allocators().items()
                  if (epoch := self.writer_epoch(node, container)) is not None}
        assert claims, "no allocator replica has claimed the ledger log"
        _, node, container = max(claims)
        return node, container

    def gpu_ledger(self, *args: str, on: tuple[str, str] | None = None,
                   check: bool = True) -> subprocess.CompletedProcess[str]:
        """``docker exec $ALLOC gpu-ledger ARGS`` in the active replica (or ``on``: a
        (node, container) of the replica whose own copy of the ledger to read)."""
        node, container = on or self._active or self.active_allocator()
        result = self.docker(node, "exec", container, "gpu-ledger", *args, check=False)
        if result.returncode != 0 and on is None and self._active is not None:
            # The replica was replaced (a rolling update, its node stopped): find it again.
            self._active = None
            return self.gpu_ledger(*args, check=check)
        if on is None:
            self._active = (node, container)
        if check and result.returncode != 0:
            raise AssertionError(f"gpu-ledger {shlex.join(args)} on {node}: {result.stderr}")
        return result

    def admin_gpu_ledger(self, *args: str, check: bool = True
                         ) -> subprocess.CompletedProcess[str]:
        """``gpu-ledger ARGS`` in the active replica as the admin's broker user (an admin
        command: ``admin_users``), the URL on stdin as docs/operations.md has it ("The
        gpu-ledger command"): never on a command line, where ``ps`` and the logs show it."""
        node, container = self.active_allocator()
        url = (f"amqps://admin:{self.secret('broker-passwords/admin')}@rabbitmq:"
               f"{self.env['SWARM_GPU_BROKER_PORT']}/swarm-gpu\n")
        result = self.docker(node, "exec", "-i", "-e", "SWARM_GPU_AMQP_URL_FILE=/dev/stdin",
                             container, "gpu-ledger", *args, check=False, stdin_text=url)
        if check and result.returncode != 0:
            raise AssertionError(f"gpu-ledger {shlex.join(args)} on {node}: "
                                 f"{result.stdout}{result.stderr}")
        return result

    def ledger_status(self, on: tuple[str, str] | None = None) -> dict[str, Any]:
        """``gpu-ledger status --json`` in an allocator container (docs/operations.md,
        step 9)."""
        status: dict[str, Any] = json.loads(self.gpu_ledger("status", "--json", on=on).stdout)
        return status

    def holders(self) -> dict[str, list[dict[str, Any]]]:
        """GPU uuid -> the leases holding it, from gpu-ledger status."""
        return {gpu["uuid"]: gpu["holders"] for gpu in self.ledger_status()["gpus"]}

    def lease(self, lease_id: str) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(the GPU, the holder) of a lease holding a GPU, or None."""
        for gpu in self.ledger_status()["gpus"]:
            for holder in gpu["holders"]:
                if holder["lease_id"] == lease_id:
                    return gpu, holder
        return None

    # ----------------------------------------------------------------- the hub

    def api(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        """The hub's REST API with the admin token (secret swarm-gpu-hub-api-token)."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            f"{self.hub_url}/hub/api{path}", data=data, method=method,
            headers={"Authorization": f"token {self.secret('hub-api-token')}",
                     "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                text = response.read().decode()
                return response.status, json.loads(text) if text else None
        except urllib.error.HTTPError as exc:
            text = exc.read().decode()
            try:
                return exc.code, json.loads(text)
            except ValueError:
                return exc.code, text

    def user(self, name: str, group: str) -> None:
        """A hub user in ``group`` (staff may take any GPU, students GTX 1070s)."""
        status, body = self.api("POST", f"/users/{name}")
        assert status in (201, 409), body
        status, body = self.api("POST", f"/groups/{group}/users", {"users": [name]})
        assert status == 200, body

    def spawn(self, name: str, options: dict[str, Any]) -> None:
        status, body = self.api("POST", f"/users/{name}/server", options)
        assert status in (201, 202), body

    def ready(self, name: str) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            status, body = self.api("GET", f"/users/{name}")
            assert status == 200, body
            server = body["servers"].get("")
            return server if server and server["ready"] else None
        return eventually(probe, f"{name}'s server ready")

    def stop(self, name: str) -> None:
        status, body = self.api("DELETE", f"/users/{name}/server")
        assert status in (202, 204), body

        def stopped() -> bool:
            status, body = self.api("GET", f"/users/{name}")
            return status == 200 and "" not in body["servers"]
        eventually(stopped, f"{name}'s server stopped")

    def service(self, name: str) -> dict[str, Any]:
        """The notebook service of a user (the spawner's default prefix: jupyter-<name>)."""
        spec: dict[str, Any] = json.loads(
            self.manager("service", "inspect", f"jupyter-{name}").stdout)[0]["Spec"]
        return spec

    def lease_of(self, name: str) -> tuple[str, str, dict[str, str]]:
        """(lease id, node, container env) of a user's running notebook service."""
        spec = self.service(name)
        env = dict(item.split("=", 1) for item in spec["TaskTemplate"]["ContainerSpec"]["Env"])
        lease_id = spec["TaskTemplate"]["ContainerSpec"]["Labels"][LEASE_LABEL]
        constraint = [c for c in spec["TaskTemplate"]["Placement"]["Constraints"]
                      if c.startswith("node.hostname == ")]
        assert len(constraint) == 1, spec["TaskTemplate"]["Placement"]
        return lease_id, constraint[0].removeprefix("node.hostname == "), env

    def granted(self, name: str, group: str, options: dict[str, Any]
                ) -> tuple[str, str, dict[str, str], dict[str, Any], dict[str, Any]]:
        """``name`` (in ``group``) spawns with ``options``: once the server is ready and its
        lease in the ledger, (lease id, node, container env, the GPU, the holder)."""
        self.user(name, group)
        self.spawn(name, options)
        self.ready(name)
        lease_id, node, env = self.lease_of(name)
        gpu, holder = eventually(lambda: self.lease(lease_id), f"{name}'s lease")
        return lease_id, node, env, gpu, holder

    def container_on(self, node: str, lease_id: str) -> str | None:
        ids = self.docker(node, "ps", "-q", "-f", f"label={LEASE_LABEL}={lease_id}").stdout.split()
        return ids[0] if ids else None

    def free(self) -> dict[str, int]:
        """Free GPUs per node, from gpu-ledger status."""
        counts: dict[str, int] = {}
        for gpu in self.ledger_status()["gpus"]:
            counts.setdefault(gpu["host"], 0)
            counts[gpu["host"]] += gpu["state"] == "free"
        return counts


def script_env(cluster_dir: Path) -> dict[str, str]:
    return {**os.environ, "SWARM_GPU_CLUSTER_DIR": str(cluster_dir)}


def read_env(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        (assignment,) = shlex.split(line.removeprefix("export "))
        key, value = assignment.split("=", 1)
        env[key] = value
    return env


@contextlib.contextmanager
def cluster_up(*options: str, env: dict[str, str] | None = None) -> Iterator[Cluster]:
    """``scripts/cluster up OPTIONS``; ``scripts/cluster down`` afterwards (unless
    SWARM_GPU_CLUSTER_KEEP=1)."""
    missing = [tool for tool in ("docker", "dockerd", "mmdebstrap", "unshare")
               if shutil.which(tool) is None]
    if missing and os.environ.get(REQUIRE_ENV) != "1":
        # In CI scripts/cluster installs what is missing; on a laptop this is a skip.
        require_service("a three-node Swarm (scripts/cluster)", f"missing {', '.join(missing)}")
    directory = Path(os.environ.get("SWARM_GPU_CLUSTER_DIR", REPO_ROOT / ".cluster"))
    started = time.monotonic()
    up = subprocess.run([str(CLUSTER_SCRIPT), "up", *options], capture_output=True, text=True,
                        timeout=UP_TIMEOUT_S, env={**script_env(directory), **(env or {})},
                        stdin=subprocess.DEVNULL)
    print(f"scripts/cluster up {' '.join(options)}: {time.monotonic() - started:.0f} s\n"
          f"{up.stderr}")
    try:
        assert up.returncode == 0, f"scripts/cluster up failed:\n{up.stderr[-4000:]}"
        yield Cluster(directory, read_env(directory / "env"))
    finally:
        # SWARM_GPU_CLUSTER_KEEP=1 leaves it running on purpose, for the next run.
        if os.environ.get("SWARM_GPU_CLUSTER_KEEP") != "1":
            down = subprocess.run([str(CLUSTER_SCRIPT), "down"], capture_output=True,
                                  text=True, timeout=600, env=script_env(directory),
                                  stdin=subprocess.DEVNULL)
            assert down.returncode == 0, down.stderr
