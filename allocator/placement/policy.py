"""The placement policy: pure functions over a :class:`~allocator.placement.cluster.Cluster`.

Nothing here does I/O or reads the clock (``now`` is passed in), so every rule can be tested
directly. The allocator calls, in order: :func:`~allocator.placement.demand.make_demand`
(validate and resolve the request), :func:`~allocator.placement.feasibility.feasible` (could it
ever fit?), :func:`place` (where does it fit now?), :func:`~allocator.placement.quota.check_quota`
(may this user take it?), :func:`~allocator.placement.claims.apply_placement` (record the
claims) and :func:`~allocator.placement.container_env.lease_env` (what the container gets).
:func:`place` is this module's: it hands a demand to the exclusive
(:mod:`~allocator.placement.exclusive`) or slice (:mod:`~allocator.placement.slices`) placement
over what is placeable now (:mod:`~allocator.placement.placeable`), and explains a failure
(:mod:`~allocator.placement.feasibility`, :mod:`~allocator.placement.no_capacity`).

Rules, as in ``docs/design.md``:

* All GPUs of one lease are on one host, which is up and not drained; unhealthy, drained
  and no-longer-present GPUs never fit.
* A GPU in MIG mode is never a unit: its MIG instances are, each under NVML's name for it
  (``NVIDIA A100-SXM4-40GB MIG 1g.5gb``) as its model, so ``count=n`` of a profile is *n*
  instances of one host.
* ``min_compute_capability`` and ``architecture`` keep only GPUs the agent reported with at
  least that capability and that architecture (an instance has its parent's).
* Exclusive ``count=n``: *n* free GPUs of one model. ``count=None`` ("all"): every present
  GPU of the host that matches the request must be free and placeable (at least one); such a
  lease mixes models only when no model was asked for. How many GPUs one host can give one
  request is :mod:`allocator.wire.capacity`'s rule, the hub's too.
* Model names a person typed are matched by :mod:`allocator.wire.model_names`, the rule the hub
  uses too. Acceptable models are tried in order of preference: the first that fits anywhere
  wins.
* Best fit: the host with the fewest free placeable GPUs, so whole hosts stay free for "all"
  requests; ties by host name, then the lowest GPU indices.
* Links (:mod:`allocator.placement.gpu_sets`), on a host whose agent reported how its GPUs are
  joined (``Node.interconnect``; a host that did not is placed exactly as before): an exclusive
  request takes the best-connected free GPUs of the host (one GPU: the one whose taking
  leaves the best sets whole), and its container sees them best-connected adjacent. For
  ``count > 1`` the host is chosen among the first
  :data:`~allocator.placement.links.TOPOLOGY_LOOKAHEAD` fitting hosts
  in best-fit order: first those where the grant leaves the host's free all-NVLink set of
  4 GPUs whole (or that had none), then the one whose best set has the best worst link (a
  host without reported links counts as joined across sockets), ties in best-fit order. A
  demanded level (``topology``) is never broken: only hosts with reported links whose free
  GPUs keep it fit, and one GPU always keeps it (it has no link). Whole-host requests keep
  their GPUs and get the container's order; slices and MIG instances are not placed by links.
* A shared slice takes one slot and a memory budget of one GPU whose model has more than one
  slot and which no exclusive lease holds; slices are packed onto GPUs already shared.
"""

from __future__ import annotations

from allocator.placement.cluster import Cluster
from allocator.placement.demand import Demand, Placement, Refusal
from allocator.placement.exclusive import place_exclusive, place_whole_host
from allocator.placement.feasibility import feasible
from allocator.placement.no_capacity import no_capacity, nothing_fits_now
from allocator.placement.placeable import current_view
from allocator.placement.slices import place_slice


def place(demand: Demand, cluster: Cluster, now: float, down_after_s: float, *,
          explain: bool = True) -> Placement | Refusal:
    """Where the demand fits now (best fit), or why not.

    ``unknown_host``/``unsatisfiable`` (from :func:`~allocator.placement.feasibility.feasible`)
    when it could never fit, else ``no_capacity`` naming what is free instead, with
    ``details["free"]`` as ``{model: {host: free GPUs}}`` (and ``details["free_slots"]`` for
    slices). Without ``explain`` a demand that does not fit gets
    :func:`~allocator.placement.no_capacity.nothing_fits_now`: finding why, and what is free
    instead, looks at every GPU of the cluster, and a queued request that is tried again
    whenever something changed needs only to know whether it fits.
    """
    if demand.host is not None and demand.host not in cluster.nodes:
        refusal = feasible(demand, cluster)
        assert refusal is not None
        return refusal
    hosts = [demand.host] if demand.host is not None else sorted(cluster.nodes)
    view = current_view(cluster, hosts, now, down_after_s)
    found: Placement | None
    if demand.shared:
        found = place_slice(demand, cluster, view)
    elif demand.count is None:
        found = place_whole_host(demand, cluster, view)
    else:
        found = place_exclusive(demand, demand.count, cluster, view)
    if found is not None:
        return found
    if not explain:
        return nothing_fits_now()
    # Only on failure: an impossible request must not queue forever as "no capacity".
    return feasible(demand, cluster) or no_capacity(demand, cluster, now, down_after_s)
