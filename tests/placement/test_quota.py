"""Placement within the quota (:func:`allocator.placement.quota.place_within_quota`): best fit
picks a host and model without the quota, so a per-model quota that refuses the model found
must not refuse a request that accepts another model its user may take. Pure: no services."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.config import PolicySettings
from allocator.placement.claims import claim_gpus
from allocator.placement.cluster import GPU, Cluster, Node
from allocator.placement.demand import Demand, Placement, Refusal, placement_model
from allocator.placement.policy import place
from allocator.placement.quota import check_quota, place_within_quota
from allocator.wire.protocol import ErrorCode

NOW = 1_000.0
DOWN_AFTER = 15.0
MODELS = ("NVIDIA A100-SXM4-40GB", "NVIDIA GeForce GTX 1070")


def cluster_of(hosts: list[list[tuple[str, str | None]]]) -> Cluster:
    """Hosts ``h0``, ``h1``, ...; each GPU a (model, the user holding it or None)."""
    cluster = Cluster()
    for number, gpus in enumerate(hosts):
        host = f"h{number}"
        node = Node(host=host, last_heartbeat=NOW)
        cluster.nodes[host] = node
        for index, (model, holder) in enumerate(gpus):
            gpu = GPU(uuid=f"GPU-{host}-{index}", host=host, index=index, model=model,
                      memory_total_mib=8192)
            cluster.gpus[gpu.uuid] = gpu
            node.gpu_uuids.append(gpu.uuid)
            if holder is not None:
                claim_gpus(cluster, f"L-{gpu.uuid}", holder, (), [gpu.uuid], shared=False,
                           memory_mib=None, units=Fraction(1))
    return cluster


def any_model(user: str = "alice", models: tuple[str, ...] | None = None) -> Demand:
    return Demand(user=user, groups=(), models=models, min_memory_mib=None, count=1,
                  host=None, shared=False, share_memory_mib=None)


def within_quota(demand: Demand, cluster: Cluster, policy: PolicySettings
                 ) -> Placement | Refusal:
    return place_within_quota(
        demand, lambda wanted, retry: place(wanted, cluster, NOW, DOWN_AFTER,
                                            explain=not retry),
        lambda found: check_quota(found.units, demand.user, demand.groups, cluster, policy,
                                  placement_model(found, cluster)))


def test_a_model_the_quota_refuses_gives_way_to_one_it_allows():
    # Best fit alone takes the last free A100 (the model with the fewest free GPUs here).
    cluster = cluster_of([[(MODELS[0], "alice"), (MODELS[0], None), (MODELS[1], None),
                           (MODELS[1], None)]])
    policy = PolicySettings(user_model_quota={"alice": {MODELS[0]: 1}})
    best_fit = place(any_model(), cluster, NOW, DOWN_AFTER)
    assert isinstance(best_fit, Placement) and placement_model(best_fit, cluster) == MODELS[0]
    got = within_quota(any_model(), cluster, policy)
    assert isinstance(got, Placement) and placement_model(got, cluster) == MODELS[1]
    # Asked for the A100 alone: the quota's refusal, as before.
    only = within_quota(any_model(models=(MODELS[0],)), cluster, policy)
    assert isinstance(only, Refusal) and only.code is ErrorCode.QUOTA_EXCEEDED


def test_with_nothing_allowed_free_the_first_quota_refusal_stands():
    cluster = cluster_of([[(MODELS[0], "alice"), (MODELS[0], None), (MODELS[1], "bob")]])
    policy = PolicySettings(user_model_quota={"alice": {MODELS[0]: 1}})
    got = within_quota(any_model(), cluster, policy)
    assert isinstance(got, Refusal) and got.code is ErrorCode.QUOTA_EXCEEDED
    assert got.details["model"] == MODELS[0]


HOLDERS = st.sampled_from([None, None, "alice", "bob"])


@settings(max_examples=150, deadline=None)
@given(hosts=st.lists(st.lists(st.tuples(st.sampled_from(MODELS), HOLDERS), min_size=1,
                               max_size=4), min_size=1, max_size=3),
       limits=st.fixed_dictionaries({}, optional={m: st.integers(0, 2) for m in MODELS}))
def test_an_any_model_request_is_never_refused_while_a_model_the_user_may_take_is_free(
        hosts: list[list[tuple[str, str | None]]], limits: dict[str, int]):
    cluster = cluster_of(hosts)
    policy = PolicySettings(user_model_quota={"alice": {m: float(n) for m, n in limits.items()}})
    held = {m: sum(1 for gpus in hosts for model, who in gpus if model == m and who == "alice")
            for m in MODELS}
    free = {m: any(model == m and who is None for gpus in hosts for model, who in gpus)
            for m in MODELS}
    may_take = [m for m in MODELS if free[m] and held[m] + 1 <= limits.get(m, held[m] + 1)]
    got = within_quota(any_model(), cluster, policy)
    if may_take:
        assert isinstance(got, Placement), got
        assert placement_model(got, cluster) in may_take
    else:
        assert isinstance(got, Refusal)
        assert got.code is (ErrorCode.QUOTA_EXCEEDED if any(free.values())
                            else ErrorCode.NO_CAPACITY)
