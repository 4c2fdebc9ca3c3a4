"""The spawn form: named profiles first, then "choose the GPU yourself", then availability.

Pure: HTML from an :class:`~allocator.protocol.InventoryReply` (or None when the allocator
cannot be reached), the admin's profiles and the user's :class:`~hubplugin.options.GPUPolicy`.
Every string that comes from outside this module (model and host names reported by node
agents, profile texts, messages) is HTML-escaped; the inline script reads only ``data-``
attributes, never interpolated text.

The field names match :func:`hubplugin.options.options_from_form`: ``profile``, ``mode``,
``model``, ``count`` (a number or ``all``), ``host`` and ``share_memory_mib`` (and ``image``
when the admin offers images).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape

from allocator.model_names import display_name
from allocator.protocol import InventoryReply, ModelSummary

from .options import (
    ANY_MODEL,
    CUSTOM_PROFILE,
    GPUMode,
    GPUOptions,
    GPUPolicy,
    ModelCatalog,
    Profile,
)


def _e(value: object) -> str:
    return escape(str(value), quote=True)


def format_mib(mib: int | None) -> str:
    """8192 -> '8 GiB', 1536 -> '1.5 GiB', 900 -> '900 MiB'."""
    if mib is None:
        return "?"
    if mib >= 1024:
        gib = mib / 1024
        return f"{gib:.0f} GiB" if gib == int(gib) or gib >= 100 else f"{gib:.1f} GiB"
    return f"{mib} MiB"


def user_models(inventory: InventoryReply | None, policy: GPUPolicy) -> list[ModelSummary]:
    """The models of the inventory this user may choose, hosts filtered to the allowed ones."""
    if inventory is None:
        return []
    catalog = ModelCatalog(inventory.models)
    if policy.allowed_models is None:
        allowed = set(catalog.models)
    else:
        allowed = {c for c in (catalog.canonical(m) for m in policy.allowed_models) if c}
    out = []
    for summary in inventory.models:
        if summary.model not in allowed:
            continue
        if policy.allowed_hosts is not None:
            hosts = {h: n for h, n in summary.hosts.items() if h in policy.allowed_hosts}
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


_STYLE = """
<style>
.sg-form { text-align: left; }
.sg-form .sg-section { margin: 0 0 1.1rem 0; }
.sg-form .sg-section > legend, .sg-form h2.sg-h {
  font-size: 1.05rem; font-weight: 600; margin: 0 0 .45rem 0; float: none; }
.sg-form .sg-profiles { display: grid; grid-template-columns: repeat(auto-fill, minmax(14rem, 1fr));
  gap: .5rem; }
.sg-form label.sg-card { display: block; border: 1px solid #ccc; border-radius: .4rem;
  padding: .5rem .65rem; cursor: pointer; margin: 0; font-weight: normal; }
.sg-form label.sg-card:has(input:checked) { border-color: #f37626; box-shadow: 0 0 0 2px #f3762640;
  background: #fff8f3; }
.sg-form label.sg-card.sg-off { opacity: .55; cursor: not-allowed; }
.sg-form .sg-card-title { font-weight: 600; }
.sg-form .sg-card small, .sg-form .sg-hint { color: #555; display: block; }
.sg-form .sg-card small.sg-tag { display: inline-block; margin: .3rem 0 .1rem 0;
  padding: .05rem .4rem; border-radius: .25rem; background: #eef2f7; color: #1f3a5a;
  font-weight: 600; }
.sg-form .sg-card small.sg-avail-ok, .sg-form .sg-avail-ok { color: #1a7f37; }
.sg-form .sg-card small.sg-avail-none, .sg-form .sg-avail-none { color: #a04d00; }
.sg-form .sg-grid { display: grid; grid-template-columns: 9rem 1fr; gap: .45rem .75rem;
  align-items: center; }
.sg-form .sg-grid > label { margin: 0; font-weight: 600; }
.sg-form .sg-modes { display: flex; flex-wrap: wrap; gap: .3rem 1.1rem; }
.sg-form .sg-modes label { font-weight: normal; margin: 0; }
.sg-form fieldset:disabled .sg-grid, .sg-form .sg-dim { opacity: .5; }
.sg-form table.sg-avail { width: 100%; font-size: .9rem; margin: 0; }
.sg-form table.sg-avail th, .sg-form table.sg-avail td { padding: .25rem .4rem;
  border-bottom: 1px solid #e3e3e3; vertical-align: top; }
.sg-form table.sg-avail th { font-weight: 600; background: #f6f6f6; }
.sg-form .sg-num { text-align: right; white-space: nowrap; }
.sg-form .sg-note { padding: .55rem .75rem; border-radius: .35rem; margin-bottom: 1rem; }
.sg-form .sg-warn { background: #fff4e5; border: 1px solid #f0b35b; }
.sg-form .sg-info { background: #eef5fb; border: 1px solid #b6d4ee; }
</style>
"""

_SCRIPT = """
<script>
(function () {
  var root = document.getElementById("sg-form");
  if (!root) { return; }
  var custom = document.getElementById("sg-custom");
  function checked(name) {
    var el = root.querySelector('input[name="' + name + '"]:checked');
    return el ? el.value : null;
  }
  function update() {
    var profile = checked("profile");
    custom.disabled = profile !== null && profile !== "custom";
    var mode = checked("mode") || "none";
    var model = document.getElementById("sg-model");
    var count = document.getElementById("sg-count");
    var host = document.getElementById("sg-host");
    var memory = document.getElementById("sg-memory");
    var gpu = mode !== "none";
    [model, host].forEach(function (el) { if (el) { el.disabled = !gpu; } });
    if (count) { count.disabled = mode !== "exclusive"; }
    if (memory) { memory.disabled = mode !== "shared"; }
    if (model && host) {
      var sel = model.options[model.selectedIndex];
      var key = sel ? sel.getAttribute("data-key") : "any";
      for (var i = 0; i < host.options.length; i++) {
        var opt = host.options[i];
        var name = opt.getAttribute("data-host");
        if (!name) { continue; }
        var attr = mode === "shared" ? "data-slots-" + key : "data-free-" + key;
        var n = opt.getAttribute(attr);
        var unit = mode === "shared" ? " free shared slot" : " free GPU";
        opt.textContent = name + " \\u2014 " + (n || "0") + unit + (n === "1" ? "" : "s");
      }
    }
  }
  root.addEventListener("change", update);
  update();
})();
</script>
"""


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


def _render_profiles(
    profiles: Sequence[Profile],
    selected: str,
    inventory: InventoryReply | None,
    wait: bool,
    gpus_reachable: bool,
) -> str:
    cards = []
    usable = {p.slug for p in profiles if gpus_reachable or not p.options().wants_gpu}
    if selected not in usable:
        selected = CUSTOM_PROFILE
    for profile in profiles:
        off = profile.slug not in usable
        availability = _profile_availability(profile, inventory, wait)
        parts = [
            f'<label class="sg-card{" sg-off" if off else ""}">',
            f'<input type="radio" name="profile" value="{_e(profile.slug)}"'
            f'{" checked" if selected == profile.slug and not off else ""}'
            f'{" disabled" if off else ""}> ',
            f'<span class="sg-card-title">{_e(profile.display_name)}</span>',
        ]
        if profile.description:
            parts.append(f"<small>{_e(profile.description)}</small>")
        parts.append(f'<small class="sg-tag">{_e(profile.summary())}</small>')
        if availability is not None:
            cls, text = availability
            parts.append(f'<small class="{cls}">{_e(text)}</small>')
        parts.append("</label>")
        cards.append("".join(parts))
    cards.append(
        '<label class="sg-card">'
        f'<input type="radio" name="profile" value="{CUSTOM_PROFILE}"'
        f'{" checked" if selected == CUSTOM_PROFILE else ""}> '
        '<span class="sg-card-title">Custom</span>'
        "<small>Choose the GPU model, count, host or a shared slice below.</small>"
        "</label>"
    )
    return (
        '<fieldset class="sg-section"><legend>Profile</legend>'
        f'<div class="sg-profiles">{"".join(cards)}</div></fieldset>'
    )


def _model_options(models: Sequence[ModelSummary], current: GPUOptions) -> str:
    free_any = sum(m.free for m in models)
    total_any = sum(m.total for m in models)
    chosen = current.model if not current.any_model else ANY_MODEL
    catalog = ModelCatalog(models)
    chosen_canonical = catalog.canonical(chosen) if chosen != ANY_MODEL else None
    opts = [
        f'<option value="{ANY_MODEL}" data-key="any"'
        f'{" selected" if chosen_canonical is None else ""}>'
        f"Any model ({free_any} of {total_any} GPUs free)</option>"
    ]
    for i, m in enumerate(models):
        sel = " selected" if m.model == chosen_canonical else ""
        share = f", {m.free_slots} shared slots free" if m.share_slots > 1 else ""
        opts.append(
            f'<option value="{_e(m.model)}" data-key="m{i}"{sel}>'
            f"{_e(display_name(m.model))} · {_e(format_mib(m.memory_total_mib))} · "
            f"{m.free}/{m.total} free{share}</option>"
        )
    return "".join(opts)


def _host_options(
    inventory: InventoryReply | None,
    models: Sequence[ModelSummary],
    policy: GPUPolicy,
    current: GPUOptions,
) -> str:
    opts = ['<option value="">Any host (the allocator picks the best fit)</option>']
    if inventory is None:
        return "".join(opts)
    hosts = sorted(
        n.host for n in inventory.nodes
        if n.up and not n.drained and n.gpus > 0
        and (policy.allowed_hosts is None or n.host in policy.allowed_hosts)
    )
    slices = [_free_slices(inventory, m.model) for m in models]
    for host in hosts:
        free = [m.hosts.get(host, 0) for m in models]
        slots = [s.get(host, 0) for s in slices]
        attrs = [f'data-host="{_e(host)}"', f'data-free-any="{sum(free)}"',
                 f'data-slots-any="{sum(slots)}"']
        attrs += [f'data-free-m{i}="{n}"' for i, n in enumerate(free)]
        attrs += [f'data-slots-m{i}="{n}"' for i, n in enumerate(slots)]
        sel = " selected" if current.host == host else ""
        label = f"{host} — {sum(free)} free GPU{'' if sum(free) == 1 else 's'}"
        opts.append(f'<option value="{_e(host)}" {" ".join(attrs)}{sel}>{_e(label)}</option>')
    return "".join(opts)


def _count_options(policy: GPUPolicy, current: GPUOptions) -> str:
    top = max(policy.max_gpus, 1)
    opts = []
    for n in range(1, top + 1):
        sel = " selected" if not current.all_gpus_of_host and current.count == n else ""
        opts.append(f'<option value="{n}"{sel}>{n} GPU{"" if n == 1 else "s"}</option>')
    if policy.allow_all_gpus_of_host:
        sel = " selected" if current.all_gpus_of_host else ""
        opts.append(f'<option value="all"{sel}>All GPUs of one host</option>')
    return "".join(opts)


def _availability_table(
    inventory: InventoryReply, models: Sequence[ModelSummary], hidden: int
) -> str:
    rows = []
    for m in models:
        hosts = ", ".join(
            f"{_e(h)}: {n}" for h, n in sorted(m.hosts.items()) if n > 0
        ) or "—"
        slots = f"{m.free_slots} of {m.total * m.share_slots}" if m.share_slots > 1 else "—"
        rows.append(
            f"<tr><td>{_e(display_name(m.model))}</td>"
            f'<td class="sg-num">{_e(format_mib(m.memory_total_mib))}'
            f'</td><td class="sg-num">{m.free} of {m.total}</td>'
            f'<td class="sg-num">{slots}</td><td>{hosts}</td></tr>'
        )
    if not rows:
        rows.append('<tr><td colspan="5">No GPU you may use has reported yet.</td></tr>')
    extra = []
    if hidden:
        extra.append(
            f"{hidden} other GPU model{'' if hidden == 1 else 's'} in the cluster "
            f"{'is' if hidden == 1 else 'are'} not available to you."
        )
    if inventory.queued:
        extra.append(
            f"{inventory.queued} request{' is' if inventory.queued == 1 else 's are'} "
            "waiting for a GPU."
        )
    foot = f'<small class="sg-hint">{" ".join(extra)}</small>' if extra else ""
    return (
        '<div class="sg-section"><h2 class="sg-h">Available now</h2>'
        '<table class="sg-avail"><thead><tr><th>Model</th><th class="sg-num">Memory</th>'
        '<th class="sg-num">Free GPUs</th><th class="sg-num">Free shared slots</th>'
        "<th>Hosts with free GPUs</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table>{foot}</div>"
    )


def render_form(
    inventory: InventoryReply | None,
    *,
    policy: GPUPolicy,
    profiles: Sequence[Profile] = (),
    current: GPUOptions | None = None,
    default_mode: GPUMode = GPUMode.NONE,
    unavailable: str | None = None,
    wait_s: float = 0.0,
    images: Mapping[str, str] | None = None,
    current_image: str | None = None,
) -> str:
    """The HTML snippet the hub puts inside its spawn ``<form>`` (it adds the Start button).

    ``inventory`` None with ``unavailable`` set renders a note and keeps "no GPU" usable.
    ``profiles`` are the ones this user may use; ``current`` preselects a previous choice.
    ``images`` (display name -> image) adds an image choice, as DockerSpawner's own form does.
    """
    gpus_reachable = inventory is not None
    models = user_models(inventory, policy)
    may_use = policy.may_use_gpus and gpus_reachable
    hidden = len(inventory.models) - len(models) if inventory is not None else 0

    if current is None:
        default = next((p for p in profiles if p.default), None)
        current = GPUOptions(
            mode=default_mode if may_use else GPUMode.NONE,
            profile=default.slug if default else None,
            share_memory_mib=policy.default_share_memory_mib,
        )
    selected_profile = current.profile or CUSTOM_PROFILE
    mode = current.mode if may_use or current.mode is GPUMode.NONE else GPUMode.NONE

    html: list[str] = [_STYLE, '<div id="sg-form" class="sg-form">']
    if not gpus_reachable:
        reason = f" ({unavailable})" if unavailable else ""
        html.append(
            '<div class="sg-note sg-warn" role="alert"><strong>GPUs cannot be requested right '
            f"now.</strong> The GPU allocator is not reachable{_e(reason)}. You can still start "
            "a server without a GPU, or try again in a minute.</div>"
        )
    elif not policy.may_use_gpus:
        html.append(
            '<div class="sg-note sg-info">Your account may not use GPUs here; servers start '
            "without one. Ask an administrator if you need a GPU.</div>"
        )

    if images:
        opts = "".join(
            f'<option value="{_e(k)}"{" selected" if k == current_image else ""}>{_e(k)}</option>'
            for k in images
        )
        html.append(
            '<div class="sg-section sg-grid"><label for="sg-image">Image</label>'
            f'<select class="form-select" id="sg-image" name="image">{opts}</select></div>'
        )

    if profiles:
        html.append(_render_profiles(profiles, selected_profile, inventory, wait_s > 0,
                                     gpus_reachable))

    def mode_radio(value: GPUMode, label: str, enabled: bool) -> str:
        return (
            f'<label><input type="radio" name="mode" value="{value.value}"'
            f'{" checked" if mode is value else ""}{"" if enabled else " disabled"}> '
            f"{label}</label>"
        )

    any_shareable = any(m.share_slots > 1 for m in models)
    memory_max = max((m.memory_total_mib for m in models if m.share_slots > 1), default=None)
    if policy.max_share_memory_mib is not None:
        memory_max = min(memory_max or policy.max_share_memory_mib, policy.max_share_memory_mib)
    memory_value = current.share_memory_mib or policy.default_share_memory_mib
    legend = "Choose the GPU yourself" if profiles else "GPU"
    html.append(
        f'<fieldset id="sg-custom" class="sg-section"><legend>{legend}</legend>'
        '<div class="sg-grid">'
        "<label>GPU use</label>"
        '<div class="sg-modes">'
        + mode_radio(GPUMode.NONE, "No GPU", True)
        + mode_radio(GPUMode.EXCLUSIVE, "Whole GPUs (exclusive)", may_use)
        + mode_radio(GPUMode.SHARED, "Shared slice of one GPU", may_use and any_shareable)
        + "</div>"
        '<label for="sg-model">Model</label>'
        f'<select class="form-select" id="sg-model" name="model">'
        f"{_model_options(models, current)}</select>"
        '<label for="sg-count">GPUs</label>'
        f'<select class="form-select" id="sg-count" name="count">'
        f"{_count_options(policy, current)}</select>"
        '<label for="sg-host">Host</label>'
        f'<select class="form-select" id="sg-host" name="host">'
        f"{_host_options(inventory, models, policy, current)}</select>"
        '<label for="sg-memory">Shared memory</label>'
        '<div><input class="form-control" type="number" id="sg-memory" name="share_memory_mib"'
        ' min="1" step="1"'
        + (f' max="{memory_max}"' if memory_max else "")
        + (f' value="{memory_value}"' if memory_value else "")
        + ' placeholder="MiB (default: an equal share of the GPU)">'
        + '<small class="sg-hint">MiB of GPU memory for a shared slice'
        + (f", at most {_e(format_mib(memory_max))}" if memory_max else "")
        + ".</small></div>"
        "</div>"
    )
    limits = [f"at most {policy.max_gpus} GPU{'' if policy.max_gpus == 1 else 's'} per server"]
    if wait_s > 0:
        minutes = wait_s / 60
        wait_text = f"{minutes:g} min" if wait_s >= 60 else f"{wait_s:g} s"
        limits.append(f"if nothing fits now, your request waits up to {wait_text} in the queue")
    html.append(f'<small class="sg-hint">You may use {"; ".join(limits)}.</small></fieldset>')

    if inventory is not None:
        html.append(_availability_table(inventory, models, hidden))
    html.append("</div>")
    html.append(_SCRIPT)
    return "\n".join(html)
