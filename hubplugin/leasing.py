"""The hub's side of one GPU request: ask, wait in the queue, and say so meanwhile.

The conversation with the allocator (docs/design.md, flows 1 and 5) without the spawner's
state: :func:`lease_gpus` sends ``allocate`` and, when the answer is ``queued``, waits for the
grant, telling ``report`` the queue position whenever it changes. The spawner keeps the lease
id and request key and turns errors into pages (:mod:`hubplugin.errors`). Also here: the
hub's one RPC client per event loop, and releases that outlive a cancelled spawn.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

from allocator.amqp.client import AllocatorClient, AllocatorError, StillQueued
from allocator.wire.protocol import AllocateRequest, ErrorCode, Lease

from .progress import queue_message

__all__ = [
    "effective_wait",
    "lease_gpus",
    "run_detached",
    "shared_client",
]

START_ROOM_S = 30.0
"""Seconds of the hub's ``start_timeout`` kept for creating the service after the wait."""


def effective_wait(wait_s: float, start_timeout: float) -> float:
    """How long a request may wait in the queue: ``wait_s``, but never so long that the
    hub's own ``start_timeout`` runs out before the service is created."""
    return max(0.0, min(wait_s, start_timeout - START_ROOM_S))


async def lease_gpus(
    client: AllocatorClient,
    request: AllocateRequest,
    *,
    recheck_s: float,
    on_lease: Callable[[Lease], None],
    report: Callable[[str], None],
) -> Lease:
    """Ask for ``request`` and wait for the grant; the granted (or bound) lease.

    A queued request's grant is pushed by the allocator the moment it is decided (no
    polling; ``recheck_s``: see :meth:`AllocatorClient.allocate_and_wait`). ``on_lease`` sees
    every lease the allocator answers (the queued one first), so the caller knows the lease id
    before the wait ends. ``report`` gets a message for each new queue position. A wait that
    ends without a GPU is ``no_capacity`` saying how long it waited; any other allocator error
    is raised as it came.
    """
    wait = request.wait_s
    shown: list[int | None] = []

    def on_queued(lease: Lease) -> None:
        on_lease(lease)
        if not shown or lease.queue_position != shown[-1]:
            shown.append(lease.queue_position)
            report(queue_message(lease.queue_position, wait))

    try:
        lease = await client.allocate_and_wait(request, recheck_s=recheck_s,
                                               on_queued=on_queued)
    except StillQueued:
        raise AllocatorError(ErrorCode.NO_CAPACITY, f"none became free within {wait:g} s") from None
    except AllocatorError as exc:
        if exc.code is not ErrorCode.NO_CAPACITY or not shown:
            raise
        raise AllocatorError(
            ErrorCode.NO_CAPACITY,
            f"none became free while you waited {wait:g} s in the queue",
        ) from None
    on_lease(lease)
    return lease


_BACKGROUND: set[asyncio.Future[None]] = set()
"""Tasks started by :func:`run_detached`, kept referenced until they finish."""


def run_detached(call: Coroutine[Any, Any, None]) -> None:
    """Run ``call`` in a task of its own that a cancellation of the caller cannot interrupt."""
    task = asyncio.ensure_future(call)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


_CLIENTS: weakref.WeakKeyDictionary[
    asyncio.AbstractEventLoop, dict[tuple[str, float, float], AllocatorClient]
] = weakref.WeakKeyDictionary()


def shared_client(url: str, timeout_s: float, connect_timeout_s: float) -> AllocatorClient:
    """The hub's RPC client for these settings: one per event loop, shared by all spawners."""
    clients = _CLIENTS.setdefault(asyncio.get_running_loop(), {})
    key = (url, timeout_s, connect_timeout_s)
    client = clients.get(key)
    if client is None:
        client = clients[key] = AllocatorClient(
            url, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s
        )
    return client
