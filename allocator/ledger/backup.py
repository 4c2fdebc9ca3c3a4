"""Backups of the ledger, and restores from them (``gpu-ledger backup`` and ``restore``).

A backup is taken with SQLite's online backup API while the allocator writes: one step that
copies every page inside one read transaction, so the copy is the ledger as of one commit
(in WAL mode the reader neither waits for nor blocks the writer). It is one self-contained
file (journal mode DELETE, no ``-wal``), checked with ``PRAGMA integrity_check``, and
appears under its name only when complete. The backup holds every lease and user name: it is
readable by its owner only (mode 0600, whatever the umask), and it is written into a file of
a name nobody can guess, made for it (``O_EXCL``) in the target's folder and renamed into
place, so a file or a link someone planted in a shared folder is never written through nor
removed. It records, as an event ``ledger_backup`` of its
own, when it was taken, from where, and the ledger log position it holds (a ledger keeps its
position in the replicated log in its table ``log_position``, which the copy carries as of
the same commit as everything else).

A restore replaces the ledger with a backup while no allocator has it open: every
:class:`~allocator.ledger.store.Ledger` holds the ledger's lock shared, the restore takes it
exclusive and refuses when it cannot, and refuses too when another process (an allocator of
a release before the lock, a ``sqlite3`` shell) still has the file open. The ledger it
replaces is kept beside it, never deleted. With ``new_log`` the backup's log position is
cleared: the old log is gone, and the allocator starts a new one with a snapshot of this
ledger; without, the allocator catches up from the backup's position.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from allocator.ledger.log_position import LogPosition
from allocator.ledger.readonly import ledger_error, open_readonly
from allocator.ledger.store import LedgerCorrupt, LedgerError, LedgerInUse, LedgerLock
from allocator.wire.protocol import LeaseState

BACKUP_EVENT = "ledger_backup"
"""The event a backup records in itself: when, from where, and its log position."""

RESTORE_EVENT = "ledger_restored"
"""The event a restore records in the restored ledger: from which backup, and the position."""


@dataclass(frozen=True)
class BackupInfo:
    """What a backup holds, read from the backup itself."""

    path: Path
    schema: int
    """Its schema version (the allocator migrates an older one at start)."""
    taken_at: float | None
    """When ``gpu-ledger backup`` took it; None for a copy made otherwise."""
    newest_record_at: float | None
    """The newest time in its leases, lease history and events: what it can know up to."""
    position: LogPosition | None
    """Its place in the replicated ledger log; None: it followed no log."""
    leases: int
    active_leases: int

    @property
    def as_of(self) -> float | None:
        """The best known time the backup's contents are from."""
        return self.taken_at if self.taken_at is not None else self.newest_record_at


@dataclass(frozen=True)
class RestoreResult:
    """What a restore did."""

    backup: BackupInfo
    ledger: Path
    replaced: list[Path]
    """The files of the ledger it replaced, kept under new names (empty: there was none)."""
    position_cleared: bool
    """``new_log`` cleared a log position the backup had."""


def stamp(at: float) -> str:
    """A UTC time stamp for file names (``20261203T081500Z``)."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y%m%dT%H%M%SZ")


TARGET_ERRORS = ("SQLITE_CANTOPEN", "SQLITE_READONLY", "SQLITE_FULL", "SQLITE_IOERR",
                 "SQLITE_PERM")
"""SQLite's errors that, met while the copy is written, are the target's fault (its folder,
its disk), not the source ledger's."""


def backup_path(target: Path | str, *, now: float) -> Path:
    """Where ``gpu-ledger backup TARGET`` writes: ``TARGET/ledger-<stamp>.sqlite`` when
    TARGET is a folder, or names one by ending in ``/`` (a folder made for it, its parent
    must exist); else TARGET itself."""
    text = str(target)
    folder = Path(text)
    if folder.is_dir() or text.endswith(("/", os.sep)):
        return folder / f"ledger-{stamp(now)}.sqlite"
    return folder


def backup(ledger: Path, target: Path | str, *, now: float, overwrite: bool = False,
           busy_timeout_s: float = 5.0) -> BackupInfo:
    """Copy ``ledger`` to ``target`` (a file, or a folder to put ``ledger-<stamp>.sqlite``
    in: :func:`backup_path`) while its allocator may be writing; returns what the backup
    holds. :class:`LedgerError` names the target and why when it cannot be written, the
    ledger when it cannot be read."""
    named_folder = str(target).endswith(("/", os.sep))
    target = backup_path(target, now=now)
    if named_folder and not target.parent.exists() and target.parent.parent.is_dir():
        try:
            target.parent.mkdir(mode=0o700)
        except OSError as exc:
            raise LedgerError(f"cannot make the folder {target.parent} for the backup: "
                              f"{exc.strerror or exc}") from exc
    if not target.parent.is_dir():
        raise LedgerError(f"no folder {target.parent} to put the backup in")
    if target.exists() and not overwrite:
        raise LedgerError(f"{target} exists; give another path, or --force to replace it")
    if ledger.exists() and target.exists() and target.samefile(ledger):
        raise LedgerError(f"{target} is the ledger itself")
    source = open_readonly(ledger, busy_timeout_s=busy_timeout_s)
    try:
        partial = _new_file(target, "partial", "the backup")
        try:
            _copy(source, partial, ledger, written=target)
            with contextlib.closing(sqlite3.connect(partial)) as copy:
                position = _position(copy)
                detail: dict[str, object] = {"source": str(ledger.resolve()),
                                             "why": "taken by gpu-ledger backup"}
                if position is not None:
                    detail.update(log_id=position.log_id, log_offset=position.offset,
                                  entry_id=position.entry_id, epoch=position.epoch)
                with copy:
                    copy.execute("INSERT INTO events (at, kind, detail) VALUES (?, ?, ?)",
                                 (now, BACKUP_EVENT, json.dumps(detail)))
                _integrity_check(copy, ledger)
            _sync(partial)
            _put_in_place(partial, target, overwrite=overwrite)
            _sync(target.parent)
        except sqlite3.Error as exc:
            raise _write_error(exc, target, ledger) from exc
        except OSError as exc:
            raise LedgerError(f"cannot write the backup {target}: "
                              f"{exc.strerror or exc}") from exc
        finally:
            partial.unlink(missing_ok=True)
    finally:
        source.close()
    return inspect(target)


def _new_file(beside: Path, what: str, role: str) -> Path:
    """A new, empty file of a name nobody can guess in ``beside``'s folder, made with
    ``O_EXCL`` and mode 0600 (``mkstemp``): SQLite then opens a file that is this process's
    own, never one a name planted in a shared folder leads to. ``role`` names the file in
    the error (:class:`LedgerError`) that says why it cannot be made."""
    try:
        fd, name = tempfile.mkstemp(prefix=f".{beside.name}.{what}-", dir=beside.parent)
    except OSError as exc:
        raise LedgerError(f"cannot write {role} {beside}: {exc.strerror or exc}") from exc
    os.close(fd)
    return Path(name)


def _put_in_place(partial: Path, target: Path, *, overwrite: bool) -> None:
    """Rename ``partial`` to ``target`` at once; without ``overwrite`` a file that appeared
    at ``target`` meanwhile is kept and refused (a hard link, which never replaces)."""
    if overwrite:
        os.replace(partial, target)
        return
    try:
        os.link(partial, target)
    except FileExistsError as exc:
        raise LedgerError(f"{target} exists; give another path, or --force to replace "
                          "it") from exc
    except OSError:
        # A filesystem without hard links: the check above has to do.
        if target.exists():
            raise LedgerError(f"{target} exists; give another path, or --force to replace "
                              "it") from None
        os.replace(partial, target)


def _write_error(exc: sqlite3.Error, target: Path, ledger: Path) -> LedgerError:
    """An SQLite error of a backup: the target's when it is of writing (:data:`TARGET_ERRORS`),
    else the source ledger's (:func:`allocator.ledger.readonly.ledger_error`)."""
    name = getattr(exc, "sqlite_errorname", "") or ""
    if name.startswith(TARGET_ERRORS):
        return LedgerError(f"cannot write the backup {target}: {exc}")
    return ledger_error(ledger, exc)


def inspect(path: Path) -> BackupInfo:
    """What the backup (or any ledger file) at ``path`` holds; :class:`LedgerError` if it is
    no ledger, of a newer schema, or damaged."""
    conn = open_readonly(path)
    try:
        _integrity_check(conn, path)
        schema = int(conn.execute("PRAGMA user_version").fetchone()[0])
        taken = conn.execute("SELECT max(at) FROM events WHERE kind = ?",
                             (BACKUP_EVENT,)).fetchone()[0]
        newest = max((value for (value,) in conn.execute(
            "SELECT max(at) FROM events UNION ALL SELECT max(at) FROM lease_history "
            "UNION ALL SELECT max(created_at) FROM leases") if value is not None),
            default=None)
        final = [state.value for state in LeaseState if state.final]
        leases, active = conn.execute(
            f"SELECT count(*), coalesce(sum(state NOT IN ({', '.join('?' for _ in final)})), 0) "
            "FROM leases", final).fetchone()
        return BackupInfo(path=path, schema=schema, taken_at=taken, newest_record_at=newest,
                          position=_position(conn), leases=int(leases),
                          active_leases=int(active))
    except sqlite3.Error as exc:
        raise ledger_error(path, exc) from exc
    finally:
        conn.close()


def restore(source: Path, ledger: Path, *, new_log: bool, now: float) -> RestoreResult:
    """Make the ledger at ``ledger`` a copy of the backup ``source``; the allocator must be
    stopped (:class:`LedgerInUse` otherwise, and nothing is changed)."""
    info = inspect(source)
    if ledger.exists() and ledger.samefile(source):
        raise LedgerError(f"{source} is the ledger itself")
    ledger.parent.mkdir(parents=True, exist_ok=True)
    lock = LedgerLock.take(ledger, exclusive=True)
    try:
        partial = _new_file(ledger, "restoring", "the restored ledger")
    except BaseException:
        lock.release()
        raise
    try:
        # The new file first, complete and synced, so the ledger is missing only between
        # two renames.
        backup_conn = open_readonly(source)
        try:
            _copy(backup_conn, partial, source, written=ledger)
        finally:
            backup_conn.close()
        if ledger.exists():  # the restored ledger is the allocator's as the one it replaces
            kept = ledger.stat()
            os.chmod(partial, kept.st_mode & 0o7777)
            with contextlib.suppress(PermissionError):  # only root may give it away
                os.chown(partial, kept.st_uid, kept.st_gid)
        cleared = False
        with contextlib.closing(sqlite3.connect(partial)) as copy:
            position = _position(copy)
            detail: dict[str, object] = {"backup": str(source.resolve()),
                                         "backup_taken_at": info.as_of}
            if position is not None:
                detail.update(log_id=position.log_id, log_offset=position.offset)
            with copy:
                if new_log and position is not None:
                    copy.execute("DELETE FROM log_position")
                    cleared = True
                detail["log_position"] = ("none" if position is None
                                          else "cleared" if cleared else "kept")
                copy.execute("INSERT INTO events (at, kind, detail) VALUES (?, ?, ?)",
                             (now, RESTORE_EVENT, json.dumps(detail)))
        _sync(partial)
        replaced = _retire(ledger, f"replaced-{stamp(now)}")
        os.replace(partial, ledger)
        _sync(ledger.parent)
    except sqlite3.Error as exc:
        raise ledger_error(source, exc) from exc
    finally:
        partial.unlink(missing_ok=True)
        lock.release()
    return RestoreResult(backup=info, ledger=ledger, replaced=replaced,
                         position_cleared=cleared)


def _copy(source: sqlite3.Connection, target: Path, name: Path, *, written: Path) -> None:
    """The whole of ``source`` (the ledger ``name``) into ``target``, an empty file of this
    process's own (:func:`_new_file`), as of one commit; ``written`` is where it goes, for
    errors."""
    if target.stat().st_size != 0:
        raise LedgerError(f"cannot write {written}: {target} is not the empty file made for it")
    with contextlib.closing(sqlite3.connect(target)) as copy:
        # pages=-1: every page in one step, inside one read transaction of the source. In
        # steps, a commit by the allocator between two would restart the copy from the start.
        source.backup(copy, pages=-1)
        # One file: a backup in WAL mode would need its -wal beside it to be whole.
        mode = copy.execute("PRAGMA journal_mode = DELETE").fetchone()[0]
        if str(mode).lower() != "delete":
            raise LedgerError(f"cannot make a copy of {name} one file (journal mode {mode})")


def _position(conn: sqlite3.Connection) -> LogPosition | None:
    """The log position a ledger file records (schema 3 on), None if it has none."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' "
                    "AND name = 'log_position'").fetchone() is None:
        return None
    row = conn.execute("SELECT log_id, log_offset, entry_id, epoch, writer "
                       "FROM log_position WHERE id = 1").fetchone()
    return LogPosition(*row) if row is not None else None


def _integrity_check(conn: sqlite3.Connection, name: Path) -> None:
    # integrity_check, not quick_check: a backup is read rarely and must be sound throughout.
    problems = [str(row[0]) for row in conn.execute("PRAGMA integrity_check(5)")]
    if problems != ["ok"]:
        raise LedgerCorrupt(name, "; ".join(problems))


def _retire(ledger: Path, suffix: str) -> list[Path]:
    """Move the ledger (and any -wal and -shm beside it) out of the way, kept under
    ``<name>.<suffix>``; first folded into one file where it can be, which also finds out
    a process that still has it open."""
    if ledger.exists():
        try:
            with contextlib.closing(sqlite3.connect(ledger, timeout=0.5)) as old:
                old.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                old.execute("PRAGMA journal_mode = DELETE")
        except sqlite3.OperationalError as exc:
            if "locked" in str(exc) or "busy" in str(exc):
                # Leaving WAL mode needs every other connection closed: something (an
                # allocator of a release without the lock, a sqlite3 shell) still has it.
                raise LedgerInUse(
                    f"the ledger {ledger} is open in another process (an allocator of an "
                    f"earlier release, a sqlite3 shell?): stop it first") from exc
            # Damaged or unreadable: it is kept as it is, with its -wal and -shm.
        except sqlite3.DatabaseError:
            pass
    moved = []
    for name in (ledger, ledger.with_name(ledger.name + "-wal"),
                 ledger.with_name(ledger.name + "-shm")):
        if name.exists():
            kept = name.with_name(f"{name.name}.{suffix}")
            os.replace(name, kept)
            moved.append(kept)
    return moved


def _sync(path: Path) -> None:
    """fsync a file or a folder, so a rename that follows is not of an empty file after a
    power cut."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
