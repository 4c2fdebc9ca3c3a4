"""TLS to the broker (``allocator/amqp/broker.py``; docs/operations.md, "TLS to the broker").

One private RabbitMQ node for the module with a TLS listener that asks every client for a
certificate signed by the test's CA (mutual TLS, ``fail_if_no_peer_cert``), certificates
made here with ``cryptography``. Over it: the allocator, a node agent's heartbeats and an
RPC client, each with the CA, its certificate and key as settings; a URL naming a dead node
first; and what a client with the wrong CA or without a certificate is told, in one line.
The plain-URL warning is the pure check plus one process that says it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import warnings
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
    wrong_host_port: int
    """The port of the listener on 127.0.0.2, a name the broker's certificate does not hold."""
    server: Issued

    def url(self, *, ca: Path | None = None, client: Issued | None = None) -> str:
        """``amqps://`` to the TLS port with the CA and client certificate as parameters."""
        return broker.with_tls(f"amqps://guest:guest@127.0.0.1:{self.port}/",
                               ca_file=ca or self.ca,
                               cert_file=client.cert if client else None,
                               key_file=client.key if client else None)

    def settings_url(self) -> str:
        """The URL with no file in it: the files come from the settings."""
        return f"amqps://guest:guest@127.0.0.1:{self.port}/"

    def wrong_host_url(self) -> str:
        """The listener on 127.0.0.2, with no file in the URL."""
        return f"amqps://guest:guest@127.0.0.2:{self.wrong_host_port}/"


def shipped_tls_versions() -> list[str]:
    """The ``ssl_options.versions.*`` lines of compose/rabbitmq.conf, as they are."""
    return [line.strip() for line in (REPO_ROOT / "compose" / "rabbitmq.conf").read_text()
            .splitlines() if line.strip().startswith("ssl_options.versions.")]


@pytest.fixture(scope="module")
def tls_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TLSBroker]:
    """A private RabbitMQ node with a TLS listener that requires a client certificate."""
    folder = tmp_path_factory.mktemp("tls")
    ca, ca_key, ca_cert = make_ca(folder, "test-ca")
    server = issue(folder, "broker", ca_key, ca_cert, server=True)
    client = issue(folder, "client", ca_key, ca_cert, server=False)
    wrong_ca, _, _ = make_ca(folder, "other-ca")
    port, wrong_host_port = free_port(), free_port()
    config = (f"listeners.ssl.1 = 127.0.0.1:{port}\n"
              f"listeners.ssl.2 = 127.0.0.2:{wrong_host_port}\n"
              f"ssl_options.cacertfile = {ca.cert}\n"
              f"ssl_options.certfile = {server.cert}\n"
              f"ssl_options.keyfile = {server.key}\n"
              "ssl_options.verify = verify_peer\n"
              "ssl_options.fail_if_no_peer_cert = true\n"
              + "".join(f"{line}\n" for line in shipped_tls_versions()))
    with services.private_rabbitmq(folder / "rabbitmq", config=config) as node:
        assert services.port_open("127.0.0.1", port), node.log_tail()
        assert services.port_open("127.0.0.2", wrong_host_port), node.log_tail()
        yield TLSBroker(node, port, ca.cert, client, wrong_ca.cert, wrong_host_port, server)


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


# ------------------------------------------- the right CA, the wrong host name


WRONG_HOST = "does not name the host 127.0.0.2 of the URL"


def tls_files(tls_broker: TLSBroker) -> dict[str, Any]:
    """The CA and the client certificate as settings."""
    return {"amqp_ca_file": tls_broker.ca, "amqp_cert_file": tls_broker.client.cert,
            "amqp_key_file": tls_broker.client.key}


async def test_the_hub_client_refuses_a_certificate_for_another_host(tls_broker: TLSBroker
                                                                      ) -> None:
    """The client of the hub's spawner and GPU page: the broker's certificate is signed by
    the CA it trusts, but names 127.0.0.1 and localhost, not 127.0.0.2."""
    url = broker.with_tls(tls_broker.wrong_host_url(), ca_file=tls_broker.ca,
                          cert_file=tls_broker.client.cert, key_file=tls_broker.client.key)
    with pytest.raises(AllocatorUnavailable) as refused:
        async with AllocatorClient(url, timeout_s=5, connect_timeout_s=10):
            pass
    message = refused.value.message
    assert WRONG_HOST in message and "give the broker a certificate for this name" in message, \
        message
    assert "\n" not in message and "guest:guest" not in message


async def test_a_node_agent_refuses_a_certificate_for_another_host(
        tls_broker: TLSBroker, tmp_path: Path) -> None:
    inventory = tmp_path / "inventory.json"
    write_inventory(inventory, {"tls-node": [make_gpu("tls-node", 0, GTX1070)]})
    settings = AgentSettings(
        host="tls-node", amqp_url=tls_broker.wrong_host_url(), inventory="simulated",
        simulated_file=inventory, interval_s=0.25, docker=False, amqp_reconnect_s=0.2,
        **tls_files(tls_broker))
    async with started(NodeAgent(settings)) as agent:
        async def refused() -> str | None:
            error = agent.publisher.last_error if agent.publisher else None
            return error if error and WRONG_HOST in error else None
        message = await wait_until(refused, within=30)
    assert "\n" not in message and agent.heartbeats_sent == 0, message


def test_the_allocator_and_the_command_line_refuse_a_certificate_for_another_host(
        tls_broker: TLSBroker, tmp_path: Path) -> None:
    """``gpu-allocator serve`` (the allocator's start), ``gpu-allocator`` and ``gpu-ledger``
    as an admin runs them: exit 1 and one line that names the host, no traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_GPU_")}
    tls_env = {"SWARM_GPU_AMQP_CA_FILE": str(tls_broker.ca),
               "SWARM_GPU_AMQP_CERT_FILE": str(tls_broker.client.cert),
               "SWARM_GPU_AMQP_KEY_FILE": str(tls_broker.client.key)}
    serve_env = {**env, **tls_env, "SWARM_GPU_AMQP_URL": tls_broker.wrong_host_url(),
                 "SWARM_GPU_BROKER_WAIT_S": "0",
                 "SWARM_GPU_LEDGER_PATH": str(tmp_path / "ledger.sqlite")}
    runs = [  # (the program's name, its command, environment and exit status)
        ("gpu-allocator", ["allocator.admin.cli", "serve"], serve_env, 1),
        ("gpu-allocator", ["allocator.admin.cli", "inventory", "--timeout", "10", "--amqp",
                           tls_broker.wrong_host_url()], {**env, **tls_env}, 1),
        ("gpu-ledger", ["allocator.admin.ledger_cli", "status", "--timeout", "10", "--amqp",
                        tls_broker.wrong_host_url()], {**env, **tls_env}, 2),
    ]
    for program, command, run_env, status in runs:
        result = subprocess.run([sys.executable, "-m", *command], env=run_env, cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=60, check=False)
        assert result.returncode == status, (command, result.stderr)
        errors = [line for line in result.stderr.splitlines()
                  if line.startswith(f"{program}:") and WRONG_HOST in line]
        assert len(errors) == 1, (command, result.stderr)
        assert "Traceback" not in result.stderr and "guest:guest" not in result.stderr


# ------------------------------------------------------- certificate checks off


@pytest.mark.parametrize("query", ["no_verify_ssl=1", "no_verify_ssl=false", "verify=0",
                                   "check_hostname=0"])
def test_a_url_that_turns_the_certificate_check_off_is_refused(
        query: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """aiormq's ``no_verify_ssl`` (any value but 0) turns the check off; ``verify`` and the
    like are read by no client and would only mislead: every client refuses them, in one
    line with a stable code, whatever takes the URL (settings, the command line)."""
    monkeypatch.delenv(broker.INSECURE_NO_VERIFY_ENV, raising=False)
    url = f"amqps://hub:pw@rabbitmq:5671/swarm-gpu?heartbeat=10&{query}"
    for make in (lambda: AllocatorSettings(amqp_url=url),
                 lambda: AgentSettings(amqp_url=url),
                 lambda: broker.with_tls(url),
                 lambda: broker.tls_context(url)):
        with pytest.raises(ValueError, match=broker.INSECURE_TLS_CODE) as refused:
            make()
        assert "pw" not in str(refused.value).replace("hub:***", "")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_GPU_")}
    for command in (["allocator.admin.cli", "inventory"], ["allocator.admin.ledger_cli",
                                                           "status"]):
        result = subprocess.run([sys.executable, "-m", *command, "--amqp", url], env=env,
                                cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                                check=False)
        assert result.returncode != 0 and broker.INSECURE_TLS_CODE in result.stderr, \
            result.stderr
        assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 1, \
            result.stderr


def test_no_verify_ssl_0_is_the_check_as_usual() -> None:
    url = "amqps://hub:pw@rabbitmq:5671/v?no_verify_ssl=0"
    context = broker.tls_context(url)
    assert context is not None and context.verify_mode is ssl.CERT_REQUIRED
    assert context.check_hostname


async def test_an_allowed_no_verify_ssl_connects_and_warns_at_every_start(
        tls_broker: TLSBroker, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """With SWARM_GPU_AMQP_INSECURE_SKIP_TLS_VERIFY=1 a URL's no_verify_ssl=1 does what it
    says (a CA that signed nothing of the broker's is then no obstacle), and the process says
    so, loudly, when it connects."""
    monkeypatch.setenv(broker.INSECURE_NO_VERIFY_ENV, "1")
    monkeypatch.setattr(broker, "_warned_plaintext", set())
    url = tls_broker.url(ca=tls_broker.wrong_ca, client=tls_broker.client) + "&no_verify_ssl=1"
    with caplog.at_level(logging.WARNING, logger=broker.security_log.name):
        connection = await broker.connect(url, timeout=10)
        await connection.close()
    warnings = [r.getMessage() for r in caplog.records if r.name == broker.security_log.name]
    assert len(warnings) == 1 and "is NOT checked" in warnings[0], warnings
    assert broker.INSECURE_NO_VERIFY_ENV in warnings[0] and "guest:guest" not in warnings[0]
    monkeypatch.setenv(broker.INSECURE_NO_VERIFY_ENV, "yes")  # only 1 allows it
    with pytest.raises(broker.InsecureTLSError):
        await broker.connect(url, timeout=10)


# ------------------------------------------------------------------ TLS versions


def test_the_shipped_broker_allows_tls_1_2_and_1_3_only() -> None:
    """compose/rabbitmq.conf pins the versions (the AMQP listener and the management UI);
    the module's broker boots with those very lines (:func:`tls_broker`)."""
    conf = (REPO_ROOT / "compose" / "rabbitmq.conf").read_text()
    for prefix in ("ssl_options", "management.ssl"):
        versions = set(re.findall(rf"^{re.escape(prefix)}\.versions\.\d+\s*=\s*(\S+)",
                                  conf, re.MULTILINE))
        assert versions == {"tlsv1.2", "tlsv1.3"}, (prefix, versions)
    for stack in ("stack.one-machine.yml", "stack.one-machine.broker-cluster.yml"):
        text = (REPO_ROOT / "compose" / stack).read_text()
        # the one-machine files replace the management UI's TLS options: versions included
        assert text.count("ssl_config [") == text.count("{versions,['tlsv1.3','tlsv1.2']}"), \
            stack


def old_tls_context(server: bool) -> ssl.SSLContext:
    """A context that speaks TLS 1.1 and nothing newer (OpenSSL's security level 0 lets it)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
    context.set_ciphers("DEFAULT:@SECLEVEL=0")
    with warnings.catch_warnings():  # deprecated: that is the point
        warnings.simplefilter("ignore", DeprecationWarning)
        context.minimum_version = ssl.TLSVersion.TLSv1_1
        context.maximum_version = ssl.TLSVersion.TLSv1_1
    return context


def test_the_broker_refuses_a_tls_1_1_client(tls_broker: TLSBroker) -> None:
    context = old_tls_context(server=False)
    context.load_verify_locations(tls_broker.ca)
    context.load_cert_chain(tls_broker.client.cert, tls_broker.client.key)
    with socket.create_connection(("127.0.0.1", tls_broker.port), timeout=10) as raw, \
            pytest.raises(ssl.SSLError) as refused:
        context.wrap_socket(raw, server_hostname="127.0.0.1").close()
    assert "PROTOCOL_VERSION" in refused.value.reason.upper() or "UNSUPPORTED_PROTOCOL" in \
        refused.value.reason.upper(), refused.value


async def test_a_client_refuses_a_broker_that_speaks_only_tls_1_1(tls_broker: TLSBroker
                                                                  ) -> None:
    """A TLS server on loopback with the broker's own certificate that offers TLS 1.1 at most:
    every client context (:func:`allocator.amqp.broker.tls_context`) wants 1.2 or newer,
    and the one line says what to change at the broker."""
    context = old_tls_context(server=True)
    context.load_cert_chain(tls_broker.server.cert, tls_broker.server.key)
    handshakes: list[str] = []

    def serve_one(listener: socket.socket) -> None:
        # A blocking server in a thread: it reads the client's hello and answers with
        # OpenSSL's alert before it closes (asyncio's server resets the connection instead).
        connection, _ = listener.accept()
        with connection:
            try:
                context.wrap_socket(connection, server_side=True).close()
                handshakes.append("done")
            except (ssl.SSLError, OSError) as exc:
                handshakes.append(f"refused: {exc}")

    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(30)
        port = listener.getsockname()[1]
        url = broker.with_tls(f"amqps://guest:guest@127.0.0.1:{port}/", ca_file=tls_broker.ca,
                              cert_file=tls_broker.client.cert, key_file=tls_broker.client.key)
        client_context = broker.tls_context(url)
        assert client_context is not None
        assert client_context.minimum_version is ssl.TLSVersion.TLSv1_2
        serving = asyncio.create_task(asyncio.to_thread(serve_one, listener))
        with pytest.raises(AllocatorUnavailable) as refused:
            async with AllocatorClient(url, timeout_s=5, connect_timeout_s=10):
                pass
        await serving
    message = refused.value.message
    assert "older than 1.2" in message and "ssl_options.versions" in message, message
    assert len(handshakes) == 1 and handshakes[0].startswith("refused"), handshakes


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
