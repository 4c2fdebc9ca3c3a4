"""``gpu-nodeagent``: run the node agent until SIGTERM or SIGINT.

    gpu-nodeagent [--config FILE] [--host NAME] [--amqp-url URL]
                  [--inventory nvml|simulated] [--simulated-file FILE] [--no-docker]
                  [--no-docker-events] [--interval SECONDS] ... [--log-level LEVEL]
                  [--log-format text|json]
    gpu-nodeagent health [the same options]

Every setting of :class:`~nodeagent.config.AgentSettings` is a flag, made by pydantic-settings
from the field (``interval_s`` is ``--interval-s``, or ``--interval``; a boolean ``docker`` is
``--docker`` / ``--no-docker``; a list is comma separated: ``--command-users a,b``), with the
field's description, default and environment variable as its help
(:func:`allocator.settings_files.setting_help`). Options override the environment
(``SWARM_GPU_AGENT_*``), which overrides the TOML file. Exit status: 0 after a clean stop, 2
when the settings or the inventory cannot work (one line says what to change, e.g.
``--inventory simulated`` on a host without NVIDIA GPUs) or when the ``agent`` extra is not
installed (one line naming it: ``pip install 'swarm-gpu[agent]'``). ``--help`` works
without that extra: it needs only the settings.

``gpu-nodeagent health`` is the stack's healthcheck: it reads the settings as the agent does
(the same options, environment and file) and asks ``GET /healthz`` of the agent on this
machine (``metrics_port``, at ``metrics_addr`` or loopback when that is a wildcard); exit
status 0 when it answers healthy, else 1 with one line on stderr that says what failed. It
needs only the settings, not the ``agent`` extra.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import logging
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic_settings import CliSettingsSource

from allocator.logs import configure_logging
from allocator.metrics.endpoint import ask_health, health_address
from allocator.settings_files import setting_help, settings_error_line
from nodeagent.config import AgentSettings, load_settings
from nodeagent.inventory import InventoryUnavailable

if TYPE_CHECKING:
    from nodeagent.agent import NodeAgent

log = logging.getLogger("nodeagent")

AGENT_EXTRA = "swarm-gpu[agent]"
"""The extra that brings the agent's own dependencies (pyproject.toml)."""

AGENT_EXTRA_MODULES = frozenset({"aiodocker", "aiohttp"})
"""Top-level modules the agent imports that only :data:`AGENT_EXTRA` installs (aiohttp comes
with aiodocker). NVML's ``pynvml`` is loaded only with ``inventory = "nvml"``, and says so
itself."""


class MissingExtra(RuntimeError):
    """The agent's extra is not installed; the message is the one line to print."""


def import_agent() -> type[NodeAgent]:
    """:class:`~nodeagent.agent.NodeAgent`, imported only now: its Docker client is in the
    ``agent`` extra. Raises :class:`MissingExtra` naming the extra when a module of it is
    missing; any other import error is a bug and propagates."""
    try:
        from nodeagent.agent import NodeAgent
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing not in AGENT_EXTRA_MODULES:
            raise
        raise MissingExtra(f"the node agent needs the {missing} package, which the 'agent' "
                           f"extra installs: pip install '{AGENT_EXTRA}'") from None
    return NodeAgent

def _add_setting_flag(parser: Any, *names: str, **options: Any) -> Any:
    """``add_argument`` for the flags of the settings, with the help of each setting."""
    dest = options.get("dest")
    if dest in AgentSettings.model_fields and options.get("help") != argparse.SUPPRESS:
        options["help"] = setting_help(AgentSettings, dest).replace("%", "%%")
    return parser.add_argument(*names, **options)


HEALTH_COMMAND = "health"
"""The first argument that makes ``gpu-nodeagent`` a healthcheck instead of the agent."""


DISTRIBUTION = "swarm-gpu"
"""The installed distribution whose version ``--version`` prints."""


def parse_args(argv: Sequence[str] | None, *, prog: str = "gpu-nodeagent",
               description: str = "swarm-gpu node agent: reports this host's GPUs and lease "
               "containers. 'gpu-nodeagent health [options]' asks the agent running here "
               "whether it is healthy (exit 0) or not (exit 1)."
               ) -> tuple[argparse.Namespace, dict[str, Any]]:
    """The command line: the options that are not settings, and the settings it gives."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    # The release as installed: the agent may not import the allocator's package itself
    # (only the surface modules), and the distribution carries the same version.
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {importlib.metadata.version(DISTRIBUTION)}")
    # The flags' shape (kebab case, --no-X for booleans, short names) is AgentSettings' config;
    # each flag's help is its setting's (description, default, environment variable).
    flags: CliSettingsSource[AgentSettings] = CliSettingsSource(
        AgentSettings, root_parser=parser, add_argument_method=_add_setting_flag)
    args = parser.parse_args(argv)
    return args, flags(parsed_args=args)()


async def run(settings: AgentSettings) -> int:
    """Run an agent until SIGTERM/SIGINT; the exit status."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    agent = import_agent()(settings)
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


def health(argv: Sequence[str]) -> int:
    """``gpu-nodeagent health``: 0 if the agent's ``/healthz`` answers healthy, else 1."""
    _, given = parse_args(
        argv, prog="gpu-nodeagent health",
        description="Ask GET /healthz of the node agent on this machine (its metrics_port, "
        "read from the same options, environment and file as the agent): exit 0 when "
        "healthy, else 1 with one line on stderr saying what failed. Swarm's healthcheck "
        "runs it.")
    try:
        # No broker is asked, so its TLS files are left out: the URL they go with may exist
        # only in the agent's own environment (compose/stack.yml's start command makes it,
        # with the password), and a CA file beside the default amqp:// URL would be refused.
        settings = AgentSettings(**{key: value for key, value in given.items()
                                    if value is not None},
                                 amqp_ca_file=None, amqp_cert_file=None, amqp_key_file=None)
    except (OSError, ValueError) as exc:  # ValueError: pydantic's and TOML's errors
        print(f"gpu-nodeagent: invalid settings: {settings_error_line(exc)}", file=sys.stderr)
        return 1
    if not settings.metrics_port:
        print("gpu-nodeagent: metrics_port is 0, so the agent serves no /healthz to ask: "
              "set metrics_port (SWARM_GPU_AGENT_METRICS_PORT)", file=sys.stderr)
        return 1
    failure = ask_health(health_address(settings.metrics_addr), settings.metrics_port)
    if failure is not None:
        print(f"gpu-nodeagent: {failure}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Console script entry point."""
    arguments = sys.argv[1:] if argv is None else list(argv)
    if arguments[:1] == [HEALTH_COMMAND]:
        return health(arguments[1:])
    _, given = parse_args(arguments)
    try:
        settings = load_settings(**given)
    except (OSError, ValueError) as exc:  # ValueError: pydantic's and TOML's errors
        print(f"gpu-nodeagent: invalid settings: {settings_error_line(exc)}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    try:
        import_agent()  # before the event loop: a missing extra is one line, not a traceback
    except MissingExtra as exc:
        print(f"gpu-nodeagent: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(run(settings))


if __name__ == "__main__":
    sys.exit(main())
