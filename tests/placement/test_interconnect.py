"""Topology-aware choice of GPUs within one host (allocator.wire.interconnect,
allocator.placement.gpu_sets): examples on the three host builders, a demanded level refused in
words, bad input refused, and properties against brute force over random small hosts."""

from __future__ import annotations

from itertools import combinations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from allocator.placement.gpu_sets import (
    DEMANDED_LEVEL,
    GpuSet,
    TopologyDemand,
    Unmet,
    choose_gpus,
    leftover_score,
    numa_nodes,
    set_cost,
    visible_order,
)
from allocator.wire.interconnect import (
    GpuLink,
    HostGpu,
    HostInterconnect,
    LinkLevel,
    build_interconnect,
    hgx_host,
    nvlink_pairs_host,
    pcie_two_socket_host,
)


def chosen(result: GpuSet | Unmet) -> GpuSet:
    assert isinstance(result, GpuSet), result
    return result


def gpus_at(host: HostInterconnect, *indices: int) -> list[str]:
    return [host.uuids[i] for i in indices]


# ----------------------------------------------------------------------------- examples


def test_hgx_every_set_is_nvlink_and_spans_one_numa_node_when_it_can() -> None:
    host = hgx_host()
    grant = chosen(choose_gpus(host, host.uuids, 4, "nvlink"))
    assert grant.worst_level is LinkLevel.NVLINK
    # All sets are equally joined; the lowest indices win, all on NUMA node 0.
    assert grant.gpus == tuple(gpus_at(host, 0, 1, 2, 3))
    assert grant.numa_nodes == (0,)


def test_pcie_host_pair_shares_a_switch_and_four_share_a_socket() -> None:
    host = pcie_two_socket_host()
    free = gpus_at(host, 1, 2, 3, 4, 6, 7)
    pair = chosen(choose_gpus(host, free, 2))
    assert pair.worst_level is LinkLevel.SINGLE
    # 2-3 and 6-7 share a switch; taking 6-7 would leave no whole socket of four.
    assert pair.gpus == tuple(gpus_at(host, 2, 3))
    four = chosen(choose_gpus(host, gpus_at(host, *range(8)), 4))
    assert four.worst_level is LinkLevel.NODE
    assert four.numa_nodes == (0,)


def test_pcie_host_prefers_across_sockets_to_nothing() -> None:
    host = pcie_two_socket_host()
    grant = chosen(choose_gpus(host, gpus_at(host, 0, 4), 2))
    assert grant.worst_level is LinkLevel.SYSTEM
    assert grant.numa_nodes == (0, 1)


def test_single_gpu_request_keeps_the_nvlink_pair_whole() -> None:
    host = nvlink_pairs_host()
    # GPU 3 is busy, 0-1 are a free NVLink pair: the one GPU goes to 2, not to index 0.
    grant = chosen(choose_gpus(host, gpus_at(host, 0, 1, 2), 1))
    assert grant.gpus == (host.uuids[2],)
    assert grant.worst_level is None
    pair = chosen(choose_gpus(host, gpus_at(host, 0, 1), 2, "nvlink"))
    assert pair.worst_level is LinkLevel.NVLINK


def test_a_demanded_level_that_cannot_be_met_is_refused_in_words() -> None:
    host = nvlink_pairs_host()
    result = choose_gpus(host, gpus_at(host, 0, 2), 2, "nvlink")
    assert isinstance(result, Unmet)
    assert "no 2 of the 2 free GPUs are all joined by NVLink" in result.reason
    assert 'topology = "nvlink"' in result.reason
    assert "a PCIe host bridge" in result.reason


def test_too_few_free_gpus_is_unmet() -> None:
    host = hgx_host()
    result = choose_gpus(host, gpus_at(host, 0, 1), 3)
    assert result == Unmet("3 GPUs asked, 2 free on the host")


def test_visible_order_puts_linked_gpus_side_by_side() -> None:
    host = pcie_two_socket_host()
    order = visible_order(host, gpus_at(host, 4, 0, 5, 1))
    assert order == tuple(gpus_at(host, 0, 1, 4, 5))
    assert numa_nodes(host, order) == (0, 1)


def test_bad_input_is_refused_with_what_is_wrong() -> None:
    host = hgx_host()
    with pytest.raises(ValueError, match="GPUs not on this host: GPU-elsewhere"):
        choose_gpus(host, ["GPU-elsewhere"], 1)
    with pytest.raises(ValueError, match="at least one GPU"):
        choose_gpus(host, host.uuids, 0)
    with pytest.raises(ValueError, match="unknown topology"):
        choose_gpus(host, host.uuids, 2, "infiniband")  # type: ignore[arg-type]
    gpus = (HostGpu(uuid="a"), HostGpu(uuid="b"), HostGpu(uuid="c"))
    with pytest.raises(ValidationError, match="a-c has none"):
        HostInterconnect(gpus=gpus, links=(GpuLink(a="a", b="b", level=LinkLevel.SINGLE),
                                           GpuLink(a="b", b="c", level=LinkLevel.SINGLE)))
    with pytest.raises(ValidationError, match="at level NVLINK only"):
        GpuLink(a="a", b="b", level=LinkLevel.SINGLE, nvlinks=2)


# ----------------------------------------------------------------------------- properties

LEVELS = list(LinkLevel)


@st.composite
def small_hosts(draw: st.DrawFn) -> HostInterconnect:
    """A host of 2-7 GPUs with random links and NUMA nodes."""
    n = draw(st.integers(min_value=2, max_value=7))
    uuids = [f"GPU-{i}" for i in range(n)]
    links = {}
    for i in range(n):
        for j in range(i + 1, n):
            level = draw(st.sampled_from(LEVELS))
            links[(i, j)] = (level, draw(st.integers(1, 18)) if level is LinkLevel.NVLINK else 0)
    nodes = draw(st.lists(st.one_of(st.none(), st.integers(0, 1)), min_size=n, max_size=n))
    return build_interconnect(uuids, nodes, links)


@st.composite
def requests(draw: st.DrawFn) -> tuple[HostInterconnect, list[str], int, TopologyDemand | None]:
    host = draw(small_hosts())
    free = draw(st.lists(st.sampled_from(host.uuids), min_size=1, unique=True))
    count = draw(st.integers(min_value=1, max_value=len(free)))
    demand = draw(st.one_of(st.none(), st.sampled_from(sorted(DEMANDED_LEVEL))))
    return host, free, count, demand


@settings(max_examples=150, deadline=None)
@given(requests())
def test_no_better_connected_set_is_passed_over(
        case: tuple[HostInterconnect, list[str], int, TopologyDemand | None]) -> None:
    host, free, count, demand = case
    result = choose_gpus(host, free, count, demand)
    fitting = [c for c in combinations(free, count)
               if demand is None or count == 1
               or set_cost(host, c).worst <= DEMANDED_LEVEL[demand]]
    if not fitting:
        assert isinstance(result, Unmet)
        return
    grant = chosen(result)
    assert sorted(grant.gpus) == sorted(set(grant.gpus)) and set(grant.gpus) <= set(free)
    assert len(grant.gpus) == count
    assert set_cost(host, grant.gpus) == min(set_cost(host, c) for c in fitting)


@settings(max_examples=150, deadline=None)
@given(requests())
def test_a_demanded_level_is_never_broken(
        case: tuple[HostInterconnect, list[str], int, TopologyDemand | None]) -> None:
    host, free, count, demand = case
    result = choose_gpus(host, free, count, demand)
    if isinstance(result, GpuSet) and demand is not None:
        for a, b in combinations(result.gpus, 2):
            assert host.link(a, b).level <= DEMANDED_LEVEL[demand]


@settings(max_examples=150, deadline=None)
@given(small_hosts(), st.data())
def test_one_gpu_leaves_the_best_four_and_pair_any_choice_could(
        host: HostInterconnect, data: st.DataObject) -> None:
    free = data.draw(st.lists(st.sampled_from(host.uuids), min_size=1, unique=True))
    grant = chosen(choose_gpus(host, free, 1))
    left = leftover_score(host, [u for u in free if u not in grant.gpus])
    for other in free:
        assert left <= leftover_score(host, [u for u in free if u != other])
