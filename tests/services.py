"""Access to the real services the tests run against (no mocks).

`scripts/services start` brings them up and writes `$SWARM_GPU_SERVICES_DIR/env`;
`scripts/test` sources that file before running pytest. This module only finds and
checks the services, using the standard library (so it works before the project's
dependencies are installed), and leaves the fixtures to `conftest.py`.

Environment variables:

- ``SWARM_GPU_REQUIRE_SERVICES=1``: a missing service fails the test instead of skipping it
  (set by ``.ci/run``).
- ``SWARM_GPU_SERVICES_DIR``: state folder of ``scripts/services`` (default: ``.services/``
  in the repo root).
- ``SWARM_GPU_AMQP_URL``: broker base URL, default ``amqp://guest:guest@127.0.0.1:5672/``.
- ``SWARM_GPU_RABBITMQ_API``: management HTTP API, default ``http://127.0.0.1:15672``.
- ``DOCKER_HOST``: the engine (``unix://`` only); default the socket in the services folder.
- ``SWARM_GPU_CHP``: configurable-http-proxy executable.
- ``SWARM_GPU_CHROMIUM``: Chromium executable.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import shutil
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
REQUIRE_ENV = "SWARM_GPU_REQUIRE_SERVICES"
DEFAULT_AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
DEFAULT_RABBITMQ_API = "http://127.0.0.1:15672"
BUSYBOX_IMAGE = "local/busybox:latest"
#: Prefix of the vhosts the tests create; the pid after it lets a later run delete
#: the leftovers of a run that was killed before its teardown.
VHOST_PREFIX = "swarm-gpu-test-"
HTTP_TIMEOUT = 10.0


def services_required() -> bool:
    """True when missing services must fail the tests (CI), not skip them."""
    return os.environ.get(REQUIRE_ENV, "") == "1"


def require_service(name: str, reason: str) -> NoReturn:
    """Give up on a test because service `name` is unavailable.

    Skips on a developer machine; fails when ``SWARM_GPU_REQUIRE_SERVICES=1`` (CI), so
    that a broken service can never turn the whole suite into green skips.
    """
    message = f"{name} unavailable: {reason} (start it with `scripts/services start`)"
    if services_required():
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def services_dir() -> Path:
    """The state folder of ``scripts/services``."""
    configured = os.environ.get("SWARM_GPU_SERVICES_DIR")
    return Path(configured) if configured else REPO_ROOT / ".services"


def port_open(host: str, port: int, timeout: float = 2.0) -> bool:
    """Whether something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------- RabbitMQ


@dataclass(frozen=True)
class RabbitMQ:
    """A running broker with its management API; `user`/`password` may administer it."""

    host: str
    port: int
    api_url: str
    user: str
    password: str

    @property
    def url(self) -> str:
        """AMQP URL of the default vhost ``/`` (tests should use `amqp_vhost` instead)."""
        return self.vhost_url("/")

    def vhost_url(self, vhost: str) -> str:
        """AMQP URL of `vhost`, percent-encoded."""
        user = urllib.parse.quote(self.user, safe="")
        password = urllib.parse.quote(self.password, safe="")
        name = urllib.parse.quote(vhost, safe="")
        return f"amqp://{user}:{password}@{self.host}:{self.port}/{name}"

    def api(self, method: str, path: str, body: Any = None, timeout: float = HTTP_TIMEOUT) -> Any:
        """Call the management HTTP API; returns the decoded JSON (None when empty).

        Raises urllib.error.HTTPError on an HTTP error status.
        """
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.api_url + path, data=data, method=method)
        token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
        request.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload = response.read()
        return json.loads(payload) if payload else None


def rabbitmq_from_env() -> RabbitMQ:
    """The broker named by SWARM_GPU_AMQP_URL / SWARM_GPU_RABBITMQ_API (or the defaults)."""
    amqp = urllib.parse.urlsplit(os.environ.get("SWARM_GPU_AMQP_URL") or DEFAULT_AMQP_URL)
    api_url = (os.environ.get("SWARM_GPU_RABBITMQ_API") or DEFAULT_RABBITMQ_API).rstrip("/")
    return RabbitMQ(
        host=amqp.hostname or "127.0.0.1",
        port=amqp.port or 5672,
        api_url=api_url,
        user=urllib.parse.unquote(amqp.username or "guest"),
        password=urllib.parse.unquote(amqp.password or "guest"),
    )


def check_rabbitmq(broker: RabbitMQ) -> str | None:
    """None when the broker and its API answer, else why not."""
    if not port_open(broker.host, broker.port):
        return f"nothing answers on {broker.host}:{broker.port}"
    try:
        overview = broker.api("GET", "/api/overview")
    except (OSError, ValueError) as exc:
        return f"management API {broker.api_url} does not answer: {exc}"
    if not isinstance(overview, dict) or "rabbitmq_version" not in overview:
        return f"management API {broker.api_url} answered unexpectedly: {overview!r}"
    return None


@dataclass(frozen=True)
class AmqpVhost:
    """A vhost of its own for a test: `name` and the AMQP `url` to connect to it."""

    name: str
    url: str
    broker: RabbitMQ


def _quote(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def create_vhost(broker: RabbitMQ, name: str | None = None, timeout: float = 30.0) -> AmqpVhost:
    """Create a vhost, grant the broker's user full rights on it, wait until it runs."""
    name = name or f"{VHOST_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:10]}"
    broker.api("PUT", f"/api/vhosts/{_quote(name)}", {"description": "swarm-gpu test"})
    broker.api(
        "PUT",
        f"/api/permissions/{_quote(name)}/{_quote(broker.user)}",
        {"configure": ".*", "write": ".*", "read": ".*"},
    )
    deadline = time.monotonic() + timeout
    while True:
        info = broker.api("GET", f"/api/vhosts/{_quote(name)}")
        states = (info or {}).get("cluster_state") or {}
        if states and all(state == "running" for state in states.values()):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"vhost {name} not running after {timeout}s: {states}")
        time.sleep(0.05)
    return AmqpVhost(name=name, url=broker.vhost_url(name), broker=broker)


def delete_vhost(broker: RabbitMQ, name: str) -> None:
    """Delete a vhost with everything in it; a missing vhost is fine."""
    try:
        broker.api("DELETE", f"/api/vhosts/{_quote(name)}", timeout=60.0)
    except urllib.error.HTTPError as exc:
        if exc.code != 404:
            raise


def vhost_exists(broker: RabbitMQ, name: str) -> bool:
    try:
        broker.api("GET", f"/api/vhosts/{_quote(name)}")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return False
        raise
    return True


@contextlib.contextmanager
def temporary_vhost(broker: RabbitMQ) -> Iterator[AmqpVhost]:
    """A fresh vhost for the duration of the block, deleted afterwards."""
    vhost = create_vhost(broker)
    try:
        yield vhost
    finally:
        delete_vhost(broker, vhost.name)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def delete_stale_vhosts(broker: RabbitMQ) -> list[str]:
    """Delete test vhosts left behind by runs whose process is gone."""
    deleted = []
    for vhost in broker.api("GET", "/api/vhosts?columns=name") or []:
        name = vhost.get("name", "")
        if not name.startswith(VHOST_PREFIX):
            continue
        pid_text = name[len(VHOST_PREFIX) :].split("-", 1)[0]
        if pid_text.isdigit() and not _pid_alive(int(pid_text)):
            delete_vhost(broker, name)
            deleted.append(name)
    return deleted


# ----------------------------------------------------------------------------- Docker


class _UnixHTTPConnection(http.client.HTTPConnection):
    """http.client over a unix socket (the Docker engine API)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self._path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def docker_host() -> str:
    """DOCKER_HOST, or the socket of `scripts/services` when DOCKER_HOST is unset."""
    return os.environ.get("DOCKER_HOST") or f"unix://{services_dir() / 'docker.sock'}"


def docker_api(
    host: str, method: str, path: str, timeout: float = HTTP_TIMEOUT
) -> tuple[int, bytes]:
    """One request to the engine API at a ``unix://`` DOCKER_HOST: (status, body)."""
    if not host.startswith("unix://"):
        raise ValueError(f"only unix:// engines are supported by the tests, not {host}")
    connection = _UnixHTTPConnection(host[len("unix://") :], timeout=timeout)
    try:
        connection.request(method, path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def check_docker(host: str) -> str | None:
    """None when `host` is a Docker engine that is an active Swarm manager, else why not."""
    try:
        status, body = docker_api(host, "GET", "/_ping")
        if status != 200 or body.strip() != b"OK":
            return f"{host}: /_ping answered {status} {body[:200]!r}"
        status, body = docker_api(host, "GET", "/info")
    except (OSError, ValueError, http.client.HTTPException) as exc:
        return f"{host}: {exc}"
    swarm = json.loads(body).get("Swarm") or {}
    if swarm.get("LocalNodeState") != "active" or not swarm.get("ControlAvailable"):
        return f"{host}: not an active swarm manager ({swarm.get('LocalNodeState')!r})"
    return None


def docker_image_exists(host: str, image: str) -> bool:
    status, _ = docker_api(host, "GET", f"/images/{urllib.parse.quote(image, safe='')}/json")
    return status == 200


# ------------------------------------------------------------------------ executables


def chp_path() -> Path | None:
    """configurable-http-proxy: SWARM_GPU_CHP, the services folder, or PATH."""
    candidates = [
        os.environ.get("SWARM_GPU_CHP"),
        str(services_dir() / "node" / "node_modules" / ".bin" / "configurable-http-proxy"),
        shutil.which("configurable-http-proxy"),
    ]
    return _first_executable(candidates)


def chromium_path() -> Path | None:
    """Chromium: SWARM_GPU_CHROMIUM or PATH."""
    candidates = [
        os.environ.get("SWARM_GPU_CHROMIUM"),
        shutil.which("chromium"),
        shutil.which("chromium-browser"),
    ]
    return _first_executable(candidates)


def _first_executable(candidates: list[str | None]) -> Path | None:
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return Path(candidate)
    return None
