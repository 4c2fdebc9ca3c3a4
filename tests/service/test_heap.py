"""The rebuilt memory kept out of the cycle collector (allocator/service/heap.py), on a real
ledger file: what a rebuild freezes, and that the state a later rebuild replaces is freed."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest

from allocator.config import AllocatorSettings
from allocator.engine import Engine
from allocator.ledger.changes import Changes
from allocator.ledger.store import Ledger
from allocator.service import heap
from allocator.service.memory import Memory
from allocator.wire.protocol import AllocateRequest, LeaseReply
from tests.support.common import HUB, NODE, RTX3090, gpus, heartbeat


@pytest.fixture
def thawed() -> Iterator[None]:
    """Whatever a test freezes is thawed after it: the test process is not an allocator."""
    try:
        yield
    finally:
        gc.unfreeze()


def ledger_with_a_lease(path: Path) -> tuple[Ledger, str]:
    """A ledger file holding one host and one granted lease, and that lease's id."""
    settings = AllocatorSettings(ledger_path=path, allow_any_node_user=True)
    engine = Engine(settings, started_at=time.time())
    changes = Changes()
    now = time.time()
    engine.handle(heartbeat("gpu-a", gpus("gpu-a", RTX3090, 2)), NODE, now, changes)
    reply = engine.handle(AllocateRequest(request_key="heap/1", user="ann"), HUB, now, changes)
    assert isinstance(reply, LeaseReply)
    ledger = Ledger(path)
    ledger.open()
    ledger.call(lambda: ledger.commit(changes))
    return ledger, reply.lease.lease_id


def tracked(obj: object) -> bool:
    """Whether a collection would walk ``obj``: frozen objects are in no generation."""
    return any(candidate is obj for candidate in gc.get_objects())


async def nothing() -> None:
    return None


async def rebuilt_memory(ledger: Ledger, *, freeze: bool) -> Engine:
    engine = Engine(AllocatorSettings(ledger_path=ledger.path, allow_any_node_user=True),
                    started_at=time.time())
    memory = Memory(ledger, engine, time.time, nothing,
                    rebuilding=heap.rebuilding if freeze else nullcontext)
    await memory.reload()
    return engine


async def test_a_rebuild_freezes_the_state_it_loaded(tmp_path: Path, thawed: None) -> None:
    ledger, lease_id = ledger_with_a_lease(tmp_path / "ledger.sqlite")
    try:
        plain = await rebuilt_memory(ledger, freeze=False)
        assert tracked(plain.leases[lease_id]), "without freezing, collections walk it"
        frozen = await rebuilt_memory(ledger, freeze=True)
        record = frozen.leases[lease_id]
        assert not tracked(record)
        assert gc.get_freeze_count() > 0
        assert tracked([record]), "what is made after the rebuild is young, walked as usual"
    finally:
        ledger.close()


async def test_a_second_rebuild_frees_the_state_it_replaces(tmp_path: Path,
                                                             thawed: None) -> None:
    ledger, lease_id = ledger_with_a_lease(tmp_path / "ledger.sqlite")
    try:
        engine = Engine(AllocatorSettings(ledger_path=ledger.path, allow_any_node_user=True),
                        started_at=time.time())
        memory = Memory(ledger, engine, time.time, nothing, rebuilding=heap.rebuilding)
        await memory.reload()
        first = engine.leases[lease_id]
        # A reference cycle through the frozen record: reference counting alone never
        # frees it, only a collection that walks it.
        first.__dict__["self_reference"] = first
        gone = weakref.ref(first)
        del first
        await memory.reload()
        assert engine.leases[lease_id] is not gone()
        assert gone() is None, "the replaced state was thawed and collected"
    finally:
        ledger.close()


class CountingEngine(Engine):
    """An engine that counts the collections Python started while it loaded its state."""

    collections_during_load = 0

    def load(self, *args: Any, **kwargs: Any) -> None:
        started: list[int] = []

        def count(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                started.append(info["generation"])

        gc.callbacks.append(count)
        try:
            super().load(*args, **kwargs)
        finally:
            gc.callbacks.remove(count)
        self.collections_during_load = len(started)


@pytest.fixture
def eager_collector() -> Iterator[None]:
    """A collection after every allocation of a tracked object, as a big load would get
    many of: without the rebuild's pause, loading even this small ledger would start some."""
    thresholds = gc.get_threshold()
    gc.set_threshold(1)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


@pytest.mark.parametrize("freeze", [True, False])
async def test_no_collection_runs_while_the_state_is_rebuilt(
        tmp_path: Path, thawed: None, eager_collector: None, freeze: bool) -> None:
    ledger, _ = ledger_with_a_lease(tmp_path / "ledger.sqlite")
    try:
        engine = CountingEngine(AllocatorSettings(ledger_path=ledger.path,
                                                  allow_any_node_user=True),
                                started_at=time.time())
        memory = Memory(ledger, engine, time.time, nothing,
                        rebuilding=heap.rebuilding if freeze else nullcontext)
        await memory.reload()
        assert gc.isenabled(), "collections run again once the rebuild is done"
        if freeze:
            assert engine.collections_during_load == 0
        else:
            assert engine.collections_during_load > 0, "the eager collector works"
    finally:
        ledger.close()
