"""``compose/rabbitmq-definitions.json`` on the real broker: least privilege, proved.

The committed definitions are rendered (compose/render_definitions.py) with test passwords, a
vhost and user names of this run's own, and loaded through the management API
(``POST /api/definitions``, which creates the vhost, users, permissions and topology). A real
allocator then runs as the ``allocator`` user, and each other user tries what it may and
may not do. Users are deleted afterwards.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import pwd
import shutil
import ssl
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aio_pika
import aiormq.exceptions
import pytest

from allocator.amqp.broker import open_connection, with_tls
from allocator.amqp.client import AllocatorClient, AllocatorError, AllocatorTimeout
from allocator.config import AllocatorSettings
from allocator.service import AllocatorService
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerAction,
    ContainerEvent,
    ErrorCode,
    LeaseState,
    StopContainer,
    StopReason,
    encode,
)
from allocator.wire.topology import (
    AGENTS_EXCHANGE,
    DEAD_LETTER_EXCHANGE,
    DEAD_LETTER_QUEUE,
    NODES_EXCHANGE,
    RPC_EXCHANGE,
    RPC_ROUTING_KEY,
    agent_queue_spec,
    allocator_queue_spec,
    command_routing_key,
    dead_letter_queue_spec,
    event_routing_key,
    heartbeat_routing_key,
)
from nodeagent.commands import CommandConsumer
from nodeagent.containers import StopOutcome
from tests.support import services
from tests.support.broker_definitions import (
    COMPOSE,
    TEMPLATE,
    Broker,
    agent_beat,
    load,
    loaded_broker,
    publish,
    render_definitions,
)
from tests.support.common import wait_until
from tests.support.ports import free_port
from tests.support.tls_certs import issue, make_ca

# ----------------------------------------------------------------------------- the file


def test_topology_is_exactly_what_the_allocator_declares():
    """Same names, types and arguments as allocator.wire.topology (a mismatch would make the
    allocator's own declaration fail with PRECONDITION_FAILED at start)."""
    queues = {q["name"]: q for q in TEMPLATE["queues"]}
    for spec in (allocator_queue_spec(), dead_letter_queue_spec()):
        assert queues[spec.name]["arguments"] == spec.arguments
        assert queues[spec.name]["durable"] is spec.durable
        assert queues[spec.name]["auto_delete"] is False
    exchanges = {e["name"]: (e["type"], e["durable"], e["auto_delete"], e["internal"])
                 for e in TEMPLATE["exchanges"]}
    assert exchanges == {RPC_EXCHANGE: ("direct", True, False, False),
                         NODES_EXCHANGE: ("topic", True, False, False),
                         AGENTS_EXCHANGE: ("topic", True, False, False),
                         DEAD_LETTER_EXCHANGE: ("fanout", True, False, False)}
    bindings = {(b["source"], b["destination"], b["routing_key"]) for b in TEMPLATE["bindings"]}
    assert bindings == {(RPC_EXCHANGE, allocator_queue_spec().name, RPC_ROUTING_KEY),
                        (NODES_EXCHANGE, allocator_queue_spec().name, "#"),
                        (DEAD_LETTER_EXCHANGE, DEAD_LETTER_QUEUE, "")}
    assert all(u["password_hash"] == "" for u in TEMPLATE["users"]), \
        "the committed file carries no password"


def test_render_adds_one_agent_per_host_with_hashed_passwords():
    passwords = {"admin": "a", "allocator": "b", "hub": "c", "gpu-x.lab": "d"}
    rendered = render_definitions.render(TEMPLATE, passwords=passwords,
                                         agents=["gpu-x.lab", "n2"], vhost="v", user_prefix="p-")
    users = {u["name"]: u for u in rendered["users"]}
    assert sorted(users) == ["p-admin", "p-agent-gpu-x.lab", "p-agent-n2", "p-allocator",
                             "p-hub"]
    assert users["p-hub"]["password_hash"] and users["p-agent-n2"]["password_hash"] == ""
    topics = {(t["user"], t["exchange"]): (t["write"], t["read"])
              for t in rendered["topic_permissions"]}
    assert topics[("p-agent-gpu-x.lab", NODES_EXCHANGE)] == (
        r"^(heartbeat|event)\.gpu\-x\.lab$", "^$")
    assert topics[("p-agent-gpu-x.lab", AGENTS_EXCHANGE)] == ("^$", r"^stop\.gpu\-x\.lab$")
    assert topics[("p-agent-n2", AGENTS_EXCHANGE)] == ("^$", r"^stop\.n2$")
    permissions = {p["user"]: p for p in rendered["permissions"]}
    agent = permissions["p-agent-gpu-x.lab"]
    assert (agent["configure"], agent["write"], agent["read"]) == (
        r"^swarm-gpu\.agent\.gpu\-x\.lab$", r"^swarm-gpu\.(nodes|agent\.gpu\-x\.lab)$",
        r"^swarm-gpu\.(agents|agent\.gpu\-x\.lab)$")
    assert permissions["p-allocator"] == {**TEMPLATE["permissions"][1], "user": "p-allocator",
                                          "vhost": "v"}, "only the agents' entries name hosts"
    assert {p["vhost"] for p in rendered["permissions"]} == {"v"}
    assert [v["name"] for v in rendered["vhosts"]] == ["v"]


def test_password_hash_is_rabbitmqs():
    # The example of RabbitMQ's docs ("Computing Password Hash"): salt 908DC60A, password
    # "test12" -> kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR.
    salt = bytes.fromhex("908DC60A")
    assert render_definitions.rabbit_password_hash("test12", salt) == \
        "kI3GCqW5JLMJa4iX1lo7X4D6XbYqlLgxIs30+P6tENUV2POR"


def test_render_script_needs_every_password(tmp_path):
    for user in ("admin", "allocator", "hub"):
        (tmp_path / user).write_text(f"{user}-pw\n")
    assert render_definitions.main(["--passwords", str(tmp_path), "--agent", "g1",
                                    "-o", str(tmp_path / "out.json")]) == 2
    (tmp_path / "agent-g1").write_text("g1-pw\n")
    assert render_definitions.main(["--passwords", str(tmp_path), "--agent", "g1",
                                    "-o", str(tmp_path / "out.json")]) == 0
    assert oct((tmp_path / "out.json").stat().st_mode & 0o777) == "0o600"


# ----------------------------------------------------------------------------- the broker


@pytest.fixture
def broker(rabbitmq) -> Iterator[Broker]:
    """The committed definitions, loaded under a vhost and user names of this test's own."""
    with loaded_broker(rabbitmq, TEMPLATE, "defs") as loaded:
        yield loaded


@pytest.fixture
async def running(broker, ledger_path):
    """A real allocator consuming as the ``allocator`` user (its declarations must pass)."""
    service = AllocatorService(broker.settings(ledger_path))
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


async def ignore(message: aio_pika.abc.AbstractIncomingMessage) -> None:
    """A consumer that is never meant to receive anything."""


async def test_hub_allocates_from_gpus_an_agent_reported(broker, running):
    agent = broker.prefix + "agent-gpu-a"
    await publish(broker.url("agent-gpu-a"), NODES_EXCHANGE, heartbeat_routing_key("gpu-a"),
                  agent_beat("gpu-a"), user_id=agent)
    async with AllocatorClient(broker.url("hub"), timeout_s=10) as hub:
        async def reported():
            return (await hub.inventory()).nodes
        nodes = await wait_until(reported)
        assert [n.host for n in nodes] == ["gpu-a"]
        lease = await hub.allocate(AllocateRequest(request_key="hub/alice/", user="alice"))
        assert lease.state is LeaseState.GRANTED and lease.host == "gpu-a"
        with pytest.raises(AllocatorError) as refused:
            await hub.drain("gpu-a")
        assert refused.value.code is ErrorCode.FORBIDDEN, "the hub is no admin"
    async with AllocatorClient(broker.url("admin"), timeout_s=10) as admin:
        assert (await admin.drain("gpu-a", reason="permission test")).drained


async def test_the_allocator_user_may_keep_the_replicated_ledger_log(broker, ledger_path):
    """``ledger_log = "stream"`` (the stack's setting): the allocator declares and reads the
    stream swarm-gpu.ledger-log and appends to it through the default exchange."""
    settings = broker.settings(ledger_path).model_copy(update={"ledger_log": "stream"})
    service = AllocatorService(settings)
    await service.start()
    try:
        # The agent's heartbeat is the first delivery: the allocator claims the log and
        # appends the heartbeat's batch, each read back from the stream before it counts.
        await publish(broker.url("agent-gpu-a"), NODES_EXCHANGE, heartbeat_routing_key("gpu-a"),
                      agent_beat("gpu-a"), user_id=broker.prefix + "agent-gpu-a")
        replicated = service.log
        assert replicated is not None

        async def claimed_and_written() -> bool:
            return replicated.entries_applied >= 2
        await wait_until(claimed_and_written)
        assert replicated.is_writer and service.failure is None
    finally:
        await asyncio.wait_for(service.stop(), 30)


async def test_hub_cannot_publish_heartbeats(broker, running):
    with pytest.raises(aiormq.exceptions.ChannelAccessRefused, match="ACCESS_REFUSED"):
        await publish(broker.url("hub"), NODES_EXCHANGE, heartbeat_routing_key("gpu-a"),
                      agent_beat("gpu-a"), user_id=broker.prefix + "hub")


async def test_hub_cannot_read_or_create_queues(broker, running):
    connection = await aio_pika.connect(broker.url("hub"), timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(allocator_queue_spec().name, ensure=False)
        with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
            await queue.consume(ignore)
        channel = await connection.channel()
        with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
            await channel.declare_queue("hub-owned", auto_delete=True)


async def test_agent_cannot_request_gpus(broker, running):
    agent = broker.prefix + "agent-gpu-a"
    request = encode(AllocateRequest(request_key="agent/x/", user="x"))
    with pytest.raises(aiormq.exceptions.ChannelAccessRefused, match="ACCESS_REFUSED"):
        await publish(broker.url("agent-gpu-a"), RPC_EXCHANGE, RPC_ROUTING_KEY, request,
                      user_id=agent)


async def test_agent_cannot_use_another_hosts_routing_key(broker, running):
    agent = broker.prefix + "agent-gpu-a"
    with pytest.raises(aiormq.exceptions.ChannelAccessRefused, match="ACCESS_REFUSED"):
        await publish(broker.url("agent-gpu-a"), NODES_EXCHANGE, heartbeat_routing_key("gpu-b"),
                      agent_beat("gpu-b"), user_id=agent)


async def test_allocator_refuses_a_heartbeat_for_another_host(broker, running):
    """agent-gpu-a reports gpu-b under its own routing key: the broker lets it through
    (the key is gpu-a's), the allocator refuses it because the user is not agent-gpu-b."""
    agent = broker.prefix + "agent-gpu-a"
    await publish(broker.url("agent-gpu-a"), NODES_EXCHANGE, heartbeat_routing_key("gpu-a"),
                  agent_beat("gpu-b"), user_id=agent)

    async def refused():
        return running.engine.counters["heartbeat_rejected"]
    assert await wait_until(refused) == 1
    assert "gpu-b" not in running.engine.cluster.nodes
    # Its own host is accepted from the same connection's user.
    await publish(broker.url("agent-gpu-b"), NODES_EXCHANGE, heartbeat_routing_key("gpu-b"),
                  agent_beat("gpu-b"), user_id=broker.prefix + "agent-gpu-b")

    async def accepted():
        return "gpu-b" in running.engine.cluster.nodes
    await wait_until(accepted)


async def test_agent_without_user_id_is_refused_by_the_allocator(broker, running):
    await publish(broker.url("agent-gpu-a"), NODES_EXCHANGE, heartbeat_routing_key("gpu-a"),
                  agent_beat("gpu-a"))

    async def refused():
        return running.engine.counters["heartbeat_rejected"]
    assert await wait_until(refused) == 1


async def test_forged_user_id_is_refused_by_the_broker(broker, running):
    with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed, match="user_id"):
        await publish(broker.url("agent-gpu-a"), NODES_EXCHANGE, heartbeat_routing_key("gpu-a"),
                      agent_beat("gpu-a"), user_id=broker.prefix + "agent-gpu-b")


async def test_agent_cannot_read_anything(broker, running):
    connection = await aio_pika.connect(broker.url("agent-gpu-a"), timeout=10)
    async with connection:
        for name in (allocator_queue_spec().name, DEAD_LETTER_QUEUE):
            channel = await connection.channel()
            queue = await channel.get_queue(name, ensure=False)
            with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
                await queue.consume(ignore)


async def test_agent_binds_only_its_own_queue_with_its_own_key(broker, running):
    spec = agent_queue_spec("gpu-a")
    connection = await aio_pika.connect(broker.url("agent-gpu-a"), timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(spec.name, durable=spec.durable,
                                            arguments=spec.arguments)
        await queue.bind(AGENTS_EXCHANGE, command_routing_key("gpu-a"))
        await queue.consume(ignore)
        # Another host's commands, all commands, or the nodes' heartbeats: refused.
        for exchange, key in ((AGENTS_EXCHANGE, command_routing_key("gpu-b")),
                              (AGENTS_EXCHANGE, "#"), (AGENTS_EXCHANGE, "stop.*"),
                              (NODES_EXCHANGE, "#")):
            channel = await connection.channel()
            queue = await channel.get_queue(spec.name, ensure=False)
            with pytest.raises(aiormq.exceptions.ChannelAccessRefused, match="ACCESS_REFUSED"):
                await queue.bind(exchange, key)
        other = agent_queue_spec("gpu-b")
        channel = await connection.channel()
        with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
            await channel.declare_queue(other.name, durable=other.durable,
                                        arguments=other.arguments)


async def test_agent_cannot_consume_another_hosts_command_queue(broker, running):
    other = agent_queue_spec("gpu-b")
    owner = await aio_pika.connect(broker.url("agent-gpu-b"), timeout=10)
    async with owner:
        channel = await owner.channel()
        await channel.declare_queue(other.name, durable=other.durable, arguments=other.arguments)
        connection = await aio_pika.connect(broker.url("agent-gpu-a"), timeout=10)
        async with connection:
            channel = await connection.channel()
            queue = await channel.get_queue(other.name, ensure=False)
            with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
                await queue.consume(ignore)


def stop_command(host: str) -> bytes:
    return encode(StopContainer(host=host, lease_id="l", container_id="c", grace_s=0,
                                reason=StopReason.RELEASED))


async def test_hub_cannot_publish_commands(broker, running):
    with pytest.raises(aiormq.exceptions.ChannelAccessRefused, match="ACCESS_REFUSED"):
        await publish(broker.url("hub"), AGENTS_EXCHANGE, command_routing_key("gpu-a"),
                      stop_command("gpu-a"), user_id=broker.prefix + "hub")


async def test_agent_cannot_publish_commands(broker, running):
    with pytest.raises(aiormq.exceptions.ChannelAccessRefused, match="ACCESS_REFUSED"):
        await publish(broker.url("agent-gpu-a"), AGENTS_EXCHANGE, command_routing_key("gpu-b"),
                      stop_command("gpu-b"), user_id=broker.prefix + "agent-gpu-a")


async def test_a_release_reaches_the_agent_with_least_privilege(broker, running):
    """The agent's real command consumer, as agent-gpu-a (it may not declare the exchange:
    it falls back to the one the definitions made), gets the allocator's stop command for a
    lease the hub released."""
    agent_user = broker.prefix + "agent-gpu-a"
    stopped: list[tuple[str, str]] = []

    async def stopper(container_id: str, lease_id: str, grace_s: float) -> StopOutcome:
        stopped.append((container_id, lease_id))
        return StopOutcome.STOPPED

    consumer = CommandConsumer(broker.url("agent-gpu-a"), "gpu-a", stopper,
                               command_users=[broker.prefix + "allocator"], timeout_s=5)
    try:
        assert await consumer.start(wait_s=10), consumer.last_error
        await publish(broker.url("agent-gpu-a"), NODES_EXCHANGE, heartbeat_routing_key("gpu-a"),
                      agent_beat("gpu-a"), user_id=agent_user)
        async with AllocatorClient(broker.url("hub"), timeout_s=10) as hub:
            async def reported():
                return (await hub.inventory()).nodes
            await wait_until(reported)
            lease = await hub.allocate(AllocateRequest(request_key="hub/erin/", user="erin"))
            await publish(broker.url("agent-gpu-a"), NODES_EXCHANGE, event_routing_key("gpu-a"),
                          encode(ContainerEvent(host="gpu-a", container_id="c-erin",
                                                lease_id=lease.lease_id,
                                                action=ContainerAction.START, at=time.time())),
                          user_id=agent_user)

            async def bound():
                return (await hub.status(lease_id=lease.lease_id)).state is LeaseState.BOUND
            await wait_until(bound)
            assert (await hub.release(lease_id=lease.lease_id)).state is LeaseState.RELEASING

            async def asked():
                return stopped
            assert await wait_until(asked) == [("c-erin", lease.lease_id)]
    finally:
        await consumer.stop()
    assert consumer.counters["refused_user"] == 0
    assert running.stats.counters["command_failures"] == 0


async def test_replies_need_write_on_the_default_exchange(rabbitmq, ledger_path):
    """Direct reply-to on 3.10: the *client* needs no permission to consume
    amq.rabbitmq.reply-to (the hub reads nothing), but the *allocator* publishes the reply
    to the default exchange, which permissions name ``amq.default``. Without write on it,
    every reply is refused and the hub times out."""
    template = json.loads(json.dumps(TEMPLATE))
    for permission in template["permissions"]:
        if permission["user"] == "allocator":
            permission["write"] = r"^swarm-gpu\.(allocator|dead-letters|dead)$"
    tag = uuid.uuid4().hex[:8]
    vhost, prefix = f"{services.VHOST_PREFIX}{os.getpid()}-noreply-{tag}", f"t{tag}-"
    users = ["admin", "allocator", "hub", "agent-gpu-a", "agent-gpu-b"]
    passwords = {user: uuid.uuid4().hex for user in users}
    try:
        load(rabbitmq, template, vhost, prefix, passwords)
        broker = Broker(rabbitmq, vhost, prefix, passwords)
        service = AllocatorService(broker.settings(ledger_path))
        await service.start()
        try:
            async with AllocatorClient(broker.url("hub"), timeout_s=2) as hub:
                with pytest.raises(AllocatorTimeout):
                    await hub.inventory()
        finally:
            await asyncio.wait_for(service.stop(), 30)
    finally:
        services.delete_vhost(rabbitmq, vhost)
        rabbitmq.api("POST", "/api/users/bulk-delete", {"users": [prefix + u for u in users]})


async def test_definitions_from_before_stop_commands_leave_the_allocator_working(
        rabbitmq, ledger_path):
    """An upgraded allocator on the broker definitions of an older release (no permissions on
    swarm-gpu.agents): it starts, answers and releases as before, without stop commands."""
    template = json.loads(json.dumps(TEMPLATE))
    for permission in template["permissions"]:
        if permission["user"] == "allocator":
            permission["configure"] = r"^swarm-gpu\.(rpc|nodes|dead|allocator|dead-letters)$"
            permission["write"] = r"^(swarm-gpu\.(allocator|dead-letters|dead)|amq\.default)$"
    template["exchanges"] = [e for e in template["exchanges"] if e["name"] != AGENTS_EXCHANGE]
    tag = uuid.uuid4().hex[:8]
    vhost, prefix = f"{services.VHOST_PREFIX}{os.getpid()}-oldperm-{tag}", f"t{tag}-"
    users = ["admin", "allocator", "hub", "agent-gpu-a", "agent-gpu-b"]
    passwords = {user: uuid.uuid4().hex for user in users}
    try:
        load(rabbitmq, template, vhost, prefix, passwords)
        broker = Broker(rabbitmq, vhost, prefix, passwords)
        service = AllocatorService(broker.settings(ledger_path))
        await service.start()
        try:
            agent = prefix + "agent-gpu-a"
            await publish(broker.url("agent-gpu-a"), NODES_EXCHANGE,
                          heartbeat_routing_key("gpu-a"), agent_beat("gpu-a"), user_id=agent)
            async with AllocatorClient(broker.url("hub"), timeout_s=10) as hub:
                async def reported():
                    return (await hub.inventory()).nodes
                await wait_until(reported)
                lease = await hub.allocate(AllocateRequest(request_key="hub/f/", user="f"))
                await publish(broker.url("agent-gpu-a"), NODES_EXCHANGE,
                              event_routing_key("gpu-a"),
                              encode(ContainerEvent(host="gpu-a", container_id="c-f",
                                                    lease_id=lease.lease_id,
                                                    action=ContainerAction.START,
                                                    at=time.time())), user_id=agent)

                async def bound():
                    return (await hub.status(lease_id=lease.lease_id)).state \
                        is LeaseState.BOUND
                await wait_until(bound)
                released = await hub.release(lease_id=lease.lease_id)
                assert released.state is LeaseState.RELEASING
                assert (await hub.inventory()).nodes, "still answering after the release"
            assert service.stats.counters["command_failures"] == 1
            assert service.stats.counters["commands_sent"] == 0
        finally:
            await asyncio.wait_for(service.stop(), 30)
    finally:
        services.delete_vhost(rabbitmq, vhost)
        rabbitmq.api("POST", "/api/users/bulk-delete", {"users": [prefix + u for u in users]})


# ----------------------------------------------------------------------------- at boot


@dataclass(frozen=True)
class BootedBroker:
    """A node booted with the stack's config: its TLS ports and the CA of its certificate."""

    amqp_port: int
    management_port: int
    ca: Path

    def url(self, user: str, password: str, vhost: str = "swarm-gpu") -> str:
        """``amqps://`` to the node as the stack's clients connect: the CA as the URL's."""
        return with_tls(f"amqps://{user}:{password}@127.0.0.1:{self.amqp_port}/{vhost}",
                        ca_file=self.ca)


@contextlib.contextmanager
def booted_broker(definitions: dict) -> Iterator[BootedBroker]:
    """A second RabbitMQ node of this machine's rabbitmq-server, started with the stack's
    compose/rabbitmq.conf and the rendered definitions as its boot-time definitions file,
    exactly as the stack mounts them, and a certificate of a CA made here where the stack
    mounts its TLS secrets. Only the ports differ (a later file overrides them, as RabbitMQ
    lets a later listener setting win). Stopped and removed afterwards."""
    server, ctl = shutil.which("rabbitmq-server"), shutil.which("rabbitmqctl")
    if not server or not ctl:
        services.require_service("rabbitmq-server", "not installed on this machine")
    base = Path(tempfile.mkdtemp(prefix="swarm-gpu-boot-", dir="/tmp"))
    node = f"sgboot{os.getpid()}{uuid.uuid4().hex[:6]}@localhost"
    amqp_port, management_port = free_port(), free_port()
    tls = base / "tls"
    tls.mkdir()
    ca, ca_key, ca_cert = make_ca(tls, "ca")
    broker_cert = issue(tls, "broker", ca_key, ca_cert, server=True)
    conf = base / "conf.d"
    conf.mkdir()
    (base / "definitions.json").write_text(json.dumps(definitions))
    stack_conf = (COMPOSE / "rabbitmq.conf").read_text().replace(
        "/etc/rabbitmq/definitions.json", str(base / "definitions.json")).replace(
        "/etc/rabbitmq/tls/ca.pem", str(ca.cert)).replace(
        "/etc/rabbitmq/tls/cert.pem", str(broker_cert.cert)).replace(
        "/etc/rabbitmq/tls/key.pem", str(broker_cert.key))
    assert not [line for line in stack_conf.splitlines()
                if "/etc/rabbitmq/" in line and not line.startswith("#")], \
        "a file the stack's config names is not replaced here"
    (conf / "20-swarm-gpu.conf").write_text(stack_conf)
    (conf / "30-test-ports.conf").write_text(
        f"listeners.ssl.default = {amqp_port}\nmanagement.ssl.port = {management_port}\n")
    (base / "enabled_plugins").write_text("[rabbitmq_management].\n")
    env = {**os.environ, "RABBITMQ_NODENAME": node, "RABBITMQ_DIST_PORT": str(free_port()),
           "RABBITMQ_MNESIA_BASE": str(base / "mnesia"), "RABBITMQ_LOG_BASE": str(base / "log"),
           "RABBITMQ_CONFIG_FILES": str(conf), "RABBITMQ_PID_FILE": str(base / "pid"),
           "RABBITMQ_ENABLED_PLUGINS_FILE": str(base / "enabled_plugins")}
    if os.geteuid() == 0:
        # The scripts drop to the rabbitmq user, which must own the node's folders.
        account = pwd.getpwnam("rabbitmq")
        base.chmod(0o755)
        for path in (base, *base.rglob("*")):
            os.chown(path, account.pw_uid, account.pw_gid)
    try:
        subprocess.run([server, "-detached"], env=env, check=True, timeout=60,
                       capture_output=True)
        # -detached returns before the node registers; await_startup refuses a node that is
        # not registered yet, so ask again until it answers.
        deadline = time.monotonic() + 120
        while True:
            started = subprocess.run([ctl, "-n", node, "await_startup", "--timeout", "90"],
                                     env=env, timeout=120, capture_output=True, text=True)
            if started.returncode == 0:
                break
            if time.monotonic() > deadline:
                logs = "".join(p.read_text() for p in (base / "log").glob("*.log"))
                raise AssertionError(f"the node did not boot: {started.stderr[-1000:]}\n"
                                     f"{logs[-3000:]}")
            time.sleep(0.5)
        yield BootedBroker(amqp_port, management_port, ca.cert)
    finally:
        subprocess.run([ctl, "-n", node, "stop"], env=env, timeout=60, capture_output=True)
        _kill_if_alive(base / "pid", node)
        shutil.rmtree(base, ignore_errors=True)


def _kill_if_alive(pid_file: Path, node: str) -> None:
    """The node this test started, if `rabbitmqctl stop` could not stop it (checked by its
    node name in the process environment, so a reused pid is never hit)."""
    with contextlib.suppress(OSError, ValueError):
        pid = int(pid_file.read_text().strip())
        if f"RABBITMQ_NODENAME={node}".encode() not in Path(f"/proc/{pid}/environ").read_bytes():
            return
        os.kill(pid, 15)
        for _ in range(100):
            os.kill(pid, 0)  # raises once it is gone
            time.sleep(0.1)


@pytest.mark.slow
async def test_a_broker_booted_with_the_stack_config_serves_the_allocator(tmp_path):
    """What the stack does at first boot: rabbitmq.conf loads the rendered definitions. No
    guest user is created then; the allocator, hub and admin log in with their passwords."""
    users = ["admin", "allocator", "hub", "agent-gpu-a", "agent-gpu-b"]
    passwords = {user: uuid.uuid4().hex for user in users}
    definitions = render_definitions.render(TEMPLATE, passwords=passwords,
                                            agents=["gpu-a", "gpu-b"])
    with booted_broker(definitions) as booted:
        def url(user: str) -> str:
            return booted.url(user, passwords[user])

        with pytest.raises(aio_pika.exceptions.ProbableAuthenticationError):
            await open_connection(booted.url("guest", "guest", vhost=""), timeout=10)
        # TLS only: nothing answers AMQP in plain text, the management API only over HTTPS.
        with pytest.raises((aiormq.exceptions.AMQPConnectionError, ConnectionError, OSError)):
            await open_connection(f"amqp://admin:{passwords['admin']}@127.0.0.1:"
                                  f"{booted.amqp_port}/swarm-gpu", timeout=10)
        context = ssl.create_default_context(cafile=str(booted.ca))
        request = urllib.request.Request(
            f"https://localhost:{booted.management_port}/api/whoami",
            headers={"Authorization": "Basic " + base64.b64encode(
                f"admin:{passwords['admin']}".encode()).decode()})

        def whoami() -> str:
            with urllib.request.urlopen(request, context=context, timeout=10) as answer:
                return str(json.loads(answer.read())["name"])
        assert await asyncio.to_thread(whoami) == "admin"
        settings = AllocatorSettings(amqp_url=url("allocator"), ledger_path=tmp_path / "l.sqlite",
                                     tick_s=0.1)  # the stack's defaults: agent-{host}, admin
        service = AllocatorService(settings)
        await service.start()
        try:
            await publish(url("agent-gpu-a"), NODES_EXCHANGE, heartbeat_routing_key("gpu-a"),
                          agent_beat("gpu-a"), user_id="agent-gpu-a")
            async with AllocatorClient(url("hub"), timeout_s=10) as hub:
                async def reported():
                    return (await hub.inventory()).nodes
                assert [n.host for n in await wait_until(reported)] == ["gpu-a"]
                lease = await hub.allocate(AllocateRequest(request_key="h/a/", user="a"))
                assert lease.state is LeaseState.GRANTED
            async with AllocatorClient(url("admin"), timeout_s=10) as admin:
                assert (await admin.drain("gpu-a")).drained
        finally:
            await service.stop()
