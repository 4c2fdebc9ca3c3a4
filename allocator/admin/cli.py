"""``gpu-allocator``: run the allocator, or ask it for GPUs from a shell.

    gpu-allocator serve [--config allocator.toml]
    gpu-allocator health [--config allocator.toml]
    gpu-allocator ask --user alice --model 1070 [--count 2 | --count all] [--host gpu-a]
                      [--share 4096] [--wait 60]
    gpu-allocator release LEASE_ID
    gpu-allocator inventory
    gpu-allocator leases [--user alice] [--finished 3600]

Settings come from ``SWARM_GPU_*`` environment variables over the TOML file
(``gpu-allocator serve --help`` lists them all, from :class:`allocator.config.AllocatorSettings`);
a start that cannot work (bad settings, a broker that cannot be reached or refuses the user or
the vhost, an unreadable ledger) exits with status 1 and one line that says what to fix. The
client commands log as ``SWARM_GPU_LOG_LEVEL`` and ``SWARM_GPU_LOG_FORMAT`` say (their broker
libraries only warnings, unless ``-v``), and take ``--amqp``, ``SWARM_GPU_AMQP_URL`` or, to
keep the broker password out of the environment and the command line,
``SWARM_GPU_AMQP_URL_FILE`` (a file holding the URL); none of them is an error naming them.
``-v`` may come before or after the command. ``serve`` stops on SIGTERM or SIGINT at any
stage, the wait for the broker at start included (exit status 0).

``gpu-allocator health`` is the stack's healthcheck: it reads the settings as ``serve`` does
and asks ``GET /healthz`` of the allocator on this machine (``metrics_port``); exit status 0
when it answers healthy, else 1 with one line on stderr that says what failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import sqlite3
import sys
import textwrap
from collections.abc import Sequence

from pydantic import ValidationError

from allocator import __version__
from allocator.amqp import broker
from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.config import AllocatorSettings, ConfigurationError, load_settings
from allocator.ledger.store import LedgerError
from allocator.logs import (
    add_verbose_flag,
    configure_logging,
    log_settings_from_environment,
    quiet_libraries,
)
from allocator.metrics.endpoint import ask_health
from allocator.settings_files import environ_secret, settings_error_line, settings_help
from allocator.tasks import cancel_and_wait
from allocator.wire.protocol import AllocateRequest, Lease, ShareRequest

EXIT_INTERRUPTED = 130
"""Ctrl-C outside ``serve``'s own handling (the shell's 128 + SIGINT)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpu-allocator", description=__doc__.split("\n")[0])
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", help="run the allocator until SIGTERM",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill(
            "Run the allocator until SIGTERM. Its settings, below, are the keys of the TOML "
            "file (--config), each overridden by its environment variable; a dict or list "
            "setting is JSON in the environment. docs/operations.md has examples.",
            width=_help_width()),
        epilog="settings:\n" + settings_help(AllocatorSettings, width=_help_width()))
    serve.add_argument("--config", help="TOML settings file (default: $SWARM_GPU_CONFIG)")
    serve.add_argument("--ledger", help="ledger file (overrides the settings)")

    health = commands.add_parser(
        "health", help="exit 0 if the allocator on this machine is healthy, else 1",
        description="Ask GET /healthz of the allocator on this machine (its metrics_port, "
        "read from the settings as serve reads them): exit 0 when healthy, else 1 with one "
        "line on stderr saying what failed. Swarm's healthcheck runs it.")
    health.add_argument("--config", help="TOML settings file (default: $SWARM_GPU_CONFIG)")
    health.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for "
                        "the answer (default: 5)")

    def client_options(sub: argparse.ArgumentParser) -> None:
        # None: from the environment (read in main, so that a bad file is one error line)
        sub.add_argument("--amqp", default=None,
                         help="broker URL (default: $SWARM_GPU_AMQP_URL, or the content of "
                              "$SWARM_GPU_AMQP_URL_FILE)")
        broker.add_tls_arguments(sub)
        sub.add_argument("--timeout", type=float, default=10.0, help="seconds per call")
        sub.add_argument("--json", action="store_true", help="print the raw reply as JSON")

    ask = commands.add_parser("ask", help="allocate GPUs and print the lease")
    client_options(ask)
    ask.add_argument("--user", required=True)
    ask.add_argument("--server", default="", help="server name (part of the request key)")
    ask.add_argument("--key", help="request key (default: cli/<user>/<server>)")
    ask.add_argument("--group", action="append", default=[], dest="groups")
    ask.add_argument("--model", action="append", help="model or alias; repeat for a list")
    ask.add_argument("--count", default="1", help='a number, or "all"')
    ask.add_argument("--host")
    ask.add_argument("--min-memory", type=int, help="MiB")
    ask.add_argument("--share", type=int, metavar="MIB", help="a shared slice with this budget")
    ask.add_argument("--wait", type=float, default=0.0, help="seconds to wait in the queue")

    release = commands.add_parser("release", help="release a lease")
    client_options(release)
    release.add_argument("lease_id")
    release.add_argument("--force", action="store_true", help="free at once (admins)")
    release.add_argument("--reason", default="")

    inventory = commands.add_parser("inventory", help="print free and total GPUs per model")
    client_options(inventory)

    leases = commands.add_parser(
        "leases", help="list leases: borrowed, idle, pending reclaim warnings")
    client_options(leases)
    leases.add_argument("--user", help="only this user's leases (default: everyone's)")
    leases.add_argument("--finished", type=float, default=0.0, metavar="S",
                        help="also the leases that ended within S seconds")
    add_verbose_flag(parser, "debug logging (overrides the log_level setting); before or "
                     "after the command")
    return parser


def _help_width() -> int:
    """Columns for the settings in ``--help``: the terminal's, as argparse's own text."""
    return max(min(shutil.get_terminal_size().columns - 2, 100), 40)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``gpu-allocator``."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            return asyncio.run(_serve(args))
        if args.command == "health":
            return _health(args)
        logs = log_settings_from_environment("SWARM_GPU_")
        configure_logging("DEBUG" if args.verbose else logs.log_level, logs.log_format)
        quiet_libraries(args.verbose)
        if args.amqp is None:
            try:
                args.amqp = environ_secret("SWARM_GPU_AMQP_URL")
            except ValueError as exc:  # both set, or a file that cannot be read
                print(f"gpu-allocator: {exc}", file=sys.stderr)
                return 1
            if args.amqp is None:
                print("gpu-allocator: no broker named: give --amqp URL or set "
                      "SWARM_GPU_AMQP_URL or SWARM_GPU_AMQP_URL_FILE (a file holding the URL)",
                      file=sys.stderr)
                return 1
        try:
            args.amqp = broker.url_with_tls_arguments(args.amqp, args)
        except ValueError as exc:  # a TLS file for a plain amqp:// URL
            print(f"gpu-allocator: {exc}", file=sys.stderr)
            return 1
        return asyncio.run(_client_command(args))
    except (AllocatorError, LedgerError, ValidationError, ConfigurationError, OSError) as exc:
        print(f"gpu-allocator: {_one_line(exc)}", file=sys.stderr)
        return 1
    except sqlite3.Error as exc:
        # The ledger turns SQLite's errors into LedgerError at open; one that escapes still
        # gets one line that names it rather than a traceback.
        print(f"gpu-allocator: ledger error: {_one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Ctrl-C outside the event loop's own handler (reading the settings, a client call)
        print("gpu-allocator: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _one_line(exc: Exception) -> str:
    if isinstance(exc, AllocatorError):
        return f"{exc.code.value}: {exc.message}"
    if isinstance(exc, ValidationError):
        return f"invalid settings: {settings_error_line(exc)}"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _health(args: argparse.Namespace) -> int:
    """``gpu-allocator health``: 0 if the allocator's ``/healthz`` answers healthy, else 1."""
    try:
        # No broker is asked, so its TLS files are left out: the URL they go with may exist
        # only in serve's own environment (compose/stack.yml's start command makes it, with
        # the password), and a CA file beside the default amqp:// URL would be refused.
        settings = load_settings(args.config, amqp_ca_file=None, amqp_cert_file=None,
                                 amqp_key_file=None)
    except (OSError, ValueError) as exc:  # ValueError: pydantic's and TOML's errors
        print(f"gpu-allocator: invalid settings: {settings_error_line(exc)}", file=sys.stderr)
        return 1
    if settings.metrics_port is None:
        print("gpu-allocator: metrics_port is not set, so the allocator serves no /healthz "
              "to ask: set metrics_port (SWARM_GPU_METRICS_PORT)", file=sys.stderr)
        return 1
    # The allocator binds its metrics port on every address: loopback reaches it.
    failure = ask_health("127.0.0.1", settings.metrics_port, timeout_s=args.timeout)
    if failure is not None:
        print(f"gpu-allocator: {failure}", file=sys.stderr)
        return 1
    return 0


async def _serve(args: argparse.Namespace) -> int:
    from allocator.service import AllocatorService

    overrides = {"ledger_path": args.ledger} if args.ledger else {}
    try:
        settings = load_settings(args.config, **overrides)
    except (OSError, ValueError) as exc:  # ValueError: pydantic's and TOML's errors
        print(f"gpu-allocator: invalid settings: {settings_error_line(exc)}", file=sys.stderr)
        return 1
    configure_logging("DEBUG" if args.verbose else settings.log_level, settings.log_format)
    service = AllocatorService(settings, freeze_heap=True)
    stop = asyncio.Event()
    signals: list[str] = []

    def on_signal(name: str) -> None:
        signals.append(name)
        stop.set()

    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signal.Signals(signum).name)
    # A signal counts at every stage, the start included: waiting for the broker may last
    # broker_wait_s, and an admin's Ctrl-C or Swarm's SIGTERM must not wait that out.
    stopping = asyncio.create_task(stop.wait(), name="allocator-signal")
    starting = asyncio.create_task(service.start(), name="allocator-start")
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            await cancel_and_wait([starting])
            print(f"gpu-allocator: {signals[0]} before the start was complete: stopped",
                  file=sys.stderr)
            return 0
        start_error = starting.exception()
        if isinstance(start_error, broker.START_ERRORS):
            failure = broker.start_failure(start_error, settings.amqp_url, role="allocator",
                                           broker_wait_s=settings.broker_wait_s)
            print(f"gpu-allocator: {failure}", file=sys.stderr)
            return 1
        starting.result()  # any other error of the start is raised as it was
        failing = asyncio.create_task(service.failed.wait())
        await asyncio.wait({stopping, failing}, return_when=asyncio.FIRST_COMPLETED)
        failing.cancel()
    finally:
        stopping.cancel()
        with contextlib.suppress(Exception):
            await service.stop()
    if service.failure is not None:
        print(f"gpu-allocator: {service.failure}", file=sys.stderr)
        return 1
    return 0


async def _client_command(args: argparse.Namespace) -> int:
    async with AllocatorClient(args.amqp, timeout_s=args.timeout) as client:
        if args.command == "inventory":
            inventory = await client.inventory()
            if args.json:
                print(inventory.model_dump_json(indent=2))
                return 0
            for model in inventory.models:
                hosts = ", ".join(f"{h}: {n}" for h, n in sorted(model.hosts.items()) if n)
                slots = f", {model.free_slots} free slices" if model.share_slots > 1 else ""
                print(f"{model.model}: {model.free}/{model.total} free{slots}"
                      f"{' (' + hosts + ')' if hosts else ''}")
            print(f"{len(inventory.nodes)} nodes, {inventory.queued} queued requests")
            return 0
        if args.command == "leases":
            reply = await client.leases(args.user, include_finished_s=args.finished)
            if args.json:
                print(reply.model_dump_json(indent=2))
                return 0
            for lease in reply.leases:
                print(_lease_line(lease, reply.at))
            return 0
        if args.command == "release":
            lease = await client.release(lease_id=args.lease_id, force=args.force,
                                         reason=args.reason, by=f"cli:{os.environ.get('USER', '')}")
            print(lease.model_dump_json(indent=2) if args.json
                  else f"lease {lease.lease_id}: {lease.state.value}")
            return 0
        models = args.model or []
        count: int | str = "all" if args.count == "all" else int(args.count)
        request = AllocateRequest(
            request_key=args.key or f"cli/{args.user}/{args.server}", user=args.user,
            groups=args.groups, model=models[0] if len(models) == 1 else None,
            models=models if len(models) > 1 else None, count=count, host=args.host,
            min_memory_mib=args.min_memory, wait_s=args.wait,
            share=ShareRequest(memory_mib=args.share) if args.share else None,
        )
        shown: list[int | None] = []

        def on_queued(queued: Lease) -> None:
            if queued.queue_position not in shown[-1:]:
                shown.append(queued.queue_position)
                print(f"queued at position {queued.queue_position}; waiting up to "
                      f"{args.wait:g} s", file=sys.stderr)

        lease = await client.allocate_and_wait(request, on_queued=on_queued)
        if args.json:
            print(lease.model_dump_json(indent=2))
        else:
            print(json.dumps({"lease_id": lease.lease_id, "host": lease.host,
                              "model": lease.model, "gpus": lease.gpu_uuids,
                              "borrowed": lease.borrowed, "env": lease.env}, indent=2))
        return 0


def _lease_line(lease: Lease, now: float) -> str:
    """One lease in a line: who, what, and what fair share says about it."""
    parts = [lease.lease_id[:12], lease.user, lease.state.value]
    if lease.host:
        parts.append(f"{lease.host}:{','.join(str(i) for i in lease.gpu_indices)}")
    if lease.model:
        parts.append(lease.model)
    if lease.queue_position is not None:
        parts.append(f"queue position {lease.queue_position}")
    if lease.state.holds_gpus:
        parts.append("borrowed" if lease.borrowed else "guaranteed")
    if lease.idle_since is not None:
        parts.append(f"idle {now - lease.idle_since:.0f} s")
    if lease.reclaim_at is not None and lease.reclaim_reason is not None:
        parts.append(f"{lease.reclaim_reason.value} in {max(lease.reclaim_at - now, 0):.0f} s")
    if lease.release_reason is not None:
        parts.append(f"ended: {lease.release_reason.value}")
    return "  ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
