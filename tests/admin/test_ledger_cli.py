"""``gpu-ledger`` as an admin runs it: a subprocess, on ledgers the real allocator wrote.

The allocator runs on the real broker (a vhost of the test's own); leases are made, bound and
released through it as hub and node agents would. The CLI then reads the ledger file while
the allocator runs (WAL: read-only readers never disturb it), after it stopped, and talks to
it live over RPC. Bad input (missing, locked, newer, corrupt ledgers; an unreachable
allocator; unknown leases and hosts) must give one line on stderr, a non-zero exit, and no file.

Exact accounting (clipping, slices, groups) is checked on a hand-written ledger at the end,
where the times are known to the second.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import io
import json
import os
import shutil
import sqlite3
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from allocator.admin import reports
from allocator.amqp.client import AllocatorClient
from allocator.config import AllocatorSettings
from allocator.ledger.readonly import open_readonly
from allocator.ledger.store import Ledger
from allocator.service import AllocatorService
from allocator.wire.protocol import (
    AllocateRequest,
    ContainerAction,
    ContainerInfo,
    LeaseState,
    ReleaseReason,
    ShareRequest,
)
from tests.support.common import GTX1070, RTX3090, NodeSimulator, gpus, wait_until
from tests.support.ledger_cli import REPO, assert_one_line_error, gpu_ledger

pytestmark = pytest.mark.slow  # real processes, brokers and engines: seconds each

UNREACHABLE = "amqp://guest:guest@127.0.0.1:1/"


@dataclass
class Cluster:
    """A running allocator with a known history, and the handles to drive it."""

    service: AllocatorService
    client: AllocatorClient
    nodes: NodeSimulator
    url: str
    ledger: Path
    leases: dict[str, str]
    """name -> lease id"""
    stopped: bool = False

    async def stop(self) -> None:
        """Stop the allocator (once; the fixture's teardown calls it again)."""
        if self.stopped:
            return
        self.stopped = True
        await self.client.close()
        await self.service.stop()


@pytest.fixture
async def cluster(amqp_vhost, ledger_path):
    """gpu-a: 4x GTX 1070 (4 slots); gpu-b: 2x RTX 3090. History written through the broker:

    - alice: one 3090, bound to container c-alice (still running)
    - bob: a 2048 MiB slice of a 1070 (granted)
    - carol: two 1070s, stopped and its container died (released, container_exited)
    - dave: one 3090, force-released by an admin (released, admin)
    - erin: two 3090s, waiting (queued behind alice)
    """
    settings = AllocatorSettings(
        amqp_url=amqp_vhost.url, ledger_path=ledger_path, allow_any_node_user=True,
        admin_users=["guest"], tick_s=0.1, share_slots={GTX1070: 4},
        aliases={"1070": GTX1070, "3090": RTX3090},
        # The simulated nodes report once; on a loaded machine a test may outlast the default
        # 15 s after which a silent node stops taking new leases.
        node_down_after_s=3600,
    )
    service = AllocatorService(settings)
    await service.start()
    client = AllocatorClient(amqp_vhost.url, timeout_s=10)
    await client.connect()
    async with NodeSimulator(amqp_vhost.url) as nodes:
        await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 4))
        await nodes.beat("gpu-b", gpus("gpu-b", RTX3090, 2))

        async def both_up():
            return sum(n.up for n in (await client.inventory()).nodes) == 2
        await wait_until(both_up)

        def ask(user: str, **fields) -> AllocateRequest:
            return AllocateRequest(request_key=f"hub/{user}/", user=user,
                                   groups=["staff"] if user in ("alice", "dave") else [],
                                   **fields)

        leases = {}
        leases["alice"] = (await client.allocate(ask("alice", model="3090"))).lease_id
        leases["bob"] = (await client.allocate(
            ask("bob", model="1070", share=ShareRequest(memory_mib=2048)))).lease_id
        leases["carol"] = (await client.allocate(ask("carol", model="1070", count=2))).lease_id
        leases["dave"] = (await client.allocate(ask("dave", model="3090"))).lease_id
        queued = await client.allocate(ask("erin", model="3090", count=2, wait_s=600))
        assert queued.state is LeaseState.QUEUED
        leases["erin"] = queued.lease_id
        await nodes.event("gpu-b", leases["alice"], ContainerAction.START, container_id="c-alice")
        await nodes.event("gpu-a", leases["carol"], ContainerAction.START, container_id="c-carol")
        await wait_until(lambda: _state(client, leases["carol"], LeaseState.BOUND))
        await client.release(lease_id=leases["carol"])
        await nodes.event("gpu-a", leases["carol"], ContainerAction.DIE, container_id="c-carol")
        await client.release(lease_id=leases["dave"], force=True, reason="test")
        await wait_until(lambda: _state(client, leases["carol"], LeaseState.RELEASED))
        await wait_until(lambda: _state(client, leases["alice"], LeaseState.BOUND))
        running = Cluster(service, client, nodes, amqp_vhost.url, ledger_path, leases)
        try:
            yield running
        finally:
            await running.stop()


async def _state(client: AllocatorClient, lease_id: str, state: LeaseState):
    lease = await client.status(lease_id=lease_id)
    return lease if lease.state is state else None


# ----------------------------------------------------------------------------- status


async def test_status_from_the_ledger_while_the_allocator_runs(cluster):
    run = await gpu_ledger("status", "--ledger", cluster.ledger)
    assert run.rc == 0, run.err
    for text in ("gpu-a", "gpu-b", GTX1070, RTX3090, "alice [bound]", "bob [granted]",
                 "slice 2048 MiB", "hub/erin/", "from the ledger file"):
        assert text in run.out, (text, run.out)
    assert "carol" not in run.out and "dave" not in run.out, "released leases hold nothing"

    status = (await gpu_ledger("status", "--ledger", cluster.ledger, "--json")).json()
    assert {h["host"]: h["up"] for h in status["hosts"]} == {"gpu-a": True, "gpu-b": True}
    holders = {h["user"]: g["uuid"] for g in status["gpus"] for h in g["holders"]}
    assert set(holders) == {"alice", "bob"}
    states = sorted(g["state"] for g in status["gpus"])
    assert states.count("held") == 2 and states.count("free") == 4
    assert [q["user"] for q in status["queued"]] == ["erin"]
    assert status["queued"][0]["count"] == 2


async def test_status_live_matches_the_ledger(cluster):
    live = (await gpu_ledger("status", "--amqp", cluster.url, "--json")).json()
    offline = (await gpu_ledger("status", "--ledger", cluster.ledger, "--json")).json()
    assert live["source"] == "live" and offline["source"] == "ledger"

    def holders(status):
        return sorted((g["uuid"], h["lease_id"], h["state"]) for g in status["gpus"]
                      for h in g["holders"])
    assert holders(live) == holders(offline)
    assert [q["lease_id"] for q in live["queued"]] == [cluster.leases["erin"]]
    table = await gpu_ledger("status", "--amqp", cluster.url)
    assert table.rc == 0 and "from the live allocator" in table.out and "alice" in table.out


async def test_status_reads_the_ledger_named_in_the_environment(cluster):
    run = await gpu_ledger("status", "--json", env={"SWARM_GPU_LEDGER_PATH": str(cluster.ledger)})
    assert run.rc == 0 and run.json()["source"] == "ledger"


# ----------------------------------------------------------------------------- export


async def test_export_leases_in_every_format(cluster, tmp_path):
    await cluster.stop()
    ids = cluster.leases
    csv_run = await gpu_ledger("export", "leases", "--ledger", cluster.ledger)
    assert csv_run.rc == 0, csv_run.err
    rows = list(csv.DictReader(io.StringIO(csv_run.out)))
    by_user = {row["user"]: row for row in rows}
    assert set(by_user) == {"alice", "bob", "carol", "dave", "erin"}
    assert by_user["carol"]["state"] == "released"
    assert by_user["carol"]["release_reason"] == ReleaseReason.CONTAINER_EXITED.value
    assert by_user["dave"]["release_reason"] == "admin"
    assert "guest" in by_user["dave"]["released_by"] and by_user["dave"]["release_note"] == "test"
    assert by_user["alice"]["container_id"] == "c-alice"
    assert json.loads(by_user["carol"]["gpu_uuids"]) and by_user["bob"]["shared"] == "True"
    assert by_user["alice"]["created_at"].endswith("Z"), "times are ISO 8601 UTC"

    ndjson_run = await gpu_ledger("export", "leases", "--ledger", cluster.ledger,
                                  "--format", "ndjson", "--time-format", "epoch")
    lines = [json.loads(line) for line in ndjson_run.out.splitlines()]
    assert [line["lease_id"] for line in lines] == [row["lease_id"] for row in rows]
    assert isinstance(lines[0]["created_at"], float) and isinstance(lines[0]["gpu_uuids"], list)

    out = tmp_path / "leases.json"
    json_run = await gpu_ledger("export", "leases", "--ledger", cluster.ledger,
                                "--format", "json", "--output", out)
    assert json_run.rc == 0 and json_run.out == ""
    assert "wrote 5 rows of leases" in json_run.err
    document = json.loads(out.read_text())
    assert sorted(d["lease_id"] for d in document) == sorted(ids.values())
    assert not list(tmp_path.glob("*.partial")), "no temporary file left"


async def test_export_filters(cluster):
    await cluster.stop()

    async def users(*filters: str) -> list[str]:
        run = await gpu_ledger("export", "leases", "--ledger", cluster.ledger,
                               "--format", "ndjson", *filters)
        assert run.rc == 0, run.err
        return sorted(json.loads(line)["user"] for line in run.out.splitlines())

    assert await users("--user", "alice") == ["alice"]
    assert await users("--model", "3090") == ["alice", "dave"]
    assert await users("--model", "gtx 1070") == ["bob", "carol"]
    assert await users("--host", "gpu-a") == ["bob", "carol"]
    assert await users("--since", "2999-01-01") == ["alice", "bob", "erin"], \
        "only leases not yet ended overlap the future"
    assert await users("--until", "2000-01-01T00:00:00Z") == []
    assert await users("--until", str(time.time() + 60), "--user", "carol") == ["carol"]


async def test_export_events_and_gpus(cluster):
    await cluster.stop()
    events = await gpu_ledger("export", "events", "--ledger", cluster.ledger, "--format",
                              "ndjson")
    kinds = [json.loads(line)["kind"] for line in events.out.splitlines()]
    assert "node_joined" in kinds and "force_release" in kinds
    forced = next(json.loads(line) for line in events.out.splitlines()
                  if json.loads(line)["kind"] == "force_release")
    assert forced["detail"]["reason"] == "test" and forced["lease_id"] == cluster.leases["dave"]
    model_events = await gpu_ledger("export", "events", "--ledger", cluster.ledger, "--format",
                                    "ndjson", "--model", "3090")
    assert {json.loads(line)["kind"] for line in model_events.out.splitlines()} == \
        {"force_release"}, "node events name no GPU; the forced 3090 lease does"
    gpu_rows = list(csv.DictReader(io.StringIO(
        (await gpu_ledger("export", "gpus", "--ledger", cluster.ledger)).out)))
    assert len(gpu_rows) == 6
    assert {row["share_slots"] for row in gpu_rows if row["model"] == GTX1070} == {"4"}
    only_b = await gpu_ledger("export", "gpus", "--ledger", cluster.ledger, "--host", "gpu-b",
                              "--format", "json")
    assert [g["idx"] for g in only_b.json()] == [0, 1]


async def test_export_to_a_closed_pipe_is_not_an_error(cluster):
    await cluster.stop()
    process = await asyncio.create_subprocess_shell(
        f"{sys.executable} -m allocator.admin.ledger_cli export events --ledger {cluster.ledger} "
        "| head -c 10 >/dev/null; echo ${PIPESTATUS[0]}", executable="/bin/bash",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, cwd=REPO)
    out, err = await process.communicate()
    assert out.decode().strip() == "0", err.decode()


# ----------------------------------------------------------------------------- usage


async def test_usage_of_the_real_ledger(cluster):
    await asyncio.sleep(0.5)
    await cluster.stop()
    run = await gpu_ledger("usage", "--ledger", cluster.ledger, "--json")
    assert run.rc == 0, run.err
    hours = {(r["user"], r["model"]): r["gpu_hours"] for r in run.json()["rows"]}
    assert set(hours) == {("alice", RTX3090), ("bob", GTX1070), ("carol", GTX1070),
                          ("dave", RTX3090)}, "erin never held a GPU"
    assert hours["alice", RTX3090] > hours["dave", RTX3090] > 0, "dave was released early"
    assert hours["bob", GTX1070] < hours["alice", RTX3090], "a quarter slice counts a quarter"
    groups = (await gpu_ledger("usage", "--ledger", cluster.ledger, "--by", "group",
                               "--json")).json()
    assert {r["group"] for r in groups["rows"]} == {"staff", reports.NO_GROUP}
    table = await gpu_ledger("usage", "--ledger", cluster.ledger, "--model", "3090")
    assert table.rc == 0 and "alice" in table.out and "bob" not in table.out
    assert "total" in table.out
    export = await gpu_ledger("export", "usage", "--ledger", cluster.ledger, "--by", "host")
    assert {row["host"] for row in csv.DictReader(io.StringIO(export.out))} == \
        {"gpu-a", "gpu-b"}


def test_usage_is_clipped_and_weighted(tmp_path):
    """Hand-written ledger, times to the second (reports.usage directly)."""
    path = tmp_path / "usage.sqlite"
    writer = Ledger(path)
    writer.open()
    writer.close()
    t0 = 1_700_000_000.0
    hour = 3600.0
    rows = [
        # (lease, user, groups, gpus, shared, units, granted, released, state)
        ("x2", "ann", ["lab"], ["a0", "a1"], 0, (2, 1), t0, t0 + 2 * hour, "released"),
        ("sl", "ann", ["lab"], ["a2"], 1, (1, 4), t0, t0 + 4 * hour, "released"),
        ("run", "ben", [], ["b0"], 0, (1, 1), t0 + hour, None, "bound"),
        ("old", "ben", [], ["b0"], 0, (1, 1), t0 - 10 * hour, t0 - 9 * hour, "released"),
        ("mix", "cy", ["lab", "ops"], ["a3", "b1"], 0, (2, 1), t0, t0 + hour, "released"),
        ("never", "dee", [], [], 0, (0, 1), None, t0 + hour, "expired"),
    ]
    with sqlite3.connect(path) as conn:
        for uuid, host, gpu_model in (("a0", "h1", "M1"), ("a1", "h1", "M1"), ("a2", "h1", "M1"),
                                      ("a3", "h1", "M1"), ("b0", "h2", "M2"), ("b1", "h2", "M2")):
            conn.execute("INSERT INTO gpus (uuid, host, idx, model, memory_total_mib, present) "
                         "VALUES (?, ?, 0, ?, 8192, 1)", (uuid, host, gpu_model))
        for lease, user, groups, uuids, shared, (num, den), granted, released, state in rows:
            model = None if lease == "mix" else ("M2" if uuids and uuids[0][0] == "b" else "M1")
            conn.execute(
                "INSERT INTO leases (lease_id, request_key, user, groups, state, created_at, "
                "host, gpu_uuids, model, shared, units_num, units_den, granted_at, released_at,"
                " release_reason) VALUES (?, ?, ?, ?, ?, ?, 'h', ?, ?, ?, ?, ?, ?, ?, ?)",
                (lease, lease, user, json.dumps(groups), state, (granted or t0) - 1,
                 json.dumps(uuids), model, shared, num, den, granted, released,
                 "container_exited" if released else None))
    conn = open_readonly(path)
    window = reports.Filters(since=t0 + hour, until=t0 + 3 * hour)
    usage = {(r.key, r.model): r.gpu_hours for r in reports.usage(conn, window)}
    # x2: 2 GPUs for the 1 h left in the window; sl: 1/4 for 2 h; run: 1 GPU for 2 h (up to
    # until); mix: ended at the window's start; old and never: outside or never granted.
    assert usage == pytest.approx({("ann", "M1"): 2 * 1 + 0.25 * 2, ("ben", "M2"): 2.0})
    everything = {(r.key, r.model): r.gpu_hours
                  for r in reports.usage(conn, reports.Filters(), now=t0 + 5 * hour)}
    assert everything == pytest.approx({
        ("ann", "M1"): 2 * 2 + 0.25 * 4, ("ben", "M2"): 4.0 + 1.0,
        ("cy", "M1"): 1.0, ("cy", "M2"): 1.0})  # a lease of two models splits by GPU
    by_group = {(r.key, r.model): r.gpu_hours
                for r in reports.usage(conn, reports.Filters(), by="group", now=t0 + 5 * hour)}
    assert by_group == pytest.approx({
        ("lab", "M1"): 5.0 + 1.0, ("lab", "M2"): 1.0, ("ops", "M1"): 1.0, ("ops", "M2"): 1.0,
        (reports.NO_GROUP, "M2"): 5.0})
    only = reports.usage(conn, reports.Filters(model="m2", user="ben"), now=t0 + 5 * hour)
    assert [(r.key, r.leases) for r in only] == [("ben", 2)]
    conn.close()


# ----------------------------------------------------------------------------- admin


async def test_drain_undrain_and_release_over_rpc(cluster):
    common = ("--amqp", cluster.url, "--by", "ops-alice")
    run = await gpu_ledger("drain", "gpu-a", "--reason", "maintenance", *common)
    assert run.rc == 0 and run.out.strip() == "gpu-a drained", run
    status = (await gpu_ledger("status", "--amqp", cluster.url, "--json")).json()
    assert [h["drained"] for h in status["hosts"] if h["host"] == "gpu-a"] == [True]
    gpu = gpus("gpu-b", RTX3090, 2)[1].uuid
    run = await gpu_ledger("drain", "gpu-b", "--gpu", gpu, *common)
    assert run.rc == 0 and gpu in run.out
    assert (await gpu_ledger("undrain", "gpu-a", *common)).rc == 0
    assert (await gpu_ledger("undrain", "gpu-b", "--gpu", gpu, *common)).rc == 0

    run = await gpu_ledger("release", cluster.leases["alice"], "--force", "--reason",
                           "GPU needed for an exam", *common)
    assert run.rc == 0 and "released (admin)" in run.out, run
    lease = await cluster.client.status(lease_id=cluster.leases["alice"])
    assert lease.release_reason is ReleaseReason.ADMIN
    granted = await wait_until(lambda: _state(cluster.client, cluster.leases["erin"],
                                              LeaseState.GRANTED))
    assert granted.host == "gpu-b", "the freed 3090 went to the queue"
    await cluster.stop()
    rows = [json.loads(line) for line in (await gpu_ledger(
        "export", "events", "--ledger", cluster.ledger, "--format", "ndjson")).out.splitlines()]
    drains = [r for r in rows if r["kind"] in ("drain", "undrain")]
    assert len(drains) == 4
    assert all(r["detail"]["by"] == "ops-alice (guest)" for r in drains)
    assert drains[0]["detail"]["reason"] == "maintenance"
    lease_row = next(json.loads(line) for line in (await gpu_ledger(
        "export", "leases", "--ledger", cluster.ledger, "--format", "ndjson", "--user",
        "alice")).out.splitlines())
    assert lease_row["released_by"] == "ops-alice (guest)"
    assert lease_row["release_note"] == "GPU needed for an exam"


async def test_admin_errors_are_one_line(cluster):
    common = ("--amqp", cluster.url)
    assert_one_line_error(await gpu_ledger("drain", "gpu-z", *common), "unknown_host", "gpu-z")
    assert_one_line_error(await gpu_ledger("drain", "gpu-a", "--gpu", "GPU-nope", *common),
                          "not_found")
    assert_one_line_error(await gpu_ledger("release", "no-such-lease", "--force", "--reason",
                                           "x", *common), "not_found", "no-such-lease")
    assert_one_line_error(await gpu_ledger("release", cluster.leases["bob"], "--force", *common),
                          "--reason")
    lease = await cluster.client.status(lease_id=cluster.leases["bob"])
    assert lease.state is LeaseState.GRANTED, "a refused command changed nothing"


async def test_unreachable_allocator():
    for args in (("drain", "gpu-a"), ("undrain", "gpu-a"), ("release", "x"),
                 ("status",), ("check", "--live", "--ledger", "/nonexistent")):
        run = await gpu_ledger(*args, "--amqp", UNREACHABLE, "--timeout", "3")
        assert_one_line_error(run)
        assert "127.0.0.1:1" in run.err or "broker" in run.err, run.err


async def test_allocator_that_does_not_answer(amqp_vhost):
    """The broker answers but no allocator consumes: a timeout, said plainly."""
    run = await gpu_ledger("status", "--amqp", amqp_vhost.url, "--timeout", "1")
    assert_one_line_error(run)


# ----------------------------------------------------------------------------- check


async def test_check_passes_on_the_real_ledger_and_live(cluster):
    run = await gpu_ledger("check", "--ledger", cluster.ledger)
    assert run.rc == 0 and run.out.startswith("ok:"), run

    async def beat_until_done(check: asyncio.Task[object], on_b: list[ContainerInfo],
                              on_a: list[ContainerInfo]) -> None:
        # Until the check ends, not for a fixed time: on a loaded machine the command may take
        # longer to start listening than its listening time.
        while not check.done():
            await cluster.nodes.beat("gpu-b", containers=on_b)
            await cluster.nodes.beat("gpu-a", containers=on_a)
            await asyncio.sleep(0.2)

    alice = ContainerInfo(container_id="c-alice", lease_id=cluster.leases["alice"])
    checking = asyncio.create_task(gpu_ledger("check", "--ledger", cluster.ledger, "--live",
                                              "--amqp", cluster.url, "--listen", "2",
                                              "--grace", "0", "--json"))
    await beat_until_done(checking, [alice], [])
    run = await checking
    assert run.rc == 0, run
    assert run.json()["hosts_reported"] == ["gpu-a", "gpu-b"]

    # gpu-a still runs carol's container although her lease was released: an orphan.
    carol = ContainerInfo(container_id="c-carol", lease_id=cluster.leases["carol"])
    checking = asyncio.create_task(gpu_ledger("check", "--ledger", cluster.ledger, "--live",
                                              "--amqp", cluster.url, "--listen", "2"))
    await beat_until_done(checking, [alice], [carol])
    run = await checking
    assert run.rc == 1, run
    assert "VIOLATION orphan_container" in run.out and "c-carol" in run.out


async def test_check_reports_each_violation_and_exits_1(cluster, tmp_path):
    await cluster.stop()
    damaged = tmp_path / "damaged.sqlite"
    with sqlite3.connect(cluster.ledger) as source, sqlite3.connect(damaged) as target:
        source.backup(target)
    with sqlite3.connect(damaged) as conn:
        alice_gpu = conn.execute("SELECT gpu_uuids FROM leases WHERE user = 'alice'").fetchone()
        conn.execute("UPDATE leases SET state = 'bound', gpu_uuids = ?, container_id = NULL, "
                     "bound_at = ? WHERE user = 'dave'", (alice_gpu[0], time.time()))
    run = await gpu_ledger("check", "--ledger", damaged)
    assert run.rc == 1
    found = [line.split()[1].rstrip(":") for line in run.out.splitlines()]
    assert sorted(found) == ["bound_without_container", "exclusive_conflict"]
    assert "2 violation(s)" in run.err
    as_json = (await gpu_ledger("check", "--ledger", damaged, "--json")).json()
    assert sorted(v["kind"] for v in as_json["violations"]) == sorted(found)


# ----------------------------------------------------------------------------- bad input


async def test_missing_ledger(tmp_path):
    for command in (("status",), ("export", "leases"), ("usage",), ("check",)):
        run = await gpu_ledger(*command, "--ledger", tmp_path / "nope.sqlite")
        assert_one_line_error(run, "no ledger at")
    assert_one_line_error(await gpu_ledger("usage", env={"SWARM_GPU_LEDGER_PATH": ""}),
                          "--ledger")


async def test_corrupt_and_foreign_files(tmp_path):
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(os.urandom(8192))
    assert_one_line_error(await gpu_ledger("status", "--ledger", garbage), "corrupt")
    foreign = tmp_path / "foreign.sqlite"
    with sqlite3.connect(foreign) as conn:
        conn.execute("CREATE TABLE photos (id INTEGER)")
    assert_one_line_error(await gpu_ledger("check", "--ledger", foreign),
                          "not a swarm-gpu ledger")
    assert_one_line_error(await gpu_ledger("export", "gpus", "--ledger", tmp_path),
                          "not a file")


async def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "future.sqlite"
    writer = Ledger(path)
    writer.open()
    writer.close()
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version = 99")
    assert_one_line_error(await gpu_ledger("status", "--ledger", path), "schema version 99",
                          "upgrade")


async def test_damaged_pages_fail_the_export_and_leave_no_file(cluster, tmp_path):
    """A ledger whose table pages are overwritten: the error surfaces mid-stream; the output
    file never appears (it is written under a temporary name and renamed when complete)."""
    for i in range(200):
        lease = await cluster.client.allocate(AllocateRequest(
            request_key=f"hub/bulk{i}/", user=f"u{i}", model="1070",
            share=ShareRequest(memory_mib=1)))
        await cluster.client.release(lease_id=lease.lease_id, force=True, reason="bulk")
    await cluster.stop()
    damaged = tmp_path / "damaged.sqlite"
    data = bytearray(cluster.ledger.read_bytes())
    page = 4096
    assert len(data) > 12 * page
    for offset in range(6 * page, len(data) - page, 3 * page):
        data[offset + 8:offset + page] = os.urandom(page - 8)
    damaged.write_bytes(bytes(data))
    out = tmp_path / "out.csv"
    run = await gpu_ledger("export", "leases", "--ledger", damaged, "--output", out)
    assert_one_line_error(run)
    assert not out.exists() and not list(tmp_path.glob("*.partial"))


async def test_locked_ledger(tmp_path):
    path = tmp_path / "locked.sqlite"
    writer = Ledger(path)
    writer.open()
    writer.close()
    holder = sqlite3.connect(path)
    try:
        # An exclusive lock (what a backup tool or a non-WAL writer may hold); the allocator's
        # WAL mode never blocks readers like this.
        holder.execute("PRAGMA locking_mode = EXCLUSIVE")
        holder.execute("BEGIN EXCLUSIVE")
        holder.execute("INSERT INTO events (at, kind) VALUES (1, 'lock')")
        holder.commit()
        run = await gpu_ledger("export", "events", "--ledger", path, "--busy-timeout", "0.2",
                               "--output", tmp_path / "events.csv")
        assert_one_line_error(run, "locked")
        assert not (tmp_path / "events.csv").exists()
    finally:
        holder.close()
    assert (await gpu_ledger("export", "events", "--ledger", path)).rc == 0


async def test_bad_arguments(tmp_path):
    path = tmp_path / "l.sqlite"
    writer = Ledger(path)
    writer.open()
    writer.close()
    run = await gpu_ledger("export", "leases", "--ledger", path, "--since", "yesterday-ish")
    assert run.rc == 2 and "neither epoch seconds nor an ISO 8601" in run.err
    run = await gpu_ledger("usage", "--ledger", path, "--since", "2024-02-01",
                           "--until", "2024-01-01")
    assert_one_line_error(run, "--since must be before --until")
    run = await gpu_ledger("export", "leases", "--ledger", path, "--output",
                           tmp_path / "no-dir" / "x.csv")
    assert_one_line_error(run, "no-dir")
    run = await gpu_ledger("status", "--ledger", path, "--amqp", UNREACHABLE)
    assert run.rc == 2 and "not allowed with" in run.err


# ----------------------------------------------------------------------------- backup


async def test_backup_while_the_allocator_runs(cluster, tmp_path):
    """docs/operations.md: VACUUM INTO (and .backup) of the live ledger give a sound copy."""
    backups = {"vacuum": tmp_path / "vacuum.sqlite", "backup": tmp_path / "backup.sqlite"}
    if shutil.which("sqlite3"):  # the sqlite3 shell, as the docs (and the image) use it
        commands = {"vacuum": ["sqlite3", str(cluster.ledger),
                               f"VACUUM INTO '{backups['vacuum']}'"],
                    "backup": ["sqlite3", str(cluster.ledger), f".backup '{backups['backup']}'"]}
    else:  # the same two operations through Python's sqlite3 module
        script = ("import sqlite3, sys; c = sqlite3.connect(sys.argv[1]); "
                  "c.execute(f\"VACUUM INTO '{sys.argv[2]}'\") if sys.argv[3] == 'vacuum' "
                  "else c.backup(sqlite3.connect(sys.argv[2]))")
        commands = {name: [sys.executable, "-c", script, str(cluster.ledger), str(path), name]
                    for name, path in backups.items()}
    writes = asyncio.create_task(_keep_allocating(cluster.client))
    try:
        for name, command in commands.items():
            process = await asyncio.create_subprocess_exec(
                *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            _, err = await process.communicate()
            assert process.returncode == 0, (name, err.decode())
    finally:
        writes.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await writes
    for path in backups.values():
        run = await gpu_ledger("check", "--ledger", path)
        assert run.rc == 0 and run.out.startswith("ok:"), run
        leases = await gpu_ledger("export", "leases", "--ledger", path, "--format", "ndjson")
        users = {json.loads(line)["user"] for line in leases.out.splitlines()}
        assert {"alice", "bob", "carol", "dave", "erin"} <= users


async def _keep_allocating(client: AllocatorClient) -> None:
    """Write to the ledger all the time (grant and force-release slices, ~40 commits/s)."""
    for i in range(100_000):
        lease = await client.allocate(AllocateRequest(
            request_key=f"hub/busy{i}/", user="busy", model="1070",
            share=ShareRequest(memory_mib=1)))
        await client.release(lease_id=lease.lease_id, force=True, reason="busy")
        await asyncio.sleep(0.05)


def test_usage_counts_idle_gpu_hours_and_reclaims(tmp_path):
    """Idle GPU-hours beside used ones, and leases reclaimed or released as idle, per user."""
    path = tmp_path / "usage.sqlite"
    writer = Ledger(path)
    writer.open()
    writer.close()
    t0 = 1_700_000_000.0
    hour = 3600.0
    rows = [
        # (lease, user, gpus, granted, released, state, reason, idle_gpu_s, idle_since)
        ("a", "ann", ["g0", "g1"], t0, t0 + 4 * hour, "released", "reclaimed", 2 * hour * 2,
         None),
        ("b", "ann", ["g2"], t0, t0 + 2 * hour, "released", "idle", 0.0, t0 + hour),
        ("c", "ben", ["g3"], t0, None, "bound", None, 0.0, t0 + 3 * hour),
        ("d", "ben", ["g2"], t0 + 2 * hour, t0 + 3 * hour, "released", "container_exited",
         0.0, None),
    ]
    with sqlite3.connect(path) as conn:
        for uuid in ("g0", "g1", "g2", "g3"):
            conn.execute("INSERT INTO gpus (uuid, host, idx, model, memory_total_mib, present) "
                         "VALUES (?, 'h', 0, 'M', 8192, 1)", (uuid,))
        for lease, user, uuids, granted, released, state, reason, idle_s, since in rows:
            conn.execute(
                "INSERT INTO leases (lease_id, request_key, user, groups, state, created_at, "
                "host, gpu_uuids, model, shared, units_num, units_den, granted_at, released_at,"
                " release_reason, idle_gpu_s, idle_since) "
                "VALUES (?, ?, ?, '[]', ?, ?, 'h', ?, 'M', 0, ?, 1, ?, ?, ?, ?, ?)",
                (lease, lease, user, state, granted, json.dumps(uuids), len(uuids), granted,
                 released, reason, idle_s, since))
    conn = open_readonly(path)
    rows_out = {r.key: r for r in reports.usage(conn, reports.Filters(), now=t0 + 5 * hour)}
    # a: 8 GPU-hours, half idle; b: 2 GPU-hours, idle since its 2nd hour (a spell still open
    # at its release); c: 5 GPU-hours, idle for the last two; d: 1, busy.
    assert rows_out["ann"].gpu_hours == pytest.approx(10.0)
    assert rows_out["ann"].idle_gpu_hours == pytest.approx(4.0 + 1.0)
    assert (rows_out["ann"].reclaimed, rows_out["ann"].idle_released) == (1, 1)
    assert rows_out["ben"].gpu_hours == pytest.approx(6.0)
    assert rows_out["ben"].idle_gpu_hours == pytest.approx(2.0)
    assert (rows_out["ben"].reclaimed, rows_out["ben"].idle_released) == (0, 0)
    # A window that ends before the reclaim counts no reclaim, and clips idle by its share.
    early = {r.key: r for r in reports.usage(conn, reports.Filters(until=t0 + 2 * hour))}
    assert early["ann"].reclaimed == 0
    assert early["ann"].idle_gpu_hours == pytest.approx(4.0 * 0.5 + 1.0)
    conn.close()
