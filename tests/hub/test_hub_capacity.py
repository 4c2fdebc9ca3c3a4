"""One capacity rule (allocator.wire.capacity) for the hub and the allocator: how many GPUs of one
request one host can give. The hub's early refusal and the policy's answer agree.

Pure, no services: the policy over a :class:`Cluster`, the hub over the inventory reply the
allocator would send for that cluster.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.config import PolicySettings
from allocator.placement.cluster import GPU, Cluster, Node
from allocator.placement.demand import Placement, Refusal, make_demand
from allocator.placement.model_summary import summarize_models
from allocator.placement.policy import place
from allocator.wire.capacity import GPUGroup, fits_count, gpu_groups, largest_group, most_per_host
from allocator.wire.protocol import (
    MAX_COUNT,
    AllocateRequest,
    ErrorCode,
    GPUView,
    Health,
    InventoryReply,
    NodeView,
)
from hubplugin.options import (
    GPUMode,
    GPUOptions,
    GPUPermissions,
    OptionsError,
    build_allocate_request,
    check_options,
)
from tests.support.hub_inventory import A100, GTX1070, MEMORY, RTX3090

NOW = 10_000.0
DOWN = 15.0
ALIASES = {"1070": GTX1070, "3090": RTX3090, "a100": A100}
SETTINGS = PolicySettings(aliases=ALIASES)
MODELS = (GTX1070, RTX3090, A100)
ANYTHING = GPUPermissions(allowed_models=None, max_gpus=MAX_COUNT)
BOTH = GPUPermissions(allowed_models=["1070", "3090"], max_gpus=MAX_COUNT, groups=["ml"])
MIXED = {"gpu-m": [GTX1070, RTX3090], "gpu-x": [A100]}
"""gpu-m: one GTX 1070 and one RTX 3090; gpu-x: an A100 none of the BOTH users may use."""


def build(hosts: dict[str, list[str]]) -> Cluster:
    """A cluster of up nodes with healthy, idle GPUs of the given models."""
    cluster = Cluster()
    for host, models in hosts.items():
        node = Node(host=host, last_heartbeat=NOW)
        cluster.nodes[host] = node
        for index, model in enumerate(models):
            gpu = GPU(uuid=f"GPU-{host}-{index}", host=host, index=index, model=model,
                      memory_total_mib=MEMORY[model])
            cluster.gpus[gpu.uuid] = gpu
            node.gpu_uuids.append(gpu.uuid)
    return cluster


def inventory_of(cluster: Cluster) -> InventoryReply:
    """The inventory reply the allocator sends for this cluster (as its engine's views do)."""
    nodes = [NodeView(host=n.host, up=True, drained=False, last_heartbeat=NOW,
                      gpus=len(n.gpu_uuids)) for n in sorted(cluster.nodes.values(),
                                                              key=lambda n: n.host)]
    gpus = [GPUView(uuid=g.uuid, host=g.host, index=g.index, model=g.model,
                    memory_total_mib=g.memory_total_mib, memory_used_mib=0,
                    health=Health.HEALTHY, share_slots=g.share_slots, free_slots=g.share_slots,
                    free_memory_mib=g.memory_total_mib)
            for g in sorted(cluster.gpus.values(), key=lambda g: (g.host, g.index))]
    return InventoryReply(at=NOW, nodes=nodes, gpus=gpus, queued=0,
                          models=summarize_models(cluster, SETTINGS, NOW, DOWN))


def policy_answer(request: AllocateRequest, cluster: Cluster) -> Placement | Refusal:
    """The allocator's answer to ``request`` on ``cluster``: a placement, or why not."""
    demand = make_demand(request, cluster, SETTINGS)
    if isinstance(demand, Refusal):
        return demand
    return place(demand, cluster, NOW, DOWN)


def wire(**fields: Any) -> AllocateRequest:
    return AllocateRequest(request_key="hub/alice/", user="alice", **fields)


def hub_refusal(options: GPUOptions, permissions: GPUPermissions,
                inventory: InventoryReply) -> str | None:
    """The hub's refusal of a choice, or None when it would ask the allocator."""
    try:
        check_options(options, permissions, inventory)
    except OptionsError as exc:
        return str(exc)
    return None


# ---------------------------------------------------------------------- the rule itself


def test_a_count_is_of_one_model_and_all_of_any_model_mixes() -> None:
    gpus = [("a", GTX1070), ("a", RTX3090), ("b", A100), ("b", A100)]
    assert gpu_groups(gpus) == [GPUGroup("b", A100, 2), GPUGroup("a", GTX1070, 1),
                                GPUGroup("a", RTX3090, 1)]
    assert most_per_host(gpu_groups(gpus)) == {"a": 1, "b": 2}
    # "all GPUs of a host" mixes models only when the request accepts any model
    assert most_per_host(gpu_groups(gpus, all_of_host=True)) == {"a": 1, "b": 2}
    mixed = gpu_groups(gpus, all_of_host=True, any_model=True)
    assert mixed == [GPUGroup("a", None, 2), GPUGroup("b", None, 2)]
    assert largest_group(mixed) == GPUGroup("a", None, 2)
    assert fits_count(2, gpu_groups(gpus)) and not fits_count(3, gpu_groups(gpus))
    assert largest_group([]) is None and not fits_count(1, [])


# ------------------------------------------------ a host of two models: the disagreement


@pytest.mark.parametrize("host", [None, "gpu-m"])
@pytest.mark.parametrize(
    ("permissions", "models"),
    [(ANYTHING, None), (BOTH, [GTX1070, RTX3090])],
    ids=["any-model", "a-list-of-both"],
)
def test_two_gpus_of_two_models_on_one_host_are_no_count_of_two(
    permissions: GPUPermissions, models: list[str] | None, host: str | None
) -> None:
    cluster = build({"gpu-m": [GTX1070, RTX3090]})
    options = GPUOptions(mode=GPUMode.EXCLUSIVE, count=2, host=host)
    refused = hub_refusal(options, permissions, inventory_of(cluster))
    answer = policy_answer(wire(models=models, count=2, host=host), cluster)
    # both refuse, and both as "could never fit", not as "busy now"
    assert refused is not None
    assert isinstance(answer, Refusal) and answer.code is ErrorCode.UNSATISFIABLE, answer
    where = "Host 'gpu-m' has only" if host else "No host has more than"
    assert refused == (
        f"{where} 1 GPU of one model (any model you may use); you asked for 2. "
        "The GPUs of one server are all of one model."
    )
    # one GPU is fine for both
    one = options.model_copy(update={"count": 1})
    assert hub_refusal(one, permissions, inventory_of(cluster)) is None
    assert isinstance(policy_answer(wire(models=models, count=1, host=host), cluster), Placement)


def test_a_count_of_one_model_a_host_holds_is_still_accepted() -> None:
    cluster = build({"gpu-m": [GTX1070, RTX3090, RTX3090]})
    options = GPUOptions(mode=GPUMode.EXCLUSIVE, count=2)
    assert hub_refusal(options, BOTH, inventory_of(cluster)) is None
    answer = policy_answer(wire(models=[GTX1070, RTX3090], count=2), cluster)
    assert isinstance(answer, Placement) and answer.host == "gpu-m"


def test_all_gpus_of_a_host_mixes_models_only_when_any_model_is_accepted() -> None:
    cluster = build(MIXED)
    inventory = inventory_of(cluster)
    everything = GPUOptions(mode=GPUMode.EXCLUSIVE, all_gpus_of_host=True, host="gpu-m")
    # any model: "all" of gpu-m is both GPUs, beyond a limit of 1 ...
    limited = ANYTHING.model_copy(update={"max_gpus": 1})
    refused = hub_refusal(everything, limited, inventory)
    assert refused is not None and "could give you 2 GPUs, more than your limit of 1" in refused
    answer = policy_answer(wire(count="all", host="gpu-m"), cluster)
    assert isinstance(answer, Placement) and len(answer.gpu_uuids) == 2
    # ... a list of models gets the GPUs of one of them: one GPU, within the limit
    listed = BOTH.model_copy(update={"max_gpus": 1})
    assert hub_refusal(everything, listed, inventory) is None
    answer = policy_answer(wire(models=[GTX1070, RTX3090], count="all", host="gpu-m"), cluster)
    assert isinstance(answer, Placement) and len(answer.gpu_uuids) == 1


# -------------------------------------------------------------------------- the property


@st.composite
def cases(draw: st.DrawFn) -> tuple[dict[str, list[str]], GPUPermissions, GPUOptions,
                                    AllocateRequest]:
    """A small cluster, a user's permissions and exclusive choice, and the request the hub
    would send for it (what the policy answers)."""
    hosts = draw(st.dictionaries(
        st.sampled_from(["h0", "h1", "h2"]),
        st.lists(st.sampled_from(MODELS), max_size=3), min_size=1))
    present = sorted({m for models in hosts.values() for m in models})
    if not present:
        # Nothing reported at all: the hub leaves that to the allocator's own words.
        hosts[next(iter(hosts))] = [draw(st.sampled_from(MODELS))]
        present = sorted({m for models in hosts.values() for m in models})
    spellings = {m: [m, *(a for a, target in ALIASES.items() if target == m)] for m in MODELS}
    kind = draw(st.sampled_from(["any", "model", "list"]))
    count: int | str = draw(st.one_of(st.integers(1, 4), st.just("all")))
    host = draw(st.one_of(st.none(), st.sampled_from(sorted(hosts))))
    choice: dict[str, Any] = {"mode": GPUMode.EXCLUSIVE, "host": host}
    if count == "all":
        choice["all_gpus_of_host"] = True
    else:
        choice["count"] = count
    allowed: list[str] | None = None
    model: str | None = None
    models: list[str] | None = None
    if kind == "model":
        model = draw(st.sampled_from(present))
        choice["model"] = draw(st.sampled_from(spellings[model]))
    elif kind == "list":
        models = draw(st.lists(st.sampled_from(present), min_size=1, unique=True))
        allowed = [draw(st.sampled_from(spellings[m])) for m in models]
    permissions = GPUPermissions(allowed_models=allowed, max_gpus=MAX_COUNT)
    request = wire(model=model, models=models, count=count, host=host)
    return hosts, permissions, GPUOptions(**choice), request


@settings(max_examples=300, deadline=None)
@given(cases())
def test_the_hub_refuses_on_capacity_exactly_what_the_policy_refuses(
    case: tuple[dict[str, list[str]], GPUPermissions, GPUOptions, AllocateRequest],
) -> None:
    hosts, permissions, options, request = case
    cluster = build(hosts)
    inventory = inventory_of(cluster)
    try:
        checked = check_options(options, permissions, inventory)
        hub: str | None = None
    except OptionsError as exc:
        checked, hub = None, str(exc)
    answer = policy_answer(request, cluster)
    # An empty cluster: whatever could ever fit fits now, so the policy places it.
    assert (hub is None) == isinstance(answer, Placement), (hosts, options, hub, answer)
    if checked is not None:
        # comparable: the hub asks the allocator exactly what the policy was asked
        sent = build_allocate_request(checked, hub_id="hub", user="alice")
        assert sent.what_is_asked() == request.what_is_asked()
