"""The site file: one TOML file that says what a swarm-gpu site is, checked by a schema.

    [stack]
    name = "swarm-gpu"
    files = ["compose/stack.yml"]

    [hub]
    domain = "hub.example.org"

    [[nodes]]
    name = "gpu-1"
    address = "10.0.0.11"
    roles = ["manager", "hub", "broker", "allocator", "gpu"]

The schema is :class:`Site`. The file is strict as every config file the project reads: an
unknown key or a value of the wrong type (TOML's own types) is a :class:`SiteError` of one
line naming the file, the line, the dotted key and, for an unknown key, the nearest valid
one. The rule is :func:`allocator.settings_files.model_problems`, the one the allocator's
and the agent's settings files follow.

Relative paths in the file (the stack's compose files, the secrets folder, a certificate of
the site's own) are relative to the site file's folder: :func:`load_site` makes them absolute.
"""

from __future__ import annotations

import ipaddress
import json
import re
import tomllib
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from allocator import __version__
from allocator.settings_files import in_file, key_lines, model_problems

__all__ = ["Hub", "Images", "Node", "Role", "Site", "SiteError", "Stack", "Storage", "load_site",
           "summary"]

HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?")
"""A DNS name as a certificate and a Swarm node carry it."""

STACK_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,30}")
"""What ``docker stack deploy`` accepts as a stack name, short enough that the versioned
secret names built on it (``<stack>-<secret>-<digest>``) stay within Swarm's 64 characters."""


def _host_name(value: str) -> str:
    if not HOST_NAME.fullmatch(value):
        raise ValueError(f"not a host name: {value!r}")
    return value


def _address(value: str) -> str:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"not an IP address: {value!r}") from None
    return value


HostName = Annotated[str, AfterValidator(_host_name)]
Address = Annotated[str, AfterValidator(_address)]


class SiteError(ValueError):
    """A site file that cannot be used: one line naming the file, the line and the key."""


class Role(StrEnum):
    """What a node does at the site."""

    MANAGER = "manager"      # a Swarm manager (checked, not made: `docker swarm join` does)
    HUB = "hub"              # runs JupyterHub (must be a manager: it creates services)
    BROKER = "broker"        # keeps RabbitMQ's disk
    ALLOCATOR = "allocator"  # keeps a copy of the ledger
    GPU = "gpu"              # has GPUs: runs a node agent, hosts notebooks


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Node(_Strict):
    """One server of the site, by its Swarm node name (``docker node ls``'s HOSTNAME)."""

    name: HostName = Field(description="the Swarm node's host name")
    address: Address = Field(description="the node's address (IPv4 or IPv6): certificates name it")
    roles: tuple[Role, ...] = Field(min_length=1, description="what the node does")


class Hub(_Strict):
    """JupyterHub's public face."""

    domain: HostName = Field(description="the hub's public host name: its certificate names it")
    https_port: Annotated[int, Field(ge=1, le=65535)] = 443
    http_port: Annotated[int, Field(ge=1, le=65535)] = 80
    first_admin: str = Field(default="admin", pattern=r"^[a-z][a-z0-9_.-]*$",
                             description="the hub's first admin; its password is made once")
    certificate: Path | None = Field(
        default=None, description="the site's own certificate for the hub (PEM, full chain); "
        "none: one signed by the site's CA")
    key: Path | None = Field(default=None, description="the key of `certificate`")

    @model_validator(mode="after")
    def _pair(self) -> Hub:
        if (self.certificate is None) != (self.key is None):
            raise ValueError("hub: give both certificate and key, or neither")
        if self.http_port == self.https_port:
            raise ValueError("hub: http_port and https_port must differ")
        return self

    @property
    def url(self) -> str:
        """The hub's HTTPS URL, as users type it."""
        port = "" if self.https_port == 443 else f":{self.https_port}"
        return f"https://{self.domain}{port}/"


class Storage(_Strict):
    """Where users' files live: a Docker volume per user, of this driver."""

    driver: str = Field(default="local", description="the volume driver")
    options: dict[str, str] = Field(
        default_factory=dict,
        description='the driver\'s options, e.g. NFS: {type = "nfs", o = "addr=10.0.0.5,rw", '
        'device = ":/export/home"}')


class Images(_Strict):
    """The images the stack runs. Each name without a registry gets ``registry`` before it."""

    registry: str = Field(default="", description="e.g. registry.example.org:5000; empty: "
                          "images loaded on every node")
    tag: str = Field(default=__version__, description="the release to run")
    allocator: str = "swarm-gpu"
    hub: str = "swarm-gpu-hub"
    notebook: str = "swarm-gpu-notebook"
    broker: str = Field(default="rabbitmq:3.10-management", description="a full reference")
    resolve: Literal["always", "changed", "never"] = Field(
        default="always", description="docker stack deploy --resolve-image: pin by digest")

    def reference(self, name: str) -> str:
        """The full reference of image ``name`` (a name with a tag is kept as it is)."""
        last = name.rsplit("/", 1)[-1]
        tagged = name if ":" in last or "@" in last else f"{name}:{self.tag}"
        return f"{self.registry}/{tagged}" if self.registry and "/" not in name else tagged


class Stack(_Strict):
    """The Swarm stack: its name (every secret's and label's prefix) and compose files."""

    name: str = Field(default="swarm-gpu", description="the stack's name")
    files: tuple[Path, ...] = Field(default=(Path("compose/stack.yml"),), min_length=1)
    label_prefix: str = Field(default="swarm-gpu", pattern=r"^[a-z0-9][a-z0-9.-]*$",
                              description="node labels are <label_prefix>.<role>")
    wait_s: Annotated[float, Field(gt=0)] = Field(
        default=600, description="how long deploy waits for every service to run")
    env: dict[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")], str] = Field(
        default_factory=dict, description="more variables for the stack files (an override "
        "file's own); never one that deploy sets itself")

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if not STACK_NAME.fullmatch(value):
            raise ValueError(f"not a stack name (a-z, 0-9, _ and -, at most 31): {value!r}")
        return value


class Site(_Strict):
    """A whole site: its nodes, hub, users' storage, images, stack and secrets folder."""

    secrets: Path = Field(default=Path("secrets"), description="the folder of the site's "
                          "certificates, keys and passwords (made 0700)")
    stack: Stack = Field(default_factory=Stack)
    hub: Hub
    storage: Storage = Field(default_factory=Storage)
    images: Images = Field(default_factory=Images)
    nodes: tuple[Node, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _roles(self) -> Site:
        names = [node.name for node in self.nodes]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"nodes: named twice: {', '.join(twice)}")
        not_managers = [node.name for node in self.with_role(Role.HUB)
                        if Role.MANAGER not in node.roles]
        if not_managers:
            raise ValueError(f"nodes: the hub creates services, so a hub node must be a "
                             f"manager too: {', '.join(not_managers)}")
        for role in (Role.MANAGER, Role.HUB, Role.BROKER, Role.ALLOCATOR, Role.GPU):
            if not self.with_role(role):
                raise ValueError(f"nodes: no node has the role {role.value!r}")
        return self

    def with_role(self, role: Role) -> tuple[Node, ...]:
        """The nodes that have ``role``, in the file's order."""
        return tuple(node for node in self.nodes if role in node.roles)

    def under(self, folder: Path) -> Site:
        """This site with its relative paths taken from ``folder`` (the site file's)."""
        hub = self.hub
        if hub.certificate is not None and hub.key is not None:
            hub = hub.model_copy(update={"certificate": folder / hub.certificate,
                                         "key": folder / hub.key})
        stack = self.stack.model_copy(update={"files": tuple(folder / f for f in self.stack.files)})
        return self.model_copy(update={"secrets": folder / self.secrets, "hub": hub,
                                       "stack": stack})


def load_site(path: Path) -> Site:
    """The site of the file ``path``, its paths absolute; :class:`SiteError` when it is not
    one (one line: ``FILE:LINE: KEY: PROBLEM; ...``)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SiteError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SiteError(f"{path}: not valid TOML: {exc}") from None
    try:
        # Strict on JSON input: TOML's types as they are ("443" is no port), paths as text.
        site = Site.model_validate_json(json.dumps(data, default=str), strict=True)
    except ValidationError as exc:
        raise SiteError(in_file(path, model_problems(Site, exc, key_lines(text)))) from None
    return site.under(path.resolve().parent)


def summary(site: Site) -> list[str]:
    """What ``swarm-gpu check`` prints: the site in a few lines."""
    lines = [f"stack {site.stack.name}: {', '.join(str(f) for f in site.stack.files)}",
             f"hub: {site.hub.url} (first admin {site.hub.first_admin}; certificate: "
             f"{site.hub.certificate or 'signed by the site CA'})"]
    lines += [f"node {node.name} ({node.address}): {', '.join(r.value for r in node.roles)}"
              for node in site.nodes]
    options = ", ".join(f"{k}={v}" for k, v in sorted(site.storage.options.items()))
    lines.append(f"users' volumes: driver {site.storage.driver}"
                 + (f" ({options})" if options else ""))
    images = site.images
    lines.append("images: " + ", ".join(images.reference(name) for name in
                                        (images.allocator, images.hub, images.notebook))
                 + f", {images.broker}")
    lines.append(f"secrets folder: {site.secrets}")
    return lines
