"""The Swarm, through the docker CLI: the engine's own client, which reaches the manager
that ``DOCKER_HOST`` names (``unix://``, ``ssh://``, ``tcp://`` with TLS) and reads the
user's docker context, as an admin's own ``docker`` commands do.

Each method is one or two CLI calls; a call that fails is a :class:`SwarmError` whose one
line names the command and the engine's own message.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["STACK_LABEL", "Docker", "SwarmError", "SwarmNode"]

STACK_LABEL = "com.docker.stack.namespace"
"""The label ``docker stack deploy`` puts on everything of a stack."""

CALL_TIMEOUT_S = 300.0
"""A bound on one CLI call: an engine that does not answer is an error, not a hang."""


class SwarmError(RuntimeError):
    """A docker CLI call that failed: one line, the command and the engine's message."""


@dataclass(frozen=True)
class SwarmNode:
    """A node as the manager sees it."""

    id: str
    hostname: str
    role: str      # "manager" or "worker"
    state: str     # "ready", "down", ...
    labels: Mapping[str, str]


class Docker:
    """The docker CLI, with ``env`` over this process's environment (``DOCKER_HOST``)."""

    def __init__(self, env: Mapping[str, str] | None = None, executable: str | None = None
                 ) -> None:
        found = executable or shutil.which("docker")
        if found is None:
            raise SwarmError("the docker CLI is not on PATH: install docker-ce-cli or docker.io")
        self._docker = found
        self._env = {**os.environ, **(env or {})}

    def run(self, *args: str, env: Mapping[str, str] | None = None, stderr: bool = False
            ) -> str:
        """``docker ARGS`` and its standard output (and error, with ``stderr``);
        :class:`SwarmError` when it fails."""
        try:
            done = subprocess.run([self._docker, *args], capture_output=True, text=True,
                                  env={**self._env, **(env or {})}, timeout=CALL_TIMEOUT_S,
                                  check=False)
        except subprocess.TimeoutExpired:
            raise SwarmError(f"docker {' '.join(args[:2])}: no answer within "
                             f"{CALL_TIMEOUT_S:.0f} s (is DOCKER_HOST a Swarm manager?)"
                             ) from None
        if done.returncode != 0:
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            why = lines[-1].strip() if lines else f"exit status {done.returncode}"
            raise SwarmError(f"docker {' '.join(args[:2])}: {why}")
        return done.stdout + (done.stderr if stderr else "")

    def _inspect(self, kind: str, ids: Sequence[str]) -> list[dict[str, Any]]:
        if not ids:
            return []
        found: list[dict[str, Any]] = json.loads(self.run(kind, "inspect", *ids))
        return found

    # ---------------------------------------------------------------------- secrets

    def secrets(self, label: str) -> set[str]:
        """The names of the secrets labelled ``label`` (``KEY=VALUE``)."""
        out = self.run("secret", "ls", "--filter", f"label={label}", "--format", "{{.Name}}")
        return set(out.split())

    def create_secret(self, name: str, file: Path, labels: Mapping[str, str]) -> None:
        """A new secret ``name`` holding ``file``."""
        args = [arg for key, value in labels.items() for arg in ("--label", f"{key}={value}")]
        self.run("secret", "create", *args, name, str(file))

    def remove_secret(self, name: str) -> bool:
        """Remove secret ``name``; False where a service still uses it (it stays)."""
        try:
            self.run("secret", "rm", name)
        except SwarmError as exc:
            if "in use" in str(exc):
                return False
            raise
        return True

    # ------------------------------------------------------------------------ nodes

    def nodes(self) -> list[SwarmNode]:
        """Every node of the Swarm."""
        ids = self.run("node", "ls", "-q").split()
        return [SwarmNode(id=node["ID"], hostname=node["Description"]["Hostname"],
                          role=node["Spec"]["Role"], state=node["Status"]["State"],
                          labels=node["Spec"].get("Labels") or {})
                for node in self._inspect("node", ids)]

    def update_labels(self, node_id: str, add: Mapping[str, str], remove: Sequence[str]) -> None:
        """Add and remove labels of one node in one update."""
        args = [*(a for key, value in add.items() for a in ("--label-add", f"{key}={value}")),
                *(a for key in remove for a in ("--label-rm", key))]
        self.run("node", "update", *args, node_id)

    # ----------------------------------------------------------------------- stacks

    def stack_deploy(self, name: str, files: Sequence[Path], env: Mapping[str, str],
                     resolve_image: str) -> None:
        """``docker stack deploy`` of ``files`` as stack ``name``, ``env`` interpolated."""
        args = [arg for file in files for arg in ("-c", str(file))]
        self.run("stack", "deploy", "--prune", "--with-registry-auth",
                 "--resolve-image", resolve_image, *args, name, env=env)

    def stack_remove(self, name: str) -> None:
        """``docker stack rm``: the stack's services, networks, configs and secrets."""
        self.run("stack", "rm", name)

    def services(self, stack: str) -> list[dict[str, Any]]:
        """``docker service inspect`` of every service of ``stack``."""
        ids = self.run("service", "ls", "-q", "--filter", f"label={STACK_LABEL}={stack}").split()
        return self._inspect("service", ids)

    def tasks(self, service_id: str) -> list[dict[str, Any]]:
        """``docker inspect`` of the tasks Swarm keeps of one service (current and recent)."""
        ids = self.run("service", "ps", "-q", "--no-trunc", service_id).split()
        found: list[dict[str, Any]] = (
            json.loads(self.run("inspect", "--type", "task", *ids)) if ids else [])
        return found

    def logs(self, service_id: str, lines: int) -> list[str]:
        """The last ``lines`` lines a service's tasks wrote (stdout and stderr)."""
        try:
            out = self.run("service", "logs", "--raw", "--no-task-ids", "--tail", str(lines),
                           service_id, stderr=True)
        except SwarmError:
            return []  # logs are a help to the message, never a reason to fail it
        return [line for line in out.splitlines() if line.strip()]
