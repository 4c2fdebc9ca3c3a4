"""MIG instances and compute capability in the pure placement policy: examples, then properties.

The cluster: ``mig-a`` has an A100 in MIG mode carved into mixed profiles, ``whole-a`` a whole
A100, ``pascal`` a GTX 1070. No services: the policy is pure functions over a Cluster.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocator.config import PolicySettings
from allocator.placement.claims import apply_placement
from allocator.placement.cluster import GPU, Cluster, Node
from allocator.placement.container_env import lease_env
from allocator.placement.demand import Placement, Refusal, make_demand
from allocator.placement.index import PlacementIndex
from allocator.placement.model_summary import summarize_models
from allocator.placement.policy import place
from allocator.wire.protocol import AllocateRequest, ErrorCode, Health
from tests.support.common import A100_40GB as A100
from tests.support.common import GTX1070 as GTX
from tests.support.common import MIG_1G, MIG_3G

NOW = 10_000.0
DOWN = 15.0
SETTINGS = PolicySettings()


def _gpu(host: str, index: int, model: str, memory: int, capability: str, arch: str,
         **fields: Any) -> GPU:
    return GPU(uuid=fields.pop("uuid", f"GPU-{host}-{index}"), host=host, index=index,
               model=model, memory_total_mib=memory, compute_capability=capability,
               architecture=arch, **fields)


def mig_cluster(profiles: tuple[str, ...] = ("3g.20gb", "1g.5gb", "1g.5gb", "1g.5gb")) -> Cluster:
    """The three hosts; the MIG A100's instances have the given profiles."""
    cluster = Cluster()
    for host in ("mig-a", "whole-a", "pascal"):
        cluster.nodes[host] = Node(host=host, last_heartbeat=NOW)
    parent = _gpu("mig-a", 0, A100, 40960, "8.0", "ampere", mig_enabled=True)
    gpus = [parent]
    for position, profile in enumerate(profiles):
        memory = 19968 if profile.startswith("3g") else 4864
        gpus.append(_gpu("mig-a", 0, f"{A100} MIG {profile}", memory, "8.0", "ampere",
                         uuid=f"MIG-a-{position}", mig_parent_uuid=parent.uuid,
                         mig_profile=profile, mig_index=position))
    gpus.append(_gpu("whole-a", 0, A100, 40960, "8.0", "ampere"))
    gpus.append(_gpu("pascal", 0, GTX, 8192, "6.1", "pascal"))
    for gpu in gpus:
        cluster.gpus[gpu.uuid] = gpu
        cluster.nodes[gpu.host].gpu_uuids.append(gpu.uuid)
    return cluster


def ask(cluster: Cluster, **fields: Any) -> Placement | Refusal:
    request = AllocateRequest(request_key="k", user="alice", **fields)
    demand = make_demand(request, cluster, SETTINGS)
    if isinstance(demand, Refusal):
        return demand
    return place(demand, cluster, NOW, DOWN)


def take(cluster: Cluster, lease_id: str, **fields: Any) -> Placement:
    request = AllocateRequest(request_key=lease_id, user="alice", **fields)
    demand = make_demand(request, cluster, SETTINGS)
    assert not isinstance(demand, Refusal)
    placement = place(demand, cluster, NOW, DOWN)
    assert isinstance(placement, Placement), placement
    apply_placement(cluster, placement, lease_id, demand)
    return placement


def test_a_profile_is_a_model_and_count_takes_instances_of_one_host() -> None:
    cluster = mig_cluster()
    one = ask(cluster, model=MIG_1G)
    assert isinstance(one, Placement) and one.host == "mig-a"
    assert one.gpu_uuids == ("MIG-a-1",)
    three = ask(cluster, model=MIG_1G, count=3)
    assert isinstance(three, Placement)
    assert three.gpu_uuids == ("MIG-a-1", "MIG-a-2", "MIG-a-3")
    four = ask(cluster, model=MIG_1G, count=4)
    assert isinstance(four, Refusal) and four.code is ErrorCode.UNSATISFIABLE
    big = ask(cluster, model=MIG_3G)
    assert isinstance(big, Placement) and big.gpu_uuids == ("MIG-a-0",)


def test_the_container_sees_the_instance_uuids() -> None:
    cluster = mig_cluster()
    placement = take(cluster, "L1", model=MIG_1G, count=2)
    env = lease_env(placement, cluster, "L1")
    assert env["NVIDIA_VISIBLE_DEVICES"] == "MIG-a-1,MIG-a-2"


def test_a_gpu_in_mig_mode_is_never_granted_whole() -> None:
    cluster = mig_cluster()
    first = take(cluster, "L1", model=A100)
    assert first.host == "whole-a"
    second = ask(cluster, model=A100)
    assert isinstance(second, Refusal) and second.code is ErrorCode.NO_CAPACITY
    # Any model, one GPU at a time: everything but the MIG-mode parent is handed out.
    handed: list[str] = []
    while isinstance(got := ask(cluster), Placement):
        apply_placement(cluster, got, f"any-{len(handed)}", _demand(cluster))
        handed.extend(got.gpu_uuids)
    assert "GPU-mig-a-0" not in handed
    assert sorted(handed) == ["GPU-pascal-0", "MIG-a-0", "MIG-a-1", "MIG-a-2", "MIG-a-3"]


def _demand(cluster: Cluster) -> Any:
    demand = make_demand(AllocateRequest(request_key="x", user="alice"), cluster, SETTINGS)
    assert not isinstance(demand, Refusal)
    return demand


def test_all_of_a_mig_host_means_its_instances() -> None:
    cluster = mig_cluster()
    placement = ask(cluster, count="all", host="mig-a")
    assert isinstance(placement, Placement)
    assert "GPU-mig-a-0" not in placement.gpu_uuids
    assert set(placement.gpu_uuids) == {"MIG-a-0", "MIG-a-1", "MIG-a-2", "MIG-a-3"}


def test_only_a_mig_parent_of_a_model_is_unsatisfiable_for_that_model() -> None:
    cluster = mig_cluster()
    del cluster.gpus["GPU-whole-a-0"]
    cluster.nodes["whole-a"].gpu_uuids.clear()
    refusal = ask(cluster, model=A100)
    assert isinstance(refusal, Refusal) and refusal.code is ErrorCode.UNSATISFIABLE
    assert MIG_1G in refusal.message  # names what there is instead


@pytest.mark.parametrize(("fields", "allowed"), [
    ({"min_compute_capability": "8.0"}, {"mig-a", "whole-a"}),
    ({"min_compute_capability": "6.1"}, {"mig-a", "whole-a", "pascal"}),
    ({"architecture": "pascal"}, {"pascal"}),
    ({"architecture": "ampere", "model": A100}, {"whole-a"}),
    ({"min_compute_capability": "7.5", "model": MIG_1G, "count": 2}, {"mig-a"}),
])
def test_compute_capability_and_architecture_filter(fields: dict[str, Any],
                                                     allowed: set[str]) -> None:
    cluster = mig_cluster()
    seen: set[str] = set()
    for n in range(8):
        got = ask(cluster, **fields)
        if not isinstance(got, Placement):
            assert got.code is ErrorCode.NO_CAPACITY
            break
        seen.add(got.host)
        request = AllocateRequest(request_key=f"k{n}", user="alice", **fields)
        demand = make_demand(request, cluster, SETTINGS)
        assert not isinstance(demand, Refusal)
        apply_placement(cluster, got, f"L{n}", demand)
    assert seen == allowed


def test_a_capability_nobody_has_is_unsatisfiable_and_says_what_there_is() -> None:
    cluster = mig_cluster()
    refusal = ask(cluster, min_compute_capability="9.0")
    assert isinstance(refusal, Refusal) and refusal.code is ErrorCode.UNSATISFIABLE
    assert "compute capability 9.0 or higher" in refusal.message
    assert "6.1" in refusal.message and "8.0" in refusal.message
    # Numbers, not strings: 10.0 is above 9.0 and 8.0.
    cluster.gpus["GPU-pascal-0"].compute_capability = "10.0"
    placed = ask(cluster, min_compute_capability="9.0")
    assert isinstance(placed, Placement) and placed.host == "pascal"


def test_unknown_capability_never_matches_a_capability_demand() -> None:
    cluster = mig_cluster()
    for gpu in cluster.gpus.values():
        gpu.compute_capability = None
    refusal = ask(cluster, min_compute_capability="1.0")
    assert isinstance(refusal, Refusal) and refusal.code is ErrorCode.UNSATISFIABLE


def test_parent_health_reported_on_instances_excludes_them_and_recovery_readmits() -> None:
    # The agent copies its parent's verdict onto each instance; the policy only reads health.
    cluster = mig_cluster()
    for gpu in cluster.gpus.values():
        if gpu.mig_parent_uuid == "GPU-mig-a-0":
            gpu.health = Health.UNHEALTHY
    refusal = ask(cluster, model=MIG_1G)
    assert isinstance(refusal, Refusal) and refusal.code is ErrorCode.NO_CAPACITY
    for gpu in cluster.gpus.values():
        gpu.health = Health.HEALTHY
    assert isinstance(ask(cluster, model=MIG_1G), Placement)


def test_the_form_summary_counts_instances_per_profile_and_not_the_parent() -> None:
    cluster = mig_cluster()
    take(cluster, "L1", model=MIG_1G)
    summaries = {s.model: s for s in summarize_models(cluster, SETTINGS, NOW, DOWN)}
    assert summaries[MIG_1G].total == 3 and summaries[MIG_1G].free == 2
    assert summaries[MIG_1G].mig_profile == "1g.5gb"
    assert summaries[MIG_1G].mig_parent_model == A100
    assert summaries[MIG_1G].compute_capability == "8.0"
    assert summaries[A100].total == 1  # the whole one only
    assert summaries[A100].mig_profile is None
    assert summaries[GTX].architecture == "pascal"


# --------------------------------------------------------------------------- properties

PROFILES = ("1g.5gb", "2g.10gb", "3g.20gb")


@st.composite
def clusters(draw: st.DrawFn) -> Cluster:
    """Hosts with whole GPUs and GPUs in MIG mode, of random capability, health and claims."""
    cluster = Cluster()
    for h in range(draw(st.integers(1, 4))):
        host = f"h{h}"
        cluster.nodes[host] = Node(host=host, last_heartbeat=NOW)
        for index in range(draw(st.integers(1, 3))):
            capability = draw(st.sampled_from(["6.1", "7.0", "8.0", "9.0"]))
            healthy = draw(st.booleans()) or draw(st.booleans())
            health = Health.HEALTHY if healthy else Health.UNHEALTHY
            parent = _gpu(host, index, A100, 40960, capability, "ampere",
                          mig_enabled=draw(st.booleans()), health=health)
            members = [parent]
            if parent.mig_enabled:
                for position in range(draw(st.integers(0, 4))):
                    profile = draw(st.sampled_from(PROFILES))
                    members.append(_gpu(host, index, f"{A100} MIG {profile}", 4864,
                                        capability, "ampere",
                                        uuid=f"MIG-{host}-{index}-{position}",
                                        mig_parent_uuid=parent.uuid, mig_profile=profile,
                                        mig_index=position, health=health))
            for gpu in members:
                cluster.gpus[gpu.uuid] = gpu
                cluster.nodes[host].gpu_uuids.append(gpu.uuid)
    return cluster


MODELS = [None, A100, *(f"{A100} MIG {p}" for p in PROFILES)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=clusters(), model=st.sampled_from(MODELS),
       count=st.one_of(st.integers(1, 4), st.just("all")),
       capability=st.sampled_from([None, "6.1", "8.0", "9.0"]), steps=st.integers(1, 5))
def test_no_placement_takes_a_mig_parent_or_a_too_weak_gpu(
    cluster: Cluster, model: str | None, count: int | str, capability: str | None, steps: int
) -> None:
    fields: dict[str, Any] = {"count": count, "min_compute_capability": capability}
    if model is not None and model in {g.model for g in cluster.gpus.values()}:
        fields["model"] = model
    for step in range(steps):
        request = AllocateRequest(request_key=f"k{step}", user="alice", **fields)
        demand = make_demand(request, cluster, SETTINGS)
        assert not isinstance(demand, Refusal)
        placement = place(demand, cluster, NOW, DOWN)
        if isinstance(placement, Refusal):
            break
        hosts = {cluster.gpus[u].host for u in placement.gpu_uuids}
        assert hosts == {placement.host}
        for uuid in placement.gpu_uuids:
            gpu = cluster.gpus[uuid]
            assert not gpu.mig_enabled
            assert gpu.health is Health.HEALTHY
            assert cluster.is_free(gpu)
            if capability is not None:
                assert gpu.compute_capability is not None
                assert float(gpu.compute_capability) >= float(capability)
            if gpu.mig_parent_uuid is not None:
                # An instance's parent is in MIG mode and holds no claim of its own.
                parent = cluster.gpus[gpu.mig_parent_uuid]
                assert parent.mig_enabled and cluster.is_free(parent)
        apply_placement(cluster, placement, f"L{step}", demand)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=clusters(), models=st.lists(st.sampled_from(MODELS[1:]), max_size=2, unique=True),
       count=st.integers(1, 3), capability=st.sampled_from([None, None, "8.0"]),
       steps=st.integers(1, 6))
def test_the_placement_index_gives_the_policys_answer_with_mig(
    cluster: Cluster, models: list[str], count: int, capability: str | None, steps: int
) -> None:
    """The engine narrows placement with the index first; with GPUs in MIG mode and their
    instances (and capability demands, which it declines) the answer must stay the policy's."""
    index = PlacementIndex()
    index.rebuild(cluster)
    known = {g.model for g in cluster.gpus.values()}
    fields: dict[str, Any] = {"count": count, "min_compute_capability": capability}
    if [m for m in models if m in known]:
        fields["models"] = [m for m in models if m in known]
    for step in range(steps):
        request = AllocateRequest(request_key=f"k{step}", user="alice", **fields)
        demand = make_demand(request, cluster, SETTINGS)
        assert not isinstance(demand, Refusal)
        expected = place(demand, cluster, NOW, DOWN)
        view = index.narrow(demand, cluster, lambda node: node.is_up(NOW, DOWN))
        got = place(demand, view, NOW, DOWN) if view is not None else expected
        if not isinstance(got, Placement):
            got = expected
        assert got == expected
        if not isinstance(got, Placement):
            break
        apply_placement(cluster, got, f"L{step}", demand)
        index.refresh(cluster, got.host)


def test_a_profile_can_have_aliases_and_is_matched_like_any_model() -> None:
    cluster = mig_cluster()
    aliased = PolicySettings(aliases={"1g.5gb": MIG_1G, "a100-small": MIG_1G})
    for spelling in ("1g.5gb", "A100-small", MIG_1G.lower(), "a100 sxm4 40gb mig 1g 5gb"):
        request = AllocateRequest(request_key="k", user="alice", model=spelling)
        demand = make_demand(request, cluster, aliased)
        assert not isinstance(demand, Refusal), spelling
        assert demand.models == (MIG_1G,)
    summary = {s.model: s for s in summarize_models(cluster, aliased, NOW, DOWN)}
    assert summary[MIG_1G].aliases == ["1g.5gb", "a100-small"]


@pytest.mark.parametrize("spelling", [
    "1g.5gb", "A100 1g.5gb", "a100-sxm4-40gb 1g.5gb", "NVIDIA A100 1g.5gb", MIG_1G.upper()])
def test_a_profile_is_found_by_its_short_spellings(spelling: str) -> None:
    cluster = mig_cluster()
    request = AllocateRequest(request_key="k", user="alice", model=spelling)
    demand = make_demand(request, cluster, SETTINGS)
    assert not isinstance(demand, Refusal), spelling
    assert demand.models == (MIG_1G,)


def test_a_profile_two_gpu_models_have_needs_its_family() -> None:
    cluster = mig_cluster()
    h100 = "NVIDIA H100 80GB HBM3"
    for model in (f"{A100} MIG 1g.10gb", f"{h100} MIG 1g.10gb"):
        gpu = _gpu("whole-a", 9, model, 9984, "9.0", "hopper", uuid=f"MIG-{model}",
                   mig_parent_uuid="GPU-whole-a-0", mig_profile="1g.10gb", mig_index=0)
        cluster.gpus[gpu.uuid] = gpu
        cluster.nodes["whole-a"].gpu_uuids.append(gpu.uuid)
    ambiguous = make_demand(AllocateRequest(request_key="k", user="u", model="1g.10gb"),
                            cluster, SETTINGS)
    assert isinstance(ambiguous, Refusal) and ambiguous.code is ErrorCode.UNKNOWN_MODEL
    assert "could mean" in ambiguous.message
    named = make_demand(AllocateRequest(request_key="k", user="u", model="h100 1g.10gb"),
                        cluster, SETTINGS)
    assert not isinstance(named, Refusal) and named.models == (f"{h100} MIG 1g.10gb",)
