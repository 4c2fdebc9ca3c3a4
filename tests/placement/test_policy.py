"""The placement policy, tested directly: examples for every rule and refusal, then properties.

No services are needed: the policy is pure functions over a :class:`Cluster`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocator.config import PolicySettings
from allocator.placement.claims import apply_placement
from allocator.placement.cluster import GPU, Claim, Cluster, Node
from allocator.placement.container_env import lease_env
from allocator.placement.demand import (
    Demand,
    Placement,
    Refusal,
    canonical_models,
    make_demand,
    resolve_models,
    share_slots_for,
)
from allocator.placement.feasibility import feasible
from allocator.placement.model_summary import summarize_models
from allocator.placement.policy import place
from allocator.placement.queue_order import queue_order_key
from allocator.placement.quota import check_quota
from allocator.wire.protocol import AllocateRequest, ErrorCode, Health, ShareRequest

NOW = 10_000.0
DOWN = 15.0

GTX = "NVIDIA GeForce GTX 1070"
A100 = "NVIDIA A100-SXM4-80GB"
V100 = "Tesla V100-PCIE-16GB"
MEM = {GTX: 8192, A100: 81920, V100: 16384}
SLOTS = {GTX: 4, A100: 1, V100: 2}
SETTINGS = PolicySettings(share_slots={GTX: 4, V100: 2}, aliases={"1070": GTX, "a100": A100})

GPUSpec = str | tuple[str, dict[str, Any]]


def build(hosts: dict[str, Sequence[GPUSpec]], **node_fields: Any) -> Cluster:
    """A cluster of up nodes; each GPU is a model name or (model, GPU field overrides)."""
    cluster = Cluster()
    for host, specs in hosts.items():
        node = Node(host=host, last_heartbeat=NOW, **node_fields)
        cluster.nodes[host] = node
        for index, spec in enumerate(specs):
            model, extra = (spec, {}) if isinstance(spec, str) else spec
            fields: dict[str, Any] = {
                "memory_total_mib": MEM.get(model, 4096),
                "share_slots": SLOTS.get(model, 1),
                **extra,
            }
            gpu = GPU(uuid=f"GPU-{host}-{index}", host=host, index=index, model=model, **fields)
            cluster.gpus[gpu.uuid] = gpu
            node.gpu_uuids.append(gpu.uuid)
    return cluster


def demand(**fields: Any) -> Demand:
    """A demand with defaults: one GPU of any model for alice."""
    base: dict[str, Any] = {
        "user": "alice",
        "groups": (),
        "models": None,
        "min_memory_mib": None,
        "count": 1,
        "host": None,
        "shared": False,
        "share_memory_mib": None,
    }
    base.update(fields)
    return Demand(**base)


def request(**fields: Any) -> AllocateRequest:
    return AllocateRequest(request_key="hub/alice/", user="alice", **fields)


def placed(result: Placement | Refusal) -> Placement:
    assert isinstance(result, Placement), result
    return result


def refused(result: object, code: ErrorCode) -> Refusal:
    assert isinstance(result, Refusal), result
    assert result.code is code, result
    return result


def grant(cluster: Cluster, d: Demand, lease_id: str) -> Placement:
    """Place and record a demand (what the allocator does on success)."""
    placement = placed(place(d, cluster, NOW, DOWN))
    apply_placement(cluster, placement, lease_id, d)
    return placement


def occupy(cluster: Cluster, uuid: str, lease_id: str = "busy", user: str = "bob") -> None:
    gpu = cluster.gpus[uuid]
    cluster.add_claim(uuid, Claim(lease_id, user, (), True, gpu.memory_total_mib, Fraction(1)))


def share(cluster: Cluster, uuid: str, memory: int, lease_id: str, user: str = "bob") -> None:
    gpu = cluster.gpus[uuid]
    units = Fraction(1, gpu.share_slots)
    cluster.add_claim(uuid, Claim(lease_id, user, (), False, memory, units))


# --------------------------------------------------------------------------- models


class TestCanonicalModels:
    def test_accepts_exact_compact_unbranded_and_alias_spellings(self) -> None:
        spellings = canonical_models(build({"a": [GTX]}), {"1070": GTX})
        for key in ("nvidia geforce gtx 1070", "nvidiageforcegtx1070", "gtx1070", "1070"):
            assert spellings[key] == GTX

    def test_vendor_words_are_stripped_for_every_brand(self) -> None:
        cluster = build({"a": [V100, "Quadro RTX 6000", A100]})
        spellings = canonical_models(cluster, {})
        assert spellings["v100pcie16gb"] == V100
        assert spellings["rtx6000"] == "Quadro RTX 6000"
        assert spellings["a100sxm480gb"] == A100

    def test_only_models_in_the_cluster_or_alias_targets_are_known(self) -> None:
        cluster = build({"a": [GTX, ("NVIDIA T4", {"present": False})]})
        spellings = canonical_models(cluster, {"h100": "NVIDIA H100"})
        assert set(spellings.values()) == {GTX, "NVIDIA T4", "NVIDIA H100"}
        assert "a100" not in spellings

    def test_alias_target_spelled_differently_maps_to_reported_name(self) -> None:
        spellings = canonical_models(build({"a": [GTX]}), {"Gtx": "nvidia geforce gtx-1070"})
        assert spellings["gtx"] == GTX

    def test_exact_name_wins_over_alias_and_alias_over_derived(self) -> None:
        cluster = build({"a": ["gtx1070", GTX]})
        spellings = canonical_models(cluster, {"nvidiageforcegtx1070": "gtx1070"})
        assert spellings["gtx1070"] == "gtx1070"  # exact name of another model
        assert spellings["nvidiageforcegtx1070"] == "gtx1070"  # the alias
        assert spellings["nvidia geforce gtx 1070"] == GTX

    def test_spelling_shared_by_two_models_is_not_accepted(self) -> None:
        spellings = canonical_models(build({"a": ["NVIDIA RTX 6000", "Quadro RTX 6000"]}), {})
        assert "rtx6000" not in spellings


class TestResolveModels:
    def test_none_means_any_model(self) -> None:
        assert resolve_models(None, build({"a": [GTX]}), {}) is None

    def test_keeps_preference_order_and_drops_duplicates(self) -> None:
        cluster = build({"a": [GTX, A100]})
        got = resolve_models(["a100", "GTX 1070", "1070", A100], cluster, SETTINGS.aliases)
        assert got == (A100, GTX)

    def test_user_spellings_with_spaces_and_brand_words(self) -> None:
        cluster = build({"a": [GTX]})
        for name in ("gtx 1070", "GeForce GTX 1070", "NVIDIA-GeForce-GTX-1070", " gtx1070 "):
            assert resolve_models([name], cluster, {}) == (GTX,)

    def test_unknown_model_lists_known_models_and_aliases(self) -> None:
        cluster = build({"a": [GTX, A100]})
        refusal = refused(
            resolve_models(["rtx 4090", "1070"], cluster, SETTINGS.aliases),
            ErrorCode.UNKNOWN_MODEL,
        )
        assert "'rtx 4090'" in refusal.message
        assert A100 in refusal.message and GTX in refusal.message
        assert "1070" in refusal.message  # the alias is shown
        assert refusal.details["unknown"] == ["rtx 4090"]
        assert refusal.details["known"][GTX] == ["1070"]

    def test_unknown_model_in_an_empty_cluster_says_nothing_is_known(self) -> None:
        refusal = refused(resolve_models(["gtx"], Cluster(), {}), ErrorCode.UNKNOWN_MODEL)
        assert "no node has reported a GPU" in refusal.message

    def test_ambiguous_spelling_names_the_candidates(self) -> None:
        cluster = build({"a": ["NVIDIA RTX 6000", "Quadro RTX 6000"]})
        refusal = refused(resolve_models(["rtx 6000"], cluster, {}), ErrorCode.UNKNOWN_MODEL)
        assert "could mean NVIDIA RTX 6000 or Quadro RTX 6000" in refusal.message

    def test_empty_list_is_a_bad_request(self) -> None:
        refused(resolve_models([], build({"a": [GTX]}), {}), ErrorCode.BAD_REQUEST)


def test_share_slots_for_uses_configured_value_then_default() -> None:
    assert share_slots_for(GTX, SETTINGS) == 4
    assert share_slots_for(A100, SETTINGS) == 1
    assert share_slots_for(A100, PolicySettings(default_share_slots=2)) == 2


# --------------------------------------------------------------------------- make_demand


class TestMakeDemand:
    def test_resolves_models_and_copies_the_request(self) -> None:
        cluster = build({"gpu-a": [GTX, A100]})
        got = make_demand(
            request(
                models=["a100", "1070"],
                groups=["students"],
                min_memory_mib=4000,
                count=2,
                host="gpu-a",
            ),
            cluster,
            SETTINGS,
        )
        assert got == Demand(
            user="alice",
            groups=("students",),
            models=(A100, GTX),
            min_memory_mib=4000,
            count=2,
            host="gpu-a",
            shared=False,
            share_memory_mib=None,
        )

    def test_count_all_becomes_none(self) -> None:
        got = make_demand(request(count="all"), build({"a": [GTX]}), SETTINGS)
        assert isinstance(got, Demand) and got.count is None and got.models is None

    def test_unknown_model_is_refused(self) -> None:
        got = make_demand(request(model="h100"), build({"a": [GTX]}), SETTINGS)
        assert GTX in refused(got, ErrorCode.UNKNOWN_MODEL).message

    def test_unknown_host_lists_known_hosts(self) -> None:
        got = make_demand(request(host="gpu-z"), build({"gpu-a": [GTX], "gpu-b": []}), SETTINGS)
        refusal = refused(got, ErrorCode.UNKNOWN_HOST)
        assert "gpu-z" in refusal.message and "gpu-a, gpu-b" in refusal.message
        assert refusal.details["known"] == ["gpu-a", "gpu-b"]

    def test_share_of_exclusive_model_is_not_shareable_and_names_shareable_models(self) -> None:
        got = make_demand(
            request(model="a100", share=ShareRequest()), build({"a": [GTX, A100]}), SETTINGS
        )
        refusal = refused(got, ErrorCode.NOT_SHAREABLE)
        assert A100 in refusal.message and f"Shareable models: {GTX}" in refusal.message
        assert refusal.details["shareable"] == [GTX]

    def test_share_with_any_model_when_nothing_is_shareable(self) -> None:
        got = make_demand(request(share=ShareRequest()), build({"a": [A100]}), SETTINGS)
        refused(got, ErrorCode.NOT_SHAREABLE)

    def test_share_drops_exclusive_models_from_the_preferences(self) -> None:
        got = make_demand(
            request(models=["a100", "1070"], share=ShareRequest(memory_mib=2048)),
            build({"a": [GTX, A100]}),
            SETTINGS,
        )
        assert isinstance(got, Demand)
        assert got.models == (GTX,) and got.shared and got.count == 1
        assert got.share_memory_mib == 2048

    def test_share_budget_larger_than_the_gpu_is_unsatisfiable(self) -> None:
        got = make_demand(
            request(model="1070", share=ShareRequest(memory_mib=9000)),
            build({"a": [GTX]}),
            SETTINGS,
        )
        refusal = refused(got, ErrorCode.UNSATISFIABLE)
        assert "9000 MiB" in refusal.message and "8192 MiB" in refusal.message

    def test_zero_share_budget_is_a_bad_request(self) -> None:
        got = make_demand(request(share=ShareRequest(memory_mib=0)), build({"a": [GTX]}), SETTINGS)
        refused(got, ErrorCode.BAD_REQUEST)


# --------------------------------------------------------------------------- feasible


class TestFeasible:
    def test_count_larger_than_any_host_names_the_largest(self) -> None:
        cluster = build({"gpu-a": [GTX] * 8, "gpu-b": [GTX] * 4})
        refusal = refused(
            feasible(demand(models=(GTX,), count=9), cluster), ErrorCode.UNSATISFIABLE
        )
        assert refusal.message == f"No host has 9 GPUs of model {GTX}; the largest has 8 (gpu-a)."
        assert refusal.details["largest"] == {"host": "gpu-a", "model": GTX, "count": 8}

    def test_count_may_not_add_up_models_or_hosts(self) -> None:
        cluster = build({"gpu-a": [GTX, A100], "gpu-b": [GTX]})
        refusal = refused(feasible(demand(count=2), cluster), ErrorCode.UNSATISFIABLE)
        assert "of one model" in refusal.message

    def test_fits_when_some_host_has_enough(self) -> None:
        cluster = build({"gpu-a": [GTX] * 2, "gpu-b": [GTX] * 4})
        assert feasible(demand(models=(GTX,), count=4), cluster) is None

    def test_min_memory_larger_than_every_gpu(self) -> None:
        cluster = build({"a": [GTX, V100]})
        refusal = refused(feasible(demand(min_memory_mib=20000), cluster), ErrorCode.UNSATISFIABLE)
        assert "at least 20000 MiB" in refusal.message and "16384 MiB" in refusal.message

    def test_model_not_on_the_named_host(self) -> None:
        cluster = build({"gpu-a": [GTX], "gpu-b": [A100]})
        refusal = refused(
            feasible(demand(models=(A100,), host="gpu-a"), cluster), ErrorCode.UNSATISFIABLE
        )
        assert "on gpu-a" in refusal.message and GTX in refusal.message

    def test_count_too_large_for_the_named_host(self) -> None:
        cluster = build({"gpu-a": [GTX], "gpu-b": [GTX] * 4})
        refusal = refused(feasible(demand(count=2, host="gpu-a"), cluster), ErrorCode.UNSATISFIABLE)
        assert refusal.message.startswith("Host gpu-a does not have 2 GPUs")

    def test_no_gpus_at_all(self) -> None:
        refused(feasible(demand(), build({"a": []})), ErrorCode.UNSATISFIABLE)

    def test_unknown_host(self) -> None:
        refused(feasible(demand(host="zz"), build({"a": [GTX]})), ErrorCode.UNKNOWN_HOST)

    def test_ignores_claims_health_drain_and_down_nodes(self) -> None:
        cluster = build(
            {"a": [(GTX, {"health": Health.UNHEALTHY}), (GTX, {"drained": True})]},
            drained=True,
        )
        occupy(cluster, "GPU-a-0")
        cluster.nodes["a"].last_heartbeat = None
        assert feasible(demand(count=2), cluster) is None
        assert feasible(demand(count=None), cluster) is None

    def test_gpus_no_longer_present_do_not_count(self) -> None:
        cluster = build({"a": [GTX, (GTX, {"present": False})]})
        refused(feasible(demand(count=2), cluster), ErrorCode.UNSATISFIABLE)

    def test_slice_of_exclusive_only_gpus(self) -> None:
        refusal = refused(
            feasible(demand(shared=True, models=(A100,)), build({"a": [A100]})),
            ErrorCode.UNSATISFIABLE,
        )
        assert "exclusive only" in refusal.message

    def test_slice_budget_larger_than_every_shareable_gpu(self) -> None:
        cluster = build({"a": [GTX, V100, A100]})
        refusal = refused(
            feasible(demand(shared=True, share_memory_mib=20000), cluster),
            ErrorCode.UNSATISFIABLE,
        )
        assert "16384 MiB" in refusal.message
        assert feasible(demand(shared=True, share_memory_mib=16000), cluster) is None


# --------------------------------------------------------------------------- place: exclusive


class TestPlaceExclusive:
    def test_best_fit_prefers_the_host_with_fewest_free_gpus(self) -> None:
        cluster = build({"gpu-a": [GTX] * 4, "gpu-b": [GTX] * 2, "gpu-c": [GTX] * 3})
        assert placed(place(demand(), cluster, NOW, DOWN)).host == "gpu-b"

    def test_free_count_includes_gpus_of_other_models(self) -> None:
        # gpu-a has 1 GTX but 3 free GPUs in all; gpu-b has only its 2 GTX free.
        cluster = build({"gpu-a": [GTX, A100, A100], "gpu-b": [GTX, GTX]})
        assert placed(place(demand(models=(GTX,)), cluster, NOW, DOWN)).host == "gpu-b"

    def test_ties_go_to_the_first_host_name_and_lowest_indices(self) -> None:
        cluster = build({"gpu-b": [GTX] * 3, "gpu-a": [GTX] * 3})
        occupy(cluster, "GPU-gpu-a-0")
        occupy(cluster, "GPU-gpu-b-1")
        got = placed(place(demand(count=2), cluster, NOW, DOWN))
        assert got.host == "gpu-a"
        assert got.gpu_uuids == ("GPU-gpu-a-1", "GPU-gpu-a-2")
        assert got.units == 2 and not got.shared and got.memory_mib is None

    def test_busy_gpus_shift_the_best_fit(self) -> None:
        cluster = build({"gpu-a": [GTX] * 4, "gpu-b": [GTX] * 2})
        occupy(cluster, "GPU-gpu-a-0")
        occupy(cluster, "GPU-gpu-a-1")
        occupy(cluster, "GPU-gpu-a-2")
        assert placed(place(demand(), cluster, NOW, DOWN)).host == "gpu-a"

    def test_all_gpus_of_one_lease_are_on_one_host(self) -> None:
        cluster = build({"gpu-a": [GTX] * 2, "gpu-b": [GTX]})
        refusal = refused(place(demand(count=3), cluster, NOW, DOWN), ErrorCode.UNSATISFIABLE)
        assert f"largest has 2 of {GTX} (gpu-a)" in refusal.message
        occupy(cluster, "GPU-gpu-a-0")
        refused(place(demand(count=2), cluster, NOW, DOWN), ErrorCode.NO_CAPACITY)

    def test_one_model_per_lease_even_without_a_model_filter(self) -> None:
        cluster = build({"a": [GTX, A100, GTX]})
        got = placed(place(demand(count=2), cluster, NOW, DOWN))
        assert got.gpu_uuids == ("GPU-a-0", "GPU-a-2")
        refused(place(demand(count=3), cluster, NOW, DOWN), ErrorCode.UNSATISFIABLE)

    def test_first_model_in_preference_order_that_fits_anywhere_wins(self) -> None:
        # The A100 host is a worse fit, but A100 comes first in the preferences.
        cluster = build({"gpu-a": [A100] * 4, "gpu-b": [GTX]})
        got = placed(place(demand(models=(A100, GTX)), cluster, NOW, DOWN))
        assert got.host == "gpu-a"
        for uuid in cluster.nodes["gpu-a"].gpu_uuids:
            occupy(cluster, uuid)
        assert placed(place(demand(models=(A100, GTX)), cluster, NOW, DOWN)).host == "gpu-b"

    def test_min_memory_filters_gpus(self) -> None:
        cluster = build({"a": [GTX, V100]})
        got = placed(place(demand(min_memory_mib=10000), cluster, NOW, DOWN))
        assert got.gpu_uuids == ("GPU-a-1",)

    def test_specific_host_only(self) -> None:
        cluster = build({"gpu-a": [GTX] * 4, "gpu-b": [GTX]})
        assert placed(place(demand(host="gpu-a"), cluster, NOW, DOWN)).host == "gpu-a"
        occupy(cluster, "GPU-gpu-b-0")
        refused(place(demand(host="gpu-b"), cluster, NOW, DOWN), ErrorCode.NO_CAPACITY)

    @pytest.mark.parametrize(
        "gpu_fields",
        [{"health": Health.UNHEALTHY}, {"drained": True}, {"present": False}],
        ids=["unhealthy", "drained", "not-present"],
    )
    def test_unplaceable_gpus_never_fit(self, gpu_fields: dict[str, Any]) -> None:
        cluster = build({"gpu-a": [(GTX, gpu_fields)], "gpu-b": [GTX, GTX]})
        assert placed(place(demand(), cluster, NOW, DOWN)).host == "gpu-b"
        assert isinstance(place(demand(host="gpu-a"), cluster, NOW, DOWN), Refusal)

    def test_down_node_never_fits(self) -> None:
        cluster = build({"gpu-a": [GTX], "gpu-b": [GTX, GTX]})
        cluster.nodes["gpu-a"].last_heartbeat = NOW - DOWN - 1
        assert placed(place(demand(), cluster, NOW, DOWN)).host == "gpu-b"
        refusal = refused(place(demand(host="gpu-a"), cluster, NOW, DOWN), ErrorCode.NO_CAPACITY)
        assert "not reporting" in refusal.message and refusal.details["host_up"] is False

    def test_node_that_never_reported_is_down(self) -> None:
        cluster = build({"gpu-a": [GTX]})
        cluster.nodes["gpu-a"].last_heartbeat = None
        refused(place(demand(), cluster, NOW, DOWN), ErrorCode.NO_CAPACITY)

    def test_heartbeat_exactly_at_the_limit_is_still_up(self) -> None:
        cluster = build({"gpu-a": [GTX]})
        cluster.nodes["gpu-a"].last_heartbeat = NOW - DOWN
        placed(place(demand(), cluster, NOW, DOWN))

    def test_drained_node_never_fits(self) -> None:
        cluster = build({"gpu-a": [GTX]})
        cluster.nodes["gpu-a"].drained = True
        refusal = refused(place(demand(host="gpu-a"), cluster, NOW, DOWN), ErrorCode.NO_CAPACITY)
        assert "drained" in refusal.message

    def test_a_slice_blocks_exclusive_use_of_its_gpu(self) -> None:
        cluster = build({"a": [GTX]})
        share(cluster, "GPU-a-0", 1024, "s1")
        refused(place(demand(), cluster, NOW, DOWN), ErrorCode.NO_CAPACITY)

    def test_exclusive_may_take_a_shareable_gpu(self) -> None:
        got = placed(place(demand(), build({"a": [GTX]}), NOW, DOWN))
        assert got.gpu_uuids == ("GPU-a-0",) and not got.shared


# --------------------------------------------------------------------------- place: "all"


class TestPlaceAll:
    def test_takes_every_gpu_of_the_host_mixing_models_without_a_filter(self) -> None:
        cluster = build({"a": [GTX, A100, GTX]})
        got = placed(place(demand(count=None), cluster, NOW, DOWN))
        assert got.gpu_uuids == ("GPU-a-0", "GPU-a-1", "GPU-a-2") and got.units == 3

    def test_with_a_model_filter_takes_only_that_model(self) -> None:
        cluster = build({"a": [GTX, A100, GTX]})
        occupy(cluster, "GPU-a-1")
        got = placed(place(demand(count=None, models=(GTX,)), cluster, NOW, DOWN))
        assert got.gpu_uuids == ("GPU-a-0", "GPU-a-2")

    def test_never_mixes_models_with_a_filter(self) -> None:
        cluster = build({"a": [GTX, A100]})
        got = placed(place(demand(count=None, models=(A100, GTX)), cluster, NOW, DOWN))
        assert got.gpu_uuids == ("GPU-a-1",)

    def test_one_busy_matching_gpu_blocks_the_host(self) -> None:
        cluster = build({"gpu-a": [GTX, GTX], "gpu-b": [GTX] * 4})
        occupy(cluster, "GPU-gpu-a-1")
        got = placed(place(demand(count=None), cluster, NOW, DOWN))
        assert got.host == "gpu-b" and len(got.gpu_uuids) == 4

    def test_unhealthy_matching_gpu_blocks_the_host(self) -> None:
        cluster = build({"a": [GTX, (GTX, {"health": Health.UNHEALTHY})]})
        refused(place(demand(count=None), cluster, NOW, DOWN), ErrorCode.NO_CAPACITY)

    def test_gpus_not_present_are_not_part_of_all(self) -> None:
        cluster = build({"a": [GTX, (GTX, {"present": False})]})
        assert placed(place(demand(count=None), cluster, NOW, DOWN)).gpu_uuids == ("GPU-a-0",)

    def test_min_memory_excludes_small_gpus_even_when_busy(self) -> None:
        cluster = build({"a": [GTX, V100, V100]})
        occupy(cluster, "GPU-a-0")
        got = placed(place(demand(count=None, min_memory_mib=10000), cluster, NOW, DOWN))
        assert got.gpu_uuids == ("GPU-a-1", "GPU-a-2")

    def test_best_fit_picks_the_smallest_whole_host(self) -> None:
        cluster = build({"gpu-a": [GTX] * 4, "gpu-b": [GTX] * 2, "gpu-c": [A100]})
        got = placed(place(demand(count=None, models=(GTX,)), cluster, NOW, DOWN))
        assert got.host == "gpu-b"

    def test_host_without_matching_gpu_does_not_fit(self) -> None:
        cluster = build({"gpu-a": [A100], "gpu-b": [GTX]})
        got = placed(place(demand(count=None, models=(GTX,)), cluster, NOW, DOWN))
        assert got.host == "gpu-b"

    def test_best_fit_for_single_gpus_keeps_whole_hosts_free(self) -> None:
        cluster = build({"gpu-a": [GTX] * 4, "gpu-b": [GTX] * 4})
        occupy(cluster, "GPU-gpu-b-0")
        grant(cluster, demand(), "one")
        got = placed(place(demand(count=None), cluster, NOW, DOWN))
        assert got.host == "gpu-a" and len(got.gpu_uuids) == 4


# --------------------------------------------------------------------------- place: slices


class TestPlaceShared:
    def test_default_budget_is_memory_divided_by_slots(self) -> None:
        cluster = build({"a": [GTX]})
        got = placed(place(demand(shared=True), cluster, NOW, DOWN))
        assert got.shared and got.memory_mib == 2048 and got.units == Fraction(1, 4)

    def test_slices_pack_onto_an_already_shared_gpu(self) -> None:
        cluster = build({"gpu-a": [GTX], "gpu-b": [GTX, GTX]})
        share(cluster, "GPU-gpu-b-1", 1024, "s1")
        got = placed(place(demand(shared=True, share_memory_mib=1024), cluster, NOW, DOWN))
        assert got.gpu_uuids == ("GPU-gpu-b-1",)

    def test_fewest_free_slots_first(self) -> None:
        cluster = build({"a": [GTX, GTX]})
        share(cluster, "GPU-a-0", 512, "s1")
        share(cluster, "GPU-a-1", 512, "s2")
        share(cluster, "GPU-a-1", 512, "s3")
        got = placed(place(demand(shared=True, share_memory_mib=512), cluster, NOW, DOWN))
        assert got.gpu_uuids == ("GPU-a-1",)

    def test_already_shared_gpu_beats_an_untouched_one_with_fewer_slots(self) -> None:
        cluster = build({"a": [(GTX, {"share_slots": 8}), (GTX, {"share_slots": 2})]})
        share(cluster, "GPU-a-0", 512, "s1")
        got = placed(place(demand(shared=True, share_memory_mib=512), cluster, NOW, DOWN))
        assert got.gpu_uuids == ("GPU-a-0",) and got.units == Fraction(1, 8)

    def test_slots_are_never_exceeded(self) -> None:
        cluster = build({"a": [GTX]})
        for i in range(4):
            grant(cluster, demand(shared=True, share_memory_mib=100), f"s{i}")
        refusal = refused(
            place(demand(shared=True, share_memory_mib=100), cluster, NOW, DOWN),
            ErrorCode.NO_CAPACITY,
        )
        assert refusal.details["free_slots"] == {}

    def test_budgets_never_exceed_the_gpu_memory(self) -> None:
        cluster = build({"a": [GTX]})
        grant(cluster, demand(shared=True, share_memory_mib=6000), "s1")
        refused(
            place(demand(shared=True, share_memory_mib=3000), cluster, NOW, DOWN),
            ErrorCode.NO_CAPACITY,
        )
        got = placed(place(demand(shared=True, share_memory_mib=2192), cluster, NOW, DOWN))
        assert got.memory_mib == 2192

    def test_exclusive_claim_blocks_slices(self) -> None:
        cluster = build({"a": [GTX]})
        occupy(cluster, "GPU-a-0")
        refused(place(demand(shared=True), cluster, NOW, DOWN), ErrorCode.NO_CAPACITY)

    def test_exclusive_only_gpus_never_take_slices(self) -> None:
        cluster = build({"a": [A100, GTX]})
        got = placed(place(demand(shared=True), cluster, NOW, DOWN))
        assert got.gpu_uuids == ("GPU-a-1",)

    def test_preference_order_and_min_memory_apply(self) -> None:
        cluster = build({"a": [GTX, V100]})
        got = placed(place(demand(shared=True, models=(V100, GTX)), cluster, NOW, DOWN))
        assert got.gpu_uuids == ("GPU-a-1",) and got.units == Fraction(1, 2)
        got = placed(place(demand(shared=True, min_memory_mib=10000), cluster, NOW, DOWN))
        assert got.gpu_uuids == ("GPU-a-1",)

    def test_unplaceable_gpu_never_takes_slices(self) -> None:
        cluster = build({"a": [(GTX, {"drained": True})]})
        refused(place(demand(shared=True), cluster, NOW, DOWN), ErrorCode.NO_CAPACITY)


# --------------------------------------------------------------------------- no capacity


class TestNoCapacity:
    def test_message_and_details_say_what_is_free_instead(self) -> None:
        cluster = build({"gpu-a": [GTX, GTX], "gpu-b": [A100], "gpu-c": [GTX]})
        occupy(cluster, "GPU-gpu-a-0")
        refusal = refused(
            place(demand(models=(GTX,), count=2), cluster, NOW, DOWN), ErrorCode.NO_CAPACITY
        )
        assert refusal.details["free"] == {A100: {"gpu-b": 1}, GTX: {"gpu-a": 1, "gpu-c": 1}}
        assert f"2 GPUs of {GTX}" in refusal.message
        assert f"{A100}: 1 on gpu-b" in refusal.message
        assert f"{GTX}: 1 on gpu-a, 1 on gpu-c" in refusal.message

    def test_nothing_free_anywhere(self) -> None:
        cluster = build({"a": [GTX]})
        occupy(cluster, "GPU-a-0")
        refusal = refused(place(demand(), cluster, NOW, DOWN), ErrorCode.NO_CAPACITY)
        assert "No GPU is free" in refusal.message and refusal.details["free"] == {}

    def test_free_gpus_on_down_or_drained_nodes_are_not_offered(self) -> None:
        cluster = build({"gpu-a": [GTX] * 2, "gpu-b": [GTX] * 2, "gpu-c": [GTX] * 2})
        cluster.nodes["gpu-a"].last_heartbeat = 0.0
        cluster.nodes["gpu-b"].drained = True
        occupy(cluster, "GPU-gpu-c-0")
        refusal = refused(place(demand(count=2), cluster, NOW, DOWN), ErrorCode.NO_CAPACITY)
        assert refusal.details["free"] == {GTX: {"gpu-c": 1}}

    def test_slice_refusal_lists_free_slices(self) -> None:
        cluster = build({"a": [GTX]})
        share(cluster, "GPU-a-0", 7000, "s1")
        refusal = refused(
            place(demand(shared=True, share_memory_mib=2000), cluster, NOW, DOWN),
            ErrorCode.NO_CAPACITY,
        )
        assert refusal.details["free_slots"] == {GTX: {"a": 3}}
        assert "Free slices now" in refusal.message

    def test_impossible_request_is_unsatisfiable_not_no_capacity(self) -> None:
        cluster = build({"a": [GTX]})
        occupy(cluster, "GPU-a-0")
        refused(place(demand(count=2), cluster, NOW, DOWN), ErrorCode.UNSATISFIABLE)

    def test_unknown_host(self) -> None:
        refused(place(demand(host="nope"), build({"a": [GTX]}), NOW, DOWN), ErrorCode.UNKNOWN_HOST)


# --------------------------------------------------------------------------- claims, env


def test_apply_placement_records_exclusive_claims_with_whole_memory() -> None:
    cluster = build({"a": [GTX, GTX]})
    d = demand(count=2, groups=("students",))
    placement = grant(cluster, d, "L1")
    for uuid in placement.gpu_uuids:
        assert cluster.claims_on(uuid) == [
            Claim("L1", "alice", ("students",), True, 8192, Fraction(1))
        ]


def test_apply_placement_records_a_slice_with_its_budget() -> None:
    cluster = build({"a": [GTX]})
    grant(cluster, demand(shared=True, share_memory_mib=3000), "L1")
    assert cluster.claims_on("GPU-a-0") == [Claim("L1", "alice", (), False, 3000, Fraction(1, 4))]
    assert cluster.free_slots(cluster.gpus["GPU-a-0"]) == 3


class TestLeaseEnv:
    def test_exclusive_gets_devices_lease_and_where(self) -> None:
        cluster = build({"a": [GTX, GTX]})
        placement = Placement("a", ("GPU-a-0", "GPU-a-1"), False, None, Fraction(2))
        assert lease_env(placement, cluster, "L1") == {
            "NVIDIA_VISIBLE_DEVICES": "GPU-a-0,GPU-a-1",
            "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
            "SWARM_GPU_LEASE": "L1",
            "SWARM_GPU_HOST": "a",
            "SWARM_GPU_GPU_COUNT": "2",
            "SWARM_GPU_MODEL": GTX,
            "SWARM_GPU_SHARED": "0",
        }

    def test_mixed_models_name_no_model(self) -> None:
        cluster = build({"a": [GTX, A100]})
        placement = Placement("a", ("GPU-a-0", "GPU-a-1"), False, None, Fraction(2))
        assert "SWARM_GPU_MODEL" not in lease_env(placement, cluster, "L1")

    def test_slice_gets_budget_and_framework_hints(self) -> None:
        cluster = build({"a": [GTX]})
        placement = Placement("a", ("GPU-a-0",), True, 2048, Fraction(1, 4))
        assert lease_env(placement, cluster, "L1") == {
            "NVIDIA_VISIBLE_DEVICES": "GPU-a-0",
            "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
            "SWARM_GPU_LEASE": "L1",
            "SWARM_GPU_HOST": "a",
            "SWARM_GPU_GPU_COUNT": "1",
            "SWARM_GPU_MODEL": GTX,
            "SWARM_GPU_SHARED": "1",
            "SWARM_GPU_MEMORY_LIMIT_MIB": "2048",
            "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.25",
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
            "TF_FORCE_GPU_ALLOW_GROWTH": "true",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
        }

    @pytest.mark.parametrize(
        ("budget", "fraction"),
        [(2730, "0.33"), (8191, "0.99"), (8192, "1.00"), (81, "0.00"), (4096, "0.50")],
    )
    def test_memory_fraction_is_rounded_down(self, budget: int, fraction: str) -> None:
        cluster = build({"a": [GTX]})
        placement = Placement("a", ("GPU-a-0",), True, budget, Fraction(1, 4))
        assert lease_env(placement, cluster, "L")["XLA_PYTHON_CLIENT_MEM_FRACTION"] == fraction


# --------------------------------------------------------------------------- quota


class TestQuota:
    def test_unlimited_by_default(self) -> None:
        cluster = build({"a": [GTX] * 8})
        grant(cluster, demand(count=8), "L1")
        assert check_quota(Fraction(64), "alice", [], cluster, PolicySettings()) is None

    def test_user_quota_counts_every_gpu_claim(self) -> None:
        cluster = build({"a": [GTX] * 4})
        grant(cluster, demand(count=2), "L1")
        limits = PolicySettings(user_quota={"alice": 3})
        assert check_quota(Fraction(1), "alice", [], cluster, limits) is None
        refusal = refused(
            check_quota(Fraction(2), "alice", [], cluster, limits), ErrorCode.QUOTA_EXCEEDED
        )
        assert refusal.message == (
            "User alice may hold 3 GPUs at once and holds 2; this request asks for 2 more."
        )
        assert refusal.details == {
            "scope": "user",
            "name": "alice",
            "limit": 3.0,
            "held": 2.0,
            "asked": 2.0,
        }

    def test_other_users_claims_do_not_count(self) -> None:
        cluster = build({"a": [GTX] * 4})
        grant(cluster, dataclasses.replace(demand(count=3), user="bob"), "L1")
        limits = PolicySettings(default_user_quota=1)
        assert check_quota(Fraction(1), "alice", [], cluster, limits) is None
        refused(check_quota(Fraction(1), "bob", [], cluster, limits), ErrorCode.QUOTA_EXCEEDED)

    def test_user_quota_overrides_the_default(self) -> None:
        limits = PolicySettings(default_user_quota=1, user_quota={"alice": 4})
        assert check_quota(Fraction(4), "alice", [], Cluster(), limits) is None
        refused(check_quota(Fraction(2), "bob", [], Cluster(), limits), ErrorCode.QUOTA_EXCEEDED)

    def test_slices_count_fractions_and_a_third_quota_is_exact(self) -> None:
        cluster = build({"a": [(GTX, {"share_slots": 3})]})
        limits = PolicySettings(default_user_quota=1 / 3)
        assert check_quota(Fraction(1, 3), "alice", [], cluster, limits) is None
        grant(cluster, demand(shared=True, share_memory_mib=100), "s1")
        refusal = refused(
            check_quota(Fraction(1, 3), "alice", [], cluster, limits), ErrorCode.QUOTA_EXCEEDED
        )
        assert "may hold 0.333 GPUs" in refusal.message and "holds 0.333" in refusal.message

    def test_group_quota_sums_over_members(self) -> None:
        cluster = build({"a": [GTX] * 4})
        grant(cluster, demand(user="bob", groups=("students",)), "L1")
        grant(cluster, demand(user="carol", groups=("students", "lab")), "L2")
        limits = PolicySettings(group_quota={"students": 3, "lab": 1})
        assert check_quota(Fraction(1), "alice", ["students"], cluster, limits) is None
        refusal = refused(
            check_quota(Fraction(2), "alice", ["students"], cluster, limits),
            ErrorCode.QUOTA_EXCEEDED,
        )
        assert refusal.message.startswith("Group students may hold 3 GPUs")
        assert refusal.details["held"] == 2.0
        refusal = refused(
            check_quota(Fraction(1), "alice", ["staff", "lab"], cluster, limits),
            ErrorCode.QUOTA_EXCEEDED,
        )
        assert refusal.details["name"] == "lab"

    def test_groups_without_a_quota_are_unlimited(self) -> None:
        limits = PolicySettings(group_quota={"students": 0})
        assert check_quota(Fraction(5), "alice", ["staff"], Cluster(), limits) is None
        refused(
            check_quota(Fraction(1), "alice", ["students"], Cluster(), limits),
            ErrorCode.QUOTA_EXCEEDED,
        )


def test_queue_order_is_priority_then_fifo_then_id() -> None:
    entries = [(0, 5.0, "c"), (10, 9.0, "d"), (0, 1.0, "b"), (0, 1.0, "a"), (-1, 0.0, "e")]
    ordered = sorted(entries, key=lambda e: queue_order_key(*e))
    assert [e[2] for e in ordered] == ["d", "a", "b", "c", "e"]


def test_summarize_models() -> None:
    cluster = build(
        {
            "gpu-a": [GTX, GTX, A100],
            "gpu-b": [GTX, (GTX, {"health": Health.UNHEALTHY}), (V100, {"present": False})],
            "gpu-c": [GTX],
        }
    )
    cluster.nodes["gpu-c"].drained = True
    occupy(cluster, "GPU-gpu-a-0")
    share(cluster, "GPU-gpu-b-0", 1000, "s1")
    got = {s.model: s for s in summarize_models(cluster, SETTINGS, NOW, DOWN)}
    assert list(got) == [A100, GTX]  # sorted; V100 is no longer present
    gtx = got[GTX]
    assert gtx.aliases == ["1070"] and gtx.memory_total_mib == 8192
    assert (gtx.total, gtx.free, gtx.share_slots) == (5, 1, 4)
    assert gtx.free_slots == 4 + 3  # a-1 untouched, b-0 with one slice
    assert gtx.hosts == {"gpu-a": 1, "gpu-b": 0, "gpu-c": 0}
    a100 = got[A100]
    assert (a100.total, a100.free, a100.share_slots, a100.free_slots) == (1, 1, 1, 1)
    assert a100.aliases == ["a100"] and a100.hosts == {"gpu-a": 1}


# --------------------------------------------------------------------------- properties

MODEL_POOL = ("M-a", "M-b", "M-c")
POOL_MEM = {"M-a": 4000, "M-b": 8000, "M-c": 16000}
POOL_SLOTS = {"M-a": 4, "M-b": 2, "M-c": 1}
HOSTS = ("h0", "h1", "h2")


def _rarely(draw: st.DrawFn) -> bool:
    return draw(st.integers(0, 7)) == 0


@st.composite
def clusters(draw: st.DrawFn) -> Cluster:
    cluster = Cluster()
    for host in HOSTS[: draw(st.integers(1, len(HOSTS)))]:
        node = Node(host=host, last_heartbeat=NOW - DOWN - 1 if _rarely(draw) else NOW)
        node.drained = _rarely(draw)
        cluster.nodes[host] = node
        for index in range(draw(st.integers(0, 4))):
            model = draw(st.sampled_from(MODEL_POOL))
            gpu = GPU(
                uuid=f"{host}-{index}",
                host=host,
                index=index,
                model=model,
                memory_total_mib=POOL_MEM[model] * draw(st.sampled_from((1, 1, 2))),
                share_slots=POOL_SLOTS[model] if not _rarely(draw) else 3,
                health=Health.UNHEALTHY if _rarely(draw) else Health.HEALTHY,
                drained=_rarely(draw),
                present=not _rarely(draw),
            )
            cluster.gpus[gpu.uuid] = gpu
            node.gpu_uuids.append(gpu.uuid)
    return cluster


@st.composite
def demands(draw: st.DrawFn) -> Demand:
    shared = draw(st.booleans())
    models = draw(
        st.none() | st.lists(st.sampled_from(MODEL_POOL), min_size=1, max_size=3, unique=True)
    )
    return Demand(
        user=draw(st.sampled_from(("u1", "u2"))),
        groups=draw(st.sampled_from(((), ("g",)))),
        models=tuple(models) if models is not None else None,
        min_memory_mib=draw(st.none() | st.sampled_from((3000, 8000, 20000))),
        count=1 if shared else draw(st.none() | st.integers(1, 4)),
        host=draw(st.none() | st.sampled_from(HOSTS)),
        shared=shared,
        share_memory_mib=draw(st.none() | st.sampled_from((1000, 2500, 5000, 40000)))
        if shared
        else None,
    )


def _usable(cluster: Cluster, host: str) -> bool:
    node = cluster.nodes.get(host)
    return node is not None and node.is_up(NOW, DOWN) and not node.drained


def _host_free(cluster: Cluster, host: str) -> int:
    return sum(1 for g in cluster.gpus_of(host) if g.placeable and not cluster.claims_on(g.uuid))


def _mem_ok(d: Demand, gpu: GPU) -> bool:
    return d.min_memory_mib is None or gpu.memory_total_mib >= d.min_memory_mib


def _slice_ok(d: Demand, cluster: Cluster, gpu: GPU) -> bool:
    """Brute force, straight from the rules: could one more slice go on this GPU?"""
    claims = cluster.claims_on(gpu.uuid)
    budget = (
        d.share_memory_mib
        if d.share_memory_mib is not None
        else (gpu.memory_total_mib // gpu.share_slots)
    )
    return (
        gpu.placeable
        and gpu.share_slots > 1
        and not any(c.exclusive for c in claims)
        and len(claims) < gpu.share_slots
        and budget >= 1
        and sum(c.memory_mib for c in claims) + budget <= gpu.memory_total_mib
    )


def brute_force_fits(d: Demand, cluster: Cluster) -> bool:
    """Whether any placement exists, by trying every host and model."""
    for host in [d.host] if d.host is not None else list(cluster.nodes):
        if not _usable(cluster, host):
            continue
        gpus = cluster.gpus_of(host)
        allowed = d.models if d.models is not None else tuple({g.model for g in gpus})
        if d.shared:
            if any(g.model in allowed and _mem_ok(d, g) and _slice_ok(d, cluster, g) for g in gpus):
                return True
        elif d.count is None:
            groups = (
                [[g for g in gpus if g.model == m] for m in allowed]
                if d.models is not None
                else [list(gpus)]
            )
            for group in groups:
                wanted = [g for g in group if g.present and _mem_ok(d, g)]
                if wanted and all(g.placeable and not cluster.claims_on(g.uuid) for g in wanted):
                    return True
        else:
            for m in allowed:
                free = [
                    g
                    for g in gpus
                    if g.model == m
                    and g.placeable
                    and _mem_ok(d, g)
                    and not cluster.claims_on(g.uuid)
                ]
                if len(free) >= d.count:
                    return True
    return False


def brute_force_free(cluster: Cluster) -> dict[str, dict[str, int]]:
    """{model: {host: unclaimed placeable GPUs on an up, undrained node}}, non-zero only."""
    free: dict[str, dict[str, int]] = {}
    for gpu in cluster.gpus.values():
        if gpu.placeable and _usable(cluster, gpu.host) and not cluster.claims_on(gpu.uuid):
            per_host = free.setdefault(gpu.model, {})
            per_host[gpu.host] = per_host.get(gpu.host, 0) + 1
    return free


def check_invariants(cluster: Cluster, leases: dict[str, Placement]) -> None:
    for uuid, claims in cluster.claims.items():
        gpu = cluster.gpus[uuid]
        assert claims, "empty claim lists are dropped"
        if any(c.exclusive for c in claims):
            assert len(claims) == 1, "an exclusive claim shares its GPU"
        else:
            assert len(claims) <= gpu.share_slots, "more slices than slots"
        assert sum(c.memory_mib for c in claims) <= gpu.memory_total_mib, "budgets > memory"
    for placement in leases.values():
        assert len({cluster.gpus[u].host for u in placement.gpu_uuids}) == 1


def check_placement(d: Demand, cluster: Cluster, p: Placement) -> None:
    """A fresh placement obeys the rules and the best-fit order."""
    gpus = [cluster.gpus[u] for u in p.gpu_uuids]
    assert gpus and all(g.host == p.host for g in gpus)
    assert [g.index for g in gpus] == sorted(g.index for g in gpus)
    assert _usable(cluster, p.host) and (d.host is None or p.host == d.host)
    assert all(g.placeable and _mem_ok(d, g) for g in gpus)
    if d.models is not None:
        assert all(g.model in d.models for g in gpus)
    if d.models is not None or d.count is not None:
        assert len({g.model for g in gpus}) == 1
    if d.shared:
        assert len(gpus) == 1 and _slice_ok(d, cluster, gpus[0])
        assert p.units == Fraction(1, gpus[0].share_slots)
        return
    assert all(not cluster.claims_on(g.uuid) for g in gpus)
    assert p.units == len(gpus)
    if d.count is not None:
        assert len(gpus) == d.count
    model = gpus[0].model
    if d.models is not None:
        # Earlier preferences did not fit anywhere.
        for earlier in d.models[: d.models.index(model)]:
            assert not brute_force_fits(dataclasses.replace(d, models=(earlier,)), cluster)
        # No other host fits the chosen model with fewer free GPUs (ties by name).
        for host in [d.host] if d.host is not None else list(cluster.nodes):
            if brute_force_fits(dataclasses.replace(d, models=(model,), host=host), cluster):
                assert (_host_free(cluster, p.host), p.host) <= (_host_free(cluster, host), host)


def idle_copy(cluster: Cluster) -> Cluster:
    """The same hardware with nothing claimed, everything healthy, undrained and up."""
    idle = Cluster()
    for host, node in cluster.nodes.items():
        idle.nodes[host] = dataclasses.replace(
            node, last_heartbeat=NOW, drained=False, gpu_uuids=list(node.gpu_uuids)
        )
    for uuid, gpu in cluster.gpus.items():
        idle.gpus[uuid] = dataclasses.replace(gpu, health=Health.HEALTHY, drained=False)
    return idle


Op = tuple[str, Any]
ops = st.lists(
    st.one_of(
        demands().map(lambda d: ("place", d)),
        st.integers(0, 1000).map(lambda i: ("release", i)),
    ),
    max_size=12,
)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cluster=clusters(), steps=ops)
def test_random_sequences_keep_invariants_and_place_whenever_possible(
    cluster: Cluster, steps: list[Op]
) -> None:
    leases: dict[str, Placement] = {}
    for number, (kind, arg) in enumerate(steps):
        if kind == "release":
            if leases:
                lease_id = sorted(leases)[arg % len(leases)]
                cluster.drop_claims(lease_id, list(leases.pop(lease_id).gpu_uuids))
        else:
            d: Demand = arg
            result = place(d, cluster, NOW, DOWN)
            assert isinstance(result, Placement) == brute_force_fits(d, cluster), result
            if isinstance(result, Placement):
                check_placement(d, cluster, result)
                assert feasible(d, cluster) is None
                lease_id = f"L{number}"
                apply_placement(cluster, result, lease_id, d)
                leases[lease_id] = result
            else:
                assert result.code in (
                    ErrorCode.NO_CAPACITY,
                    ErrorCode.UNSATISFIABLE,
                    ErrorCode.UNKNOWN_HOST,
                )
                assert result.message
                if result.code is ErrorCode.NO_CAPACITY:
                    assert feasible(d, cluster) is None
                    assert result.details["free"] == brute_force_free(cluster)
        check_invariants(cluster, leases)


@settings(max_examples=250, deadline=None)
@given(cluster=clusters(), d=demands())
def test_feasible_exactly_when_an_idle_cluster_could_place_it(cluster: Cluster, d: Demand) -> None:
    refusal = feasible(d, cluster)
    possible = brute_force_fits(d, idle_copy(cluster))
    assert (refusal is None) == possible, refusal
    if refusal is not None:
        assert refusal.code in (ErrorCode.UNSATISFIABLE, ErrorCode.UNKNOWN_HOST)


@settings(max_examples=150, deadline=None)
@given(cluster=clusters(), steps=st.lists(demands(), max_size=4))
def test_summary_counts_match_brute_force(cluster: Cluster, steps: list[Demand]) -> None:
    for number, d in enumerate(steps):
        result = place(d, cluster, NOW, DOWN)
        if isinstance(result, Placement):
            apply_placement(cluster, result, f"L{number}", d)
    summaries = summarize_models(cluster, PolicySettings(), NOW, DOWN)
    free = {s.model: {h: n for h, n in s.hosts.items() if n} for s in summaries if s.free}
    assert free == brute_force_free(cluster)
    for s in summaries:
        gpus = [g for g in cluster.gpus.values() if g.model == s.model and g.present]
        assert s.total == len(gpus) and s.free == sum(s.hosts.values())
        assert s.free_slots == sum(
            cluster.free_slots(g) for g in gpus if g.placeable and _usable(cluster, g.host)
        )
