"""The page's own usage history: one small SQLite file of per-lease samples.

The page service samples the allocator's inventory every ``sample_interval_s`` and keeps one
row per active lease and sample for ``history_hours``; older rows are deleted as new ones
arrive. The file belongs to the page alone (the allocator's ledger is never read): deleting it
loses only the charts' past. All calls run on one dedicated thread (sqlite connections are
not thread-safe), through :class:`UsageHistory`'s async methods.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import sqlite_utils

from .usage import UsagePoint

TABLE = "samples"

T = TypeVar("T")


class UsageHistory:
    """Per-lease usage samples in a SQLite file, kept for ``keep_s`` seconds."""

    def __init__(self, path: Path, keep_s: float) -> None:
        self.path = path
        self.keep_s = keep_s
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpu-page-history")
        self._db: sqlite_utils.Database | None = None

    async def open(self) -> None:
        """Create the file and its table if they do not exist."""
        await self._run(self._open)

    async def close(self) -> None:
        """Close the file and stop the thread."""
        await self._run(self._close)
        self._thread.shutdown(wait=True)

    async def record(self, rows: Sequence[tuple[str, str, UsagePoint]]) -> None:
        """Add ``(lease_id, user, point)`` rows, and forget rows older than ``keep_s``."""
        await self._run(self._record, rows)

    async def points(self, lease_ids: Iterable[str], since: float) -> dict[str, list[UsagePoint]]:
        """Each lease's samples since ``since``, oldest first."""
        return await self._run(self._points, list(lease_ids), since)

    # ------------------------------------------------------------ on the history thread

    async def _run(self, function: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._thread, function, *args)

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        connection = sqlite3.connect(self.path, check_same_thread=True)
        self._db = sqlite_utils.Database(connection)
        self._db.execute("PRAGMA journal_mode = WAL")
        table = self._db.table(TABLE)
        if not table.exists():
            table.create({"at": float, "lease_id": str, "user": str, "utilization_pct": float,
                          "memory_used_mib": int, "memory_total_mib": int})
            table.create_index(["lease_id", "at"])
            table.create_index(["at"])

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _record(self, rows: Sequence[tuple[str, str, UsagePoint]]) -> None:
        assert self._db is not None, "open() first"
        newest = max((point.at for _, _, point in rows), default=None)
        with self._db.conn:
            self._db.table(TABLE).insert_all(
                {"at": point.at, "lease_id": lease_id, "user": user,
                 "utilization_pct": point.utilization_pct,
                 "memory_used_mib": point.memory_used_mib,
                 "memory_total_mib": point.memory_total_mib}
                for lease_id, user, point in rows)
            if newest is not None:
                self._db.execute(f"DELETE FROM {TABLE} WHERE at < ?", [newest - self.keep_s])

    def _points(self, lease_ids: list[str], since: float) -> dict[str, list[UsagePoint]]:
        assert self._db is not None, "open() first"
        out: dict[str, list[UsagePoint]] = {lease_id: [] for lease_id in lease_ids}
        if not lease_ids:
            return out
        marks = ", ".join("?" for _ in lease_ids)
        cursor = self._db.execute(
            f"SELECT lease_id, at, utilization_pct, memory_used_mib, memory_total_mib "
            f"FROM {TABLE} WHERE at >= ? AND lease_id IN ({marks}) ORDER BY at",
            [since, *lease_ids])
        for lease_id, at, utilization, memory_used, memory_total in cursor.fetchall():
            out[lease_id].append(UsagePoint(at, utilization, memory_used, memory_total))
        return out
