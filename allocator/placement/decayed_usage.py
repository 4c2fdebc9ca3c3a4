"""Decayed usage: how much each user and group held lately, for fair share's orders. Pure math,
no I/O, no clock (``now`` is passed in).

As Slurm's ``PriorityDecayHalfLife``: a lease that held ``units`` GPUs (a slice counts its
share) from ``s`` to ``e`` counts, at ``now``,

    units * weight * integral over t from s to e of 2 ** (-(now - t) / half_life) dt

in weighted GPU-hours: an hour held just now counts 1, one held a half-life ago counts 1/2.
``weight`` is the model's (:func:`model_weights`): held hours count whether the GPUs were
busy or idle (docs/design.md, "Fair share that remembers", says why). A half-life of 0
switches it off: every usage is 0, so nothing is ordered by it.

:class:`Accumulator` keeps one user's (or group's) ended leases as one number and the time it
is as of; the leases still held are added on the fly (:meth:`Accumulator.at`), so a lease
is folded in once, when it ends, and folding is order independent. :class:`Usages` holds
them for every user and group (the engine's, :mod:`allocator.engine.usage`, and ``gpu-ledger
fairshare``'s).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field

HOUR_S = 3600.0

HISTORY_HALF_LIVES = 10
"""A lease that ended this many half-lives ago counts less than 1/1000 of what it did: a
rebuild reads only the leases that ended since (:func:`history_since`)."""


def model_weights(models: Iterable[str]) -> dict[str, float]:
    """The weight of a GPU-hour of each model, from the models of the cluster's GPUs (one
    entry per physical GPU): ``total GPUs / (models * GPUs of that model)``. Holding every
    GPU of a model for an hour then counts the same, ``total / models``, whichever the model,
    so an hour of a scarce model counts more than one of a plentiful one; in a cluster of one
    model every weight is 1."""
    counts = Counter(models)
    total = sum(counts.values())
    return {model: total / (len(counts) * count) for model, count in counts.items()}


def lease_weight(model: str | None, gpu_models: Iterable[str],
                 weights: Mapping[str, float]) -> float:
    """A lease's weight: its ``model``'s; for a lease that mixes models (``model`` None), the
    mean over its GPUs' models (``gpu_models``); 1 for a model not weighed (gone from the
    cluster)."""
    if model is not None:
        return weights.get(model, 1.0)
    found = [weights.get(m, 1.0) for m in gpu_models]
    return sum(found) / len(found) if found else 1.0


def held(units: float, weight: float, start: float, end: float, now: float,
         half_life_h: float) -> float:
    """Weighted GPU-hours of holding ``units`` from ``start`` to ``end``, decayed to ``now``
    (times in seconds; 0 when the half-life is 0, or the span is empty). A span past ``now``
    is cut at ``now``: what is not held yet counts nothing."""
    end = min(end, now)
    if half_life_h <= 0 or end <= start or units <= 0:
        return 0.0
    rate = math.log(2) / (half_life_h * HOUR_S)  # per second
    # integral_s^e 2^(-(now-t)/H) dt = 2^(-(now-e)/H) * (1 - 2^(-(e-s)/H)) / rate
    return (units * weight * math.exp(-rate * (now - end)) * -math.expm1(-rate * (end - start))
            / rate / HOUR_S)


def decayed(value: float, since: float, now: float, half_life_h: float) -> float:
    """``value`` as of ``since``, decayed to ``now`` (never grown: a ``now`` before ``since``,
    as a clock set back gives, is taken as ``since``)."""
    if half_life_h <= 0:
        return 0.0
    if now <= since:
        return value
    return value * math.exp2(-(now - since) / (half_life_h * HOUR_S))


def history_since(now: float, half_life_h: float) -> float | None:
    """From when the ended leases still count (see :data:`HISTORY_HALF_LIVES`); None when the
    half-life is 0 (none counts)."""
    if half_life_h <= 0:
        return None
    return now - HISTORY_HALF_LIVES * half_life_h * HOUR_S


@dataclass(frozen=True)
class Held:
    """A lease still held, as its owner's usage counts it: ``units`` GPUs of ``weight``
    since ``start``."""

    units: float
    weight: float
    start: float


@dataclass
class Accumulator:
    """One user's (or group's) usage of the leases that ended: ``value`` weighted GPU-hours as
    of ``as_of``.

    Invariant: ``value`` is the sum, as of ``as_of``, of :func:`held` over the leases folded
    in; ``as_of`` is at least the end of each of them.
    """

    half_life_h: float
    value: float = 0.0
    as_of: float = 0.0

    def fold(self, units: float, weight: float, start: float, end: float) -> None:
        """Count a lease that held ``units`` GPUs of ``weight`` from ``start`` to ``end``."""
        if self.half_life_h <= 0:
            return
        at = max(self.as_of, end)
        self.value = (decayed(self.value, self.as_of, at, self.half_life_h)
                      + held(units, weight, start, end, at, self.half_life_h))
        self.as_of = at

    def at(self, now: float, holding: Iterable[Held] = ()) -> float:
        """The usage at ``now``: the ended leases', decayed, plus the leases of ``holding``
        (still held: counted up to ``now``)."""
        if self.half_life_h <= 0:
            return 0.0
        return decayed(self.value, self.as_of, now, self.half_life_h) + sum(
            held(h.units, h.weight, h.start, now, now, self.half_life_h) for h in holding)


@dataclass(frozen=True)
class Charge:
    """A lease as usage counts it: ``units`` GPUs of ``weight`` held from ``start`` by
    ``user`` (and so by each of its ``groups``)."""

    user: str
    groups: tuple[str, ...]
    units: float
    weight: float
    start: float


@dataclass
class Usages:
    """Every user's and group's :class:`Accumulator` (ended leases), and their usage at a time
    with the leases still held (:meth:`at`)."""

    half_life_h: float
    users: dict[str, Accumulator] = field(default_factory=dict)
    groups: dict[str, Accumulator] = field(default_factory=dict)

    def fold(self, charge: Charge, end: float) -> None:
        """Count a lease that ended at ``end`` for its user and each of its groups."""
        if self.half_life_h <= 0:
            return
        for table, name in ((self.users, charge.user), *((self.groups, g) for g in charge.groups)):
            table.setdefault(name, Accumulator(self.half_life_h)).fold(
                charge.units, charge.weight, charge.start, end)

    def at(self, now: float, holding: Iterable[Charge], *,
           users: Collection[str] | None = None, groups: Collection[str] | None = None
           ) -> tuple[dict[str, float], dict[str, float]]:
        """(user -> usage, group -> usage) at ``now``, the ``holding`` leases counted up to
        ``now``; ``users`` and ``groups``: only those (default: every one known or holding)."""
        h = self.half_life_h
        by_user = {u: a.at(now) for u, a in self.users.items() if users is None or u in users}
        by_group = {g: a.at(now) for g, a in self.groups.items()
                    if groups is None or g in groups}
        for name in users or ():
            by_user.setdefault(name, 0.0)
        for name in groups or ():
            by_group.setdefault(name, 0.0)
        # One pass over the leases held, each counted once (the hot path: a queue served while
        # thousands of leases hold GPUs).
        for charge in holding:
            mine = users is None or charge.user in users
            theirs = [g for g in charge.groups if groups is None or g in groups]
            if not mine and not theirs:
                continue
            count = held(charge.units, charge.weight, charge.start, now, now, h)
            if mine:
                by_user[charge.user] = by_user.get(charge.user, 0.0) + count
            for g in theirs:
                by_group[g] = by_group.get(g, 0.0) + count
        return by_user, by_group
