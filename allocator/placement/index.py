"""An incremental index that narrows placement to a handful of candidate hosts.

:func:`allocator.placement.policy.place` looks at every GPU of the cluster: exact, simple, and on
1,000 hosts x 8 GPUs about 10 ms a call — far too slow for a request path whose transport
costs about 1 ms. This index keeps, per model, the hosts that have free GPUs of that model,
ordered by the policy's own best-fit key ``(free GPUs on the host, host name)``, plus the
hosts with partly shared GPUs. :meth:`PlacementIndex.narrow` returns a cluster view holding
only the few hosts among which the policy's answer must lie; the policy then runs on that
view. A view without hosts means that nothing fits anywhere. Whenever the view finds
nothing, a caller that owes the requester an explanation runs the policy on the whole
cluster, so refusals (and their messages) are always the exact ones; one that only asks
whether a request fits (serving the queue) takes the view's "no" as the answer.

Why the narrowed answer equals the full one: for each acceptable model the view includes the
first ``depth`` usable hosts, in best-fit order, that have enough free GPUs of that model
(and every host with a partly shared GPU of it, for slices). The policy's choice is the
minimum of the same key over all fitting hosts of the first model that fits anywhere, so it
is among them. That holds when every GPU of a model has the same memory size (the memory
filter is then all-or-nothing per model); for models whose sizes differ, and for "all GPUs
of a host", specific-host requests, requests by compute capability or architecture and
requests that demand a level of links (``topology``: a host's free GPUs may be many and still
not keep it, which this index does not know), :meth:`narrow` returns None and the full policy
runs.

A request for several GPUs is placed by links among the first
:data:`~allocator.placement.links.TOPOLOGY_LOOKAHEAD` fitting hosts in best-fit order
(:mod:`allocator.placement.policy`): for it the view holds that many hosts per model, so it holds
the policy's candidates (the first *k* candidates of the whole cluster, over every model, are
each among the first *k* hosts of their own model), unless none of them reported links: then
the first in best-fit order is the policy's choice, as before. While no host has reported
links, the index walks exactly as far as before them. A request of any model walks
the models' orders merged and stops after *k* fitting entries (its candidates are ordered by
host first, whatever their model), so its view holds at most *k* hosts, not *k* per model.
``tests/placement/test_placement_index.py`` checks the equality with hypothesis.

No I/O and no clock: pure data kept in step by the engine (:meth:`refresh` after every
change that touches a host).
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Iterator

from allocator.placement.cluster import Cluster, Node
from allocator.placement.demand import Demand
from allocator.placement.links import TOPOLOGY_LOOKAHEAD

DEFAULT_DEPTH = 1
"""Hosts per model in a narrowed view. One is enough: :meth:`PlacementIndex.narrow` skips
hosts that are down or drained with the policy's own test, so the first fitting host of a
model in best-fit order is the policy's choice for that model (the hypothesis test checks
depths 1 to 3). Each extra host costs the policy another host's GPUs to look at."""


class PlacementIndex:
    """Free GPUs per model and host, in best-fit order."""

    def __init__(self, depth: int = DEFAULT_DEPTH):
        self.depth = depth
        self._host_free: dict[str, int] = {}
        """host -> placeable GPUs with no claim (the policy's host key)."""
        self._model_free: dict[str, dict[str, int]] = {}
        """model -> host -> placeable free GPUs of that model."""
        self._order: dict[str, list[tuple[int, str]]] = {}
        """model -> sorted (host_free, host) of hosts with a free GPU of that model."""
        self._shared: dict[str, set[str]] = {}
        """model -> hosts with a partly shared GPU of that model that has a free slot."""
        self._memory: dict[str, set[int]] = {}
        """model -> memory sizes of its GPUs (narrowing needs one size per model)."""
        self._host_models: dict[str, set[str]] = {}
        """host -> models it is listed under (to clean up on refresh)."""
        self._linked: set[str] = set()
        """Hosts whose node reported its links: while there is none, a request for several
        GPUs walks no further than before links (the engine refreshes a host whose links
        change)."""

    def rebuild(self, cluster: Cluster) -> None:
        """Index a whole cluster (at load)."""
        self.__init__(self.depth)  # type: ignore[misc]
        for host in cluster.nodes:
            self.refresh(cluster, host)

    def refresh(self, cluster: Cluster, host: str) -> None:
        """Re-index one host after its GPUs, their claims or health changed."""
        old_free = self._host_free.pop(host, 0)
        for model in self._host_models.pop(host, set()):
            if self._model_free[model].pop(host, 0):
                self._remove(model, host, old_free)
            self._shared[model].discard(host)
        node = cluster.nodes.get(host)
        if node is not None and node.interconnect is not None:
            self._linked.add(host)
        else:
            self._linked.discard(host)
        gpus = [g for g in cluster.gpus_of(host) if g.host == host]
        host_free = sum(1 for g in gpus if g.placeable and cluster.is_free(g))
        self._host_free[host] = host_free
        models: set[str] = set()
        for gpu in gpus:
            if not gpu.present:
                continue
            models.add(gpu.model)
            self._memory.setdefault(gpu.model, set()).add(gpu.memory_total_mib)
            per_host = self._model_free.setdefault(gpu.model, {})
            self._shared.setdefault(gpu.model, set())
            if not gpu.placeable:
                continue
            if cluster.is_free(gpu):
                per_host[host] = per_host.get(host, 0) + 1
            elif gpu.share_slots > 1 and cluster.free_slots(gpu) > 0:
                self._shared[gpu.model].add(host)
        for model in models:
            if self._model_free[model].get(host):
                bisect.insort(self._order.setdefault(model, []), (host_free, host))
        self._host_models[host] = models

    def _remove(self, model: str, host: str, host_free: int) -> None:
        order = self._order[model]
        position = bisect.bisect_left(order, (host_free, host))
        if position < len(order) and order[position] == (host_free, host):
            del order[position]

    def _candidates(self, found: list[str], cluster: Cluster) -> list[str]:
        """The hosts found, or only the first :attr:`depth` where none reported links: best
        fit alone decides among those."""
        if len(found) <= self.depth or any(
                cluster.nodes[host].interconnect is not None for host in found):
            return found
        return found[:self.depth]

    def _entries(self, models: list[str]) -> Iterator[tuple[str, str]]:
        """(host, model) of hosts with a free GPU of these models, in best-fit order, lazily:
        a caller reads only the first few."""
        def tagged(model: str) -> Iterator[tuple[int, str, str]]:
            return ((free, host, model) for free, host in self._order.get(model, []))
        return ((host, model) for _, host, model in heapq.merge(*map(tagged, models)))

    def narrow(self, demand: Demand, cluster: Cluster,
               is_usable: Callable[[Node], bool]) -> Cluster | None:
        """A view of the few hosts the policy's choice must be among (none: nothing fits),
        or None to use all.

        ``is_usable(node)`` says whether a node is up and not drained now (the policy's
        own test); hosts failing it are skipped.
        """
        if demand.host is not None or demand.count is None:
            return None
        if demand.min_compute_capability is not None or demand.architecture is not None:
            return None  # filters per GPU, not per model: the full policy decides
        if demand.demands_links:
            return None  # whether a host keeps the level depends on which GPUs are free
        depth = self.depth if demand.shared or demand.count < 2 or not self._linked else max(
            self.depth, TOPOLOGY_LOOKAHEAD)
        models = list(demand.models) if demand.models is not None else sorted(self._model_free)
        need = 1 if demand.shared else demand.count
        hosts: set[str] = set()
        kept: list[str] = []
        for model in models:
            sizes = self._memory.get(model, set())
            if len(sizes) > 1:
                return None
            if demand.min_memory_mib is not None and sizes and max(sizes) < demand.min_memory_mib:
                continue  # the policy's memory filter drops this model entirely
            if model in demand.refused_models:
                continue  # and so does a quota that refused it
            kept.append(model)
        found: list[str] = []
        if demand.models is None and depth > self.depth:
            for host, model in self._entries(kept):
                if (self._model_free[model].get(host, 0) >= need
                        and is_usable(cluster.nodes[host])):
                    found.append(host)
                    if len(found) >= depth:
                        break
            hosts.update(self._candidates(found, cluster))
        else:
            for model in kept:
                free = self._model_free.get(model, {})
                found = []
                # The plain loop (no generator): this walk is the index's own cost.
                for _, host in self._order.get(model, []):
                    if free.get(host, 0) >= need and is_usable(cluster.nodes[host]):
                        found.append(host)
                        if len(found) >= depth:
                            break
                hosts.update(self._candidates(found, cluster))
        if demand.shared:
            for model in kept:
                hosts.update(self._shared.get(model, ()))
        nodes: dict[str, Node] = {h: cluster.nodes[h] for h in hosts if h in cluster.nodes}
        return Cluster(nodes=nodes, gpus=cluster.gpus, claims=cluster.claims)
