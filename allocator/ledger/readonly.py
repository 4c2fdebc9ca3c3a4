"""Read-only access to a ledger file: the reports', the exports' and the backup's way in.

:func:`open_readonly` opens a ledger with the checks :meth:`allocator.ledger.store.Ledger.open`
makes, refusing each kind of wrong file in one line; :func:`ledger_error` turns an SQLite
error met while reading one into a plain sentence.
"""

from __future__ import annotations

import sqlite3
import urllib.parse
from pathlib import Path

from allocator.ledger.schema import SCHEMA_VERSION
from allocator.ledger.store import LedgerError


def open_readonly(path: str | Path, *, busy_timeout_s: float = 5.0) -> sqlite3.Connection:
    """Open a ledger read-only, or raise :class:`LedgerError` saying in one line why not.

    Read-only (``mode=ro``) means the reports can never change the ledger, and in WAL mode a
    reader neither waits for nor blocks the running allocator. This is the only read-only
    way in (:class:`allocator.ledger.store.Ledger` opens for writing); its checks mirror
    :meth:`allocator.ledger.store.Ledger.open`'s: a missing file, a file that is not SQLite, an
    SQLite file that is not a ledger, a ledger of a newer schema, and a ledger another process
    holds with an exclusive lock are each refused with their own message.
    """
    path = Path(path)
    if not path.exists():
        raise LedgerError(f"no ledger at {path}")
    if not path.is_file():
        raise LedgerError(f"{path} is not a file")
    uri = "file:" + urllib.parse.quote(str(path.resolve())) + "?mode=ro"
    try:
        conn = sqlite3.connect(uri, uri=True, timeout=busy_timeout_s)
    except sqlite3.Error as exc:
        raise LedgerError(f"cannot open the ledger {path}: {exc}") from exc
    try:
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        tables = {row[0] for row in conn.execute("SELECT name FROM sqlite_master "
                                                 "WHERE type = 'table'")}
    except sqlite3.Error as exc:
        conn.close()
        raise ledger_error(path, exc) from exc
    if version > SCHEMA_VERSION:
        conn.close()
        raise LedgerError(
            f"{path} has schema version {version}, newer than this release understands "
            f"({SCHEMA_VERSION}); upgrade swarm-gpu"
        )
    missing = {"nodes", "gpus", "leases", "lease_history", "events"} - tables
    if version == 0 or missing:
        conn.close()
        raise LedgerError(f"{path} is an SQLite file but not a swarm-gpu ledger")
    return conn


def ledger_error(path: str | Path, exc: sqlite3.Error) -> LedgerError:
    """Turn an SQLite error met while reading a ledger into one plain sentence."""
    text = str(exc)
    if "locked" in text or "busy" in text:
        return LedgerError(f"the ledger {path} is locked by another process (it holds an "
                           f"exclusive lock; the allocator's WAL mode never does): {text}")
    if "not a database" in text or "malformed" in text or "corrupt" in text:
        return LedgerError(f"{path} is corrupt or not an SQLite file: {text}")
    return LedgerError(f"cannot read the ledger {path}: {text}")
