"""The start fence: after a fenced start, nothing is granted on a node before its first
complete report since the start has been applied.

A starting allocator cannot know whether its ledger is behind the nodes (deleted, restored,
another node's volume): the containers a node runs may hold GPUs the ledger calls free. The
first complete report of each node adopts those containers (:mod:`allocator.engine.node_truth`)
before the node is placeable. Until every node the ledger knew has reported (an empty ledger:
the first node), or ``start_fence_s`` runs out, a request that does not fit waits in the queue
instead of being refused. (Unrelated to the ledger log's fencing of a deposed writer.)
"""

from __future__ import annotations

from collections.abc import Iterable

from allocator.ledger.changes import Changes


class StartFence:
    """Which hosts are fenced, and until when requests wait for them.

    Invariants: ``hosts`` is the one set of fenced hosts (the same object for the engine's
    life: placement reads it); no host is fenced and ``awaits_first_report`` is false once
    ``until`` has passed and :meth:`expire` or :meth:`close` ran.
    """

    def __init__(self, started_at: float) -> None:
        self.hosts: set[str] = set()
        """Hosts nothing is granted on until their first complete report since the start is
        applied: the ledger may be behind what runs there."""
        self.until = started_at
        """Until then, a request that does not fit waits in the queue instead of being
        refused, since nodes not heard from yet may hold what it needs."""
        self.awaits_first_report = False
        """A fenced load of a ledger that knew no node: it cannot know which nodes will
        report, so requests wait until the first one has (the window closes then)."""

    def load(self, known_hosts: Iterable[str], now: float, start_fence_s: float, *,
             fenced: bool) -> None:
        """A rebuild from the ledger: fence every host it knew (``fenced``), or none."""
        self.hosts.clear()
        if fenced:
            self.hosts.update(known_hosts)
        self.awaits_first_report = fenced and not self.hosts
        self.until = now + start_fence_s if fenced else now

    def holds(self, now: float) -> bool:
        """Whether requests wait instead of being refused: after a fenced start, until every
        node the ledger knew has reported (an empty ledger: the first node), or
        ``start_fence_s`` ran out."""
        return now < self.until and (bool(self.hosts) or self.awaits_first_report)

    def wait_until(self, now: float, wait_s: float) -> float:
        """When a request queued by the fence stops waiting: its own wait, or the fence's end
        if later (a request that asked not to wait waits only for the fence)."""
        return max(now + wait_s, self.until)

    def node_joined(self, host: str, now: float) -> None:
        """A node the ledger did not know reported: during the fence it is placeable only once
        a complete report is applied (its first one, usually)."""
        if now < self.until:
            self.hosts.add(host)

    def report_applied(self, host: str, now: float, changes: Changes) -> bool:
        """A complete report of ``host`` is applied: lift its fence; True if it was fenced."""
        if host not in self.hosts:
            return False
        self.hosts.discard(host)
        self.awaits_first_report = False
        changes.event(now, "node_reported", host=host, fenced_left=len(self.hosts))
        return True

    def all_reported(self, now: float) -> bool:
        """Within the window, every fenced node has reported: the fence may close early."""
        return now < self.until and not self.holds(now)

    def close(self, now: float, changes: Changes) -> None:
        """Every node the ledger knew has reported: the window ends now."""
        self.until = now
        self._lift()
        changes.event(now, "start_fence_closed")

    def expired(self, now: float) -> bool:
        """``start_fence_s`` ran out with nodes that never reported in full."""
        return (bool(self.hosts) or self.awaits_first_report) and now >= self.until

    def expire(self, now: float, changes: Changes) -> None:
        """Place the nodes that never reported in full (an agent that cannot list its
        containers) as usual from now on."""
        changes.event(now, "start_fence_expired", unreported=sorted(self.hosts))
        self._lift()

    def _lift(self) -> None:
        self.hosts.clear()
        self.awaits_first_report = False
