"""A batch's writes as the replicated log carries them (:class:`ChangeSet`), checked against
the ledger's schema before any SQL; pure, no SQLite."""

from __future__ import annotations

from typing import Annotated, Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from allocator.ledger.changes import LEASE_OWNERS, LEASE_USAGE_BESIDE, OWNER_COLUMN, Changes
from allocator.ledger.log_snapshot import describe
from allocator.ledger.schema import COLUMNS, JSON_COLUMNS, LEASES_V8, PRIMARY_KEYS


class BrokenChanges(ValueError):
    """A change set this ledger cannot write: a table or column its schema does not have, a
    row without its key, or a value of the wrong type. Found before any SQL is run."""


def _row_model(table: str, *, skip: tuple[str, ...] = ()) -> type[BaseModel]:
    """A strict model of one row of ``table`` in a change set, made from :data:`COLUMNS`:
    every column optional (a row may update some columns only) but its key, no other name."""
    fields: dict[str, Any] = {}
    for column, kind in COLUMNS[table].items():
        if column in skip:
            continue
        value: Any
        if column in JSON_COLUMNS.get(table, ()):
            value = list[JsonValue] | dict[str, JsonValue]
        elif kind is int:
            value = bool | int  # booleans are stored as 0 and 1
        else:
            value = kind  # strict: a float column takes an int too, a text column a string
        if column == PRIMARY_KEYS[table]:
            fields[column] = (value, Field(min_length=1))
        else:
            fields[column] = (value | None, None)
    return create_model(f"{table}_row", __config__=ConfigDict(strict=True, extra="forbid",
                                                               frozen=True), **fields)


CHANGE_TABLES = {"leases": "leases", "nodes": "nodes", "gpus": "gpus",
                  "history": "lease_history", "events": "events", "bookings": "bookings"}
"""The lists of a change set and the tables they write."""


INSERTED = ("lease_history", "events")
"""Tables a change set appends to: their rows get every column (row ids are each ledger's
own, never written)."""


_ROW_MODELS = {table: _row_model(table, skip=("id",) if table in INSERTED
                                  else (OWNER_COLUMN, *LEASES_V8) if table == "leases"
                                  else ())
               for table in CHANGE_TABLES.values()}
_USAGE_MODEL = create_model(
    "lease_usage", __config__=ConfigDict(strict=True, extra="forbid", frozen=True),
    **{column: (kind | None, None) for column, kind in LEASES_V8.items()})  # type: ignore[call-overload]


class ChangeSet(BaseModel):
    """A batch's writes as the replicated log carries them (:meth:`Changes.to_json`).

    Row keys become SQL column names, so every row is checked against :data:`COLUMNS`
    first: an unknown column is a broken entry, never SQL (a newer release's column too: a
    replica that dropped it would hold another state than the writer). Fields of the change
    set itself that this release does not know are ignored.
    """

    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    leases: list[dict[str, Any]] = []
    nodes: list[dict[str, Any]] = []
    gpus: list[dict[str, Any]] = []
    history: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    bookings: list[dict[str, Any]] = []
    """Booking rows (0.3.0); a release before it ignores them and keeps no bookings."""
    lease_owners: dict[Annotated[str, Field(min_length=1)],
                       Annotated[str, Field(min_length=1)]] = {}
    """Lease id -> its owner, for lease rows of this set (:data:`LEASE_OWNERS`); written
    only when there is one."""
    lease_usage: dict[Annotated[str, Field(min_length=1)], dict[str, Any]] = {}
    """Lease id -> its measured usage columns, for lease rows of this set
    (:data:`LEASE_USAGE_BESIDE`, 0.3.0); written only when there is some."""

    @field_validator("leases", "nodes", "gpus", "history", "events", "bookings")
    @classmethod
    def _rows_of_the_schema(cls, rows: list[dict[str, Any]],
                            info: ValidationInfo) -> list[dict[str, Any]]:
        table = CHANGE_TABLES[str(info.field_name)]
        model = _ROW_MODELS[table]
        checked = []
        for number, row in enumerate(rows):
            try:
                valid = model.model_validate(row)
            except ValidationError as exc:
                raise ValueError(f"row {number} of {table}: {describe(exc)}") from None
            # An update writes the columns given; an appended row gets every column, so that
            # each of the INSERT's named parameters is bound.
            checked.append(valid.model_dump(exclude_unset=table not in INSERTED))
        return checked

    @field_validator("lease_usage")
    @classmethod
    def _usage_of_the_schema(cls, usage: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        checked = {}
        for lease_id, columns in usage.items():
            try:
                valid = _USAGE_MODEL.model_validate(columns)
            except ValidationError as exc:
                raise ValueError(f"lease_usage of {lease_id}: {describe(exc)}") from None
            checked[lease_id] = valid.model_dump(exclude_unset=True)
        return checked

    @model_validator(mode="after")
    def _owners_of_leases_written(self) -> Self:
        written = {row["lease_id"] for row in self.leases}
        stray = sorted((set(self.lease_owners) | set(self.lease_usage)) - written)
        if stray:  # an owner alone would make a lease row of nothing but its owner
            raise ValueError(f"lease_owners or lease_usage names leases the change set does "
                             f"not write: {', '.join(stray[:5])}")
        return self

    @model_serializer(mode="wrap")
    def _owners_only_when_any(self, write: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = write(self)
        if not self.lease_owners:
            data.pop(LEASE_OWNERS, None)  # a batch without owners is written as before
        if not self.lease_usage:
            data.pop(LEASE_USAGE_BESIDE, None)
        if not self.bookings:
            data.pop("bookings", None)
        return data

    @classmethod
    def parse(cls, data: object) -> ChangeSet:
        """The change set in ``data`` (plain JSON); :class:`BrokenChanges` if it is none."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise BrokenChanges(f"a broken change set: {describe(exc)}") from None

    @classmethod
    def of(cls, changes: Changes) -> ChangeSet:
        """``changes`` checked as every replica will check them."""
        return cls.parse(changes.to_json())

    def to_changes(self) -> Changes:
        """The batch to commit."""
        owners, usage = self.lease_owners, self.lease_usage
        leases = {}
        for row in self.leases:
            key = row["lease_id"]
            if key in owners:
                row = {**row, OWNER_COLUMN: owners[key]}
            if key in usage:
                row = {**row, **usage[key]}
            leases[key] = row
        return Changes(leases=leases,
                       nodes={row["host"]: row for row in self.nodes},
                       gpus={row["uuid"]: row for row in self.gpus},
                       history=list(self.history), events=list(self.events),
                       bookings={row["name"]: row for row in self.bookings})
