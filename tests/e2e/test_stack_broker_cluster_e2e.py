"""The stack with its three-node broker, on a real three-node Swarm (``scripts/cluster``).

``scripts/cluster up --broker-cluster`` deploys compose/stack.yml with
compose/stack.broker-cluster.yml (and the one-machine overrides of both): a RabbitMQ node on
each Swarm node (rabbitmq on manager-1, rabbitmq-2 on gpu-1, rabbitmq-3 on gpu-2), each with
its own data volume, one Erlang cookie from a secret, peer discovery by classic_config; every
part's AMQP URL names the three. The allocator's replicas (gpu-1, gpu-2) connect to
rabbitmq-2 first, the hub and the agents to rabbitmq.

The tests check that the three form one cluster with a member of every quorum queue and
stream on each, that a user gets a GPU through the hub, and that with the engine of the worker
whose broker node holds the active allocator's connection stopped (that broker node, an
allocator replica and an agent gone; the manager stays) the allocator answers again, every
lease granted before is still there, and a new spawn is granted; then the same with that
broker node killed (SIGKILL of its container, its node staying). The time from the fault to
the first answer is printed (docs/reliability.md records it).

Its own module (its own ``scripts/cluster up``): tests/e2e/test_stack_e2e.py's stack has one
broker node. Ends with ``scripts/cluster down`` unless SWARM_GPU_CLUSTER_KEEP=1.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import ssl
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from allocator.amqp.client import AllocatorClient, AllocatorError
from tests.support.stack import (
    ALLOCATOR_NODES,
    GTX1070,
    RTX3090,
    UP_TIMEOUT_S,
    Cluster,
    cluster_up,
    eventually,
)

pytestmark = [pytest.mark.docker, pytest.mark.hub, pytest.mark.slow,
              pytest.mark.timeout(UP_TIMEOUT_S + 900)]

BROKERS = {"manager-1": ("rabbitmq", "rabbit@rabbitmq"),
           "gpu-1": ("rabbitmq-2", "rabbit-2@rabbitmq-2"),
           "gpu-2": ("rabbitmq-3", "rabbit-3@rabbitmq-3")}
"""Swarm node -> (the broker service there, its RabbitMQ node name)."""
VHOST = "swarm-gpu"
LEDGER_LOG = "swarm-gpu.ledger-log"
INBOUND = "swarm-gpu.allocator"
ANSWER_TIMEOUT_S = 3.0
POLL_INTERVAL_S = 0.5


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # Two more broker nodes wait for the first and join it: more time to converge.
    with cluster_up("--broker-cluster", env={"SWARM_GPU_CLUSTER_DEPLOY_TIMEOUT": "600"}) as up:
        assert up.env["SWARM_GPU_CLUSTER_BROKER_CLUSTER"] == "1"
        yield up


def broker_container(cluster: Cluster, node: str) -> str:
    service = f"{cluster.stack}_{BROKERS[node][0]}"
    ids = cluster.docker(node, "ps", "-q", "-f",
                         f"label=com.docker.swarm.service.name={service}").stdout.split()
    assert ids, f"no {service} container on {node}"
    return ids[0]


def rabbitmqctl(cluster: Cluster, node: str, *args: str) -> Any:
    """``rabbitmqctl ARGS --formatter json`` in the broker container on ``node``."""
    result = cluster.docker(node, "exec", broker_container(cluster, node), "rabbitmqctl", "-q",
                            *args, "--formatter", "json", timeout=120)
    return json.loads(result.stdout)


def running_nodes(cluster: Cluster, via: str) -> list[str]:
    status = rabbitmqctl(cluster, via, "cluster_status")
    return sorted(status["running_nodes"])


def replicated_queues(cluster: Cluster, via: str) -> dict[str, dict[str, Any]]:
    """name -> type, members, online and leader of every quorum queue and stream."""
    queues = rabbitmqctl(cluster, via, "list_queues", "-p", VHOST, "name", "type", "members",
                         "online", "leader")
    return {q["name"]: q for q in queues if q["type"] in ("quorum", "stream")}


def every_queue_on(nodes: list[str]) -> Callable[[dict[str, dict[str, Any]]], bool]:
    """Whether the inbound queue and the ledger log exist and every quorum queue and stream
    has exactly ``nodes`` as its members."""
    def probe(queues: dict[str, dict[str, Any]]) -> bool:
        return {INBOUND, LEDGER_LOG} <= set(queues) and all(
            sorted(q["members"]) == nodes for q in queues.values())
    return probe


@dataclass
class Poller:
    """Calls the allocator (``inventory``) every POLL_INTERVAL_S from its own thread, as the
    admin user, over a URL naming the three nodes (the manager's first, which stays up)."""

    url: str
    answers: list[float] = field(default_factory=list)
    """monotonic times of answered calls (when the answer came)."""
    failures: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    async def _run(self) -> None:
        async with AllocatorClient(self.url, timeout_s=ANSWER_TIMEOUT_S) as client:
            while not self._stop.is_set():
                try:
                    await client.inventory(timeout_s=ANSWER_TIMEOUT_S)
                    self.answers.append(time.monotonic())
                except (AllocatorError, OSError, TimeoutError) as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                await asyncio.sleep(POLL_INTERVAL_S)

    def first_answer_after(self, moment: float) -> float | None:
        later = [t for t in self.answers if t > moment]
        return later[0] if later else None

    def longest_gap(self, since: float) -> float:
        times = [since, *[t for t in self.answers if t > since]]
        return max((b - a for a, b in itertools.pairwise(times)), default=float("inf"))


def admin_url(cluster: Cluster) -> str:
    """The admin's URL over TLS (the only way in), naming the three nodes, checking their
    certificate with the cluster's CA (scripts/certs)."""
    port = cluster.env["SWARM_GPU_BROKER_PORT"]
    addresses = [cluster.env["SWARM_GPU_MANAGER_ADDR"], cluster.env["SWARM_GPU_BROKER_2_ADDR"],
                 cluster.env["SWARM_GPU_BROKER_3_ADDR"]]
    password = cluster.secret("broker-passwords/admin")
    return (f"amqps://admin:{password}@" + ",".join(f"{a}:{port}" for a in addresses)
            + f"/{VHOST}?cafile={cluster.broker_ca}")


def management(cluster: Cluster, method: str, path: str) -> Any:
    """RabbitMQ's HTTP API (HTTPS only) on the manager's broker node, as the admin user."""
    address = cluster.env["SWARM_GPU_MANAGER_ADDR"]
    request = urllib.request.Request(f"https://{address}:15682/api{path}", method=method)
    token = base64.b64encode(f"admin:{cluster.secret('broker-passwords/admin')}".encode())
    request.add_header("Authorization", f"Basic {token.decode()}")
    tls = ssl.create_default_context(cafile=str(cluster.broker_ca))
    with urllib.request.urlopen(request, timeout=30, context=tls) as response:
        body = response.read()
    return json.loads(body) if body else None


def active_consumer(cluster: Cluster) -> dict[str, Any] | None:
    """The channel of the allocator's single active consumer of the inbound queue: its
    connection's ``name`` and the broker ``node`` it is on. None: not known yet (the API lists
    a new consumer's ``channel_details`` as ``[]`` until its channel's first statistics)."""
    consumers = [c for c in management(cluster, "GET", f"/consumers/{VHOST}")
                 if c["queue"]["name"] == INBOUND and c["active"]]
    assert len(consumers) == 1, consumers
    details = consumers[0]["channel_details"]
    return details if isinstance(details, dict) and "node" in details else None


def serving_broker_node(cluster: Cluster) -> str:
    """The worker whose broker node holds the active allocator's connection. When that is
    the manager's (which must stay), its connection is closed first: the allocator goes on
    to the next node of its URL, a worker's."""
    workers = {BROKERS[node][1]: node for node in ALLOCATOR_NODES}

    def on_a_worker() -> str | None:
        channel = active_consumer(cluster)
        if channel is None:
            return None
        if channel["node"] in workers:
            return workers[channel["node"]]
        management(cluster, "DELETE", "/connections/"
                   + urllib.parse.quote(channel["connection_name"], safe=""))
        return None
    return eventually(on_a_worker, "the active allocator connected to a worker's broker node")


# ------------------------------------------------------------------------------ tests


def test_three_broker_nodes_one_on_each_node_form_one_cluster(cluster: Cluster) -> None:
    where: dict[str, list[str]] = {}
    for line in cluster.manager("stack", "ps", cluster.stack, "--filter",
                                "desired-state=running", "--format",
                                "{{.Name}} {{.Node}} {{.CurrentState}}").stdout.splitlines():
        name, node = line.split()[:2]
        where.setdefault(name.split(".")[0].removeprefix(f"{cluster.stack}_"), []).append(node)
    for node, (service, _) in BROKERS.items():
        assert where[service] == [node], where
    assert sorted(where["allocator"]) == sorted(ALLOCATOR_NODES)
    names = sorted(name for _, name in BROKERS.values())
    for via in BROKERS:  # every node sees the same three
        eventually(lambda: running_nodes(cluster, via) == names,  # noqa: B023 (called now)
                   f"the three nodes running, as {via} sees it")
    # The definitions' quorum queues (declared when the first node ran alone) and the ledger
    # log's stream (declared by the allocator) have a member on each node.
    def whole() -> dict[str, dict[str, Any]] | None:
        queues = replicated_queues(cluster, "manager-1")
        return queues if every_queue_on(names)(queues) else None
    queues = eventually(whole, "every quorum queue and stream on the three nodes", within=180)
    assert queues[INBOUND]["type"] == "quorum" and queues[LEDGER_LOG]["type"] == "stream"


def test_a_user_gets_a_gpu_through_the_hub(cluster: Cluster) -> None:
    lease_id, node, env, gpu, holder = cluster.granted(
        "alice", "staff", {"mode": "exclusive", "model": "3090"})
    assert node == "gpu-2" and gpu["model"] == RTX3090 and holder["user"] == "alice"
    assert env["NVIDIA_VISIBLE_DEVICES"] == gpu["uuid"]
    eventually(lambda: (cluster.lease(lease_id) or ({}, {}))[1].get("state") == "bound",
               "alice's lease bound")


def serves_through(cluster: Cluster, what: str, fault: Callable[[], None], lost: str,
                   spawn_on: str, user: str) -> None:
    """Runs ``fault`` (which takes ``lost``'s broker node away) while the allocator is
    called every POLL_INTERVAL_S, then checks: it answers again, through another broker
    node; every lease of before is in the serving replica's ledger on the same GPUs; a new
    spawn on ``spawn_on`` is granted a GPU no lease held before; ``gpu-ledger check``."""
    active_node, _ = cluster.active_allocator()
    before = json.loads(cluster.gpu_ledger("export", "leases", "--format", "json").stdout)
    held = {uuid for uuid, holders in cluster.holders().items() if holders}
    poller = Poller(admin_url(cluster))
    poller.start()
    try:
        eventually(lambda: len(poller.answers) >= 3, "the allocator answering before the fault")
        began = time.monotonic()
        fault()
        ended = time.monotonic()
        first = eventually(lambda: poller.first_answer_after(ended), f"an answer after {what}",
                           within=180)
        print(f"broker cluster: {what} ({BROKERS[lost][0]}, which the active allocator on "
              f"{active_node} was connected to) took {ended - began:.1f} s; first answer "
              f"{first - ended:.1f} s after it, {first - began:.1f} s after it began; longest "
              f"gap between answers {poller.longest_gap(began):.1f} s (polled every "
              f"{POLL_INTERVAL_S} s, {ANSWER_TIMEOUT_S} s timeout); {len(poller.failures)} "
              "calls unanswered")
    finally:
        poller.stop()
    # (The management API lists consumers from statistics a few seconds old.)
    def elsewhere() -> bool:
        channel = active_consumer(cluster)
        return channel is not None and channel["node"] != BROKERS[lost][1]
    eventually(elsewhere, "the allocator consuming through another broker node")
    # No decision lost: every lease of before, on the same GPUs, in the ledger of the
    # replica serving now (the other one, if the active one was on the lost node).
    after = json.loads(cluster.gpu_ledger("export", "leases", "--format", "json").stdout)
    by_id = {row["lease_id"]: row for row in after}
    for row in before:
        assert row["lease_id"] in by_id, row
        assert sorted(by_id[row["lease_id"]]["gpu_uuids"]) == sorted(row["gpu_uuids"])
    # A new spawn is granted (a GTX 1070 of a node left).
    lease_id, node, _, gpu, _ = cluster.granted(
        user, "students", {"mode": "exclusive", "model": "1070", "host": spawn_on})
    assert node == spawn_on and gpu["model"] == GTX1070
    assert lease_id not in by_id
    assert gpu["uuid"] not in held, "a GPU held before the fault is not granted again"
    check = cluster.gpu_ledger("check", check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    cluster.stop(user)
    eventually(lambda: cluster.lease(lease_id) is None, f"{user}'s GPU free")


def whole_again(cluster: Cluster, lost: str) -> None:
    """The lost broker node back in the cluster, every replicated queue on the three."""
    names = sorted(name for _, name in BROKERS.values())
    eventually(lambda: running_nodes(cluster, "manager-1") == names,
               f"{BROKERS[lost][0]} back in the cluster", within=180)
    eventually(lambda: every_queue_on(names)(replicated_queues(cluster, "manager-1")),
               "every quorum queue and stream on the three nodes again", within=180)


def test_a_broker_nodes_node_stopped_the_allocator_answers_and_loses_no_decision(
        cluster: Cluster) -> None:
    """The worker whose broker node holds the active allocator's connection stops (its
    engine: that broker node, an allocator replica, an agent). The allocator answers again
    through the two broker nodes left, every lease granted before is still there on its
    GPUs, and a new spawn on the other worker is granted; the node comes back and its broker
    node rejoins."""
    names = sorted(name for _, name in BROKERS.values())
    lost = serving_broker_node(cluster)
    (survivor,) = ALLOCATOR_NODES - {lost}
    alice, alice_node, _ = cluster.lease_of("alice")

    def stop() -> None:
        result = cluster.script("stop-node", lost)
        assert result.returncode == 0, result.stderr
        assert running_nodes(cluster, "manager-1") == sorted(set(names) - {BROKERS[lost][1]})
    try:
        serves_through(cluster, f"stop-node {lost}", stop, lost, survivor, "bob")
        if alice_node == survivor:
            gpu, holder = eventually(lambda: cluster.lease(alice), "alice's lease after")
            assert holder["state"] == "bound" and gpu["host"] == survivor
    finally:
        start = cluster.script("start-node", lost)
        assert start.returncode == 0, start.stderr
    # Back: the broker node restarts on its own data and rejoins; its queues are whole again.
    whole_again(cluster, lost)
    cluster.stop("alice")
    eventually(lambda: cluster.free() == {"gpu-1": 2, "gpu-2": 2}, "every GPU free")


def test_a_broker_node_killed_the_allocator_answers_and_loses_no_decision(
        cluster: Cluster) -> None:
    """The broker node holding the active allocator's connection is killed (SIGKILL: no
    connection is closed cleanly, the stream and queue leaders there are lost at once); its
    node and everything else on it stay. Swarm starts it again on its own data."""
    lost = serving_broker_node(cluster)
    (other,) = ALLOCATOR_NODES - {lost}
    container = broker_container(cluster, lost)
    # A lease granted before the kill, to be found after it.
    dave, *_ = cluster.granted("dave", "staff",
                               {"mode": "exclusive", "model": "1070", "host": other})
    eventually(lambda: (cluster.lease(dave) or ({}, {}))[1].get("state") == "bound",
               "dave's lease bound")

    def kill() -> None:
        cluster.docker(lost, "kill", "--signal", "KILL", container)
    serves_through(cluster, f"SIGKILL of {BROKERS[lost][0]}", kill, lost, lost, "carol")
    gpu, holder = eventually(lambda: cluster.lease(dave), "dave's lease after")
    assert holder["state"] == "bound" and gpu["host"] == other
    whole_again(cluster, lost)
    cluster.stop("dave")
    eventually(lambda: cluster.free() == {"gpu-1": 2, "gpu-2": 2}, "every GPU free")
