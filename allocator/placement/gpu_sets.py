"""Which GPUs of one host a request gets, by how they are joined: the best-connected set, a
demanded level kept, the well-connected sets left whole, and the order the container sees.

Pure: no I/O, no clock. The caller has already chosen the host and the GPUs that may serve the
request (free, of a model it accepts); this module chooses among them with the host's
:class:`~allocator.wire.interconnect.HostInterconnect`.

**How sets compare** (:func:`set_cost`, lower is better): first by the worst link of any pair
in the set (a 4-GPU job runs at the speed of its slowest link), then by the sum of the levels
of all its pairs (fewer weak pairs), then by more NVLink links in all. One GPU has cost
``(0, 0, 0)``: it has no link to be slow on.

**What is left** (:func:`leftover_score`, lower is better): among the sets of equal cost, the
choice that leaves the host's other free GPUs the best 4-set, then the best pair (each by
:func:`set_cost`; "none left" is worse than any set). This is what keeps a one-GPU request
from breaking the last free NVLink pair or the last whole socket (NVIDIA k8s-device-plugin
#1193). Remaining ties go to the lowest GPU indices, so a choice is deterministic.

**Bounds**: the best set is found exactly, over every combination, while there are at most
:data:`EXHAUSTIVE_COMBINATIONS` of them (every request on a host of up to 14 GPUs; on a
16-GPU host, requests of up to 5 or from 11 GPUs); beyond, greedily (from each GPU, add the one
that keeps the set's cost lowest), which may miss the best set and, with a demanded level,
refuse where a set exists. The leftover score is computed for at most
:data:`LEFTOVER_CANDIDATES` equally good sets.

**Speed** (the allocator chooses on every grant): each host's links are turned into index
matrices once (:func:`host_links`, kept while the host reports the same interconnect), the
best set of a given pool is remembered per host (at most :data:`MEMO_ENTRIES` pools), and
where every pair of the free GPUs is joined alike (an HGX board) every choice is as good as
any other, so the lowest indices are taken without comparing sets.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations
from math import comb
from typing import Literal, NamedTuple

from allocator.wire.interconnect import HostInterconnect, LinkLevel

TopologyDemand = Literal["nvlink", "pcie-switch", "socket"]
"""A level a request may demand: every pair of its GPUs joined at that level or better."""

DEMANDED_LEVEL: dict[TopologyDemand, LinkLevel] = {
    "nvlink": LinkLevel.NVLINK,
    "pcie-switch": LinkLevel.SINGLE,
    "socket": LinkLevel.NODE,
}
"""The worst link each demand accepts."""

EXHAUSTIVE_COMBINATIONS = 5_000
"""Up to this many candidate sets, the choice is exact; beyond, greedy."""

LEFTOVER_CANDIDATES = 64
"""At most this many equally good sets get their leftover scored (the rest lose the tie)."""

PROTECTED_SIZES = (4, 2)
"""The sizes of the sets a choice tries to leave whole, the most important first."""

MEMO_ENTRIES = 2048
"""Best sets remembered per host (pool, size, limit); past it the memory starts again."""

HOSTS_REMEMBERED = 8192
"""Hosts whose link matrices are kept (:func:`host_links`); past it the cache starts again."""


class SetCost(NamedTuple):
    """How well a set of GPUs is joined; lower is better (see the module's docstring)."""

    worst: int
    """The worst :class:`LinkLevel` of any pair (0 for one GPU)."""
    level_sum: int
    """The levels of all pairs, added up."""
    minus_nvlinks: int
    """Minus the NVLink links of all pairs (more links sort first)."""


NOTHING_LEFT = SetCost(len(LinkLevel), 0, 0)
"""Worse than any set: no set of that size is left."""


@dataclass(frozen=True)
class GpuSet:
    """The GPUs chosen, in the order the container should see them."""

    gpus: tuple[str, ...]
    """Uuids for ``NVIDIA_VISIBLE_DEVICES``, best-connected GPUs adjacent
    (:func:`visible_order`)."""
    worst_level: LinkLevel | None
    """The worst link between two of them; None for one GPU."""
    numa_nodes: tuple[int, ...]
    """Their NUMA nodes, sorted (the ``SWARM_GPU_NUMA_NODES`` hint); empty when unknown."""


@dataclass(frozen=True)
class Unmet:
    """No set fits; ``reason`` says why, for a person."""

    reason: str


class _Links:
    """The host's links as index matrices: a set's cost in plain integer lookups."""

    def __init__(self, interconnect: HostInterconnect):
        n = len(interconnect.gpus)
        self.position = {gpu.uuid: index for index, gpu in enumerate(interconnect.gpus)}
        """uuid -> index: the host's own lookup is a pydantic private attribute, slower."""
        self.level = [[0] * n for _ in range(n)]
        self.nvlinks = [[0] * n for _ in range(n)]
        for i in range(n):
            for j in range(i + 1, n):
                link = interconnect.link_at(i, j)
                self.level[i][j] = self.level[j][i] = int(link.level)
                self.nvlinks[i][j] = self.nvlinks[j][i] = link.nvlinks
        self._memo: dict[tuple[tuple[int, ...], int, int | None],
                         tuple[SetCost, tuple[int, ...]] | None] = {}

    def uniform(self, indices: Sequence[int]) -> bool:
        """Whether every pair of these GPUs is joined alike (same level, same NVLinks)."""
        if len(indices) < 3:
            return True
        first = (self.level[indices[0]][indices[1]], self.nvlinks[indices[0]][indices[1]])
        return all((self.level[i][j], self.nvlinks[i][j]) == first
                   for position, i in enumerate(indices) for j in indices[position + 1:])

    def cost(self, indices: Sequence[int]) -> SetCost:
        worst = total = links = 0
        for position, i in enumerate(indices):
            row, nv = self.level[i], self.nvlinks[i]
            for j in indices[position + 1:]:
                level = row[j]
                worst = max(worst, level)
                total += level
                links += nv[j]
        return SetCost(worst, total, -links)

    def best(self, indices: Sequence[int], size: int,
             limit: int | None = None) -> tuple[SetCost, tuple[int, ...]] | None:
        """The best set of ``size`` among ``indices`` (ties: lowest indices), None when there
        are too few; with ``limit``, only sets whose worst link is at most that level."""
        key = (tuple(sorted(indices)), size, limit)
        if key in self._memo:
            return self._memo[key]
        if self.uniform(key[0]) and 1 <= size <= len(key[0]):
            chosen = key[0][:size]
            cost = self.cost(chosen)
            found = None if limit is not None and cost.worst > limit else (cost, chosen)
        else:
            ranked = self.ranked(indices, size, limit)
            found = ranked[0] if ranked else None
        if len(self._memo) >= MEMO_ENTRIES:
            self._memo.clear()
        self._memo[key] = found
        return found

    def ranked(self, indices: Sequence[int], size: int,
               limit: int | None = None) -> list[tuple[SetCost, tuple[int, ...]]]:
        """Candidate sets with their cost, best first: every combination when there are few
        enough, else one greedy set per starting GPU."""
        pool = sorted(indices)
        if size > len(pool) or size < 1:
            return []
        if comb(len(pool), size) <= EXHAUSTIVE_COMBINATIONS:
            candidates = [(self.cost(c), c) for c in combinations(pool, size)]
        else:
            candidates = [self._greedy(pool, size, seed, limit) for seed in pool]
        if limit is not None:
            candidates = [c for c in candidates if c[0].worst <= limit]
        candidates.sort()
        return candidates

    def _greedy(self, pool: list[int], size: int, seed: int,
                limit: int | None) -> tuple[SetCost, tuple[int, ...]]:
        chosen = [seed]
        while len(chosen) < size:
            best: tuple[tuple[bool, SetCost, int], int] | None = None
            for j in pool:
                if j in chosen:
                    continue
                cost = self.cost([*chosen, j])
                key = (limit is not None and cost.worst > limit, cost, j)
                if best is None or key < best[0]:
                    best = (key, j)
            assert best is not None  # size <= len(pool)
            chosen.append(best[1])
        ordered = tuple(sorted(chosen))
        return self.cost(ordered), ordered

    def leftover(self, remaining: Sequence[int]) -> tuple[SetCost, ...]:
        return tuple(
            found[0] if (found := self.best(remaining, size)) is not None else NOTHING_LEFT
            for size in PROTECTED_SIZES
        )


_HOSTS: dict[int, tuple[HostInterconnect, _Links]] = {}


def host_links(interconnect: HostInterconnect) -> _Links:
    """The host's link matrices, built once per interconnect object (a host that reports
    another interconnect gets new ones)."""
    known = _HOSTS.get(id(interconnect))
    if known is not None and known[0] is interconnect:
        return known[1]
    if len(_HOSTS) >= HOSTS_REMEMBERED:
        _HOSTS.clear()
    links = _Links(interconnect)
    _HOSTS[id(interconnect)] = (interconnect, links)  # the object kept: its id stays its own
    return links


def lists_all(interconnect: HostInterconnect, uuids: Iterable[str]) -> bool:
    """Whether the host's links name every one of these GPUs (a host whose GPUs changed since
    it reported its links may not)."""
    position = host_links(interconnect).position
    return all(uuid in position for uuid in uuids)


def set_cost(interconnect: HostInterconnect, uuids: Iterable[str]) -> SetCost:
    """How well these GPUs of the host are joined (lower is better)."""
    return host_links(interconnect).cost([interconnect.index_of(u) for u in uuids])


def worst_link(interconnect: HostInterconnect, uuids: Iterable[str]) -> LinkLevel | None:
    """The worst link between two of these GPUs of the host; None for fewer than two."""
    indices = _indices(interconnect, uuids)
    if len(indices) < 2:
        return None
    return LinkLevel(host_links(interconnect).cost(indices).worst)


def best_set_cost(interconnect: HostInterconnect, free: Iterable[str], count: int,
                  demand: TopologyDemand | None = None) -> SetCost | None:
    """The cost of the set :func:`choose_gpus` would choose (without the leftover's tie
    break), or None where it would be :class:`Unmet`: what the placement compares hosts by."""
    indices = _indices(interconnect, free)
    if count < 1 or count > len(indices):
        return None
    limit = None if demand is None or count == 1 else int(DEMANDED_LEVEL[demand])
    found = host_links(interconnect).best(indices, count, limit)
    return None if found is None else found[0]


def leftover_score(interconnect: HostInterconnect, free: Iterable[str]) -> tuple[SetCost, ...]:
    """How well the free GPUs could still serve a large request: the cost of their best set of
    each of :data:`PROTECTED_SIZES` (:data:`NOTHING_LEFT` where too few); lower is better."""
    return host_links(interconnect).leftover([interconnect.index_of(u) for u in free])


def choose_gpus(
    interconnect: HostInterconnect,
    free: Iterable[str],
    count: int,
    demand: TopologyDemand | None = None,
) -> GpuSet | Unmet:
    """The ``count`` GPUs of ``free`` to grant: the best-connected set, among equals the one
    that leaves the best sets free (see the module's docstring).

    ``demand`` None prefers a good set and takes any; a demanded level is never broken:
    :class:`Unmet` says so when no set of ``count`` free GPUs keeps it. ``free`` names GPUs
    of ``interconnect``'s host (ValueError otherwise).
    """
    if count < 1:
        raise ValueError(f"a request takes at least one GPU, not {count}")
    if demand is not None and demand not in DEMANDED_LEVEL:
        raise ValueError(f"unknown topology {demand!r}: one of {', '.join(DEMANDED_LEVEL)}")
    free_indices = _indices(interconnect, free)
    if count > len(free_indices):
        return Unmet(f"{count} GPUs asked, {len(free_indices)} free on the host")
    links = host_links(interconnect)
    limit = None if demand is None or count == 1 else int(DEMANDED_LEVEL[demand])
    if links.uniform(free_indices):
        # Every choice is as good as any other, and leaves as good a rest: the lowest indices.
        chosen = tuple(free_indices[:count])
        cost = links.cost(chosen)
        if limit is not None and cost.worst > limit:
            assert demand is not None  # a limit comes from a demand
            return Unmet(_unmet_reason(links, free_indices, count, demand))
        return _gpu_set(interconnect, chosen, cost, count)
    ranked = links.ranked(free_indices, count, limit)
    if not ranked:
        assert demand is not None  # without a limit, count <= free always gives a set
        return Unmet(_unmet_reason(links, free_indices, count, demand))
    best_cost = ranked[0][0]
    tied = [indices for cost, indices in ranked if cost == best_cost][:LEFTOVER_CANDIDATES]
    if len(tied) > 1:
        chosen = min(tied, key=lambda c: (
            links.leftover([i for i in free_indices if i not in c]), c))
    else:
        chosen = tied[0]
    return _gpu_set(interconnect, chosen, best_cost, count)


def _gpu_set(interconnect: HostInterconnect, chosen: Sequence[int], cost: SetCost,
             count: int) -> GpuSet:
    uuids = [interconnect.gpus[i].uuid for i in chosen]
    return GpuSet(
        gpus=visible_order(interconnect, uuids),
        worst_level=LinkLevel(cost.worst) if count > 1 else None,
        numa_nodes=numa_nodes(interconnect, uuids),
    )


def best_link(interconnect: HostInterconnect, free: Iterable[str],
              count: int) -> LinkLevel | None:
    """The worst link of the best-connected ``count`` GPUs among ``free``: the connection a
    request for that many GPUs of the host could get now (what the spawn form shows). None
    for one GPU (no link) or when fewer than ``count`` are free. ``free`` names GPUs of
    ``interconnect``'s host (ValueError otherwise)."""
    if count < 2:
        return None
    found = _Links(interconnect).best(_indices(interconnect, free), count)
    return None if found is None else LinkLevel(found[0].worst)


def _indices(interconnect: HostInterconnect, uuids: Iterable[str]) -> list[int]:
    indices: set[int] = set()
    unknown: list[str] = []
    position = host_links(interconnect).position
    for uuid in uuids:
        index = position.get(uuid)
        if index is None:
            unknown.append(uuid)
        else:
            indices.add(index)
    if unknown:
        raise ValueError(f"GPUs not on this host: {', '.join(sorted(unknown))}")
    return sorted(indices)


def _unmet_reason(links: _Links, free: list[int], count: int, demand: TopologyDemand) -> str:
    wanted = DEMANDED_LEVEL[demand]
    closest = links.best(free, count)
    assert closest is not None
    return (f"no {count} of the {len(free)} free GPUs are all joined by {wanted.words} "
            f"(topology = \"{demand}\"): the best {count} are joined only by "
            f"{LinkLevel(closest[0].worst).words}; ask without a topology, or for fewer GPUs, "
            f"or wait for GPUs to be released")


def visible_order(interconnect: HostInterconnect, uuids: Iterable[str]) -> tuple[str, ...]:
    """The GPUs in the order for ``NVIDIA_VISIBLE_DEVICES``: best-connected ones adjacent, so
    that a job splitting its GPUs into neighbouring pairs (ranks 0-1, 2-3) gets the best
    links. Greedy: start from the lower GPU of the best pair, then always append the GPU
    best linked to the last one (ties: lowest index)."""
    indices = _indices(interconnect, uuids)
    links = host_links(interconnect)
    if len(indices) <= 2 or links.uniform(indices):
        return tuple(interconnect.gpus[i].uuid for i in indices)
    first = min(combinations(indices, 2), key=lambda p: (links.cost(p), p))[0]
    order = [first]
    left = [i for i in indices if i != first]
    while left:
        last = order[-1]
        nearest = min(left, key=lambda j: (links.cost((last, j)), j))
        order.append(nearest)
        left.remove(nearest)
    return tuple(interconnect.gpus[i].uuid for i in order)


def numa_nodes(interconnect: HostInterconnect, uuids: Iterable[str]) -> tuple[int, ...]:
    """The NUMA nodes of these GPUs, sorted, those the host does not know left out."""
    return tuple(sorted({
        node for index in _indices(interconnect, uuids)
        if (node := interconnect.gpus[index].numa_node) is not None
    }))
