"""Benchmark: what ``PRAGMA quick_check`` adds to the allocator's start (``Ledger.open``).

Builds a ledger of ``--leases`` leases (100,000 by default, as ``bench/export.py`` writes
them: a year of finished leases and a few hundred running, 24 hosts of 8 GPUs) and measures,
page cache warm (the allocator restarting on its node), the best and median of ``--runs``:

- ``quick_check_s``: ``PRAGMA quick_check`` alone, on a connection of its own;
- ``integrity_check_s``: ``PRAGMA integrity_check`` alone, for comparison (what
  ``gpu-ledger backup`` runs on its copy);
- ``open_s``: ``Ledger.open`` and ``close`` (the check included);
- ``load_s``: ``Ledger.load``, what the start does right after, for scale.

Prints ONE JSON object. ``python bench/ledger_open.py [--leases 100000] [--runs 5]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from export import build_ledger  # bench/export.py: the same ledger of plausible leases

from allocator.ledger.store import Ledger


def timed(action: Callable[[], object], runs: int) -> dict[str, float]:
    """Best and median seconds of ``runs`` calls."""
    seconds = []
    for _ in range(runs):
        began = time.perf_counter()
        action()
        seconds.append(time.perf_counter() - began)
    return {"best": round(min(seconds), 4), "median": round(statistics.median(seconds), 4)}


def pragma(path: Path, name: str) -> Callable[[], object]:
    def run() -> object:
        with contextlib.closing(sqlite3.connect(path)) as conn:
            result = conn.execute(f"PRAGMA {name}").fetchall()
        if result != [("ok",)]:
            raise SystemExit(f"{name}: {result}")
        return result
    return run


def open_close(path: Path) -> None:
    ledger = Ledger(path)
    ledger.open()
    ledger.close()


def open_load_close(path: Path) -> None:
    ledger = Ledger(path)
    ledger.open()
    try:
        ledger.call(ledger.load)
    finally:
        ledger.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--leases", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarm-gpu-bench-") as scratch:
        path = Path(scratch) / "ledger.sqlite"
        build_s = build_ledger(path, args.leases)
        open_close(path)  # checkpointed, page cache warm
        quick = timed(pragma(path, "quick_check"), args.runs)
        integrity = timed(pragma(path, "integrity_check"), args.runs)
        opened = timed(lambda: open_close(path), args.runs)
        loaded = timed(lambda: open_load_close(path), args.runs)
        result = {
            "benchmark": "PRAGMA quick_check at the ledger's open (page cache warm)",
            "leases": args.leases,
            "ledger_mib": round(path.stat().st_size / 2**20, 1),
            "quick_check_s": quick,
            "integrity_check_s": integrity,
            "open_s": opened,
            "open_and_load_s": loaded,
            "quick_check_share_of_open_and_load": round(quick["median"] / loaded["median"], 3),
            "build_s": round(build_s, 2),
            "python": sys.version.split()[0],
            "sqlite": sqlite3.sqlite_version,
            "cpus": os.cpu_count(),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
