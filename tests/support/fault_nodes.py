"""Node agents of the fault tests: their settings, and waiting for a host to be up."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from allocator.amqp.client import AllocatorClient
from nodeagent.config import AgentSettings
from tests.support.common import wait_until


async def host_up(client: AllocatorClient, host: str, within: float = 15.0) -> None:
    async def up():
        return [n for n in (await client.inventory()).nodes if n.host == host and n.up]
    await wait_until(up, within=within)


def agent_settings(host: str, amqp_url: str, inventory: Path, docker_url: str,
                   **overrides: Any) -> AgentSettings:
    values: dict[str, Any] = {
        "host": host, "amqp_url": amqp_url, "inventory": "simulated",
        "simulated_file": inventory, "interval_s": 0.25, "publish_timeout_s": 1.0,
        "amqp_reconnect_s": 0.2, "docker": True, "docker_url": docker_url,
        "docker_backoff_s": 0.1, "docker_backoff_max_s": 0.5, "docker_replay_grace_s": 0.5,
        "docker_timeout_s": 3.0, "xid_poll_s": 0.2,
        # Deltas in between, but a full report well within the 1.5 s that `gpu-ledger check
        # --live` listens (it counts a host once heard in full).
        "full_report_s": 0.5,
    }
    values.update(overrides)
    return AgentSettings(**values)
