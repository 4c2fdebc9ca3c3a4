"""The ledger: SQLite in WAL mode, the allocator's durable record and decision log.

One :class:`Ledger` owns one connection on one dedicated thread (sqlite connections are not
thread-safe); every call goes through :meth:`Ledger.run`. Writes arrive as a
:class:`Changes` batch and are committed in a single transaction, so a batch of requests
costs one fsync. Nothing is answered "granted" before the batch holding it is committed.

The schema is versioned with ``PRAGMA user_version`` and migrated forward at open, each
migration in one transaction of its own; a ledger written by a newer release is refused rather
than misread, and so is one whose pages are damaged (``PRAGMA quick_check``). An open ledger
holds its lock file shared (:class:`LedgerLock`), so that ``gpu-ledger restore`` never
replaces it under a running allocator.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import json
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, TypeVar

import sqlite_utils

from allocator.ledger.change_set import INSERTED, BrokenChanges
from allocator.ledger.changes import (
    LEASE_OWNERS,
    LEASE_USAGE_BESIDE,
    OWNER_COLUMN,
    USAGE_COLUMNS,
    Changes,
)
from allocator.ledger.lease import LeaseRecord, row_reader
from allocator.ledger.loaded import BOOKING_ALERT_KINDS, BookingRow, LoadedState
from allocator.ledger.log_position import LogPosition
from allocator.ledger.log_snapshot import STATE_TABLES, TRAIL_TABLES, Table, Tables
from allocator.ledger.schema import (
    BOOKINGS_V7,
    COLUMNS,
    EVENTS_V1,
    GPUS_V1,
    GPUS_V2,
    HISTORY_V1,
    LEASES_V1,
    LEASES_V4,
    LEASES_V6,
    LEASES_V8,
    LOG_POSITION_V3,
    LOG_POSITION_V5,
    NODES_V1,
    SCHEMA_VERSION,
)
from allocator.placement.cluster import GPU, Node
from allocator.wire.protocol import Health, LeaseState

T = TypeVar("T")


class LedgerError(Exception):
    """The ledger cannot be opened or written; the message says why in plain words."""


def _on_read_only_filesystem(path: Path) -> bool:
    """Whether the ledger's folder is on a filesystem that is read-only (mounted so, or
    turned so by the kernel after a disk error): SQLite then says only "unable to open
    database file" or "disk I/O error". Asked only after a failure."""
    try:
        if os.statvfs(path.parent).f_flag & os.ST_RDONLY:
            return True
        # ext4's emergency read-only state (errors=remount-ro) leaves the mount flags alone.
        probe = path.parent / f".{path.name}.write-probe-{os.getpid()}"
        os.close(os.open(probe, os.O_CREAT | os.O_WRONLY, 0o600))
        os.unlink(probe)
    except OSError as exc:
        return exc.errno == errno.EROFS
    return False


class LedgerUnwritable(LedgerError):
    """The ledger's storage refused a write (the disk is full or read-only, an I/O error, a
    lock held by another process): nothing of the write was done, and the same write may
    work once the storage does. Not a sign that what was to be written is wrong."""


_STORAGE_FAILURES = frozenset({sqlite3.SQLITE_FULL, sqlite3.SQLITE_IOERR,
                               sqlite3.SQLITE_READONLY, sqlite3.SQLITE_CANTOPEN,
                               sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED,
                               sqlite3.SQLITE_PROTOCOL, sqlite3.SQLITE_NOLFS})
"""SQLite's primary result codes that are about the storage, not the data written."""


def _write_failed(path: Path, exc: sqlite3.Error) -> LedgerError:
    """What a failed write of the ledger at ``path`` raises: :class:`LedgerUnwritable` when
    the storage refused it, :class:`LedgerError` otherwise (the data itself did not fit)."""
    why = " (its filesystem is read-only)" if _on_read_only_filesystem(path) else ""
    message = f"cannot write the ledger {path}: {exc}{why}"
    code = getattr(exc, "sqlite_errorcode", None)
    if why or (code is not None and code & 0xFF in _STORAGE_FAILURES):
        return LedgerUnwritable(message)
    return LedgerError(message)


MIN_FREE_BYTES_TO_OPEN = 1 << 20
"""Below this much free space on its filesystem a ledger is not opened: SQLite must write its
write-ahead log index (``-shm``, memory-mapped) to open a WAL database at all, and on a full
ext4 the mapped pages cannot be allocated, which kills the process with SIGBUS instead of
failing with an error (reproduced on a filled 8 MiB filesystem)."""


def _full_filesystem(path: Path) -> str | None:
    """Why the ledger at ``path`` must not be opened for lack of space, or None."""
    try:
        stat = os.statvfs(path.parent)
    except OSError:
        return None  # not ours to judge here: the open says what is wrong
    free = stat.f_bavail * stat.f_frsize
    if free >= MIN_FREE_BYTES_TO_OPEN:
        return None
    return (f"cannot open the ledger {path}: its filesystem is full ({free} bytes free, "
            f"{MIN_FREE_BYTES_TO_OPEN >> 20} MiB needed); free space there and start again")


class LedgerChanged(LedgerError):
    """Another process committed to the ledger since this one last looked (a takeover)."""


class LedgerCorrupt(LedgerError):
    """The ledger's file is damaged (SQLite's ``quick_check`` or a read found bad pages)."""

    def __init__(self, path: Path, detail: str) -> None:
        self.path = path
        self.detail = detail
        super().__init__(f"the ledger {path} is corrupt ({detail}): "
                         f"{what_to_do_with_a_damaged_ledger(path)}")


def what_to_do_with_a_damaged_ledger(path: Path) -> str:
    """The two ways out, in words an admin can follow."""
    return (f"restore it from a backup (gpu-ledger restore BACKUP --ledger {path}), or move it "
            f"away with its -wal and -shm files so that the allocator starts afresh and "
            f"rebuilds from the nodes' running containers (and the ledger log, if on)")


def _is_corruption(exc: sqlite3.DatabaseError) -> bool:
    """Whether SQLite's error means damaged pages ("database disk image is malformed"), not
    a busy, missing or foreign file."""
    code = getattr(exc, "sqlite_errorcode", None)
    if code is not None:
        return bool(code & 0xFF == sqlite3.SQLITE_CORRUPT)
    return "malformed" in str(exc)


class LedgerInUse(LedgerError):
    """Another process holds the ledger's lock in a way that excludes this one."""


LOCK_WAIT_S = 5.0
"""How long an allocator waits at start for a restore that holds the ledger's lock."""


class LedgerLock:
    """An advisory lock beside the ledger (``<ledger>.lock``, ``flock``).

    Every :class:`Ledger` holds it shared while open, so the allocator and a standby on the
    same file never exclude each other; ``gpu-ledger restore`` takes it exclusive, so it
    never replaces a ledger an allocator has open, and an allocator never opens one being
    replaced. A lock file of its own, not SQLite's: SQLite's locks are POSIX record locks,
    which a process loses on *every* descriptor of the file when it closes any one of them.
    The kernel drops the lock with its process, so a crash never leaves it held.
    """

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @staticmethod
    def path_of(ledger: Path) -> Path:
        """The lock file of the ledger at ``ledger``."""
        return ledger.with_name(ledger.name + ".lock")

    @classmethod
    def take(cls, ledger: Path, *, exclusive: bool, wait_s: float = 0.0) -> LedgerLock:
        """The lock of ``ledger``, waiting up to ``wait_s``; :class:`LedgerInUse` if another
        process holds it in a way that excludes this one, :class:`LedgerError` if the lock
        file cannot be made."""
        path = cls.path_of(ledger)
        try:
            # Read-only is enough for flock, so the lock file of one user (an admin's
            # restore) never keeps another (the allocator's) out.
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            if exc.errno == errno.EROFS:
                raise LedgerError(f"cannot open the ledger {ledger} for writing: its "
                                  f"filesystem is read-only ({exc.strerror})") from exc
            raise LedgerError(f"cannot open the ledger's lock file {path}: "
                              f"{exc.strerror or exc}") from exc
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
                return cls(path, fd)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    if exclusive:
                        raise LedgerInUse(
                            f"the ledger {ledger} is in use by a running allocator (it holds "
                            f"{path.name}): stop it first") from None
                    raise LedgerInUse(
                        f"the ledger {ledger} is being restored (gpu-ledger restore holds "
                        f"{path.name}); start the allocator once the restore is done"
                    ) from None
                time.sleep(0.05)
            except OSError:
                os.close(fd)
                raise

    def release(self) -> None:
        """Let go of the lock (closing its descriptor)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


_SQL_TYPES = {str: "TEXT", int: "INTEGER", float: "REAL"}
"""SQLite's column type for each Python type (sqlite-utils' mapping, which wrote the ledgers
of earlier releases; 3.x wrote FLOAT for float, the same REAL affinity)."""

MigrationHook = Callable[[int, str], None]

migration_hook: MigrationHook | None = None
"""Called after each statement a migration runs, with the statement's number (from 1, counted
over the whole open) and its SQL, before the migration commits. None in production; the
tests set it in a child process to end that process mid-migration (``os._exit``) and see
that the ledger keeps its old schema whole."""


def _run(db: sqlite_utils.Database, sql: str) -> None:
    """One statement of a migration, on the connection as it is (never a commit of its own:
    the transaction is :meth:`Ledger._migrate`'s)."""
    db.conn.execute(sql)
    _statement_done(sql)


class _Progress(threading.local):
    """Statements run by the migration under way on this thread (one per ledger thread)."""

    statements = 0


_progress = _Progress()


def _statement_done(sql: str) -> None:
    _progress.statements += 1
    if migration_hook is not None:
        migration_hook(_progress.statements, sql)


def _create_table(db: sqlite_utils.Database, table: str, columns: dict[str, type],
                  pk: str) -> None:
    defs = ", ".join(f'"{name}" {_SQL_TYPES[kind]}' + (" PRIMARY KEY" if name == pk else "")
                     for name, kind in columns.items())
    _run(db, f'CREATE TABLE "{table}" ({defs})')


def _create_index(db: sqlite_utils.Database, table: str, column: str) -> None:
    # sqlite-utils' index name, so that ledgers of every release have the same indexes.
    _run(db, f'CREATE INDEX "idx_{table}_{column}" ON "{table}" ("{column}")')


def _add_columns(db: sqlite_utils.Database, table: str, columns: dict[str, type]) -> None:
    for name, kind in columns.items():
        _run(db, f'ALTER TABLE "{table}" ADD COLUMN "{name}" {_SQL_TYPES[kind]}')


# Migrations are plain SQL on the connection, not sqlite-utils' create/add_column: those
# commit by themselves outside a transaction (and 3.x always did), which left a ledger that
# crashed mid-migration with some columns and its old user_version, so the next start failed
# on "duplicate column". Each one runs in Ledger._migrate's BEGIN IMMEDIATE ... COMMIT.


def _migrate_v1(db: sqlite_utils.Database) -> None:
    """The first schema: nodes, GPUs, leases with history, and the event log."""
    _create_table(db, "nodes", NODES_V1, "host")
    _create_table(db, "gpus", GPUS_V1, "uuid")
    _create_index(db, "gpus", "host")
    _create_table(db, "leases", LEASES_V1, "lease_id")
    for column in ("state", "request_key", "user", "created_at"):
        _create_index(db, "leases", column)
    _create_table(db, "lease_history", HISTORY_V1, "id")
    _create_index(db, "lease_history", "lease_id")
    _create_table(db, "events", EVENTS_V1, "id")
    _create_index(db, "events", "at")
    _create_index(db, "events", "kind")


def _migrate_v2(db: sqlite_utils.Database) -> None:
    """MIG and compute capability per GPU, so a restarted allocator knows before the first
    heartbeat that a GPU in MIG mode is no unit of its own."""
    _add_columns(db, "gpus", GPUS_V2)


def _migrate_v3(db: sqlite_utils.Database) -> None:
    """Where this ledger stands in the replicated log (see :mod:`allocator.ledger.replication`)."""
    _create_table(db, "log_position", LOG_POSITION_V3, "id")


def _migrate_v4(db: sqlite_utils.Database) -> None:
    """Fair share: borrowed leases, reclaim warnings (their deadlines survive a restart) and
    idle accounting."""
    _add_columns(db, "leases", LEASES_V4)


def _migrate_v5(db: sqlite_utils.Database) -> None:
    """Where the newest snapshot of the replicated log is, and how much the log has grown
    since (NULL: not known, as in a ledger that followed the log before snapshots)."""
    _add_columns(db, "log_position", LOG_POSITION_V5)


def _migrate_v6(db: sqlite_utils.Database) -> None:
    """Each lease's owner: the broker user whose request made it (NULL for every lease
    made before: owner unknown, releasable by any broker user as before, so that an
    upgrade strands no lease)."""
    _add_columns(db, "leases", LEASES_V6)


def _migrate_v7(db: sqlite_utils.Database) -> None:
    """Bookings (:mod:`allocator.bookings`): one row per booking name, the booking as the
    JSON it was admitted as, who made it and when; a removed booking keeps its row with
    ``removed_at`` and ``removed_by`` set (its history is in the events)."""
    _create_table(db, "bookings", BOOKINGS_V7, "name")


def _migrate_v8(db: sqlite_utils.Database) -> None:
    """Each lease's usage as its node agent measured it (energy, SM- and memory-seconds, peak
    memory) and the measurement folded in last (NULL for every lease before: not measured)."""
    _add_columns(db, "leases", LEASES_V8)


MIGRATIONS: list[Callable[[sqlite_utils.Database], None]] = [_migrate_v1, _migrate_v2,
                                                             _migrate_v3, _migrate_v4,
                                                             _migrate_v5, _migrate_v6,
                                                             _migrate_v7, _migrate_v8]
"""``MIGRATIONS[n]`` takes a ledger from schema ``n`` to ``n + 1``."""


def _insert_sql(table: str) -> str:
    columns = [column for column in COLUMNS[table] if column != "id"]
    names = ", ".join(f'"{column}"' for column in columns)
    marks = ", ".join(f":{column}" for column in columns)
    return f'INSERT INTO "{table}" ({names}) VALUES ({marks})'


_INSERT_SQL = {table: _insert_sql(table) for table in INSERTED}
"""Appending a row of the lease history or the events: every column but the row id."""


def _upsert_sql(table: str, columns: list[str], pk: str) -> str:
    cols = ", ".join(f'"{c}"' for c in columns)
    marks = ", ".join("?" for _ in columns)
    updates = ", ".join(f'"{c}" = excluded."{c}"' for c in columns if c != pk)
    return (f'INSERT INTO "{table}" ({cols}) VALUES ({marks}) '
            f'ON CONFLICT("{pk}") DO UPDATE SET {updates}')


def _encode(value: Any) -> Any:
    if isinstance(value, list | dict):
        return json.dumps(value)
    return value


class Ledger:
    """The SQLite ledger, owned by one writer thread."""

    def __init__(self, path: str | Path, *, synchronous: Literal["full", "normal"] = "full"):
        self.path = Path(path)
        self._synchronous = "normal" if synchronous == "normal" else "full"
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger")
        self._db: sqlite_utils.Database | None = None
        self._thread: threading.Thread | None = None
        self._lock: LedgerLock | None = None

    # -- threading -------------------------------------------------------------------------

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the ledger's thread and await its result."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the ledger's thread and block for its result (for CLIs and tests)."""
        return self._executor.submit(fn).result()

    @property
    def db(self) -> sqlite_utils.Database:
        """The connection; only valid on the ledger's thread."""
        if self._db is None:
            raise LedgerError("the ledger is not open")
        if threading.current_thread() is not self._thread:
            raise LedgerError("the ledger connection may only be used on its own thread")
        return self._db

    # -- open / close ----------------------------------------------------------------------

    def open(self) -> None:
        """Open for writing, creating and migrating as needed (read-only readers use
        :func:`allocator.ledger.readonly.open_readonly`). Runs on the ledger thread."""
        self.call(self._open)

    def _open(self) -> None:
        self._thread = threading.current_thread()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Shared: the allocator and a standby on the same file may both hold it; only
        # `gpu-ledger restore` takes it exclusively, so it never replaces a ledger in use.
        self._lock = LedgerLock.take(self.path, exclusive=False, wait_s=LOCK_WAIT_S)
        try:
            full = _full_filesystem(self.path)
            if full is not None:
                raise LedgerUnwritable(full)
            self._db = self._connect_and_migrate()
        except BaseException:
            self._lock.release()
            self._lock = None
            raise

    def _connect_and_migrate(self) -> sqlite_utils.Database:
        try:
            conn = sqlite3.connect(str(self.path), check_same_thread=True)
        except sqlite3.DatabaseError as exc:
            raise self._unreadable(exc) from exc
        try:
            conn.execute("PRAGMA busy_timeout = 5000")
            db = sqlite_utils.Database(conn)
            try:
                version = db.execute("PRAGMA user_version").fetchone()[0]
                tables = set(db.table_names())
            except sqlite3.DatabaseError as exc:
                raise self._unreadable(exc) from exc
            if version > SCHEMA_VERSION:
                raise LedgerError(
                    f"{self.path} has schema version {version}, newer than this release "
                    f"understands ({SCHEMA_VERSION}); upgrade swarm-gpu"
                )
            if version == 0 and tables:
                raise LedgerError(f"{self.path} is an SQLite file but not a swarm-gpu ledger")
            if tables:
                self._quick_check(conn)
            try:
                # WAL: readers (the CLI, backups) never block the writer, and a commit is
                # one sequential append. synchronous=FULL (the default) because a granted
                # lease must survive a crash of the machine, not only of the process; see
                # AllocatorSettings.
                db.execute("PRAGMA journal_mode = WAL")
                db.execute(f"PRAGMA synchronous = {self._synchronous.upper()}")
            except sqlite3.DatabaseError as exc:
                raise self._unreadable(exc) from exc
            if version < SCHEMA_VERSION:
                self._migrate(conn, db)
        except BaseException:
            conn.close()
            raise
        return db

    def _unreadable(self, exc: sqlite3.DatabaseError) -> LedgerError:
        if _on_read_only_filesystem(self.path):
            return LedgerError(f"cannot open the ledger {self.path} for writing: its "
                               f"filesystem is read-only ({exc})")
        if _is_corruption(exc):
            return LedgerCorrupt(self.path, str(exc))
        if "locked" in str(exc) or "busy" in str(exc):
            return LedgerError(f"the ledger {self.path} is locked by another process: {exc}")
        return LedgerError(f"{self.path} is not a readable ledger: {exc}; if it was one, it "
                           f"is damaged: {what_to_do_with_a_damaged_ledger(self.path)}")

    def _quick_check(self, conn: sqlite3.Connection) -> None:
        """Refuse a ledger whose pages are damaged before anything is read or migrated.

        ``quick_check`` reads every page and checks its structure (not index contents
        against tables, which ``integrity_check`` does at several times the cost); a
        damaged page found here is better than a half-loaded engine or a migration
        failing on it. Its cost at open is measured in ``bench/ledger_open.py``.
        """
        try:
            problems = [str(row[0]) for row in conn.execute("PRAGMA quick_check(5)")]
        except sqlite3.DatabaseError as exc:
            if not _is_corruption(exc):
                raise self._unreadable(exc) from exc
            problems = [str(exc)]
        if problems != ["ok"]:
            raise LedgerCorrupt(self.path, "; ".join(problems))

    def _migrate(self, conn: sqlite3.Connection, db: sqlite_utils.Database) -> None:
        """Take the ledger to :data:`SCHEMA_VERSION`, one migration per transaction.

        Each migration's DDL and its ``user_version`` run in one explicit ``BEGIN
        IMMEDIATE ... COMMIT``: SQLite's DDL is transactional, but Python's sqlite3 (in its
        default isolation handling) begins transactions only before DML, so DDL inside
        ``with conn:`` committed statement by statement. With ``isolation_level = None`` the
        module issues no BEGIN or COMMIT of its own and the transaction is exactly ours
        (``tests/ledger/test_ledger_migrations.py`` checks both). A crash mid-migration leaves the
        previous schema whole. The version is read again inside each transaction: a standby
        sharing the file may have migrated it meanwhile.
        """
        _progress.statements = 0
        saved = conn.isolation_level
        conn.isolation_level = None
        try:
            while True:
                version = 0
                try:
                    conn.execute("BEGIN IMMEDIATE")
                    version = int(conn.execute("PRAGMA user_version").fetchone()[0])
                    if version >= SCHEMA_VERSION:
                        conn.execute("COMMIT")
                        return
                    MIGRATIONS[version](db)
                    # PRAGMA user_version is written in the database header, inside the
                    # same transaction as the DDL.
                    conn.execute(f"PRAGMA user_version = {version + 1}")
                    _statement_done(f"PRAGMA user_version = {version + 1}")
                    conn.execute("COMMIT")
                except sqlite3.Error as exc:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise self._migration_failed(version, exc) from exc
        finally:
            conn.isolation_level = saved

    def _migration_failed(self, version: int, exc: sqlite3.Error) -> LedgerError:
        if _on_read_only_filesystem(self.path):
            return LedgerError(f"cannot migrate the ledger {self.path}: its filesystem is "
                               f"read-only ({exc})")
        if isinstance(exc, sqlite3.DatabaseError) and _is_corruption(exc):
            return LedgerCorrupt(self.path, str(exc))
        hint = ""
        if "duplicate column" in str(exc) or "already exists" in str(exc):
            hint = (" (a release before 0.2.0 that stopped mid-migration leaves a ledger "
                    "so)")
        return LedgerError(
            f"cannot migrate the ledger {self.path} from schema {version} to {version + 1}: "
            f"{exc}{hint}; nothing of it was written, the ledger is still at schema "
            f"{version}: restore a backup (gpu-ledger restore BACKUP --ledger {self.path}) "
            f"or move the ledger away to rebuild from the nodes")

    def close(self) -> None:
        """Close the connection and stop the thread."""
        def _close() -> None:
            if self._db is not None:
                self._db.conn.close()
                self._db = None
            if self._lock is not None:
                self._lock.release()
                self._lock = None
        try:
            self.call(_close)
        finally:
            self._executor.shutdown(wait=True)

    # -- writes ----------------------------------------------------------------------------

    def data_version(self) -> int:
        """SQLite's data_version: changes when *another* connection commits (ledger thread)."""
        return int(self.db.execute("PRAGMA data_version").fetchone()[0])

    def commit(self, changes: Changes, *, expect_version: int | None = None,
               position: LogPosition | None = None) -> None:
        """Write one batch in one transaction (on the ledger thread).

        With ``expect_version``, first check that no other process wrote since then, and
        raise :class:`LedgerChanged` (writing nothing) if one did: an allocator that was a
        standby must not write decisions made on a stale picture. With ``position``, record
        in the same transaction that the batch is the log entry at that position.
        """
        if expect_version is not None and self.data_version() != expect_version:
            raise LedgerChanged(f"{self.path} was written by another process")
        if not changes and position is None:
            return
        conn = self.db.conn
        try:
            with conn:
                if position is not None:
                    self._write_position(conn, position)
                self._write_rows(conn, "nodes", "host", list(changes.nodes.values()))
                self._write_rows(conn, "gpus", "uuid", list(changes.gpus.values()))
                self._write_rows(conn, "leases", "lease_id", list(changes.leases.values()))
                self._write_rows(conn, "bookings", "name", list(changes.bookings.values()))
                if changes.history:
                    conn.executemany(_INSERT_SQL["lease_history"], changes.history)
                if changes.events:
                    conn.executemany(_INSERT_SQL["events"], changes.events)
        except sqlite3.Error as exc:
            raise _write_failed(self.path, exc) from exc

    @staticmethod
    def _write_position(conn: sqlite3.Connection, position: LogPosition) -> None:
        conn.execute(
            "INSERT OR REPLACE INTO log_position (id, log_id, log_offset, entry_id, epoch, "
            "writer, snapshot_from, bytes_since_snapshot) VALUES (1, ?, ?, ?, ?, ?, ?, ?)",
            (position.log_id, position.offset, position.entry_id, position.epoch,
             position.writer, position.snapshot_from, position.bytes_since_snapshot))

    def load_snapshot(self, tables: Tables, position: LogPosition, *,
                      loaded_at: float | None = None) -> None:
        """Make the ledger's state the snapshot's, in one transaction with its position (on
        the ledger thread).

        Every node, GPU and lease row is replaced by the snapshot's, with the leases' owners
        from its table :data:`LEASE_OWNERS` (none in a snapshot of 0.1.0) and their measured
        usage from :data:`LEASE_USAGE_BESIDE` (none before 0.3.0). The audit trail
        is kept and gets the snapshot's trail tables if it carries them (a log seeded from a ledger
        with data); without them and with ``loaded_at``, one event ``log_snapshot_loaded``
        says from where on this ledger's trail is whole.
        """
        conn = self.db.conn
        try:
            with conn:
                for name in STATE_TABLES:
                    conn.execute(f'DELETE FROM "{name}"')
                for name in (*STATE_TABLES, *TRAIL_TABLES):
                    table = tables.get(name)
                    if table is None or not table.rows:
                        continue
                    known = {r[1] for r in conn.execute(f'PRAGMA table_info("{name}")')}
                    if name in TRAIL_TABLES:
                        known.discard("id")  # row ids are each ledger's own
                    unknown = set(table.columns) - known
                    if unknown:
                        raise LedgerError(
                            f"the snapshot's table {name} has columns this ledger does not "
                            f"have: {', '.join(sorted(unknown))} (written by a newer release?)")
                    names = ", ".join(f'"{c}"' for c in table.columns)
                    marks = ", ".join("?" for _ in table.columns)
                    conn.executemany(f'INSERT INTO "{name}" ({names}) VALUES ({marks})',
                                     table.rows)
                owners = tables.get(LEASE_OWNERS)
                if owners is not None and owners.rows:
                    if owners.columns != ["lease_id", OWNER_COLUMN]:
                        raise LedgerError(f"the snapshot's table {LEASE_OWNERS} has the "
                                          f"columns {owners.columns}, not lease_id and owner")
                    conn.executemany('UPDATE leases SET "owner" = ? WHERE lease_id = ?',
                                     [(owner, lease_id) for lease_id, owner in owners.rows])
                usage = tables.get(LEASE_USAGE_BESIDE)
                if usage is not None and usage.rows:
                    if usage.columns != ["lease_id", *LEASES_V8]:
                        raise LedgerError(f"the snapshot's table {LEASE_USAGE_BESIDE} has the "
                                          f"columns {usage.columns}, not lease_id and "
                                          f"{', '.join(LEASES_V8)}")
                    sets = ", ".join(f'"{column}" = ?' for column in LEASES_V8)
                    conn.executemany(f"UPDATE leases SET {sets} WHERE lease_id = ?",
                                     [(*row[1:], row[0]) for row in usage.rows])
                if loaded_at is not None and not any(t in tables for t in TRAIL_TABLES):
                    conn.execute(
                        "INSERT INTO events (at, kind, detail) VALUES (?, ?, ?)",
                        (loaded_at, "log_snapshot_loaded", json.dumps(
                            {"log_id": position.log_id, "log_offset": position.offset,
                             "as_of_offset": position.snapshot_from,
                             "why": "lease history and events before this are not in this "
                                    "ledger: a snapshot carries state, not the trail"})))
                self._write_position(conn, position)
        except sqlite3.Error as exc:
            raise _write_failed(self.path, exc) from exc

    @staticmethod
    def _write_rows(conn: sqlite3.Connection, table: str, pk: str,
                    rows: list[dict[str, Any]]) -> None:
        # Rows of one table may carry different column sets (a partial node update): group them.
        # Not sqlite-utils' upsert_all: it reads the table's schema on every call, which made
        # one allocate's commit 2.5x (fsync per commit) to 2.9x (no fsync) slower, measured.
        by_columns: dict[tuple[str, ...], list[list[Any]]] = {}
        for row in rows:
            columns = tuple(row)
            by_columns.setdefault(columns, []).append([_encode(row[c]) for c in columns])
        for columns, values in by_columns.items():
            unknown = set(columns) - COLUMNS[table].keys()
            if unknown:  # never SQL: the log's rows are checked already, this guards the rest
                raise BrokenChanges(f"{table} has no column {', '.join(sorted(unknown))}")
            conn.executemany(_upsert_sql(table, list(columns), pk), values)

    # -- reads -----------------------------------------------------------------------------

    def load(self, finished_limit: int = 10_000) -> LoadedState:
        """Everything the allocator needs in memory (on the ledger thread), with the newest
        ``finished_limit`` final leases."""
        # Plain cursors, not sqlite-utils' row dicts: at 5,000 hosts (40,000 GPU rows) the
        # dicts and a json.loads per GPU were most of a cold start's load time (measured).
        conn = self.db.conn
        nodes: dict[str, Node] = {}
        agent_users: dict[str, str] = {}
        for host, last_heartbeat, drained, agent_id, agent_user in conn.execute(
                "SELECT host, last_heartbeat, drained, agent_id, agent_user FROM nodes"):
            nodes[host] = Node(host=host, last_heartbeat=last_heartbeat, drained=bool(drained),
                               agent_id=agent_id)
            if agent_user:
                agent_users[host] = agent_user
        gpus = []
        health_of = {health.value: health for health in Health}
        for (uuid, host, idx, model, memory_total_mib, share_slots, health, health_reasons,
             drained, present, memory_used_mib, utilization_pct, temperature_c, power_w,
             compute_capability, architecture, mig_enabled, mig_parent_uuid, mig_profile,
             mig_index) in conn.execute(
                "SELECT uuid, host, idx, model, memory_total_mib, share_slots, health, "
                "health_reasons, drained, present, memory_used_mib, utilization_pct, "
                "temperature_c, power_w, compute_capability, architecture, mig_enabled, "
                "mig_parent_uuid, mig_profile, mig_index FROM gpus "
                "ORDER BY host, idx, coalesce(mig_index, -1)"):
            gpu = GPU(
                uuid=uuid, host=host, index=idx, model=model, memory_total_mib=memory_total_mib,
                share_slots=share_slots or 1,
                health=(health_of.get(health) or Health(health)) if health else Health.HEALTHY,
                health_reasons=(json.loads(health_reasons)
                                if health_reasons and health_reasons != "[]" else []),
                drained=bool(drained), present=bool(present),
                memory_used_mib=memory_used_mib or 0, utilization_pct=utilization_pct,
                temperature_c=temperature_c, power_w=power_w,
                compute_capability=compute_capability, architecture=architecture,
                mig_enabled=bool(mig_enabled), mig_parent_uuid=mig_parent_uuid,
                mig_profile=mig_profile, mig_index=mig_index,
            )
            gpus.append(gpu)
            owner = nodes.get(host)
            if owner is not None:
                owner.gpu_uuids.append(uuid)
        active = [s.value for s in LeaseState if not s.final]
        leases = self._lease_records(
            f"state IN ({', '.join('?' for _ in active)}) ORDER BY created_at", active)
        final = [s.value for s in LeaseState if s.final]
        finished = self._lease_records(
            f"state IN ({', '.join('?' for _ in final)}) ORDER BY created_at DESC LIMIT ?",
            [*final, finished_limit])
        finished.reverse()
        bookings = self.bookings()
        return LoadedState(list(nodes.values()), gpus, leases, agent_users, finished,
                           bookings, self.booking_alerts(bookings) if bookings else {})

    def booking_alerts(self, bookings: Sequence[BookingRow]) -> dict[str, str]:
        """Booking name -> the kind of its newest event among :data:`BOOKING_ALERT_KINDS`
        since its ``booking_added`` (a booking of the same name removed before says nothing of
        it), for ``bookings`` (on the ledger thread). Those events are few (one per booking
        and per change of state), and the events' ``kind`` index finds them."""
        held = {row.name for row in bookings}
        kinds = ("booking_added", *BOOKING_ALERT_KINDS)
        newest: dict[str, str] = {}
        for kind, detail in self.db.conn.execute(
                f"SELECT kind, detail FROM events WHERE kind IN ({', '.join('?' for _ in kinds)})"
                " ORDER BY id", kinds):
            name = json.loads(detail or "{}").get("booking")
            if name not in held:
                continue
            if kind == "booking_added":
                newest.pop(name, None)
            else:
                newest[name] = kind
        return newest

    def bookings(self) -> list[BookingRow]:
        """The bookings not removed, oldest first: the order they were admitted in (on the
        ledger thread)."""
        return [BookingRow(name, json.loads(booking), created_at, created_by)
                for name, booking, created_at, created_by in self.db.conn.execute(
                    "SELECT name, booking, created_at, created_by FROM bookings "
                    "WHERE removed_at IS NULL ORDER BY created_at, name")]

    def _lease_records(self, where: str, params: Sequence[Any]) -> list[LeaseRecord]:
        """The leases whose rows match ``where`` (with its ``ORDER BY``), read straight from
        the cursor's values (:func:`allocator.ledger.lease.row_reader`)."""
        cursor = self.db.conn.execute(f"SELECT * FROM leases WHERE {where}", params)
        read = row_reader(tuple(column[0] for column in cursor.description))
        return [read(values) for values in cursor]

    def log_position(self) -> LogPosition | None:
        """Where this ledger stands in the replicated log; None if it never applied one."""
        row = self.db.execute("SELECT log_id, log_offset, entry_id, epoch, writer, "
                              "snapshot_from, bytes_since_snapshot "
                              "FROM log_position WHERE id = 1").fetchone()
        return LogPosition(*row) if row is not None else None

    def is_empty(self) -> bool:
        """No node, GPU, lease or booking: nothing a log would have to start from."""
        return not any(self.db.execute(f'SELECT 1 FROM "{table}" LIMIT 1').fetchone()
                       for table in ("nodes", "gpus", "leases", "bookings"))

    def snapshot_tables(self, *, trail: bool) -> tuple[LogPosition | None, Tables]:
        """The ledger's tables as stored (JSON columns stay text; the leases' owners in a
        table beside them, :data:`LEASE_OWNERS`), and its position, read in one go on the
        ledger thread, so the tables are the state at that position: a snapshot for the
        replicated log. With ``trail``, the lease history and events too (without
        their row ids, which are each ledger's own)."""
        tables: Tables = {}
        for name in (*STATE_TABLES, *(TRAIL_TABLES if trail else ())):
            order = " ORDER BY id" if name in TRAIL_TABLES else ""
            cursor = self.db.conn.execute(f'SELECT * FROM "{name}"{order}')
            columns = [d[0] for d in cursor.description]
            rows = [list(row) for row in cursor]
            if name in TRAIL_TABLES:
                keep = [i for i, column in enumerate(columns) if column != "id"]
                rows = [[row[i] for i in keep] for row in rows]
                columns = [columns[i] for i in keep]
            beside: dict[str, Table] = {}
            if name == "leases":
                # The owners and the measured usage beside the leases (LEASE_OWNERS,
                # LEASE_USAGE_BESIDE), so that 0.1.0 and 0.2.0 load it.
                key = columns.index("lease_id")
                at = columns.index(OWNER_COLUMN)
                beside[LEASE_OWNERS] = Table(
                    ["lease_id", OWNER_COLUMN],
                    [[row[key], row[at]] for row in rows if row[at] is not None])
                measured = [columns.index(column) for column in LEASES_V8]
                beside[LEASE_USAGE_BESIDE] = Table(
                    ["lease_id", *LEASES_V8],
                    [[row[key], *(row[i] for i in measured)] for row in rows
                     if any(row[i] is not None for i in measured)])
                keep = [i for i, column in enumerate(columns)
                        if column != OWNER_COLUMN and column not in USAGE_COLUMNS]
                rows = [[row[i] for i in keep] for row in rows]
                columns = [columns[i] for i in keep]
            tables[name] = Table(columns, rows)
            tables.update(beside)
        return self.log_position(), tables

    def find_lease(self, lease_id: str) -> LeaseRecord | None:
        """A lease by id, final ones included (on the ledger thread)."""
        rows = list(self.db["leases"].rows_where("lease_id = ?", [lease_id]))
        return LeaseRecord.from_row(rows[0]) if rows else None

    def latest_lease_for_key(self, request_key: str, *,
                             asker: str | None = None,
                             every_owner: bool = True) -> LeaseRecord | None:
        """The newest lease of a request key, final ones included (on the ledger thread):
        any owner's, or, without ``every_owner``, one of the broker user ``asker``'s or of
        an owner not known (request keys are each broker user's own,
        :func:`allocator.engine.leases.key_space`)."""
        where = "request_key = ?"
        params: list[str | None] = [request_key]
        if not every_owner:
            where += " AND (owner IS NULL OR owner = ?)"
            params.append(asker)
        rows = list(self.db["leases"].rows_where(
            where, params, order_by="created_at desc", limit=1))
        return LeaseRecord.from_row(rows[0]) if rows else None

