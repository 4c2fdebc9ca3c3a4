"""The ledger log's rules as every replica applies them (allocator/ledger/log_rules.py and
log_catch_up.py): pure functions of an entry and a replica's place in the log."""

from __future__ import annotations

import uuid

from hypothesis import given
from hypothesis import strategies as st

from allocator.ledger.change_set import ChangeSet
from allocator.ledger.changes import Changes
from allocator.ledger.log_catch_up import ScanFromOldest, SnapshotSearch
from allocator.ledger.log_entries import Batch, Claim, Entry
from allocator.ledger.log_position import LogPosition
from allocator.ledger.log_rules import (
    ENTRY_OVERHEAD_BYTES,
    Applied,
    CatchUp,
    Follow,
    NotHistory,
    fence,
    grown_since_snapshot,
    join,
    resume,
    snapshot_outgrows_retention,
    stream_is_not_the_log,
)
from allocator.placement.cluster import Node

LOG = "log-1"
WRITERS = ("writer-a", "writer-b", "writer-c")


def claim(epoch: int, writer: str, *, log_id: str = LOG, genesis: bool = False) -> Claim:
    return Claim(log_id=log_id, entry_id=uuid.uuid4().hex, epoch=epoch, writer=writer,
                 genesis=genesis)


def batch(epoch: int, writer: str, *, log_id: str = LOG, host: str = "gpu-a") -> Batch:
    changes = Changes()
    changes.node(Node(host=host, last_heartbeat=1.0))
    return Batch(log_id=log_id, entry_id=uuid.uuid4().hex, epoch=epoch, writer=writer,
                 changes=ChangeSet.of(changes))


entries = st.one_of(
    st.builds(claim, st.integers(1, 6), st.sampled_from(WRITERS)),
    st.builds(batch, st.integers(1, 6), st.sampled_from(WRITERS)),
)


@given(st.lists(entries, max_size=40))
def test_only_the_newest_claims_writer_has_its_batches_applied(log: list[Entry]) -> None:
    epoch, writer = 0, ""
    for entry in log:
        fenced = fence(entry, LOG, epoch, writer)
        if entry.kind == "claim":
            # A claim is accepted exactly when it is newer, and makes its writer the writer.
            assert fenced.accepted == (entry.epoch > epoch)
            assert not fenced.changes.nodes
        else:
            assert fenced.accepted == ((entry.epoch, entry.writer) == (epoch, writer))
            assert bool(fenced.changes.nodes) == fenced.accepted
        assert fenced.epoch >= epoch  # the epoch never goes back
        if fenced.accepted and entry.kind == "claim":
            assert (fenced.epoch, fenced.writer) == (entry.epoch, entry.writer)
        else:
            assert (fenced.epoch, fenced.writer) == (epoch, writer)
        epoch, writer = fenced.epoch, fenced.writer


def test_an_entry_of_another_log_is_never_accepted() -> None:
    assert not fence(claim(9, "writer-a", log_id="log-2"), LOG, 1, "writer-b").accepted
    assert not fence(batch(1, "writer-b", log_id="log-2"), LOG, 1, "writer-b").accepted


def position(offset: int, entry_id: str = "applied", *, since: int | None = 0) -> LogPosition:
    return LogPosition(LOG, offset, entry_id, 1, "writer-a", 0, since)


def test_a_restart_resumes_at_the_entry_it_applied_last() -> None:
    last = claim(1, "writer-a")
    assert resume(position(7, last.entry_id), last.entry_id, 7, last) == Applied()
    assert resume(position(7, last.entry_id), last.entry_id, 8, batch(1, "writer-a")) == \
        Follow()


def test_a_place_gone_from_the_stream_catches_up_from_its_own_log() -> None:
    verdict = resume(position(7), "applied", 20, batch(1, "writer-a"))
    assert isinstance(verdict, CatchUp) and verdict.log_id == LOG
    assert "offset 7" in verdict.why and "offset 20" in verdict.why


def test_another_entry_at_its_place_or_another_log_is_not_its_history() -> None:
    for offset, entry in ((7, batch(1, "writer-a")),                 # another entry there
                          (5, batch(1, "writer-a")),                 # the stream is shorter
                          (8, batch(1, "writer-a", log_id="log-2")),
                          (20, batch(1, "writer-a", log_id="log-2"))):
        assert isinstance(resume(position(7), "applied", offset, entry), NotHistory)


def test_a_ledger_new_to_the_log_starts_at_its_genesis_or_catches_up() -> None:
    genesis = claim(1, "writer-a", genesis=True)
    assert join(False, "writer-b", 0, genesis) == Follow()
    later = join(False, "writer-b", 12, batch(1, "writer-a"))
    assert isinstance(later, CatchUp) and later.log_id is None
    # A ledger with data joins only the log it starts itself (its snapshot seeds the others).
    assert join(True, "writer-a", 0, genesis) == Follow()
    assert isinstance(join(True, "writer-b", 0, genesis), NotHistory)
    assert isinstance(join(True, "writer-a", 12, batch(1, "writer-a")), NotHistory)


def test_growth_counts_each_entry_with_its_overhead_and_unknown_stays_unknown() -> None:
    assert grown_since_snapshot(None, 100) == 100 + ENTRY_OVERHEAD_BYTES
    assert grown_since_snapshot(position(1, since=1_000), 100) == 1_100 + ENTRY_OVERHEAD_BYTES
    assert grown_since_snapshot(position(1, since=None), 100) is None


def test_why_a_stream_cannot_be_the_log_a_restored_ledger_follows() -> None:
    here = position(7)
    assert "no entry" in (stream_is_not_the_log(here, None, 5.0) or "")
    assert "of log log-2" in (stream_is_not_the_log(
        here, (0, claim(1, "writer-a", log_id="log-2", genesis=True)), 5.0) or "")
    assert "no genesis" in (stream_is_not_the_log(here, (0, claim(1, "writer-a")), 5.0) or "")
    assert stream_is_not_the_log(here, (0, claim(1, "writer-a", genesis=True)), 5.0) is None
    assert stream_is_not_the_log(here, (3, batch(1, "writer-a")), 5.0) is None
    assert stream_is_not_the_log(here, (0, None), 5.0) is None  # the applier stops on it


def test_a_snapshot_must_fit_twice_in_what_the_stream_keeps() -> None:
    sizes = {"max_bytes": 1_000, "segment_bytes": 100, "snapshot_bytes": 200}
    assert not snapshot_outgrows_retention(300, **sizes)   # 2*300 + 200 == 1000 - 2*100
    assert snapshot_outgrows_retention(301, **sizes)


def test_a_hint_that_is_no_longer_kept_sends_the_search_to_the_oldest_entry() -> None:
    search = SnapshotSearch(LOG, hint=40)
    found = search.see(52, batch(1, "writer-a"))
    assert isinstance(found, ScanFromOldest) and "offset 40" in found.why
    # From the oldest: entries that are no snapshot are read on.
    assert SnapshotSearch(LOG).see(3, batch(1, "writer-a")) is None
