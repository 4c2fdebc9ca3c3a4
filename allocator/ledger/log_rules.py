"""The rules every replica of the ledger log applies to what it reads (pure: no I/O).

:mod:`allocator.ledger.replication` reads the stream and writes the ledger; what it decides
about each entry is here, so that every decision is one function of the entry and the
replica's place in the log, the same on every replica:

- :func:`resume`: whether the first entry read after a start is the one this ledger applied
  last (or its place is gone from the stream, or the stream is another log);
- :func:`join`: where a ledger that never followed this log may start;
- :func:`fence`: which claims and batches are accepted (the epoch rule);
- :func:`grown_since_snapshot`: how much the log has grown since its newest whole snapshot;
- :func:`stream_is_not_the_log`: why a stream cannot be the log a restored ledger follows;
- :func:`snapshot_outgrows_retention`: whether a snapshot may be dropped before the next.
"""

from __future__ import annotations

from dataclasses import dataclass

from allocator.ledger.changes import Changes
from allocator.ledger.log_entries import Batch, Entry
from allocator.ledger.log_position import LogPosition

ENTRY_OVERHEAD_BYTES = 300
"""What the stream stores per entry besides its body (AMQP properties, annotations, a share
of a chunk header): 257 bytes measured on RabbitMQ 3.10.8. The log's growth is counted with
it, so that many small entries cannot make retention drop more than the settings allow for."""


@dataclass(frozen=True)
class Applied:
    """The entry read is the one this ledger applied last: follow on from it."""


@dataclass(frozen=True)
class CatchUp:
    """This ledger's place is gone (or it never had one): load the log's newest snapshot."""

    why: str
    log_id: str | None
    """The log the snapshot must be of; None: any (a ledger new to the log)."""


@dataclass(frozen=True)
class NotHistory:
    """This ledger is not the log's history: the replica must not serve from it."""

    why: str


@dataclass(frozen=True)
class Follow:
    """Apply the entry by the epoch rule (:func:`fence`)."""


Verdict = Applied | CatchUp | NotHistory | Follow


def resume(position: LogPosition, expected_entry_id: str, offset: int, entry: Entry) -> Verdict:
    """The first entry read after a start, from the offset of ``position``: it must be the
    entry this ledger applied last (``expected_entry_id``), unless its place is gone."""
    if offset == position.offset and entry.entry_id == expected_entry_id:
        return Applied()
    if entry.log_id == position.log_id and offset > position.offset + 1:
        # Everything it holds came from this log up to its place, so the log's newest
        # snapshot may replace it.
        return CatchUp(f"its place in the log (offset {position.offset}) is older than the "
                       f"oldest entry the stream keeps (offset {offset})", position.log_id)
    if offset > position.offset + 1 or offset < position.offset or \
            entry.log_id != position.log_id or offset == position.offset:
        return NotHistory(f"it applied entry {expected_entry_id} at offset {position.offset} "
                          f"of log {position.log_id}, the log has entry {entry.entry_id} of "
                          f"log {entry.log_id} at offset {offset}")
    return Follow()


def join(had_data: bool, writer_id: str, offset: int, entry: Entry) -> Verdict:
    """An entry read by a ledger that never applied one of this log: it starts the log with
    the genesis at offset 0, or catches up; a ledger with data only from its own genesis
    (its data seeds the log)."""
    if had_data and (not entry.genesis or offset != 0 or entry.writer != writer_id):
        return NotHistory("it has data but was never part of this log")
    if not entry.genesis or offset != 0:
        return CatchUp(f"the log's oldest entry kept is offset {offset}, not its start", None)
    return Follow()


@dataclass(frozen=True)
class Fenced:
    """What the epoch rule made of one entry."""

    accepted: bool
    epoch: int
    """The epoch of the newest accepted claim after the entry."""
    writer: str
    """Its writer."""
    changes: Changes
    """What to commit: an accepted batch's changes, else none."""


def fence(entry: Entry, log_id: str, epoch: int, writer: str) -> Fenced:
    """The epoch rule: a claim of a higher epoch is accepted and its writer is the writer; a
    batch (or snapshot part) is applied only if its epoch and writer are the current ones.
    Anything else is a deposed writer's late write, skipped by every replica alike."""
    if entry.log_id != log_id:
        # A second replica's attempt to start the log, after the first: skipped.
        return Fenced(False, epoch, writer, Changes())
    if entry.kind == "claim":
        if entry.epoch > epoch:
            return Fenced(True, entry.epoch, entry.writer, Changes())
        return Fenced(False, epoch, writer, Changes())
    if entry.epoch == epoch and entry.writer == writer:
        changes = entry.changes.to_changes() if isinstance(entry, Batch) else Changes()
        return Fenced(True, epoch, writer, changes)
    return Fenced(False, epoch, writer, Changes())


def grown_since_snapshot(position: LogPosition | None, body_bytes: int) -> int | None:
    """The log's growth since its newest whole snapshot once an entry of ``body_bytes`` is
    added (from its start while it has none; unknown stays unknown until the next one)."""
    grown = position.bytes_since_snapshot if position is not None else 0
    return None if grown is None else grown + body_bytes + ENTRY_OVERHEAD_BYTES


def stream_is_not_the_log(position: LogPosition, oldest: tuple[int, Entry | None] | None,
                          timeout_s: float) -> str | None:
    """Why the stream cannot be the log this ledger follows, from its oldest entry
    (``None``: none came within ``timeout_s``; an entry of None: unreadable, which the
    applier stops on in its turn); None when it may be."""
    if oldest is None:
        return (f"the stream holds no entry (none came within {timeout_s:g} s), this "
                f"ledger applied offset {position.offset}")
    offset, entry = oldest
    if entry is not None and entry.log_id != position.log_id:
        return (f"the stream's oldest entry is of log {entry.log_id}, this ledger "
                f"follows log {position.log_id}")
    if entry is not None and offset == 0 and not entry.genesis:
        # The first entry of a log is always its genesis claim.
        return (f"the stream was started by a claim of a ledger that was not its log "
                f"(offset 0 is no genesis), this ledger applied offset {position.offset}")
    return None


def snapshot_outgrows_retention(stored_bytes: int, *, max_bytes: int, segment_bytes: int,
                                snapshot_bytes: int) -> bool:
    """Whether a snapshot of ``stored_bytes`` may be dropped before the next one is whole:
    the stream drops whole segments, so it keeps at least ``max_bytes - 2 segments``, and
    the newest snapshot must fit there twice over, with the growth allowed between two."""
    return 2 * stored_bytes + snapshot_bytes > max_bytes - 2 * segment_bytes
