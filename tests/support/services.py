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
import signal
import socket
import subprocess
import tempfile
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

from tests.support.ports import free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
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
    """Whether process ``pid`` runs. A zombie does not: a killed broker node (detached, so
    a child of init) stays one until init reaps it, seconds later,
    and a test that starts it again must not take it for running."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        # The state is the field after the command name, which is in parentheses.
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True  # no /proc here: kill(0) is all there is
    return state != "Z"


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


# --------------------------------------------------------------- a private RabbitMQ node


def rabbitmq_bin_dir() -> Path | None:
    """The folder of RabbitMQ's own scripts (not Debian's ``su rabbitmq`` wrappers)."""
    candidates = [os.environ.get("SWARM_GPU_RABBITMQ_BIN"), "/usr/lib/rabbitmq/bin"]
    server = shutil.which("rabbitmq-server")
    if server:
        candidates.append(str(Path(server).resolve().parent))
    for candidate in candidates:
        if candidate and os.access(Path(candidate) / "rabbitmq-server", os.X_OK) \
                and os.access(Path(candidate) / "rabbitmqctl", os.X_OK):
            return Path(candidate)
    return None


class PrivateRabbitMQ:
    """A RabbitMQ node of its own, for tests that stop and start the broker.

    The shared broker on 5672 serves every other test running at the same time, so a test
    that restarts a broker gets this one: its own node name, AMQP and distribution ports on
    loopback, database, logs, config and Erlang cookie (``HOME``) under ``base``, and no
    plugins (no management API). Its only vhost is ``/`` with ``guest``/``guest``.
    Started with ``rabbitmq-server -detached`` and driven with ``rabbitmqctl -n NODE``.
    """

    def __init__(self, base: Path, bin_dir: Path, *, home: Path | None = None,
                 node: str | None = None, config: str = "", erl_args: str = "") -> None:
        self.base = base
        self.bin_dir = bin_dir
        self.home = home or base
        """HOME: where the Erlang cookie is (the nodes of one cluster share it)."""
        self.port = free_port()
        self.dist_port = free_port()
        self.node = node or f"swarm-gpu-faults-{os.getpid()}-{uuid.uuid4().hex[:6]}@localhost"
        self.pid_file = base / "rabbitmq.pid"
        for folder in ("mnesia", "log"):
            (base / folder).mkdir(parents=True, exist_ok=True)
        (base / "enabled_plugins").write_text("[].\n")
        (base / "rabbitmq.conf").write_text(
            "log.console = false\nlog.file.level = info\n" + config)
        self.erl_args = erl_args
        """Extra arguments of the node's Erlang VM (``-rabbit KEY VALUE``: application
        settings rabbitmq.conf has no key for)."""

    @property
    def url(self) -> str:
        """AMQP URL of its vhost ``/``."""
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def vhost_url(self, vhost: str) -> str:
        """AMQP URL of ``vhost`` on this node."""
        return f"amqp://guest:guest@127.0.0.1:{self.port}/{urllib.parse.quote(vhost, safe='')}"

    @property
    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            HOME=str(self.home),  # the Erlang cookie of this node and its rabbitmqctl
            RABBITMQ_NODENAME=self.node,
            RABBITMQ_NODE_IP_ADDRESS="127.0.0.1",
            RABBITMQ_NODE_PORT=str(self.port),
            RABBITMQ_DIST_PORT=str(self.dist_port),
            RABBITMQ_MNESIA_BASE=str(self.base / "mnesia"),
            RABBITMQ_LOG_BASE=str(self.base / "log"),
            RABBITMQ_CONFIG_FILE=str(self.base / "rabbitmq.conf"),
            RABBITMQ_ENABLED_PLUGINS_FILE=str(self.base / "enabled_plugins"),
            RABBITMQ_PID_FILE=str(self.pid_file),
        )
        if self.erl_args:
            env["RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS"] = self.erl_args
        return env

    def ctl(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """``rabbitmqctl -n NODE ARGS``."""
        return subprocess.run(
            [str(self.bin_dir / "rabbitmqctl"), "-n", self.node, *args], env=self.env,
            cwd=self.base, capture_output=True, text=True, timeout=timeout, check=False)

    def start(self, timeout: float = 90.0) -> float:
        """Start the node and wait until it accepts AMQP connections; the seconds it took."""
        started = time.monotonic()
        self.launch()
        self._await(started, timeout)
        return time.monotonic() - started

    def launch(self) -> None:
        """Start the node's VM in the background (``rabbitmq-server -detached``), not waiting
        for it to boot."""
        subprocess.run([str(self.bin_dir / "rabbitmq-server"), "-detached"], env=self.env,
                       cwd=self.base, stdin=subprocess.DEVNULL, capture_output=True,
                       timeout=60, check=True)

    def _await(self, started: float, timeout: float) -> None:
        while True:
            remaining = timeout - (time.monotonic() - started)
            if remaining <= 0:
                raise TimeoutError(f"RabbitMQ node {self.node} not up within {timeout}s:\n"
                                   + self.log_tail())
            wait = max(1, min(30, int(remaining)))
            try:
                result = self.ctl("await_startup", "--timeout", str(wait), timeout=wait + 30)
            except subprocess.TimeoutExpired:
                # rabbitmqctl is an Erlang VM of its own: on a loaded machine it can take
                # longer than the wait it was given; the node may still be booting.
                continue
            if result.returncode == 0 and port_open("127.0.0.1", self.port):
                return
            time.sleep(0.3)

    def stop(self, timeout: float = 60.0) -> float:
        """Stop the node (the Erlang VM exits, every connection drops); the seconds it took."""
        started = time.monotonic()
        result = self.ctl("stop", str(self.pid_file), timeout=timeout)
        if result.returncode != 0 and self.running():
            raise RuntimeError(f"rabbitmqctl stop failed: {result.stderr or result.stdout}")
        return time.monotonic() - started

    def stop_app(self) -> None:
        """Stop the RabbitMQ application only (the VM stays; the listener closes)."""
        result = self.ctl("stop_app")
        if result.returncode != 0:
            raise RuntimeError(f"rabbitmqctl stop_app failed: {result.stderr or result.stdout}")

    def start_app(self, timeout: float = 60.0) -> None:
        started = time.monotonic()
        result = self.ctl("start_app", timeout=timeout)
        if result.returncode != 0:
            raise RuntimeError(f"rabbitmqctl start_app failed: {result.stderr or result.stdout}")
        self._await(started, timeout)

    def pid(self) -> int | None:
        try:
            return int(self.pid_file.read_text().strip())
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        pid = self.pid()
        return pid is not None and _pid_alive(pid)

    def kill(self) -> None:
        """Last resort of a teardown: SIGKILL the node's VM."""
        pid = self.pid()
        if pid is not None and _pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def log_tail(self, lines: int = 40) -> str:
        text = ""
        for path in sorted((self.base / "log").glob("*.log")):
            text += path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def private_rabbitmq(base: Path, *, config: str = "",
                     erl_args: str = "") -> Iterator[PrivateRabbitMQ]:
    """A started :class:`PrivateRabbitMQ` under ``base`` (``config``: more rabbitmq.conf
    lines; ``erl_args``: more VM arguments), stopped (or killed) afterwards.

    Skips (fails in CI) when RabbitMQ's scripts are not installed or the node cannot start.
    """
    bin_dir = rabbitmq_bin_dir()
    if bin_dir is None:
        require_service("private RabbitMQ node", "rabbitmq-server/rabbitmqctl not found")
    broker = PrivateRabbitMQ(base, bin_dir, config=config, erl_args=erl_args)
    try:
        broker.start()
    except (OSError, subprocess.SubprocessError, TimeoutError) as exc:
        broker.kill()
        require_service("private RabbitMQ node", f"{exc}\n{broker.log_tail()}")
    try:
        yield broker
    finally:
        try:
            if broker.running():
                broker.stop()
        except (OSError, subprocess.SubprocessError, RuntimeError):
            pass
        broker.kill()


class PrivateRabbitMQCluster:
    """Three RabbitMQ nodes of this machine's rabbitmq-server clustered together, for tests
    that stop one broker node of three (docs/operations.md, a three-node broker).

    Each node is a :class:`PrivateRabbitMQ`: its own node name, AMQP and distribution ports
    on 127.0.0.1, database and logs under ``base/<n>``; all share one Erlang cookie (``HOME``
    is ``base``). The shared broker on 5672 (and its 15672, 25672) is never touched. Node 1
    starts first; nodes 2 and 3 then start at once and join it as they boot (peer discovery
    from their config files, as a deployment's nodes do), with no second boot for a
    ``rabbitmqctl join_cluster``.
    Queues declared once all three run get a member on each: quorum queues and streams then
    survive one node.
    """

    def __init__(self, base: Path, bin_dir: Path, size: int = 3) -> None:
        self.base = base
        base.mkdir(parents=True, exist_ok=True)
        cookie = base / ".erlang.cookie"
        cookie.write_text(uuid.uuid4().hex.upper())
        cookie.chmod(0o400)
        tag = f"{os.getpid()}-{uuid.uuid4().hex[:6]}"
        names = [f"swarm-gpu-cluster-{tag}-{n}@localhost" for n in range(1, size + 1)]
        # Node 1 starts the cluster; the others find it in their config and join it while
        # they boot (retrying for up to 5 min should it not answer at once).
        joining = (
            "cluster_formation.peer_discovery_backend = classic_config\n"
            f"cluster_formation.classic_config.nodes.1 = {names[0]}\n"
            "cluster_formation.discovery_retry_limit = 300\n"
            "cluster_formation.discovery_retry_interval = 1000\n"
        )
        self.nodes = [
            PrivateRabbitMQ(base / f"node{n}", bin_dir, home=base, node=name,
                            config="" if n == 1 else joining)
            for n, name in enumerate(names, start=1)
        ]

    @property
    def url(self) -> str:
        """One AMQP URL naming every node (``host:port,host:port,...``), vhost ``/``."""
        return "amqp://guest:guest@" + ",".join(f"127.0.0.1:{node.port}" for node in self.nodes) \
            + "/"

    def start(self, timeout: float = 240.0) -> float:
        """Start every node and wait until all three run as one cluster; the seconds it took."""
        started = time.monotonic()
        # Node 1 first, fully booted: nodes that joined it while it was still booting left it
        # with its feature flags off (it then refused to declare quorum queues and streams).
        first, *others = self.nodes
        first.start(timeout)
        for node in others:
            node.launch()
        for node in others:
            node._await(started, timeout)
        self._await_all(started, timeout)
        return time.monotonic() - started

    def ensure_running(self, timeout: float = 240.0) -> float:
        """Start again every node a test killed (it rejoins the cluster with its data) and
        wait until all of them run; the seconds it took."""
        started = time.monotonic()
        stopped = [node for node in self.nodes if not node.running()]
        for node in stopped:
            node.launch()
        for node in stopped:
            node._await(started, timeout)
        self._await_all(started, timeout)
        return time.monotonic() - started

    def add_vhost(self, vhost: str) -> None:
        """A vhost of its own, where ``guest`` may do everything: a test's queues apart from
        the other tests' (each is placed anew, its leader on the node that declares it)."""
        via = next(node for node in self.nodes if node.running())
        for args in (("add_vhost", vhost),
                     ("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")):
            result = via.ctl(*args)
            if result.returncode != 0:
                raise RuntimeError(f"rabbitmqctl {' '.join(args)}: "
                                   f"{result.stderr or result.stdout}")

    def _await_all(self, started: float, timeout: float) -> None:
        wanted = sorted(node.node for node in self.nodes)
        while sorted(running := self.running_nodes()) != wanted:
            if time.monotonic() - started > timeout:
                raise RuntimeError(f"the cluster runs {running}, not all {len(self.nodes)} "
                                   f"nodes, after {timeout:g} s")
            time.sleep(0.5)

    def running_nodes(self, via: PrivateRabbitMQ | None = None) -> list[str]:
        """The node names the cluster reports running (asked of ``via``, or any live node)."""
        for node in [via] if via is not None else [n for n in self.nodes if n.running()]:
            try:
                result = node.ctl("cluster_status", "--formatter", "json")
            except subprocess.TimeoutExpired:
                continue
            if result.returncode == 0:
                running: list[str] = json.loads(result.stdout).get("running_nodes", [])
                return running
        return []

    def stop(self, timeout: float = 60.0) -> None:
        """Stop every node at once (SIGTERM: the VM shuts down cleanly), SIGKILL for one that
        has not stopped within ``timeout``. No ``rabbitmqctl stop``: three more Erlang VMs to
        boot, one after the other, took minutes on a loaded machine."""
        pids = [pid for node in self.nodes if (pid := node.pid()) is not None]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(_pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        for node in self.nodes:
            node.kill()

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(f"--- {node.node}\n{node.log_tail(lines)}" for node in self.nodes)


@contextlib.contextmanager
def private_rabbitmq_cluster(base: Path) -> Iterator[PrivateRabbitMQCluster]:
    """A started :class:`PrivateRabbitMQCluster` under ``base``, stopped afterwards.

    Skips (fails in CI) when RabbitMQ's scripts are not installed or the cluster cannot form.
    """
    bin_dir = rabbitmq_bin_dir()
    if bin_dir is None:
        require_service("a three-node RabbitMQ cluster", "rabbitmq-server/rabbitmqctl not found")
    cluster = PrivateRabbitMQCluster(base, bin_dir)
    try:
        cluster.start()
    except (OSError, subprocess.SubprocessError, TimeoutError, RuntimeError) as exc:
        cluster.stop()
        require_service("a three-node RabbitMQ cluster", f"{exc}\n{cluster.log_tail()}")
    try:
        yield cluster
    finally:
        cluster.stop()


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


class PrivateDocker:
    """A Docker engine of its own (no Swarm), for tests that stop and start the engine.

    The shared engine runs other tests' services at the same time, so a test that restarts
    an engine gets this one: ``dockerd`` with its own data root, exec root, socket and pid
    file under ``base`` (keep it short: containerd's sockets live under the exec root),
    loopback only (no bridge, no iptables), and ``local/busybox:latest`` imported from the
    root that ``scripts/services`` built. ``start(live_restore=True)`` keeps containers
    running while the engine is down, as production engines often do.
    """

    def __init__(self, base: Path, *, live_restore: bool = False) -> None:
        self.base = base
        self.live_restore = live_restore
        self.sock = base / "docker.sock"
        self.pid_file = base / "dockerd.pid"
        self.log_path = base / "dockerd.log"
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.sock}"

    def start(self, *, live_restore: bool | None = None, timeout: float = 60.0) -> float:
        """Start dockerd and wait until it answers; the seconds it took.

        ``live_restore`` (default: the constructor's) keeps containers running while the
        engine is down; without it, dockerd kills what still runs when it starts.
        """
        started = time.monotonic()
        command = [
            "dockerd", "--data-root", str(self.base / "data"),
            "--exec-root", str(self.base / "exec"), "-H", self.url,
            "--pidfile", str(self.pid_file), "--bridge=none", "--iptables=false",
            "--ip6tables=false", "--ip-masq=false",
        ]
        if self.live_restore if live_restore is None else live_restore:
            command.append("--live-restore")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        while True:
            try:
                status, body = docker_api(self.url, "GET", "/_ping", timeout=2)
                if status == 200 and body.strip() == b"OK":
                    return time.monotonic() - started
            except (OSError, http.client.HTTPException):
                pass
            if self.process.poll() is not None or time.monotonic() - started > timeout:
                raise RuntimeError(f"private dockerd did not start:\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self, timeout: float = 40.0) -> float:
        """SIGTERM dockerd and wait for it to exit (SIGKILL after ``timeout``)."""
        started = time.monotonic()
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        return time.monotonic() - started

    def import_busybox(self) -> None:
        """Import ``local/busybox:latest`` from the root ``scripts/services`` built."""
        root = services_dir() / "busybox-root"
        if not (root / "bin" / "busybox").exists():
            require_service(BUSYBOX_IMAGE, f"{root} missing (run scripts/services start)")
        env = dict(os.environ, DOCKER_HOST=self.url)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        try:
            subprocess.run(["docker", "import", "--change", 'CMD ["sh"]', "-", BUSYBOX_IMAGE],
                           stdin=tar.stdout, env=env, capture_output=True, timeout=120,
                           check=True)
        finally:
            if tar.stdout is not None:
                tar.stdout.close()
            tar.wait(30)

    def remove_all_containers(self) -> None:
        env = dict(os.environ, DOCKER_HOST=self.url)
        listed = subprocess.run(["docker", "ps", "-aq"], env=env, capture_output=True,
                                text=True, timeout=30, check=False)
        ids = listed.stdout.split()
        if ids:
            subprocess.run(["docker", "rm", "-f", *ids], env=env, capture_output=True,
                           timeout=60, check=False)

    def cleanup(self) -> None:
        """Stop the engine, unmount what it mounted under ``base``, delete ``base``."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                self.remove_all_containers()
        self.stop()
        with open("/proc/mounts", encoding="utf-8") as handle:
            mounts = [line.split()[1] for line in handle]
        base = str(self.base)
        for target in sorted((m for m in mounts if m == base or m.startswith(base + "/")),
                             key=len, reverse=True):
            subprocess.run(["umount", "-l", target], capture_output=True, timeout=30,
                           check=False)
        shutil.rmtree(self.base, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def private_docker(*, live_restore: bool = False) -> Iterator[PrivateDocker]:
    """A started :class:`PrivateDocker` with the busybox image, removed afterwards.

    Skips (fails in CI) when ``dockerd`` is not installed or cannot start here.
    """
    if shutil.which("dockerd") is None or shutil.which("docker") is None:
        require_service("private Docker engine", "dockerd/docker not found")
    engine = PrivateDocker(Path(tempfile.mkdtemp(prefix="sgpu-dk-", dir="/tmp")),
                           live_restore=live_restore)
    try:
        try:
            engine.start()
            engine.import_busybox()
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            require_service("private Docker engine", str(exc))
        yield engine
    finally:
        engine.cleanup()


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

