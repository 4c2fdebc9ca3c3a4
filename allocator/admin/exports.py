"""Streaming writers for exports: CSV, a JSON array, and NDJSON, one row at a time.

Each writer takes the column names and an iterator of rows and writes as it reads, so memory
does not grow with the number of rows. JSON is written as an array whose elements are emitted
one by one (``[`` first, ``]`` last), which any JSON reader accepts and which needs no buffer.

:func:`atomic_output` writes a file under a temporary name and renames it into place only when
the export finished: a failed export (a corrupt ledger page, a full disk) leaves nothing behind
and never a half file that looks complete.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, TextIO

Format = Literal["csv", "json", "ndjson"]
FORMATS: tuple[Format, ...] = ("csv", "json", "ndjson")

ProgressCallback = Callable[[int], None]
"""Called with the number of rows written since the last call."""

PROGRESS_EVERY = 10_000
"""Rows between two progress callbacks (a callback per row would cost more than the row)."""


def _json_default(value: Any) -> Any:
    # Rows hold only SQLite scalars and decoded JSON; anything else is shown, not refused.
    return str(value)


FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
"""What a spreadsheet takes a cell for a formula by when the cell starts with it (OWASP, "CSV
Injection"): a user name such as ``=HYPERLINK(...)`` would run when an admin opens the
export."""


def csv_cell(value: Any) -> Any:
    """``value`` as a CSV cell that no spreadsheet runs as a formula: text that starts with
    one of :data:`FORMULA_STARTS` gets a ``'`` in front (OWASP's advice; the spreadsheet
    shows the text as it was), anything else is left as it is. Only text: a number, a
    negative one included, stays a number."""
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def write_csv(out: TextIO, names: Sequence[str], rows: Iterable[Sequence[Any]],
              progress: ProgressCallback | None = None) -> int:
    """CSV with a header row. Lists and objects stay as their JSON text; None is empty; every
    cell passes through :func:`csv_cell`."""
    writer = csv.writer(_RowsEndInNewline(out), lineterminator="\r\n")
    writer.writerow([csv_cell(name) for name in names])

    def write_row(row: Sequence[Any]) -> None:
        writer.writerow(map(csv_cell, row))

    return _counted(rows, write_row, progress)


class _RowsEndInNewline:
    """A file for :class:`csv.writer` whose rows end in ``\\r\\n``, written with ``\\n``.

    Why: the csv module quotes a cell with a carriage return only when its line terminator
    holds one; with ``\\n`` alone a user name with a CR came out bare, and split its row in
    two for every reader. Each row is one ``write`` call, so its last two characters are the
    terminator."""

    def __init__(self, out: TextIO) -> None:
        self._out = out

    def write(self, row: str) -> int:
        return self._out.write(row[:-2] + "\n" if row.endswith("\r\n") else row)


def write_ndjson(out: TextIO, names: Sequence[str], rows: Iterable[Sequence[Any]],
                 progress: ProgressCallback | None = None) -> int:
    """One JSON object per line."""
    dumps = json.JSONEncoder(ensure_ascii=False, default=_json_default,
                             separators=(",", ":")).encode
    keys = list(names)

    def write(row: Sequence[Any]) -> None:
        out.write(dumps(dict(zip(keys, row, strict=True))))
        out.write("\n")

    return _counted(rows, write, progress)


def write_json(out: TextIO, names: Sequence[str], rows: Iterable[Sequence[Any]],
               progress: ProgressCallback | None = None) -> int:
    """A JSON array of objects, streamed element by element."""
    dumps = json.JSONEncoder(ensure_ascii=False, default=_json_default,
                             separators=(",", ":")).encode
    keys = list(names)
    first = True

    def write(row: Sequence[Any]) -> None:
        nonlocal first
        out.write("[\n" if first else ",\n")
        first = False
        out.write(dumps(dict(zip(keys, row, strict=True))))

    count = _counted(rows, write, progress)
    out.write("[]\n" if first else "\n]\n")
    return count


WRITERS: dict[Format, Callable[[TextIO, Sequence[str], Iterable[Sequence[Any]],
                                ProgressCallback | None], int]] = {
    "csv": write_csv, "json": write_json, "ndjson": write_ndjson,
}


def write(out: TextIO, fmt: Format, names: Sequence[str], rows: Iterable[Sequence[Any]],
          progress: ProgressCallback | None = None) -> int:
    """Write rows in ``fmt``; returns how many rows were written."""
    return WRITERS[fmt](out, names, rows, progress)


def _counted(rows: Iterable[Sequence[Any]], write_row: Callable[[Sequence[Any]], Any],
             progress: ProgressCallback | None) -> int:
    count = 0
    if progress is None:
        for row in rows:
            write_row(row)
            count += 1
        return count
    pending = 0
    for row in rows:
        write_row(row)
        count += 1
        pending += 1
        if pending >= PROGRESS_EVERY:
            progress(pending)
            pending = 0
    if pending:
        progress(pending)
    return count


@contextlib.contextmanager
def atomic_output(path: str | Path) -> Iterator[TextIO]:
    """A text file that appears at ``path`` only if the block finishes without an error."""
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    if not directory.is_dir():
        raise FileNotFoundError(f"no directory {directory} for the output file {target}")
    fd, temp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".partial",
                                     dir=directory)
    try:
        # newline="" so the csv module's own line endings are written as they are.
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp_name, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp_name)
        raise
