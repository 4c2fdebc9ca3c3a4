"""TLS to the broker (``allocator/amqp/broker.py``; docs/operations.md, "TLS to the broker").

One private RabbitMQ node for the module with a TLS listener that asks every client for a
certificate signed by the test's CA (mutual TLS, ``fail_if_no_peer_cert``), certificates
made here with ``cryptography``. Over it: the allocator, a node agent's heartbeats and an
RPC client, each with the CA, its certificate and key as settings; a URL naming a dead node
first; and what a client with the wrong CA or without a certificate is told, in one line.
The plain-URL warning is the pure check plus one process that says it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from allocator.amqp import broker
from allocator.amqp.client import AllocatorClient, AllocatorUnavailable
from allocator.config import AllocatorSettings
from allocator.service import AllocatorService
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.simulated import make_gpu, write_inventory
from tests.support import services
from tests.support.common import GTX1070, started, wait_until
from tests.support.ports import free_port
from tests.support.tls_certs import Issued, issue, make_ca

REPO_ROOT = Path(__file__).resolve().parents[2]

# The module's broker is a private RabbitMQ node with a TLS listener: booting one takes seconds
# alone and up to a minute or more beside the Swarm stack's tests, so its first test needs the
# slow tests' bound (the fixture itself waits up to 90 s for the node).
pytestmark = pytest.mark.slow


# ------------------------------------------------------------------------ certificates


@dataclass(frozen=True)
class TLSBroker:
    """The module's broker: its TLS port, the test CA, a client certificate of that CA, and
    another CA that signed nothing the broker shows."""

    node: services.PrivateRabbitMQ
    port: int
    ca: Path
    client: Issued
    wrong_ca: Path

    def url(self, *, ca: Path | None = None, client: Issued | None = None) -> str:
        """``amqps://`` to the TLS port with the CA and client certificate as parameters."""
        return broker.with_tls(f"amqps://guest:guest@127.0.0.1:{self.port}/",
                               ca_file=ca or self.ca,
                               cert_file=client.cert if client else None,
                               key_file=client.key if client else None)

    def settings_url(self) -> str:
        """The URL with no file in it: the files come from the settings."""
        return f"amqps://guest:guest@127.0.0.1:{self.port}/"


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSBroker]:
    """A private RabbitMQ node with a TLS listener that requires a client certificate."""
    folder = tmp_path_factory.mktemp("tls")
    ca, ca_key, ca_cert = make_ca(folder, "test-ca")
    server = issue(folder, "broker", ca_key, ca_cert, server=True)
    client = issue(folder, "client", ca_key, ca_cert, server=False)
    wrong_ca, _, _ = make_ca(folder, "other-ca")
    port = free_port()
    config = (f"listeners.ssl.1 = 127.0.0.1:{port}\n"
              f"ssl_options.cacertfile = {ca.cert}\n"
              f"ssl_options.certfile = {server.cert}\n"
              f"ssl_options.keyfile = {server.key}\n"
              "ssl_options.verify = verify_peer\n"
              "ssl_options.fail_if_no_peer_cert = true\n")
    with services.private_rabbitmq(folder / "rabbitmq", config=config) as node:
        assert services.port_open("127.0.0.1", port), node.log_tail()
        yield TLSBroker(node, port, ca.cert, client, wrong_ca.cert)


# ----------------------------------------------------------------------- over TLS


async def test_allocator_agent_and_client_work_over_mutual_tls(
        tls_broker: TLSBroker, tmp_path: Path) -> None:
    """The allocator and a node agent with the TLS files as settings, a client with them in
    its URL: the agent's heartbeat reaches the allocator, and a request is granted."""
    tls: dict[str, Any] = {"amqp_ca_file": tls_broker.ca,
                           "amqp_cert_file": tls_broker.client.cert,
                           "amqp_key_file": tls_broker.client.key}
    allocator_settings = AllocatorSettings(
        amqp_url=tls_broker.settings_url(), ledger_path=tmp_path / "ledger.sqlite",
        allow_any_node_user=True, tick_s=0.1, start_fence_s=0, **tls)
    inventory = tmp_path / "inventory.json"
    write_inventory(inventory, {"tls-node": [make_gpu("tls-node", 0, GTX1070)]})
    agent_settings = AgentSettings(
        host="tls-node", amqp_url=tls_broker.settings_url(), inventory="simulated",
        simulated_file=inventory, interval_s=0.25, docker=False, amqp_reconnect_s=0.2, **tls)
    assert agent_settings.amqp_url.startswith("amqps://")
    async with started(AllocatorService(allocator_settings)), \
            started(NodeAgent(agent_settings)), \
            AllocatorClient(tls_broker.url(client=tls_broker.client), timeout_s=10) as client:
        async def node_up() -> bool:
            inventory = await client.inventory()
            return any(node.host == "tls-node" and node.up for node in inventory.nodes)
        await wait_until(node_up, within=20)
        from allocator.wire.protocol import AllocateRequest, LeaseState
        lease = await client.allocate(AllocateRequest(
            request_key="tls/alice/", user="alice", model=GTX1070))
        assert lease.state is LeaseState.GRANTED and lease.host == "tls-node"


async def test_a_url_naming_a_dead_node_first_reaches_the_tls_node(tls_broker: TLSBroker
                                                                  ) -> None:
    dead = free_port()
    url = broker.with_tls(
        f"amqps://guest:guest@127.0.0.1:{dead},127.0.0.1:{tls_broker.port}/",
        ca_file=tls_broker.ca, cert_file=tls_broker.client.cert,
        key_file=tls_broker.client.key)
    assert broker.broker_address(url) == f"127.0.0.1:{dead},127.0.0.1:{tls_broker.port}/"
    connection = await broker.connect_robust(url, timeout=10)
    try:
        assert connection.url.port == tls_broker.port  # type: ignore[attr-defined]
        channel = await connection.channel()
        await channel.close()
    finally:
        await connection.close()


# ----------------------------------------------------------------------- refusals


async def test_a_client_with_the_wrong_ca_is_refused_and_told_why(tls_broker: TLSBroker
                                                                  ) -> None:
    url = tls_broker.url(ca=tls_broker.wrong_ca, client=tls_broker.client)
    with pytest.raises(AllocatorUnavailable) as refused:
        async with AllocatorClient(url, timeout_s=5, connect_timeout_s=10):
            pass
    message = refused.value.message
    assert "TLS certificate is not trusted" in message and "amqp_ca_file" in message, message
    assert "\n" not in message and "guest:guest" not in message


async def test_a_client_without_a_certificate_is_refused_and_told_why(tls_broker: TLSBroker
                                                                      ) -> None:
    with pytest.raises(AllocatorUnavailable) as refused:
        async with AllocatorClient(tls_broker.url(), timeout_s=5, connect_timeout_s=10):
            pass
    message = refused.value.message
    # Over TLS 1.3 the broker refuses a missing certificate after the handshake: the client
    # sees either its alert or a reset, by timing; either way the one line names the fix.
    assert "client certificate" in message or "client's TLS certificate" in message, message
    assert "set amqp_cert_file and amqp_key_file" in message, message
    assert "\n" not in message


def test_the_command_line_says_a_wrong_ca_in_one_line(tls_broker: TLSBroker) -> None:
    """``gpu-allocator`` with the TLS options: exit 1 and one line on stderr, no traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_GPU_")}
    result = subprocess.run(
        [sys.executable, "-m", "allocator.admin.cli", "inventory", "--timeout", "10",
         "--amqp", tls_broker.settings_url(), "--amqp-ca-file", str(tls_broker.wrong_ca),
         "--amqp-cert-file", str(tls_broker.client.cert),
         "--amqp-key-file", str(tls_broker.client.key)],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("gpu-allocator:")]
    assert len(errors) == 1 and "TLS certificate is not trusted" in errors[0], result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------ the TLS settings


def test_tls_files_go_into_every_node_of_the_url(tmp_path: Path) -> None:
    url = broker.with_tls("amqps://hub:pw@node1,node2:5671/swarm-gpu?heartbeat=10",
                          ca_file="/run/secrets/ca.pem", cert_file=None, key_file="")
    assert broker.broker_urls(url) == [
        "amqps://hub:pw@node1/swarm-gpu?heartbeat=10&cafile=/run/secrets/ca.pem",
        "amqps://hub:pw@node2:5671/swarm-gpu?heartbeat=10&cafile=/run/secrets/ca.pem"]
    assert broker.broker_address(url) == "node1:5671,node2:5671/swarm-gpu"
    # The same file again (settings read twice) is the same URL; another is refused.
    assert broker.with_tls(url, ca_file="/run/secrets/ca.pem") == url
    with pytest.raises(ValueError, match=re.escape(
            "amqp_ca_file is /other.pem but the broker URL's cafile is /run/secrets/ca.pem")):
        broker.with_tls(url, ca_file="/other.pem")


def test_a_tls_file_for_a_plain_url_is_refused_in_one_line(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not checked here")
    with pytest.raises(ValueError, match="amqp_ca_file set, but the broker URL "
                                         r"amqp://hub:\*\*\*@rabbitmq/ is not amqps://"):
        AllocatorSettings(amqp_url="amqp://hub:pw@rabbitmq/", amqp_ca_file=ca)
    with pytest.raises(ValueError, match=r"amqp_key_file: \S*missing\.pem does not exist"):
        AgentSettings(amqp_url="amqps://a:pw@rabbitmq/", amqp_key_file=tmp_path / "missing.pem")


def test_the_command_line_clients_take_tls_files_from_the_environment() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    broker.add_tls_arguments(parser)
    args = parser.parse_args(["--amqp-cert-file", "/c.pem"])
    url = broker.url_with_tls_arguments("amqps://u:p@h/", args,
                                        {"SWARM_GPU_AMQP_CA_FILE": "/ca.pem"})
    assert url == "amqps://u:p@h/?cafile=/ca.pem&certfile=/c.pem"


def test_gpu_ledger_check_of_a_file_ignores_the_tls_environment(tmp_path: Path) -> None:
    """In the stack's allocator container SWARM_GPU_AMQP_CA_FILE is set for the allocator and
    for ``gpu-ledger check --live``; ``gpu-ledger check`` of the ledger file alone uses no
    broker, so the CA file is no error there. With --live it is, beside a plain URL: the
    broker URL must then be amqps://."""
    from allocator.ledger.store import Ledger

    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open()
    ledger.close()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SWARM_GPU_")},
           "SWARM_GPU_AMQP_CA_FILE": str(tmp_path / "ca.pem")}

    def gpu_ledger(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "allocator.admin.ledger_cli", *args], env=env,
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                              check=False)

    checked = gpu_ledger("check", "--ledger", str(ledger.path))
    assert checked.returncode == 0, checked.stderr
    live = gpu_ledger("check", "--live", "--ledger", str(ledger.path),
                      "--amqp", "amqp://guest:guest@127.0.0.1:5672/")
    assert live.returncode == 2 and "is not amqps://" in live.stderr, live.stderr


# ------------------------------------------------------------ the plain-URL warning


@pytest.mark.parametrize(("url", "remote"), [
    ("amqp://hub:pw@rabbitmq:5672/swarm-gpu", "rabbitmq"),
    ("amqp://hub:pw@127.0.0.1:5672,10.0.0.3:5672/v", "10.0.0.3"),
    ("amqp://hub:pw@[::1]:5672,broker.example.org/v", "broker.example.org"),
    ("amqp://hub:pw@127.0.0.2:5682/v", None),
    ("amqp://hub:pw@localhost/v", None),
    ("amqp://hub:pw@[::1]:5672/v", None),
    ("amqps://hub:pw@rabbitmq:5671/v", None),
])
def test_plain_amqp_off_this_machine_is_warned_about(url: str, remote: str | None) -> None:
    warning = broker.plaintext_warning(url)
    if remote is None:
        assert warning is None
    else:
        assert warning is not None and f"plain amqp:// to {remote}" in warning
        assert "pw" not in warning and "amqps://" in warning


def test_a_process_with_a_plain_remote_url_says_so_at_start() -> None:
    """``gpu-ledger`` (whose broker log is otherwise quiet) with a plain URL to another host
    says so before it tries. It runs in a network namespace of its own with no route
    anywhere, so the attempt fails at once and nothing leaves this machine."""
    unshare = shutil.which("unshare")
    if unshare is None or subprocess.run([unshare, "--net", "true"], capture_output=True,
                                         check=False).returncode != 0:
        services.require_service("network namespace", "unshare --net is not available")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_GPU_")}
    result = subprocess.run(
        [unshare, "--net", sys.executable, "-m", "allocator.admin.ledger_cli", "status",
         "--timeout", "5", "--amqp", "amqp://hub:pw@192.0.2.1:5672/swarm-gpu"],
        env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode != 0
    warnings = [line for line in result.stderr.splitlines() if "plain amqp://" in line]
    assert len(warnings) == 1 and "to 192.0.2.1" in warnings[0], result.stderr
    assert "hub:pw" not in result.stderr
