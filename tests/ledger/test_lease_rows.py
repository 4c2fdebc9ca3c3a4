"""A lease written to a real ledger file reads back as the same record by every path that
reads lease rows: the load of a (re)start, active and finished, the lookup by id and the
lookup by request key; and a row from a ledger older than a column reads that field empty."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from allocator.ledger.changes import Changes
from allocator.ledger.lease import LeaseRecord, row_reader
from allocator.ledger.store import Ledger
from allocator.wire.protocol import LeaseState, ReclaimReason, ReleaseReason

TEXT = st.text(alphabet=st.characters(codec="utf-8"), max_size=12)
MAYBE_TIME = st.none() | st.floats(min_value=0, max_value=2e9, allow_nan=False)

records = st.builds(
    LeaseRecord,
    lease_id=st.uuids().map(lambda u: u.hex),
    request_key=TEXT,
    user=TEXT,
    groups=st.lists(TEXT, max_size=3).map(tuple),
    state=st.sampled_from(LeaseState),
    created_at=st.floats(min_value=0, max_value=2e9, allow_nan=False),
    request=st.dictionaries(TEXT, st.none() | st.integers(-5, 5) | TEXT | st.lists(TEXT),
                            max_size=4),
    priority=st.integers(-100, 100),
    host=st.none() | TEXT,
    gpu_uuids=st.lists(TEXT, max_size=3).map(tuple),
    model=st.none() | TEXT,
    shared=st.booleans(),
    memory_mib=st.none() | st.integers(0, 1 << 20),
    units=st.fractions(min_value=0, max_value=8, max_denominator=7),
    env=st.dictionaries(TEXT, TEXT, max_size=3),
    enqueued_at=MAYBE_TIME, wait_until=MAYBE_TIME, granted_at=MAYBE_TIME,
    bind_deadline=MAYBE_TIME, bound_at=MAYBE_TIME, container_id=st.none() | TEXT,
    releasing_at=MAYBE_TIME, released_at=MAYBE_TIME,
    release_reason=st.none() | st.sampled_from(ReleaseReason),
    released_by=st.none() | TEXT, release_note=st.none() | TEXT, borrowed=st.booleans(),
    reclaim_at=MAYBE_TIME, reclaim_reason=st.none() | st.sampled_from(ReclaimReason),
    reclaim_for=st.none() | TEXT, reclaim_stopped_at=MAYBE_TIME, idle_since=MAYBE_TIME,
    idle_gpu_s=st.floats(min_value=0, max_value=1e9, allow_nan=False),
    owner=st.none() | TEXT,
)


@pytest.fixture(scope="module")
def ledger(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ledger]:
    opened = Ledger(tmp_path_factory.mktemp("rows") / "ledger.sqlite")
    opened.open()
    yield opened
    opened.close()


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(record=records)
def test_a_lease_reads_back_as_written_by_every_path(ledger: Ledger, record: LeaseRecord
                                                     ) -> None:
    changes = Changes()
    changes.lease(record)
    ledger.call(lambda: ledger.commit(changes))
    loaded = ledger.call(ledger.load)
    in_load = [r for r in (*loaded.leases, *loaded.finished) if r.lease_id == record.lease_id]
    assert in_load == [record]
    # the load puts it where a restart looks for it: finished leases apart from active ones
    assert (record in loaded.finished) is record.state.final
    assert ledger.call(lambda: ledger.find_lease(record.lease_id)) == record
    newest = ledger.call(lambda: ledger.latest_lease_for_key(record.request_key))
    assert newest is not None and newest.request_key == record.request_key


def test_a_row_without_a_later_column_reads_that_field_empty(tmp_path: Path) -> None:
    """A row as a ledger from before ``idle_gpu_s`` and ``owner`` holds it (the migration
    adds the columns; a reader given fewer columns must not shift the others)."""
    path = tmp_path / "ledger.sqlite"
    ledger = Ledger(path)
    ledger.open()
    record = LeaseRecord(lease_id="L1", request_key="k", user="u", groups=("g",),
                         state=LeaseState.BOUND, created_at=5.0, request={"count": 2},
                         host="gpu-a", gpu_uuids=("GPU-1", "GPU-2"), units=Fraction(3, 2),
                         env={"A": "1"}, idle_gpu_s=7.5, owner="hub", borrowed=True)
    try:
        changes = Changes()
        changes.lease(record)
        ledger.call(lambda: ledger.commit(changes))
    finally:
        ledger.close()
    with sqlite3.connect(path) as conn:
        cursor = conn.execute("SELECT * FROM leases")
        columns = [c[0] for c in cursor.description]
        values = cursor.fetchone()
    kept = [i for i, name in enumerate(columns) if name not in ("idle_gpu_s", "owner")]
    read = row_reader(tuple(columns[i] for i in kept))(tuple(values[i] for i in kept))
    assert read.idle_gpu_s == 0.0 and read.owner is None
    assert read.gpu_uuids == ("GPU-1", "GPU-2") and read.units == Fraction(3, 2)
    assert read.groups == ("g",) and read.env == {"A": "1"} and read.borrowed
    assert (read.host, read.state, read.request) == ("gpu-a", LeaseState.BOUND, {"count": 2})
