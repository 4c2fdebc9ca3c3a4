"""A node's GPUs as its full report lists them: the upsert of each GPU, GPUs that moved to
another host or went missing, and which hosts' GPUs are steady (as their report has them)."""

from __future__ import annotations

from allocator import policy
from allocator.cluster import GPU, Cluster, Node
from allocator.config import AllocatorSettings
from allocator.counters import Count, Counters
from allocator.engine.nodes import NodeReports
from allocator.engine.state import count_anomaly, log
from allocator.ledger import Changes
from allocator.placement_index import PlacementIndex
from allocator.protocol import GPUInfo, Heartbeat


class GpuInventory:
    """Keeps the cluster's GPUs true to the nodes' reports.

    Invariant: a host is in ``steady`` only with the report whose upsert last changed and
    skipped nothing, and no other host's report took one of its GPUs since: upserting that
    report again would change nothing.
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

    def load(self) -> None:
        """A rebuild from the ledger: no report is known to match the GPUs."""
        self.steady.clear()

    def upsert(self, node: Node, beat: Heartbeat, now: float, changes: Changes) -> bool:
        """Upsert the node's GPUs; True when anything placement depends on changed."""
        changed = skipped = False
        listed: list[str] = []
        for info in sorted(beat.gpus, key=lambda g: (g.index, -1 if g.mig_index is None
                                                       else g.mig_index)):
            gpu, added = self._gpu_for(node, info, listed, now, changes)
            if gpu is None:
                skipped = True
                continue
            changed = self._refresh(gpu, node.host, info, now, changes) or added or changed
            listed.append(gpu.uuid)
        for gpu_uuid in node.gpu_uuids:
            if gpu_uuid not in listed:
                gpu = self.cluster.gpus.get(gpu_uuid)
                if gpu is not None and gpu.present and gpu.host == node.host:
                    gpu.present = False
                    changed = True
                    changes.event(now, "gpu_missing", host=node.host, gpu_uuid=gpu_uuid)
                    changes.gpu(gpu, now)
                    if gpu_uuid not in listed:
                        listed.append(gpu_uuid)
        if changed or set(node.gpu_uuids) != set(listed):
            ordered = sorted(set(listed) | {u for u in node.gpu_uuids
                                           if self.cluster.gpus.get(u) is not None
                                           and self.cluster.gpus[u].host == node.host},
                             key=lambda u: self.cluster.gpus[u].order)
            node.gpu_uuids = ordered
        if changed or skipped:
            self.steady.pop(node.host, None)
        else:
            self.steady[node.host] = beat
        return changed

    def _gpu_for(self, node: Node, info: GPUInfo, listed: list[str], now: float,
                 changes: Changes) -> tuple[GPU | None, bool]:
        """The cluster's GPU for a listed one (and True when it was added now), or None when
        the listing is skipped: a duplicate of an up host's GPU, or past ``max_gpus_per_host``."""
        gpu = self.cluster.gpus.get(info.uuid)
        if gpu is not None and gpu.host != node.host:
            owner = self.cluster.nodes.get(gpu.host)
            if owner is not None and gpu.present and self.nodes.up(owner, now):
                self.counters.add(Count.DUPLICATE_GPU)
                changes.event(now, "duplicate_gpu", host=node.host, gpu_uuid=info.uuid,
                              owner=gpu.host)
                return None, False
            # The GPU moved to another host while its old one is down: follow it.
            old_node = self.cluster.nodes.get(gpu.host)
            if old_node is not None and info.uuid in old_node.gpu_uuids:
                old_node.gpu_uuids.remove(info.uuid)
                self.index.refresh(self.cluster, old_node.host)
            self.steady.pop(gpu.host, None)  # its report no longer says what it has
            changes.event(now, "gpu_moved", host=node.host, gpu_uuid=info.uuid,
                          old_host=gpu.host)
            gpu = None
        if gpu is None and len(set(node.gpu_uuids) | set(listed)) \
                >= self.settings.max_gpus_per_host:
            # Cycling uuids would otherwise add a GPU row per heartbeat, forever.
            if count_anomaly(self.counters, Count.GPU_LIMIT):
                log.warning("ignored new GPU %s of %s: it has %d GPUs on record "
                            "(max_gpus_per_host)", info.uuid, node.host,
                            len(node.gpu_uuids))
                changes.event(now, "gpu_limit", host=node.host, gpu_uuid=info.uuid)
            return None, False
        if gpu is None:
            gpu = GPU(uuid=info.uuid, host=node.host, index=info.index, model=info.model,
                      memory_total_mib=info.memory_total_mib,
                      share_slots=policy.share_slots_for(info.model, self.settings))
            self.cluster.gpus[info.uuid] = gpu
            changes.gpu(gpu, now, first_seen=now)
            return gpu, True
        return gpu, False

    def _refresh(self, gpu: GPU, host: str, info: GPUInfo, now: float,
                 changes: Changes) -> bool:
        """Take the listed identity, capability, health and telemetry; True when anything
        placement depends on changed."""
        changed = False
        identity = (info.index, info.model, info.memory_total_mib)
        if (gpu.index, gpu.model, gpu.memory_total_mib) != identity or not gpu.present:
            gpu.index, gpu.model, gpu.memory_total_mib = identity
            gpu.share_slots = policy.share_slots_for(info.model, self.settings)
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
