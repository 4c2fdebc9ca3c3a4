"""One declarer of the broker's exchanges and queues, from their specs
(:class:`~allocator.wire.topology.ExchangeSpec`, :class:`~allocator.wire.topology.QueueSpec`),
and of what a caller lives with when the broker refuses a declaration.

RabbitMQ answers a declaration it refuses by closing the channel, for one of two reasons:

- ``ACCESS_REFUSED``: the broker user may not configure that name (a least-privilege user, or
  definitions that an older release rendered);
- ``PRECONDITION_FAILED``: it exists with other arguments (declared by an older release, by
  hand, or with other settings).

Each caller says which refusals it lives with (:class:`Tolerate`) and how: use what exists as
it is (a passive declaration on a fresh channel, which needs no permission and fails if there
is nothing), or go on without it. Any other refusal, and any other error, is raised.

Public surface: the node agent declares with it too. It imports only
:mod:`allocator.wire.topology`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

import aio_pika
import aio_pika.abc
import aiormq.exceptions

from allocator.wire.topology import ExchangeSpec, QueueSpec

T = TypeVar("T")

ChannelOpener = Callable[[], Awaitable[aio_pika.abc.AbstractChannel]]
"""Opens a fresh channel, as the caller wants its channels (confirms, returns)."""


class Refusal(Enum):
    """Why the broker refused a declaration."""

    ACCESS = "ACCESS_REFUSED"
    """The broker user may not configure the name."""
    PRECONDITION = "PRECONDITION_FAILED"
    """It exists with another type or other arguments."""


class OnRefusal(Enum):
    """What a caller does after a refusal it lives with."""

    PASSIVE = "passive"
    """Use it as it exists: a passive declaration on a fresh channel."""
    REPORT = "report"
    """Go on without it: the answer's ``value`` is None, its ``reason`` says why."""


@dataclass(frozen=True)
class Tolerate:
    """A refusal a caller lives with, and what it does then."""

    refusal: Refusal
    then: OnRefusal
    only_if: tuple[str, ...] = ()
    """Only when the broker's reason names one of these (the arguments a caller knows may
    differ); empty: whatever the reason."""

    def covers(self, refusal: Refusal, reason: str) -> bool:
        """Whether this rule applies to ``refusal`` for ``reason`` (the broker's text)."""
        return refusal is self.refusal and (
            not self.only_if or any(name in reason for name in self.only_if))


@dataclass(frozen=True)
class Declared(Generic[T]):
    """What a declaration gave: the exchange or queue, and the channel it is on.

    After a refusal the caller lived with, ``refusal`` and ``reason`` (the broker's text) say
    which; ``value`` and ``channel`` are then the passive declaration's (:attr:`OnRefusal.PASSIVE`)
    or None (:attr:`OnRefusal.REPORT`: the refused channel is closed).
    """

    value: T | None
    channel: aio_pika.abc.AbstractChannel | None
    refusal: Refusal | None = None
    reason: str = ""


def _refusal_of(exc: Exception) -> Refusal | None:
    if isinstance(exc, aiormq.exceptions.ChannelAccessRefused):
        return Refusal.ACCESS
    if isinstance(exc, aiormq.exceptions.ChannelPreconditionFailed):
        return Refusal.PRECONDITION
    return None


async def _declare(open_channel: ChannelOpener, channel: aio_pika.abc.AbstractChannel | None,
                   declare: Callable[[aio_pika.abc.AbstractChannel], Awaitable[T]],
                   passive: Callable[[aio_pika.abc.AbstractChannel], Awaitable[T]],
                   tolerate: Sequence[Tolerate]) -> Declared[T]:
    channel = channel if channel is not None else await open_channel()
    try:
        return Declared(await declare(channel), channel)
    except (aiormq.exceptions.ChannelAccessRefused,
            aiormq.exceptions.ChannelPreconditionFailed) as exc:
        refusal, reason = _refusal_of(exc), str(exc)
        assert refusal is not None
        rule = next((t for t in tolerate if t.covers(refusal, reason)), None)
        if rule is None:
            raise
    # The refusal closed the channel: nothing more goes on it.
    if rule.then is OnRefusal.REPORT:
        with contextlib.suppress(Exception):
            await channel.close()
        return Declared(None, None, refusal, reason)
    fresh = await open_channel()
    return Declared(await passive(fresh), fresh, refusal, reason)


async def declare_exchange(
    open_channel: ChannelOpener, spec: ExchangeSpec, *, tolerate: Sequence[Tolerate] = (),
    channel: aio_pika.abc.AbstractChannel | None = None,
) -> Declared[aio_pika.abc.AbstractExchange]:
    """Declare the exchange of ``spec`` on ``channel`` (or a fresh one), living with the
    refusals in ``tolerate``."""
    async def declare(on: aio_pika.abc.AbstractChannel) -> aio_pika.abc.AbstractExchange:
        return await on.declare_exchange(spec.name, aio_pika.ExchangeType(spec.type),
                                         durable=spec.durable)

    async def passive(on: aio_pika.abc.AbstractChannel) -> aio_pika.abc.AbstractExchange:
        return await on.declare_exchange(spec.name, passive=True)

    return await _declare(open_channel, channel, declare, passive, tolerate)


async def declare_queue(
    open_channel: ChannelOpener, spec: QueueSpec, *, tolerate: Sequence[Tolerate] = (),
    channel: aio_pika.abc.AbstractChannel | None = None,
) -> Declared[aio_pika.abc.AbstractQueue]:
    """Declare the queue of ``spec`` on ``channel`` (or a fresh one), living with the refusals
    in ``tolerate``."""
    async def declare(on: aio_pika.abc.AbstractChannel) -> aio_pika.abc.AbstractQueue:
        return await on.declare_queue(spec.name, durable=spec.durable,
                                      arguments=spec.arguments)

    async def passive(on: aio_pika.abc.AbstractChannel) -> aio_pika.abc.AbstractQueue:
        return await on.declare_queue(spec.name, passive=True)

    return await _declare(open_channel, channel, declare, passive, tolerate)
