"""A lease as the allocator keeps it in memory and in the ledger."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from fractions import Fraction
from functools import cache, lru_cache
from typing import Any

from allocator.wire.protocol import Lease, LeaseState, ReclaimReason, ReleaseReason

ADOPTED_OWNER = "(adopted)"
"""The owner of a lease adopted from its running container's grant labels: no broker user's
request made it, and the labels name none (they cannot be told from forged ones). A reserved
name: give no broker user this one."""


@dataclass
class LeaseRecord:
    """One lease: a request, and (once granted) the GPUs it holds.

    ``queued`` leases hold no GPU; ``granted``, ``bound`` and ``releasing`` leases do;
    ``released`` and ``expired`` leases are history.
    """

    lease_id: str
    request_key: str
    user: str
    groups: tuple[str, ...]
    state: LeaseState
    created_at: float
    request: dict[str, Any]
    """The allocate request as received (JSON), so a queued request can be placed later."""
    priority: int = 0
    host: str | None = None
    gpu_uuids: tuple[str, ...] = ()
    model: str | None = None
    shared: bool = False
    memory_mib: int | None = None
    units: Fraction = Fraction(0)
    env: dict[str, str] = field(default_factory=dict)
    enqueued_at: float | None = None
    wait_until: float | None = None
    granted_at: float | None = None
    bind_deadline: float | None = None
    bound_at: float | None = None
    container_id: str | None = None
    releasing_at: float | None = None
    released_at: float | None = None
    release_reason: ReleaseReason | None = None
    released_by: str | None = None
    release_note: str | None = None
    borrowed: bool = False
    """Granted beyond its owner's guarantee (see :mod:`allocator.engine.reclaim`)."""
    reclaim_at: float | None = None
    """A pending warning's deadline: the container is stopped then, if still needed."""
    reclaim_reason: ReclaimReason | None = None
    reclaim_for: str | None = None
    """The queued lease the warning is for (the first waiter that needed it)."""
    reclaim_stopped_at: float | None = None
    """When the reclaim's stop was decided: the lease then ends with ``reclaim_reason``."""
    idle_since: float | None = None
    """Since when its processes have stayed under the idle thresholds; None: busy or unmeasured."""
    idle_gpu_s: float = 0.0
    """GPU-seconds spent idle in finished idle spells (units x seconds), for accounting."""
    usage_since: float | None = None
    """Usage measured by its node agent (:class:`~allocator.wire.protocol.LeaseUsage`): when
    the measurement last folded in began (node time); None: nothing measured yet. The totals
    below add up every measurement of the lease; ``usage_run_*`` are what the current
    measurement had reported when they were last folded in, so the next report adds only what
    it counted since (:func:`allocator.engine.lease_use.fold_usage`), even after a restart or
    takeover that lost the in-memory state."""
    energy_j: float | None = None
    """Joules measured (its share of its GPUs' energy counters)."""
    sm_s: float | None = None
    """SM-seconds measured (SM utilization as a fraction of one GPU, times seconds)."""
    memory_s: float | None = None
    """Memory-seconds measured (memory-bandwidth utilization, a fraction of one GPU, times
    seconds)."""
    peak_memory_mib: int | None = None
    """The most GPU memory its processes held on one GPU at once, over every measurement."""
    usage_run_energy_j: float | None = None
    usage_run_sm_s: float | None = None
    usage_run_memory_s: float | None = None
    owner: str | None = None
    """The broker user (AMQP ``user_id``, which the broker verifies) whose request made the
    lease: its hub. Only that user and ``admin_users`` may release it or see it
    (:func:`allocator.engine.leases.may_act_on`). None: not known (a lease from before owners
    were recorded, or a request that carried no user_id), and then any broker user that may
    send requests may, as before. :data:`ADOPTED_OWNER`: adopted from its container's labels
    (no broker user asked for it): admins only, and charged to nobody (:attr:`charged`)."""

    @property
    def charged(self) -> bool:
        """Whether the lease counts against its user's and groups' quotas, guarantees and
        bookings: every lease but one adopted from its container's labels, whose user and
        groups are only what a label says (anyone who may use a node's Docker API sets
        them)."""
        return self.owner != ADOPTED_OWNER

    def to_row(self) -> dict[str, Any]:
        """The ledger row (JSON-able scalars only)."""
        row: dict[str, Any] = {}
        for name in _field_names():
            value = getattr(self, name)
            if isinstance(value, tuple):
                value = list(value)
            elif isinstance(value, Fraction):
                value = float(value)
            elif isinstance(value, LeaseState | ReleaseReason | ReclaimReason):
                value = value.value
            row[name] = value
        row["units_num"] = self.units.numerator
        row["units_den"] = self.units.denominator
        return row

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> LeaseRecord:
        """Rebuild from a ledger row, column name -> value (JSON columns as stored, text, or
        already decoded)."""
        return row_reader(tuple(row))(tuple(row.values()))

    def to_protocol(self, queue_position: int | None = None) -> Lease:
        """The lease as replies show it."""
        return Lease(
            lease_id=self.lease_id,
            request_key=self.request_key,
            user=self.user,
            state=self.state,
            host=self.host,
            gpu_uuids=list(self.gpu_uuids),
            gpu_indices=[],
            model=self.model,
            shared=self.shared,
            memory_mib=self.memory_mib,
            env=dict(self.env),
            created_at=self.created_at,
            granted_at=self.granted_at,
            bound_at=self.bound_at,
            released_at=self.released_at,
            release_reason=self.release_reason,
            container_id=self.container_id,
            queue_position=queue_position,
            wait_until=self.wait_until,
            borrowed=self.borrowed,
            reclaim_at=self.reclaim_at,
            reclaim_reason=self.reclaim_reason,
            idle_since=self.idle_since,
        )


@cache
def _field_names() -> tuple[str, ...]:
    """The record's field names, once: ``dataclasses.fields`` on every row written or read
    was a measurable part of each grant's and of a cold start's time."""
    return tuple(f.name for f in fields(LeaseRecord))


_CONVERTED = frozenset({"groups", "gpu_uuids", "state", "env", "request", "shared", "priority",
                        "units", "release_reason", "reclaim_reason", "borrowed", "idle_gpu_s"})
"""The fields a row's column does not give as they are: JSON text, enums, flags, the units'
fraction (two columns) and the numbers a missing value defaults."""


def _json(value: Any) -> Any:
    """A JSON column as stored (text) or already decoded; None or empty text is None."""
    if isinstance(value, str):
        # Most leases name no groups: skip the decoder for the commonest text.
        return () if value == "[]" else (json.loads(value) if value else None)
    return value


@lru_cache(maxsize=16)
def row_reader(columns: tuple[str, ...]) -> Callable[[Sequence[Any]], LeaseRecord]:
    """A function that rebuilds a record from one row of ``columns`` (a cursor's values, in
    that order; JSON columns as text or decoded). A column the row lacks reads as None, a field
    no column gives as None or its empty value.

    The one rule for reading a lease row. A cold start reads tens of thousands of them, and a
    dict per row, a decoded copy of it and a lookup per field were a measurable part of the
    ledger's load (docs/benchmarks.md, cold start).
    """
    at = {name: index for index, name in enumerate(columns)}
    plain = tuple((name, at[name]) for name in _field_names()
                  if name in at and name not in _CONVERTED)
    absent = dict.fromkeys(name for name in _field_names()
                           if name not in at and name not in _CONVERTED)

    state = at["state"]  # a lease row without its state is no lease row (KeyError)
    groups, uuids, env, request = (at.get(n) for n in ("groups", "gpu_uuids", "env",
                                                       "request"))
    shared, priority, num, den = (at.get(n) for n in ("shared", "priority", "units_num",
                                                      "units_den"))
    released, warned, borrowed, idle = (at.get(n) for n in (
        "release_reason", "reclaim_reason", "borrowed", "idle_gpu_s"))

    def cell(values: Sequence[Any], position: int | None) -> Any:
        return None if position is None else values[position]

    def read(values: Sequence[Any]) -> LeaseRecord:
        kwargs: dict[str, Any] = {name: values[position] for name, position in plain}
        if absent:
            kwargs.update(absent)
        release_reason, reclaim_reason = cell(values, released), cell(values, warned)
        return LeaseRecord(
            **kwargs,
            groups=tuple(_json(cell(values, groups)) or ()),
            gpu_uuids=tuple(_json(cell(values, uuids)) or ()),
            state=LeaseState(values[state]),
            env=dict(_json(cell(values, env)) or {}),
            request=dict(_json(cell(values, request)) or {}),
            shared=bool(cell(values, shared)),
            priority=int(cell(values, priority) or 0),
            units=Fraction(int(cell(values, num) or 0), int(cell(values, den) or 1)),
            release_reason=ReleaseReason(release_reason) if release_reason else None,
            reclaim_reason=ReclaimReason(reclaim_reason) if reclaim_reason else None,
            borrowed=bool(cell(values, borrowed)),
            idle_gpu_s=float(cell(values, idle) or 0.0),
        )

    return read
