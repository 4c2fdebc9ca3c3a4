"""Node reconciliation: what node agents report (heartbeats, container events), held against
the lease book.

A heartbeat upserts its node's GPUs and lists the lease-labelled containers running there: a
listed container binds its lease, a missing one ends it after a grace period. A heartbeat
delta is applied as the full heartbeat it stands for (the host's report held, with the delta's
entries: :func:`~allocator.heartbeat_delta.apply_delta`), or, when it does not fit that report,
as a sign of life only. A delta that changes nothing, onto a host whose GPUs and leases are
as its report has them, takes a shorter path to the same result
(:meth:`NodeReconciliation._liveness_only`). Container events bind or end a lease at once.
Admin drains also live here: they change what nodes offer.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from allocator import policy
from allocator.adoption import Conflict
from allocator.cluster import GPU, Node
from allocator.counters import Count, Family
from allocator.engine.node_truth import NodeTruth
from allocator.engine.state import CLOCK_SKEW_WARN_S, Sender, log
from allocator.heartbeat_delta import apply_delta
from allocator.lease import LeaseRecord
from allocator.ledger import Changes
from allocator.protocol import (
    ContainerAction,
    ContainerEvent,
    ContainerInfo,
    DrainReply,
    DrainRequest,
    ErrorCode,
    Heartbeat,
    HeartbeatDelta,
    LeaseState,
    ReleaseReason,
    StopReason,
    error_reply,
)

_GRACE_ENDS = (LeaseState.BOUND, LeaseState.RELEASING)
"""States of a lease that a complete listing without its container ends after a grace."""


def _listing_order(info: ContainerInfo) -> tuple[float, str]:
    """Oldest first: of two containers claiming one GPU, the one that ran first is adopted."""
    return (info.started_at or 0.0, info.container_id)


class NodeReconciliation(NodeTruth):
    """Keeps memory true to what the node agents report."""

    def _node_may_report(self, host: str, sender: Sender, now: float, changes: Changes,
                         kind: str) -> bool:
        if self.settings.allow_any_node_user:
            return True
        expected = self.settings.node_users.get(host) or self.settings.node_user_template.format(
            host=host)
        if sender.user_id == expected:
            return True
        self.counters.add_to(Family.NODE_MESSAGE_REJECTED, kind)
        log.warning("refused %s for host %r from broker user %r (expected %r)",
                    kind, host, sender.user_id, expected)
        changes.event(now, f"{kind}_rejected", host=host, from_user=sender.user_id,
                      expected_user=expected)
        return False

    def _stale(self, beat: Heartbeat | HeartbeatDelta) -> bool:
        """Whether ``beat`` is older news than the newest heartbeat accepted for its host.

        The same agent counts in ``seq`` (its clock may step back; its counter does not). A
        heartbeat under another ``agent_id`` is news only if sent after the newest accepted
        one: a restarted agent's first heartbeat is, a replayed capture (whatever agent id it
        claims) is not.
        """
        newest = self._newest_beat.get(beat.host)
        if newest is None:
            return False
        agent_id, seq, sent_at = newest
        return beat.seq <= seq if beat.agent_id == agent_id else beat.sent_at <= sent_at

    def _may_add_host(self, host: str, sender: Sender, now: float, changes: Changes) -> bool:
        """Whether the sender may bring one more host in (``max_hosts_per_node_user``): else a
        user who may report for any host could fill memory, the ledger and every inventory
        reply with invented hosts."""
        if self._hosts_of_user[sender.user_id or ""] < self.settings.max_hosts_per_node_user:
            return True
        if self._count_anomaly(Count.HOST_LIMIT):
            log.warning("refused new host %r: broker user %r reports for %d hosts already "
                        "(max_hosts_per_node_user)", host, sender.user_id,
                        self._hosts_of_user[sender.user_id or ""])
            changes.event(now, "host_limit", host=host, from_user=sender.user_id)
        return False

    def _count_anomaly(self, kind: Count) -> bool:
        """Count one more ``kind``; True for the first and every 1000th, the ones worth a log
        line and a ledger event (one per heartbeat would grow the ledger without end)."""
        self.counters.add(kind)
        return self.counters[kind.value] % 1000 == 1

    def _heartbeat_delta(self, delta: HeartbeatDelta, sender: Sender, now: float,
                         changes: Changes) -> None:
        """Apply the full report ``delta`` stands for; if it does not fit the report held
        (a gap in ``seq``: a message was lost, or this allocator started since), take it as
        a sign of life only and wait for the host's next full report."""
        if self._stale(delta):
            self.counters.add(Count.HEARTBEAT_STALE)
            return
        base = self._reported.get(delta.host)
        beat = apply_delta(base, delta) if base is not None else None
        if beat is not None and base is not None:
            self.counters.add(Count.HEARTBEAT_DELTAS)
            if not (delta.gpus or delta.containers) and self._liveness_only(base, beat, sender,
                                                                             now, changes):
                return
            self._heartbeat(beat, sender, now, changes)
            return
        node = self.cluster.nodes.get(delta.host)
        if base is not None:
            del self._reported[delta.host]
            if self._count_anomaly(Count.HEARTBEAT_DELTA_GAPS):
                log.info("heartbeat delta %d of %s does not follow the report held (seq %d "
                         "of agent %s); awaiting its next full report", delta.seq, delta.host,
                         base.seq, base.agent_id[:8])
        else:
            self.counters.add(Count.HEARTBEAT_DELTAS_UNAPPLIED)
        if node is None:
            return  # a delta cannot bring a host in: only a full report says what it has
        self._newest_beat[delta.host] = (delta.agent_id, delta.seq, delta.sent_at)
        self.counters.add(Count.HEARTBEATS)
        self._alive(node, sender, now, changes)

    def _liveness_only(self, base: Heartbeat, beat: Heartbeat, sender: Sender, now: float,
                       changes: Changes) -> bool:
        """Apply ``beat``, the report an empty delta onto ``base`` stands for, without the
        passes that would change nothing; False, having changed nothing, when they might.

        The full path (:meth:`_heartbeat`) would find the GPUs as ``base`` left them (the
        upsert of ``base`` changed and skipped nothing, and no other report took one since:
        :attr:`_gpus_steady`), every listed container that of a lease bound here, no lease
        of the host missing from the listing that a grace could end, no conflict to lift
        (a container event may have recorded one since) and no fence to open (implied today:
        a complete report held has lifted it; checked so that a change to the fence cannot
        make this path skip it). What it still does then, this does in the same order: hold
        the report, liveness, telemetry when it is due, and each listed lease's budget check
        and use sample (those depend on the time, not on change).
        ``tests/test_heartbeat_fast_path.py`` holds the two paths equal.
        """
        host = beat.host
        node = self.cluster.nodes.get(host)
        if (node is None or node.agent_id != beat.agent_id
                or self._gpus_steady.get(host) is not base or host in self._conflicts
                or (beat.containers_complete and host in self._fenced)):
            return False
        listed = sorted(beat.containers, key=_listing_order)
        records: list[LeaseRecord] = []
        for info in listed:
            # Bound here: neither adopted nor unexpected, nothing to bind or to stop. (Two
            # containers of one lease are two samples, as in the full path.)
            record = self.leases.get(info.lease_id)
            if record is None or record.host != host or record.state is not LeaseState.BOUND:
                return False
            records.append(record)
        running = {record.lease_id for record in records}
        if beat.containers_complete and any(
                record.lease_id not in running and record.state in _GRACE_ENDS
                for record in self._by_host.get(host, {}).values()):
            return False
        self._hold(beat, now, changes)
        self._gpus_steady[host] = beat
        self._alive_and_telemetry(node, sender, now, changes, due=False, new_node=False)
        for record, info in zip(records, listed, strict=True):
            self._node_clock_bound.setdefault(record.lease_id, beat.sent_at)
            self._check_budget(record, info, now, changes)
            self._observe_use(record, info, now, changes)
        return True

    def _hold(self, beat: Heartbeat, now: float, changes: Changes) -> None:
        """``beat`` is the host's newest report: hold it (what the next delta applies onto)
        and note its listing and its clock."""
        self._newest_beat[beat.host] = (beat.agent_id, beat.seq, beat.sent_at)
        self._reported[beat.host] = beat
        if beat.containers_complete:
            self._cannot_list.discard(beat.host)
        else:
            self._cannot_list.add(beat.host)
        self.counters.add(Count.HEARTBEATS)
        skew = beat.sent_at - now
        if abs(skew) > CLOCK_SKEW_WARN_S:
            # Liveness uses receipt time, so a skewed node clock harms nothing here; but the
            # agent's event times feed the container checks, so an admin should know.
            self.counters.add(Count.HEARTBEAT_CLOCK_SKEW)
            if beat.host not in self._skewed:
                self._skewed.add(beat.host)
                log.warning("node %s's clock is %+.1f s off the allocator's", beat.host, skew)
                changes.event(now, "clock_skew", host=beat.host, skew_s=round(skew, 1))
        else:
            self._skewed.discard(beat.host)

    def _alive_and_telemetry(self, node: Node, sender: Sender, now: float, changes: Changes,
                             *, due: bool, new_node: bool) -> None:
        """Liveness, then the GPU telemetry rows when ``due`` or ``telemetry_persist_s``
        passed since they were last written."""
        persist = due or (now - self._telemetry_saved.get(node.host, 0.0)
                          >= self.settings.telemetry_persist_s)
        self._alive(node, sender, now, changes, new_node=new_node)
        # GPU telemetry is written only when it matters or now and then.
        if persist:
            self._telemetry_saved[node.host] = now
            for gpu in self.cluster.gpus_of(node.host):
                changes.gpu(gpu, now)

    def _alive(self, node: Node, sender: Sender, now: float, changes: Changes,
               *, new_node: bool = False) -> None:
        """The node was heard from now: it is up, and the ledger says so."""
        # Receipt time, not the node's clock: a node whose clock runs ahead must not look alive
        # longer than it is.
        node.last_heartbeat = now
        if node.host in self._down:
            self._down.discard(node.host)
            if not new_node:
                changes.event(now, "node_up", host=node.host)
        # The node row (last heartbeat) is written every time so that a standby taking over
        # knows which nodes are alive.
        changes.node(node, agent_user=sender.user_id, first_seen=now if new_node else None)

    def _heartbeat(self, beat: Heartbeat, sender: Sender, now: float, changes: Changes) -> None:
        if self._stale(beat):
            self.counters.add(Count.HEARTBEAT_STALE)  # replayed or reordered: older news
            return
        if beat.host not in self.cluster.nodes and not self._may_add_host(beat.host, sender,
                                                                           now, changes):
            return
        self._hold(beat, now, changes)
        node = self.cluster.nodes.get(beat.host)
        new_node = node is None
        if node is None:
            node = Node(host=beat.host)
            self.cluster.nodes[beat.host] = node
            self._hosts_of_user[sender.user_id or ""] += 1
            if now < self._fence_until:
                # During the start fence, placeable once a complete report is applied (this
                # one, usually): only then is it known which GPUs running containers hold.
                self._fenced.add(beat.host)
            changes.event(now, "node_joined", host=beat.host, agent_id=beat.agent_id)
        agent_changed = node.agent_id != beat.agent_id
        node.agent_id = beat.agent_id
        inventory_changed = self._update_gpus(node, beat, now, changes)
        if inventory_changed:
            self.index.refresh(self.cluster, beat.host)
            self._catalog = None
        self._alive_and_telemetry(node, sender, now, changes,
                                  due=new_node or agent_changed or inventory_changed,
                                  new_node=new_node)
        freed = self._reconcile_containers(beat, now, changes)
        # Adoptions first (above), then the node is placeable.
        reported = beat.containers_complete and self._report_applied(beat.host, now, changes)
        if inventory_changed or freed or reported:
            self._serve_queue(now, changes)
        if reported and now < self._fence_until and not self._fence_holds(now):
            self._close_fence(now, changes)

    def _update_gpus(self, node: Node, beat: Heartbeat, now: float, changes: Changes) -> bool:
        """Upsert the node's GPUs; True when anything placement depends on changed."""
        changed = skipped = False
        listed: list[str] = []
        for info in sorted(beat.gpus, key=lambda g: (g.index, -1 if g.mig_index is None
                                                       else g.mig_index)):
            gpu = self.cluster.gpus.get(info.uuid)
            if gpu is not None and gpu.host != node.host:
                owner = self.cluster.nodes.get(gpu.host)
                if owner is not None and gpu.present and self._up(owner, now):
                    self.counters.add(Count.DUPLICATE_GPU)
                    changes.event(now, "duplicate_gpu", host=node.host, gpu_uuid=info.uuid,
                                  owner=gpu.host)
                    skipped = True
                    continue
                # The GPU moved to another host while its old one is down: follow it.
                old_node = self.cluster.nodes.get(gpu.host)
                if old_node is not None and info.uuid in old_node.gpu_uuids:
                    old_node.gpu_uuids.remove(info.uuid)
                    self.index.refresh(self.cluster, old_node.host)
                self._gpus_steady.pop(gpu.host, None)  # its report no longer says what it has
                changes.event(now, "gpu_moved", host=node.host, gpu_uuid=info.uuid,
                              old_host=gpu.host)
                gpu = None
            if gpu is None and len(set(node.gpu_uuids) | set(listed)) \
                    >= self.settings.max_gpus_per_host:
                # Cycling uuids would otherwise add a GPU row per heartbeat, forever.
                if self._count_anomaly(Count.GPU_LIMIT):
                    log.warning("ignored new GPU %s of %s: it has %d GPUs on record "
                                "(max_gpus_per_host)", info.uuid, node.host,
                                len(node.gpu_uuids))
                    changes.event(now, "gpu_limit", host=node.host, gpu_uuid=info.uuid)
                skipped = True
                continue
            if gpu is None:
                gpu = GPU(uuid=info.uuid, host=node.host, index=info.index, model=info.model,
                          memory_total_mib=info.memory_total_mib,
                          share_slots=policy.share_slots_for(info.model, self.settings))
                self.cluster.gpus[info.uuid] = gpu
                changes.gpu(gpu, now, first_seen=now)
                changed = True
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
                    changes.event(now, f"gpu_{info.health.value}", host=node.host,
                                  gpu_uuid=gpu.uuid, reasons=list(info.health_reasons))
                gpu.health = info.health
                gpu.health_reasons = list(info.health_reasons)
            gpu.memory_used_mib = info.memory_used_mib
            gpu.utilization_pct = info.utilization_pct
            gpu.temperature_c = info.temperature_c
            gpu.power_w = info.power_w
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
            self._gpus_steady.pop(node.host, None)
        else:
            self._gpus_steady[node.host] = beat
        return changed

    def _reconcile_containers(self, beat: Heartbeat, now: float, changes: Changes) -> bool:
        """Bind leases whose containers run; release those whose containers are gone.

        Returns whether any GPU was freed.
        """
        running = {c.lease_id: c for c in beat.containers}
        found: dict[str, list[Conflict]] = {}
        for info in sorted(beat.containers, key=_listing_order):
            record = self.leases.get(info.lease_id)
            if self._forgotten(record, info.lease_id) and info.grant is not None:
                # Oldest first: of two containers claiming one GPU, the one that ran first
                # is adopted and the other is the conflict.
                if not self._adopt_or_flag(info.lease_id, info.container_id, info.grant,
                                           beat.host, beat.sent_at, now, changes, found,
                                           "heartbeat"):
                    continue
                record = self.leases[info.lease_id]
            if record is None or record.host != beat.host:
                self._unexpected_container(info.lease_id, info.container_id, beat.host, now,
                                           changes)
                continue
            if record.state is LeaseState.GRANTED:
                self._bind(record, info.container_id, beat.sent_at, now, changes, "heartbeat")
            elif record.container_id is None:
                record.container_id = info.container_id
                changes.lease(record)
            if record.state is LeaseState.RELEASING:
                self._ask_stop(record.host, record.lease_id, info.container_id,
                               StopReason.RELEASED, now, changes, observed=True)
            self._node_clock_bound.setdefault(record.lease_id, beat.sent_at)
            self._check_budget(record, info, now, changes)
            self._observe_use(record, info, now, changes)
        freed = self._record_conflicts(beat.host, found, complete=beat.containers_complete)
        if not beat.containers_complete:
            return freed
        grace = self.settings.container_gone_grace_s
        for record in list(self._by_host.get(beat.host, {}).values()):
            if record.lease_id in running:
                continue
            if record.state is LeaseState.BOUND:
                seen = self._node_clock_bound.get(record.lease_id, 0.0)
                if beat.sent_at - seen > grace:
                    self._end_lease(record, LeaseState.RELEASED, ReleaseReason.CONTAINER_GONE, now,
                                 changes, by=f"node {beat.host}")
                    freed = True
            elif record.state is LeaseState.RELEASING:
                # Stopped by the hub: the node no longer runs it (or never did: a failed spawn).
                seen = self._node_clock_bound.get(record.lease_id, 0.0)
                if beat.sent_at - seen > grace:
                    self._end_lease(record, LeaseState.RELEASED,
                                 ReleaseReason.CONTAINER_GONE if record.bound_at
                                 else ReleaseReason.STOPPED,
                                 now, changes, by=f"node {beat.host}")
                    freed = True
        return freed

    def _forgotten(self, record: LeaseRecord | None, lease_id: str) -> bool:
        """Whether a running container's lease is one the ledger lost: unknown and not a
        lease finished here (a zombie), or still queued (a restored ledger)."""
        if record is None:
            return lease_id not in self.recent
        return record.state is LeaseState.QUEUED

    def _unexpected_container(self, lease_id: str, container_id: str, host: str, now: float,
                              changes: Changes) -> None:
        finished = self.recent.get(lease_id)
        kind = Count.ZOMBIE_CONTAINER if finished is not None else Count.UNKNOWN_LEASE_CONTAINER
        self.counters.add(kind)
        changes.event(now, kind.value, host=host, lease_id=lease_id, container_id=container_id)
        if finished is not None and finished.host in (None, host):
            # A container of a lease this allocator finished (e.g. a start after the bind
            # deadline reclaimed it): it would use GPUs the ledger gave away. A lease the
            # allocator does not know is left alone: it may be another cluster's.
            self._ask_stop(host, lease_id, container_id, StopReason.LEASE_FINISHED, now,
                           changes, observed=True)

    def _check_budget(self, record: LeaseRecord, info: Any, now: float, changes: Changes) -> None:
        if not record.shared or record.memory_mib is None:
            return
        used = sum(use.memory_used_mib for use in info.gpu_use)
        if used > record.memory_mib and record.lease_id not in self._over_budget:
            self._over_budget.add(record.lease_id)
            self.counters.add(Count.OVER_BUDGET)
            changes.event(now, "over_budget", host=record.host, lease_id=record.lease_id,
                          user=record.user, used_mib=used, budget_mib=record.memory_mib)
        elif used <= record.memory_mib:
            self._over_budget.discard(record.lease_id)

    def _bind(self, record: LeaseRecord, container_id: str, node_time: float, now: float,
              changes: Changes, via: str) -> None:
        old = record.state
        record.state = LeaseState.BOUND
        record.container_id = container_id
        record.bound_at = now
        self._node_clock_bound[record.lease_id] = node_time
        changes.transition(record, old, now, f"container {container_id[:12]} running ({via})",
                           by=f"node {record.host}")
        self.counters.add(Count.BOUND)

    def _container_event(self, event: ContainerEvent, now: float, changes: Changes) -> None:
        self.counters.add_to(Family.CONTAINER_EVENT, event.action.value)
        record = self.leases.get(event.lease_id)
        if event.action is ContainerAction.START and event.grant is not None \
                and self._forgotten(record, event.lease_id):
            found: dict[str, list[Conflict]] = {}
            if self._adopt_or_flag(event.lease_id, event.container_id, event.grant,
                                   event.host, event.at, now, changes, found, "start event"):
                return
            self._record_conflicts(event.host, found, complete=False)
            return
        if (event.action is not ContainerAction.START
                and event.container_id in self._conflicts.get(event.host, {})
                and self._record_conflicts(event.host, {}, complete=False,
                                           gone={event.container_id})):
            self._serve_queue(now, changes)
        if record is None or record.host != event.host or not record.state.holds_gpus:
            if event.action is ContainerAction.START:
                self._unexpected_container(event.lease_id, event.container_id, event.host, now,
                                           changes)
            return
        if event.action is ContainerAction.START:
            if record.state is LeaseState.GRANTED:
                self._bind(record, event.container_id, event.at, now, changes, "start event")
            elif record.container_id is None:
                record.container_id = event.container_id
                self._node_clock_bound[record.lease_id] = event.at
                changes.lease(record)
            if record.state is LeaseState.RELEASING:
                # The hub stopped the server before its container started (or a replaced
                # task started): stop it too.
                self._ask_stop(record.host, record.lease_id, event.container_id,
                               StopReason.RELEASED, now, changes, observed=True)
            return
        if record.container_id not in (None, event.container_id):
            return  # an older container of the same lease (a replaced task); not the holder
        exit_note = f"{event.action.value}" + (
            f", exit code {event.exit_code}" if event.exit_code is not None else "")
        self._end_lease(record, LeaseState.RELEASED, ReleaseReason.CONTAINER_EXITED, now, changes,
                     by=f"node {event.host}", note=exit_note)
        self._serve_queue(now, changes)

    def _silent_for(self, host: str, now: float) -> float:
        node = self.cluster.nodes.get(host)
        last = max(node.last_heartbeat or 0.0 if node else 0.0, self.started_at)
        return now - last

    def _drain(self, request: DrainRequest, sender: Sender, now: float,
               changes: Changes) -> BaseModel:
        if sender.user_id not in self.settings.admin_users:
            return error_reply(ErrorCode.FORBIDDEN,
                               f"drain is for admins; broker user {sender.user_id!r} is not "
                               "in admin_users")
        node = self.cluster.nodes.get(request.host)
        if node is None:
            return error_reply(ErrorCode.UNKNOWN_HOST, f"no node {request.host!r}; known: "
                               + (", ".join(sorted(self.cluster.nodes)) or "none"),
                               known=sorted(self.cluster.nodes))
        by = f"{request.by} ({sender.user_id})"
        if request.gpu_uuid is not None:
            gpu = self.cluster.gpus.get(request.gpu_uuid)
            if gpu is None or gpu.host != request.host:
                return error_reply(ErrorCode.NOT_FOUND,
                                   f"no GPU {request.gpu_uuid!r} on {request.host!r}")
            gpu.drained = request.drained
            changes.gpu(gpu, now)
            self.index.refresh(self.cluster, request.host)
        else:
            node.drained = request.drained
            changes.node(node, drain_reason=request.reason, drained_by=by, drained_at=now)
        changes.event(now, "drain" if request.drained else "undrain", host=request.host,
                      gpu_uuid=request.gpu_uuid, by=by, reason=request.reason)
        if not request.drained:
            self._serve_queue(now, changes)
        return DrainReply(host=request.host, gpu_uuid=request.gpu_uuid, drained=request.drained)
