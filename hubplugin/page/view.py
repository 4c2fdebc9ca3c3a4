"""What the GPU page shows, as plain data for its template: pure, no I/O, the clock passed in.

From one inventory reply (with its leases), the page's usage history and who is looking:

- *your GPUs*: each lease of the viewer on this hub (held or queued) with its host, model,
  GPUs and how they are joined ("2 GPUs, NVLink"), utilization and memory now and as a chart
  over the history, how long it has been idle, whether it is guaranteed or borrowed, and a
  pending reclaim with its deadline;
- *warnings on your GPUs*: a shared slice over its memory budget, a container that uses GPUs it
  was not granted, a process outside swarm-gpu on a GPU you hold;
- *the cluster* (admins only): every GPU with its holders (and their GPUs' links), their idle
  time and borrowing, the processes that keep it out of placement (container, image, pids),
  and the queue;
- *bookings* (:mod:`hubplugin.page.calendar`): the viewer's own, and for admins the week's
  calendar; a reclaim warning for a booking names it;
- *GPUs kept out* (everyone else): which GPUs are draining, stuck or in use outside swarm-gpu,
  without whose containers or processes those are.

The allocator decides "idle", "borrowed", "reclaim", "over budget", "outside grant" and each
GPU's process state: the page shows what the lease and the GPU say, never a rule of its own.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from allocator.bookings.outlook import outlook_for
from allocator.wire.model_names import display_name
from allocator.wire.protocol import (
    GPUView,
    InventoryReply,
    Lease,
    LeaseState,
    ProcessState,
    ProcessView,
    ReclaimReason,
)

from ..links import lease_link
from ..options import request_key
from ..templating import format_mib
from .calendar import my_bookings, week_calendar
from .chart import usage_chart
from .usage import UsagePoint, gpus_by_uuid, lease_usage


@dataclass(frozen=True)
class Viewer:
    """Who looks at the page, as the hub identified them."""

    name: str
    is_admin: bool
    groups: tuple[str, ...] = ()
    """The hub groups they are in (whose bookings are theirs)."""


@dataclass(frozen=True)
class Window:
    """The chart's time span and when a line breaks for missing samples."""

    span_s: float
    """The longest a chart goes back."""
    gap_s: float
    """Samples further apart than this are not joined by a line."""
    min_span_s: float = 600.0
    """The shortest chart: a lease younger than this gets a chart this long, not one of its
    few seconds."""

    def start_for(self, since: float, now: float) -> float:
        """Where a lease's chart starts: its grant, within ``span_s`` and ``min_span_s``."""
        return max(now - self.span_s, min(since, now - min(self.min_span_s, self.span_s)))


def clock(at: float) -> str:
    """Epoch seconds as ``14:32 UTC`` (the page speaks UTC: the hub may be anywhere)."""
    return time.strftime("%H:%M UTC", time.gmtime(at))


def duration(seconds: float) -> str:
    """``42 s``, ``12 min``, ``3 h 5 min``, ``2 d 4 h``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h" if hours else f"{days} d"


def server_label(lease: Lease) -> str:
    """The hub server a lease belongs to (its request key is ``hub/user/server``):
    ``default server`` or ``server “name”``; the key itself when it is not a hub's."""
    parts = lease.request_key.split("/", 2)
    if len(parts) == 3 and parts[1] == lease.user:
        return f"server “{parts[2]}”" if parts[2] else "default server"
    return lease.request_key


def on_this_hub(lease: Lease, hub_id: str | None) -> bool:
    """Whether a lease was asked for by this hub (all hubs' when ``hub_id`` is None)."""
    return hub_id is None or lease.request_key.startswith(request_key(hub_id, lease.user, ""))


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f} %"


def _memory(point: UsagePoint | None) -> str:
    if point is None or point.memory_used_mib is None:
        return "—"
    return f"{format_mib(point.memory_used_mib)} of {format_mib(point.memory_total_mib)}"


def _fair_share(lease: Lease, now: float) -> dict[str, Any]:
    """Guaranteed or borrowed, idle time and a pending reclaim, as the allocator says."""
    reclaim = None
    if lease.reclaim_at is not None:
        why = ("it has been idle while others wait for a GPU"
               if lease.reclaim_reason is ReclaimReason.IDLE
               else "it is borrowed beyond your guarantee, and someone within theirs waits")
        if lease.reclaim_booking is not None:  # the allocator names the booking (0.3.0)
            why = (f"its GPUs are booked for {lease.reclaim_booking}, whose members need "
                   "them then")
        reclaim = {"at": clock(lease.reclaim_at), "in": duration(lease.reclaim_at - now),
                   "why": why, "epoch": f"{lease.reclaim_at:.0f}",
                   "booking": lease.reclaim_booking}
    return {
        "share": "borrowed" if lease.borrowed else "guaranteed",
        "idle": None if lease.idle_since is None else duration(now - lease.idle_since),
        "reclaim": reclaim,
    }


def _gpu_list(lease: Lease) -> str:
    if not lease.gpu_indices:
        return "—"
    label = "GPU" if len(lease.gpu_indices) == 1 else "GPUs"
    return f"{label} {', '.join(str(i) for i in lease.gpu_indices)}"


def lease_card(lease: Lease, gpus: Mapping[str, GPUView], history: Sequence[UsagePoint],
               *, now: float, window: Window) -> dict[str, Any]:
    """One held lease of the viewer."""
    point = lease_usage(lease, gpus, now)
    model = display_name(lease.model) if lease.model else "—"
    what = f"slice of {format_mib(lease.memory_mib)}" if lease.shared else _gpu_list(lease)
    since = lease.bound_at or lease.granted_at or lease.created_at
    return {
        "lease_id": lease.lease_id,
        "server": server_label(lease),
        "state": lease.state.value,
        "host": lease.host or "—",
        "model": model,
        "what": what,
        "link": lease_link(lease),
        "whole_gpu": lease.shared and lease.utilization_pct is None,
        "since": f"{clock(since)} ({duration(now - since)} ago)",
        "utilization": _percent(point.utilization_pct if point else None),
        "memory": _memory(point),
        "chart": usage_chart(history, start=window.start_for(since, now), end=now,
                             gap_s=window.gap_s),
        **_fair_share(lease, now),
        **_process_warnings(lease, gpus, now),
    }


def _gpu_name(uuid: str, gpus: Mapping[str, GPUView]) -> str:
    """``GPU 1 (NVIDIA GeForce GTX 1070) on gpu-a``; the uuid when the inventory lacks it."""
    gpu = gpus.get(uuid)
    if gpu is None:
        return uuid
    return f"GPU {gpu.index} ({display_name(gpu.model)}) on {gpu.host}"


def _process_warnings(lease: Lease, gpus: Mapping[str, GPUView], now: float) -> dict[str, Any]:
    """What the processes on a lease's GPUs say is wrong, for its owner: its slice beyond its
    memory budget, its container on GPUs it was not granted, and others' processes on its GPUs
    (never whose: that is for admins)."""
    over_budget = None
    if lease.over_budget_since is not None:
        use = lease.gpu_memory_used_mib
        over_budget = {
            "since": clock(lease.over_budget_since),
            "for": duration(now - lease.over_budget_since),
            "budget": format_mib(lease.memory_mib) if lease.memory_mib is not None else "—",
            "use": format_mib(use) if use is not None else "more",
        }
    shared_with_outside = [
        f"GPU {gpus[uuid].index}" for uuid in lease.gpu_uuids
        if uuid in gpus and gpus[uuid].process_state is ProcessState.OUTSIDE_USE]
    return {
        "over_budget": over_budget,
        "outside_grant": [_gpu_name(uuid, gpus) for uuid in lease.outside_grant],
        "outside_use": shared_with_outside,
    }


def queued_card(lease: Lease, *, now: float) -> dict[str, Any]:
    """One queued request of the viewer."""
    return {
        "lease_id": lease.lease_id,
        "server": server_label(lease),
        "position": lease.queue_position,
        "waiting": duration(now - lease.created_at),
        "until": clock(lease.wait_until) if lease.wait_until else None,
        # a queued request names no model yet: the lease says what it got, not what it asked
        "model": display_name(lease.model) if lease.model else None,
    }


PROCESS_STATES: Mapping[ProcessState, tuple[str, str]] = {
    ProcessState.DRAINING: ("draining", "being freed after a server ended (seconds)"),
    ProcessState.STUCK_PROCESS: ("stuck", "a process of a server that ended still holds it"),
    ProcessState.OUTSIDE_USE: ("outside use", "in use outside swarm-gpu"),
}
"""Each process state: its short name (the state column) and what it means, in plain words."""


def _pids(processes: Sequence[ProcessView]) -> str:
    label = "pid" if len(processes) == 1 else "pids"
    return f"{label} {', '.join(str(p.pid) for p in processes)}"


def process_lines(processes: Sequence[ProcessView] | None,
                  leases: Mapping[str, Lease]) -> list[str]:
    """For admins: who runs the processes on a GPU, one line per container (its name and
    image, or the lease it runs for) and one for the host's own processes."""
    by_container: dict[str | None, list[ProcessView]] = {}
    for process in processes or ():
        by_container.setdefault(process.container_id, []).append(process)
    lines = []
    for container_id, group in by_container.items():
        memory = sum(p.memory_used_mib or 0 for p in group)
        used = f", {format_mib(memory)}" if memory else ""
        first = group[0]
        if container_id is None:
            names = ", ".join(sorted({p.name for p in group if p.name}))
            lines.append(f"{_pids(group)} on the host{f' ({names})' if names else ''}{used}")
        elif first.lease_id is not None:
            lease = leases.get(first.lease_id)
            owner = (f"{lease.user}'s {server_label(lease)}" if lease is not None
                     else f"ended lease {first.lease_id}")
            lines.append(f"{_pids(group)} in {owner} (container {container_id[:12]}){used}")
        else:
            name = first.container_name or container_id[:12]
            image = f" ({first.image})" if first.image else ""
            lines.append(f"{_pids(group)} in container {name}{image}{used}")
    return lines


def kept_out(gpus: Sequence[GPUView]) -> list[dict[str, Any]]:
    """For users who are not admins: the GPUs that processes keep out of placement and why,
    in plain words, without whose containers or processes those are."""
    return [{"host": gpu.host, "index": gpu.index, "model": display_name(gpu.model),
             "state": PROCESS_STATES[gpu.process_state][0],
             "why": PROCESS_STATES[gpu.process_state][1]}
            for gpu in gpus if gpu.process_state is not None]


def _holder_warnings(lease: Lease, gpus: Mapping[str, GPUView]) -> list[str]:
    """For admins, next to a holder: over its slice's budget, GPUs used outside its grant."""
    warnings = []
    if lease.over_budget_since is not None:
        warnings.append(f"over budget since {clock(lease.over_budget_since)}")
    if lease.outside_grant:
        used = ", ".join(f"GPU {gpus[uuid].index}" if uuid in gpus else uuid
                         for uuid in lease.outside_grant)
        warnings.append(f"also uses {used} (outside its grant)")
    return warnings


def _gpu_row(gpu: GPUView, leases: Mapping[str, Lease], gpus: Mapping[str, GPUView],
             now: float) -> dict[str, Any]:
    holders: list[dict[str, Any]] = []
    for lease_id in gpu.holders:
        lease = leases.get(lease_id)
        if lease is None:
            holders.append({"user": "?", "server": lease_id, "share": None, "idle": None,
                            "reclaim": None, "warnings": [], "link": None})
            continue
        holders.append({"user": lease.user, "server": server_label(lease),
                        "link": lease_link(lease),
                        "warnings": _holder_warnings(lease, gpus), **_fair_share(lease, now)})
    if gpu.health.value != "healthy":
        state = "unhealthy"
    elif gpu.drained:
        state = "drained"
    elif gpu.mig_enabled:
        state = "MIG mode"
    elif gpu.conflict:
        state = "conflict"
    elif gpu.process_state is not None:
        state = PROCESS_STATES[gpu.process_state][0]
    elif holders:
        state = "held"
    else:
        state = "free"
    return {
        "host": gpu.host,
        "index": gpu.index if gpu.mig_profile is None else f"{gpu.index} ({gpu.mig_profile})",
        "model": display_name(gpu.model),
        "state": state,
        "utilization": _percent(gpu.utilization_pct),
        "memory": f"{format_mib(gpu.memory_used_mib)} of {format_mib(gpu.memory_total_mib)}",
        "holders": holders,
        "why": PROCESS_STATES[gpu.process_state][1] if gpu.process_state else None,
        # who keeps it out; the processes of a GPU that is free to place stay unlisted
        "processes": process_lines(gpu.processes, leases) if gpu.process_state else [],
    }


def page_context(inventory: InventoryReply | None, viewer: Viewer,
                 history: Mapping[str, Sequence[UsagePoint]], *, now: float, window: Window,
                 hub_id: str | None, unavailable: str | None = None,
                 hub_prefix: str = "/hub/") -> dict[str, Any]:
    """Everything the page's template shows, for this viewer."""
    context: dict[str, Any] = {
        "user": viewer.name, "is_admin": viewer.is_admin, "now": clock(now),
        "unavailable": unavailable, "span": duration(window.span_s), "hub_prefix": hub_prefix,
        "held": [], "queued": [], "cluster": None, "kept_out": [],
        "as_of": clock(inventory.at) if inventory is not None else None,
        "bookings": [], "calendar": None,
    }
    if inventory is None:
        return context
    # Bookings (0.3.0): the viewer's own, and for admins the week's calendar.
    context["bookings"] = my_bookings(
        outlook_for(inventory.bookings, viewer.name, viewer.groups, now), now)
    if viewer.is_admin:
        context["calendar"] = week_calendar(inventory.bookings, now)
    gpus = gpus_by_uuid(inventory.gpus)
    leases = {lease.lease_id: lease for lease in inventory.leases or []}
    mine = [lease for lease in leases.values()
            if lease.user == viewer.name and on_this_hub(lease, hub_id)]
    context["held"] = [
        lease_card(lease, gpus, history.get(lease.lease_id, ()), now=now, window=window)
        for lease in sorted(mine, key=lambda lease: lease.granted_at or lease.created_at)
        if lease.state.holds_gpus
    ]
    context["queued"] = [
        queued_card(lease, now=now)
        for lease in sorted(mine, key=lambda lease: lease.queue_position or 0)
        if lease.state is LeaseState.QUEUED
    ]
    if viewer.is_admin:
        queue = sorted((lease for lease in leases.values() if lease.state is LeaseState.QUEUED),
                       key=lambda lease: lease.queue_position or 0)
        context["cluster"] = {
            "gpus": [_gpu_row(gpu, leases, gpus, now) for gpu in inventory.gpus],
            "nodes_down": [node.host for node in inventory.nodes if not node.up],
            "queue": [{"user": lease.user, **queued_card(lease, now=now)}
                      for lease in queue],
        }
    else:
        context["kept_out"] = kept_out(inventory.gpus)
    return context


def samples_of(inventory: InventoryReply) -> list[tuple[str, str, UsagePoint]]:
    """``(lease_id, user, point)`` for each lease that holds reported GPUs: one sample."""
    gpus = gpus_by_uuid(inventory.gpus)
    rows = []
    for lease in inventory.leases or []:
        if not lease.state.holds_gpus:
            continue
        point = lease_usage(lease, gpus, inventory.at)
        if point is not None:
            rows.append((lease.lease_id, lease.user, point))
    return rows
