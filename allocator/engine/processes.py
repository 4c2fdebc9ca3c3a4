"""What runs on each GPU, below the labels: the processes a node's report lists per GPU, held
against the leases on it.

Three rules keep a GPU out of placement (``GPU.process_state``; docs/reliability.md,
"Processes on a GPU"):

- **draining**: a lease whose container ran has ended; its GPUs are placed again once a
  report taken after the end (the report that ended it counts) lists none of that container's
  processes on them, or ``release_verify_s`` passed without one being seen;
- **stuck_process**: a process of that container was still listed ``release_verify_s`` after
  the end; the GPU stays out until a report no longer lists it (nothing is killed);
- **outside_use**: a process that no lease on the GPU accounts for (a container that holds no
  lease on it, or a process of the host) uses it; out while that lasts.

A lease whose container's processes use a GPU it was not granted is flagged
(``outside_grant``). Only what is known is judged: a GPU whose report says its processes are
not known (``processes`` None: an agent before 0.2.0, or NVML's process call failed) starts no
drain and no outside use, and ends neither a stuck process nor an outside use: it is judged
by its labels and events alone, as before 0.2.0. A MIG parent is not judged (it is never
granted; each instance is judged by its own list).

Memory only, like every verdict taken from reports: a reload (a restart, a failed commit, a
takeover) forgets it, and the next report decides again, by the outside-use rule (a process
an ended lease left behind is then a container without a lease).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from allocator.config import AllocatorSettings
from allocator.engine.nodes import NodeReports
from allocator.ledger.changes import Changes
from allocator.ledger.lease import LeaseRecord
from allocator.metrics.counters import Count, Counters
from allocator.placement.cluster import GPU, Cluster
from allocator.placement.index import PlacementIndex
from allocator.wire.protocol import GPUProcess, Heartbeat, LeaseState, ProcessState, ProcessView

MAX_EVENT_PROCESSES = 16
"""Processes an event names (the largest first): enough to find them, bounded in size."""


@dataclass
class Drain:
    """One GPU waiting to see its ended leases' containers gone."""

    since: float
    """The newest end among them (allocator time): the bound counts from it."""
    containers: dict[str, str] = field(default_factory=dict)
    """container id -> the ended lease it ran for."""
    stuck_since: float | None = None
    """When a process of one of them was found past the bound; None: still draining."""


def _described(processes: Iterable[GPUProcess]) -> list[dict[str, object]]:
    """Processes as an event lists them: pid, container, image, memory."""
    largest = sorted(processes, key=lambda p: (-(p.memory_used_mib or 0), p.pid))
    return [{"pid": p.pid, "name": p.name, "container_id": p.container_id,
             "container_name": p.container_name, "image": p.image,
             "memory_used_mib": p.memory_used_mib} for p in largest[:MAX_EVENT_PROCESSES]]


class ProcessWatch:
    """Holds each GPU's reported processes against its leases: drains, stuck processes,
    outside use, and leases using GPUs outside their grant.

    Invariants: ``GPU.process_state`` is set exactly on the GPUs in ``drains`` (draining or
    stuck) or ``outside`` (outside use), stuck before outside use before draining; ``outside``
    never lists a process of a container draining on that GPU.
    """

    def __init__(self, settings: AllocatorSettings, counters: Counters, cluster: Cluster,
                 index: PlacementIndex, nodes: NodeReports) -> None:
        self.settings = settings
        self.counters = counters
        self.cluster = cluster
        self.index = index
        self.nodes = nodes
        self.listed: dict[str, list[GPUProcess] | None] = {}
        """GPU uuid -> its processes in the newest report (None: not known)."""
        self.drains: dict[str, Drain] = {}
        """GPU uuid -> the ended leases' containers it waits to see gone."""
        self.outside: dict[str, list[GPUProcess]] = {}
        """GPU uuid -> the processes no lease on it accounts for, newest report."""
        self.outside_grant: dict[str, tuple[str, ...]] = {}
        """lease id -> GPUs its container's processes use outside its grant, newest report."""

    def load(self) -> None:
        """A rebuild from the ledger (the GPUs are new objects): forget every verdict; the
        next report of each node decides again."""
        self.listed.clear()
        self.drains.clear()
        self.outside.clear()
        self.outside_grant.clear()

    # ------------------------------------------------------------------ a lease ends

    def lease_ended(self, record: LeaseRecord, now: float) -> None:
        """``record`` ends now (before its claims are dropped): its GPUs drain, where its
        container ran and the GPU's processes are known."""
        self.outside_grant.pop(record.lease_id, None)
        if record.container_id is None:
            return  # no container ever ran for it: nothing to verify
        for gpu_uuid in record.gpu_uuids:
            gpu = self.cluster.gpus.get(gpu_uuid)
            if gpu is None or self.listed.get(gpu_uuid) is None:
                continue  # processes not known: placed as before 0.2.0
            drain = self.drains.setdefault(gpu_uuid, Drain(since=now))
            drain.since = max(drain.since, now)
            drain.containers[record.container_id] = record.lease_id
            self._show(gpu)  # the caller refreshes the index when it drops the claims

    def draining(self) -> list[str]:
        """The GPUs with a drain (draining or stuck), without scanning the cluster: fair share
        counts those whose ``process_state`` is draining as free for the waiters."""
        return list(self.drains)

    def draining_on(self, host: str) -> bool:
        """Whether a GPU of ``host`` waits for a report (the heartbeat's short path must not
        skip it)."""
        return any(gpu.host == host for gpu in self._gpus(self.drains))

    # ------------------------------------------------------------------ reports

    def observe(self, beat: Heartbeat, leases: Iterable[LeaseRecord], now: float,
                changes: Changes) -> bool:
        """One full report of ``beat.host`` (its containers reconciled, so ``leases`` are the
        leases placed there now): judge each GPU's processes. True when a GPU came back to
        placement (it may fit a queued request)."""
        host = beat.host
        holders: dict[str, LeaseRecord] = {}
        """container id -> the lease holding GPUs it runs for."""
        unbound: set[str] = set()
        """GPUs of granted leases no container is known for yet: a process there may be its
        container's, starting before the report that binds it."""
        for record in leases:
            if not record.state.holds_gpus:
                continue
            if record.container_id is not None:
                holders[record.container_id] = record
            elif record.state is LeaseState.GRANTED:
                unbound.update(record.gpu_uuids)
        outside_grant: dict[str, list[str]] = {}
        unblocked = changed = False
        for info in beat.gpus:
            gpu = self.cluster.gpus.get(info.uuid)
            if gpu is None or gpu.host != host or gpu.mig_enabled:
                continue  # another host's (a claim), or a MIG parent: never granted whole
            processes = info.processes
            self.listed[gpu.uuid] = processes
            if processes is None:
                continue  # not known: nothing starts or ends on it
            drain = self.drains.get(gpu.uuid)
            draining = drain.containers if drain is not None else {}
            left: list[GPUProcess] = []
            outside: list[GPUProcess] = []
            for process in processes:
                container = process.container_id
                if container is not None and container in draining:
                    left.append(process)
                    continue
                holder = holders.get(container) if container is not None else None
                if holder is not None and gpu.uuid in holder.gpu_uuids:
                    continue  # its own lease's container
                if holder is None and container is not None and gpu.uuid in unbound \
                        and not process.container_name:
                    continue  # a lease container (the agent names no other) not yet bound
                if holder is not None:
                    outside_grant.setdefault(holder.lease_id, []).append(gpu.uuid)
                outside.append(process)
            before = gpu.process_state
            if drain is not None:
                # Processes the report left out may be the container's: only the bound
                # settles a drain then.
                self._judge_drain(gpu, drain, left, info.processes_omitted > 0, now, changes)
            self._judge_outside(gpu, outside, now, changes)
            self._show(gpu)
            if gpu.process_state != before:
                changed = True
                unblocked = unblocked or gpu.process_state is None
        self._flag_outside_grant(host, holders, outside_grant, now, changes)
        if changed:
            self.index.refresh(self.cluster, host)
        return unblocked

    def _judge_drain(self, gpu: GPU, drain: Drain, left: list[GPUProcess], partial: bool,
                     now: float, changes: Changes) -> None:
        """A report after the end: the drain ends when it lists none of the containers (and
        left none out); past the bound, what it still lists is stuck."""
        if not left:
            if not partial:
                self._end_drain(gpu, drain, now, changes)
        elif drain.stuck_since is None and now - drain.since >= self.settings.release_verify_s:
            self._stuck(gpu, drain, left, now, changes)

    def _end_drain(self, gpu: GPU, drain: Drain, now: float, changes: Changes) -> None:
        del self.drains[gpu.uuid]
        if drain.stuck_since is not None:
            changes.event(now, "stuck_process_gone", host=gpu.host, gpu_uuid=gpu.uuid,
                          lease_ids=sorted(set(drain.containers.values())),
                          stuck_s=round(now - drain.stuck_since, 3))

    def _stuck(self, gpu: GPU, drain: Drain, left: list[GPUProcess], now: float,
               changes: Changes) -> None:
        drain.stuck_since = now
        self.counters.add(Count.STUCK_PROCESS)
        changes.event(now, "stuck_process", host=gpu.host, gpu_uuid=gpu.uuid,
                      lease_ids=sorted(set(drain.containers.values())),
                      container_ids=sorted({p.container_id for p in left if p.container_id}),
                      pids=sorted(p.pid for p in left), processes=_described(left),
                      release_verify_s=self.settings.release_verify_s)

    def _judge_outside(self, gpu: GPU, outside: list[GPUProcess], now: float,
                       changes: Changes) -> None:
        """One event when outside use starts, one when it ends."""
        was = gpu.uuid in self.outside
        if outside:
            self.outside[gpu.uuid] = outside
            if not was:
                self.counters.add(Count.OUTSIDE_USE)
                changes.event(now, "outside_use", host=gpu.host, gpu_uuid=gpu.uuid,
                              pids=sorted(p.pid for p in outside),
                              processes=_described(outside))
        elif was:
            del self.outside[gpu.uuid]
            changes.event(now, "outside_use_ended", host=gpu.host, gpu_uuid=gpu.uuid)

    def _flag_outside_grant(self, host: str, holders: dict[str, LeaseRecord],
                            found: dict[str, list[str]], now: float, changes: Changes) -> None:
        """Set each listed lease's GPUs outside its grant; an event when one is new."""
        for record in holders.values():
            used = tuple(sorted(set(found.get(record.lease_id, ()))))
            known = self.outside_grant.get(record.lease_id, ())
            if not used:
                self.outside_grant.pop(record.lease_id, None)
                continue
            self.outside_grant[record.lease_id] = used
            if set(used) - set(known):
                self.counters.add(Count.OUTSIDE_GRANT)
                changes.event(now, "outside_grant", host=host, lease_id=record.lease_id,
                              user=record.user, container_id=record.container_id,
                              granted=list(record.gpu_uuids), gpu_uuids=list(used))

    # ------------------------------------------------------------------ timers

    def tick(self, now: float, changes: Changes) -> bool:
        """Drains past ``release_verify_s`` that no report settled: stuck when the newest
        list still shows a process of theirs, else over (placed again). True when a GPU came
        back to placement."""
        if not self.drains:
            return False
        bound = self.settings.release_verify_s
        refresh: set[str] = set()
        unblocked = False
        for gpu_uuid, drain in list(self.drains.items()):
            if drain.stuck_since is not None or now - drain.since < bound:
                continue
            gpu = self.cluster.gpus.get(gpu_uuid)
            if gpu is None:
                del self.drains[gpu_uuid]
                continue
            left = [p for p in self.listed.get(gpu_uuid) or ()
                    if p.container_id is not None and p.container_id in drain.containers]
            if left:
                self._stuck(gpu, drain, left, now, changes)
            else:
                self._end_drain(gpu, drain, now, changes)
            before = gpu.process_state
            self._show(gpu)
            if gpu.process_state != before:
                refresh.add(gpu.host)
                unblocked = unblocked or gpu.process_state is None
        for host in sorted(refresh):
            self.index.refresh(self.cluster, host)
        return unblocked

    # ------------------------------------------------------------------ views

    def _show(self, gpu: GPU) -> None:
        """Put the GPU's process state on it: stuck, outside use, draining, or none."""
        drain = self.drains.get(gpu.uuid)
        if drain is not None and drain.stuck_since is not None:
            gpu.process_state = ProcessState.STUCK_PROCESS
        elif gpu.uuid in self.outside:
            gpu.process_state = ProcessState.OUTSIDE_USE
        elif drain is not None:
            gpu.process_state = ProcessState.DRAINING
        else:
            gpu.process_state = None

    def _gpus(self, uuids: Iterable[str]) -> Iterable[GPU]:
        for gpu_uuid in uuids:
            gpu = self.cluster.gpus.get(gpu_uuid)
            if gpu is not None:
                yield gpu

    def processes_of(self, gpu_uuid: str, lease_of: dict[str, str]) -> list[ProcessView] | None:
        """The GPU's processes in the newest report, each with the lease its container runs
        for (``lease_of``: container id -> lease id); None: not known."""
        listed = self.listed.get(gpu_uuid)
        if listed is None:
            return None
        drain = self.drains.get(gpu_uuid)
        ended = drain.containers if drain is not None else {}
        return [ProcessView(pid=p.pid, memory_used_mib=p.memory_used_mib, name=p.name,
                            container_id=p.container_id, container_name=p.container_name,
                            image=p.image,
                            lease_id=None if p.container_id is None
                            else lease_of.get(p.container_id, ended.get(p.container_id)))
                for p in listed]
