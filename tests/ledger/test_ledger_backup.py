"""``gpu-ledger backup`` and ``restore`` on real ledgers, as an admin runs them (a subprocess).

A backup taken while the allocator's ledger is being written is the ledger as of one commit;
a restore refuses a ledger in use (by an allocator of this release: its lock; by anything else
that has the file open: SQLite's own locks), keeps the ledger it replaces, says what the
restored one may lack, and leaves a ledger ``gpu-ledger check`` finds sound. On the real
broker: a restored replica catches up from the backup's position in the ledger log, and
``--new-log`` makes a backup whose log is lost start a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from allocator.ledger import backup
from allocator.ledger.backup import BACKUP_EVENT, RESTORE_EVENT
from allocator.ledger.changes import Changes
from allocator.ledger.invariants import check_ledger
from allocator.ledger.lease import LeaseRecord
from allocator.ledger.log_entries import Claim
from allocator.ledger.replication import LogMismatch
from allocator.ledger.schema import SCHEMA_VERSION
from allocator.ledger.store import Ledger, LedgerInUse, LedgerLock
from allocator.placement.cluster import Node
from allocator.wire.protocol import LeaseState
from tests.support.ledger_log import lease_ids, replica
from tests.support.services import require_service

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DATA = Path(__file__).resolve().parents[1] / "data"


def gpu_ledger(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "gpu-ledger"), *map(str, args)], capture_output=True,
                          text=True, timeout=120, cwd=REPO)


def one_line_error(run: subprocess.CompletedProcess[str], *words: str) -> str:
    assert run.returncode == 2, run
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def rows(path: Path, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return conn.execute(sql, params).fetchall()


def queued(n: int) -> LeaseRecord:
    return LeaseRecord(lease_id=f"lease-{n:06d}", request_key=f"hub/u{n}/", user=f"u{n % 7}",
                       groups=(), state=LeaseState.QUEUED, created_at=float(n),
                       request={"user": f"u{n % 7}"}, enqueued_at=float(n),
                       wait_until=float(n) + 1e9)


def batch(n: int) -> Changes:
    """Batch ``n`` as the allocator writes one: a lease, its history line, an event and the
    writer's node row, which says which batch was the last (to tell a torn copy)."""
    changes = Changes()
    changes.transition(queued(n), None, float(n), "requested")
    changes.event(float(n), "batch", lease_id=f"lease-{n:06d}")
    changes.node(Node(host="writer", agent_id="w", last_heartbeat=float(n)))
    return changes


def a_ledger(path: Path, batches: int) -> Ledger:
    """An open ledger with ``batches`` batches written."""
    ledger = Ledger(path)
    ledger.open()
    for n in range(1, batches + 1):
        ledger.call(lambda n=n: ledger.commit(batch(n)))  # type: ignore[misc]
    return ledger


def assert_one_commit(path: Path) -> int:
    """The file holds batches 1..n whole and nothing of n + 1: returns n."""
    (last,) = rows(path, "SELECT last_heartbeat FROM nodes WHERE host = 'writer'")[0]
    n = int(last)
    # The 20,000 old leases the test adds are the user "old"'s.
    assert rows(path, "SELECT count(*), max(created_at) FROM leases WHERE user != 'old'") \
        == [(n, float(n))]
    assert rows(path, "SELECT count(*) FROM lease_history") == [(n,)]
    assert rows(path, "SELECT count(*) FROM events WHERE kind = 'batch'") == [(n,)]
    return n


# ------------------------------------------------------------------ backup


@pytest.mark.slow
def test_a_backup_while_the_ledger_is_written_is_one_commit_of_it(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    ledger = a_ledger(path, 1)
    # Some size, so that each copy takes a while: 20,000 leases more, in one transaction.
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.executemany(
            "INSERT INTO leases (lease_id, request_key, user, state, created_at, "
            "release_reason, released_at, request, groups, gpu_uuids, env) VALUES "
            "(?, ?, 'old', 'released', 0.5, 'container_exited', 0.6, ?, '[]', '[]', '{}')",
            [(f"old-{i:06d}", f"hub/old{i}/", json.dumps({"pad": "x" * 200}))
             for i in range(20_000)])
    stop = threading.Event()
    written: list[int] = [1]

    def writer() -> None:
        n = 1
        while not stop.is_set():
            n += 1
            ledger.call(lambda n=n: ledger.commit(batch(n)))  # type: ignore[misc]
            written.append(n)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        backups = []
        for number in range(3):
            before = written[-1]
            target = tmp_path / f"backup-{number}.sqlite"
            taken = gpu_ledger("backup", target, "--ledger", path)
            assert taken.returncode == 0, taken
            assert taken.stdout.startswith(f"backed up {path} to {target}")
            assert written[-1] > before, "the writer went on while the backup ran"
            backups.append(target)
    finally:
        stop.set()
        thread.join(30)
        ledger.close()
    for target in backups:
        assert_one_commit(target)
        assert rows(target, "PRAGMA journal_mode") == [("delete",)]
        assert not target.with_name(target.name + "-wal").exists()
        assert rows(target, "SELECT count(*) FROM events WHERE kind = ?", BACKUP_EVENT) == [(1,)]
        with contextlib.closing(sqlite3.connect(target)) as conn:
            assert check_ledger(conn) == []
    assert [p.name for p in tmp_path.iterdir() if ".partial" in p.name] == []


def test_a_backup_goes_into_a_folder_and_never_over_a_file(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    a_ledger(path, 3).close()
    folder = tmp_path / "backups"
    folder.mkdir()
    taken = gpu_ledger("backup", folder, "--ledger", path)
    assert taken.returncode == 0, taken
    (made,) = folder.iterdir()
    assert made.name.startswith("ledger-") and made.suffix == ".sqlite"
    assert f"3 leases (3 active), schema {SCHEMA_VERSION}, no ledger log position" in taken.stdout
    again = gpu_ledger("backup", made, "--ledger", path)
    one_line_error(again, str(made), "exists", "--force")
    assert gpu_ledger("backup", made, "--ledger", path, "--force").returncode == 0


def test_a_backup_is_its_owners_only_whatever_the_umask(tmp_path: Path) -> None:
    """A backup holds every lease and user name: mode 0600 even under umask 000, and so is
    the file SQLite writes it in before the rename (seen through the journal it leaves
    none of)."""
    path = tmp_path / "ledger.sqlite"
    a_ledger(path, 2).close()
    target = tmp_path / "open-folder" / "backup.sqlite"
    target.parent.mkdir(mode=0o777)
    taken = subprocess.run(["sh", "-c", 'umask 000 && exec "$0" backup "$1" --ledger "$2"',
                            str(BIN / "gpu-ledger"), str(target), str(path)],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    assert taken.returncode == 0, taken
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert [p.name for p in target.parent.iterdir()] == ["backup.sqlite"]


def test_a_backup_never_writes_through_nor_removes_what_is_planted_beside_it(
        tmp_path: Path) -> None:
    """A shared folder where someone planted, under the names a backup's temporary file
    used to have (``.NAME.partial-PID``), a link to a file of theirs and a file: neither is
    followed, written or removed, and the backup is whole."""
    path = tmp_path / "ledger.sqlite"
    a_ledger(path, 2).close()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    victim = tmp_path / "victim"
    victim.write_bytes(b"not yours")
    target = shared / "backup.sqlite"
    planted: list[Path] = []
    for pid in range(os.getpid() - 5, os.getpid() + 6):  # the test's own pid included
        link = shared / f".{target.name}.partial-{pid}"
        link.symlink_to(victim)
        planted.append(link)
    plain = shared / f".{target.name}.partial-{os.getpid() + 100}"
    plain.write_bytes(b"someone's file")
    info = backup.backup(path, target, now=time.time())
    assert victim.read_bytes() == b"not yours"
    assert plain.read_bytes() == b"someone's file"
    for link in planted:
        assert link.is_symlink() and link.readlink() == victim, link
    assert sorted(p.name for p in shared.iterdir()) == sorted(
        [target.name, plain.name, *(link.name for link in planted)])
    assert info.leases == 2 and not target.is_symlink()


@pytest.mark.parametrize("how", ["an existing folder", "a path ending in /"])
def test_a_backup_to_a_folder_is_a_named_file_in_it(tmp_path: Path, how: str) -> None:
    path = tmp_path / "ledger.sqlite"
    a_ledger(path, 1).close()
    folder = tmp_path / "bk"
    if how == "an existing folder":
        folder.mkdir()
    taken = gpu_ledger("backup", f"{folder}/", "--ledger", path)
    assert taken.returncode == 0, taken
    assert folder.is_dir(), f"{folder} must be a folder, not the backup"
    (made,) = folder.iterdir()
    assert re.fullmatch(r"ledger-\d{8}T\d{6}Z\.sqlite", made.name), made.name
    assert taken.stdout.startswith(f"backed up {path} to {made} ")
    assert stat.S_IMODE(made.stat().st_mode) == 0o600


def test_a_backup_that_cannot_be_written_names_the_target_and_why(tmp_path: Path) -> None:
    """Not the source ledger, which is fine. /sys refuses new files even to root (sysfs);
    a file where a folder should be is the other case."""
    path = tmp_path / "ledger.sqlite"
    a_ledger(path, 1).close()
    unwritable = Path("/sys/swarm-gpu-backup.sqlite")
    try:
        os.close(os.open(unwritable, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except OSError:
        pass
    else:
        unwritable.unlink()
        require_service("an unwritable folder", "/sys takes new files here")
    taken = gpu_ledger("backup", unwritable, "--ledger", path)
    line = one_line_error(taken, f"cannot write the backup {unwritable}", "Permission denied")
    assert f"ledger {path}" not in line, line
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    under_a_file = gpu_ledger("backup", a_file / "backup.sqlite", "--ledger", path)
    one_line_error(under_a_file, f"no folder {a_file} to put the backup in")


def test_a_backup_of_a_damaged_ledger_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    a_ledger(path, 2).close()
    with contextlib.closing(sqlite3.connect(path)) as conn, conn:
        conn.executemany("INSERT INTO events (at, kind, detail) VALUES (?, 'x', ?)",
                         [(float(i), "y" * 300) for i in range(3000)])
    rows(path, "PRAGMA wal_checkpoint(TRUNCATE)")
    size = path.stat().st_size
    with open(path, "r+b") as raw:
        raw.seek(size // 2 // 4096 * 4096)
        raw.write(b"\x00\xff" * 4096)
    taken = gpu_ledger("backup", tmp_path / "b.sqlite", "--ledger", path)
    one_line_error(taken, "corrupt")
    assert not (tmp_path / "b.sqlite").exists()


# ------------------------------------------------------------------ restore


def test_restore_refuses_a_ledger_an_allocator_has_open(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    a_ledger(path, 2).close()
    backup = tmp_path / "backup.sqlite"
    assert gpu_ledger("backup", backup, "--ledger", path).returncode == 0
    running = a_ledger(path, 0)  # the allocator, holding its ledger open
    try:
        running.call(lambda: running.commit(batch(3)))
        refused = gpu_ledger("restore", backup, "--ledger", path)
        one_line_error(refused, "in use by a running allocator", "stop it first")
    finally:
        running.close()
    assert [p.name for p in tmp_path.iterdir() if "replaced" in p.name] == []
    assert rows(path, "SELECT count(*) FROM leases") == [(3,)], "nothing was replaced"


def test_restore_refuses_a_ledger_another_process_has_open(tmp_path: Path) -> None:
    """An allocator of a release without the lock, or a sqlite3 shell: SQLite says the file
    is in use (it cannot leave WAL mode while another connection is open)."""
    path = tmp_path / "ledger.sqlite"
    a_ledger(path, 2).close()
    backup = tmp_path / "backup.sqlite"
    assert gpu_ledger("backup", backup, "--ledger", path).returncode == 0
    with contextlib.closing(sqlite3.connect(path)) as other:
        other.execute("SELECT count(*) FROM leases").fetchall()
        refused = gpu_ledger("restore", backup, "--ledger", path)
    one_line_error(refused, "open in another process", "stop it first")
    assert rows(path, "PRAGMA journal_mode") == [("wal",)]


def test_an_allocator_waits_for_a_restore_in_progress(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    a_ledger(path, 1).close()
    lock = LedgerLock.take(path, exclusive=True)
    opened = threading.Event()
    ledger = Ledger(path)
    def open_ledger() -> None:
        ledger.open()
        opened.set()

    thread = threading.Thread(target=open_ledger)
    thread.start()
    time.sleep(0.5)
    assert not opened.is_set(), "it opened a ledger being replaced"
    lock.release()
    thread.join(10)
    assert opened.is_set()
    with pytest.raises(LedgerInUse, match="in use by a running allocator"):
        LedgerLock.take(path, exclusive=True)
    ledger.close()
    LedgerLock.take(path, exclusive=True).release()


def test_restore_replaces_the_ledger_keeps_the_old_and_says_what_may_be_missing(
        tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    shutil.copyfile(DATA / "ledger-v4.db", path)  # an older schema, with a log position
    ledger = Ledger(path)
    ledger.open()  # migrated, as the allocator does
    ledger.close()
    backup = tmp_path / "backup.sqlite"
    assert gpu_ledger("backup", backup, "--ledger", path).returncode == 0
    later = Ledger(path)
    later.open()
    later.call(lambda: later.commit(batch(7)))  # a lease after the backup
    later.close()
    restored = gpu_ledger("restore", backup, "--ledger", path)
    assert restored.returncode == 0, restored
    out = restored.stdout
    assert f"restored {path} from {backup}" in out and "5 leases (4 active)" in out
    assert "kept as" in out and "replaced-" in out
    assert "position kept, ledger log log-fixture at offset 41" in out
    assert "may be missing" in out and "adopts the running containers" in out
    (kept,) = [p for p in tmp_path.iterdir() if ".replaced-" in p.name]
    assert rows(kept, "SELECT count(*) FROM leases") == [(6,)], "the replaced ledger, whole"
    assert rows(path, "SELECT count(*) FROM leases") == [(5,)]
    assert rows(path, "SELECT log_id, log_offset FROM log_position") == [("log-fixture", 41)]
    ((detail,),) = rows(path, "SELECT detail FROM events WHERE kind = ?", RESTORE_EVENT)
    assert json.loads(detail)["log_position"] == "kept"
    checked = gpu_ledger("check", "--ledger", path)
    assert checked.returncode == 0 and checked.stdout.startswith("ok: "), checked
    ledger = Ledger(path)
    ledger.open()
    try:
        assert len(ledger.call(ledger.load).leases) == 4
    finally:
        ledger.close()


def test_restore_with_new_log_clears_the_position(tmp_path: Path) -> None:
    backup = tmp_path / "backup.sqlite"
    shutil.copyfile(DATA / "ledger-v5.db", backup)
    path = tmp_path / "volume" / "ledger.sqlite"  # an empty volume: nothing to replace
    restored = gpu_ledger("restore", backup, "--ledger", path, "--new-log")
    assert restored.returncode == 0, restored
    assert "position cleared (--new-log" in restored.stdout
    assert "kept as" not in restored.stdout
    assert rows(path, "SELECT count(*) FROM log_position") == [(0,)]
    assert rows(backup, "SELECT count(*) FROM log_position") == [(1,)], "the backup unchanged"
    assert gpu_ledger("check", "--ledger", path).returncode == 0


def test_restore_refuses_what_is_no_ledger(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    a_ledger(path, 1).close()
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"not a ledger" * 100)
    one_line_error(gpu_ledger("restore", junk, "--ledger", path), str(junk))
    one_line_error(gpu_ledger("restore", tmp_path / "none.sqlite", "--ledger", path),
                   "no ledger at")
    assert rows(path, "SELECT count(*) FROM leases") == [(1,)]


# ------------------------------------------------------------------ with the ledger log


async def wait_for(predicate: Callable[[], Awaitable[bool]], within: float = 15) -> None:
    async with asyncio.timeout(within):
        while True:
            if await predicate():
                return
            await asyncio.sleep(0.05)


async def run_cli(*args: str | Path) -> subprocess.CompletedProcess[str]:
    """gpu-ledger without blocking the event loop the replicas run on."""
    return await asyncio.to_thread(gpu_ledger, *args)


async def stream_bodies(url: str, stream: str, within: float = 1.0) -> list[bytes]:
    """What ``stream`` holds, read from its start for ``within`` seconds."""
    bodies: list[bytes] = []
    connection = await aio_pika.connect(url, timeout=10)
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=100)
        queue = await channel.declare_queue(stream, passive=True)

        async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            bodies.append(message.body)
            await message.ack()

        await queue.consume(take, arguments={"x-stream-offset": "first"})
        await asyncio.sleep(within)
    finally:
        await connection.close()
    return bodies


async def test_a_claim_on_a_stream_started_by_a_stranger_is_refused(
        amqp_vhost: Any, tmp_path: Path) -> None:
    """A stream whose offset 0 is no genesis claim was started by a ledger that was not its
    log (a backup restored without --new-log, before such claims were refused): a ledger of
    that log id is refused there too, before anything is appended."""
    url = amqp_vhost.url
    path = tmp_path / "ledger.sqlite"
    async with replica(url, path) as log:
        await log.claim()
        await log.append(batch(1))
        assert log.position is not None
        log_id = log.position.log_id
    connection = await aio_pika.connect(url, timeout=10)
    try:
        channel = await connection.channel()
        other = "swarm-gpu.ledger-log-other"
        await channel.declare_queue(other, durable=True, arguments={"x-queue-type": "stream",
                                                                  "x-max-length-bytes": 64 << 20})
        await channel.default_exchange.publish(aio_pika.Message(body=Claim(
            log_id=log_id, entry_id="e1", epoch=9, writer="w").encode()), routing_key=other)
    finally:
        await connection.close()
    async with replica(url, path, stream=other, timeout_s=2) as stranger:
        with pytest.raises(LogMismatch, match="offset 0 is no genesis"):
            await stranger.claim()
    assert len(await stream_bodies(url, other)) == 1


@pytest.mark.slow
async def test_a_restored_replica_catches_up_from_the_backups_log_position(
        amqp_vhost: Any, tmp_path: Path) -> None:
    url = amqp_vhost.url
    active = tmp_path / "active.sqlite"
    backup = tmp_path / "backup.sqlite"
    async with replica(url, active) as log:
        await log.claim()
        await log.append(batch(1))
        taken = await run_cli("backup", backup, "--ledger", active)  # while it runs
        assert taken.returncode == 0, taken
        assert log.position is not None
        assert f"ledger log {log.position.log_id} at offset {log.position.offset}" \
            in taken.stdout
        await log.append(batch(2))
        await log.append(batch(3))
    # The replica's volume lost: restored from the backup, it catches up from its position.
    restored = tmp_path / "restored.sqlite"
    done = await run_cli("restore", backup, "--ledger", restored)
    assert done.returncode == 0, done
    async with replica(url, restored) as again:
        async def caught_up() -> bool:
            return lease_ids(restored) == lease_ids(active)
        await wait_for(caught_up)
        assert again.mismatch is None
    assert lease_ids(restored) == ["lease-000001", "lease-000002", "lease-000003"]
    assert (await run_cli("check", "--ledger", restored)).returncode == 0

    # The stream lost too (here: another stream, empty). Without --new-log the backup's
    # position is beyond the stream's end: its claim is refused before anything is appended,
    # with a message naming --new-log. With --new-log it starts the new log, with its own data.
    kept = tmp_path / "kept.sqlite"
    assert (await run_cli("restore", backup, "--ledger", kept)).returncode == 0
    async with replica(url, kept, stream="swarm-gpu.ledger-log-new", timeout_s=2) as stranger:
        with pytest.raises(LogMismatch, match="--new-log") as refused:
            await stranger.claim()
        assert "\n" not in str(refused.value)
        assert not stranger.is_writer
    assert await stream_bodies(url, "swarm-gpu.ledger-log-new") == []
    fresh = tmp_path / "fresh.sqlite"
    cleared = await run_cli("restore", backup, "--ledger", fresh, "--new-log")
    assert cleared.returncode == 0, cleared
    async with replica(url, fresh, stream="swarm-gpu.ledger-log-new") as new_log:
        assert await new_log.claim() is True  # the new log's first entry
        await new_log.append(batch(4))
    assert lease_ids(fresh) == ["lease-000001", "lease-000004"]
    assert (await run_cli("check", "--ledger", fresh)).returncode == 0
