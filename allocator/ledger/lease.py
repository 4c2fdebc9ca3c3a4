"""A lease as the allocator keeps it in memory and in the ledger."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from fractions import Fraction
from functools import cache
from typing import Any

from allocator.wire.protocol import Lease, LeaseState, ReclaimReason, ReleaseReason


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
    owner: str | None = None
    """The broker user (AMQP ``user_id``, which the broker verifies) whose request made the
    lease: its hub. Only that user and ``admin_users`` may release it or see it
    (:func:`allocator.engine.leases.may_act_on`). None: not known (a lease from before owners
    were recorded, one adopted from its container's labels, or a request that carried no
    user_id), and then any broker user that may send requests may, as before."""

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
    def from_row(cls, row: dict[str, Any]) -> LeaseRecord:
        """Rebuild from a ledger row (JSON columns already decoded)."""
        values: dict[str, Any] = {name: row.get(name) for name in _field_names()}
        values["groups"] = tuple(row.get("groups") or ())
        values["gpu_uuids"] = tuple(row.get("gpu_uuids") or ())
        values["state"] = LeaseState(row["state"])
        values["env"] = dict(row.get("env") or {})
        values["request"] = dict(row.get("request") or {})
        values["shared"] = bool(row.get("shared"))
        values["priority"] = int(row.get("priority") or 0)
        values["units"] = Fraction(int(row.get("units_num") or 0), int(row.get("units_den") or 1))
        reason = row.get("release_reason")
        values["release_reason"] = ReleaseReason(reason) if reason else None
        warned = row.get("reclaim_reason")
        values["reclaim_reason"] = ReclaimReason(warned) if warned else None
        values["borrowed"] = bool(row.get("borrowed"))
        values["idle_gpu_s"] = float(row.get("idle_gpu_s") or 0.0)
        return cls(**values)

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
