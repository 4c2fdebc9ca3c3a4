"""Node truth: running containers give the ledger back what it forgot.

The ledger can be behind the nodes: deleted, restored from last night's backup, or another
node's volume. The containers still run, and their labels carry their whole grant (see
:mod:`allocator.wire.lease_container`). Here a container of a lease the ledger does not know
becomes a ``bound`` lease again, its GPUs claimed (event and history reason ``adopted``),
unless its grant contradicts what the allocator knows: then the GPUs it names stay out of
placement while the node lists it, an ``adoption_conflict`` event and counter say why (naming
the container), and nothing is stopped (see :mod:`allocator.placement.adoption`). A container of a
lease the ledger has *queued* is such a conflict too, never a bind: anyone who may use the node's
Docker API could otherwise bind someone's waiting request. Nothing is granted on a node before
these adoptions (:mod:`allocator.engine.fence`).
"""

from __future__ import annotations

from allocator.config import AllocatorSettings
from allocator.engine.leases import LeaseBook
from allocator.engine.nodes import EventBudget
from allocator.ledger.changes import Changes
from allocator.ledger.lease import ADOPTED_OWNER, LeaseRecord
from allocator.metrics.counters import Count, Counters
from allocator.placement import adoption
from allocator.placement.cluster import Cluster
from allocator.placement.index import PlacementIndex
from allocator.wire.protocol import ContainerGrant, LeaseState


class NodeTruth:
    """Adoption of running containers the ledger does not know, and grant conflicts.

    Invariant: a GPU is in ``marked`` exactly while a container that its host lists (as
    ``conflicts`` records it) names it in a grant that contradicts the ledger, and then its
    ``conflict`` is the message ``marked`` holds (a grant conflict takes the place of a move
    conflict, :mod:`allocator.engine.gpus`, which comes back at the claimant's next report).
    """

    def __init__(self, settings: AllocatorSettings, counters: Counters, cluster: Cluster,
                 index: PlacementIndex, book: LeaseBook) -> None:
        self.settings = settings
        self.adoptions = EventBudget(settings.node_events_per_minute)
        """The adoptions each host may still make this minute (memory only: a reload keeps
        it)."""
        self.counters = counters
        self.cluster = cluster
        self.index = index
        self.book = book
        self.conflicts: dict[str, dict[str, list[adoption.Conflict]]] = {}
        """host -> container id -> why its grant cannot be adopted; the GPUs named stay out
        of placement while the node lists the container."""
        self.marked: dict[str, str] = {}
        """GPU uuid -> the grant conflict message this part put on it."""

    def load(self) -> None:
        """A rebuild from the ledger: conflicts are judged again from the next listings."""
        self.conflicts = {}
        self.marked = {}

    def forgotten(self, record: LeaseRecord | None, lease_id: str) -> bool:
        """Whether a running container's lease is one to judge here rather than bind: unknown
        and not a lease finished here (a zombie), or still queued (never bound by a label)."""
        if record is None:
            return lease_id not in self.book.recent
        return record.state is LeaseState.QUEUED

    def adopt_or_flag(self, lease_id: str, holder: adoption.LabelHolder, grant: ContainerGrant,
                      host: str, node_time: float, now: float, changes: Changes,
                      found: dict[str, list[adoption.Conflict]], via: str) -> bool:
        """Adopt the container's grant, or record why not in ``found`` (container id ->
        conflicts); True when adopted."""
        record = self.book.leases.get(lease_id)
        queued = record is not None and record.state is LeaseState.QUEUED
        # Adopted leases hold their request keys apart from the hubs' (key_space): a label
        # naming someone's key takes it from nobody, and two labels cannot share one.
        conflicts = adoption.judge(lease_id, grant, host, self.cluster,
                                   self.book.by_key.get((ADOPTED_OWNER, grant.request_key)),
                                   holder, queued=queued)
        if not conflicts and not self.adoptions.take((None, host), now):
            # Each adoption is a lease row and its history: one agent credential must not
            # grow the ledger without bound by containers that come and go.
            conflicts = adoption.deferred(lease_id, grant, holder,
                                          self.settings.node_events_per_minute)
        container_id = holder.container_id
        if conflicts:
            known = {(c.kind, c.gpu_uuid)
                     for c in self.conflicts.get(host, {}).get(container_id, [])}
            for conflict in conflicts:
                if (conflict.kind, conflict.gpu_uuid) not in known:
                    self.counters.add(Count.ADOPTION_CONFLICT)
                    changes.event(now, "adoption_conflict", host=host, lease_id=lease_id,
                                  gpu_uuid=conflict.gpu_uuid, user=grant.user,
                                  container_id=container_id, container_name=holder.name,
                                  started_at=holder.started_at, conflict=conflict.kind.value,
                                  message=conflict.message)
            found[container_id] = conflicts
            return False
        self._adopt(lease_id, container_id, grant, host, node_time, now, changes, via)
        return True

    def _adopt(self, lease_id: str, container_id: str, grant: ContainerGrant, host: str,
               node_time: float, now: float, changes: Changes, via: str) -> None:
        book = self.book
        # Charged to nobody and the admins' alone (ADOPTED_OWNER): the labels' user, groups
        # and key are kept to show, but a label cannot be told from a forged one.
        record = LeaseRecord(lease_id=lease_id, request_key=grant.request_key,
                             user=grant.user, groups=tuple(grant.groups),
                             state=LeaseState.BOUND, created_at=now, request={},
                             owner=ADOPTED_OWNER)
        models = {self.cluster.gpus[u].model for u in grant.gpu_uuids}
        record.host = host
        record.gpu_uuids = tuple(grant.gpu_uuids)
        record.model = models.pop() if len(models) == 1 else None
        record.shared = grant.shared
        record.memory_mib = grant.memory_mib if grant.shared else None
        record.units = adoption.units_of(grant, self.cluster)
        record.granted_at = now
        record.bind_deadline = None
        record.bound_at = now
        record.container_id = container_id
        book.track(record)
        book.claim_gpus(record)
        self.index.refresh(self.cluster, host)
        book.node_clock_bound[lease_id] = node_time
        changes.transition(record, None, now, "adopted", by=f"node {host}")
        changes.event(now, "adopted", host=host, lease_id=lease_id, user=grant.user,
                      container_id=container_id, gpu_uuids=list(grant.gpu_uuids),
                      shared=grant.shared, memory_mib=grant.memory_mib, via=via, was=None)
        self.counters.add(Count.ADOPTED)

    def record_conflicts(self, host: str, found: dict[str, list[adoption.Conflict]], *,
                         complete: bool, gone: set[str] | None = None) -> bool:
        """Update the host's conflicts: a complete listing replaces them, anything else adds
        ``found`` and drops the containers in ``gone``; then mark the host's GPUs. True when
        a GPU left its conflict (it may fit a queued request now)."""
        current = {} if complete else dict(self.conflicts.get(host, {}))
        current.update(found)
        for container_id in gone or ():
            current.pop(container_id, None)
        # The host's own GPUs, not every GPU of the cluster: this runs for every heartbeat.
        node = self.cluster.nodes.get(host)
        before = {u for u in (node.gpu_uuids if node is not None else ()) if u in self.marked}
        if current:
            self.conflicts[host] = current
        else:
            self.conflicts.pop(host, None)
        messages: dict[str, str] = {}
        for conflicts in current.values():
            for conflict in conflicts:
                if conflict.gpu_uuid is not None:
                    messages.setdefault(conflict.gpu_uuid, conflict.message)
        changed = unblocked = False
        for gpu_uuid in before | set(messages):
            gpu = self.cluster.gpus.get(gpu_uuid)
            if gpu is None or gpu.host != host:
                continue  # another host's GPU: only its own host's listings mark it
            wanted = messages.get(gpu_uuid)
            mine = self.marked.get(gpu_uuid)
            if wanted is None:
                self.marked.pop(gpu_uuid, None)
                if gpu.conflict is not None and gpu.conflict == mine:
                    gpu.conflict = None
                    unblocked = changed = True
            elif gpu.conflict != wanted:
                self.marked[gpu_uuid] = wanted
                gpu.conflict = wanted
                changed = True
            else:
                self.marked[gpu_uuid] = wanted
        if changed:
            self.index.refresh(self.cluster, host)
        return unblocked

    def conflicted_gpus(self) -> dict[str, str]:
        """GPU uuid -> why it is out of placement (a running container's grant contradicts
        the ledger on it, or two hosts report it: a move conflict)."""
        return {u: g.conflict for u, g in self.cluster.gpus.items() if g.conflict is not None}
