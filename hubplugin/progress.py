"""What the spawn page shows while a server starts: the GPU request, its queue position.

JupyterHub reads a spawner's ``progress()`` as an async iterator of events
(``{"message": ..., "progress": 0-100}``) while ``start`` runs; :class:`SpawnProgress` holds the
events ``start`` emits and gives them out in order until the start ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["SpawnProgress", "queue_message"]

POLL_S = 0.2
"""How often a reader of the events looks for new ones while the start runs (seconds)."""


class SpawnProgress:
    """The progress events of one start, read by JupyterHub while the start runs."""

    def __init__(self) -> None:
        self._events: list[dict[str, Any]] = []
        self._done = True

    def begin(self) -> None:
        """A start begins: forget the last start's events."""
        self._events = []
        self._done = False

    def end(self) -> None:
        """The start ended (granted, failed or cancelled): readers stop after what they saw."""
        self._done = True

    def emit(self, message: str, progress: int | None = None) -> dict[str, Any]:
        """Add one event (``progress`` in percent, when known); returns it."""
        event: dict[str, Any] = {"message": message}
        if progress is not None:
            event["progress"] = progress
        self._events.append(event)
        return event

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """Every event of this start in order, until the start ends."""
        seen = 0
        while True:
            while seen < len(self._events):
                yield self._events[seen]
                seen += 1
            if self._done:
                return
            await asyncio.sleep(POLL_S)


def queue_message(position: int | None, wait_s: float) -> str:
    """The progress message of a queued request."""
    where = f"position {position}" if position else "waiting"
    return f"No GPU free yet: queued ({where}); waiting up to {wait_s:g} s for one to free up"
