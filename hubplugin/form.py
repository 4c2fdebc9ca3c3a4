"""The spawn form: named profiles first, then "choose the GPU yourself", then availability.

Pure: the form's data from an :class:`~allocator.wire.protocol.InventoryReply` (or None when the
allocator cannot be reached), the admin's profiles and the user's
:class:`~hubplugin.options.GPUPermissions`, rendered by the Jinja2 template
``hubplugin/templates/spawn_form.html.j2`` (JupyterHub ships Jinja2). An admin overrides the
template, as kubespawner's form is overridden, with a file of the same name in a directory of
``template_paths`` (the spawner's ``gpu_form_template_paths``); the template may also extend
the packaged one (``{% extends "swarm_gpu/spawn_form.html.j2" %}``) and replace a block.

Autoescape is on: every string that comes from outside (model and host names reported by node
agents, profile texts, messages) is HTML-escaped; the inline script reads only ``data-``
attributes, never interpolated text.

The field names match :func:`hubplugin.options.options_from_form`: ``profile``, ``mode``,
``model``, ``count`` (a number or ``all``), ``host`` and ``share_memory_mib`` (and ``image``
when the admin offers images, ``topology`` when a host reported how its GPUs are joined:
:mod:`hubplugin.links`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from allocator.bookings.outlook import UserOutlook
from allocator.wire.model_names import display_name
from allocator.wire.protocol import InventoryReply, ModelSummary

from .booked import booking_notes, mark_models, mark_profiles
from .borrowing import BorrowOutlook, choice_units
from .links import TIMES, best_link_of, link_words, reports_topology, topology_choices
from .options import (
    ANY_MODEL,
    CUSTOM_PROFILE,
    GPUMode,
    GPUOptions,
    GPUPermissions,
    ModelCatalog,
    Profile,
)
from .templating import format_mib, template

TEMPLATE = "spawn_form.html.j2"
"""The form's template name: an admin's file of this name replaces the packaged one."""


def user_models(
    inventory: InventoryReply | None, permissions: GPUPermissions
) -> list[ModelSummary]:
    """The models of the inventory this user may choose, hosts filtered to the allowed ones."""
    if inventory is None:
        return []
    catalog = ModelCatalog(inventory.models)
    if permissions.allowed_models is None:
        allowed = set(catalog.models)
    else:
        allowed = {c for c in (catalog.canonical(m) for m in permissions.allowed_models) if c}
    out = []
    for summary in inventory.models:
        if summary.model not in allowed:
            continue
        if permissions.allowed_hosts is not None:
            hosts = {h: n for h, n in summary.hosts.items() if h in permissions.allowed_hosts}
            summary = summary.model_copy(update={"hosts": hosts})
        out.append(summary)
    return sorted(out, key=lambda m: m.model)


def _free_slices(inventory: InventoryReply | None, model: str) -> dict[str, int]:
    """host -> free share slots of one model."""
    out: dict[str, int] = {}
    if inventory is None:
        return out
    for gpu in inventory.gpus:
        if gpu.model == model and gpu.share_slots > 1:
            out[gpu.host] = out.get(gpu.host, 0) + gpu.free_slots
    return out


def _availability_text(free: int, total: int, wait: bool) -> tuple[str, str]:
    if free > 0:
        return "sg-avail-ok", f"{free} of {total} free now"
    if wait:
        return "sg-avail-none", f"none of {total} free now: you will wait in the queue"
    return "sg-avail-none", f"none of {total} free now"


def _profile_availability(
    profile: Profile, inventory: InventoryReply | None, wait: bool
) -> tuple[str, str] | None:
    opts = profile.options()
    if opts.mode is GPUMode.NONE or inventory is None:
        return None
    catalog = ModelCatalog(inventory.models)
    if opts.any_model:
        models = list(catalog.models.values())
    else:
        name = catalog.canonical(opts.model)
        models = [catalog.models[name]] if name else []
    if not models:
        return "sg-avail-none", "no such GPU in the cluster right now"
    if opts.mode is GPUMode.SHARED:
        free = sum(m.free_slots for m in models if m.share_slots > 1)
        total = sum(m.total * m.share_slots for m in models if m.share_slots > 1)
        cls, text = _availability_text(free, total, wait)
        return cls, text.replace(" free", " shared slots free", 1) if free else text
    if opts.host is not None:
        free = sum(m.hosts.get(opts.host, 0) for m in models)
    else:
        free = sum(m.free for m in models)
    return _availability_text(free, sum(m.total for m in models), wait)


def _profile_cards(
    profiles: Sequence[Profile],
    selected: str,
    inventory: InventoryReply | None,
    wait: bool,
    gpus_reachable: bool,
    borrow: BorrowOutlook | None = None,
) -> tuple[list[dict[str, Any]], bool]:
    """The profile cards, and whether "custom" is the checked choice."""
    usable = {p.slug for p in profiles if gpus_reachable or not p.options().wants_gpu}
    catalog = ModelCatalog(inventory.models) if inventory is not None else None
    if selected not in usable:
        selected = CUSTOM_PROFILE
    cards = []
    for profile in profiles:
        off = profile.slug not in usable
        cards.append({
            "slug": profile.slug, "title": profile.display_name,
            "description": profile.description, "summary": profile.summary(),
            "availability": _profile_availability(profile, inventory, wait),
            "off": off, "checked": selected == profile.slug and not off,
            "borrowed": borrow is not None and borrow.would_borrow(
                choice_units(profile.options(), catalog)),
        })
    return cards, selected == CUSTOM_PROFILE


def _model_options(models: Sequence[ModelSummary], current: GPUOptions,
                   borrow: BorrowOutlook | None = None) -> list[dict[str, Any]]:
    free_any = sum(m.free for m in models)
    total_any = sum(m.total for m in models)
    chosen = current.model if not current.any_model else ANY_MODEL
    catalog = ModelCatalog(models)
    chosen_canonical = catalog.canonical(chosen) if chosen != ANY_MODEL else None
    options = [{"value": ANY_MODEL, "key": "any", "selected": chosen_canonical is None,
                "label": f"Any model ({free_any} of {total_any} GPUs free)",
                "slice_borrowed": False}]
    for i, m in enumerate(models):
        share = f", {m.free_slots} shared slots free" if m.share_slots > 1 else ""
        options.append({
            "value": m.model, "key": f"m{i}", "selected": m.model == chosen_canonical,
            "label": f"{display_name(m.model)} · {format_mib(m.memory_total_mib)} · "
                     f"{m.free}/{m.total} free{share}",
            "slice_borrowed": borrow is not None and m.share_slots > 1
            and borrow.would_borrow(1.0 / m.share_slots),
        })
    return options


def _host_options(
    inventory: InventoryReply | None,
    models: Sequence[ModelSummary],
    permissions: GPUPermissions,
    current: GPUOptions,
) -> list[dict[str, Any]]:
    options: list[dict[str, Any]] = [{"value": "", "data": [], "selected": False,
                                      "label": "Any host (the allocator picks the best fit)"}]
    if inventory is None:
        return options
    hosts = sorted(
        n.host for n in inventory.nodes
        if n.up and not n.drained and n.gpus > 0
        and (permissions.allowed_hosts is None or n.host in permissions.allowed_hosts)
    )
    slices = [_free_slices(inventory, m.model) for m in models]
    for host in hosts:
        free = [m.hosts.get(host, 0) for m in models]
        slots = [s.get(host, 0) for s in slices]
        data = [("data-host", host), ("data-free-any", sum(free)),
                ("data-slots-any", sum(slots))]
        data += [(f"data-free-m{i}", n) for i, n in enumerate(free)]
        data += [(f"data-slots-m{i}", n) for i, n in enumerate(slots)]
        options.append({
            "value": host, "data": data, "selected": current.host == host,
            "label": f"{host} — {sum(free)} free GPU{'' if sum(free) == 1 else 's'}",
        })
    return options


def _count_options(permissions: GPUPermissions, current: GPUOptions,
                   borrow: BorrowOutlook | None = None) -> list[dict[str, Any]]:
    options = [
        {"value": str(n), "label": f"{n} GPU{'' if n == 1 else 's'}",
         "selected": not current.all_gpus_of_host and current.count == n,
         "borrowed": borrow is not None and borrow.would_borrow(float(n)), "links": []}
        for n in range(1, max(permissions.max_gpus, 1) + 1)
    ]
    if permissions.allow_all_gpus_of_host:
        options.append({"value": "all", "label": "All GPUs of one host",
                        "selected": current.all_gpus_of_host,
                        # every GPU of a host is at least one: borrowed if one would be
                        "borrowed": borrow is not None and borrow.would_borrow(1.0),
                        "links": []})
    return options


def _with_links(count_options: list[dict[str, Any]], inventory: InventoryReply,
                models: Sequence[ModelSummary], current: GPUOptions) -> None:
    """Each multi-GPU count says the best connection that many free GPUs of one host could
    get now: "2 GPUs, NVLink" for any model, "2 x A100, NVLink" (with a multiplication sign)
    for one. The label is the chosen model's; ``data-link-any`` and ``data-link-m<i>`` (the
    model options' keys) hold each model's, which the script puts in the label when the
    model changes (empty: no host has that many free GPUs whose links it reported; the
    plain label then)."""
    catalog = ModelCatalog(models)
    chosen = None if current.any_model else catalog.canonical(current.model)
    for option in count_options:
        if not option["value"].isdigit() or int(option["value"]) < 2:
            continue
        count = int(option["value"])
        any_link = best_link_of(inventory, models, count)
        labels = {"any": f"{option['label']}, {link_words(any_link)}"
                  if any_link is not None else ""}
        for i, m in enumerate(models):
            level = best_link_of(inventory, [m], count)
            labels[f"m{i}"] = (f"{count} {TIMES} {display_name(m.model)}, {link_words(level)}"
                               if level is not None else "")
        option["links"] = [("data-label", option["label"])]
        option["links"] += [(f"data-link-{key}", text) for key, text in labels.items()]
        key = next((f"m{i}" for i, m in enumerate(models) if m.model == chosen), "any")
        option["label"] = labels[key] or option["label"]


def _availability(
    inventory: InventoryReply, models: Sequence[ModelSummary], hidden: int
) -> dict[str, Any]:
    rows = [
        {
            "model": display_name(m.model), "memory": format_mib(m.memory_total_mib),
            "free": f"{m.free} of {m.total}",
            "slots": f"{m.free_slots} of {m.total * m.share_slots}" if m.share_slots > 1
            else "—",
            "hosts": ", ".join(f"{h}: {n}" for h, n in sorted(m.hosts.items()) if n > 0)
            or "—",
        }
        for m in models
    ]
    notes = []
    if hidden:
        notes.append(
            f"{hidden} other GPU model{'' if hidden == 1 else 's'} in the cluster "
            f"{'is' if hidden == 1 else 'are'} not available to you."
        )
    if inventory.queued:
        notes.append(
            f"{inventory.queued} request{' is' if inventory.queued == 1 else 's are'} "
            "waiting for a GPU."
        )
    return {"rows": rows, "notes": notes}


def render_form(
    inventory: InventoryReply | None,
    *,
    permissions: GPUPermissions,
    profiles: Sequence[Profile] = (),
    current: GPUOptions | None = None,
    default_mode: GPUMode = GPUMode.NONE,
    unavailable: str | None = None,
    wait_s: float = 0.0,
    images: Mapping[str, str] | None = None,
    current_image: str | None = None,
    template_paths: Sequence[str] = (),
    borrow: BorrowOutlook | None = None,
    bookings: UserOutlook | None = None,
) -> str:
    """The HTML snippet the hub puts inside its spawn ``<form>`` (it adds the Start button).

    ``inventory`` None with ``unavailable`` set renders a note and keeps "no GPU" usable.
    ``profiles`` are the ones this user may use; ``current`` preselects a previous choice.
    ``images`` (display name -> image) adds an image choice, as DockerSpawner's own form does.
    ``template_paths``: directories searched for an admin's own ``spawn_form.html.j2`` first.
    ``borrow``: the allocator's answers on which choices would be borrowed (marked so).
    ``bookings``: what the inventory's bookings mean for this user (:mod:`hubplugin.booked`).
    """
    # What the template shows: plain data (strings, numbers, lists, dicts), nothing to call.
    gpus_reachable = inventory is not None
    models = user_models(inventory, permissions)
    may_use = permissions.may_use_gpus and gpus_reachable
    hidden = len(inventory.models) - len(models) if inventory is not None else 0

    if current is None:
        default = next((p for p in profiles if p.default), None)
        current = GPUOptions(
            mode=default_mode if may_use else GPUMode.NONE,
            profile=default.slug if default else None,
            share_memory_mib=permissions.default_share_memory_mib,
        )
    mode = current.mode if may_use or current.mode is GPUMode.NONE else GPUMode.NONE
    cards, custom_checked = _profile_cards(profiles, current.profile or CUSTOM_PROFILE,
                                           inventory, wait_s > 0, gpus_reachable, borrow)
    any_shareable = any(m.share_slots > 1 for m in models)
    memory_max = max((m.memory_total_mib for m in models if m.share_slots > 1), default=None)
    if permissions.max_share_memory_mib is not None:
        largest = permissions.max_share_memory_mib
        memory_max = min(memory_max or largest, largest)
    most = permissions.max_gpus
    limits = [f"at most {most} GPU{'' if most == 1 else 's'} per server"]
    if wait_s > 0:
        minutes = wait_s / 60
        wait_text = f"{minutes:g} min" if wait_s >= 60 else f"{wait_s:g} s"
        limits.append(f"if nothing fits now, your request waits up to {wait_text} in the queue")
    if borrow is not None and (borrowing := borrow.summary()):
        limits.append(borrowing)
    count_options = _count_options(permissions, current, borrow)
    # Only where a host reported its topology: the form of any other cluster stays as it was.
    topology_options: Sequence[dict[str, object]] = []
    if may_use and inventory is not None and reports_topology(inventory):
        _with_links(count_options, inventory, models, current)
        topology_options = topology_choices(current.topology)
    model_options = _model_options(models, current, borrow)
    # Bookings (0.3.0): the choices a booking of the user's covers or others' take back soon.
    outlook, at = bookings or UserOutlook(), inventory.at if inventory is not None else 0.0
    mark_models(model_options, outlook, at)
    mark_profiles(cards, profiles, ModelCatalog(inventory.models) if inventory else None,
                  outlook, at)
    context = {
        "gpus_reachable": gpus_reachable,
        "may_use_gpus": permissions.may_use_gpus,
        "unavailable_reason": f" ({unavailable})" if unavailable else "",
        "images": [{"name": k, "selected": k == current_image} for k in images or {}],
        "profiles": cards,
        "custom_profile": CUSTOM_PROFILE,
        "custom_checked": custom_checked,
        "legend": "Choose the GPU yourself" if profiles else "GPU",
        "modes": [
            {"value": value.value, "label": label, "enabled": enabled, "checked": mode is value}
            for value, label, enabled in (
                (GPUMode.NONE, "No GPU", True),
                (GPUMode.EXCLUSIVE, "Whole GPUs (exclusive)", may_use),
                (GPUMode.SHARED, "Shared slice of one GPU", may_use and any_shareable),
            )
        ],
        "model_options": model_options,
        "booking_notes": booking_notes(outlook, at),
        "count_options": count_options,
        "topology_options": topology_options,
        "host_options": _host_options(inventory, models, permissions, current),
        "memory_max": memory_max,
        "memory_max_text": format_mib(memory_max) if memory_max else "",
        "memory_value": current.share_memory_mib or permissions.default_share_memory_mib,
        "limits": limits,
        "availability": _availability(inventory, models, hidden) if inventory is not None
        else None,
    }
    return template(TEMPLATE, template_paths).render(context)
