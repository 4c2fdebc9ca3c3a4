"""Deciding a batch in memory: each message checked, decoded and handed to the engine, each
tick run, and what each message is to be answered once the batch is committed.

Before the engine sees a message: a redelivery of a request decided already is dropped
(:mod:`allocator.service.decided`), a ``reply_to`` that is no direct reply-to address is
refused to the dead-letter queue, a body that does not parse is answered (or dead-lettered
when nobody waits for an answer), and a request past its deadline is dropped unanswered.
Nothing here talks to the broker or the ledger: the batch's changes are committed, and its
answers sent, by :mod:`allocator.service.batch`.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable

import aio_pika.abc

from allocator.config import AllocatorSettings
from allocator.engine import Engine, Sender
from allocator.ledger.changes import Changes
from allocator.metrics.counters import Count, Family, ServiceStats
from allocator.service.answers import Pending
from allocator.service.decided import DecidedRequests, RequestId
from allocator.service.intake import TICK
from allocator.wire.protocol import (
    MAX_BODY_BYTES,
    MAX_NAME,
    PRINTABLE,
    AgentCommand,
    AllocateRequest,
    ErrorCode,
    ErrorReply,
    LeaseReply,
    LeaseState,
    ReleaseRequest,
    StatusRequest,
    decode_inbound,
    error_reply,
)
from allocator.wire.topology import NODES_EXCHANGE, is_direct_reply_to

log = logging.getLogger(__name__)


def request_id(message: aio_pika.abc.AbstractIncomingMessage) -> RequestId:
    """What identifies one call of a caller's: its broker user, reply address and correlation
    id (a retry of the call has a new correlation id)."""
    return (message.user_id or "", message.reply_to or "", message.correlation_id or "")


def wants_reply(message: aio_pika.abc.AbstractIncomingMessage) -> bool:
    """Whether the sender waits for an answer (it gave a reply address and correlation id)."""
    return bool(message.reply_to and message.correlation_id)


def heartbeat_host(body: bytes) -> str | None:
    """The host a heartbeat (full or delta) that did not decode names, if that much can be
    read: a JSON object whose ``kind`` is a heartbeat's and whose ``host`` is a printable
    name. None otherwise (the message is refused as before)."""
    if len(body) > MAX_BODY_BYTES:
        return None  # a heartbeat is never this large; not worth parsing
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict) or data.get("kind") not in ("heartbeat", "heartbeat_delta"):
        return None
    host = data.get("host")
    if (not isinstance(host, str) or not 0 < len(host) <= MAX_NAME
            or not re.fullmatch(PRINTABLE, host)):
        return None
    return host


class Poisoned(Exception):
    """The engine raised on the batch's item at ``index``; the engine's memory holds part of
    what the batch did and must be rebuilt before anything else is applied."""

    def __init__(self, index: int):
        super().__init__(index)
        self.index = index


class Decider:
    """Applies a batch to the engine and remembers the requests decided lately."""

    def __init__(self, settings: AllocatorSettings, engine: Engine, stats: ServiceStats,
                 clock: Callable[[], float]) -> None:
        self.settings = settings
        self._engine = engine
        self._stats = stats
        self._clock = clock
        self._decided = DecidedRequests()
        """Requests decided and committed lately: their redeliveries are not decided again."""

    def decide(self, batch: list[object], poisoned: dict[int, Pending | None]
               ) -> tuple[Changes, list[Pending]]:
        """Apply ``batch`` to the engine: its change set, and what to answer each message.

        The items at the indexes in ``poisoned`` are not applied again: each is answered as
        ``poisoned`` says (None: not at all). Raises :class:`Poisoned` when the engine fails.
        """
        changes = Changes()
        self._engine.commands.clear()  # only this batch's own decisions go out after its commit
        pending: list[Pending] = []
        for index, item in enumerate(batch):
            if index in poisoned:
                refused = poisoned[index]
                if refused is not None:
                    pending.append(refused)
                continue
            now = self._clock()
            try:
                if item is TICK:
                    self._engine.tick(now, changes)
                    continue
                assert isinstance(item, aio_pika.abc.AbstractIncomingMessage)
                pending.append(self._message(item, now, changes))
            except Exception as exc:
                raise Poisoned(index) from exc
        return changes, pending

    def refused(self, item: object) -> Pending | None:
        """How to answer a message the engine failed on (None for a failed tick)."""
        if not isinstance(item, aio_pika.abc.AbstractIncomingMessage):
            return None
        if not wants_reply(item):
            return Pending(item, None, dead_letter=True)
        return Pending(item, error_reply(
            ErrorCode.INTERNAL_ERROR,
            "the allocator failed on this request and did nothing with it; the allocator's "
            "log says why"))

    def take_commands(self) -> list[AgentCommand]:
        """The commands to node agents the last batch decided (sent after its commit)."""
        return self._engine.take_agent_commands()

    def hellos_not_sent(self, hosts: list[str]) -> None:
        """The hellos to these hosts' agents did not go out: greet them again."""
        self._engine.hellos_not_sent(hosts)

    def committed(self, pending: list[Pending], at: float) -> None:
        """The batch of ``pending`` is committed (``at``, ``time.monotonic()``): its requests
        are decided, and a redelivery of one is not decided again."""
        self._decided.forget_expired(at)
        for entry in pending:
            if wants_reply(entry.message):
                self._decided.add(request_id(entry.message), at)

    def _message(self, message: aio_pika.abc.AbstractIncomingMessage, now: float,
                 changes: Changes) -> Pending:
        self._stats.counters.add(Count.RECEIVED)
        replies = wants_reply(message)
        if replies and message.redelivered and request_id(message) in self._decided:
            # Decided, committed and answered already; its acknowledgement was lost with a
            # broker node. Its caller may have released the lease since: deciding it again
            # would grant that request key a lease nobody holds.
            self._stats.counters.add(Count.REDELIVERED_DECIDED)
            log.info("dropped a redelivered request decided already (correlation id %s)",
                     (message.correlation_id or "")[:40])
            return Pending(message, None)
        if replies and not self._may_reply_to(message.reply_to or ""):
            # Publishing there would let any sender make the allocator write into a queue of
            # its choosing (its own inbound queue included): refuse unanswered, keep it for a
            # person in the dead-letter queue, and count it.
            self._stats.counters.add(Count.REPLY_TO_REFUSED)
            log.warning("refused a message whose reply_to %r is not a direct reply-to address",
                        (message.reply_to or "")[:100])
            return Pending(message, None, dead_letter=True)
        decoded = decode_inbound(message.body)
        if isinstance(decoded, ErrorReply):
            self._stats.counters.add_to(Family.INVALID_MESSAGE, decoded.error.code.value)
            if not replies and message.exchange == NODES_EXCHANGE:
                host = heartbeat_host(message.body)
                sender = Sender(user_id=message.user_id, via_nodes_exchange=True)
                if host is not None and self._engine.unreadable_heartbeat(host, sender, now,
                                                                         changes):
                    # A sign of life, yet refused as before: dead-lettered for a person to
                    # read (that queue is bounded, drop-head), counted and logged (first and
                    # every 1000th) by the engine.
                    log.debug("refused a heartbeat of %s: %s", host, decoded.error.message)
                    return Pending(message, None, dead_letter=True)
            log.info("refused a message: %s", decoded.error.message)
            if not replies:
                return Pending(message, None, dead_letter=True)
            return Pending(message, decoded)
        deadline = getattr(decoded, "deadline", None)
        if deadline is not None and now > deadline:
            # The caller gave up already; granting now would leak a lease nobody holds.
            self._stats.counters.add(Count.EXPIRED_DROPPED)
            return Pending(message, None, kind=decoded.kind)
        sender = Sender(user_id=message.user_id,
                        via_nodes_exchange=message.exchange == NODES_EXCHANGE)
        reply = self._engine.handle(decoded, sender, now, changes)
        entry = Pending(message, reply if replies else None, kind=decoded.kind)
        if (replies and isinstance(decoded, AllocateRequest | StatusRequest)
                and isinstance(reply, LeaseReply) and reply.lease.state is LeaseState.QUEUED):
            entry.waits = reply.lease.lease_id
        if (isinstance(decoded, StatusRequest | ReleaseRequest) and isinstance(reply, ErrorReply)
                and reply.error.code is ErrorCode.NOT_FOUND):
            entry.lookup = (decoded.lease_id, decoded.request_key)
        return entry

    def _may_reply_to(self, address: str) -> bool:
        """Whether a reply may be published to ``address`` (see ``reply_to_prefix``)."""
        prefix = self.settings.reply_to_prefix
        return is_direct_reply_to(address) or (prefix is not None and address.startswith(prefix))
