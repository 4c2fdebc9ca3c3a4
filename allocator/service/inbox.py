"""The allocator's inbox: deliveries not applied yet, in two lanes, and how to settle a batch.

Requests (everything that did not come through the nodes exchange) go ahead of node messages
that arrived before them: a spawn must not wait behind a backlog of heartbeats (a restart
leaves seconds of them in the queue; 5,000 hosts send 1,000 a second). That reorders nothing
anybody could rely on: the broker keeps no order between two publishers, and each lane keeps
its own arrival order, so one hub's requests stay in the order it sent them and so do one
agent's events and heartbeats (an event applied before the heartbeat sent ahead of it would
make a container look alive after its death). A batch takes up to ``batch_max`` of each
lane, so no stream of requests can starve liveness: node messages move as fast as they did
when a batch was ``batch_max`` messages of both kinds, in arrival order (faster, since
requests no longer take their places).

A batch is then no longer every unsettled delivery up to its last one, and one
``ack(multiple=True)`` on its last message could settle node messages still waiting here.
:func:`acknowledgements` says which acknowledgements settle exactly a batch: one ``multiple``
per channel for what lies below the oldest delivery still waiting, and one each above it.

Pure: no I/O, no clock, no asyncio.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
C = TypeVar("C", bound=Hashable)


class Inbox(Generic[T, C]):
    """Items in two first-in-first-out lanes, requests and node messages; each item with
    the (channel, delivery tag) that settles it, or None (a timer tick)."""

    def __init__(self) -> None:
        self._order = itertools.count()
        self._requests: deque[tuple[int, T, tuple[C, int] | None]] = deque()
        self._nodes: deque[tuple[int, T, tuple[C, int] | None]] = deque()

    def put(self, item: T, *, request: bool, delivery: tuple[C, int] | None = None) -> None:
        """Add ``item`` at the end of its lane."""
        (self._requests if request else self._nodes).append((next(self._order), item, delivery))

    def __len__(self) -> int:
        return len(self._requests) + len(self._nodes)

    def __iter__(self) -> Iterator[T]:
        """Every item waiting, requests first (each lane in arrival order)."""
        for _, item, _ in itertools.chain(self._requests, self._nodes):
            yield item

    def take(self, most: int) -> list[T]:
        """The oldest ``most`` items of each lane (at most), in the order they arrived."""
        taken = [self._requests.popleft() for _ in range(min(most, len(self._requests)))]
        taken += [self._nodes.popleft() for _ in range(min(most, len(self._nodes)))]
        taken.sort(key=lambda entry: entry[0])
        return [item for _, item, _ in taken]

    def oldest_deliveries(self) -> list[tuple[C, int]]:
        """The oldest waiting delivery of each lane (what :func:`acknowledgements` needs:
        a lane keeps arrival order, so nothing older waits behind it), on the channel of
        the deliveries since the last :meth:`keep_channel`."""
        oldest = []
        for lane in (self._requests, self._nodes):
            for _, _, delivery in lane:  # past the timer ticks at its head, if any
                if delivery is not None:
                    oldest.append(delivery)
                    break
        return oldest

    def keep_channel(self, channel: C) -> list[T]:
        """Remove and return the items delivered on any other channel (a channel closed by
        a reconnect: the broker has given its unsettled deliveries back to the queue)."""
        dropped: list[T] = []
        for lane in (self._requests, self._nodes):
            kept = [entry for entry in lane if entry[2] is None or entry[2][0] == channel]
            dropped += [entry[1] for entry in lane
                        if entry[2] is not None and entry[2][0] != channel]
            lane.clear()
            lane.extend(kept)
        return dropped


@dataclass(frozen=True)
class Acknowledgement(Generic[C]):
    """One ``basic.ack``: of delivery ``tag`` on ``channel``, or of every delivery up to it."""

    channel: C
    tag: int
    multiple: bool


def acknowledgements(applied: Iterable[tuple[C, int]], waiting: Iterable[tuple[C, int]]
                     ) -> list[Acknowledgement[C]]:
    """The fewest acknowledgements that settle the ``applied`` deliveries (channel, delivery
    tag) and none of those still ``waiting`` in the inbox.

    Relies on what the allocator keeps true: on each channel, every delivery older than the
    oldest one waiting has been applied (lanes keep arrival order, batches are settled one
    after the other), so a ``multiple`` acknowledgement up to the newest applied delivery
    below it settles only applied ones (and deliveries settled already, which it skips).
    Applied deliveries newer than the oldest waiting one (requests taken ahead of older node
    messages) are acknowledged one by one.
    """
    oldest_waiting: dict[C, int] = {}
    for channel, tag in waiting:
        if tag < oldest_waiting.get(channel, tag + 1):
            oldest_waiting[channel] = tag
    by_channel: dict[C, list[int]] = {}
    for channel, tag in applied:
        by_channel.setdefault(channel, []).append(tag)
    out: list[Acknowledgement[C]] = []
    for channel, tags in by_channel.items():
        limit = oldest_waiting.get(channel)
        below = [tag for tag in tags if limit is None or tag < limit]
        if below:
            out.append(Acknowledgement(channel, max(below), multiple=True))
        out.extend(Acknowledgement(channel, tag, multiple=False)
                   for tag in sorted(tag for tag in tags if limit is not None and tag > limit))
    return out
