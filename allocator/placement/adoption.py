"""Adoption: a running container whose lease the ledger does not know claims its GPUs again.

Pure policy, no I/O: given the grant a container's labels carry (see
:mod:`allocator.wire.lease_container`), the node that reports it and the cluster as the engine holds
it, say whether the grant can be taken back as a ``bound`` lease, or what contradicts it. The
engine acts on the answer.

Truth lives on the nodes: after a lost ledger, a restored backup or an allocator started on
an empty volume, the containers still run on the GPUs they were given. Claiming those GPUs
again, before anything else is granted on the node, is what keeps them from being handed out
a second time. A grant that contradicts what the allocator already knows (two containers on
one exclusive GPU, slices over a GPU's memory or slots, a GPU the node does not have) is not
adopted: the GPUs it names stay out of placement while the container runs, and nothing is
stopped to resolve it — that is a person's decision.

Labels are only as trustworthy as whoever may use the node's Docker API (root on the node, the
hub through a manager's socket), and a forged label is indistinguishable from a real one. So a
label can do little: it never binds a lease that is still queued (the container of a lease
not yet granted is a conflict, its GPUs kept out while it runs: it may be a real notebook of a
restored ledger, but it binds nobody's waiting request), and a conflict lasts only while its
container runs and names that container, so that a person can find who set the label.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import StrEnum
from fractions import Fraction

from allocator.placement.cluster import Cluster
from allocator.wire.protocol import ContainerGrant


class ConflictKind(StrEnum):
    """Why a container's grant cannot be adopted."""

    WRONG_HOST = "wrong_host"
    """The labels name another node than the one that runs the container."""
    UNKNOWN_GPU = "unknown_gpu"
    """The labels name a GPU the node does not list."""
    EXCLUSIVE_CONFLICT = "exclusive_conflict"
    """The GPU is held already, and one of the two holds it exclusively."""
    OVER_SLOTS = "over_slots"
    """One more slice than the GPU has share slots."""
    OVER_MEMORY = "over_memory"
    """The slices' budgets would add up to more than the GPU's memory."""
    REQUEST_KEY_TAKEN = "request_key_taken"
    """Another active lease holds the request key (a server cannot have two)."""
    QUEUED_LEASE = "queued_lease"
    """The labels name a lease that is queued here, not granted: a container never binds
    one (anyone with the node's Docker API could bind someone's waiting request)."""
    ADOPTION_DEFERRED = "adoption_deferred"
    """Its node's adoptions of this minute reached ``node_events_per_minute``: adopted at a
    later report, its GPUs kept out meanwhile (each adoption is a lease row and its
    history, and labels are anyone's with the node's Docker API)."""


@dataclass(frozen=True)
class LabelHolder:
    """The running container whose labels make a claim, as its node reports it: what an admin
    needs to find it (``docker inspect`` gives its image and who created it)."""

    container_id: str
    name: str = ""
    started_at: float | None = None
    """Epoch seconds: its start (from a start event) or creation (from a listing)."""

    def describe(self) -> str:
        """``container 0123456789ab 'jupyter-alice' (started 2026-01-02T03:04:05Z)``."""
        name = f" {self.name!r}" if self.name else ""
        started = "" if self.started_at is None else f" (started {_iso(self.started_at)})"
        return f"container {self.container_id[:12]}{name}{started}"


def _iso(epoch: float) -> str:
    """UTC seconds; a time the calendar cannot hold (a node's report is not trusted to be
    sane) as the number it is."""
    if not 0 <= epoch < _YEAR_10000:
        return f"{epoch:g}"
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


_YEAR_10000 = 253_402_300_800.0


@dataclass(frozen=True)
class Conflict:
    """One contradiction between a container's grant and what the allocator knows."""

    kind: ConflictKind
    gpu_uuid: str | None
    message: str


def judge(lease_id: str, grant: ContainerGrant, host: str, cluster: Cluster,
          active_key_holder: str | None, holder: LabelHolder, *,
          queued: bool = False) -> list[Conflict]:
    """Every reason the grant of ``lease_id``, carried by ``holder`` on ``host``, cannot be
    adopted now (empty: adopt it). ``active_key_holder`` is the id of another active lease
    with the grant's request key, if there is one; ``queued``: the lease is queued here."""
    who = holder.describe()
    if grant.host != host:
        return [Conflict(ConflictKind.WRONG_HOST, None,
                         f"{who} of lease {lease_id} runs on {host} but its labels grant GPUs "
                         f"of {grant.host}")]
    conflicts: list[Conflict] = []
    if queued:
        conflicts.append(Conflict(
            ConflictKind.QUEUED_LEASE, None,
            f"{who} is labelled for lease {lease_id}, which is queued here (not granted): "
            "a container does not bind a waiting request"))
    elif active_key_holder is not None and active_key_holder != lease_id:
        conflicts.append(Conflict(
            ConflictKind.REQUEST_KEY_TAKEN, None,
            f"{who}: request key {grant.request_key!r} of lease {lease_id} is held by active "
            f"lease {active_key_holder}"))
    for gpu_uuid in grant.gpu_uuids:
        gpu = cluster.gpus.get(gpu_uuid)
        if gpu is None or gpu.host != host or not gpu.present:
            conflicts.append(Conflict(ConflictKind.UNKNOWN_GPU, gpu_uuid,
                                      f"{who} of lease {lease_id} names GPU {gpu_uuid}, which "
                                      f"{host} does not list"))
            continue
        if not gpu.allocatable:
            conflicts.append(Conflict(ConflictKind.UNKNOWN_GPU, gpu_uuid,
                                      f"{who} of lease {lease_id} names GPU {gpu_uuid} of "
                                      f"{host} whole, but it is in MIG mode (only its "
                                      "instances are granted)"))
            continue
        if queued:
            conflicts.append(Conflict(
                ConflictKind.QUEUED_LEASE, gpu_uuid,
                f"{who} names GPU {gpu_uuid} on {host} for lease {lease_id}, which is queued "
                "here (not granted): not bound; the GPU is kept out of placement while it "
                "runs"))
            continue
        claims = cluster.claims_on(gpu_uuid)
        holders = ", ".join(sorted(c.lease_id for c in claims))
        if claims and (not grant.shared or any(c.exclusive for c in claims)):
            conflicts.append(Conflict(
                ConflictKind.EXCLUSIVE_CONFLICT, gpu_uuid,
                f"{who} of lease {lease_id} claims GPU {gpu_uuid} on {host}, held already by "
                f"{holders}"))
            continue
        if not grant.shared:
            continue
        if len(claims) + 1 > gpu.share_slots:
            conflicts.append(Conflict(
                ConflictKind.OVER_SLOTS, gpu_uuid,
                f"{who} of lease {lease_id} would be slice {len(claims) + 1} of GPU "
                f"{gpu_uuid} on {host}, which has {gpu.share_slots} slot(s) ({holders})"))
        promised = sum(c.memory_mib for c in claims) + (grant.memory_mib or 0)
        if promised > gpu.memory_total_mib:
            conflicts.append(Conflict(
                ConflictKind.OVER_MEMORY, gpu_uuid,
                f"{who} of lease {lease_id} would take the slices of GPU {gpu_uuid} on {host} "
                f"to {promised} MiB of {gpu.memory_total_mib} MiB"))
    return conflicts


def deferred(lease_id: str, grant: ContainerGrant, holder: LabelHolder,
             per_minute: int) -> list[Conflict]:
    """Why an adoptable grant waits: its node adopted ``per_minute`` containers this minute
    already. One conflict per GPU it names, so that they stay out of placement meanwhile."""
    who = holder.describe()
    return [Conflict(ConflictKind.ADOPTION_DEFERRED, gpu_uuid,
                     f"{who} of lease {lease_id} names GPU {gpu_uuid} of {grant.host}, "
                     f"whose adoptions reached {per_minute} this minute "
                     "(node_events_per_minute): adopted at a later report, kept out of "
                     "placement meanwhile")
            for gpu_uuid in grant.gpu_uuids]


def units_of(grant: ContainerGrant, cluster: Cluster) -> Fraction:
    """Quota units of an adopted grant, as :mod:`allocator.placement.policy` counts a
    placement's."""
    if not grant.shared:
        return Fraction(len(grant.gpu_uuids))
    gpu = cluster.gpus.get(grant.gpu_uuids[0])
    return Fraction(1, gpu.share_slots if gpu is not None and gpu.share_slots > 0 else 1)
