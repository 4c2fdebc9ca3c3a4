"""``gpu-ledger booking add|list|remove``: admins manage bookings through the running
allocator (the ``booking`` request; ``docs/operations.md``, "Bookings").

    gpu-ledger booking add --name NAME (--group G | --users A,B) --model M --count N
                           [--mig-profile P] [--host H] --zone ZONE
                           (--once START END | --weekly DAYS --at HH:MM --duration 2h
                            --until DATE [--from DATE]) [--lead 15m] [--by WHO]
    gpu-ledger booking add --file lab.toml|lab.json [--by WHO]
    gpu-ledger booking list [--json]
    gpu-ledger booking remove NAME [--reason TEXT]

The options only build the booking's body; every rule is the allocator's, so the answer to a
bad booking is its error (one line), and a booking that does not fit is refused with what
collides and what would fit.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tomllib
from collections.abc import Callable, Mapping
from datetime import date, datetime, time
from pathlib import Path
from typing import Any, Final, TextIO

from pydantic import ValidationError

from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.bookings.booking import Booking
from allocator.settings_files import in_file, key_lines, model_problems
from allocator.wire.protocol import BookingView, ErrorCode


class BookingInputError(Exception):
    """Options or a file that make no booking body (said in one line)."""


_DURATION: Final = re.compile(r"^(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")


def seconds(text: str) -> int:
    """``2h``, ``90m``, ``1h30m``, ``15m``, ``45s``, ``1d`` or plain seconds (``7200``)."""
    text = text.strip().lower()
    if text.isdigit():
        return int(text)
    match = _DURATION.match(text)
    if not text or match is None:
        raise BookingInputError(f"{text!r} is no duration: write it like 2h, 90m, 1h30m or "
                                "7200 (seconds)")
    days, hours, minutes, secs = (int(part or 0) for part in match.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + secs


def add_booking_commands(commands: Any,
                         with_allocator: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``booking add|list|remove`` to ``gpu-ledger``'s commands; ``with_allocator`` adds
    the broker options (``--amqp``, ``--timeout``, TLS) to each."""
    booking = commands.add_parser(
        "booking", help="add, list or remove bookings (over RPC, admins)",
        description="Bookings: GPUs guaranteed to a group (or users) in a window of time, "
                    "one-off or weekly, in a time zone you name (docs/operations.md, "
                    "Bookings).")
    ops = booking.add_subparsers(dest="booking_command", required=True, metavar="OP")

    add = ops.add_parser("add", help="add a booking (refused if it does not fit)")
    add.add_argument("--file", type=Path, metavar="FILE",
                     help="the booking as a JSON or TOML file (.toml) instead of the options")
    add.add_argument("--name", help="the booking's name, e.g. 'CS101 lab'")
    members = add.add_mutually_exclusive_group()
    members.add_argument("--group", help="its members: this group's users")
    members.add_argument("--users", help="its members by name, comma-separated")
    add.add_argument("--model", help="GPU model or alias, as in a request")
    add.add_argument("--mig-profile", metavar="PROFILE", help="a MIG profile of that model")
    add.add_argument("--count", type=int, help="GPUs (or MIG instances)")
    add.add_argument("--host", help="only this node's GPUs")
    add.add_argument("--zone", help="IANA time zone of the window, e.g. Europe/Berlin")
    add.add_argument("--once", nargs=2, metavar=("START", "END"),
                     help="one window: local start and end, e.g. 2026-12-08T10:00 "
                          "2026-12-08T12:00")
    add.add_argument("--weekly", metavar="DAYS",
                     help="weekdays it recurs on, comma-separated: mon,tue,...,sun")
    add.add_argument("--at", metavar="HH:MM", help="with --weekly: the local start time")
    add.add_argument("--duration", metavar="D", help="with --weekly: e.g. 2h, 90m")
    add.add_argument("--from", dest="starts_on", metavar="DATE",
                     help="with --weekly: the first day (default: from now)")
    add.add_argument("--until", metavar="DATE",
                     help="with --weekly: the last day an occurrence starts on (required)")
    add.add_argument("--lead", metavar="D",
                     help="warn borrowers of the GPUs this long before (default: the "
                          "allocator's)")
    add.add_argument("--quota-does-not-apply", action="store_true",
                     help="members' own quotas do not limit what they take of the booking")
    add.add_argument("--reason", default="", help="recorded in the ledger")
    add.add_argument("--by", default=None, help="who (default: your login name)")
    add.add_argument("--json", action="store_true", help="print the booking as JSON")
    with_allocator(add)

    listing = ops.add_parser("list", help="every booking, its next occurrences, shortfalls")
    listing.add_argument("--json", action="store_true", help="print JSON instead of text")
    listing.add_argument("--by", default=None, help="who (default: your login name)")
    with_allocator(listing)

    remove = ops.add_parser("remove", help="remove a booking")
    remove.add_argument("name")
    remove.add_argument("--reason", default="", help="recorded in the ledger")
    remove.add_argument("--by", default=None, help="who (default: your login name)")
    with_allocator(remove)


def _plain(value: Any) -> Any:
    """TOML's dates and times as the ISO text a booking's body carries."""
    if isinstance(value, datetime | date | time):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _from_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise BookingInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, ValueError) as exc:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise BookingInputError(f"{path} is not valid {kind}: {exc}") from None
    if not isinstance(data, dict):
        raise BookingInputError(f"{path} must hold one booking (an object/table)")
    body: dict[str, Any] = _plain(data)
    # A key the booking does not have is a typo the admin fixes here, told where and what
    # was meant; every other problem is the allocator's answer, with its own error code.
    try:
        Booking.model_validate({"created_by": "-", **body})
    except ValidationError as exc:
        unknown = model_problems(Booking, exc, key_lines(text) if path.suffix == ".toml" else {},
                                 only={"extra_forbidden"})
        if unknown:
            raise BookingInputError(in_file(path, unknown)) from None
    return body


_OPTIONS: Final = ("name", "group", "users", "model", "mig_profile", "count", "host", "zone",
                   "once", "weekly", "at", "duration", "starts_on", "until", "lead")


def booking_body(args: argparse.Namespace) -> dict[str, Any]:
    """The booking's body from ``--file`` or from the options (one of them)."""
    given = [name for name in _OPTIONS if getattr(args, name) is not None]
    if args.file is not None:
        if given or args.quota_does_not_apply:
            raise BookingInputError("give the booking as --file or as options, not both "
                                    f"(--{given[0].replace('_', '-') if given else 'quota'}"
                                    "... given too)")
        return _from_file(args.file)
    missing = [f"--{name}" for name in ("name", "model", "count", "zone")
               if getattr(args, name) is None]
    if args.group is None and args.users is None:
        missing.append("--group or --users")
    if args.once is None and args.weekly is None:
        missing.append("--once START END or --weekly DAYS")
    if missing:
        raise BookingInputError(f"a booking needs {', '.join(missing)} (or --file)")
    if args.once is not None and args.weekly is not None:
        raise BookingInputError("give --once or --weekly, not both")
    window: dict[str, Any]
    if args.once is not None:
        stray = [f"--{n.replace('_', '-')}" for n in ("at", "duration", "starts_on", "until")
                 if getattr(args, n) is not None]
        if stray:
            raise BookingInputError(f"{', '.join(stray)} go with --weekly, not --once")
        window = {"kind": "once", "start": args.once[0], "end": args.once[1]}
    else:
        if args.at is None or args.duration is None:
            raise BookingInputError("--weekly needs --at HH:MM and --duration (e.g. 2h)")
        window = {"kind": "weekly",
                  "weekdays": [d.strip().lower()[:3] for d in args.weekly.split(",")
                               if d.strip()],
                  "start": args.at, "duration_s": seconds(args.duration)}
        if args.starts_on is not None:
            window["starts_on"] = args.starts_on
        if args.until is not None:  # without it the allocator says recurrence_without_end
            window["until"] = args.until
    gpus: dict[str, Any] = {"model": args.model, "count": args.count}
    if args.mig_profile is not None:
        gpus["mig_profile"] = args.mig_profile
    if args.host is not None:
        gpus["host"] = args.host
    body: dict[str, Any] = {"name": args.name, "gpus": gpus, "zone": args.zone,
                            "window": window}
    if args.group is not None:
        body["group"] = args.group
    else:
        body["users"] = [u.strip() for u in args.users.split(",") if u.strip()]
    if args.lead is not None:
        body["lead_s"] = seconds(args.lead)
    if args.quota_does_not_apply:
        body["quota_applies"] = False
    return body


def _window_text(booking: Mapping[str, Any]) -> str:
    window = booking.get("window", {})
    zone = booking.get("zone", "")
    if window.get("kind") == "once":
        return f"once {window.get('start')} - {window.get('end')} ({zone})"
    days = ",".join(window.get("weekdays", []))
    minutes = int(window.get("duration_s", 0)) // 60
    length = f"{minutes // 60}h{minutes % 60:02d}" if minutes % 60 else f"{minutes // 60}h"
    start = str(window.get("start", ""))[:5]
    until = window.get("until")
    first = window.get("starts_on")
    span = f" from {first}" if first else ""
    return f"weekly {days} {start} for {length}{span} until {until} ({zone})"


def print_view(view: BookingView, out: TextIO) -> None:
    """One booking for people: who, what, when, next, shortfalls."""
    booking = view.booking
    gpus = booking.get("gpus", {})
    members = (f"group {booking['group']}" if booking.get("group")
               else "users " + ", ".join(booking.get("users") or []))
    where = f" on {gpus['host']}" if gpus.get("host") else ""
    model = view.model or gpus.get("model")
    lead = booking.get("lead_s")
    print(f"{view.name}: {gpus.get('count')} x {model}{where} for {members}", file=out)
    print(f"  {_window_text(booking)}"
          + (f", borrowers warned {lead // 60} min before" if lead is not None else ""),
          file=out)
    if view.next:
        print("  next: " + "; ".join(o.local_start[:16].replace("T", " ") for o in view.next),
              file=out)
    else:
        print("  next: none (every occurrence has ended)", file=out)
    for text in view.shortfalls:
        print(f"  SHORT: {text}", file=out)
    print(f"  added by {view.created_by}", file=out)


def print_refusal(error: AllocatorError, out: TextIO) -> None:
    """For a booking that does not fit: each colliding occurrence and what would fit."""
    if error.code is not ErrorCode.COLLIDES:
        return
    details = error.details
    print(f"{details.get('colliding')} of {details.get('occurrences')} occurrence(s) "
          "collide:", file=out)
    for collision in details.get("collisions", []):
        others = ", ".join(collision.get("others", [])) or "no other booking"
        start = str(collision.get("local_start", ""))[:16].replace("T", " ")
        print(f"  {start}: {collision.get('short_by')} GPU(s) short, next to {others}",
              file=out)
    fits = [f"--count {details['largest_count']}" if details.get("largest_count") else "",
            "without --host" if details.get("fits_without_host") else "",
            f"--until {details['fits_until']}" if details.get("fits_until") else ""]
    if any(fits):
        print("would fit: " + "; or ".join(f for f in fits if f), file=out)


async def run(args: argparse.Namespace, by: str) -> int:
    """The booking command ``args`` names, through the allocator at ``args.amqp``."""
    op = args.booking_command
    body = booking_body(args) if op == "add" else None
    async with AllocatorClient(args.amqp, timeout_s=args.timeout,
                               connect_timeout_s=args.timeout) as client:
        if op == "list":
            views = await client.bookings(by=by)
            if args.json:
                print(json.dumps([v.model_dump(mode="json") for v in views], indent=2))
            elif not views:
                print("no bookings")
            for view in [] if args.json else views:
                print_view(view, sys.stdout)
            return 0
        if op == "remove":
            removed = await client.remove_booking(args.name, by=by, reason=args.reason)
            print(f"booking {removed.name!r} removed")
            return 0
        assert body is not None
        try:
            added = await client.add_booking(body, by=by, reason=args.reason)
        except AllocatorError as refused:
            print_refusal(refused, sys.stderr)
            raise
    if args.json:
        print(json.dumps(added.model_dump(mode="json"), indent=2))
    else:
        print(f"booking {added.name!r} added")
        print_view(added, sys.stdout)
    return 0

