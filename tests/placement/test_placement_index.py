"""The placement index narrows the search without changing the policy's answer."""

from __future__ import annotations

from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.placement.claims import apply_placement
from allocator.placement.cluster import GPU, Cluster, Node
from allocator.placement.demand import Demand, Placement
from allocator.placement.index import PlacementIndex
from allocator.placement.no_capacity import nothing_fits_now
from allocator.placement.policy import place
from allocator.wire.protocol import Health

NOW = 1000.0
DOWN_AFTER = 10.0
MODELS = {"A": (8192, 4), "B": (24576, 1), "C": (81920, 2)}


@st.composite
def clusters(draw: st.DrawFn) -> Cluster:
    cluster = Cluster()
    for h in range(draw(st.integers(1, 7))):
        host = f"h{h}"
        node = Node(host=host, last_heartbeat=NOW - draw(st.sampled_from([0, 0, 0, 60])),
                    drained=draw(st.booleans()) and draw(st.booleans()))
        cluster.nodes[host] = node
        for i in range(draw(st.integers(0, 5))):
            model = draw(st.sampled_from(sorted(MODELS)))
            memory, slots = MODELS[model]
            gpu = GPU(uuid=f"{host}-{i}", host=host, index=i, model=model,
                      memory_total_mib=memory, share_slots=slots,
                      health=Health.UNHEALTHY if draw(st.integers(0, 9)) == 0 else Health.HEALTHY,
                      drained=draw(st.integers(0, 9)) == 0)
            cluster.gpus[gpu.uuid] = gpu
            node.gpu_uuids.append(gpu.uuid)
    return cluster


demands = st.builds(
    Demand,
    user=st.just("u"), groups=st.just(()),
    models=st.one_of(st.none(), st.lists(st.sampled_from(sorted(MODELS)), min_size=1,
                                         max_size=3, unique=True).map(tuple)),
    min_memory_mib=st.sampled_from([None, None, 10000, 50000]),
    count=st.integers(1, 4), host=st.just(None), shared=st.booleans(),
    share_memory_mib=st.sampled_from([None, 1024, 4096]),
)


def usable(node: Node) -> bool:
    return node.is_up(NOW, DOWN_AFTER) and not node.drained


def narrowed_place(index: PlacementIndex, demand: Demand, cluster: Cluster):
    """What the engine does: the narrowed view first, the whole cluster when it finds nothing."""
    view = index.narrow(demand, cluster, usable)
    if view is not None and view.nodes:
        found = place(demand, view, NOW, DOWN_AFTER)
        if isinstance(found, Placement):
            return found
    return place(demand, cluster, NOW, DOWN_AFTER)


def quick_place(index: PlacementIndex, demand: Demand, cluster: Cluster):
    """What the engine does when it serves the queue: the narrowed view's answer stands, a
    "no" included (None: the index could not narrow)."""
    view = index.narrow(demand, cluster, usable)
    if view is None:
        return None
    if not view.nodes:
        return nothing_fits_now()
    return place(demand, view, NOW, DOWN_AFTER, explain=False)


@settings(max_examples=300, deadline=None)
@given(clusters(), st.lists(st.tuples(demands, st.booleans()), max_size=25), st.integers(1, 3))
def test_narrowed_placement_equals_full_placement(cluster, steps, depth):
    index = PlacementIndex(depth=depth)
    index.rebuild(cluster)
    held: list[tuple[str, Placement]] = []
    for n, (demand, release_one) in enumerate(steps):
        if demand.shared:
            demand = Demand(**{**demand.__dict__, "count": 1})
        expected = place(demand, cluster, NOW, DOWN_AFTER)
        got = narrowed_place(index, demand, cluster)
        assert got == expected
        quick = quick_place(index, demand, cluster)
        if quick is not None:  # where it narrows, its "no" is the policy's too
            assert quick == expected if isinstance(expected, Placement) \
                else not isinstance(quick, Placement)
        if isinstance(got, Placement):
            apply_placement(cluster, got, f"l{n}", demand)
            index.refresh(cluster, got.host)
            held.append((f"l{n}", got))
        if release_one and held:
            lease_id, placement = held.pop(0)
            cluster.drop_claims(lease_id, list(placement.gpu_uuids))
            index.refresh(cluster, placement.host)


def test_narrowing_declines_when_a_model_has_several_sizes():
    cluster = Cluster(nodes={"h": Node(host="h", last_heartbeat=NOW, gpu_uuids=["a", "b"])})
    cluster.gpus["a"] = GPU(uuid="a", host="h", index=0, model="X", memory_total_mib=10)
    cluster.gpus["b"] = GPU(uuid="b", host="h", index=1, model="X", memory_total_mib=20)
    index = PlacementIndex()
    index.rebuild(cluster)
    demand = Demand(user="u", groups=(), models=("X",), min_memory_mib=15, count=1,
                    host=None, shared=False, share_memory_mib=None)
    assert index.narrow(demand, cluster, usable) is None
    placement = narrowed_place(index, demand, cluster)
    assert isinstance(placement, Placement) and placement.gpu_uuids == ("b",)
    assert placement.units == Fraction(1)


def test_narrowed_view_holds_only_the_best_fit_hosts():
    cluster = Cluster()
    for h, free in enumerate([8, 3, 1, 5]):
        host = f"h{h}"
        cluster.nodes[host] = Node(host=host, last_heartbeat=NOW)
        for i in range(free):
            gpu = GPU(uuid=f"{host}-{i}", host=host, index=i, model="A", memory_total_mib=8)
            cluster.gpus[gpu.uuid] = gpu
            cluster.nodes[host].gpu_uuids.append(gpu.uuid)
    index = PlacementIndex(depth=2)
    index.rebuild(cluster)
    demand = Demand(user="u", groups=(), models=None, min_memory_mib=None, count=2,
                    host=None, shared=False, share_memory_mib=None)
    view = index.narrow(demand, cluster, usable)
    assert view is not None and sorted(view.nodes) == ["h1", "h3"]
