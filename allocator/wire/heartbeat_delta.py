"""Heartbeat deltas: what changed since an agent's previous heartbeat, and the report back.

Pure functions, no I/O; the node agent and the allocator share them (this module is part of
the allocator's public surface, like :mod:`allocator.wire.protocol`).

- The agent keeps the report the allocator holds (its last full :class:`Heartbeat` with every
  delta since applied: :func:`apply_delta`) and, for each new heartbeat, sends
  :func:`delta_between` that report and the new one, or the full heartbeat when no delta can
  say what changed (a GPU or container came or went, the listing became incomplete, ...).
- The allocator keeps the same report per host and turns each delta back into the full
  heartbeat it stands for with :func:`apply_delta`, or learns that the delta does not fit (a
  gap in ``seq``): then it applies nothing but liveness and waits for the next full report.

Telemetry (memory used, utilization, temperature, power) counts as changed only when it left
the band of :class:`Thresholds` width (0-5 %, 5-10 %, ...) that holds the value last *reported*:
slow drift adds up to a change instead of hiding under the threshold forever, the value held is
never a threshold or more off, and every crossing of a multiple of the threshold is reported
(keep the allocator's ``idle_utilization_pct`` a multiple of the agent's
``delta_utilization_pct``, both 5 by default, and idle detection sees every crossing).
The processes on a GPU (``GPUInfo.processes``) count as changed when they become known or not
known, when a pid comes or goes or runs in another container (or under another name), and when
one pid's memory leaves its band (``memory_mib``); their order does not count. Anything else
about a GPU (health and its reasons, XIDs, ECC, MIG, identity, ``processes_omitted``) or a
container (its grant, name, start) counts at once. A container's measured ``usage`` (0.3.0)
never counts as a change: its counters grow at every heartbeat, and a delta per heartbeat for
them would be a full report's cost; a delta carries it when it carries the container anyway,
and every full report (``full_report_s``) carries all of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from allocator.wire.protocol import (
    ContainerInfo,
    GPUInfo,
    GPUProcess,
    Heartbeat,
    HeartbeatDelta,
    ProcessUse,
)


@dataclass(frozen=True)
class Thresholds:
    """The band widths of telemetry: a reading counts as changed when it left the band that
    holds the value last reported."""

    utilization_pct: float = 5.0
    memory_mib: int = 256
    temperature_c: float = 5.0
    power_w: float = 25.0


EXACT = Thresholds(utilization_pct=0.0, memory_mib=0, temperature_c=0.0, power_w=0.0)
"""Every change of telemetry counts: a delta then carries all a full report would."""

Entry = TypeVar("Entry", GPUInfo, ContainerInfo)

_TELEMETRY = ("memory_used_mib", "utilization_pct", "temperature_c", "power_w")
_NOT_COMPARED_WHOLE = {*_TELEMETRY, "processes"}
"""A GPU's fields compared on their own terms (within thresholds) rather than as they are."""
_IDENTITY = ("uuid", "index", "model", "memory_total_mib", "mig_mode", "mig_parent_uuid",
             "mig_profile", "mig_index")
"""What a GPU is: a change of any of it re-indexes placement, so it comes in a full report."""


def _moved(old: float | None, new: float | None, threshold: float) -> bool:
    """Whether a reading left the band of width ``threshold`` (0-5, 5-10, ...) that holds the
    value last reported: never more than a threshold off, and every crossing of a multiple
    of it is reported (the allocator's idle line at 5 % among them)."""
    if old is None or new is None:
        return old is not new
    if threshold <= 0:
        return new != old
    return math.floor(old / threshold) != math.floor(new / threshold)


def gpu_changed(old: GPUInfo, new: GPUInfo, thresholds: Thresholds) -> bool:
    """Whether ``new`` says something about the GPU that ``old`` does not (within thresholds)."""
    limits = (thresholds.memory_mib, thresholds.utilization_pct, thresholds.temperature_c,
              thresholds.power_w)
    for name, limit in zip(_TELEMETRY, limits, strict=True):
        if _moved(getattr(old, name), getattr(new, name), limit):
            return True
    if _processes_changed(old.processes, new.processes, thresholds):
        return True
    rest = new.model_dump(exclude=_NOT_COMPARED_WHOLE)
    return old.model_dump(exclude=_NOT_COMPARED_WHOLE) != rest


def _processes_changed(old: list[GPUProcess] | None, new: list[GPUProcess] | None,
                       thresholds: Thresholds) -> bool:
    """Whether a GPU's processes changed: known or not, which pids, any pid's container or
    name, or its memory beyond the threshold (order does not count)."""
    if old is None or new is None:
        return old is not new
    before = {process.pid: process for process in old}
    after = {process.pid: process for process in new}
    if before.keys() != after.keys():
        return True
    for pid, now in after.items():
        then = before[pid]
        if _moved(then.memory_used_mib, now.memory_used_mib, thresholds.memory_mib):
            return True
        if (then.name, then.container_id, then.container_name, then.image) != (
                now.name, now.container_id, now.container_name, now.image):
            return True
    return False


def _use_changed(old: list[ProcessUse], new: list[ProcessUse], thresholds: Thresholds) -> bool:
    if [u.gpu_uuid for u in old] != [u.gpu_uuid for u in new]:
        return True
    return any(_moved(a.memory_used_mib, b.memory_used_mib, thresholds.memory_mib)
               or _moved(a.utilization_pct, b.utilization_pct, thresholds.utilization_pct)
               for a, b in zip(old, new, strict=True))


def container_changed(old: ContainerInfo, new: ContainerInfo, thresholds: Thresholds) -> bool:
    """Whether ``new`` says something about the container that ``old`` does not: its GPU use
    beyond the thresholds, or anything else at all."""
    if _use_changed(old.gpu_use, new.gpu_use, thresholds):
        return True
    return (old.container_id, old.lease_id, old.name, old.started_at, old.grant) != (
        new.container_id, new.lease_id, new.name, new.started_at, new.grant)


def delta_between(reported: Heartbeat, current: Heartbeat,
                  thresholds: Thresholds) -> HeartbeatDelta | None:
    """The delta that brings ``reported`` up to ``current``; None when only a full report
    can: another agent or interval, a GPU or container that came, went, moved in the list or
    changed identity, or another ``containers_complete`` or ``source``."""
    if (reported.agent_id, reported.host, reported.interval_s, reported.source,
            reported.containers_complete) != (current.agent_id, current.host, current.interval_s,
                                              current.source, current.containers_complete):
        return None
    if [g.uuid for g in reported.gpus] != [g.uuid for g in current.gpus]:
        return None
    if [c.container_id for c in reported.containers] != [
            c.container_id for c in current.containers]:
        return None
    gpus = []
    for old, new in zip(reported.gpus, current.gpus, strict=True):
        if any(getattr(old, name) != getattr(new, name) for name in _IDENTITY):
            return None
        if gpu_changed(old, new, thresholds):
            gpus.append(new)
    containers = [new for old, new in zip(reported.containers, current.containers, strict=True)
                  if container_changed(old, new, thresholds)]
    return HeartbeatDelta(host=current.host, agent_id=current.agent_id, seq=current.seq,
                          sent_at=current.sent_at, interval_s=current.interval_s, gpus=gpus,
                          containers=containers)


def apply_delta(base: Heartbeat, delta: HeartbeatDelta) -> Heartbeat | None:
    """The full report ``delta`` stands for, applied onto ``base``; None when it does not fit:
    another host, agent or interval, a ``seq`` that is not the next one (a message in between
    was lost), or an entry ``base`` does not have or with another identity."""
    if (delta.host, delta.agent_id, delta.interval_s) != (base.host, base.agent_id,
                                                          base.interval_s):
        return None
    if delta.seq != base.seq + 1:
        return None
    gpus = _replaced(base.gpus, delta.gpus, lambda g: g.uuid,
                     lambda old, new: all(getattr(old, n) == getattr(new, n) for n in _IDENTITY))
    containers = _replaced(base.containers, delta.containers, lambda c: c.container_id,
                           lambda old, new: old.lease_id == new.lease_id)
    if gpus is None or containers is None:
        return None
    # No validation needed: the identities and sets are base's, which was validated.
    return base.model_copy(update={"seq": delta.seq, "sent_at": delta.sent_at, "gpus": gpus,
                                   "containers": containers})


def _replaced(held: list[Entry], changed: list[Entry], key: Callable[[Entry], str],
              same_identity: Callable[[Entry, Entry], bool]) -> list[Entry] | None:
    """``held`` with each entry of ``changed`` in place of the one with its key; None when
    ``changed`` names an entry ``held`` does not have, or gives it another identity."""
    if not changed:
        return held
    updates = {key(entry): entry for entry in changed}
    by_key = {key(entry): entry for entry in held}
    for name, entry in updates.items():
        old = by_key.get(name)
        if old is None or not same_identity(old, entry):
            return None
    return [updates.get(key(entry), entry) for entry in held]
