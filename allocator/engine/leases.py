"""The lease book: allocate, queue, grant, release and end leases.

Lease life (docs/design.md, flows): ``queued`` -> ``granted`` (GPUs claimed) -> ``bound`` (the
node saw the container start; :mod:`~allocator.engine.nodes` does that) -> ``releasing`` (the hub
stopped it) -> ``released`` (the container is gone). Every release records its reason.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from allocator import policy
from allocator.cluster import GPU, Cluster, Node
from allocator.counters import Count, Family
from allocator.engine.outbox import CommandOutbox
from allocator.engine.state import RECENT_FINAL_LEASES, Sender
from allocator.engine.views import Views
from allocator.lease import LeaseRecord
from allocator.ledger import Changes
from allocator.protocol import (
    AllocateRequest,
    ErrorCode,
    ErrorReply,
    LeaseState,
    ReleaseReason,
    ReleaseRequest,
    StopReason,
    error_reply,
)

FENCE_WAITS_FOR = frozenset({ErrorCode.NO_CAPACITY, ErrorCode.UNKNOWN_MODEL,
                             ErrorCode.UNKNOWN_HOST, ErrorCode.UNSATISFIABLE})
"""Refusals that nodes not yet heard from since a fenced start could turn into a grant."""


class LeaseBook(Views, CommandOutbox):
    """Requests from the hub and admins that create, queue and end leases."""

    def _allocate(self, request: AllocateRequest, now: float, changes: Changes) -> BaseModel:
        existing_id = self.by_key.get(request.request_key)
        if existing_id is not None:
            existing = self.leases[existing_id]
            if existing.user != request.user:
                return error_reply(
                    ErrorCode.CONFLICT,
                    f"request key {request.request_key!r} belongs to user {existing.user!r}",
                )
            asked, held = request.what_is_asked(), self._what_was_asked(existing)
            if held is not None and asked != held:
                self.counters.add(Count.REQUEST_KEY_CONFLICT)
                differs = sorted(name for name in asked if asked[name] != held.get(name))
                return error_reply(
                    ErrorCode.CONFLICT,
                    f"request key {request.request_key!r} is in use by lease "
                    f"{existing.lease_id} ({existing.state.value}), which asked for other GPUs "
                    f"({', '.join(differs)} differ). A retry repeats its request exactly; for "
                    "another request, release that lease first or use another key.",
                    lease_id=existing.lease_id, state=existing.state.value, differs=differs,
                    held=held, asked=asked)
            self.counters.add(Count.ALLOCATE_RETRY)
            return self.lease_reply(existing)
        demand = policy.make_demand(request, self._model_catalog(), self.settings)
        if isinstance(demand, policy.Refusal):
            if self._fence_holds(now) and demand.code in FENCE_WAITS_FOR:
                return self._wait_behind_fence(self._new_record(request, now), request, now,
                                               changes)
            return self._refuse(demand)
        placement = self._place(demand, now)
        record = self._new_record(request, now)
        if isinstance(placement, policy.Placement):
            self._grant(record, placement, demand, now, changes, old=None)
            self._track(record)
            return self.lease_reply(record)
        if self._fence_holds(now) and placement.code in FENCE_WAITS_FOR:
            return self._wait_behind_fence(record, request, now, changes)
        if placement.code is ErrorCode.NO_CAPACITY and request.wait_s > 0:
            record.enqueued_at = now
            record.wait_until = now + request.wait_s
            self._track(record)
            changes.transition(record, None, now, "no GPU free; waiting", by=request.user)
            self.counters.add(Count.QUEUED)
            return self.lease_reply(record)
        return self._refuse(placement)

    def _new_record(self, request: AllocateRequest, now: float) -> LeaseRecord:
        return LeaseRecord(
            lease_id=self.new_lease_id(), request_key=request.request_key, user=request.user,
            groups=tuple(request.groups), state=LeaseState.QUEUED, created_at=now,
            request=request.model_dump(mode="json", exclude={"deadline"}),
            priority=request.priority,
        )

    # ------------------------------------------------------------------ the start fence

    def _fence_holds(self, now: float) -> bool:
        """Whether requests wait instead of being refused: after a fenced start, until every
        node the ledger knew has reported (an empty ledger: the first node), or
        ``start_fence_s`` ran out."""
        return now < self._fence_until and (bool(self._fenced)
                                            or self._fence_awaits_first_report)

    def _wait_behind_fence(self, record: LeaseRecord, request: AllocateRequest, now: float,
                           changes: Changes) -> BaseModel:
        """Queue a request that may fit once the nodes not heard from yet have reported; a
        request that asked not to wait waits only for the fence."""
        record.enqueued_at = now
        record.wait_until = max(now + request.wait_s, self._fence_until)
        self._track(record)
        changes.transition(record, None, now, "waiting for the nodes' first reports",
                           by=request.user)
        self.counters.add(Count.QUEUED)
        self.counters.add(Count.QUEUED_BEHIND_FENCE)
        return self.lease_reply(record)

    def _close_fence(self, now: float, changes: Changes) -> None:
        """Every node the ledger knew has reported (an empty ledger: the first node): requests
        queued only by the fence that still do not fit get the answer they asked for (no
        waiting beyond their wait_s)."""
        self._fence_until = now
        self._fenced.clear()
        self._fence_awaits_first_report = False
        changes.event(now, "start_fence_closed")
        for _, lease_id in list(self._queue):
            record = self.leases[lease_id]
            wait_s = float(record.request.get("wait_s") or 0.0)
            own_end = (record.enqueued_at or record.created_at) + wait_s
            if own_end <= now:
                self._end_lease(record, LeaseState.EXPIRED, ReleaseReason.WAIT_EXPIRED, now,
                                changes, by="allocator",
                                note="nothing fits now that every node has reported")
            elif record.wait_until is not None and record.wait_until > own_end:
                record.wait_until = own_end
                changes.lease(record)

    @staticmethod
    def _what_was_asked(record: LeaseRecord) -> dict[str, Any] | None:
        """What the lease's request asked for (see ``AllocateRequest.what_is_asked``), or None
        for a lease whose stored request does not say (recorded by another writer)."""
        if not record.request:
            return None
        try:
            return AllocateRequest.model_validate(record.request).what_is_asked()
        except ValidationError:
            return None

    def _model_catalog(self) -> Cluster:
        """The cluster as model resolution needs it: every node, one GPU per model and size.

        :func:`policy.make_demand` only asks which models, sizes and hosts exist; a catalog of
        a few GPUs answers that in microseconds where the whole cluster takes milliseconds.
        It is rebuilt after an inventory change.
        """
        if self._catalog is None:
            representatives: dict[tuple[str, int, bool], GPU] = {}
            for gpu in self.cluster.gpus.values():
                representatives.setdefault((gpu.model, gpu.memory_total_mib, gpu.present), gpu)
            self._catalog = Cluster(nodes=self.cluster.nodes,
                                    gpus={g.uuid: g for g in representatives.values()})
        return self._catalog

    def _place(self, demand: policy.Demand, now: float, *, explain: bool = True,
               view: Callable[[], Cluster] | None = None) -> policy.Placement | policy.Refusal:
        """Best-fit placement (narrowed by the index when it can be), then the quota.

        Without ``explain`` (serving the queue) a demand that fits nowhere gets a bare
        refusal: the index's answer where it narrows (exact, as its own placements are), and
        no account of what is free instead. Each of those looks at every GPU of the cluster;
        a queue of requests tried again at every change (each node's first report after a
        start, every release) made that a scan per waiting request per change, seconds per
        heartbeat at 1,000 hosts. ``view``: gives :meth:`_placement_view` (built once for
        many calls, and only when one needs it: the index skips down and fenced nodes itself).
        """
        down_after = self.settings.node_down_after_s
        placement: policy.Placement | policy.Refusal | None = None
        narrowed = self.index.narrow(
            demand, self.cluster,
            lambda node: node.host not in self._down and node.host not in self._fenced
            and not node.drained and node.is_up(now, down_after))
        if narrowed is not None and narrowed.nodes:
            placement = policy.place(demand, narrowed, now, down_after, explain=explain)
        if not isinstance(placement, policy.Placement):
            if not explain and narrowed is not None:
                return policy.nothing_fits_now()
            # Nothing among the candidates (or no narrowing possible): the exact answer, with
            # the refusal's full explanation, from the whole cluster.
            whole = view() if view is not None else self._placement_view(now)
            placement = policy.place(demand, whole, now, down_after, explain=explain)
        # Quotas need a placement's units; a slice's units depend on the GPU it lands on, so
        # place first and check the quota of the actual placement.
        if isinstance(placement, policy.Refusal):
            return placement
        refusal = policy.check_quota(placement.units, demand.user, demand.groups,
                                     self.cluster, self.settings,
                                     policy.placement_model(placement, self.cluster))
        return refusal if refusal is not None else placement

    def _placement_view(self, now: float) -> Cluster:
        """The cluster as placement sees it: nodes not yet heard from since a restart are down,
        and so are fenced nodes (no complete report applied since a fenced start)."""
        if not self._down and not self._fenced:
            return self.cluster
        view = Cluster(nodes=dict(self.cluster.nodes), gpus=self.cluster.gpus,
                       claims=self.cluster.claims)
        for host in self._down | self._fenced:
            node = view.nodes.get(host)
            if node is not None:
                view.nodes[host] = Node(host=node.host, last_heartbeat=None,
                                        drained=node.drained, agent_id=node.agent_id,
                                        gpu_uuids=node.gpu_uuids)
        return view

    def _grant(self, record: LeaseRecord, placement: policy.Placement, demand: policy.Demand,
               now: float, changes: Changes, old: LeaseState | None) -> None:
        record.state = LeaseState.GRANTED
        self._time(record)
        record.host = placement.host
        self._by_host.setdefault(record.host, {})[record.lease_id] = record
        record.gpu_uuids = tuple(placement.gpu_uuids)
        record.model = policy.placement_model(placement, self.cluster)
        record.shared = placement.shared
        record.memory_mib = placement.memory_mib
        record.units = placement.units
        record.env = policy.lease_env(placement, self.cluster, record.lease_id)
        record.granted_at = now
        record.bind_deadline = now + self.settings.bind_timeout_s
        record.borrowed = policy.would_borrow(placement.units, policy.quota_standings(
            record.user, record.groups, self.cluster, self.settings, limited_only=True,
            model=record.model))
        policy.apply_placement(self.cluster, placement, record.lease_id, demand)
        self.index.refresh(self.cluster, placement.host)
        self.by_key[record.request_key] = record.lease_id
        changes.transition(record, old, now, "granted", by=record.user)
        self.counters.add(Count.GRANTED)

    def _refuse(self, refusal: policy.Refusal) -> ErrorReply:
        self.counters.add_to(Family.REFUSED, refusal.code.value)
        return error_reply(refusal.code, refusal.message, **refusal.details)

    def _queued_demand(self, record: LeaseRecord) -> policy.Demand | policy.Refusal | None:
        """What a queued request asks, resolved against the current models; None when its
        stored request no longer validates (cannot happen for one that was accepted).

        Kept per lease until the models change: the queue is tried again at every change
        that could let a request fit, and validating and resolving each waiting request
        every time was most of that (75 µs each, 48,000 times in 1,000 first reports after
        a restart with 64 waiting).
        """
        catalog = self._model_catalog()
        known = self._demands.get(record.lease_id)
        if known is not None and known[0] is catalog:
            return known[1]
        try:
            request = AllocateRequest.model_validate(record.request)
        except ValidationError:
            return None
        demand = policy.make_demand(request, catalog, self.settings)
        self._demands[record.lease_id] = (catalog, demand)
        return demand

    def _serve_queue(self, now: float, changes: Changes) -> None:
        """Grant queued requests that fit now, in queue order (a freed GPU goes to the head)."""
        if not self._queue:
            return
        # Nodes do not change during the pass, only claims (which the view shares): one view
        # for the whole pass, built if a request needs it.
        view = functools.cache(lambda: self._placement_view(now))
        for _, lease_id in list(self._queue):
            record = self.leases[lease_id]
            demand = self._queued_demand(record)
            if demand is None:  # never wedge the queue
                self._end_lease(record, LeaseState.EXPIRED, ReleaseReason.CANCELLED, now, changes,
                             by="allocator", note="stored request no longer valid")
                continue
            if isinstance(demand, policy.Refusal):
                continue
            placement = self._place(demand, now, explain=False, view=view)
            if isinstance(placement, policy.Placement):
                self._dequeue(lease_id)
                self._grant(record, placement, demand, now, changes, old=LeaseState.QUEUED)

    def _dequeue(self, lease_id: str) -> None:
        self._queue = [entry for entry in self._queue if entry[1] != lease_id]
        self._demands.pop(lease_id, None)

    def _release_request(self, request: ReleaseRequest, sender: Sender, now: float,
                         changes: Changes) -> BaseModel:
        record = self.find(request.lease_id, request.request_key)
        if record is None:
            what = (f"lease {request.lease_id!r}" if request.lease_id
                    else f"request key {request.request_key!r}")
            return error_reply(ErrorCode.NOT_FOUND, f"no {what} in the ledger")
        if request.force and sender.user_id not in self.settings.admin_users:
            return error_reply(ErrorCode.FORBIDDEN,
                               f"force-release is for admins; broker user {sender.user_id!r} "
                               "is not in admin_users")
        by = request.by if sender.user_id is None else f"{request.by} ({sender.user_id})"
        note = request.reason or None
        if record.state.final:
            return self.lease_reply(record)
        if record.state is LeaseState.QUEUED:
            self._end_lease(record, LeaseState.RELEASED, ReleaseReason.CANCELLED, now, changes,
                         by=by, note=note)
        elif request.force:
            self._end_lease(record, LeaseState.RELEASED, ReleaseReason.ADMIN, now, changes,
                         by=by, note=note)
            changes.event(now, "force_release", lease_id=record.lease_id, user=record.user,
                          by=by, reason=request.reason)
            # The GPUs go to someone else now: the old container must not keep using them.
            self._ask_stop(record.host, record.lease_id, record.container_id,
                           StopReason.FORCE_RELEASED, now, changes)
            self._serve_queue(now, changes)
        elif record.state in (LeaseState.GRANTED, LeaseState.BOUND):
            self._stop_and_release(record, StopReason.RELEASED, now, changes, by=by, note=note,
                                   why="stop requested")
        return self.lease_reply(record)

    def _stop_and_release(self, record: LeaseRecord, stop: StopReason, now: float,
                          changes: Changes, *, by: str, note: str | None, why: str) -> None:
        """Make a granted or bound lease ``releasing`` and ask its node to stop the container.

        The GPU is free when the container is gone, not when someone asks (docs/design.md,
        flow 3): the node agent's event or heartbeat finishes this.
        """
        old = record.state
        record.state = LeaseState.RELEASING
        self._time(record)
        record.releasing_at = now
        record.released_by = by
        record.release_note = note
        self.by_key.pop(record.request_key, None)
        changes.transition(record, old, now, why, by=by)
        # Swarm stops a removed service's task only seconds later (a 2 s gossip delay
        # comes first); the node agent stops it at once, so the GPU is free in
        # milliseconds. A lease never bound has no container to stop yet: if one starts,
        # its start is answered with a stop (_container_event).
        self._ask_stop(record.host, record.lease_id, record.container_id, stop, now, changes)

    def _end_lease(self, record: LeaseRecord, state: LeaseState, reason: ReleaseReason, now: float,
                changes: Changes, *, by: str, note: str | None = None) -> None:
        """End a lease for good and free what it held."""
        old = record.state
        if record.reclaim_stopped_at is not None and record.reclaim_reason is not None \
                and reason is not ReleaseReason.ADMIN:
            # Its container was stopped to reclaim it: however the end is noticed (die event,
            # missing from a listing, silent node), that is why it ended.
            reason = ReleaseReason(record.reclaim_reason.value)
        elif record.reclaim_at is not None:
            # Ended otherwise during a warning's grace: the warning did not happen.
            record.reclaim_at = record.reclaim_reason = record.reclaim_for = None
        self._close_idle_spell(record, now)
        self.use.forget(record.lease_id)
        if old.holds_gpus:
            self.cluster.drop_claims(record.lease_id, list(record.gpu_uuids))
            if record.host is not None:
                self.index.refresh(self.cluster, record.host)
        if old is LeaseState.QUEUED:
            self._dequeue(record.lease_id)
        record.state = state
        record.released_at = now
        record.release_reason = reason
        record.released_by = record.released_by or by
        if note:
            record.release_note = note
        if self.by_key.get(record.request_key) == record.lease_id:
            del self.by_key[record.request_key]
        self.leases.pop(record.lease_id, None)
        if record.host is not None:
            self._by_host.get(record.host, {}).pop(record.lease_id, None)
        self._node_clock_bound.pop(record.lease_id, None)
        self._over_budget.discard(record.lease_id)
        self.recent[record.lease_id] = record
        while len(self.recent) > RECENT_FINAL_LEASES:
            self.recent.popitem(last=False)
        changes.transition(record, old, now, reason.value, by=by)
        self.counters.add_to(Family.RELEASED, reason.value)
