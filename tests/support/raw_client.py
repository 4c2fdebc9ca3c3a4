"""An RPC client that sends and reads raw JSON bodies, as a client of another release would."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aio_pika
import aio_pika.abc

from allocator.wire.topology import (
    DIRECT_REPLY_TO,
    RPC_EXCHANGE,
    RPC_ROUTING_KEY,
)


class RawClient:
    """A client written from docs/protocol.md alone: raw AMQP, with or without the
    ``swarm-gpu-release`` header; every answer on its direct reply-to address, in order."""

    def __init__(self, amqp_url: str, headers: dict[str, str] | None) -> None:
        self.amqp_url = amqp_url
        self.headers = headers
        self.answers: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._connection: aio_pika.abc.AbstractConnection | None = None
        self._exchange: aio_pika.abc.AbstractExchange | None = None
        self._calls = 0

    async def __aenter__(self) -> RawClient:
        self._connection = await aio_pika.connect(self.amqp_url, timeout=10)
        channel = await self._connection.channel()

        async def on_answer(answer: aio_pika.abc.AbstractIncomingMessage) -> None:
            await self.answers.put(json.loads(answer.body))

        replies = await channel.get_queue(DIRECT_REPLY_TO, ensure=False)
        await replies.consume(on_answer, no_ack=True)
        self._exchange = await channel.get_exchange(RPC_EXCHANGE, ensure=False)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._connection is not None:
            await self._connection.close()

    async def call(self, **body: object) -> dict[str, Any]:
        """Publish one request; its answer."""
        assert self._exchange is not None
        self._calls += 1
        await self._exchange.publish(
            aio_pika.Message(json.dumps({"v": 1, **body}).encode(),
                             correlation_id=f"c{self._calls}", reply_to=DIRECT_REPLY_TO,
                             content_type="application/json",
                             headers=dict[str, Any](self.headers) if self.headers else None),
            routing_key=RPC_ROUTING_KEY)
        return await self.next_answer()

    async def next_answer(self) -> dict[str, Any]:
        return await asyncio.wait_for(self.answers.get(), 10)
