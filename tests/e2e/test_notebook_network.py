"""Notebooks cannot reach the control plane: compose/stack.yml's networks, deployed for real.

The suite's shared engine has no bridge and no overlay networks (loopback only), so this test
starts an engine of its own inside a network namespace it makes (``ip netns add``), where
dockerd may have its bridge, its iptables rules and Swarm's overlay networks without touching
the machine's network. Every address lives inside that namespace (198.18.0.0/15, the
benchmarking range, never a private one), and the namespace goes with the test.

The stack deployed there is compose/stack.yml's network layout, read from the file: each
service with the networks and published ports the file gives it, running a busybox listener
on the ports the real service serves (the broker's AMQP, management API, epmd and Erlang
distribution; the allocator's and the agents' metrics; the hub's proxy and API). The notebook
is a service on the network the hub's spawner is given (``SWARM_GPU_NETWORK``), as
dockerspawner's SwarmSpawner creates it. From inside the notebook, every address of every
control-plane container (on every network it has, its gateway bridge included) and the
node's own address are tried on every control-plane port: none may answer. The hub answers
the notebook, the hub reaches the notebook, and the hub reaches the broker: so the listeners
listen, and what the notebook cannot reach is kept from it by the networks.

Costs 12 to 18 s (engine, swarm, stack, probes and teardown).

Whatever the network lets through, the control plane also asks for credentials: the broker
and its management API refuse a login without the password (the second test, on the shared
broker); the metrics' token is tested in tests/metrics/test_metrics.py and
tests/agent/test_agent_metrics.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import http.client
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika.exceptions
import pytest
import yaml

from allocator.amqp.broker import open_connection
from tests.support.services import BUSYBOX_IMAGE, PrivateDocker, docker_api, require_service

REPO = Path(__file__).resolve().parents[2]
STACK = REPO / "compose" / "stack.yml"
STACK_NAME = "swarm-gpu"

CONTROL_PORTS: dict[str, tuple[int, ...]] = {
    "rabbitmq": (5671, 15671, 4369, 25672),  # AMQP over TLS, management over HTTPS, epmd, Erlang
    "allocator": (9464,),
    "nodeagent": (9465,),
}
"""What each control-plane service listens on: AMQP, the management API, epmd, the Erlang
distribution; the allocator's metrics; the agent's metrics (bound to 0.0.0.0 here, as a site
that lets Prometheus in sets it)."""
HUB_PORTS = (8000, 8081)
"""The hub's proxy (what users and the hub's own checks reach) and its API (notebooks call it)."""
NOTEBOOK_PORT = 8888
NODE_ADDRESS = "198.18.255.1"
"""The node's own address: a published port would answer there."""


class NamespacedDocker(PrivateDocker):
    """A Docker engine in a network namespace of its own, with a bridge, iptables and Swarm's
    overlay networks, all inside that namespace."""

    def __init__(self, base: Path, netns: str) -> None:
        super().__init__(base)
        self.netns = netns

    def start(self, *, live_restore: bool | None = None, timeout: float = 60.0) -> float:
        started = time.monotonic()
        # nsenter, not `ip netns exec`: the latter remounts /sys, hiding the cgroups dockerd
        # needs ("Devices cgroup isn't mounted").
        command = [
            "nsenter", f"--net=/run/netns/{self.netns}", "dockerd",
            "--data-root", str(self.base / "data"), "--exec-root", str(self.base / "exec"),
            "-H", self.url, "--pidfile", str(self.pid_file), "--ip6tables=false",
            "--shutdown-timeout", "2",
            # Bridges and the gateway bridge from the benchmarking range, not 172.16/12.
            "--default-address-pool", "base=198.18.0.0/17,size=24",
        ]
        env = dict(os.environ, DOCKER_SERVICE_PREFER_OFFLINE_IMAGE="1")
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            env=env)
        while True:
            try:
                status, body = docker_api(self.url, "GET", "/_ping", timeout=2)
                if status == 200 and body.strip() == b"OK":
                    return time.monotonic() - started
            except (OSError, http.client.HTTPException):
                pass
            if self.process.poll() is not None or time.monotonic() - started > timeout:
                raise RuntimeError(f"dockerd in {self.netns} did not start:\n{self.log_tail()}")
            time.sleep(0.1)

    def docker(self, *args: str, stdin: str | None = None,
               timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["docker", *args], input=stdin, capture_output=True, text=True,
                              timeout=timeout, env=dict(os.environ, DOCKER_HOST=self.url),
                              check=False)


def ip_netns(*args: str) -> None:
    subprocess.run(["ip", "netns", *args], capture_output=True, text=True, timeout=30,
                   check=True)


@contextlib.contextmanager
def namespaced_swarm() -> Iterator[NamespacedDocker]:
    """A one-node Swarm in a network namespace of its own; everything removed afterwards."""
    missing = [tool for tool in ("ip", "nsenter", "dockerd", "docker", "iptables")
               if shutil.which(tool) is None]
    if missing:
        require_service("a Docker engine in a network namespace", f"missing {missing}")
    if os.geteuid() != 0:
        require_service("a Docker engine in a network namespace", "needs root (ip netns)")
    netns = f"sgpu-nb-{uuid.uuid4().hex[:8]}"
    engine = NamespacedDocker(Path(tempfile.mkdtemp(prefix="sgpu-nb-", dir="/tmp")), netns)
    ip_netns("add", netns)
    try:
        for command in (["ip", "link", "set", "lo", "up"],
                        ["ip", "addr", "add", f"{NODE_ADDRESS}/32", "dev", "lo"]):
            subprocess.run(["ip", "netns", "exec", netns, *command], capture_output=True,
                           timeout=30, check=True)
        try:
            engine.start()
            engine.import_busybox()
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            require_service("a Docker engine in a network namespace", str(exc))
        init = engine.docker("swarm", "init", "--advertise-addr", "127.0.0.1",
                             "--listen-addr", "127.0.0.1:2377",
                             "--default-addr-pool", "198.19.0.0/16",
                             "--default-addr-pool-mask-length", "24")
        assert init.returncode == 0, init.stderr
        yield engine
    finally:
        engine.cleanup()
        with contextlib.suppress(subprocess.SubprocessError):
            ip_netns("delete", netns)


def listener(ports: tuple[int, ...]) -> list[str]:
    """A busybox command answering TCP on ``ports`` (httpd, one per port)."""
    serve = "; ".join(f"httpd -p 0.0.0.0:{port} -h /tmp" for port in ports)
    return ["sh", "-c", f"{serve}; exec sleep 2147483647"]


def network_layout(stack: dict[str, Any]) -> dict[str, Any]:
    """compose/stack.yml reduced to what decides who reaches whom: its networks (with their
    options), and each service's networks, published ports and host name, running a
    listener on the service's real ports."""
    services = {}
    for name, service in stack["services"].items():
        ports = CONTROL_PORTS.get(name, HUB_PORTS if name == "jupyterhub" else ())
        assert ports, f"{name}: a service of the stack this test does not know"
        reduced: dict[str, Any] = {"image": BUSYBOX_IMAGE, "command": listener(ports),
                                   "stop_grace_period": "1s"}
        for key in ("networks", "hostname"):
            if key in service:
                reduced[key] = service[key]
        # Ports published through the routing mesh need IPVS, which this kernel lacks; a
        # port in host mode is what would answer on the node's address.
        host_ports = [p for p in service.get("ports", []) if isinstance(p, dict)
                      and p.get("mode") == "host"]
        if host_ports:
            reduced["ports"] = host_ports
        services[name] = reduced
    return {"version": stack["version"], "networks": stack["networks"], "services": services}


def containers_of(engine: NamespacedDocker) -> dict[str, dict[str, Any]]:
    """Service name (without the stack's prefix) -> its task container's inspect data."""
    listed = engine.docker("ps", "-q")
    inspected = json.loads(engine.docker("inspect", *listed.stdout.split()).stdout or "[]")
    found = {}
    for container in inspected:
        service = container["Config"]["Labels"].get("com.docker.swarm.service.name", "")
        found[service.removeprefix(f"{STACK_NAME}_")] = container
    return found


def addresses(container: dict[str, Any]) -> dict[str, str]:
    """Network name -> the container's IPv4 address on it (the stack's networks)."""
    return {name: network["IPAddress"]
            for name, network in container["NetworkSettings"]["Networks"].items()
            if network.get("IPAddress")}


def every_address(engine: NamespacedDocker, container: dict[str, Any]) -> set[str]:
    """Every IPv4 address the container has, the gateway bridge's included (Swarm does not
    list that one among its networks)."""
    done = engine.docker("exec", container["Id"], "ip", "-4", "-o", "addr", "show")
    assert done.returncode == 0, done.stderr
    found = {line.split()[3].split("/")[0] for line in done.stdout.splitlines()
             if line.split()[1] != "lo"}
    assert set(addresses(container).values()) <= found
    return found


def reachable(engine: NamespacedDocker, container: dict[str, Any],
              targets: list[tuple[str, int]]) -> set[tuple[str, int]]:
    """Which of ``targets`` accept a TCP connection from inside ``container`` (all tried at
    once, 2 s each)."""
    script = " ".join(
        f"(nc -w 2 {host} {port} </dev/null >/dev/null 2>&1 && echo {host}:{port}) &"
        for host, port in targets) + " wait"
    done = engine.docker("exec", container["Id"], "sh", "-c", script, timeout=60)
    assert done.returncode == 0, done.stderr
    return {(line.rsplit(":", 1)[0], int(line.rsplit(":", 1)[1]))
            for line in done.stdout.split()}


def wait_for_tasks(engine: NamespacedDocker, names: set[str],
                   within: float = 60) -> dict[str, dict[str, Any]]:
    deadline = time.monotonic() + within
    while True:
        found = containers_of(engine)
        if names <= set(found) and all(c["State"]["Running"] for c in found.values()):
            return found
        if time.monotonic() > deadline:
            tasks = engine.docker("service", "ls").stdout
            raise AssertionError(f"tasks not running within {within} s: {sorted(found)}\n"
                                 f"{tasks}\n{engine.log_tail()}")
        time.sleep(0.2)


@pytest.mark.docker
def test_a_notebook_reaches_the_hub_and_nothing_of_the_control_plane(tmp_path: Path) -> None:
    stack = yaml.safe_load(STACK.read_text())
    hub_network = stack["services"]["jupyterhub"]["environment"]["SWARM_GPU_NETWORK"]
    layout = tmp_path / "stack.yml"
    layout.write_text(yaml.safe_dump(network_layout(stack)))
    with namespaced_swarm() as engine:
        deployed = engine.docker("stack", "deploy", "-c", str(layout), STACK_NAME)
        assert deployed.returncode == 0, deployed.stderr
        # The notebook as dockerspawner's SwarmSpawner creates it: a service on network_name.
        created = engine.docker("service", "create", "--detach", "--name", "jupyter-alice",
                                "--network", hub_network, "--stop-grace-period", "1s",
                                BUSYBOX_IMAGE, *listener((NOTEBOOK_PORT,)))
        assert created.returncode == 0, created.stderr
        containers = wait_for_tasks(engine, {*stack["services"], "jupyter-alice"}, within=90)
        notebook, hub = containers["jupyter-alice"], containers["jupyterhub"]
        hub_on_notebooks = addresses(hub)[hub_network]
        notebook_address = addresses(notebook)[hub_network]

        control = [(address, port)
                   for name, ports in CONTROL_PORTS.items()
                   for address in every_address(engine, containers[name])
                   for port in ports]
        control += [(NODE_ADDRESS, port) for ports in CONTROL_PORTS.values() for port in ports]
        hub_ports = [(hub_on_notebooks, port) for port in HUB_PORTS]
        from_notebook = reachable(engine, notebook, control + hub_ports)
        assert from_notebook == set(hub_ports), \
            f"the notebook reaches {sorted(from_notebook - set(hub_ports))}"

        broker = addresses(containers["rabbitmq"])[f"{STACK_NAME}_default"]
        from_hub = reachable(engine, hub, [(notebook_address, NOTEBOOK_PORT), (broker, 5671)])
        assert from_hub == {(notebook_address, NOTEBOOK_PORT), (broker, 5671)}


def management_status(api_url: str, user: str | None, password: str) -> int:
    """The management API's answer to ``GET /api/overview`` with these credentials."""
    request = urllib.request.Request(f"{api_url}/api/overview")
    if user is not None:
        basic = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {basic}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        with error:
            return error.code


async def test_the_broker_and_its_management_api_refuse_a_caller_without_the_password(
        amqp_vhost: Any) -> None:
    """Whatever the network lets through, a notebook holds no broker password: a login with
    none, or a wrong one, is refused on the AMQP port and on the management API."""
    broker = amqp_vhost.broker
    user, password = f"t{uuid.uuid4().hex[:8]}-hub", uuid.uuid4().hex
    broker.api("PUT", f"/api/users/{user}", {"password": password, "tags": ""})
    try:
        broker.api("PUT", f"/api/permissions/{urllib.parse.quote(amqp_vhost.name, safe='')}/"
                   f"{user}", {"configure": "", "write": ".*", "read": ""})

        def url(secret: str) -> str:
            return (f"amqp://{user}:{secret}@{broker.host}:{broker.port}/"
                    f"{urllib.parse.quote(amqp_vhost.name, safe='')}")

        connection = await open_connection(url(password), timeout=10)  # the password works
        await connection.close()
        for wrong in ("", password[:-1], "guest"):
            with pytest.raises(aio_pika.exceptions.ProbableAuthenticationError):
                refused = await open_connection(url(wrong), timeout=10)
                await refused.close()
        for who, secret in ((None, ""), (user, ""), (user, password[:-1]),
                            ("guest", password)):
            assert await asyncio.to_thread(management_status, broker.api_url, who,
                                           secret) == 401, who
        assert await asyncio.to_thread(management_status, broker.api_url, broker.user,
                                       broker.password) == 200
    finally:
        broker.api("DELETE", f"/api/users/{user}")
