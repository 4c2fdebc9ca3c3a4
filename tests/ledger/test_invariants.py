"""The invariant checker: silent on sound ledgers, and finds each kind of damage on purpose.

Damaged ledgers are written row by row with sqlite3 into a real ledger schema (created by
:class:`allocator.ledger.store.Ledger`), since the allocator itself must never produce them. The
sound ones include a ledger written by the real allocator over the real broker.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from allocator.ledger.invariants import NodeReport, Violation, check_ledger
from allocator.ledger.readonly import open_readonly
from allocator.ledger.store import Ledger
from allocator.wire.protocol import AllocateRequest, ContainerAction, LeaseState, ShareRequest
from tests.support.common import GTX1070, RTX3090, gpus, wait_until

NOW = 1_700_000_000.0


# ----------------------------------------------------------------------------- building


def add_gpu(conn: sqlite3.Connection, uuid: str, host: str = "gpu-a", *, idx: int = 0,
            model: str = GTX1070, memory: int = 8192, slots: int = 1) -> None:
    conn.execute("INSERT OR IGNORE INTO nodes (host, last_heartbeat, drained) VALUES (?, ?, 0)",
                 (host, NOW))
    conn.execute(
        "INSERT INTO gpus (uuid, host, idx, model, memory_total_mib, health, health_reasons, "
        "drained, present, share_slots, first_seen, updated_at) "
        "VALUES (?, ?, ?, ?, ?, 'healthy', '[]', 0, 1, ?, ?, ?)",
        (uuid, host, idx, model, memory, slots, NOW, NOW))


def add_lease(conn: sqlite3.Connection, lease_id: str, state: str = "bound", *,
              gpu_uuids: list[str] | None = None, host: str | None = "gpu-a",
              shared: bool = False, memory_mib: int | None = None, user: str = "alice",
              request_key: str | None = None, **columns: Any) -> None:
    holds = state in ("granted", "bound", "releasing")
    row: dict[str, Any] = {
        "lease_id": lease_id, "request_key": request_key or f"hub/{lease_id}/",
        "user": user, "groups": "[]", "state": state, "created_at": NOW, "request": "{}",
        "priority": 0, "host": host if state != "queued" else None,
        "gpu_uuids": json.dumps(gpu_uuids if gpu_uuids is not None else []),
        "model": GTX1070, "shared": int(shared), "memory_mib": memory_mib,
        "units_num": 1, "units_den": 1, "env": "{}",
        "granted_at": NOW + 1 if holds or state == "released" else None,
        "bound_at": NOW + 2 if state in ("bound", "releasing") else None,
        "container_id": f"c-{lease_id}" if state in ("bound", "releasing") else None,
        "released_at": NOW + 3 if state in ("released", "expired") else None,
        "release_reason": {"released": "container_exited",
                           "expired": "wait_expired"}.get(state),
    }
    row.update(columns)
    names = ", ".join(f'"{k}"' for k in row)
    marks = ", ".join("?" for _ in row)
    conn.execute(f"INSERT INTO leases ({names}) VALUES ({marks})", list(row.values()))


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[sqlite3.Connection]:
    """A sound small cluster: gpu-a with 2 shareable 1070s, gpu-b with one 3090.

    g0: alice exclusive (bound); g1: two slices of 2048 MiB (bob bound, carol granted);
    g3: free; plus a queued request, a released lease and an expired one.
    """
    path = tmp_path / "ledger.sqlite"
    writer = Ledger(path)
    writer.open()
    writer.close()
    conn = sqlite3.connect(path)
    add_gpu(conn, "g0", idx=0, slots=4)
    add_gpu(conn, "g1", idx=1, slots=4)
    add_gpu(conn, "g3", "gpu-b", model=RTX3090, memory=24576)
    add_lease(conn, "alice", gpu_uuids=["g0"], units_num=1, units_den=1)
    add_lease(conn, "bob", gpu_uuids=["g1"], shared=True, memory_mib=2048, user="bob",
              units_num=1, units_den=4)
    add_lease(conn, "carol", "granted", gpu_uuids=["g1"], shared=True, memory_mib=2048,
              user="carol", units_num=1, units_den=4)
    add_lease(conn, "dave", "queued", user="dave")
    add_lease(conn, "old", "released", gpu_uuids=["g0"], request_key="hub/alice/")
    add_lease(conn, "gone", "expired", host=None, request_key="hub/dave/")
    conn.commit()
    yield conn
    conn.close()


def kinds(violations: list[Violation]) -> list[str]:
    return sorted(v.kind for v in violations)


# ----------------------------------------------------------------------------- sound


def test_sound_ledger_has_no_violation(ledger):
    assert check_ledger(ledger) == []


def test_empty_ledger_has_no_violation(tmp_path):
    writer = Ledger(tmp_path / "empty.sqlite")
    writer.open()
    writer.close()
    with sqlite3.connect(tmp_path / "empty.sqlite") as conn:
        assert check_ledger(conn) == []


async def test_ledger_of_the_real_allocator_is_sound(allocator, client, nodes):
    """Grants, slices, a queue, binds and releases through the broker: the ledger stays sound,
    read while the allocator runs and again after it wrote everything."""
    await nodes.beat("gpu-a", gpus("gpu-a", GTX1070, 2))
    await nodes.beat("gpu-b", gpus("gpu-b", RTX3090, 1))
    await wait_until(lambda: _nodes_up(client, 2))
    whole = await client.allocate(AllocateRequest(request_key="h/a/", user="a", model="3090"))
    slices = [await client.allocate(AllocateRequest(
        request_key=f"h/s{i}/", user=f"s{i}", model="1070", share=ShareRequest(memory_mib=2048)))
        for i in range(5)]
    queued = await client.allocate(AllocateRequest(request_key="h/q/", user="q", model="3090",
                                                   wait_s=30))
    assert queued.state is LeaseState.QUEUED
    await nodes.event("gpu-b", whole.lease_id, ContainerAction.START, container_id="c-a")
    await nodes.event("gpu-a", slices[0].lease_id, ContainerAction.START, container_id="c-s0")
    await wait_until(lambda: _state(client, whole.lease_id, LeaseState.BOUND))
    await client.release(lease_id=slices[1].lease_id)
    await nodes.event("gpu-b", whole.lease_id, ContainerAction.DIE, container_id="c-a")
    await wait_until(lambda: _state(client, queued.lease_id, LeaseState.GRANTED))
    conn = open_readonly(allocator.settings.ledger_path)
    try:
        assert check_ledger(conn) == []
        report = NodeReport(host="gpu-a", received_at=time.time() + 60,
                            containers={slices[0].lease_id: "c-s0"})
        assert check_ledger(conn, {"gpu-a": report}) == []
    finally:
        conn.close()


async def _nodes_up(client, count: int) -> bool:
    return sum(n.up for n in (await client.inventory()).nodes) >= count


async def _state(client, lease_id: str, state: LeaseState):
    lease = await client.status(lease_id=lease_id)
    return lease if lease.state is state else None


# ----------------------------------------------------------------------------- damaged

Damage = Callable[[sqlite3.Connection], None]


def _set(lease_id: str, **columns: Any) -> Damage:
    def damage(conn: sqlite3.Connection) -> None:
        assignments = ", ".join(f'"{k}" = ?' for k in columns)
        conn.execute(f"UPDATE leases SET {assignments} WHERE lease_id = ?",
                     [*columns.values(), lease_id])
    return damage


def _add_slices(conn: sqlite3.Connection, count: int) -> None:
    for i in range(count):
        add_lease(conn, f"s{i}", "granted", gpu_uuids=["g1"], shared=True, memory_mib=100)


DAMAGES: dict[str, tuple[Damage, str]] = {
    "two exclusive holders": (
        lambda c: add_lease(c, "eve", gpu_uuids=["g0"], user="eve"), "exclusive_conflict"),
    "exclusive and a slice": (
        lambda c: add_lease(c, "eve", gpu_uuids=["g0"], shared=True, memory_mib=1024),
        "exclusive_conflict"),
    "more slices than slots": (
        lambda c: _add_slices(c, 3), "over_slots"),
    "budgets over the memory": (
        lambda c: add_lease(c, "big", "granted", gpu_uuids=["g1"], shared=True,
                            memory_mib=6000),
        "over_memory"),
    "a GPU that does not exist": (
        lambda c: add_lease(c, "ghost", gpu_uuids=["GPU-nowhere"]), "unknown_gpu"),
    "a GPU of another host": (
        lambda c: add_lease(c, "far", gpu_uuids=["g3"], host="gpu-a"), "wrong_host"),
    "an unknown state": (_set("alice", state="sleeping"), "bad_state"),
    "an unknown release reason": (_set("old", release_reason="bored"), "bad_reason"),
    "granted without GPUs": (_set("carol", gpu_uuids="[]"), "granted_without_gpus"),
    "holding without a host": (_set("alice", host=None), "granted_without_gpus"),
    "holding without a grant time": (_set("alice", granted_at=None), "granted_without_gpus"),
    "GPU list not JSON": (_set("alice", gpu_uuids="g0"), "granted_without_gpus"),
    "queued with GPUs": (_set("dave", gpu_uuids='["g3"]'), "queued_with_gpus"),
    "bound without a container": (_set("alice", container_id=None), "bound_without_container"),
    "bound without a bind time": (_set("alice", bound_at=None), "bound_without_container"),
    "released without a reason": (_set("old", release_reason=None), "released_without_reason"),
    "expired without a time": (_set("gone", released_at=None), "released_without_reason"),
    "a slice on two GPUs": (
        _set("bob", gpu_uuids='["g1", "g0"]'), "bad_share"),
    "a slice without a budget": (_set("bob", memory_mib=None), "bad_share"),
    "two active leases of one key": (
        lambda c: add_lease(c, "twin", "queued", user="alice", request_key="hub/alice/"),
        "duplicate_request_key"),
}


@pytest.mark.parametrize("damage", list(DAMAGES), ids=list(DAMAGES))
def test_each_damage_is_found(ledger, damage):
    apply, kind = DAMAGES[damage]
    apply(ledger)
    ledger.commit()
    found = check_ledger(ledger)
    assert kind in kinds(found), found
    for violation in found:
        assert violation.message and str(violation).startswith(violation.kind)


def test_violations_name_the_lease_and_gpu(ledger):
    add_lease(ledger, "eve", gpu_uuids=["g0"], user="eve")
    (violation,) = check_ledger(ledger)
    assert violation.gpu_uuid == "g0" and violation.host == "gpu-a"
    assert "alice" in violation.message and "eve" in violation.message


def test_a_released_lease_frees_its_gpu(ledger):
    """History is not a holder: a GPU held by a released lease and a new one is fine."""
    add_lease(ledger, "next", "released", gpu_uuids=["g3"], host="gpu-b")
    add_lease(ledger, "now", gpu_uuids=["g3"], host="gpu-b")
    assert check_ledger(ledger) == []


# ----------------------------------------------------------------------------- live truth


def report(host: str = "gpu-a", *, age: float = 60.0, complete: bool = True,
           **containers: str) -> dict[str, NodeReport]:
    return {host: NodeReport(host=host, received_at=NOW + 2 + age, containers=containers,
                             complete=complete)}


def test_bound_leases_match_the_reported_containers(ledger):
    assert check_ledger(ledger, report(alice="c-alice", bob="c-bob")) == []


def test_bound_lease_without_its_container(ledger):
    found = check_ledger(ledger, report(bob="c-bob"))
    assert kinds(found) == ["bound_container_missing"]
    assert found[0].lease_id == "alice"


def test_bound_lease_with_another_container(ledger):
    found = check_ledger(ledger, report(alice="c-other", bob="c-bob"))
    assert kinds(found) == ["bound_container_missing"]
    assert "c-other" in found[0].message


def test_a_fresh_bind_or_an_incomplete_report_is_not_judged(ledger):
    assert check_ledger(ledger, report(age=1.0), grace_s=5.0) == []
    assert check_ledger(ledger, report(complete=False)) == []


def test_container_of_a_released_lease_is_an_orphan(ledger):
    found = check_ledger(ledger, report(alice="c-alice", bob="c-bob", old="c-old"))
    assert kinds(found) == ["orphan_container"]
    found = check_ledger(ledger, report(alice="c-alice", bob="c-bob", nobody="c-x"))
    assert kinds(found) == ["orphan_container"]
    assert "no lease" in found[0].message


def test_one_request_key_of_two_owners_is_two_servers(ledger):
    """Request keys are each hub's own: two hubs' active leases under one key are sound,
    two of one hub's are not."""
    add_lease(ledger, "hub-a-1", "queued", request_key="shared/k/", owner="hub-a")
    add_lease(ledger, "hub-b-1", "queued", request_key="shared/k/", owner="hub-b")
    ledger.commit()
    assert check_ledger(ledger) == []
    add_lease(ledger, "hub-b-2", "queued", request_key="shared/k/", owner="hub-b")
    ledger.commit()
    assert [(v.kind, v.lease_id) for v in check_ledger(ledger)] == [
        ("duplicate_request_key", "hub-b-2")]
