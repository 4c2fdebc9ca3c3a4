"""How GPUs are joined, as the hub shows it (pure): the spawn form's connection of a
multi-GPU choice and its topology choice, the options that carry it to the request, and a
lease's connection on the GPU page."""

from __future__ import annotations

import pytest

from allocator.placement.gpu_sets import DEMANDED_LEVEL, best_link, choose_gpus
from allocator.wire.interconnect import (
    LINK_NAMES,
    HostInterconnect,
    LinkLevel,
    build_interconnect,
    hgx_host,
    pcie_two_socket_host,
)
from allocator.wire.protocol import InventoryReply, LeaseState
from hubplugin.form import render_form
from hubplugin.links import TOPOLOGY_CHOICES, best_link_of, lease_link, reports_topology
from hubplugin.options import (
    GPUMode,
    GPUOptions,
    GPUPermissions,
    OptionsError,
    check_options,
    load_profiles,
    options_from_form,
    parse_user_options,
)
from hubplugin.options import build_allocate_request as request_for
from hubplugin.page.app import TEMPLATE
from hubplugin.page.view import Viewer, page_context
from hubplugin.templating import template
from tests.support.hub_form import STAFF, parse
from tests.support.hub_inventory import A100, GTX1070, RTX3090, inventory, lease
from tests.support.page_view import NOW, WINDOW, cluster_with

TIMES = "\u00d7"


def with_topology(reply: InventoryReply, **hosts: HostInterconnect) -> InventoryReply:
    """``reply`` whose named hosts (``gpu_c`` for gpu-c) reported the links of the first GPUs
    of these shapes, as many as the host has, renamed to the inventory's ``GPU-<host>-<i>``."""
    nodes = []
    for node in reply.nodes:
        shape = hosts.get(node.host.replace("-", "_"))
        if shape is not None:
            uuids = [f"GPU-{node.host}-{i}" for i in range(node.gpus)]
            links = {(i, j): (shape.link_at(i, j).level, shape.link_at(i, j).nvlinks)
                     for i in range(node.gpus) for j in range(i + 1, node.gpus)}
            numa = [gpu.numa_node for gpu in shape.gpus[:node.gpus]]
            node = node.model_copy(update={"interconnect": build_interconnect(uuids, numa, links)})
        nodes.append(node)
    return reply.model_copy(update={"nodes": nodes})


def busy(reply: InventoryReply, *uuids: str) -> InventoryReply:
    """``reply`` with these GPUs held."""
    gpus = [g.model_copy(update={"holders": ["L-x"], "free_slots": 0}) if g.uuid in uuids else g
            for g in reply.gpus]
    return reply.model_copy(update={"gpus": gpus})


def count_options(html: str) -> dict[str, dict[str, str | None]]:
    return {str(o["value"]): o for o in parse(html).selects["count"]}


# --------------------------------------------------------------------------- the rule


def test_best_link_is_the_worst_pair_of_the_set_the_placement_would_choose() -> None:
    pcie = pcie_two_socket_host()
    every = list(pcie.uuids)
    assert best_link(pcie, every, 1) is None, "one GPU has no link"
    assert best_link(pcie, every, 2) is LinkLevel.SINGLE
    assert best_link(pcie, every, 4) is LinkLevel.NODE
    assert best_link(pcie, every, 5) is LinkLevel.SYSTEM
    assert best_link(pcie, every[:3], 4) is None, "too few free"
    # one free GPU of each switch pair: no two share a switch any more
    assert best_link(pcie, every[::2], 2) is LinkLevel.NODE
    for count in range(2, 9):
        for free in (every, every[1:], every[::2], every[3:]):
            chosen = choose_gpus(pcie, free, count)
            expected = getattr(chosen, "worst_level", None)
            assert best_link(pcie, free, count) == expected, (count, free)
    with pytest.raises(ValueError, match="not on this host"):
        best_link(pcie, ["GPU-elsewhere"], 2)


# --------------------------------------------------------------------------- the form


def test_a_multi_gpu_choice_says_its_best_connection_now() -> None:
    reply = with_topology(inventory(), gpu_c=hgx_host(), gpu_b=pcie_two_socket_host())
    # gpu-b's four RTX 3090s are GPUs 0-3 of the PCIe shape: two switches of one socket
    html = render_form(reply, permissions=STAFF,
                       current=GPUOptions(mode=GPUMode.EXCLUSIVE, model="a100", count=2))
    counts = count_options(html)
    assert counts["1"]["text"] == "1 GPU" and "data-label" not in counts["1"]
    assert counts["2"]["text"] == f"2 {TIMES} NVIDIA A100-SXM4-80GB, NVLink"
    assert counts["4"]["text"] == f"4 {TIMES} NVIDIA A100-SXM4-80GB, NVLink"
    keys = {o["value"]: o["data-key"] for o in parse(html).selects["model"]}
    three090, gtx = f"data-link-{keys[RTX3090]}", f"data-link-{keys[GTX1070]}"
    assert counts["2"][three090] == f"2 {TIMES} NVIDIA GeForce RTX 3090, one PCIe switch"
    assert counts["4"][three090] == f"4 {TIMES} NVIDIA GeForce RTX 3090, one CPU socket"
    assert counts["2"][gtx] == "", "gpu-a reported no links"
    assert counts["2"]["data-link-any"] == "2 GPUs, NVLink"
    assert counts["2"]["data-label"] == "2 GPUs"
    assert counts["all"]["text"] == "All GPUs of one host" and "data-label" not in counts["all"]


def test_the_connection_is_of_the_free_gpus_of_one_host_the_user_may_use() -> None:
    reply = with_topology(inventory(), gpu_b=pcie_two_socket_host())
    # GPU 1 and GPU 2 held: 0 and 3 are on different switches of one socket
    held = busy(reply, "GPU-gpu-b-1", "GPU-gpu-b-2")
    counts = count_options(render_form(held, permissions=STAFF, current=GPUOptions(
        mode=GPUMode.EXCLUSIVE, model="3090", count=2)))
    assert counts["2"]["text"] == f"2 {TIMES} NVIDIA GeForce RTX 3090, one CPU socket"
    assert counts["3"]["text"] == "3 GPUs", "only two are free: nothing to say"
    models = [m for m in held.models if m.model == RTX3090]
    assert best_link_of(held, models, 2) is LinkLevel.NODE
    elsewhere = [m.model_copy(update={"hosts": {"gpu-c": 8}}) for m in models]
    assert best_link_of(held, elsewhere, 2) is None, "gpu-b is not a host the user may use"
    down = held.model_copy(update={"nodes": [
        n.model_copy(update={"up": n.host != "gpu-b"}) for n in held.nodes]})
    assert best_link_of(down, models, 2) is None, "a host that is down gives nothing"
    unhealthy = held.model_copy(update={"gpus": [
        g.model_copy(update={"health": "unhealthy"}) if g.uuid == "GPU-gpu-b-3" else g
        for g in held.gpus]})
    assert best_link_of(unhealthy, models, 2) is None


def test_the_topology_choice_is_offered_where_hosts_report_links() -> None:
    reply = with_topology(inventory(), gpu_c=hgx_host())
    assert reports_topology(reply) and not reports_topology(inventory())
    form = parse(render_form(reply, permissions=STAFF))
    choices = [(o["value"], o["text"]) for o in form.selects["topology"]]
    assert choices == [("any", "any (best available)"), ("nvlink", "NVLink only"),
                       ("pcie-switch", "same PCIe switch"), ("socket", "same socket")]
    assert form.selected("topology") == "any"
    assert [value for value, _ in TOPOLOGY_CHOICES[1:]] == list(DEMANDED_LEVEL)
    again = parse(render_form(reply, permissions=STAFF, current=GPUOptions(
        mode=GPUMode.EXCLUSIVE, model="a100", count=4, topology="nvlink")))
    assert again.selected("topology") == "nvlink"
    assert options_from_form(again.submit()) == {
        "mode": "exclusive", "model": A100, "count": 4, "topology": "nvlink"}


def test_a_cluster_without_links_gets_the_form_it_had() -> None:
    """No new control, no new attribute, no new script where no host reported its links."""
    for permissions in (STAFF, GPUPermissions(max_gpus=8)):
        html = render_form(inventory(), permissions=permissions, current=GPUOptions(
            mode=GPUMode.EXCLUSIVE, model="a100", count=2))
        form = parse(html)
        assert "topology" not in form.selects and "sg-topology" not in html
        assert "data-link" not in html and "data-label" not in html and "Connection" not in html
        assert form.scripts == 1
        assert count_options(html)["2"]["text"] == "2 GPUs"
    linked = with_topology(inventory(), gpu_c=hgx_host())
    assert parse(render_form(linked, permissions=STAFF)).scripts == 2
    no_gpus = render_form(linked, permissions=GPUPermissions(max_gpus=0))
    assert "sg-topology" not in no_gpus and "data-link" not in no_gpus, "nothing to join"


def test_the_topology_script_reads_only_data_attributes() -> None:
    html = render_form(with_topology(inventory(), gpu_c=hgx_host()), permissions=STAFF)
    script = html[html.rindex("<script>"):]
    assert "NVLink" not in script and A100 not in script and "gpu-c" not in script
    assert 'getAttribute("data-link-" + key)' in script


# --------------------------------------------------------------------------- the options


def test_the_topology_reaches_the_request_and_bad_values_say_what_is_known() -> None:
    options = parse_user_options({"mode": "exclusive", "model": "a100", "count": 2,
                                  "topology": "pcie-switch"})
    checked = check_options(options, STAFF, with_topology(inventory(), gpu_c=hgx_host()))
    assert checked is not None
    request = request_for(checked, hub_id="hub", user="alice")
    assert request.topology == "pcie-switch" and request.count == 2
    assert "joined by one PCIe switch or better" in options.describe()
    for bad in ("fast", "NVLINK", 3):
        with pytest.raises(OptionsError) as raised:
            parse_user_options({"mode": "exclusive", "count": 2, "topology": bad})
        assert "GPU connection: must be one of: any, nvlink, pcie-switch, socket" in str(
            raised.value)
        assert raised.value.field == "topology"
    with pytest.raises(OptionsError, match="GPU connection: must be one of"):
        options_from_form({"mode": ["exclusive"], "count": ["2"], "topology": ["best"]})
    # "any" is no demand; one GPU or a slice has no link to demand
    assert "topology" not in options_from_form(
        {"mode": ["exclusive"], "count": ["2"], "topology": ["any"]})
    assert "topology" not in options_from_form(
        {"mode": ["exclusive"], "count": ["1"], "topology": ["nvlink"]})
    assert "topology" not in options_from_form(
        {"mode": ["shared"], "model": ["1070"], "topology": ["nvlink"]})
    assert options_from_form({"mode": ["exclusive"], "count": ["all"], "topology": ["socket"]}
                             )["topology"] == "socket"
    plain = check_options(parse_user_options({"mode": "exclusive", "count": 2}), STAFF)
    assert plain is not None and request_for(plain, hub_id="h", user="u").topology is None


def test_a_demand_goes_only_to_an_allocator_whose_hosts_report_links() -> None:
    """An allocator before 0.3.0 would ignore the demand: the hub asks only one whose
    inventory shows links (the spawner reads the inventory first for such a choice)."""
    demand = parse_user_options({"mode": "exclusive", "model": "a100", "count": 2,
                                 "topology": "nvlink"})
    with pytest.raises(OptionsError, match="No GPU host has reported how its GPUs are joined"
                       ) as raised:
        check_options(demand, STAFF, inventory())
    assert raised.value.field == "topology"
    for trusted in (False, True):
        assert check_options(demand, STAFF, with_topology(inventory(), gpu_b=hgx_host()),
                             trusted=trusted) is not None
    plain = demand.model_copy(update={"topology": None})
    assert check_options(plain, STAFF, inventory()) is not None


def test_a_profile_may_demand_a_topology() -> None:
    (profile,) = load_profiles([{"slug": "a100-pair", "display_name": "Two NVLinked A100s",
                                 "mode": "exclusive", "model": "a100", "count": 2,
                                 "topology": "nvlink"}])
    assert profile.options().topology == "nvlink"
    assert profile.summary() == "2 whole GPUs (a100), joined by NVLink or better"
    with pytest.raises(ValueError, match="gpu_profiles\\[0\\]"):
        load_profiles([{"slug": "x", "display_name": "X", "topology": "fast"}])


# --------------------------------------------------------------------------- the page


def test_a_lease_shows_how_its_gpus_are_joined() -> None:
    pair = lease(lease_id="L-pair", request_key="hub/alice/", user="alice", host="gpu-b",
                 gpu_uuids=["GPU-gpu-b-0", "GPU-gpu-b-1"], gpu_indices=[0, 1], model=RTX3090,
                 granted_at=NOW - 60, link="pcie-switch")
    single = lease(lease_id="L-one", request_key="hub/alice/small", user="alice",
                   host="gpu-a", gpu_uuids=["GPU-gpu-a-0"], gpu_indices=[0], granted_at=NOW)
    newer = pair.model_copy(update={"lease_id": "L-new", "request_key": "hub/alice/new",
                                    "link": "optical"})
    assert lease_link(pair) == "2 GPUs, one PCIe switch"
    assert lease_link(single) is None
    assert lease_link(pair.model_copy(update={"link": None})) is None, "before 0.3.0"
    assert lease_link(newer) == "2 GPUs, optical", "a name this hub does not know: as sent"
    assert {lease_link(pair.model_copy(update={"link": name})) for name in LINK_NAMES.values()
            } == {f"2 GPUs, {level.words}" for level in LinkLevel}
    reply = cluster_with([pair, single])
    context = page_context(reply, Viewer("alice", is_admin=False), {}, now=NOW,
                           window=WINDOW, hub_id="hub")
    assert [card["link"] for card in context["held"]] == ["2 GPUs, one PCIe switch", None]
    html = template(TEMPLATE).render({**context, "refresh_s": 0})
    assert html.count('class="sg-link"') == 1
    assert '<dt>Connection</dt><dd class="sg-link">2 GPUs, one PCIe switch</dd>' in html
    assert "<script" not in html
    admin = page_context(reply, Viewer("root", is_admin=True), {}, now=NOW, window=WINDOW,
                         hub_id="hub")
    links = [h["link"] for row in admin["cluster"]["gpus"] for h in row["holders"]]
    assert links == [None, "2 GPUs, one PCIe switch", "2 GPUs, one PCIe switch"]
    admin_html = template(TEMPLATE).render({**admin, "refresh_s": 0})
    assert admin_html.count('<span class="sg-link">2 GPUs, one PCIe switch</span>') == 2


def test_a_page_without_links_is_the_page_it_was() -> None:
    pair = lease(lease_id="L-pair", request_key="hub/alice/", user="alice", host="gpu-b",
                 gpu_uuids=["GPU-gpu-b-0", "GPU-gpu-b-1"], gpu_indices=[0, 1], model=RTX3090,
                 granted_at=NOW - 60, state=LeaseState.BOUND)
    for viewer in (Viewer("alice", is_admin=False), Viewer("root", is_admin=True)):
        context = page_context(cluster_with([pair]), viewer, {}, now=NOW, window=WINDOW,
                               hub_id="hub")
        html = template(TEMPLATE).render({**context, "refresh_s": 0})
        assert "sg-link" not in html and "Connection" not in html
