"""Node reconciliation: the containers node agents report (heartbeat listings, container
events), held against the lease book.

A listed container binds its lease, a missing one ends it after ``container_gone_grace_s``
(node clock); a start event binds at once, a die event ends the lease at once. A container of
a lease the ledger forgot is adopted (:mod:`~allocator.engine.node_truth`), one of a lease
still queued is a conflict (never a bind); one of a lease finished here is a zombie and is
asked to stop.
"""

from __future__ import annotations

from allocator.config import AllocatorSettings
from allocator.engine.idle import IdleWatch
from allocator.engine.leases import LeaseBook
from allocator.engine.node_truth import NodeTruth
from allocator.engine.nodes import NodeReports
from allocator.engine.outbox import CommandOutbox
from allocator.engine.requests import LeaseRequests
from allocator.ledger.changes import Changes
from allocator.ledger.lease import LeaseRecord
from allocator.metrics.counters import Count, Counters, Family
from allocator.placement.adoption import Conflict, LabelHolder
from allocator.wire.protocol import (
    ContainerAction,
    ContainerEvent,
    ContainerInfo,
    Heartbeat,
    LeaseState,
    ReleaseReason,
    StopReason,
)

GRACE_ENDS = (LeaseState.BOUND, LeaseState.RELEASING)
"""States of a lease that a complete listing without its container ends after a grace."""


def listing_order(info: ContainerInfo) -> tuple[float, str]:
    """Oldest first: of two containers claiming one GPU, the one that ran first is adopted."""
    return (info.started_at or 0.0, info.container_id)


class NodeReconciliation:
    """Binds, ends and stops leases by what runs on the nodes; keeps no state of its own."""

    def __init__(self, settings: AllocatorSettings, counters: Counters, book: LeaseBook,
                 truth: NodeTruth, idle: IdleWatch, outbox: CommandOutbox,
                 requests: LeaseRequests, nodes: NodeReports) -> None:
        self.settings = settings
        self.counters = counters
        self.book = book
        self.truth = truth
        self.idle = idle
        self.outbox = outbox
        self.requests = requests
        self.nodes = nodes

    def reconcile(self, beat: Heartbeat, now: float, changes: Changes) -> bool:
        """Bind leases whose containers run; release those whose containers are gone.

        Returns whether any GPU was freed (the caller serves the queue).
        """
        book = self.book
        found: dict[str, list[Conflict]] = {}
        for info in sorted(beat.containers, key=listing_order):
            record = book.leases.get(info.lease_id)
            if self.truth.forgotten(record, info.lease_id) and info.grant is not None:
                # Oldest first: of two containers claiming one GPU, the one that ran first
                # is adopted and the other is the conflict.
                holder = LabelHolder(info.container_id, info.name, info.started_at)
                if not self.truth.adopt_or_flag(info.lease_id, holder, info.grant, beat.host,
                                                beat.sent_at, now, changes, found,
                                                "heartbeat"):
                    continue
                record = book.leases[info.lease_id]
            if record is None or record.host != beat.host:
                self._unexpected_container(info.lease_id, info.container_id, beat.host, now,
                                           changes)
                continue
            if record.state is LeaseState.GRANTED:
                book.bind(record, info.container_id, beat.sent_at, now, changes, "heartbeat")
            elif record.container_id is None:
                record.container_id = info.container_id
                changes.lease(record)
            if record.state is LeaseState.RELEASING:
                self.outbox.ask_stop(record.host, record.lease_id, info.container_id,
                                     StopReason.RELEASED, now, changes, observed=True)
            book.node_clock_bound.setdefault(record.lease_id, beat.sent_at)
            self.check_budget(record, info, now, changes)
            self.idle.observe(record, info, now, changes)
        freed = self.truth.record_conflicts(beat.host, found, complete=beat.containers_complete)
        if not beat.containers_complete:
            return freed
        return self._end_missing(beat, now, changes) or freed

    def check_budget(self, record: LeaseRecord, info: ContainerInfo, now: float,
                     changes: Changes) -> None:
        """A shared slice's memory against its budget (:meth:`IdleWatch.check_budget`); one
        over it past ``over_budget_grace_s`` with ``over_budget_action = "stop"`` is released
        and its container stopped, reason ``over_budget``."""
        if self.idle.check_budget(record, info, now, changes):
            self.book.stop_and_release(
                record, StopReason.OVER_BUDGET, now, changes, by="allocator",
                note="over its GPU memory budget", why="over its GPU memory budget "
                f"({record.memory_mib} MiB) for over_budget_grace_s")

    def _end_missing(self, beat: Heartbeat, now: float, changes: Changes) -> bool:
        """A complete listing: end the host's bound and releasing leases whose container it
        has not listed for ``container_gone_grace_s``. True when any ended."""
        running = {c.lease_id for c in beat.containers}
        grace = self.settings.container_gone_grace_s
        freed = False
        for record in list(self.book.by_host.get(beat.host, {}).values()):
            if record.lease_id in running or record.state not in GRACE_ENDS:
                continue
            seen = self.book.node_clock_bound.get(record.lease_id, 0.0)
            if beat.sent_at - seen <= grace:
                continue
            # Bound: its container is gone. Releasing: stopped by the hub, the node no longer
            # runs it (or never did: a failed spawn).
            reason = (ReleaseReason.CONTAINER_GONE
                      if record.state is LeaseState.BOUND or record.bound_at
                      else ReleaseReason.STOPPED)
            self.book.end(record, LeaseState.RELEASED, reason, now, changes,
                          by=f"node {beat.host}")
            freed = True
        return freed

    def _unexpected_container(self, lease_id: str, container_id: str, host: str, now: float,
                              changes: Changes) -> None:
        finished = self.book.recent.get(lease_id)
        kind = Count.ZOMBIE_CONTAINER if finished is not None else Count.UNKNOWN_LEASE_CONTAINER
        self.counters.add(kind)
        changes.event(now, kind.value, host=host, lease_id=lease_id,
                      container_id=container_id)
        if finished is not None and finished.host in (None, host):
            # A container of a lease this allocator finished (e.g. a start after the bind
            # deadline reclaimed it): it would use GPUs the ledger gave away. A lease the
            # allocator does not know is left alone: it may be another cluster's.
            self.outbox.ask_stop(host, lease_id, container_id, StopReason.LEASE_FINISHED, now,
                                 changes, observed=True)

    def container_event(self, event: ContainerEvent, now: float, changes: Changes) -> None:
        """A container started or ended: adopt, bind, stop or end its lease at once; serve the
        queue when that freed GPUs."""
        self.counters.add_to(Family.CONTAINER_EVENT, event.action.value)
        record = self.book.leases.get(event.lease_id)
        if event.action is ContainerAction.START and event.grant is not None \
                and self.truth.forgotten(record, event.lease_id):
            found: dict[str, list[Conflict]] = {}
            holder = LabelHolder(event.container_id, started_at=event.at)
            if self.truth.adopt_or_flag(event.lease_id, holder, event.grant, event.host,
                                        event.at, now, changes, found, "start event"):
                return
            self.truth.record_conflicts(event.host, found, complete=False)
            return
        if (event.action is not ContainerAction.START
                and event.container_id in self.truth.conflicts.get(event.host, {})
                and self.truth.record_conflicts(event.host, {}, complete=False,
                                                gone={event.container_id})):
            self.requests.serve_queue(now, changes)
        if record is None or record.host != event.host or not record.state.holds_gpus:
            if event.action is ContainerAction.START:
                self._unexpected_container(event.lease_id, event.container_id, event.host, now,
                                           changes)
            return
        if event.action is ContainerAction.START:
            self._started(record, event, now, changes)
            return
        if record.container_id not in (None, event.container_id):
            return  # an older container of the same lease (a replaced task); not the holder
        exit_note = f"{event.action.value}" + (
            f", exit code {event.exit_code}" if event.exit_code is not None else "")
        self.book.end(record, LeaseState.RELEASED, ReleaseReason.CONTAINER_EXITED, now, changes,
                      by=f"node {event.host}", note=exit_note)
        self.requests.serve_queue(now, changes)

    def _started(self, record: LeaseRecord, event: ContainerEvent, now: float,
                 changes: Changes) -> None:
        """The container of a lease holding GPUs started."""
        if record.state is LeaseState.GRANTED:
            self.book.bind(record, event.container_id, event.at, now, changes, "start event")
        elif record.container_id is None:
            record.container_id = event.container_id
            self.book.node_clock_bound[record.lease_id] = event.at
            changes.lease(record)
        if record.state is LeaseState.RELEASING:
            # The hub stopped the server before its container started (or a replaced task
            # started): stop it too.
            self.outbox.ask_stop(record.host, record.lease_id, event.container_id,
                                 StopReason.RELEASED, now, changes, observed=True)
