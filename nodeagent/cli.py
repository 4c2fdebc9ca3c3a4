"""``gpu-nodeagent``: run the node agent until SIGTERM or SIGINT.

    gpu-nodeagent [--config FILE] [--host NAME] [--amqp-url URL]
                  [--inventory nvml|simulated] [--simulated-file FILE] [--no-docker]
                  [--no-docker-events] [--interval SECONDS] ... [--log-level LEVEL]

Every setting of :class:`~nodeagent.config.AgentSettings` is a flag, made by pydantic-settings
from the field (``interval_s`` is ``--interval-s``, or ``--interval``; a boolean ``docker`` is
``--docker`` / ``--no-docker``; a list is comma separated: ``--command-users a,b``), with the
field's description as its help. Options override the environment (``SWARM_GPU_AGENT_*``),
which overrides the TOML file. Exit status: 0 after a clean stop, 2 when the settings or the
inventory cannot work (one line says what to change, e.g. ``--inventory simulated`` on a host
without NVIDIA GPUs).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from pydantic_settings import CliSettingsSource

from allocator.settings_files import settings_error_line
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings, load_settings
from nodeagent.inventory import InventoryUnavailable

log = logging.getLogger("nodeagent")

def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, dict[str, Any]]:
    """The command line: the options that are not settings, and the settings it gives."""
    parser = argparse.ArgumentParser(
        prog="gpu-nodeagent",
        description="swarm-gpu node agent: reports this host's GPUs and lease containers.",
    )
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    # The flags' shape (kebab case, --no-X for booleans, short names) is AgentSettings' config.
    flags: CliSettingsSource[AgentSettings] = CliSettingsSource(AgentSettings, root_parser=parser)
    args = parser.parse_args(argv)
    return args, flags(parsed_args=args)()


async def run(settings: AgentSettings) -> int:
    """Run an agent until SIGTERM/SIGINT; the exit status."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    agent = NodeAgent(settings)
    try:
        await agent.start()
    except InventoryUnavailable as exc:
        log.error("%s", exc)
        await agent.stop()
        return 2
    try:
        await stop.wait()
        log.info("signal received: stopping")
    finally:
        await agent.stop()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Console script entry point."""
    args, given = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        settings = load_settings(**given)
    except (OSError, ValueError) as exc:  # ValueError: pydantic's and TOML's errors
        print(f"gpu-nodeagent: invalid settings: {settings_error_line(exc)}", file=sys.stderr)
        return 2
    return asyncio.run(run(settings))


if __name__ == "__main__":
    sys.exit(main())
