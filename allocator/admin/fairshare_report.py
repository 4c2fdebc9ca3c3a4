"""``gpu-ledger fairshare``: each user's and group's decayed usage, as Slurm's ``sshare`` shows
it, computed from the ledger file the way the allocator rebuilds it after a restart
(:mod:`allocator.engine.usage`): the leases that ended within the history window and those
holding GPUs now, weighted by the models of the GPUs the ledger knows now.

The allocator's own figures can differ a little: it weighs a lease by the models of the
cluster when the lease ended.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass

from allocator.ledger.lease import LeaseRecord
from allocator.ledger.usage_history import ended_since, gpu_models, holding
from allocator.placement.decayed_usage import (
    Charge,
    Usages,
    history_since,
    lease_weight,
    model_weights,
)


@dataclass(frozen=True)
class Standing:
    """One user's or group's row."""

    name: str
    usage: float
    """Decayed weighted GPU-hours."""
    held: float
    """GPUs it holds now (a slice counts its share)."""


@dataclass(frozen=True)
class FairshareReport:
    """Users and groups, least recent use first (the order in which waiters of equal
    priority are served)."""

    half_life_h: float
    at: float
    users: list[Standing]
    groups: list[Standing]


def fairshare(conn: sqlite3.Connection, half_life_h: float, now: float) -> FairshareReport:
    """The decayed usages at ``now`` with this half-life (above 0)."""
    since = history_since(now, half_life_h)
    assert since is not None, "a half-life above 0"
    gpus = gpu_models(conn)
    weights = model_weights(model for model, instance in gpus.values() if not instance)

    def charge(record: LeaseRecord) -> Charge | None:
        if not record.charged or record.granted_at is None:
            return None
        weight = lease_weight(record.model, (gpus[u][0] for u in record.gpu_uuids if u in gpus),
                              weights)
        return Charge(record.user, record.groups, float(record.units), weight,
                      record.granted_at)

    usages = Usages(half_life_h)
    for record in ended_since(conn, since):
        ended = charge(record)
        if ended is not None and record.released_at is not None:
            usages.fold(ended, record.released_at)
    held = [c for c in map(charge, holding(conn)) if c is not None]
    by_user, by_group = usages.at(now, held)
    held_user: dict[str, float] = {}
    held_group: dict[str, float] = {}
    for c in held:
        held_user[c.user] = held_user.get(c.user, 0.0) + c.units
        for group in c.groups:
            held_group[group] = held_group.get(group, 0.0) + c.units
    return FairshareReport(
        half_life_h, now,
        sorted((Standing(n, u, held_user.get(n, 0.0)) for n, u in by_user.items()),
               key=lambda s: (s.usage, s.name)),
        sorted((Standing(n, u, held_group.get(n, 0.0)) for n, u in by_group.items()),
               key=lambda s: (s.usage, s.name)))
