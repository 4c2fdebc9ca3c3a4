"""Read-only answers from the engine's memory: the inventory, quotas, the ``leases`` listing,
the queue, and the figures a metrics scrape reads. Nothing here changes state.

The listings show a lease only to whom :func:`~allocator.engine.leases.may_act_on` lets act
on it (``visible``): a hub sees its own leases, admins every lease; the GPUs, their holders'
lease ids and the counts stay whole, since every hub places on the same GPUs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from fractions import Fraction

from allocator.bookings.in_effect import Held
from allocator.bookings.schedule import bookings_view
from allocator.config import AllocatorSettings, PolicySettings
from allocator.engine.idle import IdleWatch
from allocator.engine.leases import LeaseBook
from allocator.engine.nodes import NodeReports
from allocator.engine.processes import ProcessWatch
from allocator.ledger.lease import LeaseRecord
from allocator.metrics.figures import SHARES, EngineFigures
from allocator.placement.cluster import GPU, Cluster
from allocator.placement.model_summary import summarize_models
from allocator.placement.quota import quota_standings, would_borrow
from allocator.wire.protocol import (
    BookingsView,
    GPUView,
    Health,
    InventoryReply,
    LeasesReply,
    LeasesRequest,
    LeaseState,
    ModelSummary,
    NodeView,
    ProcessState,
    QueueReply,
    QuotaReply,
    QuotaRequest,
    QuotaView,
)

Visible = Callable[[LeaseRecord], bool]
"""Whether the asker may see a lease in a listing."""


def everything(record: LeaseRecord) -> bool:
    """Every lease (the engine's own readers: metrics, tests)."""
    return True


def shown(gpu: GPU) -> bool:
    """Whether the inventory (and the metrics) show ``gpu``: a GPU its host no longer lists
    is left out, unless it is in conflict (another host reports it): an admin must see that."""
    return gpu.present or gpu.conflict is not None


def groups_with_a_guarantee(settings: PolicySettings) -> list[str]:
    """The groups the settings give a guarantee (``group_quota``, ``group_model_quota``), in
    name order: the group label's values (bounded by the settings, not by the requests)."""
    return sorted({*settings.group_quota, *settings.group_model_quota})


class Views:
    """Answers built from the cluster, the lease book, node liveness and lease use."""

    def __init__(self, settings: AllocatorSettings, cluster: Cluster, book: LeaseBook,
                 idle: IdleWatch, nodes: NodeReports, processes: ProcessWatch) -> None:
        self.settings = settings
        self.cluster = cluster
        self.book = book
        self.idle = idle
        self.nodes = nodes
        self.processes = processes

    def quota(self, request: QuotaRequest, visible: Visible = everything) -> QuotaReply:
        """The user's quotas and what they and their groups hold now in the leases the asker
        may see (``visible``: a hub its own and those whose owner is not known, an admin
        every lease), so that a hub learns nothing of another hub's users; with a count,
        whether granting that many now would be borrowed."""
        views = []
        model = (None if request.model is None
                 else self.settings.aliases.get(request.model, request.model))
        leases = self.book.leases
        seen = Cluster(nodes=self.cluster.nodes, gpus=self.cluster.gpus, claims={
            uuid: [claim for claim in claims
                   if claim.lease_id in leases and visible(leases[claim.lease_id])]
            for uuid, claims in self.cluster.claims.items()})
        standings = quota_standings(request.user, request.groups, seen,
                                    self.settings, model=model,
                                    every_model=model is None)
        for standing in standings:
            limit = None if standing.limit is None else float(standing.limit)
            views.append(QuotaView(
                scope="user" if standing.scope == "user" else "group", name=standing.name,
                limit=limit, held=float(standing.held),
                free=None if limit is None else max(limit - float(standing.held), 0.0),
                guaranteed=None if standing.guarantee is None else float(standing.guarantee),
                borrow_limit=limit, model=standing.model))
        borrowing = None
        if request.count is not None:
            units = Fraction(request.count).limit_denominator(1_000_000)
            borrowing = would_borrow(
                units, [s for s in standings if s.model in (None, model)])
        return QuotaReply(user=request.user, quotas=views, would_borrow=borrowing)

    def queue(self, visible: Visible = everything) -> QueueReply:
        """The queued leases in the order they are served (those ``visible``; positions count
        them all)."""
        book = self.book
        return QueueReply(leases=[book.view(book.leases[i]) for i in book.serving_order()
                                  if visible(book.leases[i])])

    def leases_reply(self, request: LeasesRequest, now: float,
                     visible: Visible = everything) -> LeasesReply:
        """Leases of one user (or everyone's) that are ``visible``: queued in queue order,
        then holding ones by newest grant, then those ended within ``include_finished_s`` by
        newest end."""
        def wanted(record: LeaseRecord) -> bool:
            return (request.user is None or record.user == request.user) and visible(record)

        book = self.book
        queued = [book.leases[i] for _, i in book.queue if wanted(book.leases[i])]
        holding = sorted((r for r in book.leases.values()
                          if r.state is not LeaseState.QUEUED and wanted(r)),
                         key=lambda r: (-(r.granted_at or r.created_at), r.lease_id))
        finished: list[LeaseRecord] = []
        if request.include_finished_s > 0:
            since = now - request.include_finished_s
            finished = sorted((r for r in book.recent.values()
                               if wanted(r) and (r.released_at or 0.0) >= since),
                              key=lambda r: (-(r.released_at or 0.0), r.lease_id))
        views = []
        for record in (*queued, *holding, *finished):
            lease = book.view(record)
            if request.include_usage:
                lease.usage = self.idle.usage_of(record.lease_id)
            views.append(lease)
        return LeasesReply(at=now, leases=views, idle_window_s=self.settings.idle_window_s,
                           reclaim_grace_s=self.settings.reclaim_grace_s)

    def inventory(self, now: float, include_leases: bool = False,
                  visible: Visible = everything) -> InventoryReply:
        """The cluster as the inventory reply shows it (with ``include_leases``, the active
        leases that are ``visible``)."""
        down_after = self.settings.node_down_after_s
        lease_of = {r.container_id: r.lease_id for r in self.book.leases.values()
                    if r.container_id is not None}
        nodes = [
            NodeView(host=n.host, up=self.nodes.up(n, now), drained=n.drained,
                     last_heartbeat=n.last_heartbeat, gpus=len(n.gpu_uuids),
                     interconnect=n.interconnect)
            for n in sorted(self.cluster.nodes.values(), key=lambda n: n.host)
        ]
        gpus = [
            GPUView(
                uuid=g.uuid, host=g.host, index=g.index, model=g.model,
                memory_total_mib=g.memory_total_mib, memory_used_mib=g.memory_used_mib,
                utilization_pct=g.utilization_pct, temperature_c=g.temperature_c,
                health=g.health, health_reasons=list(g.health_reasons), drained=g.drained,
                share_slots=g.share_slots,
                holders=[c.lease_id for c in self.cluster.claims_on(g.uuid)],
                free_slots=self.cluster.free_slots(g),
                free_memory_mib=self.cluster.free_memory_mib(g),
                compute_capability=g.compute_capability, architecture=g.architecture,
                mig_enabled=g.mig_enabled, mig_parent_uuid=g.mig_parent_uuid,
                mig_profile=g.mig_profile,
                conflict=g.conflict or g.undeclared,
                process_state=g.process_state,
                processes=self.processes.processes_of(g.uuid, lease_of),
            )
            for g in sorted(self.cluster.gpus.values(), key=lambda g: (g.host, g.order))
            if shown(g)
        ]
        models = summarize_models(self.cluster, self.settings, now, down_after)
        leases = None
        if include_leases:
            leases = [self.book.view(r) for r in self.book.leases.values() if visible(r)]
        return InventoryReply(at=now, nodes=nodes, gpus=gpus, models=models,
                              queued=len(self.book.queue), leases=leases,
                              bookings=self.bookings_view(now, models))

    def figures(self, now: float) -> EngineFigures:
        """What a metrics scrape reports of the cluster, the leases and the queue
        (:mod:`allocator.metrics.figures`; the engine adds its bookings and counters)."""
        figures = EngineFigures()
        # Read from the engine's own state, not from inventory(): that builds a reply model
        # of every node and GPU and each model's summary, several times the stalled event
        # loop of this walk on a large cluster (docs/benchmarks.md, bench/engine.py scrape
        # against inventory).
        cluster = self.cluster
        for node in cluster.nodes.values():
            figures.nodes[node.host] = (self.nodes.up(node, now), node.drained,
                                        node.last_heartbeat)
        # Tallied into lists and counted at once (Counter.update counts in C): a Counter
        # increment per GPU and per lease was most of a scrape.
        gpu_states: list[tuple[str, str]] = []
        for gpu in cluster.gpus.values():
            if not shown(gpu):
                continue
            node_up, node_drained, _ = figures.nodes.get(gpu.host, (False, False, None))
            if gpu.conflict is not None or gpu.undeclared is not None:
                state = "conflict"
            elif gpu.process_state in (ProcessState.STUCK_PROCESS, ProcessState.OUTSIDE_USE):
                state = gpu.process_state.value
            elif cluster.claims_on(gpu.uuid):
                state = "held"
            elif gpu.process_state is ProcessState.DRAINING:
                state = "draining"
            elif gpu.health is not Health.HEALTHY:
                state = "unhealthy"
            elif gpu.drained or node_drained:
                state = "drained"
            elif not node_up:
                state = "down"
            else:
                state = "free"
            gpu_states.append((gpu.model, state))
            if gpu.share_slots > 1:
                free_slots = cluster.free_slots(gpu)
                figures.slots[gpu.model, "free"] += free_slots
                figures.slots[gpu.model, "held"] += gpu.share_slots - free_slots
        figures.gpus.update(gpu_states)
        leases = self.book.leases.values()
        for lease_state, count in Counter([record.state for record in leases]).items():
            figures.leases[lease_state.value] += count
        figures.group_held = {group: dict.fromkeys(SHARES, Fraction(0))
                              for group in groups_with_a_guarantee(self.settings)}
        if figures.group_held:
            for record in leases:
                if record.state.holds_gpus:
                    # The lease's standing as fair share keeps it
                    # (allocator.placement.fairshare.borrowed_leases, at each grant and
                    # tick): the one reclaim acts on, not a second reckoning.
                    share = "borrowed" if record.borrowed else "guaranteed"
                    for group in dict.fromkeys(record.groups):
                        if group in figures.group_held:
                            figures.group_held[group][share] += record.units
        waiting_since = [record.enqueued_at or record.created_at for record in leases
                         if record.state is LeaseState.QUEUED]
        figures.queue_length = len(waiting_since)
        figures.queue_oldest_wait_s = (max(now - min(waiting_since), 0.0) if waiting_since
                                       else 0.0)
        return figures

    # --- What users see of bookings (allocator.bookings.schedule) -------------------------

    def bookings_view(self, now: float, models: list[ModelSummary]) -> BookingsView | None:
        """The bookings of the coming week as users see them; None while none is held. Read
        from the bookings the engine's windows draw on, never changing those windows."""
        bookings = self.book.windows.bookings
        resolved = bookings.resolved()
        if not resolved:
            return None
        held = [Held(r.lease_id, r.user, r.groups, r.model, r.host or "", r.units,
                     r.granted_at or 0.0) for r in self.book.charged_holding()]
        free = {(m.model, host): n for m in models for host, n in m.hosts.items()}
        return bookings_view(resolved, now, bookings.capacity(now), held, free)
