"""The GPU page's pure parts (what a viewer sees, the chart) and its history file (real SQLite)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from allocator.wire.protocol import InventoryReply, LeaseState, ProcessState, ProcessView
from hubplugin.page.app import TEMPLATE
from hubplugin.page.chart import usage_chart
from hubplugin.page.history import UsageHistory
from hubplugin.page.usage import UsagePoint
from hubplugin.page.view import Viewer, Window, duration, page_context, samples_of
from hubplugin.templating import template
from tests.support.hub_inventory import RTX3090, lease
from tests.support.page_view import NOW, WINDOW, cluster_with

ALICE = lease(lease_id="L-alice", request_key="hub/alice/", user="alice", host="gpu-a",
              gpu_uuids=["GPU-gpu-a-0"], gpu_indices=[0], granted_at=NOW - 600)
ALICE_QUEUED = lease(lease_id="L-alice-q", request_key="hub/alice/big", user="alice",
                     state=LeaseState.QUEUED, host=None, gpu_uuids=[], gpu_indices=[],
                     model=RTX3090, queue_position=2, created_at=NOW - 90, granted_at=None)
BOB = lease(lease_id="L-bob", request_key="hub/bob/", user="bob", host="gpu-b",
            gpu_uuids=["GPU-gpu-b-1", "GPU-gpu-b-2"], gpu_indices=[1, 2], model=RTX3090)
ALICE_ELSEWHERE = lease(lease_id="L-alice-other-hub", request_key="other/alice/",
                        user="alice", host="gpu-a", gpu_uuids=["GPU-gpu-a-1"], gpu_indices=[1])


def test_a_user_sees_only_their_own_leases_of_this_hub() -> None:
    reply = cluster_with([ALICE, ALICE_QUEUED, BOB, ALICE_ELSEWHERE])
    history = {"L-alice": [UsagePoint(NOW - 60, 50.0, 1024, 8192),
                           UsagePoint(NOW - 30, 64.0, 2048, 8192)]}
    context = page_context(reply, Viewer("alice", is_admin=False), history, now=NOW,
                           window=WINDOW, hub_id="hub")
    assert [card["lease_id"] for card in context["held"]] == ["L-alice"]
    card = context["held"][0]
    assert card["server"] == "default server" and card["host"] == "gpu-a"
    assert card["utilization"] == "64 %" and card["memory"] == "2 GiB of 8 GiB"
    assert card["what"] == "GPU 0" and card["since"].endswith("(10 min ago)")
    assert "<polyline" in card["chart"]
    assert [(q["lease_id"], q["position"], q["server"]) for q in context["queued"]] == [
        ("L-alice-q", 2, "server “big”")]
    assert context["cluster"] is None


def test_an_admin_sees_every_gpu_and_its_holder() -> None:
    reply = cluster_with([ALICE, BOB])
    context = page_context(reply, Viewer("root", is_admin=True), {}, now=NOW, window=WINDOW,
                           hub_id=None)
    assert context["held"] == []
    rows = context["cluster"]["gpus"]
    assert [(r["host"], r["index"], r["state"]) for r in rows] == [
        ("gpu-a", 0, "held"), ("gpu-a", 1, "free"), ("gpu-b", 0, "free"), ("gpu-b", 1, "held"),
        ("gpu-b", 2, "held"), ("gpu-b", 3, "free")]
    assert [h["user"] for r in rows for h in r["holders"]] == ["alice", "bob", "bob"]


def test_one_sample_per_holding_lease() -> None:
    reply = cluster_with([ALICE, ALICE_QUEUED, BOB])
    rows = {lease_id: point for lease_id, _user, point in samples_of(reply)}
    assert set(rows) == {"L-alice", "L-bob"}  # a queued request holds no GPU
    assert rows["L-bob"] == UsagePoint(NOW, 64.0, 4096, 2 * 24576)


def test_the_chart_breaks_where_samples_are_missing() -> None:
    points = [UsagePoint(NOW - 3000 + i * 30, 40.0, 4096, 8192) for i in range(5)]
    points += [UsagePoint(NOW - 600 + i * 30, 80.0, 4096, 8192) for i in range(5)]
    svg = usage_chart(points, start=NOW - 3600, end=NOW, gap_s=75)
    utilization = re.findall(r'<polyline class="sg-util" points="([^"]+)"', svg)
    memory = re.findall(r'<polyline class="sg-mem" points="([^"]+)"', svg)
    assert len(utilization) == 2 and len(memory) == 2
    # 40 % sits lower than 80 % (SVG's y grows downwards); memory is 50 % of the slice
    y_40 = float(utilization[0].split()[0].split(",")[1])
    y_80 = float(utilization[1].split()[0].split(",")[1])
    y_mem = float(memory[0].split()[0].split(",")[1])
    assert y_80 < y_mem < y_40
    empty = usage_chart([], start=NOW - 3600, end=NOW, gap_s=75)
    assert "no samples yet" in empty and "<polyline" not in empty


def test_durations_read_as_people_say_them() -> None:
    assert [duration(s) for s in (42, 720, 3 * 3600 + 300, 50 * 3600)] == [
        "42 s", "12 min", "3 h 5 min", "2 d 2 h"]


def test_hostile_names_are_escaped_and_an_admin_template_may_extend_the_page(
        tmp_path: Path) -> None:
    hostile = lease(lease_id="L-x", request_key='hub/mallory/<script>alert(1)</script>',
                    user="mallory", host="gpu-a", gpu_uuids=["GPU-gpu-a-0"], gpu_indices=[0])
    context = page_context(cluster_with([hostile]), Viewer("mallory", is_admin=True), {},
                           now=NOW, window=WINDOW, hub_id="hub")
    html = template(TEMPLATE).render({**context, "refresh_s": 0})
    assert "<script>" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    (tmp_path / TEMPLATE).write_text(
        '{% extends "swarm_gpu/gpu_page.html.j2" %}'
        '{% block footer %}<p id="site">Ask gpu-help@example.org</p>{% endblock %}')
    html = template(TEMPLATE, [str(tmp_path)]).render({**context, "refresh_s": 0})
    assert '<p id="site">Ask gpu-help@example.org</p>' in html and 'id="sg-cluster"' in html


async def test_history_keeps_samples_for_its_window_only(tmp_path: Path) -> None:
    path = tmp_path / "history.sqlite"
    history = UsageHistory(path, keep_s=3600)
    await history.open()
    try:
        start = time.time()
        await history.record([("L1", "alice", UsagePoint(start, 10.0, 100, 8192)),
                              ("L2", "bob", UsagePoint(start, 20.0, 200, 8192))])
        await history.record([("L1", "alice", UsagePoint(start + 1800, 30.0, 300, 8192))])
        points = await history.points(["L1", "L2", "L3"], since=start - 1)
        assert [p.utilization_pct for p in points["L1"]] == [10.0, 30.0]
        assert [p.memory_used_mib for p in points["L2"]] == [200] and points["L3"] == []
        # an hour later the first samples are gone
        await history.record([("L1", "alice", UsagePoint(start + 3601, None, None, 8192))])
        points = await history.points(["L1", "L2"], since=0)
        assert [p.at for p in points["L1"]] == [start + 1800, start + 3601]
        assert points["L2"] == []
    finally:
        await history.close()
    reopened = UsageHistory(path, keep_s=3600)  # the file survives a restart of the page
    await reopened.open()
    try:
        assert len((await reopened.points(["L1"], since=0))["L1"]) == 2
    finally:
        await reopened.close()


def test_a_pending_reclaim_shows_its_deadline_and_why() -> None:
    warned = lease(lease_id="L-warned", request_key="hub/alice/extra", user="alice",
                   host="gpu-a", gpu_uuids=["GPU-gpu-a-1"], gpu_indices=[1], borrowed=True,
                   idle_since=NOW - 900, reclaim_at=NOW + 240, reclaim_reason="reclaimed")
    context = page_context(cluster_with([ALICE, warned]), Viewer("alice", is_admin=False), {},
                           now=NOW, window=WINDOW, hub_id="hub")
    cards = {card["lease_id"]: card for card in context["held"]}
    assert cards["L-alice"]["reclaim"] is None and cards["L-alice"]["share"] == "guaranteed"
    assert cards["L-warned"]["share"] == "borrowed" and cards["L-warned"]["idle"] == "15 min"
    html = template(TEMPLATE).render({**context, "refresh_s": 0})
    warnings = re.findall(r'<div class="sg-note sg-danger sg-reclaim"[^>]*>(.*?)</div>', html)
    assert len(warnings) == 1
    assert f'data-deadline="{NOW + 240:.0f}"' in html
    deadline = time.strftime("%H:%M UTC", time.gmtime(NOW + 240))
    assert f"server “extra” will be stopped at {deadline}</strong> (in 4 min)" in warnings[0]
    assert "borrowed beyond your guarantee" in warnings[0]


def test_a_chart_starts_at_its_lease_within_bounds() -> None:
    window = Window(span_s=3 * 3600, gap_s=75, min_span_s=600)
    assert window.start_for(NOW - 3600, NOW) == NOW - 3600  # granted an hour ago
    assert window.start_for(NOW - 5, NOW) == NOW - 600  # a new lease: ten minutes
    assert window.start_for(NOW - 86400, NOW) == NOW - 3 * 3600  # never more than the span
    assert Window(span_s=180, gap_s=3).start_for(NOW - 5, NOW) == NOW - 180


def test_hub_admins_and_admin_groups_see_the_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    from hubplugin.page.app import GPUPage
    from hubplugin.page.settings import PageSettings

    monkeypatch.setenv("SWARM_GPU_PAGE_ADMIN_GROUPS", "gpu-admins,staff")
    page = GPUPage(PageSettings())
    assert page.viewer({"name": "root", "admin": True, "groups": []}) == Viewer("root", True)
    assert page.viewer({"name": "eve", "admin": False, "groups": ["staff"]}).is_admin
    assert not page.viewer({"name": "bob", "admin": False, "groups": ["students"]}).is_admin


def test_an_allocator_that_does_not_answer_is_said_and_the_last_answer_shown() -> None:
    reply = cluster_with([ALICE])
    context = page_context(reply, Viewer("alice", is_admin=False), {}, now=NOW + 120,
                           window=WINDOW, hub_id="hub",
                           unavailable="the allocator did not answer within 5 s")
    html = template(TEMPLATE).render({**context, "refresh_s": 0})
    note = re.search(r'<div class="sg-note sg-warn" role="alert">(.*?)</div>', html)
    assert note is not None
    assert "does not answer right now" in note.group(1) and "within 5 s" in note.group(1)
    assert f"Showing what it said at {time.strftime('%H:%M UTC', time.gmtime(NOW))}" \
        in note.group(1)
    assert 'data-lease="L-alice"' in html  # the last answer's lease is still shown
    nothing = page_context(None, Viewer("alice", is_admin=False), {}, now=NOW, window=WINDOW,
                           hub_id="hub", unavailable="cannot reach the broker")
    html = template(TEMPLATE).render({**nothing, "refresh_s": 0})
    assert "cannot reach the broker" in html and "Showing what it said" not in html


def with_processes(reply: InventoryReply, states: dict[str, tuple[ProcessState,
                                                                  list[ProcessView]]],
                   ) -> InventoryReply:
    """``reply`` with a process state and its processes on the GPUs ``states`` names."""
    gpus = [gpu.model_copy(update=dict(zip(("process_state", "processes"),
                                           states[gpu.uuid], strict=True)))
            if gpu.uuid in states else gpu for gpu in reply.gpus]
    return reply.model_copy(update={"gpus": gpus})


SLICE = lease(lease_id="L-slice", request_key="hub/alice/small", user="alice", host="gpu-b",
              gpu_uuids=["GPU-gpu-b-0"], gpu_indices=[0], model=RTX3090, shared=True,
              memory_mib=4096, gpu_memory_used_mib=6144, over_budget_since=NOW - 720,
              outside_grant=["GPU-gpu-b-3"])
STRAY = ProcessView(pid=4242, memory_used_mib=900, name="python", container_id="f00dcafe",
                    container_name="miner", image="lab/miner:1")
LEFT_BEHIND = ProcessView(pid=77, memory_used_mib=512, name="python",
                          container_id="0123456789abcdef", lease_id="L-ended")


def process_states() -> InventoryReply:
    """alice's slice on gpu-b 0 is over budget and her container also uses gpu-b 3; bob's
    gpu-b 1 is shared with a stray container; gpu-a 1 drains; a process of an ended lease
    holds gpu-a 0 after the bound."""
    return with_processes(cluster_with([SLICE, BOB]), {
        "GPU-gpu-a-1": (ProcessState.DRAINING, []),
        "GPU-gpu-b-1": (ProcessState.OUTSIDE_USE, [
            STRAY, STRAY.model_copy(update={"pid": 4243, "memory_used_mib": 100}),
            ProcessView(pid=31, memory_used_mib=2048, container_id="c-bob",
                        lease_id="L-bob")]),
        "GPU-gpu-a-0": (ProcessState.STUCK_PROCESS, [LEFT_BEHIND]),
        "GPU-gpu-b-3": (ProcessState.OUTSIDE_USE, [
            ProcessView(pid=88, memory_used_mib=300, container_id="c-slice",
                        lease_id="L-slice"),
            ProcessView(pid=9, memory_used_mib=64, name="Xorg")]),
    })


def test_a_user_is_warned_of_their_slice_over_budget_and_gpus_outside_its_grant() -> None:
    context = page_context(process_states(), Viewer("alice", is_admin=False), {}, now=NOW,
                           window=WINDOW, hub_id="hub")
    card = context["held"][0]
    assert card["over_budget"] == {"since": time.strftime("%H:%M UTC", time.gmtime(NOW - 720)),
                                   "for": "12 min", "budget": "4 GiB", "use": "6 GiB"}
    assert card["outside_grant"] == ["GPU 3 (NVIDIA GeForce RTX 3090) on gpu-b"]
    html = template(TEMPLATE).render({**context, "refresh_s": 0})
    over = re.findall(r'<div class="sg-note sg-warn sg-over-budget"[^>]*>(.*?)</div>', html)
    assert len(over) == 1 and "server “small” uses more GPU memory than its slice" in over[0]
    assert "6 GiB of a 4 GiB budget" in over[0] and "(for 12 min)" in over[0]
    outside = re.findall(r'<div class="sg-note sg-danger sg-outside-grant"[^>]*>(.*?)</div>',
                         html)
    assert len(outside) == 1
    assert "also uses GPU 3 (NVIDIA GeForce RTX 3090) on gpu-b, which it was not given" \
        in outside[0] and "tell your GPU admin" in outside[0]
    # every GPU kept out, in plain words, and nothing of whose processes keep it out
    assert [(g["host"], g["index"], g["state"]) for g in context["kept_out"]] == [
        ("gpu-a", 0, "stuck"), ("gpu-a", 1, "draining"), ("gpu-b", 1, "outside use"),
        ("gpu-b", 3, "outside use")]
    kept = re.search(r'<table class="sg-table" id="sg-kept-out">(.*?)</table>', html, re.S)
    assert kept is not None and kept.group(1).count("in use outside swarm-gpu") == 2
    for private in ("miner", "4242", "L-ended", "bob", "Xorg", "pid"):
        assert private not in html, private
    assert 'id="sg-cluster"' not in html


def test_a_user_whose_gpu_a_stray_process_uses_is_told_so_but_not_whose() -> None:
    context = page_context(process_states(), Viewer("bob", is_admin=False), {}, now=NOW,
                           window=WINDOW, hub_id="hub")
    card = context["held"][0]
    assert (card["outside_use"], card["over_budget"], card["outside_grant"]) == (
        ["GPU 1"], None, [])
    html = template(TEMPLATE).render({**context, "refresh_s": 0})
    note = re.findall(r'<p class="sg-card-note sg-warn sg-shared-outside">(.*?)</p>', html)
    assert note == ["GPU 1 is also used by a process outside swarm-gpu: your server may get "
                    "less of it than it should. Your GPU admin sees whose it is."]
    assert "miner" not in html and "sg-over-budget" not in html


def test_an_admin_sees_what_keeps_each_gpu_out_and_whose_processes_those_are() -> None:
    context = page_context(process_states(), Viewer("root", is_admin=True), {}, now=NOW,
                           window=WINDOW, hub_id=None)
    rows = {(r["host"], r["index"]): r for r in context["cluster"]["gpus"]}
    assert {key: r["state"] for key, r in rows.items()} == {
        ("gpu-a", 0): "stuck", ("gpu-a", 1): "draining", ("gpu-b", 0): "held",
        ("gpu-b", 1): "outside use", ("gpu-b", 2): "held", ("gpu-b", 3): "outside use"}
    assert rows["gpu-b", 1]["processes"] == [
        "pids 4242, 4243 in container miner (lab/miner:1), 1000 MiB",
        "pid 31 in bob's default server (container c-bob), 2 GiB"]
    assert rows["gpu-b", 1]["holders"][0]["user"] == "bob"  # still held: the state says why
    assert rows["gpu-a", 0]["processes"] == [
        "pid 77 in ended lease L-ended (container 0123456789ab), 512 MiB"]
    assert rows["gpu-b", 3]["processes"] == [
        "pid 88 in alice's server “small” (container c-slice), 300 MiB",
        "pid 9 on the host (Xorg), 64 MiB"]
    assert rows["gpu-a", 1]["why"] == "being freed after a server ended (seconds)"
    assert rows["gpu-b", 2]["processes"] == [] and rows["gpu-b", 2]["why"] is None
    # the holder over its budget and outside its grant, as its owner is told
    assert rows["gpu-b", 0]["holders"][0]["warnings"] == [
        f"over budget since {time.strftime('%H:%M UTC', time.gmtime(NOW - 720))}",
        "also uses GPU 3 (outside its grant)"]
    assert rows["gpu-b", 2]["holders"][0]["warnings"] == []
    assert context["kept_out"] == [], "an admin has the whole table"
    html = template(TEMPLATE).render({**context, "refresh_s": 0})
    stuck = re.search(r'<tr class="sg-gpu"><td>gpu-a</td><td>0</td>.*?</tr>', html, re.S)
    assert stuck is not None
    assert 'class="sg-state-stuck"' in stuck.group(0)
    assert "a process of a server that ended still holds it" in stuck.group(0)
    assert "pid 77 in ended lease L-ended" in stuck.group(0)
    assert 'id="sg-kept-out"' not in html
    assert "· also uses GPU 3 (outside its grant)" in html
