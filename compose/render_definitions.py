#!/usr/bin/env python3
"""Render ``rabbitmq-definitions.json`` for one cluster: passwords and one agent user per host.

The committed definitions file is loadable as it is, but its users have no password (an
empty ``password_hash`` refuses every login) and it names two example agents, ``agent-gpu-a``
and ``agent-gpu-b``. This script (standard library only, so it runs on any manager node)
writes the file RabbitMQ loads at boot:

    python3 compose/render_definitions.py --passwords ./broker-passwords \\
        --agent gpu-node-1 --agent gpu-node-2 > definitions.json
    docker secret create swarm-gpu-rabbitmq-definitions definitions.json

``--passwords DIR`` holds one file per user, named after it (``admin``, ``allocator``, ``hub``,
``agent-<host>``), each containing that user's password. Passwords are stored as RabbitMQ's
salted SHA-256 hashes, never in clear. Every agent gets the example agent's permissions with
its own host name: write on ``swarm-gpu.nodes`` only, with routing keys
``heartbeat.<host>``/``event.<host>`` only (a topic permission), and the allocator accepts its
heartbeats only for that host; for the allocator's commands, its own queue
``swarm-gpu.agent.<host>`` only (declare, bind, consume), bound from ``swarm-gpu.agents`` with
the routing key ``stop.<host>`` only (a topic permission on read, which RabbitMQ checks when a
queue is bound to a topic exchange); and the example agent's connection and channel limits
(``limits``: ``max-connections``, ``max-channels``), so that one agent's credential cannot
hold the broker's memory with connections. The policies (the bounds of the allocator's queue
and of the dead letters) move to the vhost with everything else.
"""

from __future__ import annotations

import argparse
import base64
import copy
import hashlib
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

TEMPLATE = Path(__file__).with_name("rabbitmq-definitions.json")
TEMPLATE_VHOST = "swarm-gpu"
AGENT_PREFIX = "agent-"
EXAMPLE_AGENT = "agent-gpu-a"
EXAMPLE_HOST = "gpu-a"
HOST_IN_PATTERN = re.compile(r"(?<=\\\.)" + re.escape(EXAMPLE_HOST) + r"(?=\$|\))")
"""Where a permission pattern names the example host: after an escaped dot (``\\.gpu-a``)
and before the end of the pattern or of a group (``$``, ``)``)."""
PATTERN_FIELDS = ("configure", "write", "read")
HASHING = "rabbit_password_hashing_sha256"


def rabbit_password_hash(password: str, salt: bytes | None = None) -> str:
    """RabbitMQ's ``rabbit_password_hashing_sha256``: base64(salt + sha256(salt + password))."""
    salt = os.urandom(4) if salt is None else salt
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


def _agent_entries(template: dict[str, Any], host: str) -> dict[str, list[dict[str, Any]]]:
    """The example agent's user, permission and topic permission, for ``host``."""
    user = f"{AGENT_PREFIX}{host}"
    entries: dict[str, list[dict[str, Any]]] = {}
    for section, key in (("users", "name"), ("permissions", "user"),
                         ("topic_permissions", "user")):
        entries[section] = []
        for entry in template.get(section, []):
            if entry.get(key) != EXAMPLE_AGENT:
                continue
            clone = copy.deepcopy(entry)
            clone[key] = user
            for field in PATTERN_FIELDS:
                if field in clone:
                    # Queue names and routing keys name the host; escape it for the regex.
                    clone[field] = HOST_IN_PATTERN.sub(lambda _: re.escape(host), clone[field])
            entries[section].append(clone)
    return entries


def render(template: Mapping[str, Any], *, passwords: Mapping[str, str],
           agents: Sequence[str] | None = None, vhost: str = TEMPLATE_VHOST,
           user_prefix: str = "") -> dict[str, Any]:
    """The definitions for one cluster.

    ``agents``: the GPU hosts (None keeps the template's example agents). ``passwords``: user
    name (without prefix) -> password; a user without one keeps an empty hash (cannot log
    in). ``vhost`` and ``user_prefix`` rename the vhost and every user, so that test runs
    sharing one broker do not clash.
    """
    result = copy.deepcopy(dict(template))
    if agents is not None:
        if len(set(agents)) != len(agents):
            raise ValueError("an agent host is named twice")
        for host in agents:
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", host):
                raise ValueError(f"{host!r} is not a host name")
        new = {section: [] for section in ("users", "permissions", "topic_permissions")}
        for host in agents:
            for section, entries in _agent_entries(result, host).items():
                new[section].extend(entries)
        for section, key in (("users", "name"), ("permissions", "user"),
                             ("topic_permissions", "user")):
            kept = [e for e in result.get(section, [])
                    if not str(e.get(key, "")).startswith(AGENT_PREFIX)]
            result[section] = kept + new[section]
    for user in result.get("users", []):
        password = passwords.get(user["name"])
        user["password_hash"] = rabbit_password_hash(password) if password else ""
        user["hashing_algorithm"] = HASHING
        user["name"] = user_prefix + user["name"]
    for section in ("permissions", "topic_permissions"):
        for entry in result.get(section, []):
            entry["user"] = user_prefix + entry["user"]
    for section in ("permissions", "topic_permissions", "policies", "queues", "exchanges",
                    "bindings", "parameters"):
        for entry in result.get(section, []):
            if entry.get("vhost") == TEMPLATE_VHOST:
                entry["vhost"] = vhost
    for entry in result.get("vhosts", []):
        if entry.get("name") == TEMPLATE_VHOST:
            entry["name"] = vhost
    return result


def read_passwords(folder: Path, users: Sequence[str]) -> dict[str, str]:
    """One password per user from ``folder/<user>`` (trailing newline stripped)."""
    passwords = {}
    missing = []
    for user in users:
        path = folder / user
        if not path.is_file():
            missing.append(user)
            continue
        password = path.read_text().rstrip("\r\n")
        if not password:
            raise ValueError(f"{path} is empty")
        passwords[user] = password
    if missing:
        raise ValueError(f"no password file for {', '.join(missing)} in {folder}")
    return passwords


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passwords", type=Path, required=True, metavar="DIR",
                        help="folder with one password file per user")
    parser.add_argument("--agent", action="append", default=[], metavar="HOST",
                        help="a GPU host (repeat); its broker user is agent-HOST")
    parser.add_argument("--vhost", default=TEMPLATE_VHOST)
    parser.add_argument("--user-prefix", default="", metavar="PREFIX",
                        help="put PREFIX before every user name (the password files keep "
                        "the plain names), so that several sites can share one broker")
    parser.add_argument("--template", type=Path, default=TEMPLATE)
    parser.add_argument("--output", "-o", type=Path, help="default: stdout")
    args = parser.parse_args(argv)
    if not args.agent:
        parser.error("name every GPU host with --agent HOST")
    try:
        template = json.loads(args.template.read_text())
        users = ([u["name"] for u in template["users"]
                  if not u["name"].startswith(AGENT_PREFIX)]
                 + [f"{AGENT_PREFIX}{host}" for host in args.agent])
        definitions = render(template, passwords=read_passwords(args.passwords, users),
                             agents=args.agent, vhost=args.vhost,
                             user_prefix=args.user_prefix)
    except (OSError, ValueError, KeyError) as exc:
        print(f"render_definitions: error: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(definitions, indent=2) + "\n"
    if args.output:
        args.output.write_text(text)
        args.output.chmod(0o600)  # it holds password hashes
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
