"""Showback: what ``gpu-ledger usage`` prints per user, group, model or host, and the
right-size suggestions for slices.

Over :func:`allocator.admin.reports.usage` (GPU-hours held, idle and measured per key and
model): the rows with their idle share, the GPU-hours really used, kWh, peak memory and,
with prices configured (``price_per_gpu_hour`` per model, ``price_per_kwh``), their cost.
And :func:`right_size`: the shared slices of a period whose measured peak memory stayed
under half their budget, with the budget that would have fit. Suggestions only: nothing here
changes a lease or a setting.
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from allocator.admin.reports import (
    MEASURED_COLUMNS,
    Filters,
    UsageBy,
    UsageRow,
    held_interval,
    lease_columns_or_null,
    lease_where,
)

RIGHT_SIZE_STEP_MIB = 512
"""A suggested budget is a multiple of this."""

RIGHT_SIZE_HEADROOM = 1.25
"""A suggested budget leaves this much room over the peak measured (25 % more)."""


@dataclass(frozen=True)
class Prices:
    """The showback prices of the settings (``price_per_gpu_hour``, ``price_per_kwh``)."""

    per_gpu_hour: Mapping[str, float] = field(default_factory=dict)
    per_kwh: float | None = None

    @property
    def any(self) -> bool:
        """Whether any price is set (else no cost is shown)."""
        return bool(self.per_gpu_hour) or self.per_kwh is not None

    def cost(self, model: str, gpu_hours: float, kwh: float) -> float:
        """The GPU-hours held at the model's price (none: free) and the kWh at the price of
        energy (none: free)."""
        return (gpu_hours * self.per_gpu_hour.get(model, 0.0)
                + kwh * (self.per_kwh or 0.0))


@dataclass(frozen=True)
class ShowbackRow:
    """One row of ``gpu-ledger usage``: one key (and model, except ``--by model``)."""

    key: str
    model: str
    gpu_hours: float
    used_gpu_hours: float
    measured_gpu_hours: float
    idle_share: float
    kwh: float
    peak_memory_mib: int | None
    leases: int
    cost: float | None
    idle_gpu_hours: float = 0.0
    reclaimed: int = 0
    idle_released: int = 0


def showback(rows: Sequence[UsageRow], prices: Prices) -> list[ShowbackRow]:
    """The usage rows as printed: the idle share is of the GPU-hours held (idle spells);
    cost only when some price is set."""
    return [ShowbackRow(
        key=row.key, model=row.model, gpu_hours=row.gpu_hours,
        used_gpu_hours=row.used_gpu_hours, measured_gpu_hours=row.measured_gpu_hours,
        idle_share=row.idle_gpu_hours / row.gpu_hours if row.gpu_hours > 0 else 0.0,
        kwh=row.kwh, peak_memory_mib=row.peak_memory_mib, leases=row.leases,
        cost=prices.cost(row.model, row.gpu_hours, row.kwh) if prices.any else None,
        idle_gpu_hours=row.idle_gpu_hours, reclaimed=row.reclaimed,
        idle_released=row.idle_released)
        for row in rows]


def columns(by: UsageBy, prices: Prices) -> list[str]:
    """The columns of the CSV and JSON output, in order (those of releases before first, so
    a script that read them still does)."""
    names = [by] if by == "model" else [by, "model"]
    names += ["gpu_hours", "leases", "idle_gpu_hours", "reclaimed", "idle_released",
              "used_gpu_hours", "measured_gpu_hours", "idle_share", "kwh", "peak_memory_mib"]
    return [*names, "cost"] if prices.any else names


def values(row: ShowbackRow, by: UsageBy, prices: Prices) -> list[Any]:
    """One row's values in the order of :func:`columns` (numbers rounded to 6 places)."""
    out: list[Any] = [row.key] if by == "model" else [row.key, row.model]
    out += [round(row.gpu_hours, 6), row.leases, round(row.idle_gpu_hours, 6), row.reclaimed,
            row.idle_released, round(row.used_gpu_hours, 6), round(row.measured_gpu_hours, 6),
            round(row.idle_share, 6), round(row.kwh, 6), row.peak_memory_mib]
    if prices.any:
        out.append(None if row.cost is None else round(row.cost, 6))
    return out


@dataclass(frozen=True)
class RightSize:
    """A slice whose measured peak memory stayed under half its budget."""

    lease_id: str
    user: str
    host: str
    model: str
    budget_mib: int
    peak_memory_mib: int
    suggested_mib: int


RIGHT_SIZE_COLUMNS = ("lease_id", "user", "host", "model", "budget_mib", "peak_memory_mib",
                      "suggested_mib")


def suggested_budget(peak_mib: int) -> int:
    """The budget that would have fit: the peak with :data:`RIGHT_SIZE_HEADROOM`, rounded up to
    :data:`RIGHT_SIZE_STEP_MIB` (at least one step)."""
    wanted = math.ceil(peak_mib * RIGHT_SIZE_HEADROOM / RIGHT_SIZE_STEP_MIB)
    return max(wanted, 1) * RIGHT_SIZE_STEP_MIB


def right_size(conn: sqlite3.Connection, filters: Filters, *, until: float) -> list[RightSize]:
    """The shared slices that held their GPU within the period, whose peak memory was
    measured and stayed under half their budget (oldest first)."""
    if "NULL AS peak_memory_mib" in lease_columns_or_null(conn, MEASURED_COLUMNS):
        return []  # a ledger before schema 8: nothing measured
    where = lease_where(Filters(since=filters.since, until=until, user=filters.user,
                                 host=filters.host), holding_only=True)
    where.add("granted_at < ?", until)
    where.add("shared = 1")
    where.add("memory_mib IS NOT NULL")
    where.add("peak_memory_mib IS NOT NULL")
    where.add("peak_memory_mib * 2 < memory_mib")
    sql = ("SELECT lease_id, user, host, model, memory_mib, peak_memory_mib, granted_at, "
           f"released_at, state FROM leases{where.sql()} ORDER BY granted_at, lease_id")
    found = []
    for (lease_id, user, host, model, budget, peak, granted_at, released_at,
         state) in conn.execute(sql, where.params):
        if held_interval(granted_at, released_at, state, filters.since, until) <= 0:
            continue
        if not filters.model_matches(model):
            continue
        found.append(RightSize(lease_id, user, host or "", model or "", int(budget), int(peak),
                               min(suggested_budget(int(peak)), int(budget))))
    return found


def right_size_values(item: RightSize) -> list[Any]:
    """One suggestion's values in the order of :data:`RIGHT_SIZE_COLUMNS`."""
    return [item.lease_id, item.user, item.host, item.model, item.budget_mib,
            item.peak_memory_mib, item.suggested_mib]
