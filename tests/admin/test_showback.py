"""Showback: ``gpu-ledger usage`` (table, CSV, JSON; by user, group, model, host; prices from a
real settings file; ``--right-size``) over a real ledger file holding a scripted day, every
figure checked against values computed by hand."""

from __future__ import annotations

import csv
import io
from fractions import Fraction
from pathlib import Path

import pytest

from allocator.ledger.changes import Changes
from allocator.ledger.lease import LeaseRecord
from allocator.ledger.store import Ledger
from allocator.placement.cluster import GPU
from allocator.wire.protocol import LeaseState
from tests.support.ledger_cli import assert_one_line_error, gpu_ledger

A100 = "NVIDIA A100-SXM4-40GB"
GTX = "NVIDIA GeForce GTX 1070"
T0 = 1_709_510_400.0  # 2024-03-04T00:00:00Z
HOUR = 3600.0
DAY = ("--from", "2024-03-04T00:00:00Z", "--to", "2024-03-05T00:00:00Z")


def lease(lease_id: str, user: str, groups: tuple[str, ...], gpu: str, model: str,
          hours: tuple[float, float], *, units: Fraction = Fraction(1), budget: int | None = None,
          sm_s: float | None = None, energy_j: float | None = None, peak: int | None = None,
          idle_gpu_s: float = 0.0) -> LeaseRecord:
    granted, released = (T0 + h * HOUR for h in hours)
    return LeaseRecord(
        lease_id=lease_id, request_key=f"hub/{user}/", user=user, groups=groups,
        state=LeaseState.RELEASED, created_at=granted - 1, request={}, host=gpu[:2],
        gpu_uuids=(gpu,), model=model, shared=budget is not None, memory_mib=budget,
        units=units, granted_at=granted, bound_at=granted + 1, released_at=released,
        idle_gpu_s=idle_gpu_s, usage_since=None if sm_s is None else granted + 1,
        sm_s=sm_s, energy_j=energy_j, memory_s=None if sm_s is None else 0.0,
        peak_memory_mib=peak)


@pytest.fixture
def day(tmp_path: Path) -> Path:
    """One day: ann holds an A100 8-12 h (1 h idle, 2 h of SM time, 1 kWh, 30,000 MiB at
    most); ben half a 1070 9-11 h (a slice of 4,096 MiB whose peak was 1,000); cy half a 1070
    9-13 h on an agent that measured nothing; dee half a 1070 14-15 h (peak 3,000 of 4,096)."""
    path = tmp_path / "ledger.sqlite"
    changes = Changes()
    changes.gpu(GPU(uuid="h1-a100", host="h1", index=0, model=A100, memory_total_mib=40960),
                T0, first_seen=T0)
    changes.gpu(GPU(uuid="h2-1070", host="h2", index=0, model=GTX, memory_total_mib=8192,
                    share_slots=2), T0, first_seen=T0)
    half = Fraction(1, 2)
    for record in (
            lease("L-ann", "ann", ("lab",), "h1-a100", A100, (8, 12), sm_s=2 * HOUR,
                  energy_j=3_600_000, peak=30_000, idle_gpu_s=HOUR),
            lease("L-ben", "ben", ("lab", "ops"), "h2-1070", GTX, (9, 11), units=half,
                  budget=4096, sm_s=0.5 * HOUR, energy_j=1_800_000, peak=1000),
            lease("L-cy", "cy", (), "h2-1070", GTX, (9, 13), units=half, budget=4096),
            lease("L-dee", "dee", (), "h2-1070", GTX, (14, 15), units=half, budget=4096,
                  sm_s=0.25 * HOUR, energy_j=360_000, peak=3000)):
        changes.lease(record)
    ledger = Ledger(path)
    ledger.open()
    try:
        ledger.call(lambda: ledger.commit(changes))
    finally:
        ledger.close()
    return path


def row_cells(line: str) -> list[str]:
    """A table line's cells, without the table's rules."""
    return [cell for cell in line.split() if cell not in {"│", "┃", "|"}]


@pytest.fixture
def prices(tmp_path: Path) -> Path:
    path = tmp_path / "allocator.toml"
    path.write_text(f'price_per_kwh = 0.5\n\n[price_per_gpu_hour]\n"{A100}" = 2.0\n'
                    f'"{GTX}" = 0.4\n')
    return path


def figures(rows: list[dict[str, object]], by: str) -> dict[tuple[object, ...], tuple[object, ...]]:
    return {(row[by], row["model"]): (row["gpu_hours"], row["used_gpu_hours"],
                                      row["measured_gpu_hours"], row["idle_share"],
                                      row["kwh"], row["peak_memory_mib"], row["leases"])
            for row in rows}


async def test_the_day_by_user_with_prices(day: Path, prices: Path) -> None:
    run = await gpu_ledger("usage", "--ledger", day, *DAY, "--config", prices, "--json")
    assert run.rc == 0, run.err
    rows = run.json()["rows"]
    assert figures(rows, "user") == {
        ("ann", A100): (4.0, 2.0, 4.0, 0.25, 1.0, 30_000, 1),
        ("ben", GTX): (1.0, 0.5, 1.0, 0.0, 0.5, 1000, 1),
        ("cy", GTX): (2.0, 0.0, 0.0, 0.0, 0.0, None, 1),  # not measured: held only
        ("dee", GTX): (0.5, 0.25, 0.5, 0.0, 0.1, 3000, 1)}
    # Cost: GPU-hours at the model's price and kWh at 0.5.
    assert {row["user"]: row["cost"] for row in rows} == pytest.approx(
        {"ann": 4 * 2.0 + 1.0 * 0.5, "ben": 1 * 0.4 + 0.5 * 0.5, "cy": 2 * 0.4,
         "dee": 0.5 * 0.4 + 0.1 * 0.5})


async def test_the_day_by_model_group_and_host_without_prices(day: Path) -> None:
    by_model = await gpu_ledger("usage", "--ledger", day, *DAY, "--by", "model", "--json")
    assert by_model.rc == 0, by_model.err
    rows = by_model.json()["rows"]
    assert all("cost" not in row and "user" not in row for row in rows)
    assert {row["model"]: (row["gpu_hours"], row["used_gpu_hours"], row["kwh"],
                           row["peak_memory_mib"]) for row in rows} == {
        A100: (4.0, 2.0, 1.0, 30_000), GTX: (3.5, 0.75, 0.6, 3000)}
    by_group = (await gpu_ledger("usage", "--ledger", day, *DAY, "--by", "group",
                                 "--json")).json()["rows"]
    # ben's slice counts for both his groups.
    assert {(row["group"], row["model"]): (row["gpu_hours"], row["kwh"]) for row in by_group} \
        == {("lab", A100): (4.0, 1.0), ("lab", GTX): (1.0, 0.5), ("ops", GTX): (1.0, 0.5),
            ("(no group)", GTX): (2.5, 0.1)}
    by_host = await gpu_ledger("usage", "--ledger", day, *DAY, "--by", "host", "--format",
                               "csv")
    assert by_host.rc == 0, by_host.err
    table = list(csv.DictReader(io.StringIO(by_host.out)))
    assert {(row["host"], row["model"]): (float(row["gpu_hours"]), float(row["kwh"]))
            for row in table} == {("h1", A100): (4.0, 1.0), ("h2", GTX): (3.5, 0.6)}


async def test_a_period_that_clips_leases_counts_their_share(day: Path) -> None:
    """10:00 to 10:30: half an hour of ann's four (an eighth of her measured usage) and of
    ben's two (a quarter of his)."""
    run = await gpu_ledger("usage", "--ledger", day, "--from", "2024-03-04T10:00:00Z",
                           "--to", "2024-03-04T10:30:00Z", "--json")
    assert run.rc == 0, run.err
    assert figures(run.json()["rows"], "user") == {
        ("ann", A100): (0.5, 0.25, 0.5, 0.25, 0.125, 30_000, 1),
        ("ben", GTX): (0.25, 0.125, 0.25, 0.0, 0.125, 1000, 1),
        ("cy", GTX): (0.25, 0.0, 0.0, 0.0, 0.0, None, 1)}


async def test_the_table_and_the_right_size_suggestions(day: Path, prices: Path) -> None:
    table = await gpu_ledger("usage", "--ledger", day, *DAY, "--config", prices)
    assert table.rc == 0, table.err
    rows = {cells[0]: cells for cells in map(row_cells, table.out.splitlines()) if cells}
    assert rows["ann"][-7:] == ["4.00", "2.00", "25%", "1.00", "30000", "1", "8.50"]
    assert rows["cy"][-7:] == ["2.00", "-", "0%", "-", "-", "1", "0.80"], "not measured"
    # Idle: ann's 1 h of 7.5 h held; cost 8.50 + 0.65 + 0.80 + 0.25.
    assert rows["total"][1:] == ["7.50", "2.75", "13%", "1.60", "4", "10.20"]
    suggested = await gpu_ledger("usage", "--ledger", day, *DAY, "--right-size", "--json")
    assert suggested.rc == 0, suggested.err
    # Only ben's slice stayed under half its budget (1,000 of 4,096 MiB); 1,000 MiB and a
    # quarter more, in steps of 512 MiB: 1,536. dee's (3,000) did not; cy's is not measured.
    assert suggested.json()["slices"] == [{
        "lease_id": "L-ben", "user": "ben", "host": "h2", "model": GTX, "budget_mib": 4096,
        "peak_memory_mib": 1000, "suggested_mib": 1536}]
    listed = await gpu_ledger("usage", "--ledger", day, *DAY, "--right-size")
    assert listed.rc == 0 and "L-ben" in listed.out and "1536" in listed.out
    assert "L-dee" not in listed.out


async def test_prices_are_settings_checked_strictly(day: Path, tmp_path: Path) -> None:
    typo = tmp_path / "typo.toml"
    typo.write_text("price_per_kwhh = 0.5\n")
    assert_one_line_error(await gpu_ledger("usage", "--ledger", day, "--config", typo),
                          "price_per_kwhh", "price_per_kwh")
    negative = tmp_path / "negative.toml"
    negative.write_text(f'[price_per_gpu_hour]\n"{A100}" = -1\n')
    assert_one_line_error(await gpu_ledger("usage", "--ledger", day, "--config", negative),
                          "price_per_gpu_hour")
