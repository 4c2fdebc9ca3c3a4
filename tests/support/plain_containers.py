"""Containers run on the real Docker engine without Swarm, removed afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from tests.support.common import LabelledDocker

TRAP_TERM = 'trap "exit 0" TERM; while true; do sleep 0.1; done'
"""Exits at once on SIGTERM (a shell as PID 1 ignores SIGTERM without a trap)."""


class PlainContainers(LabelledDocker):
    """Lease-labelled containers of one image that exit at once on SIGTERM."""

    def __init__(self, url: str, image: str) -> None:
        super().__init__(url)
        self.image = image

    async def run_labelled(self, label: str) -> str:
        return await self.start_labelled(label, self.image, ["sh", "-c", TRAP_TERM],
                                         prefix="stop")


@contextlib.asynccontextmanager
async def plain_containers(docker_engine: str, image: str) -> AsyncIterator[PlainContainers]:
    """Starts plain containers with a lease label; removes them afterwards."""
    docker = PlainContainers(docker_engine, image)
    try:
        yield docker
    finally:
        await docker.close()
