"""The pure fair-share policy (allocator.placement.fairshare), over generated clusters: nothing
within a guarantee is ever reclaimed, nobody is reclaimed when nobody waits, and what is reclaimed
lets a waiter fit."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.config import PolicySettings
from allocator.placement import fairshare
from allocator.placement.claims import claim_gpus
from allocator.placement.cluster import GPU, Cluster, Node
from allocator.placement.demand import Demand, Placement, placement_model
from allocator.placement.policy import place
from allocator.placement.quota import check_quota, quota_scopes, quota_standings, would_borrow
from allocator.wire.protocol import Health, ReclaimReason

USERS = ("ann", "ben", "cat", "dan")
GROUPS = ("lab", "course")
MODELS = ("NVIDIA GeForce GTX 1070", "NVIDIA A100-SXM4-40GB")
NOW = 10_000.0


def build_cluster(hosts: int, gpus_per_host: int) -> Cluster:
    cluster = Cluster()
    for h in range(hosts):
        host = f"gpu-{h}"
        uuids = [f"GPU-{h}-{i}" for i in range(gpus_per_host)]
        cluster.nodes[host] = Node(host=host, last_heartbeat=NOW, drained=False,
                                   agent_id="a", gpu_uuids=uuids)
        for i, uuid in enumerate(uuids):
            cluster.gpus[uuid] = GPU(uuid=uuid, host=host, index=i, model=MODELS[i % 2],
                                     memory_total_mib=8192, health=Health.HEALTHY,
                                     share_slots=1)
    return cluster


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[Cluster, PolicySettings, list[fairshare.Holding],
                                        list[fairshare.Waiter], dict[str, float]]:
    cluster = build_cluster(draw(st.integers(1, 3)), draw(st.integers(1, 4)))
    guarantees = {u: float(draw(st.integers(0, 2))) for u in USERS if draw(st.booleans())}
    borrow = {u: g + draw(st.integers(0, 3)) for u, g in guarantees.items()}
    group_guarantees = {g: float(draw(st.integers(0, 3))) for g in GROUPS if draw(st.booleans())}
    group_borrow = {g: v + draw(st.integers(0, 4)) for g, v in group_guarantees.items()}
    model_guarantees = {u: {MODELS[1]: float(draw(st.integers(0, 1)))} for u in USERS
                        if draw(st.booleans())}
    model_borrow = {u: {m: g + draw(st.integers(0, 2)) for m, g in by_model.items()}
                    for u, by_model in model_guarantees.items()}
    config = PolicySettings(user_quota=guarantees, user_borrow_limit=borrow,
                            group_quota=group_guarantees, group_borrow_limit=group_borrow,
                            user_model_quota=model_guarantees,
                            user_model_borrow_limit=model_borrow)
    free = sorted(cluster.gpus)
    holdings: list[fairshare.Holding] = []
    idle: dict[str, float] = {}
    for n in range(draw(st.integers(0, len(free)))):
        user = draw(st.sampled_from(USERS))
        groups = tuple(draw(st.lists(st.sampled_from(GROUPS), max_size=2, unique=True)))
        uuid = free.pop(draw(st.integers(0, len(free) - 1)))
        lease_id = f"h{n}"
        holdings.append(fairshare.Holding(lease_id, user, groups, Fraction(1),
                                          float(draw(st.integers(0, 50))),
                                          model=cluster.gpus[uuid].model))
        claim_gpus(cluster, lease_id, user, groups, [uuid], shared=False,
                   memory_mib=None, units=Fraction(1))
        idle[lease_id] = float(draw(st.sampled_from([0, 100, 5000])))
    waiters = [fairshare.Waiter(f"w{n}", Demand(
        user=draw(st.sampled_from(USERS)),
        groups=tuple(draw(st.lists(st.sampled_from(GROUPS), max_size=2, unique=True))),
        models=None, min_memory_mib=None, count=draw(st.integers(1, 2)), host=None,
        shared=False, share_memory_mib=None)) for n in range(draw(st.integers(0, 3)))]
    return cluster, config, holdings, waiters, idle


def candidates_of(cluster: Cluster, holdings: list[fairshare.Holding], borrowed: set[str],
                  idle: dict[str, float], release_after: float | None
                  ) -> list[fairshare.Candidate]:
    where = {c.lease_id: uuid for uuid, claims in cluster.claims.items() for c in claims}
    return [fairshare.Candidate(
        lease_id=h.lease_id, gpu_uuids=(where[h.lease_id],), granted_at=h.granted_at,
        idle_s=idle[h.lease_id], warned=False, borrowed=h.lease_id in borrowed,
        idle_releasable=release_after is not None and idle[h.lease_id] >= release_after)
        for h in holdings]


def plan(cluster: Cluster, config: PolicySettings, holdings: list[fairshare.Holding],
         waiters: list[fairshare.Waiter], idle: dict[str, float],
         release_after: float | None = None) -> tuple[set[str], dict[str, fairshare.Reclaim]]:
    borrowed = fairshare.borrowed_leases(holdings, config)
    result = fairshare.plan_reclaims(
        waiters, candidates_of(cluster, holdings, borrowed, idle, release_after), cluster, config,
        now=NOW, down_after_s=60.0, idle_window_s=600.0)
    return borrowed, result


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_nothing_within_a_guarantee_is_ever_reclaimed(scenario) -> None:
    cluster, config, holdings, waiters, idle = scenario
    claims_before = {uuid: list(claims) for uuid, claims in cluster.claims.items()}
    borrowed, result = plan(cluster, config, holdings, waiters, idle)
    assert set(result) <= borrowed
    assert all(r.reason is ReclaimReason.RECLAIMED for r in result.values())
    assert cluster.claims == claims_before  # the plan works on a copy
    # Within the guarantee means: in every limited scope, among the oldest grants that fit it.
    for holding in holdings:
        if holding.lease_id in borrowed:
            continue
        for quota in quota_scopes(holding.user, holding.groups, config,
                                  model=holding.model):
            if quota.guarantee is None:
                continue
            same = [h for h in holdings
                    if (h.user == quota.name if quota.scope == "user" else quota.name in h.groups)
                    and quota.model in (None, h.model)]
            earlier = [h for h in same if (h.granted_at, h.borrowed, h.lease_id)
                       <= (holding.granted_at, holding.borrowed, holding.lease_id)]
            assert sum(h.units for h in earlier) <= quota.guarantee


@settings(max_examples=200, deadline=None)
@given(scenarios())
def test_nobody_is_reclaimed_when_nobody_waits(scenario) -> None:
    cluster, config, holdings, _, idle = scenario
    assert plan(cluster, config, holdings, [], idle, release_after=60.0)[1] == {}


def fits_within_guarantee(waiter: fairshare.Waiter, cluster: Cluster, config: PolicySettings,
                          without: set[str]) -> bool:
    """Whether the waiter fits, within its quota and guarantees, once ``without`` are gone."""
    view = Cluster(nodes=cluster.nodes, gpus=cluster.gpus,
                   claims={u: [c for c in cs if c.lease_id not in without]
                           for u, cs in cluster.claims.items()})
    placement = place(waiter.demand, view, NOW, 60.0)
    if not isinstance(placement, Placement):
        return False
    user, groups = waiter.demand.user, waiter.demand.groups
    model = placement_model(placement, view)
    if check_quota(placement.units, user, groups, view, config, model) is not None:
        return False
    return not would_borrow(placement.units, quota_standings(
        user, groups, view, config, limited_only=True, model=model))


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_what_is_reclaimed_for_a_waiter_is_what_it_needs(scenario) -> None:
    cluster, config, holdings, waiters, idle = scenario
    _, result = plan(cluster, config, holdings, waiters[:1], idle)
    if not result:
        return
    waiter = waiters[0]
    assert not fits_within_guarantee(waiter, cluster, config, set())
    assert fits_within_guarantee(waiter, cluster, config, set(result))
    for victim in result:  # minimal: without any one victim it would not fit
        assert not fits_within_guarantee(waiter, cluster, config, set(result) - {victim})
