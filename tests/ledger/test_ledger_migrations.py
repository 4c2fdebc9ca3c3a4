"""The ledger's schema migrations on real SQLite files: atomic, crash-safe, and able to take a
ledger of every earlier schema (made by that release's own code, ``tests/data/``) to today's.

Also the checks at open: a damaged ledger is refused before anything is read, and an
allocator that cannot open or migrate its ledger says so in one line (the console script,
in a subprocess).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from allocator.config import AllocatorSettings
from allocator.engine import Engine, Sender
from allocator.ledger.changes import Changes
from allocator.ledger.invariants import check_ledger
from allocator.ledger.lease import LeaseRecord
from allocator.ledger.loaded import BookingRow
from allocator.ledger.log_position import LogPosition
from allocator.ledger.schema import SCHEMA_VERSION
from allocator.ledger.store import MIGRATIONS, Ledger, LedgerCorrupt, LedgerError
from allocator.wire.protocol import (
    ErrorCode,
    ErrorReply,
    LeaseReply,
    LeaseState,
    ReleaseRequest,
    StatusRequest,
)
from tests.support.services import require_service

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[1] / "data"
BIN = Path(sys.executable).parent
UNREACHABLE = "amqp://guest:guest@127.0.0.1:1/"
T0 = 1_750_000_100.0
"""The fixtures' clock (``tests/data/make_ledger_fixture.py``: its T0 plus 100)."""

FIXTURES = {1: "93c7617", 2: "40bfd06", 3: "25e3269", 4: "712b0e4", 5: "de14dc7",
            6: "lease owners", 7: "bookings", 8: "lease usage"}
"""Schema version -> the commit whose code wrote ``tests/data/ledger-v<version>.db`` (with
``tests/data/make_ledger_fixture.py``): the last commit before schema 2 (MIG), the MIG commit,
the merge that put the log position after MIG as schema 3, fair share, the last commit
before migrations became atomic (schema 5 as release 0.1.0 writes it), and the change that
recorded each lease's owner (schema 6, 0.2.0), the change that kept bookings (schema 7,
0.3.0), and the one that kept each lease's measured usage (schema 8, 0.3.0)."""


def fixture(version: int, tmp_path: Path) -> Path:
    """A copy of the fixture of ``version`` to work on."""
    copy = tmp_path / f"ledger-v{version}.sqlite"
    shutil.copyfile(DATA / f"ledger-v{version}.db", copy)
    return copy


def user_version(path: Path) -> int:
    with contextlib.closing(sqlite3.connect(path)) as conn:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])


Schema = dict[str, object]


def schema(path: Path) -> Schema:
    """Tables with their columns (name, type affinity, primary key) and the indexes: what
    a ledger's code relies on, not the DDL's spelling."""
    def affinity(kind: str) -> str:
        return "REAL" if kind.upper() in ("FLOAT", "REAL") else kind.upper()

    with contextlib.closing(sqlite3.connect(path)) as conn:
        tables = [row[0] for row in conn.execute(
            "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        result: Schema = {
            table: [(row[1], affinity(row[2]), row[5])
                    for row in conn.execute(f'PRAGMA table_info("{table}")')]
            for table in tables}
        result["indexes"] = sorted(
            (row[0], row[1]) for row in conn.execute(
                "SELECT name, tbl_name FROM sqlite_master WHERE type = 'index' "
                "AND name NOT LIKE 'sqlite_autoindex%'"))
    return result


def fresh(tmp_path: Path) -> Path:
    path = tmp_path / "fresh.sqlite"
    ledger = Ledger(path)
    ledger.open()
    ledger.close()
    return path


def gpu_ledger(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "gpu-ledger"), *map(str, args)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


# ------------------------------------------------------------------ sqlite3 and transactions


def test_pythons_default_isolation_commits_ddl_by_itself(tmp_path: Path) -> None:
    """Why the migrations manage their transaction: in sqlite3's default mode a DDL
    statement opens no transaction, so ``with conn:`` around it commits nothing and rolls
    back nothing; each statement is committed on its own (the old migrations' bug)."""
    with contextlib.closing(sqlite3.connect(tmp_path / "l.sqlite")) as conn:
        assert str(conn.isolation_level) == ""  # the default the ledger's connection has
        conn.execute("CREATE TABLE t (a TEXT)")
        with pytest.raises(RuntimeError), conn:
            conn.execute("ALTER TABLE t ADD COLUMN b TEXT")
            assert not conn.in_transaction
            raise RuntimeError("a crash between two statements")
        columns = [row[1] for row in conn.execute("PRAGMA table_info(t)")]
    assert columns == ["a", "b"], "the DDL stayed although the block failed"


def test_ddl_stays_in_an_explicit_transaction_without_pythons_isolation(
        tmp_path: Path) -> None:
    """What Ledger._migrate relies on: with ``isolation_level = None``, CREATE, ALTER and
    ``PRAGMA user_version`` between our own BEGIN IMMEDIATE and ROLLBACK all go."""
    path = tmp_path / "l.sqlite"
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("CREATE TABLE t (a TEXT)")
        conn.commit()
        conn.isolation_level = None
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ALTER TABLE t ADD COLUMN b TEXT")
        conn.execute("CREATE TABLE u (x INTEGER PRIMARY KEY)")
        conn.execute("CREATE INDEX idx_t_a ON t (a)")
        conn.execute("PRAGMA user_version = 7")
        assert conn.in_transaction
        # Another connection sees none of it before the commit.
        with contextlib.closing(sqlite3.connect(path)) as other:
            assert [r[1] for r in other.execute("PRAGMA table_info(t)")] == ["a"]
            assert other.execute("PRAGMA user_version").fetchone()[0] == 0
        conn.execute("ROLLBACK")
    assert schema(path) == {"t": [("a", "TEXT", 0)], "indexes": []}
    assert user_version(path) == 0


# ------------------------------------------------------------------ crashes mid-migration

_CRASH_AT = """
import os, sys
import allocator.ledger.store as ledger
def crash(number, sql):
    if number == int(sys.argv[2]):
        os._exit(75)  # no rollback, no close: as a killed process
ledger.migration_hook = crash
ledger.Ledger(sys.argv[1]).open()
os._exit(0)
"""


def _statements_from_v1(tmp_path: Path) -> list[str]:
    """Every statement the migration of the schema-1 fixture runs, in order."""
    import allocator.ledger.store as ledger_module

    seen: list[str] = []
    ledger_module.migration_hook = lambda number, sql: seen.append(sql)
    try:
        ledger = Ledger(fixture(1, tmp_path))
        ledger.open()
        ledger.close()
    finally:
        ledger_module.migration_hook = None
    return seen


@pytest.mark.slow
def test_a_crash_after_any_statement_leaves_a_whole_schema_and_the_ledger_starts(
        tmp_path: Path) -> None:
    (tmp_path / "count").mkdir()
    statements = _statements_from_v1(tmp_path / "count")
    assert len(statements) > SCHEMA_VERSION  # several per migration
    schemas = {v: schema(DATA / f"ledger-v{v}.db") for v in FIXTURES}
    for number, sql in enumerate(statements, start=1):
        work = tmp_path / f"crash-{number}"
        work.mkdir()
        path = fixture(1, work)
        child = subprocess.run([sys.executable, "-c", _CRASH_AT, str(path), str(number)],
                               capture_output=True, text=True, timeout=60, cwd=REPO)
        assert child.returncode == 75, (number, sql, child.stderr)
        version = user_version(path)
        # Each migration is all or nothing: the file is exactly some release's schema.
        assert schema(path) == schemas[version], (number, sql)
        assert version < SCHEMA_VERSION
        # ... and today's code starts on it.
        ledger = Ledger(path)
        ledger.open()
        try:
            loaded = ledger.call(ledger.load)
        finally:
            ledger.close()
        assert user_version(path) == SCHEMA_VERSION
        assert schema(path) == schemas[SCHEMA_VERSION]
        assert len(loaded.leases) == 4 and len(loaded.finished) == 1
        with contextlib.closing(sqlite3.connect(path)) as conn:
            assert check_ledger(conn) == []


def test_a_migration_that_fails_writes_nothing_of_itself(tmp_path: Path) -> None:
    """A ledger that a release before 0.2.0 left half-migrated (a fair-share column added,
    ``user_version`` still 3): today's migration to 4 fails on it, rolls back, and says
    what to do; the ledger is as it was."""
    path = fixture(3, tmp_path)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("ALTER TABLE leases ADD COLUMN borrowed INTEGER")
        conn.commit()
    before = schema(path)
    with pytest.raises(LedgerError) as failed:
        Ledger(path).open()
    message = str(failed.value)
    assert "from schema 3 to 4" in message and "duplicate column" in message
    assert "gpu-ledger restore" in message and "\n" not in message
    assert schema(path) == before and user_version(path) == 3


def test_two_allocators_migrating_one_file_migrate_it_once(tmp_path: Path) -> None:
    """The version is read again inside each migration's transaction: a standby that
    opens the file the active one is migrating finds each migration done, never runs one
    twice (a duplicate column)."""
    import allocator.ledger.store as ledger_module

    path = fixture(1, tmp_path)
    second = Ledger(path)
    outcome: list[BaseException | None] = []

    def open_second() -> None:
        try:
            second.open()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    racer = threading.Thread(target=open_second)

    def start_the_second(number: int, sql: str) -> None:
        if number == 1:  # the first migration is under way and holds the write lock
            ledger_module.migration_hook = None
            racer.start()
            racer.join(0.3)  # it reads version 1 and waits on the lock meanwhile

    ledger_module.migration_hook = start_the_second
    first = Ledger(path)
    try:
        first.open()
    finally:
        ledger_module.migration_hook = None
    racer.join(30)
    first.close()
    second.close()
    assert outcome == [None]
    assert user_version(path) == SCHEMA_VERSION
    assert schema(path) == schema(DATA / f"ledger-v{SCHEMA_VERSION}.db")


# ------------------------------------------------------------------ every earlier schema


@pytest.mark.parametrize("version", sorted(FIXTURES))
def test_a_ledger_of_every_schema_is_migrated_whole_and_sound(version: int,
                                                             tmp_path: Path) -> None:
    path = fixture(version, tmp_path)
    assert user_version(path) == version
    ledger = Ledger(path)
    ledger.open()
    try:
        loaded = ledger.call(ledger.load)
        position = ledger.call(ledger.log_position)
    finally:
        ledger.close()
    assert user_version(path) == SCHEMA_VERSION
    assert schema(path) == schema(fresh(tmp_path))
    # What the old release wrote is all there.
    assert sorted(lease.lease_id for lease in loaded.leases) == [
        "L-bound", "L-granted", "L-queued", "L-slice"]
    assert [lease.lease_id for lease in loaded.finished] == ["L-done"]
    assert sorted(gpu.uuid for gpu in loaded.gpus) == ["GPU-a0", "GPU-a1", "GPU-b0", "GPU-b1"]
    assert {node.host for node in loaded.nodes} == {"gpu-a", "gpu-b"}
    slice_ = next(lease for lease in loaded.leases if lease.lease_id == "L-slice")
    assert slice_.shared and slice_.memory_mib == 4096 and slice_.gpu_uuids == ("GPU-a0",)
    # Before schema 6 nobody recorded who asked: the owner is unknown, never made up.
    owners = {lease.owner for lease in (*loaded.leases, *loaded.finished)}
    assert owners == ({"hub"} if version >= 6 else {None})
    # Bookings from schema 7 on; a ledger from before has none, and the table to keep them.
    assert [(row.name, row.booking["gpus"]["count"], row.created_by)
            for row in loaded.bookings] == ([("CS101 lab", 2, "admin (admin)")]
                                            if version >= 7 else [])
    # Measured usage from schema 8 on; before, every lease reads as not measured.
    done = loaded.finished[0]
    assert (done.usage_since, done.energy_j, done.sm_s, done.memory_s, done.peak_memory_mib,
            done.usage_run_energy_j) == ((T0 - 97, 12_000.0, 23.5, 4.7, 3100, 12_000.0)
                                         if version >= 8 else (None,) * 6)
    assert all(lease.energy_j is None for lease in loaded.leases)
    if version >= 3:
        assert position == LogPosition("log-fixture", 41, "entry-41", 2, "allocator-1")
    else:
        assert position is None
    checked = gpu_ledger("check", "--ledger", path)
    assert checked.returncode == 0, checked
    assert checked.stdout.startswith("ok: ")


@pytest.mark.parametrize("version", [1, 5, 6])
def test_leases_of_a_ledger_from_before_owners_stay_releasable_by_any_hub(
        version: int, tmp_path: Path) -> None:
    """No upgrade strands a lease: the leases a ledger of schema 1 or 5 (0.1.0) holds have
    no owner recorded, and after the migration any hub's broker user may see and release
    them, as before. The leases of schema 6 are the ``hub`` user's: another hub is refused
    ``forbidden`` and changes nothing; their own hub releases them."""
    path = fixture(version, tmp_path)
    ledger = Ledger(path)
    ledger.open()
    try:
        loaded = ledger.call(ledger.load)
    finally:
        ledger.close()
    engine = Engine(AllocatorSettings(ledger_path=path, allow_any_node_user=True,
                                      admin_users=["admin"]), started_at=T0)
    engine.load(loaded, T0)
    other_hub = Sender(user_id="hub-b", via_nodes_exchange=False)
    changes = Changes()
    for lease_id, after in (("L-bound", LeaseState.RELEASING),
                            ("L-queued", LeaseState.RELEASED)):
        seen = engine.handle(StatusRequest(lease_id=lease_id), other_hub, T0, changes)
        released = engine.handle(ReleaseRequest(lease_id=lease_id), other_hub, T0, changes)
        if version < 6:
            assert isinstance(seen, LeaseReply) and seen.lease.lease_id == lease_id
            assert isinstance(released, LeaseReply) and released.lease.state is after
            continue
        for refused in (seen, released):
            assert isinstance(refused, ErrorReply), refused
            assert refused.error.code is ErrorCode.FORBIDDEN
            assert "'hub'" in refused.error.message and "'hub-b'" in refused.error.message
        assert engine.leases[lease_id].state in (LeaseState.BOUND, LeaseState.QUEUED)
        assert engine.commands == [], "nothing stopped"
        own_hub = Sender(user_id="hub", via_nodes_exchange=False)
        released = engine.handle(ReleaseRequest(lease_id=lease_id), own_hub, T0, changes)
        assert isinstance(released, LeaseReply) and released.lease.state is after
        engine.take_commands()


def test_the_migrations_write_the_schema_the_releases_wrote(tmp_path: Path) -> None:
    """Today's migrations are plain SQL, no longer sqlite-utils': each one, run on the
    fixture of the schema before it, gives the fixture of the schema after it."""
    for version in range(1, SCHEMA_VERSION):
        path = fixture(version, tmp_path)
        with contextlib.closing(sqlite3.connect(path)) as conn:
            import sqlite_utils

            MIGRATIONS[version](sqlite_utils.Database(conn))
            conn.commit()
        assert schema(path) == schema(DATA / f"ledger-v{version + 1}.db"), version


def test_fixtures_are_small() -> None:
    for version in FIXTURES:
        assert (DATA / f"ledger-v{version}.db").stat().st_size < 20_000


# ------------------------------------------------------------------ damaged ledgers


def damaged_ledger(tmp_path: Path, leases: int = 3000) -> Path:
    """A ledger of a few hundred pages, one file, with pages in its middle overwritten as
    a failing disk or a stray write would."""
    path = tmp_path / "damaged.sqlite"
    ledger = Ledger(path)
    ledger.open()
    ledger.close()
    with contextlib.closing(sqlite3.connect(path)) as conn:
        with conn:
            conn.executemany(
                "INSERT INTO leases (lease_id, request_key, user, state, created_at, "
                "release_reason, released_at, request) VALUES (?, ?, ?, 'released', ?, "
                "'container_exited', ?, '{}')",
                [(f"lease-{i:06d}", f"hub/u{i}/", f"u{i % 50}", float(i), float(i + 1))
                 for i in range(leases)])
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        conn.execute("PRAGMA journal_mode = DELETE")
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    pages = path.stat().st_size // page_size
    with open(path, "r+b") as raw:
        for page in range(pages // 2, pages // 2 + 3):
            raw.seek(page * page_size)
            raw.write(os.urandom(page_size))
    return path


def test_a_damaged_ledger_is_refused_at_open(tmp_path: Path) -> None:
    path = damaged_ledger(tmp_path)
    with pytest.raises(LedgerCorrupt) as refused:
        Ledger(path).open()
    message = str(refused.value)
    assert "corrupt" in message and "gpu-ledger restore" in message
    assert "move it away" in message and "\n" not in message


def _serve(ledger: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_GPU_")}
    env.update(SWARM_GPU_AMQP_URL=UNREACHABLE, SWARM_GPU_LEDGER_PATH=str(ledger))
    return subprocess.run([str(BIN / "gpu-allocator"), "serve"], capture_output=True,
                          text=True, timeout=60, cwd=tmp_path, env=env)


@pytest.mark.slow
def test_the_allocator_refuses_a_damaged_ledger_in_one_line(tmp_path: Path) -> None:
    path = damaged_ledger(tmp_path)
    served = _serve(path, tmp_path)
    assert served.returncode == 1, served
    lines = served.stderr.strip().splitlines()
    assert len(lines) == 1, served.stderr
    assert lines[0].startswith("gpu-allocator: the ledger ") and "is corrupt" in lines[0]
    assert "gpu-ledger restore" in lines[0]


@pytest.mark.slow
def test_the_allocator_says_in_one_line_that_a_migration_failed(tmp_path: Path) -> None:
    path = fixture(3, tmp_path)
    with contextlib.closing(sqlite3.connect(path)) as conn:
        conn.execute("ALTER TABLE leases ADD COLUMN borrowed INTEGER")
        conn.commit()
    served = _serve(path, tmp_path)
    assert served.returncode == 1, served
    assert "Traceback" not in served.stderr
    lines = served.stderr.strip().splitlines()
    assert len(lines) == 1, served.stderr
    assert lines[0].startswith("gpu-allocator: cannot migrate the ledger ")
    assert "from schema 3 to 4" in lines[0] and "restore a backup" in lines[0]
    assert user_version(path) == 3


RELEASE_0_2_0 = "885a655"
"""The commit of release 0.2.0 (schema 6)."""


@pytest.fixture(scope="module")
def release_0_2_0_code(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """0.2.0's ``allocator`` package, read out of the history (``git archive``: the clone
    is not changed); it runs on this environment's packages, which 0.2.0's also are."""
    git = shutil.which("git")
    found = git is not None and subprocess.run(
        [git, "-C", str(REPO), "rev-parse", "--verify", "--quiet",
         f"{RELEASE_0_2_0}^{{commit}}"], capture_output=True, check=False).returncode == 0
    if not found:  # a shallow clone on a laptop; CI's clone has the whole history
        require_service("git history", f"commit {RELEASE_0_2_0} (0.2.0) is not in this "
                        "clone's history")
    assert git is not None
    where = tmp_path_factory.mktemp("release-0.2.0")
    archive = subprocess.run([git, "-C", str(REPO), "archive", RELEASE_0_2_0, "allocator"],
                             capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive.stdout, check=True)
    return where


def test_a_0_2_0_allocator_refuses_a_ledger_of_this_release_in_one_line(
        release_0_2_0_code: Path, tmp_path: Path) -> None:
    """Rolling back to 0.2.0 after this release migrated the ledger is refused, in one line,
    and the ledger (with its bookings) is left as it was."""
    path = fixture(6, tmp_path)
    ledger = Ledger(path)
    ledger.open()
    ledger.close()
    before = schema(path)
    assert user_version(path) == SCHEMA_VERSION
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_GPU_")}
    env.update(SWARM_GPU_AMQP_URL=UNREACHABLE, SWARM_GPU_LEDGER_PATH=str(path),
               PYTHONPATH=str(release_0_2_0_code))
    served = subprocess.run([sys.executable, "-m", "allocator.cli", "serve"],  # 0.2.0's
                            capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert served.returncode == 1, served
    lines = served.stderr.strip().splitlines()
    assert len(lines) == 1, served.stderr
    assert (f"schema version {SCHEMA_VERSION}, newer than this release understands (6)"
            in lines[0])
    assert "upgrade swarm-gpu" in lines[0]
    assert user_version(path) == SCHEMA_VERSION and schema(path) == before


_OLD_REPLICA = """
import json, sys
from allocator.ledger import ChangeSet, Ledger, LogPosition
from allocator.log_snapshot import Table
batch, tables, path = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
ledger = Ledger(path)
ledger.open()
ledger.call(lambda: ledger.commit(ChangeSet.parse(batch).to_changes()))
ledger.call(lambda: ledger.load_snapshot(
    {name: Table(t["columns"], t["rows"]) for name, t in tables.items()},
    LogPosition("log", 5, "entry-5", 1, "writer")))
ledger.close()
"""


def test_a_0_2_0_replica_follows_batches_and_snapshots_with_bookings(
        release_0_2_0_code: Path, tmp_path: Path) -> None:
    """0.2.0's own ledger code on this release's batch and snapshot that carry bookings and
    a lease's measured usage: it writes the rest and ignores the bookings and the usage (its
    ledger has no table or column for them)."""
    changes = Changes()
    changes.lease(LeaseRecord(lease_id="L-used", request_key="hub/ann/", user="ann",
                              groups=(), state=LeaseState.RELEASED, created_at=T0,
                              request={}, owner="hub", usage_since=T0, energy_j=50.0,
                              sm_s=4.0, memory_s=1.0, peak_memory_mib=128,
                              usage_run_energy_j=50.0, usage_run_sm_s=4.0,
                              usage_run_memory_s=1.0))
    changes.booking(BookingRow("CS101 lab", {"name": "CS101 lab"}, T0, "admin (admin)"))
    changes.event(T0, "booking_added", booking="CS101 lab", by="admin (admin)")
    source = fresh(tmp_path)
    ledger = Ledger(source)
    ledger.open()
    try:
        ledger.call(lambda: ledger.commit(changes))
        _, tables = ledger.call(lambda: ledger.snapshot_tables(trail=False))
    finally:
        ledger.close()
    assert tables["bookings"].rows
    old = tmp_path / "old.sqlite"
    env = {**os.environ, "PYTHONPATH": str(release_0_2_0_code)}
    ran = subprocess.run(
        [sys.executable, "-c", _OLD_REPLICA, json.dumps(changes.to_json()),
         json.dumps({name: {"columns": t.columns, "rows": t.rows} for name, t in tables.items()}),
         str(old)], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert ran.returncode == 0, ran.stderr
    assert user_version(old) == 6
    with contextlib.closing(sqlite3.connect(old)) as conn:
        assert conn.execute("SELECT kind FROM events").fetchall() == [("booking_added",)]
        assert conn.execute("SELECT lease_id, owner FROM leases").fetchall() == [
            ("L-used", "hub")]
