"""Node truth: running containers give the ledger back what it forgot, and a fence at start.

The ledger can be behind the nodes: deleted, restored from last night's backup, or another
node's volume. The containers still run, and their labels carry their whole grant (see
:mod:`allocator.lease_container`). Here a container of a lease the ledger does not know (or
knows only as queued) becomes a ``bound`` lease again, its GPUs claimed (event and history reason
``adopted``), unless its grant contradicts what the allocator knows: then the GPUs it names
stay out of placement while the node lists it, an ``adoption_conflict`` event and counter say
why, and nothing is stopped (see :mod:`allocator.adoption`).

After a fenced load (:meth:`~allocator.engine.state.EngineState.load`), nothing is granted on
a node before its first complete report has been applied, so the adoptions come first.
"""

from __future__ import annotations

from allocator import adoption
from allocator.counters import Count
from allocator.engine.leases import LeaseBook
from allocator.lease import LeaseRecord
from allocator.ledger import Changes
from allocator.protocol import ContainerGrant, LeaseState


class NodeTruth(LeaseBook):
    """Adoption of running containers the ledger does not know, conflicts, and the fence."""

    def _adopt_or_flag(self, lease_id: str, container_id: str, grant: ContainerGrant,
                       host: str, node_time: float, now: float, changes: Changes,
                       found: dict[str, list[adoption.Conflict]], via: str) -> bool:
        """Adopt the container's grant, or record why not in ``found`` (container id ->
        conflicts); True when adopted."""
        conflicts = adoption.judge(lease_id, grant, host, self.cluster,
                                   self.by_key.get(grant.request_key))
        if conflicts:
            known = {(c.kind, c.gpu_uuid)
                     for c in self._conflicts.get(host, {}).get(container_id, [])}
            for conflict in conflicts:
                if (conflict.kind, conflict.gpu_uuid) not in known:
                    self.counters.add(Count.ADOPTION_CONFLICT)
                    changes.event(now, "adoption_conflict", host=host, lease_id=lease_id,
                                  gpu_uuid=conflict.gpu_uuid, user=grant.user,
                                  container_id=container_id, conflict=conflict.kind.value,
                                  message=conflict.message)
            found[container_id] = conflicts
            return False
        self._adopt(lease_id, container_id, grant, host, node_time, now, changes, via)
        return True

    def _adopt(self, lease_id: str, container_id: str, grant: ContainerGrant, host: str,
               node_time: float, now: float, changes: Changes, via: str) -> None:
        queued = self.leases.get(lease_id)
        old: LeaseState | None = None
        if queued is not None:  # a restored ledger that still has it waiting
            old = queued.state
            self._dequeue(lease_id)
            record = queued
        else:
            record = LeaseRecord(lease_id=lease_id, request_key=grant.request_key,
                                 user=grant.user, groups=tuple(grant.groups),
                                 state=LeaseState.BOUND,
                                 created_at=now, request={})
        models = {self.cluster.gpus[u].model for u in grant.gpu_uuids}
        record.state = LeaseState.BOUND
        record.host = host
        record.gpu_uuids = tuple(grant.gpu_uuids)
        record.model = models.pop() if len(models) == 1 else None
        record.shared = grant.shared
        record.memory_mib = grant.memory_mib if grant.shared else None
        record.units = adoption.units_of(grant, self.cluster)
        record.granted_at = record.granted_at or now
        record.bind_deadline = None
        record.bound_at = now
        record.container_id = container_id
        self._track(record)
        self._claim(record)
        self.index.refresh(self.cluster, host)
        self._node_clock_bound[lease_id] = node_time
        changes.transition(record, old, now, "adopted", by=f"node {host}")
        changes.event(now, "adopted", host=host, lease_id=lease_id, user=grant.user,
                      container_id=container_id, gpu_uuids=list(grant.gpu_uuids),
                      shared=grant.shared, memory_mib=grant.memory_mib, via=via,
                      was=old.value if old else None)
        self.counters.add(Count.ADOPTED)

    def _record_conflicts(self, host: str, found: dict[str, list[adoption.Conflict]], *,
                          complete: bool, gone: set[str] | None = None) -> bool:
        """Update the host's conflicts: a complete listing replaces them, anything else adds
        ``found`` and drops the containers in ``gone``; then mark the host's GPUs. True when
        a GPU left its conflict (it may fit a queued request now)."""
        current = {} if complete else dict(self._conflicts.get(host, {}))
        current.update(found)
        for container_id in gone or ():
            current.pop(container_id, None)
        # The host's own GPUs, not every GPU of the cluster: this runs for every heartbeat.
        node = self.cluster.nodes.get(host)
        before = {u for u in (node.gpu_uuids if node is not None else ())
                  if (gpu := self.cluster.gpus.get(u)) is not None and gpu.host == host
                  and gpu.conflict}
        if current:
            self._conflicts[host] = current
        else:
            self._conflicts.pop(host, None)
        messages: dict[str, str] = {}
        for conflicts in current.values():
            for conflict in conflicts:
                if conflict.gpu_uuid is not None:
                    messages.setdefault(conflict.gpu_uuid, conflict.message)
        changed = unblocked = False
        for gpu_uuid in before | set(messages):
            gpu = self.cluster.gpus.get(gpu_uuid)
            if gpu is None or gpu.host != host:
                continue
            wanted = messages.get(gpu_uuid)
            if gpu.conflict != wanted:
                unblocked = unblocked or wanted is None
                gpu.conflict = wanted
                changed = True
        if changed:
            self.index.refresh(self.cluster, host)
        return unblocked

    def conflicted_gpus(self) -> dict[str, str]:
        """GPU uuid -> why it is out of placement (a running container's grant contradicts
        the ledger on it)."""
        return {u: g.conflict for u, g in self.cluster.gpus.items() if g.conflict is not None}

    def _report_applied(self, host: str, now: float, changes: Changes) -> bool:
        """A complete report of ``host`` is applied: lift its fence; True if it was fenced."""
        if host not in self._fenced:
            return False
        self._fenced.discard(host)
        self._fence_awaits_first_report = False
        changes.event(now, "node_reported", host=host, fenced_left=len(self._fenced))
        return True
