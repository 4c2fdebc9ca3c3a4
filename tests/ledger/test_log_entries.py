"""The ledger log's entries as strict models (allocator/ledger/log_entries.py, ChangeSet in
allocator/ledger/store.py): every kind round-trips with the previous release's bytes, an entry of a
newer release with fields this one does not know is read, a field of the wrong type is a
broken entry, and a change naming a column the schema does not have is refused before any
SQL runs. (On the real broker: tests/ledger/test_ledger_log.py.)"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from allocator.ledger.change_set import BrokenChanges, ChangeSet
from allocator.ledger.changes import Changes
from allocator.ledger.log_entries import (
    Batch,
    BrokenEntry,
    Claim,
    SnapshotPart,
    decode_entry,
)
from allocator.ledger.log_snapshot import AsOf, PartHeader, Table, encode_parts
from allocator.ledger.schema import COLUMNS
from allocator.ledger.store import Ledger, LedgerError

LEASE = {"lease_id": "l1", "request_key": "k/l1/", "user": "u", "state": "queued",
         "created_at": 1.5, "groups": ["g"], "request": {"count": 1}, "gpu_uuids": [],
         "env": {}, "shared": False, "priority": 0, "units": 0.0}


def changes() -> Changes:
    result = Changes()
    result.leases["l1"] = dict(LEASE)
    result.nodes["h1"] = {"host": "h1", "agent_id": "a", "last_heartbeat": 2.0, "drained": 0}
    result.gpus["GPU-1"] = {"uuid": "GPU-1", "host": "h1", "idx": 0, "model": "m",
                            "memory_total_mib": 8192, "health_reasons": [], "present": 1}
    result.history.append({"lease_id": "l1", "at": 1.5, "from_state": None,
                           "to_state": "queued", "reason": "requested", "by": ""})
    result.event(1.5, "queued", lease_id="l1", user="u", why="no GPU free")
    return result


def claim() -> Claim:
    return Claim(log_id="log-1", entry_id="e1", epoch=1, writer="w1", genesis=True)


def batch() -> Batch:
    return Batch(log_id="log-1", entry_id="e2", epoch=1, writer="w1",
                 changes=ChangeSet.of(changes()), snapshot_from=0)


def part() -> SnapshotPart:
    [payload] = encode_parts({"leases": Table(["lease_id", "state"], [["l1", "queued"]])}, 4096)
    return SnapshotPart(log_id="log-1", entry_id="e3", epoch=1, writer="w1", snapshot_from=0,
                        payload=payload,
                        snapshot=PartHeader(id="s1", part=0, parts=1,
                                            as_of=AsOf(offset=1, entry_id="e2", epoch=1,
                                                       writer="w1")))


def previous_release_encode(kind: str, log_id: str, entry_id: str, epoch: int, writer: str, *,
                            changes: dict[str, Any] | None = None, genesis: bool = False,
                            snapshot_from: int | None = None,
                            snapshot: dict[str, Any] | None = None,
                            payload: bytes = b"") -> bytes:
    """``Entry.encode`` of the release before these models, as it was written."""
    head: dict[str, Any] = {"v": 1, "kind": kind, "log_id": log_id, "entry_id": entry_id,
                            "epoch": epoch, "writer": writer, "changes": changes,
                            "genesis": genesis}
    if snapshot_from is not None:
        head["snapshot_from"] = snapshot_from
    if snapshot is not None:
        head["snapshot"] = snapshot
    body = json.dumps(head, separators=(",", ":")).encode()
    return body + b"\n" + payload if kind == "snapshot" else body


def head_of(body: bytes) -> dict[str, Any]:
    return dict(json.loads(body.partition(b"\n")[0]))


# ------------------------------------------------------------------ round trips, compatibility

@pytest.mark.parametrize("make", [claim, batch, part])
def test_every_kind_of_entry_reads_back_as_written(make: Any) -> None:
    entry = make()
    assert decode_entry(entry.encode()) == entry


def test_claims_and_parts_are_written_byte_for_byte_as_the_previous_release_wrote_them(
        ) -> None:
    assert claim().encode() == previous_release_encode("claim", "log-1", "e1", 1, "w1",
                                                       genesis=True)
    snapshot = part()
    assert snapshot.encode() == previous_release_encode(
        "snapshot", "log-1", "e3", 1, "w1", snapshot_from=0, payload=snapshot.payload,
        snapshot={"id": "s1", "part": 0, "parts": 1,
                  "as_of": {"offset": 1, "entry_id": "e2", "epoch": 1, "writer": "w1"}})


def test_a_batch_keeps_the_previous_releases_fields_and_the_same_rows() -> None:
    written = head_of(batch().encode())
    old = head_of(previous_release_encode("batch", "log-1", "e2", 1, "w1",
                                          changes=changes().to_json(), snapshot_from=0))
    assert list(written) == list(old)
    assert {k: v for k, v in written.items() if k != "changes"} == \
        {k: v for k, v in old.items() if k != "changes"}
    for name, rows in old["changes"].items():
        assert written["changes"][name] == rows  # column order aside: the same values


def test_entries_of_the_previous_release_and_of_releases_before_snapshots_are_read() -> None:
    body = previous_release_encode("batch", "log-1", "e2", 3, "w1", changes=changes().to_json())
    entry = decode_entry(body)
    assert isinstance(entry, Batch) and entry.snapshot_from is None and entry.epoch == 3
    assert entry.changes.to_changes().leases["l1"]["groups"] == ["g"]
    bare = {"v": 1, "kind": "claim", "log_id": "log-1", "entry_id": "e1", "epoch": 1,
            "writer": "w1"}  # no genesis, changes or snapshot_from at all
    assert decode_entry(json.dumps(bare).encode()) == Claim(log_id="log-1", entry_id="e1",
                                                            epoch=1, writer="w1")


def test_an_entry_of_a_newer_release_with_fields_this_one_does_not_know_is_read() -> None:
    snapshot = part()
    head = head_of(snapshot.encode())
    head["trace_id"] = "abc"
    head["snapshot"]["compression"] = "none"
    head["snapshot"]["as_of"]["term"] = 7
    body = json.dumps(head).encode() + b"\n" + snapshot.payload
    assert decode_entry(body) == snapshot
    newer = head_of(batch().encode())
    newer["changes"]["metrics"] = [{"x": 1}]  # a new list of a change set: ignored
    entry = decode_entry(json.dumps(newer).encode())
    assert isinstance(entry, Batch) and entry.changes == batch().changes


# ------------------------------------------------------------------ broken entries

@pytest.mark.parametrize(("change", "says"), [
    ({"epoch": "3"}, "epoch"),
    ({"epoch": 0}, "epoch"),
    ({"epoch": True}, "epoch"),
    ({"log_id": 7}, "log_id"),
    ({"writer": ""}, "writer"),
    ({"genesis": "yes"}, "genesis"),
    ({"snapshot_from": -1}, "snapshot_from"),
    ({"snapshot_from": 1.5}, "snapshot_from"),
])
def test_a_field_of_the_wrong_type_or_out_of_range_is_a_broken_entry(
        change: dict[str, Any], says: str) -> None:
    head = {**head_of(claim().encode()), **change}
    with pytest.raises(BrokenEntry, match=f"broken ledger log claim entry: claim.{says}"):
        decode_entry(json.dumps(head).encode())


@pytest.mark.parametrize("header", [
    {"id": "s1", "part": 1, "parts": 1},
    {"id": "s1", "part": "0", "parts": 1},
    {"id": "s1", "part": 0, "parts": 0},
    {"id": "s1", "part": 0, "parts": 1, "as_of": {"offset": -2}},
])
def test_a_broken_snapshot_header_is_a_broken_entry(header: dict[str, Any]) -> None:
    head = head_of(part().encode())
    head["snapshot"] = {**head["snapshot"], **header,
                        "as_of": {**head["snapshot"]["as_of"], **header.get("as_of", {})}}
    with pytest.raises(BrokenEntry, match=r"broken ledger log snapshot entry: snapshot\.snapshot"):
        decode_entry(json.dumps(head).encode() + b"\n" + part().payload)


@pytest.mark.parametrize("body", [b"not json", b"[1]", b'{"v":2,"kind":"claim"}',
                                  b'{"v":true,"kind":"claim"}', b'{"v":1,"kind":"vote"}'])
def test_what_is_no_entry_of_this_version_is_refused_as_before(body: bytes) -> None:
    with pytest.raises(BrokenEntry):
        decode_entry(body)


def test_only_a_claim_starts_a_log() -> None:
    head = {**head_of(batch().encode()), "genesis": True}
    with pytest.raises(BrokenEntry, match="genesis"):
        decode_entry(json.dumps(head).encode())


def test_a_broken_entry_is_a_value_error_as_before() -> None:
    # The applier and the newest-snapshot lookup handle a broken entry as a ValueError.
    assert issubclass(BrokenEntry, ValueError) and issubclass(BrokenChanges, ValueError)


# ------------------------------------------------------------------ change sets and the schema

@pytest.mark.parametrize(("table", "row", "says"), [
    ("leases", {"lease_id": "l2", "x; DROP TABLE leases": 1}, "x; DROP TABLE leases"),
    ("leases", {"lease_id": "l2", 'state" = 1, "user': "x"}, "state"),
    ("nodes", {"host": "h2", "agent_id": "a", "id": 3}, "id"),
    ("history", {"lease_id": "l1", "at": 1.0, "id": 99}, "id"),
    ("events", {"at": 1.0, "kind": "k", "sql": "1); DROP TABLE events; --"}, "sql"),
    ("leases", {"user": "u"}, "lease_id"),
    ("gpus", {"uuid": "", "host": "h"}, "uuid"),
    ("leases", {"lease_id": "l2", "priority": "1"}, "priority"),
    ("leases", {"lease_id": "l2", "created_at": "now"}, "created_at"),
    ("leases", {"lease_id": "l2", "gpu_uuids": "GPU-1"}, "gpu_uuids"),
    ("gpus", {"uuid": "GPU-2", "memory_total_mib": 1.5}, "memory_total_mib"),
])
def test_a_change_naming_an_unknown_column_or_of_a_wrong_type_is_refused_before_sql(
        tmp_path: Path, table: str, row: dict[str, Any], says: str) -> None:
    path = tmp_path / "ledger.sqlite"
    ledger = Ledger(path)
    ledger.open()
    try:
        ledger.call(lambda: ledger.commit(changes()))
        data = {"leases": [], "nodes": [], "gpus": [], "history": [], "events": [], table: [row]}
        with pytest.raises(BrokenChanges, match="broken change set") as refused:
            Changes.from_json(data)
        assert says in str(refused.value)
        head = {**head_of(batch().encode()), "changes": data}
        with pytest.raises(BrokenEntry, match="broken ledger log batch entry"):
            decode_entry(json.dumps(head).encode())
    finally:
        ledger.close()
    conn = sqlite3.connect(path)
    try:
        assert [r[0] for r in conn.execute("SELECT lease_id FROM leases")] == ["l1"]
        assert conn.execute("SELECT count(*) FROM events").fetchone() == (1,)
        assert conn.execute("SELECT count(*) FROM lease_history").fetchone() == (1,)
    finally:
        conn.close()


def test_rows_that_bypass_the_log_are_held_to_the_schema_too(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open()
    try:
        bad = Changes()
        bad.leases["l2"] = {"lease_id": "l2", "x; DROP TABLE leases": 1}
        with pytest.raises(BrokenChanges, match="x; DROP TABLE leases"):
            ledger.call(lambda: ledger.commit(bad))
        assert ledger.call(lambda: ledger.find_lease("l2")) is None
    finally:
        ledger.close()


def committed(path: Path, batch_: Changes) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of ``batch_`` as a new ledger at ``path`` stores it."""
    ledger = Ledger(path)
    ledger.open()
    try:
        ledger.call(lambda: ledger.commit(batch_))
        return ledger.call(lambda: {
            table: sorted(map(tuple, ledger.db.execute(f'SELECT * FROM "{table}"')))
            for table in ("nodes", "gpus", "leases", "lease_history", "events")})
    finally:
        ledger.close()


def test_a_change_set_commits_as_the_batch_it_was(tmp_path: Path) -> None:
    """Through the log's form and back, the ledger gets the same rows as a direct commit."""
    entry = decode_entry(Batch(log_id="l", entry_id="e", epoch=1, writer="w",
                               changes=ChangeSet.of(changes())).encode())
    assert isinstance(entry, Batch)
    assert committed(tmp_path / "log.sqlite", entry.changes.to_changes()) == \
        committed(tmp_path / "direct.sqlite", changes())


def test_the_schema_the_migrations_make_is_the_column_lists(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "ledger.sqlite")
    ledger.open()
    try:
        for table, columns in COLUMNS.items():
            made = ledger.call(lambda t=table: [  # type: ignore[misc]
                row[1] for row in ledger.db.execute(f'PRAGMA table_info("{t}")')])
            assert made == list(columns), table
    finally:
        ledger.close()


def test_every_row_the_engine_writes_is_one_the_schema_knows() -> None:
    from allocator.ledger.lease import LeaseRecord
    from allocator.placement.cluster import GPU, Node
    from allocator.wire.protocol import LeaseState

    written = Changes()
    written.node(Node(host="h"), agent_user="agent", first_seen=1.0, drain_reason="r",
                 drained_by="admin", drained_at=2.0)
    written.gpu(GPU(uuid="GPU-1", host="h", index=0, model="m", memory_total_mib=1,
                    compute_capability="8.0", mig_profile="1g.5gb", mig_index=0,
                    utilization_pct=3.0), 1.0, first_seen=1.0)
    record = LeaseRecord(lease_id="l", request_key="k", user="u", groups=("g",),
                         state=LeaseState.QUEUED, created_at=1, request={"count": 1})
    written.transition(record, None, 1.0, "requested")
    assert set(written.gpus["GPU-1"]) == set(COLUMNS["gpus"])
    assert set(written.leases["l"]) == set(COLUMNS["leases"])
    assert set(written.nodes["h"]) == set(COLUMNS["nodes"])
    assert ChangeSet.of(written).to_changes().leases["l"]["groups"] == ["g"]


def test_a_ledger_opens_only_for_writing(tmp_path: Path) -> None:
    """Read-only readers use readonly.open_readonly; a Ledger creates its file."""
    path = tmp_path / "new" / "ledger.sqlite"
    ledger = Ledger(path)
    ledger.open()
    ledger.close()
    assert path.exists()
    (tmp_path / "not-a-ledger").write_bytes(b"x" * 4096)
    with pytest.raises(LedgerError, match="not a readable ledger"):
        Ledger(tmp_path / "not-a-ledger").open()
