"""Snapshots of the ledger in the replicated log, as pure code (no I/O, no clock).

A snapshot is the ledger's tables at one entry of the log, its *as-of* entry, written into
the log as a run of *parts* right after that entry (:mod:`allocator.ledger.replication` writes and
reads them). This module holds the three rules every replica must apply alike:

- :func:`encode_parts`: the tables as payloads of bounded size, so that no entry outgrows a
  sane message (a ledger with a long past is large);
- :func:`decode_parts`: the payloads joined into the tables again;
- :class:`SnapshotAssembly`: which entries read from the log make one whole, valid snapshot.

Valid means: the parts follow their as-of entry *immediately* in the log, one after the
other with nothing between them, and they were written by the writer the log obeyed at that
entry (their epoch and writer are the as-of entry's). Nothing between the as-of entry and the
last part then changed the ledger: only the writer's batches do, and the writer appends
nothing of its own while it writes a snapshot; an accepted claim in between would have broken
the run. So the tables are the ledger's state at the last part, and a replica that loads them
may go on with the entry after it. A snapshot of a deposed writer, one broken by another
entry, or one whose parts are partly gone is no snapshot: every replica ignores it alike.

Stream offsets are not used to tell "right after": RabbitMQ gives offsets to its own chunks
too (each new segment starts with one), so two entries in a row may be two offsets apart.
Order of delivery is what counts; the as-of entry is named by offset *and* entry id.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    TypeAdapter,
    ValidationError,
    model_validator,
)

STATE_TABLES = ("nodes", "gpus", "leases", "bookings")
"""What a replica serves and accounts from: every node, GPU and lease, finished ones too
(a request key's status, usage accounting and zombie containers all read lease rows), and
every booking (0.3.0; a release before it loads the tables it knows and skips this one)."""

TRAIL_TABLES = ("lease_history", "events")
"""The audit trail: appended to, never read to serve. Only the snapshot that seeds a new log
from a ledger with data carries it (docs/design.md, high availability, snapshots)."""


@dataclass
class Table:
    """One table of a snapshot: its column names and its rows, values as stored in SQLite."""

    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)


Tables = dict[str, Table]


def encode_parts(tables: Tables, max_part_bytes: int) -> list[bytes]:
    """``tables`` as JSON payloads of at most ``max_part_bytes`` each, rows kept whole (a row
    larger than that alone gets a part of its own). Always at least one part; a table without
    rows is in none."""
    if max_part_bytes < 64:
        raise ValueError("a snapshot part must be allowed at least 64 bytes")
    parts: list[bytes] = []
    current: list[tuple[str, bytes, list[bytes]]] = []
    """The part being filled: (table, its opening ``"name":{"columns":[...],"rows":[``, its
    encoded rows)."""
    size = 2  # the payload's braces

    def flush() -> None:
        nonlocal current, size
        parts.append(b"{" + b",".join(opening + b",".join(rows) + b"]}"
                                      for _, opening, rows in current) + b"}")
        current, size = [], 2

    for name, table in tables.items():
        opening = (json.dumps(name) + ':{"columns":' + json.dumps(table.columns)
                   + ',"rows":[').encode()
        for row in table.rows:
            encoded = json.dumps(row, separators=(",", ":")).encode()
            if current and current[-1][0] == name:
                cost = 1 + len(encoded)  # a comma, the row
            else:  # a comma after the part's last table, the table's opening and ]}, the row
                cost = (1 if current else 0) + len(opening) + 2 + len(encoded)
            if current and size + cost > max_part_bytes:
                flush()
                cost = len(opening) + 2 + len(encoded)
            if not current or current[-1][0] != name:
                current.append((name, opening, []))
            current[-1][2].append(encoded)
            size += cost
    if current or not parts:
        flush()
    return parts


Value = StrictStr | StrictInt | StrictFloat | StrictBool | None
"""A value as SQLite stores it (JSON columns as their text)."""


class _TablePart(BaseModel):
    """One table's rows in one part: ``{"columns": [...], "rows": [[...], ...]}``."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    columns: list[Annotated[str, Field(min_length=1)]] = Field(min_length=1)
    rows: list[list[Value]]

    @model_validator(mode="after")
    def _rows_fit_the_columns(self) -> Self:
        if len(set(self.columns)) != len(self.columns):
            raise ValueError("a column is named twice")
        width = len(self.columns)
        for number, row in enumerate(self.rows):
            if len(row) != width:
                raise ValueError(f"row {number} has {len(row)} values for {width} columns")
        return self


_PART = TypeAdapter(dict[str, _TablePart])
"""A part's payload: table name to its rows in the part. Table names are checked where the
tables are loaded (:meth:`allocator.ledger.store.Ledger.load_snapshot` reads only its own)."""


def decode_parts(payloads: list[bytes]) -> Tables:
    """The tables :func:`encode_parts` split into ``payloads``; ValueError (a pydantic
    ValidationError among them) if a payload is not one."""
    tables: Tables = {}
    for payload in payloads:
        try:
            part = _PART.validate_json(payload, strict=True)
        except ValidationError as exc:
            raise ValueError(f"a broken snapshot part: {describe(exc)}") from None
        for name, table in part.items():
            if name not in tables:
                tables[name] = Table(list(table.columns), [])
            elif tables[name].columns != table.columns:
                raise ValueError(f"the parts of a snapshot disagree on the columns of {name}")
            tables[name].rows.extend(table.rows)
    return tables


def describe(exc: ValidationError) -> str:
    """A validation error in one line: the first problem, where it is, and how many more."""
    errors = exc.errors(include_url=False, include_input=False)
    where = ".".join(str(part) for part in errors[0]["loc"])
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where + ': ' if where else ''}{errors[0]['msg']}{more}"


class AsOf(BaseModel):
    """The entry a snapshot is the state of, and the epoch and writer the log obeyed after
    it: a replica that loads the snapshot obeys them too, and only their own parts make the
    snapshot."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    offset: int = Field(ge=0)
    """The stream offset of the as-of entry."""
    entry_id: str = Field(min_length=1)
    epoch: int = Field(ge=1)
    writer: str = Field(min_length=1)


class PartHeader(BaseModel):
    """What a snapshot's part says about the snapshot (the entry's ``snapshot`` field)."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    id: str = Field(min_length=1)
    """The snapshot's id, the same in each of its parts."""
    part: int = Field(ge=0)
    """This part's number, from 0."""
    parts: int = Field(ge=1)
    """How many parts the snapshot has."""
    as_of: AsOf

    @model_validator(mode="after")
    def _part_of_parts(self) -> Self:
        if self.part >= self.parts:
            raise ValueError(f"snapshot part {self.part} of {self.parts}")
        return self


@dataclass(frozen=True)
class Seen:
    """One entry of the log, as the assembly needs to know it."""

    offset: int
    entry_id: str
    log_id: str
    epoch: int
    writer: str
    genesis: bool = False
    """The log's first claim (whose state is the ledger its writer started the log from)."""
    part: PartHeader | None = None
    """Set when the entry is a part of a snapshot."""
    payload: bytes = b""


@dataclass(frozen=True)
class Assembled:
    """A whole, valid snapshot, as the last of its parts is read."""

    header: PartHeader
    log_id: str
    last_offset: int
    """The offset and id of its last part: the ledger's position once it is loaded."""
    last_entry_id: str
    as_of_genesis: bool
    """Its as-of entry is the log's genesis claim: it seeds the log, and every replica other
    than its writer loads it."""
    payloads: list[bytes]
    """Its parts' payloads in order; empty if the assembly did not keep them."""
    size: int
    """The bytes of its payloads."""


@dataclass
class _Run:
    header: PartHeader
    log_id: str
    as_of_genesis: bool
    next_part: int
    keep: bool
    payloads: list[bytes]
    size: int


class SnapshotAssembly:
    """Reads the log's entries in order and says when they make a whole, valid snapshot.

    ``previous`` is the entry read just before the first one given to :meth:`see` (offset,
    entry id, log id, whether it is the genesis claim), when known. With ``keep_payloads``
    false, only a snapshot that seeds the log (its as-of entry is the genesis claim) keeps
    its payloads: a replica that follows the log has the state of every other one already.
    """

    def __init__(self, previous: tuple[int, str, str, bool] | None = None, *,
                 keep_payloads: bool = True) -> None:
        self._previous = previous
        self._keep_payloads = keep_payloads
        self._run: _Run | None = None

    @property
    def assembling(self) -> bool:
        """Whether the entries read last are the first parts of a snapshot not yet whole."""
        return self._run is not None

    def see(self, entry: Seen) -> Assembled | None:
        """Read one entry; the snapshot it completes, if it does."""
        previous, self._previous = self._previous, (entry.offset, entry.entry_id,
                                                    entry.log_id, entry.genesis)
        run, self._run = self._run, None
        part = entry.part
        if part is None or entry.epoch != part.as_of.epoch or entry.writer != part.as_of.writer:
            return None
        if run is not None and entry.log_id == run.log_id \
                and part == run.header.model_copy(update={"part": run.next_part}):
            pass  # the next part of the snapshot being read
        elif part.part == 0 and previous is not None \
                and previous[:3] == (part.as_of.offset, part.as_of.entry_id, entry.log_id):
            run = _Run(part, entry.log_id, previous[3], 0,
                       self._keep_payloads or previous[3], [], 0)
        else:
            return None  # a part whose beginning was not read right before it
        if run.keep:
            run.payloads.append(entry.payload)
        run.size += len(entry.payload)
        run.next_part += 1
        if run.next_part < run.header.parts:
            self._run = run
            return None
        return Assembled(run.header, run.log_id, entry.offset, entry.entry_id,
                         run.as_of_genesis, run.payloads, run.size)
