"""Pure: each user's files in a Docker volume of their own, mounted at the notebook's work dir.

A notebook service mounts the named volume ``user_volume`` (a template such as
``swarm-gpu-home-{username}``; ``{username}`` is dockerspawner's escaped name, lower-case
letters, digits and ``-`` escapes, so two users never share a volume and every name is one
Docker accepts). The site's volume driver and its options (NFS through ``local``, or a
plugin's) make the volume reachable from every node, so the files outlive a stop, a reclaim
and a move to another node; without a driver it is Docker's ``local`` volume of the node
the server runs on.

The mount is written in the Engine API's own form (``Type: volume``), never as
dockerspawner's ``volumes``: ``SwarmSpawner`` turns those into mounts of type *bind*, which
the engine refuses for a volume's name. ``VolumeOptions.DriverConfig`` is set only when a
driver (or driver options) is given, so a site without one gets the engine's default.

The settings come from the spawner's traits; :func:`user_volume_from_env` reads them from
:data:`VOLUME_VARIABLE`, :data:`DRIVER_VARIABLE` and :data:`OPTIONS_VARIABLE` for the
example configuration.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DEFAULT_TARGET", "DEFAULT_TEMPLATE", "DRIVER_VARIABLE", "OPTIONS_VARIABLE",
    "VOLUME_VARIABLE", "UserVolume", "VolumeSettingError", "check_template",
    "user_volume_from_env", "user_volume_mount", "volume_name",
]

VOLUME_VARIABLE = "SWARM_GPU_USER_VOLUME"
"""The volume's name template (``{username}``); empty: no volume."""
DRIVER_VARIABLE = "SWARM_GPU_USER_VOLUME_DRIVER"
"""The volume driver (empty: the engine's default, ``local``)."""
OPTIONS_VARIABLE = "SWARM_GPU_USER_VOLUME_OPTIONS"
"""The driver's options, a JSON object of strings, e.g.
``{"type": "nfs", "o": "addr=10.0.0.5,rw", "device": ":/export/home/{username}"}``."""

DEFAULT_TEMPLATE = "swarm-gpu-home-{username}"
DEFAULT_TARGET = "/home/jovyan/work"
"""The Jupyter Docker Stacks' work dir, where the notebook opens."""

# What the engine accepts as a volume's name (daemon/names: RestrictedNamePattern).
_VOLUME_NAME = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.-]+$")
_SAMPLE_USER = "user-2dname"  # an escaped name with the escape character in it


class VolumeSettingError(ValueError):
    """The users' volume settings cannot make a volume or its mount."""


@dataclass(frozen=True)
class UserVolume:
    """The site's users' volumes: the name template, driver and options, mount point."""

    template: str
    driver: str = ""
    options: dict[str, str] = field(default_factory=dict)
    target: str = DEFAULT_TARGET


def _fill(text: str, username: str) -> str:
    # str.replace rather than format(): a template with other braces must not raise, nor
    # reach attributes of the argument ({username.__class__})
    return text.replace("{username}", username)


def check_template(template: str) -> str:
    """``template`` if it makes a valid volume name and names the user, else the reason
    (:class:`VolumeSettingError`)."""
    if "{username}" not in template:
        raise VolumeSettingError(
            f"the users' volume {template!r} has no {{username}}: every user would share it")
    sample = _fill(template, _SAMPLE_USER)
    if not _VOLUME_NAME.match(sample):
        raise VolumeSettingError(
            f"the users' volume {template!r} makes names like {sample!r}, which Docker "
            "refuses (letters, digits, '_', '.', '-'; first a letter or digit)")
    return template


def volume_name(template: str, escaped_username: str) -> str:
    """The volume of the user whose dockerspawner-escaped name is ``escaped_username``."""
    name = _fill(check_template(template), escaped_username)
    if not _VOLUME_NAME.match(name):
        raise VolumeSettingError(f"{name!r} is no valid Docker volume name")
    return name


def user_volume_mount(volume: UserVolume, escaped_username: str) -> dict[str, Any]:
    """The Swarm ``ContainerSpec.Mounts`` entry for the user's volume: type ``volume``, its
    name as ``Source``, the work dir as ``Target``; ``{username}`` in the driver's option
    values is the user's escaped name too (an NFS export per user)."""
    if not volume.target.startswith("/"):
        raise VolumeSettingError(f"the users' volume's mount point {volume.target!r} is not "
                                 "an absolute path")
    mount: dict[str, Any] = {
        "Type": "volume",
        "Source": volume_name(volume.template, escaped_username),
        "Target": volume.target,
    }
    if volume.driver or volume.options:
        mount["VolumeOptions"] = {"DriverConfig": {
            "Name": volume.driver or "local",
            "Options": {key: _fill(value, escaped_username)
                        for key, value in volume.options.items()},
        }}
    return mount


def user_volume_from_env(environ: Mapping[str, str],
                         default_template: str = DEFAULT_TEMPLATE) -> UserVolume | None:
    """The users' volumes from :data:`VOLUME_VARIABLE` (unset: ``default_template``; empty:
    None, no volume), :data:`DRIVER_VARIABLE` and :data:`OPTIONS_VARIABLE` (a JSON object of
    strings). A wrong value is an error that names its variable."""
    template = environ.get(VOLUME_VARIABLE, default_template).strip()
    if not template:
        return None
    try:
        check_template(template)
    except VolumeSettingError as exc:
        raise VolumeSettingError(f"{VOLUME_VARIABLE}: {exc}") from None
    text = environ.get(OPTIONS_VARIABLE, "").strip()
    try:
        options = json.loads(text) if text else {}
    except ValueError as exc:
        raise VolumeSettingError(f"{OPTIONS_VARIABLE}: not JSON ({exc})") from None
    if not isinstance(options, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in options.items()):
        raise VolumeSettingError(f"{OPTIONS_VARIABLE}: not a JSON object of strings: {text}")
    return UserVolume(template=template, driver=environ.get(DRIVER_VARIABLE, "").strip(),
                      options=options)
