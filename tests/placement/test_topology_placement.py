"""Placement by links (allocator.placement.policy with allocator.placement.gpu_sets): the
best-connected set on the chosen host, a demanded level never broken, hosts without reported links
placed exactly as before, the placement index still exact, and the container's order and NUMA
hint."""

from __future__ import annotations

from collections.abc import Sequence
from fractions import Fraction
from itertools import combinations

from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.placement import policy
from allocator.placement.claims import apply_placement
from allocator.placement.cluster import GPU, Claim, Cluster, Node
from allocator.placement.container_env import lease_env
from allocator.placement.demand import Demand, Placement, Refusal
from allocator.placement.gpu_sets import DEMANDED_LEVEL, set_cost, visible_order, worst_link
from allocator.placement.index import PlacementIndex
from allocator.wire.interconnect import LinkLevel
from allocator.wire.protocol import ErrorCode
from nodeagent.simulated import TOPOLOGY_PRESETS, preset_interconnect

NOW = 1000.0
DOWN_AFTER = 10.0
MODELS = {"A": 81920, "B": 24576}
PRESET_GPUS = {"hgx": 8, "pcie-two-socket": 8, "nvlink-pairs": 4}


def add_host(cluster: Cluster, host: str, gpus: int, model: str = "A",
             preset: str | None = None, taken: Sequence[int] = ()) -> list[str]:
    """A host of ``gpus`` GPUs of ``model``, joined as ``preset`` (None: links not
    reported), GPUs ``taken`` held by an exclusive lease."""
    node = Node(host=host, last_heartbeat=NOW)
    cluster.nodes[host] = node
    for i in range(gpus):
        gpu = GPU(uuid=f"{host}-{i}", host=host, index=i, model=model,
                  memory_total_mib=MODELS[model])
        cluster.gpus[gpu.uuid] = gpu
        node.gpu_uuids.append(gpu.uuid)
        if i in taken:
            cluster.add_claim(gpu.uuid, Claim(lease_id=f"held-{host}-{i}", user="x", groups=(),
                                              exclusive=True, memory_mib=gpu.memory_total_mib,
                                              units=Fraction(1)))
    if preset is not None:
        node.interconnect = preset_interconnect(preset, node.gpu_uuids)  # type: ignore[arg-type]
    return node.gpu_uuids


def demand(count: int | None, topology: str | None = None, *, models: tuple[str, ...] | None
           = None) -> Demand:
    return Demand(user="u", groups=(), models=models, min_memory_mib=None, count=count,
                  host=None, shared=False, share_memory_mib=None,
                  topology=topology)  # type: ignore[arg-type]


def place(cluster: Cluster, wanted: Demand) -> Placement | Refusal:
    return policy.place(wanted, cluster, NOW, DOWN_AFTER)


# --------------------------------------------------------------------------- examples


def test_two_gpus_of_a_two_socket_host_share_a_pcie_switch():
    cluster = Cluster()
    add_host(cluster, "p", 8, preset="pcie-two-socket", taken=[0, 2])
    got = place(cluster, demand(2))
    assert isinstance(got, Placement)
    assert set(got.gpu_uuids) == {"p-4", "p-5"}  # 1 and 3 are on one socket, not one switch
    assert got.numa_nodes == (1,)


def test_one_gpu_leaves_the_last_nvlink_pair_whole():
    cluster = Cluster()
    add_host(cluster, "w", 4, preset="nvlink-pairs", taken=[0])
    got = place(cluster, demand(1))
    assert isinstance(got, Placement) and got.gpu_uuids == ("w-1",)


def test_the_same_host_by_index_without_links():
    cluster = Cluster()
    add_host(cluster, "w", 4, taken=[0])
    got = place(cluster, demand(1))
    assert isinstance(got, Placement) and got.gpu_uuids == ("w-1",)
    assert place(cluster, demand(2)).gpu_uuids == ("w-1", "w-2")  # type: ignore[union-attr]


def test_several_gpus_go_to_the_better_connected_host_of_the_first_candidates():
    """Best fit alone takes the fuller host "a", whose free GPUs span both sockets; "b" has
    a free switch pair and wins. A host without links counts as across sockets."""
    cluster = Cluster()
    add_host(cluster, "a", 8, preset="pcie-two-socket", taken=[0, 2, 5, 7, 1])  # 3, 4, 6 free
    add_host(cluster, "b", 8, preset="pcie-two-socket", taken=[0, 1, 2, 3])
    got = place(cluster, demand(2))
    assert isinstance(got, Placement) and got.host == "b"
    assert worst_link(cluster.nodes["b"].interconnect, got.gpu_uuids) is LinkLevel.SINGLE  # type: ignore[arg-type]
    one = place(cluster, demand(1))
    assert isinstance(one, Placement) and one.host == "a"  # one GPU: best fit only


def test_a_demanded_level_skips_hosts_that_cannot_keep_it():
    cluster = Cluster()
    add_host(cluster, "old", 8, taken=[0, 1, 2, 3, 4])  # no links reported: cannot promise
    add_host(cluster, "p", 8, preset="pcie-two-socket", taken=[1, 3, 5, 7])
    add_host(cluster, "h", 8, preset="hgx", taken=[0, 1, 2, 3, 4, 5])
    got = place(cluster, demand(2, "nvlink"))
    assert isinstance(got, Placement) and got.host == "h"
    switch = place(cluster, demand(2, "pcie-switch"))
    assert isinstance(switch, Placement) and switch.host == "h"  # NVLink is better
    cluster.add_claim("h-6", Claim("z", "x", (), True, 81920, Fraction(1)))
    refused = place(cluster, demand(2, "nvlink"))
    assert isinstance(refused, Refusal) and refused.code is ErrorCode.NO_CAPACITY
    assert "NVLink" in refused.message and refused.details["topology"] == "nvlink"
    # one GPU keeps any level
    assert isinstance(place(cluster, demand(1, "nvlink")), Placement)


def test_a_level_no_host_could_ever_keep_is_unsatisfiable():
    cluster = Cluster()
    add_host(cluster, "p", 8, preset="pcie-two-socket")
    refused = place(cluster, demand(2, "nvlink"))
    assert isinstance(refused, Refusal) and refused.code is ErrorCode.UNSATISFIABLE
    assert "NVLink" in refused.message and "one PCIe switch" in refused.message
    unreported = Cluster()
    add_host(unreported, "old", 8)
    refused = place(unreported, demand(2, "socket"))
    assert isinstance(refused, Refusal) and refused.code is ErrorCode.UNSATISFIABLE
    assert "reported how its GPUs are joined" in refused.message


def test_a_whole_host_keeps_its_gpus_in_the_containers_order():
    cluster = Cluster()
    add_host(cluster, "w", 4, preset="nvlink-pairs")
    got = place(cluster, demand(None))
    assert isinstance(got, Placement)
    assert set(got.gpu_uuids) == {"w-0", "w-1", "w-2", "w-3"}
    assert got.gpu_uuids == visible_order(cluster.nodes["w"].interconnect, got.gpu_uuids)  # type: ignore[arg-type]
    assert isinstance(place(cluster, demand(None, "nvlink")), Refusal)
    assert isinstance(place(cluster, demand(None, "socket")), Placement)


def test_the_container_gets_the_order_and_the_numa_nodes():
    cluster = Cluster()
    add_host(cluster, "h", 8, preset="hgx", taken=[0, 1, 2])
    got = place(cluster, demand(3))
    assert isinstance(got, Placement) and got.numa_nodes == (0, 1)
    env = lease_env(got, cluster, "lease-1")
    assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(got.gpu_uuids)
    assert env["SWARM_GPU_NUMA_NODES"] == "0,1"
    plain = Cluster()
    add_host(plain, "n", 2)
    bare = place(plain, demand(2))
    assert isinstance(bare, Placement)
    assert "SWARM_GPU_NUMA_NODES" not in lease_env(bare, plain, "lease-2")


# --------------------------------------------------------------------------- properties


@st.composite
def clusters(draw: st.DrawFn, *, links: bool = True) -> Cluster:
    cluster = Cluster()
    for h in range(draw(st.integers(1, 6))):
        preset = draw(st.sampled_from([None, *TOPOLOGY_PRESETS])) if links else None
        gpus = PRESET_GPUS[preset] if preset is not None else draw(st.integers(1, 8))
        taken = draw(st.lists(st.integers(0, gpus - 1), max_size=gpus, unique=True))
        add_host(cluster, f"h{h}", gpus, draw(st.sampled_from(sorted(MODELS))), preset, taken)
        cluster.nodes[f"h{h}"].drained = draw(st.integers(0, 9)) == 0
    return cluster


demands = st.builds(
    demand, count=st.sampled_from([1, 2, 2, 3, 4, None]),
    topology=st.sampled_from([None, None, *DEMANDED_LEVEL]),
    models=st.sampled_from([None, ("A",), ("B", "A")]))


def eligible(cluster: Cluster, host: str, model: str) -> list[str]:
    return [g.uuid for g in cluster.gpus_of(host)
            if g.model == model and g.placeable and cluster.is_free(g)]


def old_exclusive(cluster: Cluster, wanted: Demand) -> tuple[str, tuple[str, ...]] | None:
    """The rule before links, written out: the fewest free GPUs on the host, its name, the
    model with the fewest free GPUs there; the lowest indices."""
    assert wanted.count is not None
    for model in wanted.models or [None]:
        best = None
        for host in sorted(cluster.nodes):
            node = cluster.nodes[host]
            if node.drained or not node.is_up(NOW, DOWN_AFTER):
                continue
            host_free = sum(1 for g in cluster.gpus_of(host) if g.placeable and cluster.is_free(g))
            for m in sorted(MODELS):
                free = eligible(cluster, host, m)
                if (model is None or m == model) and len(free) >= wanted.count:
                    key = (host_free, host, len(free), m)
                    if best is None or key < best[0]:
                        best = (key, tuple(free[:wanted.count]))
        if best is not None:
            return best[0][1], best[1]
    return None


@settings(max_examples=300, deadline=None)
@given(clusters(links=False), demands)
def test_without_links_placement_is_what_it_was(cluster, wanted):
    wanted = Demand(**{**wanted.__dict__, "topology": None})
    got = place(cluster, wanted)
    if wanted.count is None:
        return  # "all" is tests/placement/test_policy.py's
    expected = old_exclusive(cluster, wanted)
    if expected is None:
        assert isinstance(got, Refusal)
    else:
        assert isinstance(got, Placement) and (got.host, got.gpu_uuids) == expected
        assert got.numa_nodes == ()


@settings(max_examples=300, deadline=None)
@given(clusters(), demands)
def test_never_a_worse_set_than_one_that_fits_on_the_chosen_host(cluster, wanted):
    got = place(cluster, wanted)
    if not isinstance(got, Placement) or wanted.count is None:
        return
    links = cluster.nodes[got.host].interconnect
    if links is None:
        return
    model = cluster.gpus[got.gpu_uuids[0]].model
    free = eligible(cluster, got.host, model)
    best = min(set_cost(links, c) for c in combinations(free, wanted.count))
    assert set_cost(links, got.gpu_uuids) == best
    assert got.gpu_uuids == visible_order(links, got.gpu_uuids)


@settings(max_examples=300, deadline=None)
@given(clusters(), demands)
def test_a_demanded_level_is_never_broken(cluster, wanted):
    got = place(cluster, wanted)
    if wanted.topology is None or wanted.count == 1:
        return
    level = DEMANDED_LEVEL[wanted.topology]
    if isinstance(got, Placement):
        if len(got.gpu_uuids) == 1:
            return  # "all" of a host of one GPU: no link to keep
        links = cluster.nodes[got.host].interconnect
        assert links is not None
        worst = worst_link(links, got.gpu_uuids)
        assert worst is not None and worst <= level
        return
    # Refused: no usable host with links has a fitting set that keeps the level.
    for host, node in cluster.nodes.items():
        if node.interconnect is None or node.drained:
            continue
        for model in wanted.models or sorted(MODELS):
            free = eligible(cluster, host, model)
            if wanted.count is None:
                every = [g.uuid for g in cluster.gpus_of(host) if g.model == model]
                if every and free == every and len(every) > 1 and wanted.models is not None:
                    assert worst_link(node.interconnect, every) > level  # type: ignore[operator]
                continue
            for chosen in combinations(free, wanted.count):
                assert worst_link(node.interconnect, chosen) > level  # type: ignore[operator]


@settings(max_examples=200, deadline=None)
@given(clusters(), st.lists(st.tuples(demands, st.booleans()), max_size=20), st.integers(1, 2))
def test_the_index_narrows_to_the_same_answer_with_links(cluster, steps, depth):
    index = PlacementIndex(depth=depth)
    index.rebuild(cluster)

    def usable(node: Node) -> bool:
        return node.is_up(NOW, DOWN_AFTER) and not node.drained

    held: list[tuple[str, Placement]] = []
    for n, (wanted, release_one) in enumerate(steps):
        expected = place(cluster, wanted)
        view = index.narrow(wanted, cluster, usable)
        got: Placement | Refusal | None = None
        if view is not None and view.nodes:
            got = policy.place(wanted, view, NOW, DOWN_AFTER)
        if not isinstance(got, Placement):
            got = place(cluster, wanted)
        assert got == expected
        if isinstance(got, Placement):
            apply_placement(cluster, got, f"l{n}", wanted)
            index.refresh(cluster, got.host)
            held.append((f"l{n}", got))
        if release_one and held:
            lease_id, placement = held.pop(0)
            cluster.drop_claims(lease_id, list(placement.gpu_uuids))
            index.refresh(cluster, placement.host)
