"""Spawner settings changed for one server and put back afterwards.

Two kinds, both on traits the admin configured:

- a profile's ``spawner_override`` (:func:`profile_settings` computes the values, pure): set
  when a server starts with the profile and undone when the next start begins, so the
  running server's spawner shows the settings it was started with;
- the Swarm service parts for one start (:func:`settings_swapped`): the admin's own values
  come back as soon as ``start`` returns, so a lease's labels and placement never leak into
  the next start.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from traitlets import HasTraits

__all__ = ["OverrideError", "SavedSettings", "profile_settings", "settings_swapped"]


class OverrideError(ValueError):
    """A profile overrides a setting the spawner does not have."""


def profile_settings(
    override: Mapping[str, Any],
    current: Callable[[str], Any],
    known: Callable[[str], bool],
    spawner: Any,
) -> dict[str, Any]:
    """The values a profile's ``spawner_override`` gives the spawner's settings.

    A callable value is called with the spawner (as kubespawner's ``kubespawner_override``);
    a dict over a dict setting is merged into it, so a profile adds to the admin's
    ``environment`` instead of replacing it. ``current`` reads a setting, ``known`` says
    whether the spawner has it.
    """
    values: dict[str, Any] = {}
    for name, value in override.items():
        if not known(name):
            raise OverrideError(f"unknown setting {name!r}")
        if callable(value):
            value = value(spawner)
        now = current(name)
        if isinstance(value, dict) and isinstance(now, dict):
            value = {**now, **value}
        values[name] = value
    return values


class SavedSettings:
    """Settings set on an object, with what they were before, until :meth:`restore`."""

    def __init__(self) -> None:
        self._saved: dict[str, Any] = {}

    def apply(self, target: HasTraits, values: Mapping[str, Any]) -> None:
        """Set ``values`` on ``target`` (after putting back what an earlier apply set)."""
        self.restore(target)
        for name, value in values.items():
            self._saved[name] = copy.deepcopy(getattr(target, name))
            setattr(target, name, value)

    def restore(self, target: HasTraits) -> None:
        """Put back what :meth:`apply` changed (a no-op when nothing is set)."""
        saved, self._saved = self._saved, {}
        for name, value in saved.items():
            setattr(target, name, value)


@contextmanager
def settings_swapped(target: Any, values: Mapping[str, Any]) -> Iterator[None]:
    """``values`` set on ``target`` for the ``with`` block, the old values back after it."""
    saved = {name: getattr(target, name) for name in values}
    for name, value in values.items():
        setattr(target, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(target, name, value)
