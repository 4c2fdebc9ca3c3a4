"""The entries of the replicated ledger log, as strict pydantic models (pure: no I/O).

Every entry is one message of the ledger-log stream (:mod:`allocator.ledger.replication`): a JSON
object, and for a snapshot part its payload after a newline. Three kinds:

- :class:`Claim`: a writer takes the log at an epoch (the log's first, its *genesis*,
  starts the log and names it);
- :class:`Batch`: one committed batch of the writer of its epoch, a :class:`ChangeSet`;
- :class:`SnapshotPart`: one part of a snapshot of the ledger
  (:mod:`allocator.ledger.log_snapshot`), its header in ``snapshot`` and its tables as the payload.

Entries come from other releases of the allocator, older and newer, on the other replicas:
a reader ignores fields it does not know, and validates the fields it knows strictly (no
``"3"`` for an epoch, no negative offset). What is written keeps the field names, order and
meaning of the first release with snapshots, so that release reads it. An entry of another
version (``v``) or that does not validate is a :class:`BrokenEntry`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Final, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from allocator.ledger.change_set import ChangeSet
from allocator.ledger.log_snapshot import PartHeader, Seen, describe

ENTRY_VERSION: Final = 1
"""Version of the entry format; an entry of another version stops the replica."""

KINDS: Final = ("claim", "batch", "snapshot")

Ident = Annotated[str, Field(min_length=1)]
"""A log id, entry id or writer id (uuid4 hex as written; any non-empty text is read)."""

_ALWAYS_WRITTEN: Final = frozenset({"v", "kind", "log_id", "entry_id", "epoch", "writer",
                                    "changes", "genesis"})
_HEAD_ORDER: Final = ("v", "kind", "log_id", "entry_id", "epoch", "writer", "changes",
                      "genesis", "snapshot_from", "snapshot")
"""The fields of an entry's JSON as written, in order; ``snapshot_from`` and ``snapshot`` only
when set. The bytes are those of the releases before these models."""


class BrokenEntry(ValueError):
    """A message of the ledger log's stream that is not an entry this release can read: not
    JSON, another version, or a field of the wrong type or out of range. A replica that
    meets one stops serving (:class:`allocator.ledger.replication.LogMismatch`)."""


class _Entry(BaseModel):
    """The fields every entry has."""

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    v: Literal[1] = ENTRY_VERSION
    kind: str
    log_id: Ident
    """Which log: a new one in the genesis claim, then the same in every entry."""
    entry_id: Ident
    """This entry's own id (stream offsets alone cannot name an entry: see log_snapshot)."""
    epoch: int = Field(ge=1)
    """The writer's epoch: a claim's new one, the epoch of a batch's or a part's writer."""
    writer: Ident
    genesis: bool = False
    """The log's first claim. Only a claim is one."""
    snapshot_from: int | None = Field(default=None, ge=0)
    """Where the newest whole snapshot the writer knows starts (its as-of entry's offset);
    None while the log has none, and in entries of releases before snapshots."""

    @model_validator(mode="after")
    def _only_a_claim_starts_a_log(self) -> Self:
        if self.genesis and self.kind != "claim":
            raise ValueError(f"a {self.kind} cannot be the log's genesis")
        return self

    @property
    def part(self) -> PartHeader | None:
        """A snapshot part's header; None for other entries."""
        return None

    @property
    def body_payload(self) -> bytes:
        """What follows the JSON in the message: a snapshot part's tables; empty otherwise."""
        return b""

    def encode(self) -> bytes:
        """The message body: one JSON object; a snapshot part's payload follows it on a line
        of its own, so a replica that does not need the tables does not parse them."""
        fields = self.model_dump(mode="json", exclude={"payload"})
        head = {name: fields.get(name) for name in _HEAD_ORDER
                if name in _ALWAYS_WRITTEN or fields.get(name) is not None}
        body = json.dumps(head, separators=(",", ":")).encode()
        return body + b"\n" + self.body_payload if self.kind == "snapshot" else body

    def seen(self, offset: int) -> Seen:
        """The entry as a :class:`~allocator.ledger.log_snapshot.SnapshotAssembly` reads it."""
        return Seen(offset, self.entry_id, self.log_id, self.epoch, self.writer, self.genesis,
                    self.part, self.body_payload)


class Claim(_Entry):
    """A writer takes the log: accepted by every replica if its epoch is higher than the
    current one (its writer is then the only one whose batches are applied)."""

    kind: Literal["claim"] = "claim"
    changes: None = None
    """Written as null, as every release did."""


class Batch(_Entry):
    """One committed batch: applied if its epoch and writer are the current ones, skipped
    (fenced) by every replica otherwise."""

    kind: Literal["batch"] = "batch"
    changes: ChangeSet
    """The writes, checked against the ledger's schema as they are read."""


class SnapshotPart(_Entry):
    """One part of a snapshot: applies nothing; a whole run of parts right after their as-of
    entry is a snapshot (:class:`~allocator.ledger.log_snapshot.SnapshotAssembly`)."""

    kind: Literal["snapshot"] = "snapshot"
    changes: None = None
    snapshot: PartHeader
    payload: bytes = Field(default=b"", exclude=True, repr=False)
    """The part's tables (:func:`allocator.ledger.log_snapshot.encode_parts`): after the JSON in
    the body, never inside it."""

    @property
    def part(self) -> PartHeader:
        """The header: which part, of which snapshot, as of which entry."""
        return self.snapshot

    @property
    def body_payload(self) -> bytes:
        """The part's tables."""
        return self.payload


Entry = Claim | Batch | SnapshotPart

_ENTRY: TypeAdapter[Entry] = TypeAdapter(
    Annotated[Entry, Field(discriminator="kind")])


def decode_entry(body: bytes) -> Entry:
    """The entry in a message body of the log; :class:`BrokenEntry` if it holds none."""
    head, _, payload = body.partition(b"\n")  # JSON text holds no raw newline
    try:
        data: Any = json.loads(head)
    except (ValueError, RecursionError) as exc:
        raise BrokenEntry(f"a ledger log entry that is not JSON: {exc}") from None
    version = data.get("v") if isinstance(data, dict) else None
    kind = data.get("kind") if isinstance(data, dict) else None
    if type(version) is not int or version != ENTRY_VERSION or kind not in KINDS:
        raise BrokenEntry(f"not a ledger log entry of version {ENTRY_VERSION}")
    if kind == "snapshot":
        data["payload"] = payload
    try:
        return _ENTRY.validate_python(data, strict=True)
    except ValidationError as exc:
        raise BrokenEntry(f"a broken ledger log {kind} entry: {describe(exc)}") from None
