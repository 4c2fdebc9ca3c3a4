"""Benchmark: ``gpu-ledger export leases`` streams a million-lease ledger in bounded memory.

Builds two ledgers in a temporary folder (10^4 and 10^6 leases, written with ``executemany``
in one transaction into the real schema), runs ``gpu-ledger export leases`` on each as a
subprocess (stdout to /dev/null) in CSV and NDJSON, and prints ONE JSON object:

    {"exports": {"csv": {"10000": {"seconds", "rows_per_s", "rows_per_s_after_startup",
                                   "peak_rss_mib"}, "1000000": ...},
                 "ndjson": ...},
     "rss_ratio": {"csv": rss(10^6) / rss(10^4), "ndjson": ...}, ...}

Peak RSS is the child's own ``ru_maxrss`` (from ``wait4``), so it covers the interpreter, its
imports and the export; a ratio near 1 means memory does not grow with the ledger.

    python bench/export.py [--large 1000000] [--small 10000] [--keep DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from allocator.ledger.store import Ledger

REPO = Path(__file__).resolve().parents[1]
MODELS = [("NVIDIA GeForce GTX 1070", 8192, 4), ("NVIDIA GeForce RTX 3090", 24576, 1),
          ("NVIDIA A100-SXM4-80GB", 81920, 1)]
HOSTS = [f"gpu-{i:02d}" for i in range(24)]
REASONS = ["container_exited", "container_gone", "stopped", "admin", "bind_timeout",
           "node_silent"]

LEASE_COLUMNS = (
    "lease_id", "request_key", "user", "groups", "state", "created_at", "request", "priority",
    "host", "gpu_uuids", "model", "shared", "memory_mib", "units", "units_num", "units_den",
    "env", "granted_at", "bind_deadline", "bound_at", "container_id", "releasing_at",
    "released_at", "release_reason", "released_by", "release_note",
)


def _leases(count: int, seed: int = 7) -> Iterator[tuple[Any, ...]]:
    """``count`` plausible finished leases over a year (a few hundred still running)."""
    rng = random.Random(seed)
    start = 1_700_000_000.0
    step = 365 * 86400 / count
    for i in range(count):
        model, memory, slots = MODELS[i % len(MODELS)]
        host = HOSTS[i % len(HOSTS)]
        shared = slots > 1 and i % 2 == 0
        gpus = 1 if shared else rng.choice((1, 1, 1, 2, 4))
        uuids = [f"GPU-{host}-{(i + k) % 8}" for k in range(gpus)]
        created = start + i * step
        granted = created + rng.random()
        bound = granted + 5 + rng.random() * 20
        running = i >= count - 200
        released = None if running else bound + rng.random() * 8 * 3600
        user = f"user{rng.randrange(5000):04d}"
        yield (
            uuid.UUID(int=rng.getrandbits(128)).hex, f"hub/{user}/{i % 3 or ''}", user,
            json.dumps(["students"] if i % 3 else ["staff", "lab"]),
            "bound" if running else "released", created,
            json.dumps({"v": 1, "kind": "allocate", "user": user, "model": model}),
            0, host, json.dumps(uuids), model, int(shared),
            memory // slots if shared else None, 1 / slots if shared else float(gpus),
            1, slots if shared else 1, "{}", granted, granted + 300, bound,
            uuid.UUID(int=rng.getrandbits(128)).hex + uuid.UUID(int=i).hex,
            None if running else released, released,
            None if running else REASONS[i % len(REASONS)],
            None if running else f"node {host}", None,
        )


def build_ledger(path: Path, count: int) -> float:
    """Create a ledger with ``count`` leases; returns the seconds it took."""
    began = time.perf_counter()
    ledger = Ledger(path)
    ledger.open()
    ledger.close()
    conn = sqlite3.connect(path)
    try:
        # Bulk load: one transaction, no fsync per row (this is a scratch file).
        conn.execute("PRAGMA synchronous = OFF")
        columns = ", ".join(f'"{c}"' for c in LEASE_COLUMNS)
        marks = ", ".join("?" for _ in LEASE_COLUMNS)
        with conn:
            conn.executemany(f"INSERT INTO leases ({columns}) VALUES ({marks})", _leases(count))
            for h, host in enumerate(HOSTS):
                model, memory, slots = MODELS[h % len(MODELS)]
                conn.execute("INSERT INTO nodes (host, last_heartbeat, drained) VALUES (?, ?, 0)",
                             (host, time.time()))
                conn.executemany(
                    "INSERT INTO gpus (uuid, host, idx, model, memory_total_mib, health, "
                    "health_reasons, drained, present, share_slots) "
                    "VALUES (?, ?, ?, ?, ?, 'healthy', '[]', 0, 1, ?)",
                    [(f"GPU-{host}-{k}", host, k, model, memory, slots) for k in range(8)])
    finally:
        conn.close()
    return time.perf_counter() - began


def run_export(ledger: Path, fmt: str) -> dict[str, float]:
    """Export all leases to /dev/null in a child; wall time and the child's peak RSS."""
    command = [sys.executable, "-m", "allocator.admin.ledger_cli", "export", "leases",
               "--ledger", str(ledger), "--format", fmt]
    began = time.perf_counter()
    with open(os.devnull, "wb") as sink:
        child = subprocess.Popen(command, stdout=sink, stderr=subprocess.PIPE, cwd=REPO)
        _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - began
    stderr = child.stderr.read().decode() if child.stderr else ""
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"export failed: {stderr.strip()}")
    return {"seconds": round(seconds, 3), "peak_rss_mib": round(usage.ru_maxrss / 1024, 1)}


def baseline(runs: int = 3) -> dict[str, float]:
    """The CLI doing no export (interpreter and imports only): seconds (best of ``runs``) and
    peak RSS."""
    command = [sys.executable, "-c", "import allocator.admin.ledger_cli"]
    best, rss = float("inf"), 0.0
    for _ in range(runs):
        began = time.perf_counter()
        child = subprocess.Popen(command, cwd=REPO)
        _, _, usage = os.wait4(child.pid, 0)
        best = min(best, time.perf_counter() - began)
        rss = max(rss, usage.ru_maxrss / 1024)
    return {"seconds": round(best, 3), "peak_rss_mib": round(rss, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--large", type=int, default=1_000_000)
    parser.add_argument("--keep", type=Path, help="build the ledgers here and keep them")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="swarm-gpu-bench-") as scratch:
        folder = args.keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        sizes = (args.small, args.large)
        ledgers, build = {}, {}
        for count in sizes:
            ledgers[count] = folder / f"ledger-{count}.sqlite"
            ledgers[count].unlink(missing_ok=True)
            build[count] = round(build_ledger(ledgers[count], count), 2)
        start = baseline()
        exports: dict[str, dict[str, dict[str, float | None]]] = {}
        for fmt in ("csv", "ndjson"):
            exports[fmt] = {}
            for count in sizes:
                measured = run_export(ledgers[count], fmt)
                seconds = measured["seconds"]
                figures: dict[str, float | None] = {**measured,
                                                    "rows_per_s": round(count / seconds)}
                # Without the interpreter's start, which dominates small exports (too close
                # to it to say anything: null).
                net = seconds - start["seconds"]
                figures["rows_per_s_after_startup"] = (
                    round(count / net) if net > 0.2 * seconds else None)
                exports[fmt][str(count)] = figures
        result = {
            "benchmark": "gpu-ledger export leases (subprocess, stdout to /dev/null)",
            "rows": list(sizes),
            "exports": exports,
            "rss_ratio": {fmt: round(float(exports[fmt][str(args.large)]["peak_rss_mib"] or 0)
                                     / float(exports[fmt][str(args.small)]["peak_rss_mib"] or 1),
                                     3)
                          for fmt in exports},
            "startup": start,
            "ledger_mib": {str(c): round(ledgers[c].stat().st_size / 2**20, 1) for c in sizes},
            "build_seconds": {str(c): build[c] for c in sizes},
            "python": sys.version.split()[0],
            "sqlite": sqlite3.sqlite_version,
            "cpus": os.cpu_count(),
        }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
