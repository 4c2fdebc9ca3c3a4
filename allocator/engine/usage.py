"""Decayed usage in the engine: each user's and group's accumulator
(:mod:`allocator.placement.decayed_usage`), a lease folded in when it ends, rebuilt from the
ledger's recently ended leases on a load; and the two orders fair share takes from it.

Only leases that count against their owners (:attr:`~LeaseRecord.charged`) count; a lease
counts from its grant to its end (the hours it held GPUs, idle or busy). With
``usage_half_life_h`` 0 it keeps nothing and orders nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence

from allocator.config import AllocatorSettings
from allocator.engine.placement import Placer
from allocator.ledger.lease import LeaseRecord
from allocator.placement import decayed_usage
from allocator.placement.cluster import Cluster
from allocator.placement.decayed_usage import Charge, Usages

TABLE_REFRESH_S = 30.0
"""How long the orders use one table of usages (:meth:`UsageBook.table`)."""

Standing = tuple[float, float]
"""A user's usage, then the heaviest usage among the groups it asks in (groups only break a
tie between users)."""


class UsageBook:
    """The users' and groups' usages, and the cluster's model weights.

    Invariant: :attr:`usages` holds exactly the charged leases that held GPUs and ended
    (since the last :meth:`load`'s history window).
    """

    def __init__(self, settings: AllocatorSettings, cluster: Cluster, placer: Placer) -> None:
        self.half_life_h = settings.usage_half_life_h
        self.cluster = cluster
        self.placer = placer
        self.usages = Usages(self.half_life_h)
        self.charges: dict[str, Charge] = {}
        """Lease id -> its charge, for the leases held: made once (its weight is the
        cluster's when it is first counted), dropped when it ends."""
        self._table: tuple[float, dict[str, float], dict[str, float]] | None = None
        """(when, user -> usage, group -> usage): see :meth:`table`."""
        self.seen_at = 0.0
        """The latest ``now`` it was given: the time of the orders asked without one (a
        reply's queue position)."""
        self._weights: tuple[object, dict[str, float]] | None = None
        """(the model catalog they were counted for, the weights): counted again when the
        inventory changes (the placer's catalog is then another object)."""

    def seen(self, now: float) -> None:
        """The engine's time moved on: orders asked without a time are as of ``now``."""
        self.seen_at = max(self.seen_at, now)

    @property
    def on(self) -> bool:
        """Whether usage is kept (a half-life above 0)."""
        return self.half_life_h > 0

    def history_since(self, now: float) -> float | None:
        """From when a load needs the ended leases (None: it needs none)."""
        return decayed_usage.history_since(now, self.half_life_h)

    def load(self, history: Iterable[LeaseRecord], active: Iterable[str], now: float) -> None:
        """Rebuild from the ledger's leases that ended since :meth:`history_since` (those of
        ``active``, ids of leases the ledger holds as not final, are not counted twice)."""
        self.usages = Usages(self.half_life_h)
        self.charges = {}
        self._table = None
        self.seen(now)
        if not self.on:
            return
        skip = set(active)
        for record in history:
            charge = self.charge(record)
            if record.lease_id not in skip and record.released_at is not None \
                    and charge is not None:
                self.usages.fold(charge, record.released_at)

    def lease_ended(self, record: LeaseRecord, now: float) -> None:
        """Fold in a lease that held GPUs and ends at ``now``."""
        self.seen(now)
        charge = self.charge(record) if self.on else None
        self.charges.pop(record.lease_id, None)
        if charge is not None:
            self.usages.fold(charge, now)

    def charge(self, record: LeaseRecord) -> Charge | None:
        """The lease as usage counts it; None for one charged to nobody or never granted."""
        known = self.charges.get(record.lease_id)
        if known is not None and known.start == record.granted_at:
            return known
        if not record.charged or record.granted_at is None:
            return None
        charge = Charge(record.user, record.groups, float(record.units), self.weight(record),
                        record.granted_at)
        if record.state.holds_gpus:
            self.charges[record.lease_id] = charge
        return charge

    def weight(self, record: LeaseRecord) -> float:
        """The lease's weight: its model's; for a lease that mixes models, the mean of its
        GPUs' models' weights; 1 for a model the cluster no longer has."""
        catalog = self.placer.model_catalog()
        if self._weights is None or self._weights[0] is not catalog:
            # Physical GPUs: a MIG instance is part of its parent's GPU, counted once.
            self._weights = (catalog, decayed_usage.model_weights(
                gpu.model for gpu in self.cluster.gpus.values() if gpu.mig_parent_uuid is None))
        gpus = self.cluster.gpus
        return decayed_usage.lease_weight(
            record.model, (gpus[uuid].model for uuid in record.gpu_uuids if uuid in gpus),
            self._weights[1])

    def usage(self, holding: Iterable[LeaseRecord], now: float, *,
              users: Collection[str] | None = None, groups: Collection[str] | None = None
              ) -> tuple[dict[str, float], dict[str, float]]:
        """(user -> usage, group -> usage) at ``now``, with the ``holding`` leases counted up
        to ``now`` (:meth:`Usages.at`)."""
        self.seen(now)
        charges = (c for c in map(self.charge, holding) if c is not None)
        return self.usages.at(now, charges, users=users, groups=groups)

    def order(self, ids: Sequence[str], leases: Mapping[str, LeaseRecord],
              holding: Callable[[], Iterable[LeaseRecord]], now: float | None) -> list[str]:
        """The queued ``ids`` (in queue order) with waiters of equal priority put least recent
        use first (:data:`Standing`); equal standings keep the queue's order. Unchanged when
        usage is off. ``holding``: gives the leases that hold GPUs (asked only when needed);
        ``now`` None: as of the latest time it was given."""
        if not self.on or len(ids) < 2:
            return list(ids)
        waiting = [leases[lease_id] for lease_id in ids]
        standing = self.standings(waiting, holding, self.seen_at if now is None else now)

        def key(record: LeaseRecord) -> tuple[int, Standing]:
            return -record.priority, standing[record.lease_id]

        return [r.lease_id for r in sorted(waiting, key=key)]

    def standings(self, records: Sequence[LeaseRecord],
                  holding: Callable[[], Iterable[LeaseRecord]], now: float
                  ) -> dict[str, Standing]:
        """Lease id -> its owner's :data:`Standing` as of ``now`` (from :meth:`table`), for
        ``records`` (empty when off)."""
        if not self.on or not records:
            return {}
        by_user, by_group = self.table(holding, now)
        return {r.lease_id: (by_user.get(r.user, 0.0),
                             max((by_group.get(g, 0.0) for g in r.groups), default=0.0))
                for r in records}

    def table(self, holding: Callable[[], Iterable[LeaseRecord]], now: float
              ) -> tuple[dict[str, float], dict[str, float]]:
        """Every user's and group's usage, computed at most every :data:`TABLE_REFRESH_S`:
        the orders ask for it on each tick and each pass over the queue, and computing it
        walks every lease held (tens of milliseconds for thousands). Between two, a lease
        that ended is folded in with the value it was counted at, and one granted since
        counts nothing yet (a few seconds of use at most)."""
        cached = self._table
        if cached is None or not cached[0] <= now < cached[0] + TABLE_REFRESH_S:
            cached = self._table = (now, *self.usage(holding(), now))
        return cached[1], cached[2]
