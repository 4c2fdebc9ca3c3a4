"""The command outbox: commands to node agents, decided by the engine, sent by the service.

The engine only appends :class:`~allocator.wire.protocol.StopContainer` commands to
:attr:`CommandOutbox.commands`, and :class:`~allocator.wire.protocol.AllocatorHello` messages to
:attr:`CommandOutbox.hellos`; the service takes both (``Engine.take_agent_commands``) once the
batch that decided them is committed, and a reload (a failed commit) forgets them.
"""

from __future__ import annotations

from collections import OrderedDict

from allocator.config import AllocatorSettings
from allocator.engine.state import RECENT_FINAL_LEASES
from allocator.ledger.changes import Changes
from allocator.metrics.counters import Counters, Family
from allocator.wire.protocol import (
    GPU_PROCESSES,
    INTERCONNECT,
    LEASE_USAGE,
    AgentCommand,
    AllocatorHello,
    StopContainer,
    StopReason,
)


class CommandOutbox:
    """Decides which containers a node agent is asked to stop, and when to ask again; and
    which agents are told what this allocator reads.

    Invariants: ``commands`` holds only commands decided since the last :meth:`take` or
    :meth:`load`; ``stops_asked`` holds at most ``RECENT_FINAL_LEASES`` entries, oldest ask
    first; ``greeted`` holds one agent per host, the newest greeted since the last
    :meth:`load`.
    """

    def __init__(self, settings: AllocatorSettings, counters: Counters) -> None:
        self.settings = settings
        self.counters = counters
        self.commands: list[StopContainer] = []
        """Commands to node agents decided since the last :meth:`take`."""
        self.stops_asked: OrderedDict[tuple[str, str], float] = OrderedDict()
        """(lease id, container id) -> when its stop was last asked, so that a container that
        heartbeats keep listing is not asked again every heartbeat."""
        self.hellos: list[AllocatorHello] = []
        """Hellos decided since the last :meth:`take_hellos`."""
        self.greeted: dict[str, str] = {}
        """host -> the agent (``agent_id``) last sent a hello, since this process last loaded
        its engine (a start, a takeover, a failed commit): each agent gets one per load."""

    def load(self) -> None:
        """A rebuild from the ledger: commands of a batch that was not committed must not go
        out; containers still running are asked again when the next heartbeat lists them."""
        self.commands = []
        self.stops_asked.clear()
        # A takeover's agents have heard only from the replica before; a failed commit's
        # hellos never went out: every agent is greeted again.
        self.hellos = []
        self.greeted.clear()

    def take(self) -> list[StopContainer]:
        """Empty the outbox and return what was in it (the service, after a commit)."""
        commands, self.commands = self.commands, []
        return commands

    def take_hellos(self) -> list[AllocatorHello]:
        """Empty the hellos and return them (the service, after a commit)."""
        hellos, self.hellos = self.hellos, []
        return hellos

    def take_all(self) -> list[AgentCommand]:
        """Hellos, then stop commands: everything decided since they were last taken."""
        return [*self.take_hellos(), *self.take()]

    def greet(self, host: str, agent_id: str) -> None:
        """Tell the agent ``agent_id`` of ``host`` what this allocator reads, unless it has
        been told since the last :meth:`load`: the first message taken from each agent.

        An agent sends ``GPUInfo.processes`` (and, from 0.3.0, ``Heartbeat.interconnect`` and
        ``ContainerInfo.usage``) only after such a hello, since an older allocator refuses a
        heartbeat with a field it does not know.
        """
        if self.greeted.get(host) == agent_id:
            return
        self.greeted[host] = agent_id
        self.hellos.append(AllocatorHello(host=host, reads=[GPU_PROCESSES, INTERCONNECT,
                                                                  LEASE_USAGE]))

    def not_greeted(self, hosts: list[str]) -> None:
        """The hellos to these hosts' agents were not sent (the broker did not take them):
        greet each agent again at its next message."""
        for host in hosts:
            self.greeted.pop(host, None)

    def ask_stop(self, host: str | None, lease_id: str, container_id: str | None,
                 reason: StopReason, now: float, changes: Changes, *,
                 observed: bool = False) -> None:
        """Put a :class:`StopContainer` for the node agent of ``host`` into the outbox.

        ``observed``: asked because a listing or a start event showed the container running,
        not because of a decision just taken. Those come with every heartbeat, so the stop
        is asked again only once ``container_stop_grace_s + container_stop_retry_s`` passed
        since the last ask (the first command may have been lost; stopping is idempotent).
        """
        if not self.settings.stop_containers or host is None or container_id is None:
            return
        key = (lease_id, container_id)
        last = self.stops_asked.get(key)
        if observed and last is not None and now - last < (
                self.settings.container_stop_grace_s + self.settings.container_stop_retry_s):
            return
        self.stops_asked[key] = now
        self.stops_asked.move_to_end(key)
        while len(self.stops_asked) > RECENT_FINAL_LEASES:
            self.stops_asked.popitem(last=False)
        self.commands.append(StopContainer(
            host=host, lease_id=lease_id, container_id=container_id,
            grace_s=self.settings.container_stop_grace_s, reason=reason))
        self.counters.add_to(Family.STOP_ASKED, reason.value)
        changes.event(now, "stop_container", host=host, lease_id=lease_id,
                      container_id=container_id, reason=reason.value,
                      repeat=last is not None)
