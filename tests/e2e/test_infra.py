"""The test infrastructure itself: the fixtures reach real, working services."""

from __future__ import annotations

import asyncio
import subprocess
import uuid
from pathlib import Path

import aio_pika
import aiodocker
import pytest

from tests.support import services

# --------------------------------------------------------------------- require_service


def test_missing_service_skips_on_a_developer_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(services.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="Frobnicator unavailable: gone"):
        services.require_service("Frobnicator", "gone")


def test_missing_service_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(services.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="Frobnicator unavailable: gone"):
        services.require_service("Frobnicator", "gone")


# ---------------------------------------------------------------------------- RabbitMQ


async def _receive(queue: aio_pika.abc.AbstractQueue, count: int) -> list[bytes]:
    """Consume `count` messages (basic.get is refused on single-active-consumer queues)."""
    bodies: list[bytes] = []
    async with asyncio.timeout(10), queue.iterator() as messages:
        async for message in messages:
            async with message.process():
                bodies.append(message.body)
            if len(bodies) == count:
                break
    return bodies


def test_vhost_is_created_and_deleted(rabbitmq: services.RabbitMQ) -> None:
    with services.temporary_vhost(rabbitmq) as vhost:
        assert vhost.name.startswith(services.VHOST_PREFIX)
        assert services.vhost_exists(rabbitmq, vhost.name)
        permissions = rabbitmq.api("GET", f"/api/vhosts/{vhost.name}/permissions")
        assert {p["user"] for p in permissions} >= {rabbitmq.user}
    assert not services.vhost_exists(rabbitmq, vhost.name)


@pytest.mark.asyncio
async def test_message_round_trips_through_a_queue_in_the_vhost(
    amqp_vhost: services.AmqpVhost,
) -> None:
    assert amqp_vhost.url.endswith("/" + amqp_vhost.name)
    connection = await aio_pika.connect(amqp_vhost.url, timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue("round-trip", exclusive=True)
        await channel.default_exchange.publish(
            aio_pika.Message(body=b"ping"), routing_key=queue.name
        )
        assert await _receive(queue, 1) == [b"ping"]

    # The queue lives in the test's vhost, not in the shared default one.
    queues = amqp_vhost.broker.api("GET", f"/api/queues/{amqp_vhost.name}")
    assert [q["name"] for q in queues] == []  # exclusive: gone with its connection


@pytest.mark.asyncio
async def test_quorum_queue_with_single_active_consumer_declares(
    amqp_vhost: services.AmqpVhost,
) -> None:
    connection = await aio_pika.connect(amqp_vhost.url, timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.declare_queue(
            "requests",
            durable=True,
            arguments={
                "x-queue-type": "quorum",
                "x-single-active-consumer": True,
                "x-delivery-limit": 5,
            },
        )
        info = amqp_vhost.broker.api("GET", f"/api/queues/{amqp_vhost.name}/requests")
        assert info["type"] == "quorum"
        assert info["arguments"]["x-single-active-consumer"] is True

        for body in (b"1", b"2", b"3"):
            await channel.default_exchange.publish(
                aio_pika.Message(body=body), routing_key=queue.name
            )
        assert await _receive(queue, 3) == [b"1", b"2", b"3"]

        # The default if_unused=True would make RabbitMQ 3.10 close the whole connection.
        await queue.delete(if_unused=False, if_empty=False)
        assert not connection.is_closed
        await channel.declare_queue("still-usable", exclusive=True)


# ------------------------------------------------------------------------------ Docker


@pytest.mark.docker
@pytest.mark.asyncio
async def test_docker_engine_is_a_swarm_manager(docker_engine: str) -> None:
    async with aiodocker.Docker(url=docker_engine) as docker:
        info = await docker.system.info()
    assert info["Swarm"]["LocalNodeState"] == "active"
    assert info["Swarm"]["ControlAvailable"] is True


@pytest.mark.docker
@pytest.mark.asyncio
async def test_swarm_service_runs_busybox_on_the_host_network(
    docker_engine: str, busybox_image: str
) -> None:
    name = f"swarm-gpu-test-{uuid.uuid4().hex[:10]}"
    async with aiodocker.Docker(url=docker_engine) as docker:
        service = await docker.services.create(
            task_template={
                "ContainerSpec": {
                    "Image": busybox_image,
                    "Command": ["sleep", "30"],
                    # sleep runs as PID 1 and ignores SIGTERM: do not wait 10 s to stop it.
                    "StopGracePeriod": 1_000_000_000,
                },
                "RestartPolicy": {"Condition": "none"},
                "Networks": [{"Target": "host"}],
            },
            name=name,
            labels={"swarm-gpu.test": "infra"},
        )
        try:
            task = await _running_task(docker, name, within=30)
            container_id = task["Status"]["ContainerStatus"]["ContainerID"]
            container = await docker.containers.get(container_id)
            assert container["HostConfig"]["NetworkMode"] == "host"
            assert container["Config"]["Image"] == busybox_image
        finally:
            await docker.services.delete(service["ID"])

        assert name not in {s["Spec"]["Name"] for s in await docker.services.list()}
        # Removal is asynchronous: the swarm stops and removes the container within ~6 s.
        label = f"com.docker.swarm.service.name={name}"
        deadline = asyncio.get_running_loop().time() + 30
        while await docker.containers.list(all=True, filters={"label": [label]}):
            if asyncio.get_running_loop().time() > deadline:
                pytest.fail(f"the container of {name} still exists 30 s after removal")
            await asyncio.sleep(0.2)


async def _running_task(docker: aiodocker.Docker, service: str, within: float) -> dict:
    """The first task of `service` to reach `running`; fails the test after `within` s."""
    deadline = asyncio.get_running_loop().time() + within
    states: list[str] = []
    while asyncio.get_running_loop().time() < deadline:
        tasks = await docker.tasks.list(filters={"service": service})
        states = [f"{t['Status']['State']} {t['Status'].get('Err', '')}".strip() for t in tasks]
        for task in tasks:
            if task["Status"]["State"] == "running":
                return dict(task)
            if task["Status"]["State"] in {"failed", "rejected"}:
                pytest.fail(f"task of {service} did not start: {states}")
        await asyncio.sleep(0.2)
    pytest.fail(f"no running task of {service} within {within} s: {states}")


# ------------------------------------------------------------------------ executables


@pytest.mark.hub
def test_configurable_http_proxy_runs(chp_path: Path) -> None:
    result = subprocess.run(
        [str(chp_path), "--version"], capture_output=True, text=True, timeout=30, check=True
    )
    assert result.stdout.strip().startswith("5.")


@pytest.mark.browser
def test_chromium_runs(chromium_path: Path) -> None:
    result = subprocess.run(
        [str(chromium_path), "--headless", "--no-sandbox", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "Chromium" in result.stdout


def test_ledger_path_is_in_the_test_folder(ledger_path: Path, tmp_path: Path) -> None:
    assert ledger_path == tmp_path / "ledger.sqlite"
    assert not ledger_path.exists()
