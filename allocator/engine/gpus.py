"""A node's GPUs as its full report lists them: the upsert of each GPU, GPUs claimed by (and,
in time, moved to) another host, GPUs gone missing, and which hosts' GPUs are steady (as their
report has them).

A GPU uuid belongs to one host. A report that names a GPU of another host is a *claim*: while
that host holds the GPU (it is up and lists it) the claim is a duplicate and ignored. While it
does not (it is down, or no longer lists it), the claim is a *move conflict*: the GPU stays on
its old host's record, placed on neither host, its ``conflict`` saying who claims it since
when (an event ``gpu_move_conflict`` and the anomaly counter say so too). It moves only once
one host alone has claimed it for ``gpu_move_after_s`` and that host's report is complete
(its containers listed, nothing of it skipped, none of its own GPUs gone missing), so that a
forged report, or a host that reboots, cannot take another host's GPUs by being quick.
"""

from __future__ import annotations

import time

from allocator.config import AllocatorSettings
from allocator.engine.nodes import NodeReports
from allocator.engine.state import count_anomaly, log
from allocator.ledger.changes import Changes
from allocator.metrics.counters import Count, Counters
from allocator.placement.cluster import GPU, Cluster, Node
from allocator.placement.declared import beyond_declared
from allocator.placement.demand import share_slots_for
from allocator.placement.index import PlacementIndex
from allocator.wire.protocol import GPUInfo, Heartbeat


def iso(epoch: float) -> str:
    """An epoch time as people read it in a message (UTC, seconds)."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


class GpuInventory:
    """Keeps the cluster's GPUs true to the nodes' reports.

    Invariants: a host is in ``steady`` only with the report whose upsert last changed and
    skipped nothing, and no other host's report took or claimed one of its GPUs since:
    upserting that report again would change nothing. A GPU in ``claims`` is on record for a
    host that does not hold it, and carries the message in ``shown`` as its ``conflict``
    unless a grant conflict (:mod:`allocator.engine.node_truth`) took its place.
    """

    def __init__(self, settings: AllocatorSettings, counters: Counters, cluster: Cluster,
                 index: PlacementIndex, nodes: NodeReports) -> None:
        self.settings = settings
        self.counters = counters
        self.cluster = cluster
        self.index = index
        self.nodes = nodes
        self.steady: dict[str, Heartbeat] = {}
        """host -> the report whose GPU upsert last changed nothing and skipped nothing (it
        found the GPUs as the report has them), so a delta that changes nothing may skip the
        upsert (see ``Engine._liveness_only``)."""
        self.claims: dict[str, dict[str, float]] = {}
        """GPU uuid -> host claiming it -> since when (allocator time): the GPUs other hosts
        report while their own host does not hold them. Memory only: after a restart a
        claim starts again, which only delays a move."""
        self.shown: dict[str, str] = {}
        """GPU uuid -> the move conflict message this part put on the GPU (so that it clears
        its own message and never a grant conflict's)."""

    def load(self, now: float) -> None:
        """A rebuild from the ledger: no report is known to match the GPUs, no claim stands
        (the GPUs are new objects, without a conflict); what the site declared is judged at
        once, before anything is placed."""
        self.steady.clear()
        self.claims.clear()
        self.shown.clear()
        for node in self.cluster.nodes.values():
            self.judge_declared(node, now, None)

    def upsert(self, node: Node, beat: Heartbeat, now: float, changes: Changes) -> bool:
        """Upsert the node's GPUs, claims of other hosts' GPUs included; True when anything
        placement depends on changed."""
        changed = skipped = False
        listed: list[str] = []
        claimed: list[GPUInfo] = []
        for info in sorted(beat.gpus, key=lambda g: (g.index, -1 if g.mig_index is None
                                                       else g.mig_index)):
            gpu = self.cluster.gpus.get(info.uuid)
            if gpu is not None and gpu.host != node.host:
                if self._held(gpu, now):
                    self.counters.add(Count.DUPLICATE_GPU)
                    changes.event(now, "duplicate_gpu", host=node.host,
                                  gpu_uuid=info.uuid, owner=gpu.host)
                    skipped = True
                else:
                    claimed.append(info)
                continue
            if gpu is not None and info.uuid in self.claims:
                # Its own host lists it again: every other host's claim ends.
                self._end_claims(info.uuid, None, now, changes, f"{node.host} lists it again")
                changed = True
            if gpu is None:
                gpu = self._new_gpu(node, info, listed, now, changes)
                if gpu is None:
                    skipped = True
                    continue
                changed = True
            changed = self._refresh(gpu, node.host, info, now, changes) or changed
            listed.append(gpu.uuid)
        went_missing = False
        for gpu_uuid in node.gpu_uuids:
            if gpu_uuid not in listed:
                gpu = self.cluster.gpus.get(gpu_uuid)
                if gpu is not None and gpu.present and gpu.host == node.host:
                    gpu.present = False
                    changed = went_missing = True
                    changes.event(now, "gpu_missing", host=node.host, gpu_uuid=gpu_uuid)
                    changes.gpu(gpu, now)
                    if gpu_uuid not in listed:
                        listed.append(gpu_uuid)
        self._withdrawn(node.host, {info.uuid for info in claimed}, now, changes)
        complete = beat.containers_complete and not skipped and not went_missing
        for info in claimed:
            moved = self._claim(node, info, listed, complete, now, changes)
            if moved is None:
                skipped = True
                continue
            self._refresh(moved, node.host, info, now, changes)
            changed = True
            listed.append(moved.uuid)
        if changed or set(node.gpu_uuids) != set(listed):
            ordered = sorted(set(listed) | {u for u in node.gpu_uuids
                                           if self.cluster.gpus.get(u) is not None
                                           and self.cluster.gpus[u].host == node.host},
                             key=lambda u: self.cluster.gpus[u].order)
            node.gpu_uuids = ordered
        changed = self.judge_declared(node, now, changes) or changed
        if changed or skipped:
            self.steady.pop(node.host, None)
        else:
            self.steady[node.host] = beat
        return changed

    def judge_declared(self, node: Node, now: float, changes: Changes | None) -> bool:
        """Mark the node's GPUs beyond what the site declared for it (``declared_gpus``,
        :mod:`allocator.placement.declared`) and clear the others; True when a mark
        changed. A GPU newly beyond it is an event and an anomaly (none with ``changes``
        None: a load, which judges every node again)."""
        declared = self.settings.declared_gpus.get(node.host)
        gpus = [gpu for gpu in self.cluster.gpus_of(node.host)
                if gpu.host == node.host and gpu.present]
        beyond = ({} if declared is None else
                  beyond_declared(node.host, gpus, declared, self.settings.aliases))
        changed = False
        for gpu in gpus:
            wanted = beyond.get(gpu.uuid)
            if gpu.undeclared == wanted:
                continue
            if wanted is not None and gpu.undeclared is None and changes is not None:
                self.counters.add(Count.UNDECLARED_GPU)
                changes.event(now, "undeclared_gpu", host=node.host, gpu_uuid=gpu.uuid,
                              model=gpu.model, message=wanted)
            gpu.undeclared = wanted
            changed = True
        return changed

    def _held(self, gpu: GPU, now: float) -> bool:
        """Whether the GPU's own host holds it: it is up and lists it."""
        owner = self.cluster.nodes.get(gpu.host)
        return owner is not None and gpu.present and self.nodes.up(owner, now)

    def _new_gpu(self, node: Node, info: GPUInfo, listed: list[str], now: float,
                 changes: Changes) -> GPU | None:
        """A GPU row of ``node`` for a uuid it has not on record (new, or moving to it); None
        when the node has ``max_gpus_per_host`` GPUs on record already."""
        if len(set(node.gpu_uuids) | set(listed)) >= self.settings.max_gpus_per_host:
            # Cycling uuids would otherwise add a GPU row per heartbeat, forever.
            if count_anomaly(self.counters, Count.GPU_LIMIT):
                log.warning("ignored new GPU %s of %s: it has %d GPUs on record "
                            "(max_gpus_per_host)", info.uuid, node.host,
                            len(node.gpu_uuids))
                changes.event(now, "gpu_limit", host=node.host, gpu_uuid=info.uuid)
            return None
        gpu = GPU(uuid=info.uuid, host=node.host, index=info.index, model=info.model,
                  memory_total_mib=info.memory_total_mib,
                  share_slots=share_slots_for(info.model, self.settings))
        self.cluster.gpus[info.uuid] = gpu
        changes.gpu(gpu, now, first_seen=now)
        return gpu

    # ------------------------------------------------------------------ claims and moves

    def _claim(self, node: Node, info: GPUInfo, listed: list[str], complete: bool,
               now: float, changes: Changes) -> GPU | None:
        """``node`` reports a GPU on record for another host that does not hold it: record
        the claim, and move the GPU once it is due; the GPU row of ``node`` when it moved."""
        gpu = self.cluster.gpus[info.uuid]
        claimants = self.claims.setdefault(info.uuid, {})
        since = claimants.get(node.host)
        if since is not None and node.last_heartbeat is not None \
                and not self.nodes.up(node, now):
            since = None  # the claimant itself was down meanwhile: its claim did not stand
        if since is None:
            since = claimants[node.host] = now
            self.counters.add(Count.GPU_MOVE_CONFLICT)
            log.warning("%s reports GPU %s of %s, which does not hold it: a move conflict; it "
                        "moves after %.0f s (gpu_move_after_s) if the claim stands",
                        node.host, info.uuid, gpu.host, self.settings.gpu_move_after_s)
            changes.event(now, "gpu_move_conflict", host=node.host, gpu_uuid=info.uuid,
                          owner=gpu.host, move_after_s=self.settings.gpu_move_after_s,
                          claimants=sorted(claimants))
            # The owner's next report must not skip its upsert: it ends the claim.
            self.steady.pop(gpu.host, None)
        if (len(claimants) == 1 and complete
                and now - since >= self.settings.gpu_move_after_s):
            moved = self._new_gpu(node, info, listed, now, changes)
            if moved is not None:
                self._moved(gpu, node.host, since, now, changes)
                return moved
        self._show(gpu)
        return None

    def _moved(self, old: GPU, host: str, since: float, now: float,
               changes: Changes) -> None:
        """``old`` (the replaced row) has moved to ``host``: off its old node's record."""
        self.claims.pop(old.uuid, None)
        if old.conflict is not None and old.conflict == self.shown.get(old.uuid):
            old.conflict = None
        self.shown.pop(old.uuid, None)
        old_node = self.cluster.nodes.get(old.host)
        if old_node is not None and old.uuid in old_node.gpu_uuids:
            old_node.gpu_uuids.remove(old.uuid)
            self.index.refresh(self.cluster, old_node.host)
        self.steady.pop(old.host, None)  # its report no longer says what it has
        log.warning("GPU %s moved from %s to %s (claimed since %s)", old.uuid, old.host, host,
                    iso(since))
        changes.event(now, "gpu_moved", host=host, gpu_uuid=old.uuid, old_host=old.host,
                      claimed_since=since)

    def _withdrawn(self, host: str, claiming: set[str], now: float, changes: Changes) -> None:
        """``host``'s report claims exactly ``claiming`` of other hosts' GPUs: its other
        claims end."""
        if not self.claims:
            return
        for gpu_uuid, claimants in list(self.claims.items()):
            if host in claimants and gpu_uuid not in claiming:
                self._end_claims(gpu_uuid, host, now, changes,
                                 f"the report of {host} no longer claims it")

    def _end_claims(self, gpu_uuid: str, host: str | None, now: float, changes: Changes,
                    why: str) -> None:
        """End ``host``'s claim of the GPU (None: every claim); the conflict goes with the
        last one."""
        claimants = self.claims.get(gpu_uuid, {})
        for claimant in sorted(claimants) if host is None else [host]:
            if claimants.pop(claimant, None) is not None:
                changes.event(now, "gpu_move_withdrawn", host=claimant, gpu_uuid=gpu_uuid,
                              reason=why)
        gpu = self.cluster.gpus.get(gpu_uuid)
        if claimants:
            if gpu is not None:
                self._show(gpu)
            return
        self.claims.pop(gpu_uuid, None)
        shown = self.shown.pop(gpu_uuid, None)
        if gpu is not None and gpu.conflict is not None and gpu.conflict == shown:
            gpu.conflict = None
            self.index.refresh(self.cluster, gpu.host)

    def _show(self, gpu: GPU) -> None:
        """Put the GPU's move conflict on it (unless a grant conflict is shown there)."""
        claimants = self.claims.get(gpu.uuid, {})
        by = ", ".join(f"{host} since {iso(since)}" for host, since in sorted(
            claimants.items(), key=lambda item: (item[1], item[0])))
        state = "is down" if gpu.present else "no longer lists it"
        message = (f"reported by {by} while its host {gpu.host} {state}: a move conflict. It "
                   f"moves once one host alone has reported it for "
                   f"{self.settings.gpu_move_after_s:.0f} s (gpu_move_after_s) with a complete "
                   "report; until then it is placed on no host")
        shown = self.shown.get(gpu.uuid)
        if gpu.conflict is None or gpu.conflict == shown:
            if gpu.conflict != message:
                gpu.conflict = message
                self.index.refresh(self.cluster, gpu.host)
            self.shown[gpu.uuid] = message

    def _refresh(self, gpu: GPU, host: str, info: GPUInfo, now: float,
                 changes: Changes) -> bool:
        """Take the listed identity, capability, health and telemetry; True when anything
        placement depends on changed."""
        changed = False
        identity = (info.index, info.model, info.memory_total_mib)
        if (gpu.index, gpu.model, gpu.memory_total_mib) != identity or not gpu.present:
            gpu.index, gpu.model, gpu.memory_total_mib = identity
            gpu.share_slots = share_slots_for(info.model, self.settings)
            gpu.present = True
            changed = True
        # MIG mode and capability decide what is placeable: a change re-indexes the node.
        capability = (bool(info.mig_mode), info.mig_parent_uuid, info.mig_profile,
                      info.mig_index, info.compute_capability, info.architecture)
        if capability != (gpu.mig_enabled, gpu.mig_parent_uuid, gpu.mig_profile,
                          gpu.mig_index, gpu.compute_capability, gpu.architecture):
            (gpu.mig_enabled, gpu.mig_parent_uuid, gpu.mig_profile, gpu.mig_index,
             gpu.compute_capability, gpu.architecture) = capability
            changed = True
        if gpu.health != info.health or gpu.health_reasons != list(info.health_reasons):
            if gpu.health != info.health:
                changed = True
                changes.event(now, f"gpu_{info.health.value}", host=host,
                              gpu_uuid=gpu.uuid, reasons=list(info.health_reasons))
            gpu.health = info.health
            gpu.health_reasons = list(info.health_reasons)
        gpu.memory_used_mib = info.memory_used_mib
        gpu.utilization_pct = info.utilization_pct
        gpu.temperature_c = info.temperature_c
        gpu.power_w = info.power_w
        return changed
