"""The allocator's commands to node agents (stop a lease's container; the hello that says what
this allocator reads), published to the agents exchange after the commit that decided them,
before the batch's replies.

Fire-and-forget, each bounded in time: a command that cannot be published is logged and
counted and never fails the batch (the decision is committed; Swarm still stops the task,
later, and a container that heartbeats keep listing is asked again).
"""

from __future__ import annotations

import asyncio
import logging
import time

import aio_pika
import aio_pika.abc

from allocator.config import AllocatorSettings
from allocator.logs import lease_context
from allocator.metrics.counters import Count, ServiceStats
from allocator.wire.protocol import AgentCommand, AllocatorHello, StopContainer, encode
from allocator.wire.topology import command_routing_key

log = logging.getLogger(__name__)


class Commands:
    """Sends commands on the agents exchange, as the allocator's broker user."""

    def __init__(self, settings: AllocatorSettings, stats: ServiceStats, user_id: str
                 ) -> None:
        self.settings = settings
        self._stats = stats
        self._user_id = user_id
        """The AMQP user_id of every command, which the broker verifies and the agents check."""
        self._exchange: aio_pika.abc.AbstractExchange | None = None
        """The agents exchange on the command channel; None: stop commands cannot be sent
        (before :meth:`attach`, or the broker refused its declaration)."""

    def attach(self, exchange: aio_pika.abc.AbstractExchange | None) -> None:
        """Send commands on ``exchange`` from now on (None: stop commands are off)."""
        self._exchange = exchange

    async def send(self, commands: list[AgentCommand]) -> list[str]:
        """Publish the batch's commands to the agents (after the commit, never before).

        Not mandatory and not persistent: an agent whose queue does not exist (agent down) is
        simply not stopping anything, and Swarm stops the task as before.

        Returns the hosts whose hello could not be published, so that the engine greets their
        agents again at their next message (a hello is decided once per agent and load: one
        lost to a broker hiccup would otherwise leave that agent on what an allocator before
        0.2.0 reads until the next restart). Not the hellos dropped because the agents exchange
        is off: sending them again could not work either.
        """
        exchange = self._exchange
        if exchange is None:
            # The agents keep to what an allocator before 0.2.0 reads: nothing to count or
            # log for the hellos beyond the error at start.
            commands = [c for c in commands if isinstance(c, StopContainer)]
        if not commands:
            return []
        counters = self._stats.counters
        if exchange is None:
            counters.add(Count.COMMAND_FAILURES, len(commands))
            log.warning("%d stop command(s) not sent: stop commands are off (see the error "
                        "at start)", len(commands))
            return []
        # One bound for the whole batch, so that a broker that stopped answering delays the
        # batch's replies by request_timeout_s at most, however many commands it decided.
        give_up = time.monotonic() + self.settings.request_timeout_s
        not_greeted: list[str] = []
        for index, command in enumerate(commands):
            remaining = give_up - time.monotonic()
            if remaining <= 0:
                counters.add(Count.COMMAND_FAILURES, len(commands) - index)
                log.warning("gave up sending %d command(s) to node agents: the broker does "
                            "not take them", len(commands) - index)
                return not_greeted + [c.host for c in commands[index:]
                                      if isinstance(c, AllocatorHello)]
            try:
                await exchange.publish(self._message(command),
                                       routing_key=command_routing_key(command.host),
                                       mandatory=False, timeout=remaining)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never fail the batch: the decision is committed
                counters.add(Count.COMMAND_FAILURES)
                _log_failure(command, exc)
                if isinstance(command, AllocatorHello):
                    not_greeted.append(command.host)
                continue
            counters.add(Count.HELLOS_SENT if isinstance(command, AllocatorHello)
                         else Count.COMMANDS_SENT)
            _log_sent(command)
        return not_greeted

    def _message(self, command: AgentCommand) -> aio_pika.Message:
        return aio_pika.Message(
            body=encode(command),
            content_type="application/json",
            type=command.kind,
            user_id=self._user_id,
            delivery_mode=aio_pika.DeliveryMode.NOT_PERSISTENT,
        )


def _log_sent(command: AgentCommand) -> None:
    if isinstance(command, AllocatorHello):
        # Once per agent and load: the agent may send what this allocator reads from now on.
        log.info("told the agent of %s that this allocator reads %s", command.host,
                 ", ".join(command.reads) or "nothing optional")
        return
    log.info("asked %s to stop container %s of lease %s (%s, grace %g s)",
             command.host, command.container_id[:12], command.lease_id,
             command.reason.value, command.grace_s,
             extra=lease_context(command.lease_id, command.host))


def _log_failure(command: AgentCommand, exc: BaseException) -> None:
    why = exc or type(exc).__name__
    if isinstance(command, StopContainer):
        log.warning("could not ask %s to stop container %s (lease %s): %s",
                    command.host, command.container_id[:12], command.lease_id, why,
                    extra=lease_context(command.lease_id, command.host))
        return
    # Not sent: the agent keeps to what an older allocator reads until it gets one; it is
    # sent again after the agent's next message.
    log.warning("could not send the hello to the agent of %s (sent again after its next "
                "message): %s", command.host, why)
