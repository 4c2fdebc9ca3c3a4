"""The ledger log's stream on a three-node broker: where it is placed, and where it is read.

Three RabbitMQ nodes of this machine's rabbitmq-server form one cluster (fixture
``rabbitmq_cluster``); a real allocator process (``python -m allocator.admin.cli serve``) with
``ledger_log = "stream"`` and one AMQP URL naming the three nodes. Each test has a vhost of
its own, so the stream is new to it.

- A new stream is declared only once every node of the URL answers: RabbitMQ places a
  stream's replicas on the nodes that run at its declaration, and RabbitMQ 3.10 cannot add a
  replica on a node that joined later until its stream coordinator has taken the node in
  (a stream command on that node before then splits the coordinator: the fresh stack's
  stream was stuck on one node). Here node 3 is down when the allocator starts: the stream
  must not exist until node 3 is back, and then it has a replica on all three.
- An allocator whose first node holds no replica of the stream (refused its consumer there:
  ``does not have a replica on the local node``) follows the log from the next node instead
  of exiting.
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import aio_pika
import pytest

from allocator.amqp.client import AllocatorClient
from allocator.config import AllocatorSettings
from allocator.ledger.replication import stream_arguments
from tests.support.common import wait_until
from tests.support.faults import AllocatorProcess
from tests.support.services import PrivateRabbitMQ, PrivateRabbitMQCluster

pytestmark = pytest.mark.slow  # three broker nodes and a real process: a minute or so

STREAM = AllocatorSettings().ledger_log_stream


def cluster_url(cluster: PrivateRabbitMQCluster, vhost: str, first: int = 0) -> str:
    """One URL naming every node of ``cluster``, node ``first`` first, for ``vhost``."""
    nodes = cluster.nodes[first:] + cluster.nodes[:first]
    return "amqp://guest:guest@" + ",".join(f"127.0.0.1:{node.port}" for node in nodes) \
        + f"/{vhost}"


def stream_members(node: PrivateRabbitMQ, vhost: str) -> list[str] | None:
    """The nodes holding a replica of the log's stream in ``vhost`` (asked of ``node``), or
    None when the stream does not exist."""
    result = node.ctl("list_queues", "-p", vhost, "name", "type", "members",
                      "--no-table-headers", "-q")
    assert result.returncode == 0, result.stderr
    for line in result.stdout.splitlines():
        name, kind, members = line.split("\t")
        if name == STREAM:
            assert kind == "stream", line
            return sorted(member.strip() for member in members.strip("[]").split(","))
    return None


async def on_every_node(cluster: PrivateRabbitMQCluster, vhost: str) -> str:
    """Start every node a test stopped, add ``vhost`` (new to the log), and return it."""
    await asyncio.to_thread(cluster.ensure_running)
    await asyncio.to_thread(cluster.add_vhost, vhost)
    return vhost


async def test_a_new_log_stream_waits_for_every_broker_node_and_has_a_replica_on_each(
        rabbitmq_cluster, tmp_path: Path) -> None:
    vhost = await on_every_node(rabbitmq_cluster, "log-stream-new")
    first, _, third = rabbitmq_cluster.nodes
    await asyncio.to_thread(third.kill)
    url = cluster_url(rabbitmq_cluster, vhost)
    active = AllocatorProcess("new-stream", url, tmp_path / "ledger.sqlite", tmp_path,
                              ledger_log="stream", broker_wait_s=240)
    try:
        await active.start()

        async def waiting() -> bool:
            return "waiting for broker node(s)" in active.log()
        await wait_until(waiting, within=60)
        assert f"127.0.0.1:{third.port}" in active.log()
        assert await asyncio.to_thread(stream_members, first, vhost) is None, \
            "the stream was declared while a broker node of the URL was down"
        assert active.process is not None and active.process.returncode is None

        await asyncio.to_thread(rabbitmq_cluster.ensure_running)
        await active.wait_consuming(within=120)
        members = await asyncio.to_thread(stream_members, first, vhost)
        assert members == sorted(node.node for node in rabbitmq_cluster.nodes), members
        async with AllocatorClient(url, timeout_s=10) as client:
            assert (await client.inventory()).nodes == []
    finally:
        assert await active.stop() == 0, active.log()[-3000:]


async def test_an_allocator_refused_the_log_on_its_first_node_follows_it_from_the_next(
        rabbitmq_cluster, tmp_path: Path) -> None:
    vhost = await on_every_node(rabbitmq_cluster, "log-stream-not-here")
    first, second, _ = rabbitmq_cluster.nodes
    settings = AllocatorSettings()
    declaring = await aio_pika.connect(second.vhost_url(vhost), timeout=30)
    try:
        channel = await declaring.channel()
        await channel.declare_queue(STREAM, durable=True, arguments=stream_arguments(
            settings.ledger_log_max_bytes, settings.ledger_log_segment_bytes))
    finally:
        await declaring.close()
    removed = await asyncio.to_thread(
        subprocess.run,
        [str(first.bin_dir / "rabbitmq-streams"), "-n", second.node, "delete_replica",
         "-p", vhost, STREAM, first.node], env=first.env, capture_output=True, text=True,
        timeout=60)
    assert removed.returncode == 0, removed.stderr or removed.stdout

    async def replica_gone() -> bool:
        members = await asyncio.to_thread(stream_members, second, vhost)
        return members is not None and first.node not in members
    await wait_until(replica_gone, within=60, interval=0.5)

    url = cluster_url(rabbitmq_cluster, vhost)  # the node without a replica first
    active = AllocatorProcess("not-here", url, tmp_path / "ledger.sqlite", tmp_path,
                              ledger_log="stream", broker_wait_s=120)
    try:
        await active.start()
        await active.wait_consuming(within=90)
        assert "holds no replica of the stream" in active.log(), active.log()[-3000:]
        async with AllocatorClient(url, timeout_s=10) as client:
            assert (await client.inventory()).nodes == []
    finally:
        assert await active.stop() == 0, active.log()[-3000:]
