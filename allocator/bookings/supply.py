"""The GPUs bookings draw on, and what each booking active at one instant can be given of
them.

Capacity is counted per model (a MIG profile's instances are a model of their own, see
:mod:`allocator.wire.model_names`) and host, from the same ``(host, model)`` groups
:mod:`allocator.wire.capacity` forms for a request. A booking without a host draws on every host of
its model; one with a host only on that host. So the bookings of one model fit at an instant
when, for every host, those pinned to it book no more than it has, and all of them together
book no more than the model has: what is left on the hosts is exactly what the unpinned ones
may share, wherever it is.

When they do not fit (GPUs went away after the bookings were made), bookings are served in
the order they were admitted: each gets what is left after the ones before it, so an earlier
booking is never cut for a later one.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from allocator.wire.capacity import GPUGroup, gpu_groups


@dataclass(frozen=True)
class Capacity:
    """GPUs per model and host."""

    gpus: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    """Canonical model -> host -> GPUs of that model there."""

    @classmethod
    def of_groups(cls, groups: Iterable[GPUGroup]) -> Capacity:
        """From :func:`allocator.wire.capacity.gpu_groups` of a request for one model; a group that
        mixes models (``model`` None) is no model's and is left out."""
        gpus: dict[str, dict[str, int]] = {}
        for group in groups:
            if group.model is not None and group.gpus > 0:
                hosts = gpus.setdefault(group.model, {})
                hosts[group.host] = hosts.get(group.host, 0) + group.gpus
        return cls(gpus)

    @classmethod
    def of_gpus(cls, gpus: Iterable[tuple[str, str]]) -> Capacity:
        """From one ``(host, model)`` pair per GPU that counts (present, not a GPU in MIG mode
        itself, not on a drained or lost node: the caller decides)."""
        return cls.of_groups(gpu_groups(gpus))

    def on(self, model: str, host: str | None = None) -> int:
        """GPUs of ``model``: on ``host``, or on every host."""
        hosts = self.gpus.get(model, {})
        return hosts.get(host, 0) if host is not None else sum(hosts.values())

    def hosts_text(self, model: str) -> str:
        """``gpu-a: 8, gpu-b: 4`` (or ``none``), for messages."""
        hosts = self.gpus.get(model, {})
        return ", ".join(f"{host}: {n}" for host, n in sorted(hosts.items())) or "none"


@dataclass(frozen=True)
class Draw:
    """One booking's claim at an instant: ``count`` GPUs of ``model``, on ``host`` or any."""

    model: str
    host: str | None
    count: int


def served(draws: Sequence[Draw], capacity: Capacity) -> list[int]:
    """What each draw gets, in the order given (the order the bookings were admitted): each
    as much of its count as is left after the draws before it, keeping every host's pinned
    draws within the host and every model's draws within the model."""
    total_used: dict[str, int] = {}
    host_used: dict[tuple[str, str], int] = {}
    given: list[int] = []
    for draw in draws:
        room = capacity.on(draw.model) - total_used.get(draw.model, 0)
        if draw.host is not None:
            key = (draw.model, draw.host)
            room = min(room, capacity.on(draw.model, draw.host) - host_used.get(key, 0))
        got = max(0, min(draw.count, room))
        total_used[draw.model] = total_used.get(draw.model, 0) + got
        if draw.host is not None:
            host_used[(draw.model, draw.host)] = host_used.get((draw.model, draw.host), 0) + got
        given.append(got)
    return given


def over(draws: Iterable[Draw], capacity: Capacity) -> int:
    """By how many GPUs the draws exceed what exists, in the worst of their constraints (a
    host's pinned draws against the host, a model's draws against the model); 0 or less when
    all fit."""
    total: dict[str, int] = {}
    pinned: dict[tuple[str, str], int] = {}
    for draw in draws:
        total[draw.model] = total.get(draw.model, 0) + draw.count
        if draw.host is not None:
            pinned[(draw.model, draw.host)] = pinned.get((draw.model, draw.host), 0) + draw.count
    excess = [n - capacity.on(model) for model, n in total.items()]
    excess += [n - capacity.on(model, host) for (model, host), n in pinned.items()]
    return max(excess, default=0)
