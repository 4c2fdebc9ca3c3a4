"""The cluster as plain data: nodes, GPUs and the claims leases hold on them.

No I/O and no clock here. The allocator keeps one :class:`Cluster` in memory, mirrors every
change into the ledger, and hands it to the pure functions of :mod:`allocator.placement.policy`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

from allocator.wire.interconnect import HostInterconnect
from allocator.wire.protocol import Health, ProcessState


@dataclass
class GPU:
    """One GPU: identity from its node agent, state from the allocator."""

    uuid: str
    host: str
    index: int
    model: str
    memory_total_mib: int
    share_slots: int = 1
    """Shared slices this GPU can hold; 1 = exclusive only."""
    health: Health = Health.HEALTHY
    health_reasons: list[str] = field(default_factory=list)
    drained: bool = False
    present: bool = True
    """False when the GPU's node stopped listing it (it stays in the ledger for history)."""
    memory_used_mib: int = 0
    utilization_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    compute_capability: str | None = None
    """CUDA compute capability ``"major.minor"``, as the agent reports it (None: unknown)."""
    architecture: str | None = None
    """``ampere``, ``pascal``, ... as the agent reports it (None: unknown)."""
    mig_enabled: bool = False
    """The GPU is in MIG mode: never handed out whole, only its instances are."""
    mig_parent_uuid: str | None = None
    """Set on a MIG instance: the GPU it is carved out of."""
    mig_profile: str | None = None
    """A MIG instance's GPU instance profile (``1g.5gb``)."""
    mig_index: int | None = None
    """A MIG instance's index on its parent; instances share the parent's ``index``."""
    conflict: str | None = None
    """Why a running container's grant contradicts the ledger on this GPU (see
    :mod:`allocator.placement.adoption`); None when nothing does. Kept in memory only: it is judged
    again from every listing of the node."""
    undeclared: str | None = None
    """Why the site's declaration of its host (``declared_gpus``) has no room for it: its
    host reports more GPUs of its model than declared, or a model not declared; None:
    within it, or the host declares nothing. Out of placement, shown as a conflict. Memory
    only: judged again from every report of its host and at every load."""
    process_state: ProcessState | None = None
    """Why the processes on it keep it out of placement (draining after a lease's end, a
    process left behind, use outside swarm-gpu: :mod:`allocator.engine.processes`); None:
    nothing, or its processes are not known. Memory only: the next report decides again."""

    @property
    def allocatable(self) -> bool:
        """Whether this is a unit a lease can get: a whole GPU not in MIG mode, or a MIG
        instance. A GPU in MIG mode is not, whatever its state."""
        return not self.mig_enabled

    @property
    def placeable(self) -> bool:
        """Allocatable, healthy, listed by its node, not drained, not in conflict, within
        what the site declared for its node and not kept out by its processes (node state
        is checked separately)."""
        return (self.allocatable and self.present and self.health is Health.HEALTHY
                and not self.drained and self.conflict is None and self.undeclared is None
                and self.process_state is None)

    @property
    def order(self) -> tuple[int, int]:
        """Sort key of a node's GPUs: index, then a MIG instance's index after its parent."""
        return (self.index, -1 if self.mig_index is None else self.mig_index)


@dataclass
class Node:
    """One GPU host."""

    host: str
    last_heartbeat: float | None = None
    drained: bool = False
    agent_id: str | None = None
    gpu_uuids: list[str] = field(default_factory=list)
    """This node's GPUs, in index order."""
    interconnect: HostInterconnect | None = None
    """How the node's GPUs are joined (NVLink, PCIe switch, socket), as its agent last reported;
    None until an agent reports it (agents before 0.3.0 never do). Kept in memory only: an
    allocator that loads the ledger asks again with its ``hello``."""

    def is_up(self, now: float, down_after_s: float) -> bool:
        """Whether its last heartbeat is recent enough."""
        return self.last_heartbeat is not None and now - self.last_heartbeat <= down_after_s


@dataclass(frozen=True)
class Claim:
    """What one lease holds on one GPU."""

    lease_id: str
    user: str | None
    """The user it counts against; None: nobody (a lease adopted from its container's labels,
    whose user is only what a label says)."""
    groups: tuple[str, ...]
    exclusive: bool
    memory_mib: int
    """For a slice, its budget; for an exclusive claim, the GPU's whole memory."""
    units: Fraction
    """How much of a GPU this claim counts for quotas: 1, or 1/slots for a slice."""


@dataclass
class Cluster:
    """Nodes, GPUs and claims, indexed for the policy."""

    nodes: dict[str, Node] = field(default_factory=dict)
    gpus: dict[str, GPU] = field(default_factory=dict)
    claims: dict[str, list[Claim]] = field(default_factory=dict)
    """GPU uuid -> claims on it."""

    def claims_on(self, uuid: str) -> list[Claim]:
        """The claims on one GPU (empty if free)."""
        return self.claims.get(uuid, [])

    def add_claim(self, uuid: str, claim: Claim) -> None:
        """Record that a lease holds (part of) a GPU."""
        self.claims.setdefault(uuid, []).append(claim)

    def drop_claims(self, lease_id: str, uuids: list[str]) -> None:
        """Forget a lease's claims on the given GPUs."""
        for uuid in uuids:
            remaining = [c for c in self.claims.get(uuid, []) if c.lease_id != lease_id]
            if remaining:
                self.claims[uuid] = remaining
            else:
                self.claims.pop(uuid, None)

    def free_slots(self, gpu: GPU) -> int:
        """Slots not taken; 0 when an exclusive claim holds it."""
        held = self.claims_on(gpu.uuid)
        if any(c.exclusive for c in held):
            return 0
        return max(gpu.share_slots - len(held), 0)

    def free_memory_mib(self, gpu: GPU) -> int:
        """Memory not promised to any claim."""
        return max(gpu.memory_total_mib - sum(c.memory_mib for c in self.claims_on(gpu.uuid)), 0)

    def is_free(self, gpu: GPU) -> bool:
        """No claim at all on it."""
        return not self.claims_on(gpu.uuid)

    def gpus_of(self, host: str) -> list[GPU]:
        """A node's GPUs in index order."""
        node = self.nodes.get(host)
        if node is None:
            return []
        return [self.gpus[u] for u in node.gpu_uuids if u in self.gpus]
