"""``gpu-ledger``: see, account for and administer the GPU cluster.

    gpu-ledger status   [--ledger FILE | --amqp URL] [--json]
    gpu-ledger status   --topology HOST [--amqp URL] [--json]   (the running allocator only)
    gpu-ledger export   leases|events|gpus|usage [--ledger FILE] [--format csv|json|ndjson]
                        [--since T] [--until T] [--user U] [--model M] [--host H]
                        [--by user|group|host] [--output FILE]
    gpu-ledger usage    [--ledger FILE] [--from T] [--to T] [--by user|group|model|host]
                        [--format table|csv|json] [--config FILE] [--right-size]
    gpu-ledger fairshare [--ledger FILE] [--half-life H] [--at T] [--json]
    gpu-ledger drain    HOST [--gpu UUID] [--reason TEXT]          (over RPC, admins)
    gpu-ledger undrain  HOST [--gpu UUID]
    gpu-ledger release  LEASE_ID [--force --reason TEXT]
    gpu-ledger booking  add|list|remove ...                   (over RPC, admins)
    gpu-ledger check    [--ledger FILE] [--live --amqp URL]
    gpu-ledger backup   PATH [--ledger FILE] [--force]        (while the allocator runs)
    gpu-ledger restore  BACKUP [--ledger FILE] [--new-log]    (with the allocator stopped)

Reading commands open the ledger read-only (``--ledger``, default ``$SWARM_GPU_LEDGER_PATH``);
in WAL mode that works while the allocator runs and never disturbs it. Admin actions and the
live status go through the running allocator (``--amqp``, default ``$SWARM_GPU_AMQP_URL`` or
the content of the file ``$SWARM_GPU_AMQP_URL_FILE`` names; none of them is an error that
says so, never a guess at a broker), which records who did what and why. ``-v`` (before or
after the command) logs what the broker client does. Times (``T``) are ISO 8601 (UTC unless
an offset is given), epoch seconds, or ``now``. ``backup`` reads the ledger as the reading
commands do; ``restore`` replaces it, and refuses while an allocator has it open.

Exit status: 0 done, 1 ``check`` found violations, 2 an error (one line on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import json
import logging
import os
import sqlite3
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn, TextIO

import aio_pika
from pydantic import ValidationError
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from allocator import __version__
from allocator.admin import booking_cli, exports, reports, showback
from allocator.admin.fairshare_report import fairshare
from allocator.admin.status import ClusterStatus, SlotHolder, ledger_status, live_status
from allocator.amqp import broker
from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.config import load_settings
from allocator.ledger import backup
from allocator.ledger.invariants import NodeReport, Violation, check_ledger
from allocator.ledger.log_position import LogPosition
from allocator.ledger.readonly import ledger_error, open_readonly
from allocator.ledger.store import LedgerError
from allocator.logs import (
    add_verbose_flag,
    configure_logging,
    log_settings_from_environment,
    quiet_libraries,
)
from allocator.settings_files import environ_secret, settings_error_line
from allocator.wire.heartbeat_delta import apply_delta
from allocator.wire.interconnect import HostInterconnect, matrix_lines
from allocator.wire.protocol import NODE_MESSAGE_ADAPTER, READ_EXTRA, Heartbeat, HeartbeatDelta
from allocator.wire.topology import NODES_EXCHANGE

PROG = "gpu-ledger"
EXIT_OK, EXIT_VIOLATIONS, EXIT_ERROR = 0, 1, 2


class CommandError(Exception):
    """A problem to report in one line (bad input, unreachable allocator...)."""


# --------------------------------------------------------------------------- arguments


def _time_arg(text: str) -> float:
    try:
        return reports.parse_time(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="See, account for and administer the swarm-gpu cluster.",
        epilog="Times are ISO 8601 (UTC unless an offset is given), epoch seconds, or 'now'.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def ledger_option(sub: argparse.ArgumentParser, group: Any = None) -> None:
        (group or sub).add_argument(
            "--ledger", type=Path,
            default=None if group else (os.environ.get("SWARM_GPU_LEDGER_PATH") or None),
            help="ledger file, opened read-only (default: $SWARM_GPU_LEDGER_PATH)")
        sub.add_argument("--busy-timeout", type=float, default=5.0, metavar="S",
                         help="how long to wait for a ledger another process locked")

    def amqp_option(sub: argparse.ArgumentParser, group: Any = None) -> None:
        # None: $SWARM_GPU_AMQP_URL (env_amqp), else an error saying how to name the broker
        (group or sub).add_argument(
            "--amqp", default=None, metavar="URL",
            help="broker URL of the running allocator (default: $SWARM_GPU_AMQP_URL)")
        sub.add_argument("--timeout", type=float, default=10.0, metavar="S",
                         help="seconds to wait for the allocator")
        broker.add_tls_arguments(sub)

    def filter_options(sub: argparse.ArgumentParser, *, aliases: bool = False) -> None:
        since, until = (("--since", "--from"), ("--until", "--to")) if aliases else (
            ("--since",), ("--until",))
        sub.add_argument(*since, type=_time_arg, metavar="T", dest="since",
                         help="start of the period")
        sub.add_argument(*until, type=_time_arg, metavar="T", dest="until",
                         help="end of the period (exclusive; default now)")
        sub.add_argument("--user", help="only this user")
        sub.add_argument("--model", help="only models containing this (e.g. 1070)")
        sub.add_argument("--host", help="only this host")

    # $SWARM_GPU_AMQP_URL, or the file $SWARM_GPU_AMQP_URL_FILE names (ValueError: main)
    env_amqp = environ_secret("SWARM_GPU_AMQP_URL")
    # read once: the file may be a pipe (docker exec -i ... SWARM_GPU_AMQP_URL_FILE=/dev/stdin)
    parser.set_defaults(env_amqp=env_amqp)
    status = commands.add_parser(
        "status", help="hosts, GPUs, holders and the queue",
        description="From the ledger file (--ledger, or $SWARM_GPU_LEDGER_PATH) or from the "
                    "running allocator (--amqp, or $SWARM_GPU_AMQP_URL when no ledger is named).")
    source = status.add_mutually_exclusive_group()
    ledger_option(status, source)
    amqp_option(status, source)
    status.add_argument("--down-after", type=float, default=15.0, metavar="S",
                        help="offline: a node silent this long is down (default 15)")
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")
    status.add_argument(
        "--topology", metavar="HOST",
        help="print how HOST's GPUs are joined, as nvidia-smi topo -m does (from the running "
             "allocator only: the ledger file does not keep it)")

    export = commands.add_parser("export", help="stream leases, events, GPUs or usage")
    export.add_argument("kind", choices=reports.EXPORT_KINDS)
    ledger_option(export)
    filter_options(export)
    export.add_argument("--format", choices=exports.FORMATS, default="csv")
    export.add_argument("--by", choices=("user", "group", "host"), default="user",
                        help="usage: per user, group or host (default user)")
    export.add_argument("--output", "-o", type=Path, metavar="FILE",
                        help="write here (appears only when complete); default stdout")
    export.add_argument("--time-format", choices=("iso", "epoch"), default="iso")
    export.add_argument("--no-progress", action="store_true", help="no progress bar")

    usage = commands.add_parser(
        "usage", help="GPU-hours held and used, kWh, peak memory (and cost) per user, group, "
                      "model or host",
        description="Showback from the ledger: per row GPU-hours held, GPU-hours really used "
                    "(measured SM time), idle share, kWh and peak memory; with prices in the "
                    "settings (price_per_gpu_hour, price_per_kwh; --config), their cost.")
    ledger_option(usage)
    filter_options(usage, aliases=True)
    usage.add_argument("--by", choices=("user", "group", "model", "host"), default="user")
    usage.add_argument("--format", choices=("table", "csv", "json"), default="table",
                       dest="output_format")
    usage.add_argument("--json", action="store_true", help="the same as --format json")
    usage.add_argument("--config", default=os.environ.get("SWARM_GPU_CONFIG") or None,
                       help="the allocator's TOML settings, for the prices (default: "
                            "$SWARM_GPU_CONFIG; none: no cost)")
    usage.add_argument("--right-size", action="store_true",
                       help="list the slices whose peak memory stayed under half their "
                            "budget, with the budget that would have fit (suggestions only)")

    share = commands.add_parser(
        "fairshare", help="each user's and group's decayed usage (as Slurm's sshare)",
        description="The decayed usage fair share orders by (usage_half_life_h), from the "
                    "ledger file: least recent use first.")
    ledger_option(share)
    share.add_argument(
        "--half-life", type=float, metavar="H",
        help="half-life in hours (default: $SWARM_GPU_USAGE_HALF_LIFE_H, the allocator's "
             "usage_half_life_h)")
    share.add_argument("--at", type=_time_arg, metavar="T", help="as of (default now)")
    share.add_argument("--json", action="store_true", help="print JSON instead of tables")

    for name, what in (("drain", "stop placing on a host (or one GPU)"),
                       ("undrain", "place on a drained host (or GPU) again")):
        sub = commands.add_parser(name, help=what)
        sub.add_argument("host")
        sub.add_argument("--gpu", metavar="UUID", help="only this GPU of the host")
        sub.add_argument("--reason", default="", help="recorded in the ledger")
        sub.add_argument("--by", default=None, help="who (default: your login name)")
        amqp_option(sub)

    release = commands.add_parser("release", help="release a lease (--force: at once)")
    release.add_argument("lease_id")
    release.add_argument("--force", action="store_true",
                         help="free the GPUs now, even while the container runs (admins)")
    release.add_argument("--reason", default="", help="why (required with --force)")
    release.add_argument("--by", default=None, help="who (default: your login name)")
    amqp_option(release)

    booking_cli.add_booking_commands(commands, amqp_option)

    check = commands.add_parser("check", help="verify the ledger's invariants")
    ledger_option(check)
    amqp_option(check)
    check.add_argument("--live", action="store_true",
                       help="also compare bound leases with the containers the nodes report "
                            "(listens to their heartbeats on the broker)")
    check.add_argument("--listen", type=float, default=25.0, metavar="S",
                       help="with --live: how long to collect heartbeats (default 25: longer "
                       "than the agents' full_report_s, so every live node is heard in full)")
    check.add_argument("--grace", type=float, default=5.0, metavar="S",
                       help="with --live: ignore leases bound or released this recently")
    check.add_argument("--json", action="store_true", help="print violations as JSON")

    take = commands.add_parser(
        "backup", help="copy the ledger, consistent, while the allocator writes",
        description="SQLite's online backup of the ledger into PATH (a file, or a folder for "
                    "ledger-<UTC time>.sqlite: one that exists, or a path ending in / that is "
                    "made), as of one commit, with its ledger log position; readable by its "
                    "owner only (mode 0600).")
    # str, not Path: Path drops the trailing "/" that says PATH is a folder
    take.add_argument("path", metavar="PATH")
    ledger_option(take)
    take.add_argument("--force", action="store_true", help="replace PATH if it exists")

    back = commands.add_parser(
        "restore", help="replace the ledger with a backup (the allocator stopped)",
        description="Replace the ledger with a copy of BACKUP. Refused while an allocator has "
                    "the ledger open; the replaced ledger is kept beside it.")
    back.add_argument("backup", type=Path, metavar="BACKUP")
    back.add_argument(
        "--ledger", type=Path, default=os.environ.get("SWARM_GPU_LEDGER_PATH") or None,
        help="the ledger to replace (default: $SWARM_GPU_LEDGER_PATH)")
    back.add_argument(
        "--new-log", action="store_true",
        help="with the replicated ledger log: clear the backup's log position, because the "
             "log it belongs to is lost (the allocator then starts a new log from this "
             "ledger); default: keep it, and the allocator catches up from there")
    add_verbose_flag(parser, "log what the broker client does (to stderr); before or after "
                     "the command")
    return parser


# --------------------------------------------------------------------------- helpers


def _console(file: TextIO | None = None) -> Console:
    out = file or sys.stdout
    # Wide when not a terminal, so piped tables are not wrapped into unreadable columns.
    return Console(file=out, width=None if out.isatty() else 200, soft_wrap=False)


def _fail(message: str) -> NoReturn:
    raise CommandError(message)


def _ledger_path(args: argparse.Namespace) -> Path:
    if args.ledger is None:
        _fail("no ledger: give --ledger FILE or set SWARM_GPU_LEDGER_PATH")
    return Path(args.ledger)


@contextlib.contextmanager
def _open_ledger(args: argparse.Namespace) -> Iterator[sqlite3.Connection]:
    path = _ledger_path(args)
    conn = open_readonly(path, busy_timeout_s=args.busy_timeout)
    try:
        yield conn
    except sqlite3.Error as exc:
        raise ledger_error(path, exc) from exc
    finally:
        conn.close()


def _when(epoch: float | None, now: float) -> str:
    if epoch is None:
        return "never"
    ago = now - epoch
    stamp = reports.iso(epoch) or ""
    if ago < 0:
        return stamp
    if ago < 120:
        return f"{stamp} ({ago:.0f} s ago)"
    if ago < 7200:
        return f"{stamp} ({ago / 60:.0f} min ago)"
    return f"{stamp} ({ago / 3600:.1f} h ago)"


def _run_async(factory: Callable[[], Any]) -> Any:
    return asyncio.run(factory())


# --------------------------------------------------------------------------- status


def cmd_status(args: argparse.Namespace) -> int:
    """Print hosts, GPUs with their holders, and the queue; or one host's topology."""
    if args.topology is not None:
        return _print_topology(args)
    if args.amqp is None and args.ledger is None and os.environ.get("SWARM_GPU_LEDGER_PATH"):
        args.ledger = Path(os.environ["SWARM_GPU_LEDGER_PATH"])
    if args.ledger is None:
        if not (args.amqp or args.env_amqp):
            _fail("nothing to read the status from: for the ledger file give --ledger FILE or "
                  "set SWARM_GPU_LEDGER_PATH; for the running allocator give --amqp URL or set "
                  f"SWARM_GPU_AMQP_URL {NO_BROKER_HOW}")
        url = _broker_url(args)
        status = _run_async(lambda: _live_status(url, args.timeout))
    else:
        with _open_ledger(args) as conn:
            status = ledger_status(conn, now=time.time(), down_after_s=args.down_after)
    if args.json:
        json.dump(status.to_json(), sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
        return EXIT_OK
    render_status(status, _console())
    return EXIT_OK


NO_BROKER_HOW = "or SWARM_GPU_AMQP_URL_FILE (a file holding the URL)"


def _broker_url(args: argparse.Namespace) -> str:
    """The running allocator's broker URL: ``--amqp``, else the environment's, with the TLS
    options. None given is an error that says how to give one: trying RabbitMQ's default
    user on this machine would answer an admin with a refused login, or with another
    broker's cluster."""
    url = args.amqp or args.env_amqp
    if not url:
        _fail(f"no broker named: give --amqp URL or set SWARM_GPU_AMQP_URL {NO_BROKER_HOW}")
    return _with_tls(url, args)


def _with_tls(url: str, args: argparse.Namespace) -> str:
    """``url`` with the TLS options (:func:`allocator.amqp.broker.url_with_tls_arguments`)."""
    try:
        return broker.url_with_tls_arguments(url, args)
    except ValueError as exc:  # a TLS file for a plain amqp:// URL
        raise CommandError(str(exc)) from None


async def _live_status(url: str, call_timeout_s: float) -> ClusterStatus:
    async with AllocatorClient(url, timeout_s=call_timeout_s,
                               connect_timeout_s=call_timeout_s) as client:
        inventory = await client.inventory(include_leases=True)
        queue = await client.queue()
    return live_status(inventory, queue)


def _print_topology(args: argparse.Namespace) -> int:
    """``status --topology HOST``: the host's link matrix (or its JSON), from the running
    allocator; the links live in its memory only, as the host's agent last reported them."""
    if args.ledger is not None:
        raise CommandError("--topology reads the running allocator (--amqp): the ledger file "
                           "does not keep how a host's GPUs are joined")
    url = _broker_url(args)
    interconnect = _run_async(lambda: _live_topology(url, args.timeout, args.topology))
    if args.json:
        json.dump(interconnect.model_dump(mode="json"), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return EXIT_OK
    sys.stdout.write(f"{args.topology}\n" + "".join(f"{line}\n"
                                                     for line in matrix_lines(interconnect)))
    return EXIT_OK


async def _live_topology(url: str, call_timeout_s: float, host: str) -> HostInterconnect:
    async with AllocatorClient(url, timeout_s=call_timeout_s,
                               connect_timeout_s=call_timeout_s) as client:
        inventory = await client.inventory()
    node = next((n for n in inventory.nodes if n.host == host), None)
    if node is None:
        known = ", ".join(n.host for n in inventory.nodes) or "none"
        raise CommandError(f"the allocator knows no host {host!r} (hosts: {known})")
    if node.interconnect is None:
        raise CommandError(
            f"{host} has not reported how its GPUs are joined: its node agent is older than "
            f"0.3.0, or it has not reported since the allocator started")
    return node.interconnect


def render_status(status: ClusterStatus, console: Console) -> None:
    """The status as three rich tables."""
    now = status.at
    source = "ledger file" if status.source == "ledger" else "live allocator"
    console.print(f"[bold]swarm-gpu[/bold] at {reports.iso(now)} (from the {source})")
    hosts = Table(title="Hosts", title_justify="left")
    for name in ("host", "state", "last heartbeat", "GPUs"):
        hosts.add_column(name)
    for host in status.hosts:
        state = "[green]up[/green]" if host.up else "[red]down[/red]"
        if host.drained:
            state += " [yellow]drained[/yellow]"
        hosts.add_row(escape(host.host), state, _when(host.last_heartbeat, now), str(host.gpus))
    console.print(hosts)
    gpus = Table(title="GPUs", title_justify="left")
    for name in ("host", "#", "model", "health", "state", "util", "memory MiB", "slots",
                 "holders"):
        gpus.add_column(name)
    for gpu in status.gpus:
        health = gpu.health if not gpu.health_reasons else (
            f"{gpu.health} ({'; '.join(gpu.health_reasons)})")
        util = "" if gpu.utilization_pct is None else f"{gpu.utilization_pct:.0f}%"
        memory = (f"{gpu.memory_used_mib}/{gpu.memory_total_mib}"
                  if gpu.memory_used_mib is not None else str(gpu.memory_total_mib))
        slots = (f"{len(gpu.holders)}/{gpu.share_slots}" if gpu.share_slots > 1
                 else ("1/1" if gpu.holders else "0/1"))
        holders = ", ".join(_holder(h, now) for h in gpu.holders)
        state = gpu.state + (" [yellow]drained[/yellow]" if gpu.drained and gpu.holders else "")
        # Names come from users and nodes: escaped, so "[x]" is shown, not taken as markup.
        gpus.add_row(escape(gpu.host), str(gpu.index), escape(gpu.model), escape(health),
                     state, util, memory, slots, escape(holders))
    console.print(gpus)
    _render_processes(status, console)
    if not status.queued:
        console.print("Queue: empty")
        return
    queue = Table(title="Queue", title_justify="left")
    for name in ("#", "user", "request key", "models", "count", "waiting since", "until"):
        queue.add_column(name)
    for item in status.queued:
        queue.add_row(str(item.position), escape(item.user), escape(item.request_key),
                      escape(", ".join(item.models)) if item.models else "any",
                      f"{item.count}" + (" (slice)" if item.shared else ""),
                      _when(item.enqueued_at, now), reports.iso(item.wait_until) or "")
    console.print(queue)


def _holder(holder: SlotHolder, now: float) -> str:
    """One holder of a GPU: who, its state, its lease, and what its processes do wrong."""
    text = f"{holder.user} [{holder.state}] {holder.lease_id[:8]}"
    if holder.shared:
        text += f" slice {holder.memory_mib} MiB"
    if holder.over_budget_since is not None:
        text += f" over budget {_when(holder.over_budget_since, now)}"
    if holder.outside_grant:
        text += f" also uses {', '.join(holder.outside_grant)} (outside its grant)"
    return text


def _render_processes(status: ClusterStatus, console: Console) -> None:
    """The processes that keep GPUs out of placement (draining, stuck, outside use): who to
    look for on which host. From the live allocator only: the ledger does not keep them."""
    kept_out = [gpu for gpu in status.gpus if gpu.process_state is not None]
    if not kept_out:
        return
    table = Table(title="Processes keeping GPUs out of placement", title_justify="left")
    for name in ("host", "#", "state", "processes"):
        table.add_column(name)
    for gpu in kept_out:
        listed = "; ".join(p.describe() for p in gpu.processes or ()) or "none listed"
        table.add_row(escape(gpu.host), str(gpu.index), str(gpu.process_state),
                      escape(listed))
    console.print(table)


# --------------------------------------------------------------------------- export / usage


def _filters(args: argparse.Namespace) -> reports.Filters:
    if args.since is not None and args.until is not None and args.since >= args.until:
        _fail("--since must be before --until")
    return reports.Filters(since=args.since, until=args.until, user=args.user,
                           model=args.model, host=args.host)


def cmd_export(args: argparse.Namespace) -> int:
    """Stream one kind of record to stdout or a file."""
    filters = _filters(args)
    now = time.time()
    with _open_ledger(args) as conn:
        export = reports.export_rows(
            conn, args.kind, filters, time_format=args.time_format,
            decode_json=args.format != "csv", usage_by=args.by, now=now)
        if args.output is None:
            try:
                exports.write(sys.stdout, args.format, export.names, export.rows)
                sys.stdout.flush()
            except BrokenPipeError:
                # The reader went away (`| head`): that is its choice, not an error.
                with contextlib.suppress(OSError):
                    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (never closed on purpose)
            return EXIT_OK
        show_progress = (not args.no_progress and sys.stderr.isatty()
                         and args.kind != "usage")
        with exports.atomic_output(args.output) as out:
            if show_progress:
                total = reports.count_rows(conn, args.kind, filters)
                with _progress() as progress:
                    task = progress.add_task(f"{args.kind} → {args.output}", total=total)
                    written = exports.write(out, args.format, export.names, export.rows,
                                            lambda n: progress.advance(task, n))
            else:
                written = exports.write(out, args.format, export.names, export.rows)
    print(f"wrote {written} rows of {args.kind} to {args.output}", file=sys.stderr)
    return EXIT_OK


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeRemainingColumn(), console=Console(file=sys.stderr), transient=True)


def cmd_usage(args: argparse.Namespace) -> int:
    """Showback per user (group, model, host): a table, CSV or JSON; ``--right-size``: the
    slices that could have had a smaller budget."""
    filters = _filters(args)
    now = time.time()
    prices = _prices(args.config)
    fmt = "json" if args.json else args.output_format
    until = filters.until if filters.until is not None else now
    with _open_ledger(args) as conn:
        if args.right_size:
            return _print_right_size(showback.right_size(conn, filters, until=until), fmt,
                                     filters.since, until)
        rows = showback.showback(reports.usage(conn, filters, by=args.by, now=now), prices)
    names = showback.columns(args.by, prices)
    if fmt == "json":
        json.dump({"since": filters.since, "until": until, "by": args.by,
                   "rows": [dict(zip(names, showback.values(r, args.by, prices), strict=True))
                            for r in rows]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return EXIT_OK
    if fmt == "csv":
        exports.write(sys.stdout, "csv", names,
                      (showback.values(r, args.by, prices) for r in rows))
        return EXIT_OK
    since_text = reports.iso(filters.since) if filters.since is not None else "the beginning"
    table = Table(title=f"GPU usage from {since_text} to {reports.iso(until)}",
                  title_justify="left")
    table.add_column(args.by)
    if args.by != "model":
        table.add_column("model")
    for heading in ("GPU-h held", "GPU-h used", "idle", "kWh", "peak MiB", "leases"):
        table.add_column(heading, justify="right")
    if prices.any:
        table.add_column("cost", justify="right")

    def cells(row: showback.ShowbackRow) -> list[str]:
        out = [escape(row.key)] + ([] if args.by == "model" else [escape(row.model)])
        measured = row.measured_gpu_hours > 0
        out += [f"{row.gpu_hours:.2f}", f"{row.used_gpu_hours:.2f}" if measured else "-",
                f"{row.idle_share:.0%}", f"{row.kwh:.2f}" if measured else "-",
                "-" if row.peak_memory_mib is None else str(row.peak_memory_mib),
                str(row.leases)]
        return out + ([f"{row.cost:.2f}"] if row.cost is not None else [])

    for row in rows:
        table.add_row(*cells(row))
    if args.by != "group" and rows:
        # Group totals overlap (a user may be in several groups), so they get no total.
        held = sum(r.gpu_hours for r in rows)
        idle = sum(r.idle_share * r.gpu_hours for r in rows)
        total = ["total"] + ([] if args.by == "model" else [""])
        total += [f"{held:.2f}", f"{sum(r.used_gpu_hours for r in rows):.2f}",
                  f"{idle / held:.0%}" if held else "0%", f"{sum(r.kwh for r in rows):.2f}",
                  "", str(sum(r.leases for r in rows))]
        if prices.any:
            total.append(f"{sum(r.cost or 0.0 for r in rows):.2f}")
        table.add_section()
        table.add_row(*total)
    _console().print(table)
    return EXIT_OK


def cmd_fairshare(args: argparse.Namespace) -> int:
    """Each user's and group's decayed usage, least first, as tables or JSON."""
    half_life = args.half_life
    if half_life is None:
        text = os.environ.get("SWARM_GPU_USAGE_HALF_LIFE_H") or "0"
        try:
            half_life = float(text)
        except ValueError:
            _fail(f"SWARM_GPU_USAGE_HALF_LIFE_H = {text!r} is not a number of hours")
    if not half_life > 0:
        _fail("no half-life: give --half-life H (hours, above 0) or set "
              "SWARM_GPU_USAGE_HALF_LIFE_H (the allocator's usage_half_life_h)")
    now = args.at if args.at is not None else time.time()
    with _open_ledger(args) as conn:
        report = fairshare(conn, half_life, now)
    if args.json:
        json.dump({"half_life_h": report.half_life_h, "at": report.at,
                   "users": [{"user": r.name, "usage_gpu_hours": round(r.usage, 6),
                              "held_gpus": r.held} for r in report.users],
                   "groups": [{"group": r.name, "usage_gpu_hours": round(r.usage, 6),
                               "held_gpus": r.held} for r in report.groups]},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
        return EXIT_OK
    console = _console()
    for what, rows in (("user", report.users), ("group", report.groups)):
        table = Table(title=f"Decayed usage by {what} at {reports.iso(now)} (half-life "
                            f"{report.half_life_h:g} h; least first, served first among "
                            "equal priority)", title_justify="left")
        table.add_column(what)
        table.add_column("weighted GPU-hours", justify="right")
        table.add_column("GPUs held now", justify="right")
        for row in rows:
            table.add_row(escape(row.name), f"{row.usage:.2f}", f"{row.held:g}")
        console.print(table)
    return EXIT_OK


def _prices(config: str | None) -> showback.Prices:
    """The showback prices of the settings file ``config`` (none: no prices); a file that is
    not valid settings is an error, as for the allocator."""
    if not config:
        return showback.Prices()
    try:
        settings = load_settings(config, amqp_ca_file=None, amqp_cert_file=None,
                                 amqp_key_file=None)
    except (OSError, ValueError) as exc:  # ValueError: pydantic's and TOML's errors
        raise CommandError(f"invalid settings: {settings_error_line(exc)}") from None
    return showback.Prices(settings.price_per_gpu_hour, settings.price_per_kwh)


def _print_right_size(found: list[showback.RightSize], fmt: str, since: float | None,
                      until: float) -> int:
    names = showback.RIGHT_SIZE_COLUMNS
    if fmt == "json":
        json.dump({"since": since, "until": until,
                   "slices": [dict(zip(names, showback.right_size_values(f), strict=True))
                              for f in found]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    elif fmt == "csv":
        exports.write(sys.stdout, "csv", names, (showback.right_size_values(f) for f in found))
    else:
        table = Table(title="Slices whose peak memory stayed under half their budget "
                            "(suggestions only)", title_justify="left")
        for heading in ("lease", "user", "host", "model", "budget MiB", "peak MiB",
                        "would fit MiB"):
            table.add_column(heading, justify="right" if "MiB" in heading else "left")
        for f in found:
            table.add_row(escape(f.lease_id), escape(f.user), escape(f.host), escape(f.model),
                          str(f.budget_mib), str(f.peak_memory_mib), str(f.suggested_mib))
        _console().print(table)
    return EXIT_OK


# --------------------------------------------------------------------------- admin actions


def _who(args: argparse.Namespace) -> str:
    if args.by:
        return str(args.by)
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name in a bare container
        return "admin"


def cmd_drain(args: argparse.Namespace) -> int:
    """Drain or undrain a host or one GPU through the allocator."""
    drained = args.command == "drain"

    async def call() -> Any:
        async with AllocatorClient(args.amqp, timeout_s=args.timeout,
                                   connect_timeout_s=args.timeout) as client:
            return await client.drain(args.host, gpu_uuid=args.gpu, drained=drained,
                                      by=_who(args), reason=args.reason)

    reply = _run_async(call)
    what = f"GPU {reply.gpu_uuid} of {reply.host}" if reply.gpu_uuid else reply.host
    print(f"{what} {'drained' if reply.drained else 'undrained'}")
    return EXIT_OK


def cmd_release(args: argparse.Namespace) -> int:
    """Release a lease (force: free its GPUs now) through the allocator."""
    if args.force and not args.reason.strip():
        _fail("--force needs --reason: a forced release is recorded with who and why")

    async def call() -> Any:
        async with AllocatorClient(args.amqp, timeout_s=args.timeout,
                                   connect_timeout_s=args.timeout) as client:
            return await client.release(lease_id=args.lease_id, by=_who(args),
                                        reason=args.reason, force=args.force)

    lease = _run_async(call)
    reason = f" ({lease.release_reason.value})" if lease.release_reason else ""
    print(f"lease {lease.lease_id} of {lease.user}: {lease.state.value}{reason}")
    return EXIT_OK


def cmd_booking(args: argparse.Namespace) -> int:
    """Add, list or remove bookings through the allocator (:mod:`allocator.admin.booking_cli`)."""
    try:
        return int(_run_async(lambda: booking_cli.run(args, _who(args))))
    except booking_cli.BookingInputError as exc:
        _fail(str(exc))


# --------------------------------------------------------------------------- check


def cmd_check(args: argparse.Namespace) -> int:
    """Check the invariants; exit 1 and print each violation if any."""
    path = _ledger_path(args)
    node_reports: dict[str, NodeReport] | None = None
    if args.live:
        node_reports = _run_async(lambda: collect_node_reports(args.amqp, args.listen,
                                                               args.timeout))
    # The ledger is read after the reports, so a lease bound before a report is on disk.
    with _open_ledger(args) as conn:
        violations = check_ledger(conn, node_reports, grace_s=args.grace)
    if args.json:
        json.dump({"ledger": str(path), "violations": [vars(v) for v in violations],
                   "hosts_reported": sorted(node_reports or {})}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        _print_violations(violations, path, node_reports)
    return EXIT_VIOLATIONS if violations else EXIT_OK


def _print_violations(violations: Sequence[Violation], path: Path,
                      node_reports: dict[str, NodeReport] | None) -> None:
    live = ""
    if node_reports is not None:
        live = f"; compared with reports of {len(node_reports)} host(s): " + (
            ", ".join(sorted(node_reports)) or "none heard")
    if not violations:
        print(f"ok: {path} holds every invariant{live}")
        return
    for violation in violations:
        print(f"VIOLATION {violation}")
    print(f"{len(violations)} violation(s) in {path}{live}", file=sys.stderr)


async def collect_node_reports(amqp_url: str, listen_s: float,
                               timeout_s: float) -> dict[str, NodeReport]:
    """Listen to the nodes' heartbeats for ``listen_s`` and keep each host's latest.

    A private, auto-deleted queue bound to ``heartbeat.#`` sees copies of what the allocator
    sees, without taking anything from the allocator's queue.
    """
    latest: dict[str, NodeReport] = {}
    try:
        async with asyncio.timeout(timeout_s):
            connection = await broker.connect(amqp_url, timeout=timeout_s)
    except (TimeoutError, OSError, aio_pika.exceptions.AMQPError) as exc:
        raise CommandError(f"cannot reach the broker to listen to heartbeats: "
                           f"{broker.connection_failure(exc, amqp_url)}") from exc
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue("", exclusive=True, auto_delete=True)
        exchange = await channel.get_exchange(NODES_EXCHANGE, ensure=False)
        await queue.bind(exchange, routing_key="heartbeat.#")

        full: dict[str, Heartbeat] = {}

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            try:
                beat = NODE_MESSAGE_ADAPTER.validate_json(message.body, extra=READ_EXTRA)
            except ValidationError:
                return
            if isinstance(beat, HeartbeatDelta):
                # A delta that follows a full report heard here says its containers still
                # run now; any other is not a report (the host counts once heard in full).
                base = full.pop(beat.host, None)
                rebuilt = apply_delta(base, beat) if base is not None else None
                if rebuilt is None:
                    return
                beat = rebuilt
            if isinstance(beat, Heartbeat):
                full[beat.host] = beat
                latest[beat.host] = NodeReport.from_heartbeat(beat, time.time())

        await queue.consume(on_message, no_ack=True)
        await asyncio.sleep(listen_s)
    except aio_pika.exceptions.AMQPError as exc:
        raise CommandError(f"cannot listen to heartbeats on {NODES_EXCHANGE}: {exc}") from exc
    finally:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(timeout_s):
                await connection.close()
    return latest


# --------------------------------------------------------------------------- backup, restore


def _position_text(position: LogPosition | None) -> str:
    if position is None:
        return "no ledger log position (it followed no replicated log)"
    return (f"ledger log {position.log_id} at offset {position.offset} "
            f"(epoch {position.epoch})")


def _age(at: float | None, now: float) -> str:
    if at is None:
        return "at an unknown time"
    return _when(at, now)


def cmd_backup(args: argparse.Namespace) -> int:
    """Copy the ledger, consistent, while the allocator writes."""
    path = _ledger_path(args)
    began = time.monotonic()
    info = backup.backup(path, args.path, now=time.time(), overwrite=args.force,
                         busy_timeout_s=args.busy_timeout)
    print(f"backed up {path} to {info.path} in {time.monotonic() - began:.1f} s: "
          f"{info.leases} leases ({info.active_leases} active), schema {info.schema}, "
          f"{_position_text(info.position)}")
    return EXIT_OK


def cmd_restore(args: argparse.Namespace) -> int:
    """Replace the ledger with a backup, and say what the restored ledger may lack."""
    path = _ledger_path(args)
    now = time.time()
    result = backup.restore(args.backup, path, new_log=args.new_log, now=now)
    info = result.backup
    print(f"restored {path} from {info.path}, taken {_age(info.as_of, now)}: {info.leases} "
          f"leases ({info.active_leases} active), schema {info.schema} (the allocator "
          f"migrates it at start)")
    if result.replaced:
        print(f"the ledger it replaced is kept as {', '.join(map(str, result.replaced))}")
    if info.position is None:
        print("ledger log: none in the backup; with ledger_log = \"stream\" the allocator "
              "starts a new log from it only if the old stream is gone (delete it first)")
    elif result.position_cleared:
        print(f"ledger log: position cleared (--new-log; it was "
              f"{_position_text(info.position)}); the allocator starts a new log with a "
              f"snapshot of this ledger: delete the old stream first and empty the other "
              f"replicas' ledgers")
    else:
        print(f"ledger log: position kept, {_position_text(info.position)}; the allocator "
              f"catches up from there (from the log's newest snapshot if the stream no "
              f"longer keeps it)")
    missing = ("what the log does not bring back" if info.position is not None
               and not result.position_cleared else "everything")
    print(f"may be missing: {missing} after the backup was taken: leases granted, released "
          f"or queued since, their history and accounting. At start the allocator adopts the "
          f"running containers of leases it does not know from their labels, releases the "
          f"leases whose containers are gone, and grants nothing on a node before its first "
          f"report; requests that were waiting must be made again")
    print(f"next: gpu-ledger check --ledger {path}, then start the allocator")
    return EXIT_OK


# --------------------------------------------------------------------------- main

COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "status": cmd_status, "export": cmd_export, "usage": cmd_usage,
    "fairshare": cmd_fairshare, "drain": cmd_drain,
    "undrain": cmd_drain, "release": cmd_release, "check": cmd_check, "backup": cmd_backup,
    "restore": cmd_restore, "booking": cmd_booking,
}


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gpu-ledger`` console script."""
    try:
        parser = _parser()
    except ValueError as exc:  # SWARM_GPU_AMQP_URL and _FILE both set, or an unreadable file
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    args = parser.parse_args(argv)
    # The broker client logs every failed connection attempt; the error it ends in is printed
    # below in one line, so its log stays quiet unless asked for. A plain amqp:// URL to
    # another host is still said (allocator.amqp.broker.security_log). The format is
    # SWARM_GPU_LOG_FORMAT's, as the allocator's.
    try:
        log_format = log_settings_from_environment("SWARM_GPU_").log_format
    except ValidationError as exc:
        print(f"{PROG}: error: invalid settings: {settings_error_line(exc)}", file=sys.stderr)
        return EXIT_ERROR
    configure_logging(logging.DEBUG if args.verbose else logging.CRITICAL, log_format)
    quiet_libraries(args.verbose)
    broker.security_log.setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    try:
        # `check` without --live reads the ledger file only: it needs no broker, and TLS
        # files in the environment are no error there. `status` reads either.
        if hasattr(args, "amqp") and args.command != "status" and getattr(args, "live", True):
            args.amqp = _broker_url(args)
        return COMMANDS[args.command](args)
    except (CommandError, LedgerError, AllocatorError) as exc:
        message = str(exc)
    except sqlite3.Error as exc:
        message = str(ledger_error(getattr(args, "ledger", "") or "", exc))
    except OSError as exc:
        message = f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc)
    except KeyboardInterrupt:
        message = "interrupted"
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
