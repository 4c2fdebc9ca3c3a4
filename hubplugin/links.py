"""How GPUs are joined, in the hub's words: the connection a multi-GPU choice of the spawn form
could get now, the form's topology choice, and a lease's connection on the GPU page.

Pure: no I/O, no clock. The rule of which GPUs a request gets, and so the best connection
``count`` free GPUs of a host could have, is the allocator's
(:func:`allocator.placement.gpu_sets.best_link`); this module only reads it over an
:class:`~allocator.wire.protocol.InventoryReply` and puts it in words. A cluster where no host
reported how its GPUs are joined (agents before 0.3.0) gets no words and no choice at all.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from allocator.placement.gpu_sets import TopologyDemand, best_link
from allocator.wire.interconnect import LINK_NAMES, LinkLevel
from allocator.wire.protocol import GPUView, Health, InventoryReply, Lease, ModelSummary

TIMES = "\u00d7"
"""The multiplication sign of "2 x A100, NVLink"."""

ANY_TOPOLOGY = "any"
"""The form's topology value that demands no level (the allocator still picks the best)."""

TOPOLOGY_CHOICES: tuple[tuple[str, str], ...] = (
    (ANY_TOPOLOGY, "any (best available)"),
    ("nvlink", "NVLink only"),
    ("pcie-switch", "same PCIe switch"),
    ("socket", "same socket"),
)
"""The form's topology choices, ``(value, label)``: ``any``, then
:data:`allocator.placement.gpu_sets.DEMANDED_LEVEL`'s keys (a test holds them equal)."""


def reports_topology(inventory: InventoryReply | None) -> bool:
    """Whether any host of the inventory said how its GPUs are joined."""
    return inventory is not None and any(n.interconnect is not None for n in inventory.nodes)


def _free_whole(gpu: GPUView) -> bool:
    """Whether the GPU could be granted whole now (the inventory's view of "free")."""
    return (not gpu.holders and not gpu.mig_enabled and gpu.health is Health.HEALTHY
            and not gpu.drained and gpu.conflict is None and gpu.process_state is None)


def best_link_of(inventory: InventoryReply, models: Iterable[ModelSummary],
                 count: int) -> LinkLevel | None:
    """The best connection ``count`` free GPUs of one of ``models`` on one host could get now
    (the GPUs of one server are of one model and on one host); only the hosts each summary
    lists count (the form's summaries list the hosts the user may use). None for one GPU, or
    when no host that reported its topology has ``count`` free GPUs of one model."""
    if count < 2:
        return None
    best: LinkLevel | None = None
    for node in inventory.nodes:
        interconnect = node.interconnect
        if interconnect is None or not node.up or node.drained:
            continue
        known = set(interconnect.uuids)
        for summary in models:
            if node.host not in summary.hosts:
                continue
            free = [g.uuid for g in inventory.gpus
                    if g.host == node.host and g.model == summary.model and g.uuid in known
                    and _free_whole(g)]
            level = best_link(interconnect, free, count)
            if level is not None and (best is None or level < best):
                best = level
    return best


def link_words(level: LinkLevel) -> str:
    """A connection in the form's and the page's words: ``NVLink``, ``one PCIe switch``."""
    return level.words


_LEVEL_NAMED = {name: level for level, name in LINK_NAMES.items()}


def lease_link(lease: Lease) -> str | None:
    """A lease's connection for the GPU page, ``2 GPUs, NVLink``; None for one GPU, a shared
    slice, or an allocator that did not say (before 0.3.0, or a host without topology)."""
    if lease.link is None or lease.shared or len(lease.gpu_uuids) < 2:
        return None
    level = _LEVEL_NAMED.get(lease.link)
    # a level a newer allocator names and this hub does not know: its name as sent
    words = link_words(level) if level is not None else lease.link
    return f"{len(lease.gpu_uuids)} GPUs, {words}"


def topology_choices(selected: TopologyDemand | None) -> Sequence[dict[str, object]]:
    """The form's topology options, ``selected`` preselected (None: "any")."""
    chosen = selected or ANY_TOPOLOGY
    return [{"value": value, "label": label, "selected": value == chosen}
            for value, label in TOPOLOGY_CHOICES]
