"""The spawn form's HTML (pure): availability, choices, escaping, the allocator-down note."""

from __future__ import annotations

import re

from hubplugin.form import render_form, user_models
from hubplugin.options import GPUMode, GPUOptions, GPUPermissions, load_profiles, options_from_form
from hubplugin.templating import format_mib
from tests.support.hub_form import PROFILES, STAFF, parse
from tests.support.hub_inventory import A100, GTX1070, RTX3090, inventory

STUDENTS = GPUPermissions(allowed_models=["1070"], max_gpus=2, groups=["students"])


def test_lists_models_with_free_and_total() -> None:
    html = render_form(inventory(), permissions=STAFF)
    form = parse(html)
    models = {o["value"]: o["text"] for o in form.selects["model"]}
    assert next(iter(models)) == "any"
    assert "Any model (13 of 14 GPUs free)" in str(models["any"])
    assert "1/2 free" in str(models[GTX1070]) and "4 shared slots free" in str(models[GTX1070])
    assert "8/8 free" in str(models[A100]) and "80 GiB" in str(models[A100])
    assert "shared" not in str(models[RTX3090])
    # availability table: model, memory, free of total, slots, hosts
    text = " ".join(form.text)
    assert "Available now" in text
    assert "1 of 2" in text and "4 of 8" in text and "gpu-c: 8" in text


def test_count_choices_follow_the_user_limit() -> None:
    form = parse(render_form(inventory(), permissions=STUDENTS))
    assert [o["value"] for o in form.selects["count"]] == ["1", "2", "all"]
    form = parse(render_form(inventory(), permissions=GPUPermissions(max_gpus=3,
                                                           allow_all_gpus_of_host=False)))
    assert [o["value"] for o in form.selects["count"]] == ["1", "2", "3"]


def test_only_the_users_models_are_offered() -> None:
    form = parse(render_form(inventory(), permissions=STUDENTS))
    assert [o["value"] for o in form.selects["model"]] == ["any", GTX1070]
    text = " ".join(form.text)
    assert "2 other GPU models in the cluster are not available to you." in text
    assert A100 not in text


def test_hosts_carry_per_model_counts() -> None:
    form = parse(render_form(inventory(), permissions=STAFF))
    hosts = {o["value"]: o for o in form.selects["host"]}
    assert hosts[""]["text"].startswith("Any host")  # type: ignore[union-attr]
    assert hosts["gpu-a"]["data-free-any"] == "1"
    assert hosts["gpu-c"]["data-free-any"] == "8"
    assert hosts["gpu-a"]["data-slots-any"] == "4"
    assert hosts["gpu-b"]["text"] == "gpu-b — 4 free GPUs"


def test_allowed_hosts_filter_the_host_list() -> None:
    permissions = GPUPermissions(max_gpus=2, allowed_hosts=["gpu-b"])
    form = parse(render_form(inventory(), permissions=permissions))
    assert [o["value"] for o in form.selects["host"]] == ["", "gpu-b"]


def test_profiles_come_first_with_availability() -> None:
    html = render_form(inventory(), permissions=STUDENTS, profiles=PROFILES, wait_s=120)
    form = parse(html)
    assert [r["value"] for r in form.radios("profile")] == [
        "cpu", "one-1070", "small-share", "custom",
    ]
    assert form.checked("profile") == "one-1070"  # the default profile
    assert html.index('value="cpu"') < html.index('name="mode"')
    text = " ".join(form.text)
    assert "For light work" in text
    assert "1 of 2 free now" in text
    assert "4 of 8 shared slots free now" in text
    assert "waits up to 2 min in the queue" in text
    # submitting the defaults picks the profile
    assert options_from_form(form.submit()) == {"profile": "one-1070"}


def test_default_mode_and_previous_choice_are_preselected() -> None:
    form = parse(render_form(inventory(), permissions=STAFF, default_mode=GPUMode.EXCLUSIVE))
    assert form.checked("mode") == "exclusive"
    assert options_from_form(form.submit()) == {"mode": "exclusive"}
    previous = GPUOptions(mode=GPUMode.EXCLUSIVE, model="3090", count=2, host="gpu-b")
    form = parse(render_form(inventory(), permissions=STAFF, current=previous))
    assert form.selected("model") == RTX3090
    assert form.selected("count") == "2"
    assert form.selected("host") == "gpu-b"
    assert options_from_form(form.submit()) == {
        "mode": "exclusive", "model": RTX3090, "count": 2, "host": "gpu-b",
    }
    shared = GPUOptions(mode=GPUMode.SHARED, model="1070", share_memory_mib=3000)
    form = parse(render_form(inventory(), permissions=STAFF, current=shared))
    assert options_from_form(form.submit()) == {
        "mode": "shared", "model": GTX1070, "share_memory_mib": 3000,
    }


def test_share_memory_input_is_bounded() -> None:
    permissions = GPUPermissions(max_gpus=1, default_share_memory_mib=1024,
                                 max_share_memory_mib=4096)
    form = parse(render_form(inventory(), permissions=permissions))
    memory = next(i for i in form.inputs if i.get("name") == "share_memory_mib")
    assert memory["max"] == "4096" and memory["value"] == "1024" and memory["min"] == "1"
    form = parse(render_form(inventory(), permissions=GPUPermissions(max_gpus=1)))
    memory = next(i for i in form.inputs if i.get("name") == "share_memory_mib")
    assert memory["max"] == "8192"  # the largest shareable GPU


def test_allocator_unreachable_note_keeps_no_gpu_usable() -> None:
    html = render_form(None, permissions=STAFF, profiles=PROFILES,
                       unavailable="timed out <after 3 s>", default_mode=GPUMode.EXCLUSIVE)
    form = parse(html)
    assert "The GPU allocator is not reachable (timed out &lt;after 3 s&gt;)" in html
    assert "You can still start a server without a GPU" in html
    modes = {r["value"]: r for r in form.radios("mode")}
    assert "disabled" not in modes["none"] and "disabled" in modes["exclusive"]
    assert "disabled" in modes["shared"]
    assert form.checked("mode") == "none"
    profiles = {r["value"]: r for r in form.radios("profile")}
    assert "disabled" in profiles["one-1070"] and "disabled" not in profiles["cpu"]
    assert form.checked("profile") == "custom"  # the default profile needs a GPU
    assert options_from_form(form.submit()) == {"mode": "none"}
    assert "Available now" not in html


def test_user_without_gpus_sees_a_note() -> None:
    html = render_form(inventory(), permissions=GPUPermissions(max_gpus=0))
    assert "may not use GPUs" in html
    form = parse(html)
    assert form.checked("mode") == "none"
    assert "disabled" in {r["value"]: r for r in form.radios("mode")}["exclusive"]


def test_hostile_names_are_escaped() -> None:
    evil_model = '<img src=x onerror="alert(1)">'
    evil_host = 'gpu"><script>alert(2)</script>'
    inv = inventory({evil_host: [(evil_model, False)]})
    profiles = load_profiles([{"slug": "p", "display_name": "<b>bold</b>",
                               "description": "a & b <i>"}])
    html = render_form(inv, permissions=GPUPermissions(max_gpus=1), profiles=profiles,
                       unavailable=None, images={"<lab>": "img"})
    assert "<img" not in html and "<b>bold" not in html and "<lab>" not in html
    assert html.count("<script>") == 1  # only our own
    assert "alert(2)</script>" not in html
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;" in html
    form = parse(html)
    assert form.scripts == 1
    assert any(o["value"] == evil_model for o in form.selects["model"])
    assert any(o["value"] == evil_host for o in form.selects["host"])


def test_images_choice_when_offered() -> None:
    form = parse(render_form(inventory(), permissions=STAFF, images={"base": "a", "lab": "b"},
                             current_image="lab"))
    assert [o["value"] for o in form.selects["image"]] == ["base", "lab"]
    assert form.selected("image") == "lab"


def test_queue_length_is_shown() -> None:
    html = render_form(inventory(queued=3), permissions=STAFF)
    assert "3 requests are waiting for a GPU." in html


def test_user_models_and_format() -> None:
    assert [m.model for m in user_models(inventory(), STUDENTS)] == [GTX1070]
    assert user_models(None, STAFF) == []
    assert format_mib(8192) == "8 GiB" and format_mib(1536) == "1.5 GiB"
    assert format_mib(900) == "900 MiB" and format_mib(None) == "?"


def test_script_reads_only_data_attributes() -> None:
    html = render_form(inventory(), permissions=STAFF)
    script = html[html.index("<script>"):]
    assert GTX1070 not in script and "gpu-a" not in script
    assert re.search(r"getAttribute\(\"data-key\"\)", script)


def test_an_admin_template_replaces_a_block_of_the_packaged_form(tmp_path) -> None:
    (tmp_path / "spawn_form.html.j2").write_text(
        '{% extends "swarm_gpu/spawn_form.html.j2" %}'
        '{% block notes %}<div class="site-note">Ask {{ "<ops>" }} for more GPUs.</div>'
        "{{ super() }}{% endblock %}")
    html = render_form(inventory(), permissions=STAFF, template_paths=[str(tmp_path)])
    assert '<div class="site-note">Ask &lt;ops&gt; for more GPUs.</div>' in html
    form = parse(html)
    assert form.selected("model") == "any", "the rest is the packaged form, unchanged"
    assert "Available now" in html
    assert "site-note" not in render_form(inventory(), permissions=STAFF), "only where configured"


def test_an_admin_template_replaces_the_whole_form(tmp_path) -> None:
    (tmp_path / "spawn_form.html.j2").write_text(
        '<select name="mode">{% for m in modes %}<option value="{{ m.value }}">'
        "{{ m.label }}</option>{% endfor %}</select>")
    html = render_form(inventory(), permissions=STAFF, template_paths=[str(tmp_path)])
    assert html.startswith('<select name="mode">') and "sg-form" not in html
    assert [o["value"] for o in parse(html).selects["mode"]] == ["none", "exclusive", "shared"]


def test_choices_the_allocator_says_would_be_borrowed_are_marked() -> None:
    from allocator.wire.protocol import QuotaView
    from hubplugin.borrowing import BorrowOutlook, amounts_offered, choice_units
    from hubplugin.options import ModelCatalog

    reply = inventory()
    catalog = ModelCatalog(reply.models)
    # the amounts the form asks about: counts 1..4, the profiles', a GTX 1070 slice (4 slots)
    assert amounts_offered(STAFF, PROFILES, catalog) == {1.0, 2.0, 3.0, 4.0, 0.25}
    assert choice_units(PROFILES[2].options(), catalog) == 0.25
    assert choice_units(GPUOptions(mode=GPUMode.EXCLUSIVE, all_gpus_of_host=True), catalog) \
        is None
    quota = QuotaView(scope="user", name="alice", limit=2.0, held=1.0, free=1.0,
                      guaranteed=1.0, borrow_limit=2.0)
    borrow = BorrowOutlook(quotas=[quota],
                           borrowed={1.0: True, 2.0: True, 3.0: True, 4.0: True, 0.25: False})
    html = render_form(reply, permissions=STAFF, profiles=PROFILES, borrow=borrow)
    form = parse(html)
    profiles = {i["value"]: i for i in form.inputs if i.get("name") == "profile"}
    assert "data-borrowed" in profiles["one-1070"]
    assert "data-borrowed" not in profiles["small-share"]
    assert all("data-borrowed" in o for o in form.selects["count"])
    slices = {o["value"]: "data-slice-borrowed" in o for o in form.selects["model"]}
    assert slices == {"any": False, GTX1070: False, RTX3090: False, A100: False}
    assert re.search(r'<div id="sg-borrowed-note"[^>]* hidden>', html)
    assert "1 GPU guaranteed to you (you hold 1); beyond it, up to 2 GPUs in all" in html
    # without the allocator's answers, nothing is marked
    plain = parse(render_form(reply, permissions=STAFF, profiles=PROFILES))
    assert not any("data-borrowed" in i for i in plain.inputs)
    assert not any("data-borrowed" in o for o in plain.selects["count"])
    assert "guaranteed to you" not in "".join(plain.text)


def test_the_guarantees_that_allow_borrowing_are_listed() -> None:
    from allocator.wire.protocol import QuotaView
    from hubplugin.borrowing import BorrowOutlook

    def quota(scope: str, name: str, guaranteed: float | None, limit: float | None,
              held: float) -> QuotaView:
        return QuotaView(scope=scope, name=name, limit=limit, held=held,
                         free=None if limit is None else limit - held, guaranteed=guaranteed,
                         borrow_limit=limit)

    outlook = BorrowOutlook(quotas=[
        quota("user", "alice", 1.0, 1.0, 0.0),  # no borrowing: not listed
        quota("group", "students", 4.0, None, 2.5),
        quota("group", "staff", None, None, 0.0),  # unlimited: not listed
    ], borrowed={})
    assert outlook.summary() == ("4 GPUs guaranteed to group students (its members hold 2.5); "
                                 "beyond it, more while GPUs are free, borrowed")
    assert BorrowOutlook(quotas=[quota("user", "bob", 2.0, 2.0, 1.0)], borrowed={}).summary() \
        is None
    assert not outlook.would_borrow(None) and not outlook.would_borrow(3.0)
