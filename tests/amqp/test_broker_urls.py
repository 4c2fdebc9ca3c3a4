"""One AMQP URL naming several broker nodes (``allocator/amqp/broker.py``).

The parsing is pure; the connections are made to the real broker, with a dead address (a
port nothing listens on) before it in the list. What happens when a node of a real
three-node cluster dies under load is tests/faults/test_fault_broker_cluster.py.
"""

from __future__ import annotations

import urllib.parse

import pytest

from allocator.amqp import broker
from allocator.amqp.client import AllocatorClient, AllocatorUnavailable
from nodeagent.publisher import Publisher
from tests.support.ports import free_port


def test_a_url_with_one_host_is_left_as_it_is() -> None:
    url = "amqp://hub:s3cret@rabbitmq:5672/swarm-gpu?heartbeat=30"
    assert broker.broker_urls(url) == [url]


def test_a_url_with_several_hosts_becomes_one_url_per_node_in_order() -> None:
    url = "amqp://hub:s3cret@node1:5672,node2,10.0.0.3:5673/swarm-gpu?heartbeat=30"
    assert broker.broker_urls(url) == [
        "amqp://hub:s3cret@node1:5672/swarm-gpu?heartbeat=30",
        "amqp://hub:s3cret@node2/swarm-gpu?heartbeat=30",
        "amqp://hub:s3cret@10.0.0.3:5673/swarm-gpu?heartbeat=30",
    ]
    assert broker.broker_address(url) == "node1:5672,node2:5672,10.0.0.3:5673/swarm-gpu"


def test_an_empty_host_in_the_list_is_refused_without_the_password() -> None:
    with pytest.raises(ValueError, match="empty broker address") as refused:
        broker.broker_urls("amqp://hub:s3cret@node1,,node3/v")
    assert "s3cret" not in str(refused.value)


def test_redact_hides_the_password_only() -> None:
    assert broker.redact("amqp://hub:s3cret@a:1,b:2/v") == "amqp://hub:***@a:1,b:2/v"
    assert broker.redact("amqp://rabbitmq/v") == "amqp://rabbitmq/v"


def test_rotating_the_nodes_puts_the_chosen_one_first_and_keeps_the_rest() -> None:
    url = "amqp://hub:s3cret@node1:5672,node2,node3:5673/swarm-gpu?heartbeat=30"
    assert broker.rotate_nodes(url, 1) == \
        "amqp://hub:s3cret@node2,node3:5673,node1:5672/swarm-gpu?heartbeat=30"
    assert broker.rotate_nodes(url, 5) == \
        "amqp://hub:s3cret@node3:5673,node1:5672,node2/swarm-gpu?heartbeat=30"
    assert broker.rotate_nodes(url, 3) == url
    assert broker.rotate_nodes("amqp://rabbitmq/v", 2) == "amqp://rabbitmq/v"


def dead_address() -> str:
    """host:port on loopback where nothing listens."""
    return f"127.0.0.1:{free_port()}"


def with_dead_node_first(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    credentials, _, host = parts.netloc.rpartition("@")
    return urllib.parse.urlunsplit(
        parts._replace(netloc=f"{credentials}@{dead_address()},{host}"))


async def test_connections_go_to_the_first_node_that_answers(amqp_vhost) -> None:
    url = with_dead_node_first(amqp_vhost.url)
    robust = await broker.connect_robust(url, timeout=5)
    try:
        channel = await robust.channel()
        queue = await channel.declare_queue("", exclusive=True)
        assert queue.name
    finally:
        await robust.close()
    plain = await broker.connect(url, timeout=5)
    await plain.close()
    # The hub's client too: an RPC round trip needs an allocator; the broker answering the
    # reply consumer is what the connection gives.
    async with AllocatorClient(url, timeout_s=5) as client:
        assert client.connected


async def test_a_node_agent_publishes_over_a_url_naming_several_nodes(amqp_vhost) -> None:
    """The agent's publisher takes its broker user (the AMQP ``user_id`` of every message)
    from a URL naming several nodes, and connects to the first that answers."""
    url = with_dead_node_first(amqp_vhost.url)
    publisher = Publisher(url, "gpu-a", timeout_s=5)
    assert publisher.user_id == urllib.parse.urlsplit(amqp_vhost.url).username
    await publisher.start()
    try:
        assert publisher.connected
    finally:
        await publisher.stop()


async def test_silent_nodes_are_the_ones_that_accept_no_connection(amqp_vhost) -> None:
    dead = dead_address()
    parts = urllib.parse.urlsplit(amqp_vhost.url)
    credentials, _, host = parts.netloc.rpartition("@")
    url = urllib.parse.urlunsplit(parts._replace(netloc=f"{credentials}@{host},{dead}"))
    assert await broker.silent_nodes(url, timeout=5) == [dead]
    assert await broker.silent_nodes(amqp_vhost.url, timeout=5) == []


async def test_no_node_answering_is_an_unavailable_broker_naming_every_node() -> None:
    url = f"amqp://guest:guest@{dead_address()},{dead_address()}/"
    with pytest.raises(AllocatorUnavailable) as unavailable:
        async with AllocatorClient(url, timeout_s=2, connect_timeout_s=2):
            pass
    assert "guest:***@" in str(unavailable.value)
    assert url.split("@")[1].split("/")[0] in str(unavailable.value)
