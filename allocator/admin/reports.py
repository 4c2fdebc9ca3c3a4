"""Reports over the ledger: exports and GPU-hour accounting (the cluster's status is
:mod:`allocator.admin.status`).

Everything here reads an open :class:`sqlite3.Connection` (or the allocator's replies, for the
live status) and returns data; nothing prints. ``gpu-ledger`` (:mod:`allocator.admin.ledger_cli`)
renders the results, and tests call these functions directly.

Exports are *streams*: :func:`export_rows` returns an iterator over one cursor, so a ledger of
millions of leases is written in constant memory. Aggregations (:func:`usage`) stream too and
keep only one running total per output row.
"""

from __future__ import annotations

import json
import math
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from fractions import Fraction
from typing import Any, Literal

from allocator.ledger.schema import COLUMNS, JSON_COLUMNS
from allocator.wire.protocol import LeaseState

HOLDING_STATES = tuple(s.value for s in LeaseState if s.holds_gpus)
"""Lease states that count against their GPUs (granted, bound, releasing)."""

ExportKind = Literal["leases", "events", "gpus", "usage"]
EXPORT_KINDS: tuple[ExportKind, ...] = ("leases", "events", "gpus", "usage")
UsageBy = Literal["user", "group", "model", "host"]
TimeFormat = Literal["iso", "epoch"]

NO_GROUP = "(no group)"
"""The group of usage by leases whose user belongs to no group."""


# --------------------------------------------------------------------------- times


def parse_time(text: str, *, now: float | None = None) -> float:
    """Epoch seconds from ``"now"``, epoch seconds, or ISO 8601 (a time without offset is UTC).

    >>> parse_time("2024-05-01")
    1714521600.0
    >>> parse_time("1714521600")
    1714521600.0
    """
    value = text.strip()
    if value.lower() == "now":
        return datetime.now(UTC).timestamp() if now is None else now
    try:
        number = float(value)
    except ValueError:
        pass
    else:
        if not math.isfinite(number):
            raise ValueError(f"{text!r} is not a time")
        return number
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError as exc:
        raise ValueError(f"{text!r} is neither epoch seconds nor an ISO 8601 date/time") from exc
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.timestamp()


def iso(epoch: float | None) -> str | None:
    """An epoch time as ISO 8601 UTC, rounded to milliseconds (``2024-05-01T12:00:00.000Z``).

    Rounded, not truncated; :func:`iso_sql` formats the exports the same way in SQL.
    """
    if epoch is None:
        return None
    # Half up, as SQLite's round() does (Python's round() goes to even on ties).
    seconds, millis = divmod(math.floor(epoch * 1000 + 0.5), 1000)
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{millis:03d}Z"


# --------------------------------------------------------------------------- filters


@dataclass(frozen=True)
class Filters:
    """What an export or a usage report is restricted to.

    ``since``/``until`` are epoch seconds (``until`` exclusive). ``model`` matches as a
    case-insensitive substring of the canonical NVML name, so ``1070`` finds
    ``NVIDIA GeForce GTX 1070``.
    """

    since: float | None = None
    until: float | None = None
    user: str | None = None
    model: str | None = None
    host: str | None = None

    def model_matches(self, model: str | None) -> bool:
        """Whether a model name passes the model filter."""
        return self.model is None or (model is not None
                                      and self.model.casefold() in model.casefold())


class _Where:
    """Builds a WHERE clause and its parameters one condition at a time."""

    def __init__(self) -> None:
        self.conditions: list[str] = []
        self.params: list[Any] = []

    def add(self, condition: str, *params: Any) -> None:
        self.conditions.append(condition)
        self.params.extend(params)

    def sql(self) -> str:
        return (" WHERE " + " AND ".join(self.conditions)) if self.conditions else ""


def _like(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return f"%{escaped}%"


# --------------------------------------------------------------------------- exports


@dataclass(frozen=True)
class Column:
    """One exported column: its name, and how a raw ledger value becomes the exported one."""

    name: str
    kind: Literal["text", "number", "time", "json", "bool"] = "text"


LEASE_COLUMNS: tuple[Column, ...] = (
    Column("lease_id"), Column("request_key"), Column("user"), Column("groups", "json"),
    Column("state"), Column("host"), Column("gpu_uuids", "json"), Column("model"),
    Column("shared", "bool"), Column("memory_mib", "number"), Column("units", "number"),
    Column("priority", "number"), Column("created_at", "time"), Column("enqueued_at", "time"),
    Column("granted_at", "time"), Column("bound_at", "time"), Column("releasing_at", "time"),
    Column("released_at", "time"), Column("release_reason"), Column("released_by"),
    Column("release_note"), Column("container_id"),
)
"""The lease export: everything but the raw request and the container environment."""

EVENT_COLUMNS: tuple[Column, ...] = (
    Column("id", "number"), Column("at", "time"), Column("kind"), Column("host"),
    Column("lease_id"), Column("user"), Column("gpu_uuid"), Column("detail", "json"),
)

_GPU_KINDS: dict[str, Literal["time", "bool"]] = {
    "first_seen": "time", "updated_at": "time",
    "drained": "bool", "present": "bool", "mig_enabled": "bool",
}
"""The GPU columns whose SQLite type does not say what they mean (times are REAL, flags
INTEGER)."""

GPU_COLUMNS: tuple[Column, ...] = tuple(
    Column(name, _GPU_KINDS.get(name)
           or ("json" if name in JSON_COLUMNS["gpus"]
               else "number" if kind in (int, float) else "text"))
    for name, kind in COLUMNS["gpus"].items())
"""The GPU export: every column of the ``gpus`` table (:data:`allocator.ledger.schema.COLUMNS`), in
the schema's order, so a new column is exported without being listed twice."""


def usage_columns(by: UsageBy) -> tuple[Column, ...]:
    """Columns of the usage export."""
    return (Column(by), Column("model"), Column("gpu_hours", "number"),
            Column("leases", "number"), Column("since", "time"), Column("until", "time"),
            Column("idle_gpu_hours", "number"), Column("reclaimed", "number"),
            Column("idle_released", "number"), Column("measured_gpu_hours", "number"),
            Column("used_gpu_hours", "number"), Column("kwh", "number"),
            Column("peak_memory_mib", "number"))


def lease_where(filters: Filters, *, holding_only: bool = False) -> _Where:
    """The WHERE of the leases that overlap the filters' period, user and host (with
    ``holding_only``: only leases ever granted)."""
    where = _Where()
    if holding_only:
        where.add("granted_at IS NOT NULL")
    if filters.since is not None:
        # A lease overlaps the period if it had not ended by its start.
        where.add("(released_at IS NULL OR released_at >= ?)", filters.since)
    if filters.until is not None:
        where.add("created_at < ?", filters.until)
    if filters.user is not None:
        where.add("user = ?", filters.user)
    if filters.host is not None:
        where.add("host = ?", filters.host)
    return where


def iso_sql(column: str) -> str:
    """SQL giving :func:`iso`'s text for an epoch column, to the same millisecond.

    Whole milliseconds are computed once as an integer, as :func:`iso` does: SQLite's own
    ``%f`` goes through Julian days and rounds differently in about 1 case of 60.
    """
    ms = f"CAST(round({column} * 1000) AS INTEGER)"
    return (f"strftime('%Y-%m-%dT%H:%M:%S', {ms} / 1000, 'unixepoch')"
            f" || printf('.%03dZ', {ms} % 1000)")


def _select(columns: Sequence[Column], time_format: TimeFormat, alias: str = "") -> str:
    """The select list; ISO times are formatted by SQLite, in C, not per cell in Python
    (that was half the time of a million-row export)."""
    parts = []
    for column in columns:
        name = f'{alias}"{column.name}"'
        if column.kind == "time" and time_format == "iso":
            parts.append(iso_sql(name))
        else:
            parts.append(name)
    return ", ".join(parts)


def _lease_query(filters: Filters, time_format: TimeFormat = "epoch") -> tuple[str, list[Any]]:
    where = lease_where(filters)
    if filters.model is not None:
        where.add("model LIKE ? ESCAPE '\\'", _like(filters.model))
    columns = _select(LEASE_COLUMNS, time_format)
    # created_at is indexed, so the ORDER BY walks the index instead of sorting millions of
    # rows in a temporary b-tree: the export starts at once and stays in constant memory.
    return f"SELECT {columns} FROM leases{where.sql()} ORDER BY created_at", where.params


def _event_query(filters: Filters, time_format: TimeFormat = "epoch") -> tuple[str, list[Any]]:
    where = _Where()
    if filters.since is not None:
        where.add("e.at >= ?", filters.since)
    if filters.until is not None:
        where.add("e.at < ?", filters.until)
    if filters.user is not None:
        where.add("e.user = ?", filters.user)
    if filters.host is not None:
        where.add("e.host = ?", filters.host)
    joins = ""
    if filters.model is not None:
        # Events name a GPU, a lease, or both; either may carry the model.
        joins = (" LEFT JOIN gpus g ON g.uuid = e.gpu_uuid"
                 " LEFT JOIN leases l ON l.lease_id = e.lease_id")
        where.add("COALESCE(g.model, l.model) LIKE ? ESCAPE '\\'", _like(filters.model))
    columns = _select(EVENT_COLUMNS, time_format, "e.")
    # (at, id) is the order of the index on "at" (id is the rowid): no sort needed.
    return f"SELECT {columns} FROM events e{joins}{where.sql()} ORDER BY e.at, e.id", where.params


def _gpu_query(filters: Filters, time_format: TimeFormat = "epoch") -> tuple[str, list[Any]]:
    where = _Where()
    if filters.host is not None:
        where.add("host = ?", filters.host)
    if filters.model is not None:
        where.add("model LIKE ? ESCAPE '\\'", _like(filters.model))
    columns = _select(GPU_COLUMNS, time_format)
    return (f"SELECT {columns} FROM gpus{where.sql()} ORDER BY host, idx, "
            "coalesce(mig_index, -1)", where.params)


_QUERIES: dict[str, Callable[[Filters, TimeFormat], tuple[str, list[Any]]]] = {
    "leases": _lease_query, "events": _event_query, "gpus": _gpu_query,
}
_COLUMNS: dict[str, tuple[Column, ...]] = {
    "leases": LEASE_COLUMNS, "events": EVENT_COLUMNS, "gpus": GPU_COLUMNS,
}


@dataclass
class Export:
    """Columns and a stream of rows (tuples of exported values, in column order)."""

    columns: tuple[Column, ...]
    rows: Iterator[tuple[Any, ...]]

    @property
    def names(self) -> list[str]:
        """The column names."""
        return [column.name for column in self.columns]


def convert_value(column: Column, value: Any, *, time_format: TimeFormat,
                  decode_json: bool) -> Any:
    """A raw ledger value as exported: times as ISO text (or epoch), JSON decoded or not."""
    if value is None:
        return None
    if column.kind == "time":
        return iso(value) if time_format == "iso" else value
    if column.kind == "bool":
        return bool(value)
    if column.kind == "json" and decode_json:
        try:
            return json.loads(value)
        except (TypeError, ValueError):
            return value  # never lose a row over one odd cell
    return value


def _converter(columns: Sequence[Column], time_format: TimeFormat, decode_json: bool, *,
               times_done: bool = False) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    """A function converting one raw row; columns that need no conversion are passed through.

    ``times_done``: the query already formatted the times (see :func:`_select`).
    """
    plans = [(i, c) for i, c in enumerate(columns)
             if (c.kind == "time" and not times_done) or c.kind == "bool"
             or (c.kind == "json" and decode_json)]
    if not plans:
        return lambda row: row

    def convert(row: tuple[Any, ...]) -> tuple[Any, ...]:
        values = list(row)
        for index, column in plans:
            values[index] = convert_value(column, values[index], time_format=time_format,
                                          decode_json=decode_json)
        return tuple(values)

    return convert


def export_rows(conn: sqlite3.Connection, kind: ExportKind, filters: Filters = Filters(), *,
                time_format: TimeFormat = "iso", decode_json: bool = True,
                usage_by: UsageBy = "user", now: float | None = None) -> Export:
    """Stream one kind of record from the ledger.

    ``leases`` are those that overlap ``since``/``until`` (ordered by creation), ``events``
    those that happened in it, ``gpus`` every GPU ever seen (time filters do not apply) and
    ``usage`` the GPU-hours of :func:`usage`. ``decode_json`` turns JSON columns (groups,
    GPU lists, event details) into lists and objects, for JSON output; CSV keeps the text.
    """
    if kind == "usage":
        rows = usage(conn, filters, by=usage_by, now=now)
        since = filters.since
        until = filters.until if filters.until is not None else now
        columns = usage_columns(usage_by)
        convert = _converter(columns, time_format, decode_json)
        return Export(columns, (convert((r.key, r.model, round(r.gpu_hours, 6), r.leases,
                                         since, until, round(r.idle_gpu_hours, 6), r.reclaimed,
                                         r.idle_released, round(r.measured_gpu_hours, 6),
                                         round(r.used_gpu_hours, 6), round(r.kwh, 6),
                                         r.peak_memory_mib)) for r in rows))
    if kind not in _QUERIES:
        raise ValueError(f"unknown export {kind!r}; choose one of {', '.join(EXPORT_KINDS)}")
    sql, params = _QUERIES[kind](filters, time_format)
    columns = _COLUMNS[kind]
    convert = _converter(columns, time_format, decode_json, times_done=True)
    cursor = conn.execute(sql, params)
    cursor.arraysize = 1000
    return Export(columns, (convert(row) for row in _fetch(cursor)))


def _fetch(cursor: sqlite3.Cursor) -> Iterator[tuple[Any, ...]]:
    """Rows from a cursor in chunks (fewer Python calls than one-by-one iteration)."""
    while True:
        chunk = cursor.fetchmany()
        if not chunk:
            return
        yield from chunk


def count_rows(conn: sqlite3.Connection, kind: ExportKind, filters: Filters = Filters()) -> int:
    """How many rows :func:`export_rows` would stream (for a progress bar)."""
    if kind == "usage":
        return 0
    sql, params = _QUERIES[kind](filters, "epoch")
    body = sql.split(" FROM ", 1)[1].rsplit(" ORDER BY ", 1)[0]
    return int(conn.execute(f"SELECT COUNT(*) FROM {body}", params).fetchone()[0])


# --------------------------------------------------------------------------- usage


@dataclass(frozen=True)
class UsageRow:
    """GPU-hours of one user (or group, or host) on one model."""

    key: str
    model: str
    gpu_hours: float
    leases: int
    idle_gpu_hours: float = 0.0
    """Of ``gpu_hours``, those its processes left the GPUs idle (see :func:`idle_share`)."""
    reclaimed: int = 0
    """Leases that ended in the period because they were reclaimed (borrowed)."""
    idle_released: int = 0
    """Leases that ended in the period because they were released as idle."""
    measured_gpu_hours: float = 0.0
    """Of ``gpu_hours``, those of leases whose node agent measured their usage (0.3.0 agents
    reporting to a 0.3.0 allocator): what ``used_gpu_hours`` and ``kwh`` stand for."""
    used_gpu_hours: float = 0.0
    """GPU-hours really used: the measured SM-seconds (SM utilization as a fraction of one
    GPU, times seconds) over 3,600."""
    kwh: float = 0.0
    """Energy measured, its share of the GPUs' energy counters (docs/operations.md, Usage)."""
    peak_memory_mib: int | None = None
    """The most GPU memory one lease's processes held on one GPU; None: none measured."""


def idle_share(idle_gpu_s: float | None, idle_since: float | None, units: Fraction,
               held_s: float, end: float) -> float:
    """The share (0-1) of a lease's whole holding its GPUs were idle: its finished idle spells
    (``idle_gpu_s``, GPU-seconds) and a spell still open at ``end`` (``idle_since``), over its
    GPU-seconds held. The ledger keeps idle time per lease, not per spell, so a period that
    clips a lease counts this share of the part inside it."""
    if held_s <= 0 or units <= 0:
        return 0.0
    idle = float(idle_gpu_s or 0.0)
    if idle_since is not None:
        idle += float(units) * max(end - idle_since, 0.0)
    return min(idle / (float(units) * held_s), 1.0)


FAIRSHARE_COLUMNS = ("idle_gpu_s", "idle_since", "release_reason")
"""Lease columns usage reads that a ledger older than schema 4 lacks (read as NULL)."""

MEASURED_COLUMNS = ("sm_s", "energy_j", "peak_memory_mib")
"""Lease columns of measured usage that a ledger older than schema 8 lacks (read as NULL)."""


def lease_columns_or_null(conn: sqlite3.Connection, names: Sequence[str]) -> str:
    """The select list of lease ``names``, each one the ledger lacks (an older schema) as
    ``NULL AS name``."""
    present = {row[1] for row in conn.execute("PRAGMA table_info(leases)")}
    return ", ".join(name if name in present else f"NULL AS {name}" for name in names)


def lease_units(units_num: int | None, units_den: int | None, gpu_count: int,
                shared: bool) -> Fraction:
    """How many GPUs a lease counts for: its GPU count, or its share of one GPU for a slice.

    The ledger records the lease's quota units exactly (numerator/denominator); an old or
    hand-written row without them falls back to the GPU count (exclusive) or one GPU.
    """
    if units_num and units_den:
        return Fraction(int(units_num), int(units_den))
    return Fraction(1) if shared or gpu_count == 0 else Fraction(gpu_count)


def held_interval(granted_at: float, released_at: float | None, state: str,
                  since: float | None, until: float) -> float:
    """Seconds a lease held its GPUs within ``[since, until)``.

    A lease holds from its grant to its release; one still holding counts up to ``until``.
    A final lease without a release time (a damaged row) counts nothing rather than forever.
    """
    if released_at is None:
        end = until if state in HOLDING_STATES else granted_at
    else:
        end = min(released_at, until)
    start = granted_at if since is None else max(granted_at, since)
    return max(end - start, 0.0)


def usage(conn: sqlite3.Connection, filters: Filters = Filters(), *, by: UsageBy = "user",
          now: float | None = None) -> list[UsageRow]:
    """GPU-hours per ``by`` (user, group, model or host) and model over
    ``filters.since/until``, with the usage measured on the leases (schema 8: used GPU-hours,
    kWh, peak memory) where their agents measured it.

    An exclusive lease counts its GPUs times hours, a shared slice its share (1/slots) times hours.
    Leases still running count up to ``until`` (default: ``now``); every lease is clipped to
    the period. A lease of several models (``models=[...]``) splits its units over its GPUs by
    each GPU's model. With ``by="group"`` a lease counts once for each of its user's groups,
    so group totals may add up to more than the cluster's total.
    """
    now = datetime.now(UTC).timestamp() if now is None else now
    until = filters.until if filters.until is not None else now
    gpu_models = {uuid: model for uuid, model in conn.execute("SELECT uuid, model FROM gpus")}
    where = lease_where(Filters(since=filters.since, until=until, user=filters.user,
                                 host=filters.host), holding_only=True)
    where.add("granted_at < ?", until)
    sql = ("SELECT user, groups, host, model, gpu_uuids, shared, units_num, units_den, state, "
           f"granted_at, released_at, {lease_columns_or_null(conn, FAIRSHARE_COLUMNS)}, "
           f"{lease_columns_or_null(conn, MEASURED_COLUMNS)} FROM leases{where.sql()}")
    hours: dict[tuple[str, str], float] = {}
    idle_hours: dict[tuple[str, str], float] = {}
    counted: dict[tuple[str, str], int] = {}
    ended_by: dict[tuple[str, str, str], int] = {}
    measured: dict[tuple[str, str], list[float]] = {}  # held, used GPU-hours, kWh
    peaks: dict[tuple[str, str], int] = {}
    cursor = conn.execute(sql, where.params)
    cursor.arraysize = 1000
    for (user, groups_json, host, lease_model, uuids_json, shared, num, den, state,
         granted_at, released_at, idle_gpu_s, idle_since, reason, sm_s, energy_j,
         peak_mib) in _fetch(cursor):
        seconds = held_interval(granted_at, released_at, state, filters.since, until)
        if seconds <= 0:
            continue
        uuids = json_list(uuids_json)
        units = lease_units(num, den, len(uuids), bool(shared))
        # The share is of the lease's whole holding (up to now for one still running).
        whole_s = held_interval(granted_at, released_at, state, None, now)
        idle = idle_share(idle_gpu_s, idle_since, units, whole_s,
                          now if released_at is None else released_at)
        # Measured usage is a total per lease, like idle time: a period that clips a lease
        # counts the part of it that its share of the lease's holding is.
        inside = min(seconds / whole_s, 1.0) if whole_s > 0 else 0.0
        ended_here = (released_at is not None and released_at < until
                      and reason in ("reclaimed", "idle"))
        per_model: dict[str, Fraction] = {}
        if lease_model or not uuids:
            per_model[lease_model or "(unknown)"] = units
        else:
            for gpu_uuid in uuids:
                model = gpu_models.get(gpu_uuid, "(unknown)")
                per_model[model] = per_model.get(model, Fraction(0)) + units / len(uuids)
        if by == "user":
            keys = [user]
        elif by == "host":
            keys = [host or "(no host)"]
        elif by == "model":
            keys = []  # the model itself, below
        else:
            keys = [str(g) for g in json_list(groups_json)] or [NO_GROUP]
        for model, share in per_model.items():
            if not filters.model_matches(model):
                continue
            # A lease of several models splits its measured usage as it splits its units.
            part = inside * float(share / units) if units else 0.0
            for key in keys or [model]:
                held_h = float(share) * seconds / 3600
                hours[key, model] = hours.get((key, model), 0.0) + held_h
                idle_hours[key, model] = idle_hours.get((key, model), 0.0) + held_h * idle
                counted[key, model] = counted.get((key, model), 0) + 1
                if ended_here:
                    ended_by[key, model, reason] = ended_by.get((key, model, reason), 0) + 1
                if sm_s is not None or energy_j is not None:
                    sums = measured.setdefault((key, model), [0.0, 0.0, 0.0])
                    sums[0] += held_h
                    sums[1] += float(sm_s or 0.0) * part / 3600
                    sums[2] += float(energy_j or 0.0) * part / 3.6e6
                if peak_mib is not None:
                    peaks[key, model] = max(peaks.get((key, model), 0), int(peak_mib))
    rows = []
    for key, model in sorted(hours):
        held_m, used_h, kwh = measured.get((key, model), (0.0, 0.0, 0.0))
        rows.append(UsageRow(key, model, hours[key, model], counted[key, model],
                             idle_gpu_hours=idle_hours[key, model],
                             reclaimed=ended_by.get((key, model, "reclaimed"), 0),
                             idle_released=ended_by.get((key, model, "idle"), 0),
                             measured_gpu_hours=held_m, used_gpu_hours=used_h, kwh=kwh,
                             peak_memory_mib=peaks.get((key, model))))
    return rows


def json_list(text: str | None) -> list[Any]:
    if not text:
        return []
    try:
        value = json.loads(text)
    except ValueError:
        return []
    return value if isinstance(value, list) else []
