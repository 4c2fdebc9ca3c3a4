"""``swarm-gpu``: a site from its site file, on the Swarm manager ``DOCKER_HOST`` names.

    swarm-gpu check SITE.toml     the site file checked, and what it says
    swarm-gpu deploy SITE.toml    certificates, passwords, secrets, labels, the stack, and a
                                  wait until every service runs; again: "nothing to change"
    swarm-gpu status SITE.toml    nodes, services and certificates on one screen

Exit status 0 when done, 1 with one line on stderr naming the file and key or the step and
what to do, 2 for a command line it cannot read.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from allocator import __version__
from allocator.deploy.site import SiteError, load_site, summary
from allocator.deploy.steps import DeployError, admin_password_shown, deploy, status
from allocator.deploy.swarm import Docker, SwarmError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"swarm-gpu {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, help_text in (("check", "check the site file and say what it holds"),
                            ("deploy", "bring the site up, or up to date (idempotent)"),
                            ("status", "the site's nodes, services and certificates")):
        command = commands.add_parser(name, help=help_text)
        command.add_argument("site", type=Path, metavar="SITE.toml")
    return parser


def _print(line: str) -> None:
    print(line, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; the exit status."""
    args = _parser().parse_args(argv)
    try:
        site = load_site(args.site)
        if args.command == "check":
            for line in summary(site):
                _print(line)
            _print(f"{args.site}: ok")
            return 0
        docker = Docker()
        if args.command == "status":
            for line in status(site, docker):
                _print(line)
            return 0
        done = deploy(site, docker, _print)
    except (SiteError, DeployError, SwarmError) as exc:
        print(f"swarm-gpu {args.command}: {exc}", file=sys.stderr)
        return 1
    if not done.changed:
        _print("nothing to change")
    _print(f"hub: {site.hub.url}")
    if done.admin_password is not None:
        # Shown this once: it is kept in the secrets folder, readable by its owner only.
        _print(f"first admin: {site.hub.first_admin}, password {done.admin_password} "
               f"(shown once; kept in {site.secrets / 'passwords' / 'hub-admin-password'})")
        admin_password_shown(site, done.admin_password)
    return 0


if __name__ == "__main__":
    sys.exit(main())
