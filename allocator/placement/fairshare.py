"""Fair share: which leases are borrowed, and which are reclaimed for whom. Pure functions over
a :class:`~allocator.placement.cluster.Cluster`: no I/O, no clock (``now`` is passed in).

Rules, as in ``docs/design.md`` (fair share):

* **Borrowed.** In each limited scope (the user; each of its groups with a quota; per model,
  where a per-model guarantee is configured, the leases of that model), the leases
  counted there, oldest grant first, are within the guarantee while their units add up to at
  most the guarantee; the later ones are borrowed there (a tie in grant time keeps the
  standing each had). A lease is borrowed when it is
  borrowed in any of its scopes. When an older lease ends, a younger one may move within the
  guarantee: borrowed is a standing, not a label given once.
* **Who waits.** Queued requests are simulated in queue order on a copy of the cluster: one
  that fits (on free GPUs, or on GPUs already to be freed) takes them, so that what is freed
  for one waiter is never counted twice.
* **Reclaim.** A waiter that does not fit, and whose grant would be within its owner's
  guarantees, may have borrowed leases reclaimed for it: leases already warned first (so a
  warning once given is the one carried out), then idle ones (longest idle first), then, when
  ``usage_half_life_h`` is set, the heaviest recent user's
  (:mod:`~allocator.placement.decayed_usage`), then the most recently granted. Victims are
  taken in that order until the waiter fits, then every victim it fits without is given back
  (latest first). A lease within its owner's guarantee is never a reclaim victim.
* **Idle release** (when ``idle_release_after_s`` is set): any waiter that still does not fit
  may have leases idle longer than that released, in the same order.
* **Bookings** (:mod:`allocator.bookings.in_effect`). A lease a booking in effect covers is
  neither borrowed nor counted in its owner's other guarantees, and is never a victim. A
  member's request that fits in its booking's room is within a guarantee (and, for a booking
  whose ``quota_applies`` is false, not held to the member's quota there); it may also
  reclaim the leases of non-members that stand on the booking's GPUs.
* Nobody waits, nothing is reclaimed.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction

from allocator.bookings.guarantees import Guarantee
from allocator.bookings.in_effect import in_room
from allocator.config import PolicySettings
from allocator.placement.claims import apply_placement
from allocator.placement.cluster import Claim, Cluster
from allocator.placement.demand import Demand, Placement, Refusal, placement_model
from allocator.placement.policy import place
from allocator.placement.quota import (
    QuotaScope,
    check_quota,
    place_within_quota,
    quota_scopes,
    quota_standings,
    would_borrow,
)
from allocator.wire.protocol import ProcessState, ReclaimReason


@dataclass(frozen=True)
class Holding:
    """A lease that holds GPUs, as fair share sees it."""

    lease_id: str
    user: str
    groups: tuple[str, ...]
    units: Fraction
    granted_at: float
    borrowed: bool = False
    """Borrowed as it stands now: of leases granted at the same instant, those already
    borrowed stay behind the others, so a standing never flips on a tie."""
    model: str | None = None
    """Its one model (None: it mixes models), for per-model guarantees."""


def borrowed_leases(holdings: Sequence[Holding], settings: PolicySettings,
                    covered: Collection[str] = frozenset()) -> set[str]:
    """The leases held beyond a guarantee of their owner (see the module's rules);
    ``covered``: the leases a booking in effect covers (never borrowed, not counted)."""
    in_scope: dict[QuotaScope, list[Holding]] = {}
    for holding in holdings:
        if holding.lease_id in covered:
            continue
        for scope in quota_scopes(holding.user, holding.groups, settings,
                                  model=holding.model):
            if scope.guarantee is not None:
                in_scope.setdefault(scope, []).append(holding)
    borrowed: set[str] = set()
    for scope, members in in_scope.items():
        assert scope.guarantee is not None
        total = Fraction(0)
        for holding in sorted(members, key=lambda h: (h.granted_at, h.borrowed, h.lease_id)):
            total += holding.units
            if total > scope.guarantee:
                borrowed.add(holding.lease_id)
    return borrowed


@dataclass(frozen=True)
class Candidate:
    """A lease that may be reclaimed or released for a waiter."""

    lease_id: str
    gpu_uuids: tuple[str, ...]
    granted_at: float
    idle_s: float
    """How long it has been idle without a break (0: busy, or not measured)."""
    warned: bool
    """A warning is pending for it already."""
    borrowed: bool
    idle_releasable: bool
    """Idle longer than ``idle_release_after_s`` (always false when that is off)."""
    displaceable_by: frozenset[str] = frozenset()
    """The bookings in effect whose members may reclaim it: a non-member's lease on their
    GPUs that no booking covers."""
    recent_use: tuple[float, float] = (0.0, 0.0)
    """Its owner's decayed usage, then its heaviest group's
    (:mod:`allocator.placement.decayed_usage`); zeros when that is off."""


@dataclass(frozen=True)
class Waiter:
    """A queued request, in queue order."""

    lease_id: str
    demand: Demand
    booked: Guarantee | None = None
    """The booking in effect the waiter is a member of, with room for it."""


@dataclass(frozen=True)
class Reclaim:
    """One lease to warn (or, once its grace is over, to stop), and for whom."""

    reason: ReclaimReason
    for_lease: str | None
    """The waiter it is for; None for a warning before a booking's window."""
    booking: str | None = None
    """The booking it is for, when it is for one."""


def victim_order(candidates: Sequence[Candidate], idle_window_s: float) -> list[Candidate]:
    """Warned first, then idle (for the window) longest idle first, then the heaviest recent
    user's (``recent_use``), then newest grant first."""
    return sorted(candidates, key=lambda c: (
        not c.warned,
        c.idle_s < idle_window_s,
        -c.idle_s if c.idle_s >= idle_window_s else 0.0,
        -c.recent_use[0],
        -c.recent_use[1],
        -c.granted_at,
        c.lease_id,
    ))


def _copy(cluster: Cluster, draining: Collection[str]) -> Cluster:
    """The planner's own cluster: claims it may change, and the GPUs in ``draining`` shown
    free of the processes they wait to see gone (the GPU objects themselves are shared)."""
    gpus = cluster.gpus
    drained_soon = [uuid for uuid in draining
                    if (gpu := gpus.get(uuid)) is not None
                    and gpu.process_state is ProcessState.DRAINING]
    if drained_soon:
        gpus = dict(gpus)
        for uuid in drained_soon:
            gpus[uuid] = replace(gpus[uuid], process_state=None)
    return Cluster(nodes=cluster.nodes, gpus=gpus,
                   claims={uuid: list(claims) for uuid, claims in cluster.claims.items()})


def in_booking(booked: Guarantee | None, placement: Placement, cluster: Cluster,
               rooms: Mapping[str, Fraction]) -> bool:
    """Whether a placement of a member falls in its booking's room (``rooms``: booking ->
    its room left)."""
    return booked is not None and in_room(
        booked, rooms.get(booked.booking, Fraction(0)), placement_model(placement, cluster),
        placement.host, placement.units)


def quota_refusal(placement: Placement, demand: Demand, cluster: Cluster,
                  settings: PolicySettings, booked: Guarantee | None,
                  rooms: Mapping[str, Fraction]) -> Refusal | None:
    """Why the quota refuses ``placement`` of ``demand``, or None when it may be granted: it
    is within the quota, or it falls in the room of the member's booking in effect
    (``booked``) and that booking lifts the quota (``quota_applies`` false). The one rule,
    for placement (:meth:`allocator.engine.placement.Placer.place`) and for the plan of who
    fits (:func:`plan_reclaims`)."""
    refusal = check_quota(placement.units, demand.user, demand.groups, cluster,
                          settings, placement_model(placement, cluster))
    if (refusal is not None and booked is not None and not booked.quota_applies
            and in_booking(booked, placement, cluster, rooms)):
        return None
    return refusal


def _fits(waiter: Waiter, cluster: Cluster, settings: PolicySettings, now: float,
          down_after_s: float, rooms: Mapping[str, Fraction]) -> Placement | None:
    placement = place_within_quota(
        waiter.demand,
        lambda demand, retry: place(demand, cluster, now, down_after_s, explain=False),
        lambda found: quota_refusal(found, waiter.demand, cluster, settings, waiter.booked,
                                    rooms))
    return placement if isinstance(placement, Placement) else None


def _within_guarantee(waiter: Waiter, placement: Placement, cluster: Cluster,
                      settings: PolicySettings) -> bool:
    standings = quota_standings(waiter.demand.user, waiter.demand.groups, cluster,
                                settings, limited_only=True,
                                model=placement_model(placement, cluster))
    return not would_borrow(placement.units, standings)


def plan_reclaims(waiters: Sequence[Waiter], candidates: Sequence[Candidate], cluster: Cluster,
                  settings: PolicySettings, *, now: float, down_after_s: float,
                  idle_window_s: float,
                  leaving: Mapping[str, Sequence[str]] | None = None,
                  draining: Collection[str] = (),
                  rooms: Mapping[str, Fraction] | None = None) -> dict[str, Reclaim]:
    """Which leases must go, and why, so that the waiters that may reclaim fit.

    ``cluster`` is the cluster as placement sees it (it is not changed); ``candidates`` are the
    holding leases that may be reclaimed (borrowed) or released (idle-releasable);
    ``leaving`` (lease id → its GPU uuids) are holding leases already on their way out (being
    released, or a reclaim's stop sent): their GPUs count as free, so that nobody else is
    warned for a waiter that a stopping container is about to make room for. ``draining``
    (GPU uuids) may be free once a report no longer lists an ended lease's processes: those
    whose ``process_state`` is draining count as free for the same reason (a GPU kept out by
    a process left behind or by outside use does not).
    ``rooms``
    (booking → its room) are the bookings in effect that waiters are ``booked`` in; a
    member placed in its booking's room uses it up for the waiters after it.
    """
    plan: dict[str, Reclaim] = {}
    if not waiters:
        return plan
    view = _copy(cluster, draining)
    for lease_id, gpu_uuids in (leaving or {}).items():
        view.drop_claims(lease_id, list(gpu_uuids))
    ordered = victim_order(candidates, idle_window_s)
    room = dict(rooms or {})
    for waiter in waiters:
        placement = _fits(waiter, view, settings, now, down_after_s, room)
        if placement is None:
            placement = _make_room(waiter, ordered, view, plan, settings, now, down_after_s,
                                   room)
        if placement is not None:
            if waiter.booked is not None and in_booking(waiter.booked, placement, view, room):
                room[waiter.booked.booking] -= placement.units
            apply_placement(view, placement, waiter.lease_id, waiter.demand)
    return plan


def _make_room(waiter: Waiter, ordered: Sequence[Candidate], view: Cluster,
               plan: dict[str, Reclaim], settings: PolicySettings, now: float,
               down_after_s: float, rooms: Mapping[str, Fraction]) -> Placement | None:
    """Choose victims for one waiter that does not fit (recorded in ``plan``, taken out of
    ``view``) and return its placement; None, with ``view`` unchanged, when none lets it fit.

    First as a waiter within its guarantees (borrowed and idle-releasable leases may go, and
    for a member of a booking the non-members' leases on its GPUs; the placement found must
    be within the guarantees or the booking's room), else idle-releasable leases only.
    """
    booking = waiter.booked.booking if waiter.booked is not None else None

    def as_guaranteed(candidate: Candidate) -> ReclaimReason | None:
        if candidate.borrowed or booking in candidate.displaceable_by:
            return ReclaimReason.RECLAIMED
        return ReclaimReason.IDLE if candidate.idle_releasable else None

    def idle_only(candidate: Candidate) -> ReclaimReason | None:
        return ReclaimReason.IDLE if candidate.idle_releasable else None

    def within(placement: Placement) -> bool:
        return (in_booking(waiter.booked, placement, view, rooms)
                or _within_guarantee(waiter, placement, view, settings))

    for eligible, accept in ((as_guaranteed, within), (idle_only, None)):
        pool = [(c, reason) for c in ordered if c.lease_id not in plan
                for reason in [eligible(c)] if reason is not None]
        found = _take_until_fits(waiter, pool, view, settings, now, down_after_s, accept,
                                 rooms)
        if found is not None:
            placement, picked = found
            for candidate, reason in picked:
                for_booking = booking if booking in candidate.displaceable_by else None
                plan[candidate.lease_id] = Reclaim(reason, waiter.lease_id, for_booking)
            return placement
    return None


def _take_until_fits(
    waiter: Waiter, pool: Sequence[tuple[Candidate, ReclaimReason]], view: Cluster,
    settings: PolicySettings, now: float, down_after_s: float,
    accept: Callable[[Placement], bool] | None, rooms: Mapping[str, Fraction],
) -> tuple[Placement, list[tuple[Candidate, ReclaimReason]]] | None:
    """Take candidates out of ``view`` in pool order until the waiter fits (and ``accept``
    says yes), then give back those it fits without, the least preferred first. None, with
    ``view`` as it was, when the whole pool is not enough."""
    def fits() -> Placement | None:
        placement = _fits(waiter, view, settings, now, down_after_s, rooms)
        if placement is None or (accept is not None and not accept(placement)):
            return None
        return placement

    picked: list[tuple[Candidate, ReclaimReason, dict[str, list[Claim]]]] = []
    placement: Placement | None = None
    for candidate, reason in pool:
        picked.append((candidate, reason, _take(view, candidate)))
        placement = fits()
        if placement is not None:
            break
    if placement is None:
        for _, _, taken in reversed(picked):
            _give_back(view, taken)
        return None
    # Give back until no single victim can be: one pass is not enough, because placement is
    # not monotone in free GPUs (more free GPUs may move a best fit onto a model the quota
    # refuses), so a victim kept in one pass may be needless after a later one is given back.
    given_back = True
    while given_back and len(picked) > 1:
        given_back = False
        for index in range(len(picked) - 1, -1, -1):
            candidate, reason, taken = picked[index]
            _give_back(view, taken)
            trial = fits()
            if trial is not None:
                placement = trial
                del picked[index]
                given_back = True
            else:
                _take(view, candidate)
    return placement, [(candidate, reason) for candidate, reason, _ in picked]


def _take(view: Cluster, candidate: Candidate) -> dict[str, list[Claim]]:
    """Remove the candidate's claims from ``view``; return them to give back."""
    taken = {uuid: [c for c in view.claims.get(uuid, []) if c.lease_id == candidate.lease_id]
             for uuid in candidate.gpu_uuids}
    view.drop_claims(candidate.lease_id, list(candidate.gpu_uuids))
    return taken


def _give_back(view: Cluster, taken: dict[str, list[Claim]]) -> None:
    for uuid, claims in taken.items():
        for claim in claims:
            view.add_claim(uuid, claim)
