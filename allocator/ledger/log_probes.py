"""One-off reads of the ledger log's stream, each on a channel of its own, beside the
replica's consumer (:mod:`allocator.ledger.replication`): whether the stream exists, its
oldest entry, and where its newest whole snapshot starts."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aio_pika
import aio_pika.abc

from allocator.ledger.log_entries import BrokenEntry, Entry, decode_entry

OldestEntry = tuple[int, Entry | None]
"""The stream's oldest entry kept: its offset, and the entry (None: not readable as one)."""


def offset_of(message: aio_pika.abc.AbstractIncomingMessage) -> int:
    """The stream offset RabbitMQ gives a delivered entry (-1 when missing)."""
    return int((message.headers or {}).get("x-stream-offset", -1))  # type: ignore[arg-type]


async def stream_exists(connection: aio_pika.abc.AbstractConnection, stream: str) -> bool:
    """Whether the stream has been declared (a passive declaration of a queue that does not
    exist closes its channel, hence a channel of its own)."""
    channel = await connection.channel()
    try:
        await channel.declare_queue(stream, passive=True)
    except aio_pika.exceptions.ChannelNotFoundEntity:
        return False
    finally:
        with contextlib.suppress(Exception):
            await channel.close()
    return True


async def oldest_entry(connection: aio_pika.abc.AbstractConnection, stream: str,
                       timeout_s: float, unless: asyncio.Event) -> OldestEntry | None:
    """The stream's oldest entry kept; None when none came within ``timeout_s`` or
    ``unless`` was set first. Broker errors (AMQP, OS) are raised."""
    first: asyncio.Future[OldestEntry] = asyncio.get_running_loop().create_future()

    # Never acknowledged: with a prefetch of one, one entry is all this channel receives, and
    # an ack racing the channel's close would close the whole connection (a frame on a closed
    # channel is a connection error).
    async def oldest(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        if first.done():
            return
        try:
            first.set_result((offset_of(message), decode_entry(message.body)))
        except BrokenEntry:  # the applier stops on it in its turn
            first.set_result((offset_of(message), None))

    given_up = asyncio.ensure_future(unless.wait())
    channel = await connection.channel()
    try:
        await channel.set_qos(prefetch_count=1)
        queue = await channel.declare_queue(stream, passive=True)
        await queue.consume(oldest, arguments={"x-stream-offset": "first"})
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                either: list[asyncio.Future[Any]] = [first, given_up]
                await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    finally:
        given_up.cancel()
        with contextlib.suppress(Exception):
            await channel.close()
    return first.result() if first.done() and not unless.is_set() else None


async def newest_snapshot_start(connection: aio_pika.abc.AbstractConnection, stream: str,
                                log_id: str, timeout_s: float) -> int | None:
    """Where the newest whole snapshot starts, as the stream's newest entry says (None: it
    says nothing, is of another log, or is not an entry). Broker errors and a timeout are
    raised."""
    found: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()

    async def newest(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        with contextlib.suppress(Exception):
            await message.ack()
        if not found.done():
            try:
                entry = decode_entry(message.body)
            except BrokenEntry:  # not an entry: no pointer
                found.set_result(None)
                return
            found.set_result(entry.snapshot_from if entry.log_id == log_id else None)

    channel = await connection.channel()
    try:
        await channel.set_qos(prefetch_count=10)
        queue = await channel.declare_queue(stream, passive=True)
        await queue.consume(newest, arguments={"x-stream-offset": "last"})
        async with asyncio.timeout(timeout_s):
            return await found
    finally:
        with contextlib.suppress(Exception):
            await channel.close()
