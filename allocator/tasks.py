"""Background tasks: stopping them, bounded, and the doubling pause of their retry loops;
the allocator's service and the node agent alike.

Part of the allocator's public surface, so the node agent uses the same rules.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)


class Backoff:
    """The pause of a retry loop: ``first`` after the first failure, doubled after each
    further one up to ``cap``; :meth:`reset` starts over (after a success)."""

    def __init__(self, first: float, cap: float) -> None:
        self.first = first
        self.cap = cap
        self._pause = first

    def next(self) -> float:
        """The pause to wait now; the next one is twice it, at most ``cap``."""
        pause = self._pause
        self._pause = min(pause * 2, self.cap)
        return pause

    def reset(self) -> None:
        """The next pause is ``first`` again."""
        self._pause = self.first

STOP_WITHIN_S = 10.0
"""How long stopping waits for cancelled tasks before it gives up on them."""


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any] | None],
                          within: float = STOP_WITHIN_S) -> None:
    """Cancel every task, then wait (bounded) for them to end; their errors are not raised.

    All are cancelled before any is awaited, so one slow task does not delay the others'
    cancellation. The wait is bounded because a library call that swallows a cancellation
    (a broker client in the middle of connecting, say) must not hang a shutdown.
    """
    pending = {task for task in tasks if task is not None and not task.done()}
    for task in pending:
        task.cancel()
    if not pending:
        return
    done, stuck = await asyncio.wait(pending, timeout=within)
    for task in done:
        if not task.cancelled():
            task.exception()  # retrieved, so asyncio does not report it as never retrieved
    for task in stuck:
        log.warning("a task did not stop within %.0f s of its cancellation: %r", within, task)
