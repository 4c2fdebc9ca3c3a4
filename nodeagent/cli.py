"""``gpu-nodeagent``: run the node agent until SIGTERM or SIGINT.

    gpu-nodeagent [--config FILE] [--host NAME] [--amqp-url URL]
                  [--inventory nvml|simulated] [--simulated-file FILE] [--no-docker]
                  [--no-docker-events]

Options override the environment (``SWARM_GPU_AGENT_*``), which overrides the TOML file.
Exit status: 0 after a clean stop, 2 when the settings or the inventory cannot work (the
message says what to change, e.g. ``--inventory simulated`` on a host without NVIDIA GPUs).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from pydantic import ValidationError

from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings, load_settings
from nodeagent.inventory import InventoryUnavailable

log = logging.getLogger("nodeagent")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line."""
    parser = argparse.ArgumentParser(
        prog="gpu-nodeagent",
        description="swarm-gpu node agent: reports this host's GPUs and lease containers.",
    )
    parser.add_argument("--config", help="TOML settings file (default: $SWARM_GPU_AGENT_CONFIG)")
    parser.add_argument("--host", help="node name (default: the Docker engine's node name)")
    parser.add_argument("--amqp-url", help="broker URL; its user is sent as user_id")
    parser.add_argument("--inventory", choices=["nvml", "simulated"],
                        help="GPU source (default nvml)")
    parser.add_argument("--simulated-file", help="simulated inventory JSON (with --inventory "
                        "simulated)")
    parser.add_argument("--interval", type=float, dest="interval_s", help="heartbeat seconds")
    parser.add_argument("--docker-url", help="Docker engine endpoint (default $DOCKER_HOST)")
    parser.add_argument("--no-docker", action="store_false", dest="docker", default=None,
                        help="do not watch containers (heartbeats then say "
                        "containers_complete=false)")
    parser.add_argument("--no-docker-events", action="store_false", dest="docker_events",
                        default=None, help="do not follow Docker's event stream: re-list the "
                        "containers before every heartbeat instead (deaths are then noticed "
                        "by heartbeat reconciliation only)")
    parser.add_argument("--no-stop-commands", action="store_false", dest="stop_commands",
                        default=None, help="ignore the allocator's stop commands (a released "
                        "server's GPU then waits until Swarm stops its container)")
    parser.add_argument("--command-users", metavar="USER,...",
                        help="broker users whose stop commands are carried out "
                        "(default: allocator)")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    return parser.parse_args(argv)


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
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    overrides = {
        "host": args.host,
        "amqp_url": args.amqp_url,
        "inventory": args.inventory,
        "simulated_file": args.simulated_file,
        "interval_s": args.interval_s,
        "docker_url": args.docker_url,
        "docker": args.docker,
        "docker_events": args.docker_events,
        "stop_commands": args.stop_commands,
        "command_users": args.command_users,
    }
    try:
        settings = load_settings(args.config, **overrides)
    except (ValidationError, OSError, ValueError) as exc:
        print(f"gpu-nodeagent: bad settings: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(run(settings))


if __name__ == "__main__":
    sys.exit(main())
