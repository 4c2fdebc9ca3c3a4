"""The steps of ``swarm-gpu deploy``, each idempotent: run again with nothing changed, none
changes anything, and :func:`deploy` says so.

0. :func:`check_nodes`: every node of the site is in the Swarm, its managers managers;
1. :func:`make_files`: passwords and tokens, the CA and the server certificates, made once in
   the secrets folder (:mod:`allocator.deploy.pki`);
2. :func:`create_secrets`: each missing Swarm secret under its versioned name
   (:mod:`allocator.deploy.plan`);
3. :func:`set_labels`: the nodes' labels from their roles;
4. :func:`deploy_stack`: ``docker stack deploy`` with the plan's environment; a service
   whose spec it did not change is no change;
5. :func:`wait_running`: every service's tasks of its current spec running (healthy, where it
   has a health check); a service whose tasks keep failing ends the wait at once with the
   task's error and its last lines of log;
6. :func:`prune_secrets`: the versions of the site's secrets the plan no longer names.

A failure is a :class:`DeployError`: one line naming the step and what to do. Every step
takes over what an interrupted run left: files are written whole or not at all, and the
Swarm's objects are looked at before anything is made.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography import x509

from allocator.deploy import pki
from allocator.deploy.plan import (
    Plan,
    certificates,
    label_changes,
    make_plan,
    passwords,
    secret_files,
)
from allocator.deploy.site import Role, Site
from allocator.deploy.swarm import Docker, SwarmError, SwarmNode

__all__ = [
    "FAILURES_TO_STOP",
    "SECRET_KEY_LABEL",
    "SECRET_STACK_LABEL",
    "DeployError",
    "Deployed",
    "Files",
    "admin_password_shown",
    "create_secrets",
    "deploy",
    "deploy_stack",
    "digests",
    "make_files",
    "prune_secrets",
    "set_labels",
    "status",
    "wait_running",
]

SECRET_STACK_LABEL = "swarm-gpu.deploy.stack"
"""The label on every Swarm secret ``deploy`` makes: the stack it is for."""
SECRET_KEY_LABEL = "swarm-gpu.deploy.key"
"""...and which of the site's secrets it is a version of."""

FAILURES_TO_STOP = 2
"""Failed tasks of a service's current spec that end the wait: one may be a node's hiccup;
two in a row is a service that cannot start."""

POLL_S = 1.0

ADMIN_PASSWORD = "hub-admin-password"
SHOWN = ".hub-admin-password-shown"
"""In ``passwords/``: the SHA-256 of the first admin's password once it was shown."""

SPEC_KEYS = ("Image", "Command", "Args", "Env", "Configs", "Secrets", "Mounts", "Labels")
"""What tells a task of a service's current spec from one of its last."""

Say = Callable[[str], None]


class DeployError(RuntimeError):
    """A step that failed: one line, the step and what to do."""


@dataclass(frozen=True)
class Files:
    """What :func:`make_files` made (empty: everything was there)."""

    made: tuple[str, ...]
    admin_password: str | None  # the hub's first admin's password, until it is shown


@dataclass
class Deployed:
    """The outcome of :func:`deploy`."""

    plan: Plan
    changes: dict[str, list[str]] = field(default_factory=dict)
    admin_password: str | None = None

    @property
    def changed(self) -> bool:
        """Whether any step changed anything."""
        return any(self.changes.values())


def _password(path: Path, length: int) -> bool:
    """Make the password file ``path`` (hex) unless it holds one; whether it was made."""
    try:
        if path.read_text(encoding="utf-8").strip():
            return False
    except FileNotFoundError:
        pass
    pki.write_private(path, (secrets.token_hex(length // 2) + "\n").encode())
    return True


def make_files(site: Site) -> Files:
    """Passwords, tokens, the CA and the server certificates of ``site``, made where
    missing (certificates also where expiring or for other names)."""
    folder = pki.private_folder(site.secrets)
    words = pki.private_folder(folder / "passwords")
    made = [name for name, length in passwords(site).items() if _password(words / name, length)]
    tls = pki.private_folder(folder / "tls")
    ca = pki.ensure_ca(tls)
    if ca.made:
        made.append("CA")
    made += [f"{name} certificate" for name, hosts in certificates(site).items()
             if pki.ensure_server(tls, name, hosts, ca).made]
    admin = (words / ADMIN_PASSWORD).read_text(encoding="utf-8").strip()
    shown = words / SHOWN
    try:
        seen = shown.read_text(encoding="utf-8").strip() == _fingerprint(admin)
    except FileNotFoundError:
        seen = False
    return Files(tuple(made), None if seen else admin)


def _fingerprint(password: str) -> str:
    return hashlib.sha256(password.encode()).hexdigest()


def admin_password_shown(site: Site, password: str) -> None:
    """Remember that ``password`` was shown: :func:`make_files` gives it no more. Until
    then it gives it at every run, so a first run that fails after making it does not lose
    it: the next run that gets through shows it."""
    pki.write_private(site.secrets / "passwords" / SHOWN, (_fingerprint(password) + "\n")
                      .encode())


def digests(site: Site, files: Mapping[str, Path]) -> dict[str, str]:
    """The SHA-256 (hex) of each secret's file."""
    found = {}
    for key, path in files.items():
        try:
            found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        except OSError as exc:
            raise DeployError(f"secrets: cannot read {path}: {exc.strerror or exc}") from None
    return found


def create_secrets(docker: Docker, plan: Plan) -> list[str]:
    """Each Swarm secret of the plan that does not exist yet, created."""
    have = docker.secrets(f"{SECRET_STACK_LABEL}={plan.stack}")
    made = []
    for secret in plan.secrets:
        if secret.name in have:
            continue
        docker.create_secret(secret.name, secret.file,
                             {SECRET_STACK_LABEL: plan.stack, SECRET_KEY_LABEL: secret.key})
        made.append(f"created secret {secret.name}")
    return made


def check_nodes(docker: Docker, site: Site) -> dict[str, SwarmNode]:
    """The Swarm's nodes by host name, once every node of the site is one of them and each
    manager of the site is a Swarm manager; else a :class:`DeployError` (checked before
    anything is made on the Swarm)."""
    nodes = {node.hostname: node for node in docker.nodes()}
    for node in site.nodes:
        if node.name not in nodes:
            raise DeployError(f"nodes: {node.name} is not in the swarm: join it "
                              f"(docker swarm join) or take it out of the site file")
        if Role.MANAGER in node.roles and nodes[node.name].role != "manager":
            raise DeployError(f"nodes: {node.name} is a worker, the site says manager: "
                              f"docker node promote {node.name}")
    return nodes


def set_labels(docker: Docker, site: Site, plan: Plan) -> list[str]:
    """The plan's node labels set, on the nodes :func:`check_nodes` found."""
    nodes = check_nodes(docker, site)
    done = []
    for change in label_changes(plan, {name: node.labels for name, node in nodes.items()}):
        docker.update_labels(nodes[change.node].id, change.add, change.remove)
        words = [f"+{key}" for key in change.add] + [f"-{key}" for key in change.remove]
        done.append(f"{change.node}: {' '.join(words)}")
    return done


def _specs(docker: Docker, stack: str) -> dict[str, tuple[str, str]]:
    """Each service of the stack: its name and its spec (as JSON), by ID."""
    return {service["ID"]: (service["Spec"]["Name"], json.dumps(service["Spec"], sort_keys=True))
            for service in docker.services(stack)}


def deploy_stack(docker: Docker, plan: Plan) -> list[str]:
    """``docker stack deploy`` of the plan; what it changed: services created, updated (their
    spec differs) or removed."""
    before = _specs(docker, plan.stack)
    docker.stack_deploy(plan.stack, plan.files, plan.env, plan.resolve_image)
    after = _specs(docker, plan.stack)
    changed = [f"created {name}" for sid, (name, _) in after.items() if sid not in before]
    changed += [f"updated {name}" for sid, (name, spec) in after.items()
                if sid in before and before[sid][1] != spec]
    changed += [f"removed {name}" for sid, (name, _) in before.items() if sid not in after]
    return sorted(changed)


def _current(task: Mapping[str, Any], service: Mapping[str, Any]) -> bool:
    """Whether ``task`` runs the service's current spec (not one a rolling update replaces)."""
    wanted = service["Spec"]["TaskTemplate"].get("ContainerSpec", {})
    have = task.get("Spec", {}).get("ContainerSpec", {})
    # The keys a deploy changes; the engine fills defaults (a stop grace period, privileges)
    # into the service's copy that its tasks' copies lack.
    return all(have.get(key) == wanted.get(key) for key in SPEC_KEYS)


def _service_state(docker: Docker, service: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether a service runs as its spec says, and else why not, in words; raises
    :class:`DeployError` when its current tasks keep failing."""
    name = service["Spec"]["Name"]
    tasks = [task for task in docker.tasks(service["ID"]) if _current(task, service)]
    failed = [task for task in tasks if task["Status"]["State"] in ("failed", "rejected")]
    if len(failed) >= FAILURES_TO_STOP:
        last = max(failed, key=lambda task: str(task["Status"].get("Timestamp", "")))
        why = last["Status"].get("Err") or last["Status"]["State"]
        logs = docker.logs(service["ID"], 3)
        said = f"; its last lines: {' | '.join(logs)}" if logs else ""
        raise DeployError(f"services running: {name} keeps failing: {why}{said}; see "
                          f"docker service ps --no-trunc {name}")
    running = [task for task in tasks
               if task.get("DesiredState") == "running" and task["Status"]["State"] == "running"]
    mode = service["Spec"]["Mode"]
    if "Replicated" in mode:
        wanted = int(mode["Replicated"].get("Replicas", 1))
        if len(running) == wanted:
            return True, ""
        waiting = [task for task in tasks if task.get("DesiredState") == "running"
                   and task["Status"]["State"] != "running"]
        detail = "; ".join(sorted({f"{t['Status']['State']}"
                                   + (f" ({t['Status']['Err']})" if t["Status"].get("Err")
                                      else "") for t in waiting}))
        return False, f"{name}: {len(running)}/{wanted} running" + (f", {detail}" if detail
                                                                   else "")
    desired = [task for task in tasks if task.get("DesiredState") == "running"]
    if desired and len(running) == len(desired):
        return True, ""
    return False, f"{name}: {len(running)}/{len(desired)} running (global)"


def wait_running(docker: Docker, plan: Plan, wait_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 pause: Callable[[float], None] = time.sleep) -> None:
    """Until every service of the stack runs its current spec; a service whose tasks keep
    failing, or ``wait_s`` over, is a :class:`DeployError` naming it and why."""
    deadline = clock() + wait_s
    while True:
        services = docker.services(plan.stack)
        if not services:
            raise DeployError(f"services running: the stack {plan.stack} has no service: "
                              f"do its compose files name any?")
        waiting = [why for ok, why in (_service_state(docker, s) for s in services) if not ok]
        if not waiting:
            return
        if clock() >= deadline:
            raise DeployError(f"services running: not within {wait_s:.0f} s: "
                              f"{'; '.join(waiting)}; see docker stack ps {plan.stack}")
        pause(POLL_S)


def prune_secrets(docker: Docker, plan: Plan) -> list[str]:
    """The site's secrets the plan no longer names (an older version), removed once no
    service uses them."""
    current = {secret.name for secret in plan.secrets}
    removed = []
    for name in sorted(docker.secrets(f"{SECRET_STACK_LABEL}={plan.stack}") - current):
        if docker.remove_secret(name):
            removed.append(f"removed secret {name}")
    return removed


def deploy(site: Site, docker: Docker, say: Say) -> Deployed:
    """Every step, in order, each said as it ends; :class:`DeployError` names the step that
    failed."""
    try:
        check_nodes(docker, site)
    except SwarmError as exc:
        raise DeployError(f"nodes: {exc}") from None
    step = "certificates and passwords"
    try:
        files = make_files(site)
    except (OSError, ValueError) as exc:
        raise DeployError(f"{step}: {exc}; check {site.secrets}") from None
    try:
        plan = make_plan(site, digests(site, secret_files(site)))
    except ValueError as exc:
        raise DeployError(f"plan: {exc}") from None
    result = Deployed(plan, admin_password=files.admin_password)
    result.changes[step] = [f"made {made}" for made in files.made]
    say(f"{step}: {', '.join(files.made) or 'unchanged'}")
    steps: list[tuple[str, Callable[[], list[str]]]] = [
        ("swarm secrets", lambda: create_secrets(docker, plan)),
        ("node labels", lambda: set_labels(docker, site, plan)),
        ("stack", lambda: deploy_stack(docker, plan)),
        ("services running", lambda: _waited(docker, plan, site.stack.wait_s)),
        ("old secrets", lambda: prune_secrets(docker, plan)),
    ]
    for step, run in steps:
        try:
            done = run()
        except SwarmError as exc:
            raise DeployError(f"{step}: {exc}") from None
        result.changes[step] = done
        say(f"{step}: {'; '.join(done) if done else 'unchanged'}")
    return result


def _waited(docker: Docker, plan: Plan, wait_s: float) -> list[str]:
    wait_running(docker, plan, wait_s)
    return []  # waiting changes nothing


def status(site: Site, docker: Docker) -> list[str]:
    """The site on one screen: its nodes, services and certificates."""
    lines = []
    nodes = {node.hostname: node for node in docker.nodes()}
    under = site.stack.label_prefix + "."
    for node in site.nodes:
        found = nodes.get(node.name)
        if found is None:
            lines.append(f"node {node.name}: NOT IN THE SWARM")
            continue
        labels = sorted(key.removeprefix(under) for key in found.labels if key.startswith(under))
        lines.append(f"node {node.name}: {found.role}, {found.state}; "
                     f"roles {', '.join(labels) or 'none'}")
    services = docker.services(site.stack.name)
    if not services:
        lines.append(f"stack {site.stack.name}: not deployed")
    for service in sorted(services, key=lambda s: str(s["Spec"]["Name"])):
        try:
            ok, why = _service_state(docker, service)
        except DeployError as exc:
            ok, why = False, str(exc).removeprefix("services running: ")
        lines.append(f"service {service['Spec']['Name']}: {'running' if ok else why}")
    for pem in sorted((site.secrets / "tls").glob("*.pem")):
        cert = x509.load_pem_x509_certificate(pem.read_bytes())
        lines.append(f"certificate {pem.name}: expires {cert.not_valid_after_utc:%Y-%m-%d}")
    lines.append(f"hub: {site.hub.url}")
    return lines
