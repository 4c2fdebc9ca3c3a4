"""Where a demand fits: best-fit placement over the nodes that may be placed on now, narrowed by
the placement index, then the quota (lifted within a booking that says so); and the model
catalog that demands are resolved against.

A node may be placed on when it is up, not drained, and not behind the start fence
(:mod:`allocator.engine.fence`).
"""

from __future__ import annotations

from collections.abc import Callable

from allocator.config import AllocatorSettings
from allocator.engine.booking_windows import BookingWindows
from allocator.engine.fence import StartFence
from allocator.engine.nodes import NodeReports
from allocator.placement import fairshare
from allocator.placement.cluster import GPU, Cluster, Node
from allocator.placement.demand import Demand, Placement, Refusal
from allocator.placement.index import PlacementIndex
from allocator.placement.no_capacity import nothing_fits_now
from allocator.placement.policy import place
from allocator.placement.quota import place_within_quota


class Placer:
    """Places demands on the cluster as the nodes and the start fence allow.

    Invariant: ``catalog`` is None or was built from the cluster's current GPU inventory
    (:meth:`inventory_changed` drops it).
    """

    def __init__(self, settings: AllocatorSettings, cluster: Cluster, index: PlacementIndex,
                 nodes: NodeReports, start_fence: StartFence, windows: BookingWindows) -> None:
        self.settings = settings
        self.windows = windows
        self.cluster = cluster
        self.index = index
        self.nodes = nodes
        self.start_fence = start_fence
        self.catalog: Cluster | None = None
        """The model catalog (see :meth:`model_catalog`), built when first needed."""

    def inventory_changed(self) -> None:
        """The models or sizes of GPUs may have changed: rebuild the catalog when needed."""
        self.catalog = None

    def model_catalog(self) -> Cluster:
        """The cluster as model resolution needs it: every node, one GPU per model and size.

        :func:`policy.make_demand` only asks which models, sizes and hosts exist; a catalog of
        a few GPUs answers that in microseconds where the whole cluster takes milliseconds.
        Callers may compare it by identity: a new one means the inventory changed.
        """
        if self.catalog is None:
            representatives: dict[tuple[str, int, bool], GPU] = {}
            for gpu in self.cluster.gpus.values():
                representatives.setdefault((gpu.model, gpu.memory_total_mib, gpu.present), gpu)
            self.catalog = Cluster(nodes=self.cluster.nodes,
                                   gpus={g.uuid: g for g in representatives.values()})
        return self.catalog

    def place(self, demand: Demand, now: float, *, explain: bool = True,
              view: Callable[[], Cluster] | None = None) -> Placement | Refusal:
        """Best-fit placement (narrowed by the index when it can be) within the quota
        (:func:`~allocator.placement.quota.place_within_quota`).

        Without ``explain`` (serving the queue) a demand that fits nowhere gets a bare
        refusal: the index's answer where it narrows (exact, as its own placements are), and
        no account of what is free instead, since each of those looks at every GPU of the
        cluster and the queue is tried again at every change. ``view``: gives :meth:`view`
        (built once for many calls, and only when one needs it: the index skips down and
        fenced nodes itself).
        """
        windows = self.windows

        def refuse(placement: Placement) -> Refusal | None:
            # Quotas need a placement's units; a slice's units depend on the GPU it lands
            # on, so place first and check the quota of the actual placement.
            share = windows.booked_share(demand.user, demand.groups, demand.models,
                                         demand.host) if windows.rooms else None
            return fairshare.quota_refusal(placement, demand, self.cluster, self.settings,
                                           None if share is None else share.guarantee,
                                           windows.rooms)

        return place_within_quota(
            demand, lambda wanted, retry: self._best_fit(wanted, now, explain and not retry,
                                                         view), refuse)

    def _best_fit(self, demand: Demand, now: float, explain: bool,
                  view: Callable[[], Cluster] | None) -> Placement | Refusal:
        """Where the demand fits now, without the quota (see :meth:`place`)."""
        down_after = self.settings.node_down_after_s
        down, fenced = self.nodes.down, self.start_fence.hosts
        placement: Placement | Refusal | None = None
        narrowed = self.index.narrow(
            demand, self.cluster,
            lambda node: node.host not in down and node.host not in fenced
            and not node.drained and node.is_up(now, down_after))
        if narrowed is not None and narrowed.nodes:
            placement = place(demand, narrowed, now, down_after, explain=explain)
        if not isinstance(placement, Placement):
            if not explain and narrowed is not None:
                return nothing_fits_now()
            # Nothing among the candidates (or no narrowing possible): the exact answer, with
            # the refusal's full explanation, from the whole cluster.
            whole = view() if view is not None else self.view(now)
            placement = place(demand, whole, now, down_after, explain=explain)
        return placement

    def view(self, now: float) -> Cluster:
        """The cluster as placement sees it: nodes not yet heard from since a restart are down,
        and so are fenced nodes (no complete report applied since a fenced start)."""
        down, fenced = self.nodes.down, self.start_fence.hosts
        if not down and not fenced:
            return self.cluster
        view = Cluster(nodes=dict(self.cluster.nodes), gpus=self.cluster.gpus,
                       claims=self.cluster.claims)
        for host in down | fenced:
            node = view.nodes.get(host)
            if node is not None:
                view.nodes[host] = Node(host=node.host, last_heartbeat=None,
                                        drained=node.drained, agent_id=node.agent_id,
                                        gpu_uuids=node.gpu_uuids)
        return view
