"""GPUSwarmSpawner waits for its service's task on the real engine, looking soon and often.

``start_object`` is where SwarmSpawner's start waits for the task to run; the spawner's own
schedule (``task_poll_s``, growing to ``task_poll_max_s``) replaces dockerspawner's 1 s to 11 s.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from types import SimpleNamespace

import aiodocker
import pytest

from hubplugin.spawner import GPUSwarmSpawner
from tests.support.common import docker_cli

pytestmark = [pytest.mark.docker]


def spawner_for(service: str) -> GPUSwarmSpawner:
    user = SimpleNamespace(name="alice", groups=[], url="/user/alice/")
    return GPUSwarmSpawner(user=user, object_name=service, task_poll_s=0.05,
                           task_poll_max_s=0.2)


async def create_service(service: str, image: str, command: str) -> None:
    await docker_cli("service", "create", "--detach", "--name", service, "--network", "host",
                     "--restart-condition", "none", "--constraint", "node.role==manager",
                     image, "sh", "-c", command)


async def task_state(service: str) -> str:
    return await docker_cli("service", "ps", "--format", "{{.CurrentState}}", "--no-trunc",
                            service)


async def test_returns_once_the_task_runs(docker_engine, busybox_image):
    service = f"sgtest-wait-{secrets.token_hex(3)}"
    await create_service(service, busybox_image, "sleep 600")
    try:
        started = time.monotonic()
        await spawner_for(service).start_object()
        assert (await task_state(service)).startswith("Running"), "returned before it ran"
        assert time.monotonic() - started < 60
    finally:
        await docker_cli("service", "rm", service)


async def test_a_task_that_ended_is_an_error(docker_engine, busybox_image):
    service = f"sgtest-wait-{secrets.token_hex(3)}"
    await create_service(service, busybox_image, "exit 0")
    try:
        async with aiodocker.Docker(url=docker_engine) as docker:
            deadline = time.monotonic() + 60
            while "complete" not in str([t["Status"]["State"] for t in
                                         await docker.tasks.list(filters={"service": service})]):
                assert time.monotonic() < deadline, "the task never ended"
                await asyncio.sleep(0.1)
        with pytest.raises(RuntimeError, match="not running"):
            await spawner_for(service).start_object()
    finally:
        await docker_cli("service", "rm", service)
