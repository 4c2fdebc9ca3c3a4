"""The pure rules of the ledger log's snapshots (allocator/ledger/log_snapshot.py): the tables split
into bounded parts and joined again unchanged, and which runs of entries make a whole, valid
snapshot. (On the real broker: tests/ledger/test_ledger_log_snapshots.py.)"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.ledger.log_snapshot import (
    AsOf,
    PartHeader,
    Seen,
    SnapshotAssembly,
    Table,
    Tables,
    decode_parts,
    encode_parts,
)

values = st.one_of(st.none(), st.booleans(), st.integers(-(2**53), 2**53),
                   st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40))


@st.composite
def tables(draw: st.DrawFn) -> Tables:
    result: Tables = {}
    for name in draw(st.lists(st.sampled_from(["nodes", "gpus", "leases", "events"]),
                              unique=True, max_size=4)):
        columns = draw(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=5,
                                unique=True))
        rows = draw(st.lists(st.lists(values, min_size=len(columns), max_size=len(columns)),
                             max_size=30))
        result[name] = Table(columns, rows)
    return result


def without_empty(tables: Tables) -> Tables:
    return {name: table for name, table in tables.items() if table.rows}


@settings(max_examples=300, deadline=None)
@given(tables(), st.integers(64, 4096))
def test_parts_join_into_the_same_tables_and_each_stays_within_its_bound(
        snapshot: Tables, max_part_bytes: int) -> None:
    parts = encode_parts(snapshot, max_part_bytes)
    assert parts, "even an empty ledger's snapshot is one part"
    assert decode_parts(parts) == without_empty(snapshot)
    for part in parts:
        rows = sum(len(table["rows"]) for table in json.loads(part).values())
        # Only a part holding a single row larger than the bound may exceed it.
        assert len(part) <= max_part_bytes or rows == 1, (len(part), rows)


def test_parts_that_disagree_on_a_tables_columns_are_refused() -> None:
    first = encode_parts({"leases": Table(["lease_id"], [["a"]])}, 1024)
    second = encode_parts({"leases": Table(["lease_id", "user"], [["b", "u"]])}, 1024)
    try:
        decode_parts(first + second)
    except ValueError as exc:
        assert "columns of leases" in str(exc)
    else:
        raise AssertionError("mixed columns were joined")


# ------------------------------------------------------------------------------ assembly

LOG = "log-1"
WRITER = "writer-a"


def entry(offset: int, name: str, *, epoch: int = 1, writer: str = WRITER,
          part: PartHeader | None = None, payload: bytes = b"", genesis: bool = False) -> Seen:
    return Seen(offset, name, LOG, epoch, writer, genesis, part, payload)


def snapshot_entries(as_of: Seen, payloads: list[bytes], *, first_offset: int,
                     epoch: int = 1, writer: str = WRITER, snapshot_id: str = "s1",
                     header_epoch: int | None = None, header_writer: str | None = None
                     ) -> list[Seen]:
    """The parts a writer appends after ``as_of``; offsets may skip (RabbitMQ's own chunks)."""
    return [entry(first_offset + 2 * number, f"{snapshot_id}-part{number}", epoch=epoch,
                  writer=writer, payload=payload,
                  part=PartHeader(id=snapshot_id, part=number, parts=len(payloads),
                                  as_of=AsOf(offset=as_of.offset, entry_id=as_of.entry_id,
                                             epoch=header_epoch or epoch,
                                             writer=header_writer or writer)))
            for number, payload in enumerate(payloads)]


def read(entries: list[Seen], assembly: SnapshotAssembly | None = None) -> list[Any]:
    assembly = assembly or SnapshotAssembly()
    return [done for seen in entries if (done := assembly.see(seen)) is not None]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=50), min_size=1, max_size=8), st.integers(0, 10**6))
def test_parts_right_after_their_as_of_entry_make_one_whole_snapshot(
        payloads: list[bytes], first: int) -> None:
    as_of = entry(first, "batch-at-as-of")
    parts = snapshot_entries(as_of, payloads, first_offset=first + 1)
    [done] = read([entry(first - 1, "before"), as_of, *parts, entry(10**7, "after")])
    assert done.payloads == payloads
    assert (done.last_offset, done.last_entry_id) == (parts[-1].offset, parts[-1].entry_id)
    assert done.header.as_of.offset == first and not done.as_of_genesis
    assert done.size == sum(map(len, payloads))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=20), min_size=1, max_size=6), st.data())
def test_any_entry_between_the_as_of_entry_and_the_last_part_breaks_the_snapshot(
        payloads: list[bytes], data: st.DataObject) -> None:
    """A claim (or a deposed writer's late batch) that lands among the parts: the tables may
    no longer be the state at the last part, so no replica may load them."""
    as_of = entry(10, "as-of")
    parts = snapshot_entries(as_of, payloads, first_offset=11)
    where = data.draw(st.integers(0, len(parts) - 1), label="intruder before part")
    intruder = entry(parts[where].offset - 1, "claim-of-b", epoch=2, writer="writer-b")
    assert read([as_of, *parts[:where], intruder, *parts[where:]]) == []


def test_a_snapshot_whose_start_is_not_read_is_none() -> None:
    as_of = entry(10, "as-of")
    parts = snapshot_entries(as_of, [b"1", b"2", b"3"], first_offset=11)
    assert read(parts) == [], "as-of entry unknown (the stream starts later)"
    assert read(parts[1:], SnapshotAssembly((10, "as-of", LOG, False))) == [], "first part gone"
    assert read([entry(9, "another"), *parts]) == [], "another entry read before the first part"


def test_a_snapshot_of_a_writer_the_log_did_not_obey_at_its_as_of_entry_is_none() -> None:
    """A deposed writer that read the new claim writes the claim's epoch and writer into the
    header (they come from its ledger) but its own id into the entries: never whole."""
    as_of = entry(10, "claim-of-b", epoch=2, writer="writer-b")
    parts = snapshot_entries(as_of, [b"x", b"y"], first_offset=11, epoch=2, writer=WRITER,
                             header_epoch=2, header_writer="writer-b")
    assert read([as_of, *parts]) == []
    # An older epoch in the entries than in the header is no snapshot either.
    parts = snapshot_entries(as_of, [b"x"], first_offset=11, epoch=1, header_epoch=2,
                             header_writer=WRITER)
    assert read([as_of, *parts]) == []


def test_the_parts_of_two_snapshots_interleaved_make_neither() -> None:
    as_of = entry(10, "as-of")
    first = snapshot_entries(as_of, [b"a", b"b"], first_offset=11, snapshot_id="s1")
    second = snapshot_entries(as_of, [b"c", b"d"], first_offset=12, snapshot_id="s2")
    assert read([as_of, first[0], second[0], first[1], second[1]]) == []


def test_a_snapshot_right_after_the_genesis_claim_seeds_the_log_and_keeps_its_tables() -> None:
    genesis = entry(0, "genesis", genesis=True)
    parts = snapshot_entries(genesis, [b"seed-1", b"seed-2"], first_offset=1)
    later_as_of = entry(20, "batch")
    later = snapshot_entries(later_as_of, [b"state"], first_offset=21, snapshot_id="s2")
    follower = SnapshotAssembly(keep_payloads=False)
    seed, periodic = read([genesis, *parts, later_as_of, *later], follower)
    assert seed.as_of_genesis and seed.payloads == [b"seed-1", b"seed-2"]
    assert not periodic.as_of_genesis and periodic.payloads == [], \
        "a follower has the state already: the tables are not kept"
