"""What a site asks of the Swarm, pure: no file, no docker, no clock.

From a :class:`~allocator.deploy.site.Site` (and, for the secrets' names, the digests of the
files the steps made), :func:`make_plan` says:

- the Swarm secrets, each under a *versioned* name ``<stack>-<key>-<digest>``: a Swarm secret
  cannot change, so a changed file is a new secret, and the stack, deployed with the new
  name in its environment (``SWARM_GPU_SECRET_<KEY>``), moves its services onto it; the same
  file is the same name, so a second run creates nothing;
- the node labels, ``<label_prefix>.<role>=true`` for each role but ``manager`` (which is the
  node's Swarm role, not a label);
- the environment of ``docker stack deploy``: images, the hub's name and ports, the users'
  volume driver and options, the label prefix, every secret's name, and the site's own
  variables (``[stack] env``, for its override files).

:func:`passwords` and :func:`certificates` say which passwords and certificates the steps make
once in the secrets folder, and :func:`label_changes` what turns a node's labels into the
plan's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from allocator.deploy.site import Role, Site

__all__ = ["BROKER_NAMES", "PASSWORDS", "SWARM_SECRETS", "LabelChange", "Plan", "SecretSpec",
           "certificates", "label_changes", "make_plan", "passwords", "secret_env",
           "secret_files"]

PASSWORDS: Mapping[str, int] = {
    "broker-admin": 48,        # the broker's admin user (its definitions)
    "allocator-password": 48,  # the broker user of the allocators
    "hub-password": 48,        # the broker user of the hub
    "hub-admin-password": 24,  # the hub's first admin: shown once, typed by a person
    "hub-api-token": 64,       # the hub's admin API token
    "metrics-token": 64,       # what Prometheus sends to read the metrics
}
"""Each password or token made once (hex characters), by its name in ``passwords/``."""

SWARM_SECRETS = ("allocator-password", "hub-password", "hub-admin-password", "hub-api-token",
                 "metrics-token", "broker-ca", "broker-cert", "broker-key", "hub-cert",
                 "hub-key")
"""The Swarm secrets of a site, by key, in the order they are created."""

BROKER_NAMES = ("rabbitmq", "rabbitmq-2", "rabbitmq-3", "localhost", "127.0.0.1")
"""The names the stack's clients use for the broker (its one node, or three)."""

DIGEST_CHARS = 12
"""Characters of a file's SHA-256 in its secret's name: a new name for every change."""


@dataclass(frozen=True)
class SecretSpec:
    """One Swarm secret: the file it holds, its versioned name, the variable naming it."""

    key: str
    file: Path
    name: str
    env: str


@dataclass(frozen=True)
class LabelChange:
    """What to add to and remove from one node's labels."""

    node: str
    add: Mapping[str, str] = field(default_factory=dict)
    remove: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    """Everything ``deploy`` makes the Swarm hold for a site."""

    stack: str
    files: tuple[Path, ...]
    secrets: tuple[SecretSpec, ...]
    labels: Mapping[str, Mapping[str, str]]
    label_prefix: str
    env: Mapping[str, str]
    resolve_image: str


def passwords(site: Site) -> dict[str, int]:
    """The passwords and tokens to make once: name -> length in hex characters; each GPU
    node's agent also gets its own broker password (``agent-<node>``)."""
    made = dict(PASSWORDS)
    made.update({f"agent-{node.name}": 48 for node in site.with_role(Role.GPU)})
    return made


def certificates(site: Site) -> dict[str, list[str]]:
    """The server certificates the site's CA signs: name -> the names each is for (the hub's
    only when the site has no certificate of its own)."""
    broker = [*BROKER_NAMES, *(n for node in site.with_role(Role.BROKER)
                               for n in (node.name, node.address) if n not in BROKER_NAMES)]
    made = {"broker": list(dict.fromkeys(broker))}
    if site.hub.certificate is None:
        made["hub"] = [site.hub.domain]
    return made


def secret_files(site: Site) -> dict[str, Path]:
    """The file each Swarm secret holds, by key."""
    tls, words = site.secrets / "tls", site.secrets / "passwords"
    files = {key: words / key for key in SWARM_SECRETS if key in PASSWORDS}
    files |= {"broker-ca": tls / "ca.pem", "broker-cert": tls / "broker.pem",
              "broker-key": tls / "broker.key",
              "hub-cert": site.hub.certificate or tls / "hub.pem",
              "hub-key": site.hub.key or tls / "hub.key"}
    return {key: files[key] for key in SWARM_SECRETS}


def secret_env(key: str) -> str:
    """The variable that names secret ``key`` in the stack: ``SWARM_GPU_SECRET_BROKER_CA``."""
    return "SWARM_GPU_SECRET_" + key.upper().replace("-", "_")


def make_plan(site: Site, digests: Mapping[str, str]) -> Plan:
    """The plan of ``site``; ``digests``: each secret file's SHA-256 (hex), by key."""
    missing = sorted(set(SWARM_SECRETS) - set(digests))
    if missing:
        raise ValueError(f"no digest for the secrets {', '.join(missing)}")
    stack = site.stack.name
    secrets = tuple(SecretSpec(key, path, f"{stack}-{key}-{digests[key][:DIGEST_CHARS]}",
                               secret_env(key)) for key, path in secret_files(site).items())
    prefix = site.stack.label_prefix
    labels = {node.name: {f"{prefix}.{role.value}": "true" for role in node.roles
                          if role is not Role.MANAGER} for node in site.nodes}
    images = site.images
    env = {
        "SWARM_GPU_IMAGE": images.reference(images.allocator),
        "SWARM_GPU_HUB_IMAGE": images.reference(images.hub),
        "SWARM_GPU_NOTEBOOK_IMAGE": images.reference(images.notebook),
        "SWARM_GPU_BROKER_IMAGE": images.broker,
        "SWARM_GPU_HUB_DOMAIN": site.hub.domain,
        "SWARM_GPU_HUB_URL": site.hub.url,
        "SWARM_GPU_HUB_HTTPS_PORT": str(site.hub.https_port),
        "SWARM_GPU_HUB_HTTP_PORT": str(site.hub.http_port),
        "SWARM_GPU_HUB_FIRST_ADMIN": site.hub.first_admin,
        "SWARM_GPU_USER_VOLUME_DRIVER": site.storage.driver,
        "SWARM_GPU_USER_VOLUME_OPTIONS": json.dumps(site.storage.options, sort_keys=True),
        "SWARM_GPU_LABEL_PREFIX": prefix,
        **{secret.env: secret.name for secret in secrets},
    }
    clash = sorted(set(site.stack.env) & set(env))
    if clash:
        raise ValueError(f"stack.env: deploy sets {', '.join(clash)} itself; take "
                         f"{'it' if len(clash) == 1 else 'them'} out of the site file")
    return Plan(stack=stack, files=site.stack.files, secrets=secrets, labels=labels,
                label_prefix=prefix, env={**site.stack.env, **env},
                resolve_image=images.resolve)


def label_changes(plan: Plan, current: Mapping[str, Mapping[str, str]]) -> list[LabelChange]:
    """What turns each planned node's ``current`` labels into the plan's: the plan's labels
    added where missing or different, and labels under the plan's prefix it does not hold
    removed (a role taken off a node). Labels of other prefixes are left alone; a node
    already right has no change."""
    changes = []
    under = plan.label_prefix + "."
    for node, wanted in plan.labels.items():
        have = current.get(node, {})
        add = {key: value for key, value in wanted.items() if have.get(key) != value}
        remove = tuple(sorted(key for key in have if key.startswith(under) and key not in wanted))
        if add or remove:
            changes.append(LabelChange(node, add, remove))
    return changes
