"""The replicated ledger log on the real broker, with real SQLite ledgers: epochs fence a
deposed writer, every replica's ledger is the same history, and a ledger that is not the log's
history is refused. (Whole allocator processes: tests/faults/test_fault_ledger_log.py.)"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aio_pika
import pytest

from allocator.ledger.change_set import ChangeSet
from allocator.ledger.log_entries import Batch
from allocator.ledger.replication import LogFenced, LogMismatch, LogUnavailable
from allocator.ledger.store import Ledger
from tests.support.common import wait_until
from tests.support.ledger_log import STREAM, batch, lease_ids, replica


async def test_a_deposed_writer_is_fenced_and_every_replica_has_one_history(
        amqp_vhost, tmp_path: Path) -> None:
    url = amqp_vhost.url
    async with (replica(url, tmp_path / "a.sqlite") as a,
                replica(url, tmp_path / "b.sqlite") as b,
                replica(url, tmp_path / "c.sqlite") as c):
        assert await a.claim() is True  # the log's first entry
        await a.append(batch("from-a-1"))

        async def b_read_both() -> bool:
            return b.position is not None and b.position.offset == 1
        await wait_until(b_read_both, within=10)
        assert await b.claim() is False  # b takes over (a is still running: two "actives")
        await b.append(batch("from-b-1"))
        # a has read b's claim: it knows it is deposed and writes nothing.
        with pytest.raises(LogFenced):
            await a.append(batch("from-a-refused"))
        assert not a.is_writer and b.is_writer
        # A write a made before it saw b's claim, arriving after it: what a deposed writer's
        # in-flight append looks like on the stream. Every replica skips it.
        assert a.position is not None
        late = Batch(log_id=a.position.log_id, entry_id="late-entry", epoch=1,
                     writer=a.writer_id, changes=ChangeSet.of(batch("from-a-late")))
        connection = await aio_pika.connect(url, timeout=10)
        async with connection:
            channel = await connection.channel()
            await channel.default_exchange.publish(aio_pika.Message(body=late.encode()),
                                                   routing_key=STREAM)
        await b.append(batch("from-b-2"))

        async def caught_up() -> bool:
            return all(r.position is not None and b.position is not None
                       and r.position.offset == b.position.offset for r in (a, c))
        await wait_until(caught_up, within=10)
    histories = {name: lease_ids(tmp_path / f"{name}.sqlite") for name in "abc"}
    assert histories == {name: ["from-a-1", "from-b-1", "from-b-2"] for name in "abc"}
    assert (a.entries_fenced, b.entries_fenced, c.entries_fenced) == (1, 1, 1)


async def test_a_ledger_that_is_not_the_logs_history_is_refused(amqp_vhost,
                                                                tmp_path: Path) -> None:
    url = amqp_vhost.url
    async with replica(url, tmp_path / "a.sqlite") as a:
        await a.claim()
        await a.append(batch("one"))
    # A ledger with data that never was part of this log (another cluster's, or one from
    # before the log was turned on).
    other = Ledger(tmp_path / "other.sqlite")
    other.open()
    other.call(lambda: other.commit(batch("someone-else")))
    other.close()
    async with replica(url, tmp_path / "other.sqlite") as stranger:
        assert await asyncio.wait_for(stranger.mismatch_event.wait(), 10) is True
        assert "not the history" in str(stranger.mismatch)
        with pytest.raises(LogMismatch):
            await stranger.claim()
    assert lease_ids(tmp_path / "other.sqlite") == ["someone-else"], "nothing applied to it"
    # An empty ledger replays the whole log; an old copy of a replica catches up.
    async with replica(url, tmp_path / "a.sqlite") as again:
        await again.claim()
        await again.append(batch("two"))
    async with replica(url, tmp_path / "fresh.sqlite") as fresh:
        async def replayed() -> bool:
            return fresh.position is not None and fresh.position.offset >= 3
        await wait_until(replayed, within=10)
        assert fresh.mismatch is None
    assert lease_ids(tmp_path / "fresh.sqlite") == ["one", "two"]


async def test_its_own_entry_arriving_after_a_drop_does_not_make_it_the_writer_again(
        amqp_vhost, tmp_path: Path) -> None:
    """A writer whose broker connection dropped with an entry in flight: the entry had landed
    and still arrives, and is applied (a decision of its epoch), but only a new claim makes
    this allocator the writer again. Taking that entry for a mandate let it decide on a memory
    that lacked the entry: one request key granted twice (the broker-cluster test)."""
    url = amqp_vhost.url
    async with replica(url, tmp_path / "a.sqlite") as a:
        await a.claim()
        await a.append(batch("before-the-drop"))
        # What the connection's close callback does when a broker node is lost.
        a._connection_lost(None, ConnectionResetError("a broker node was lost"))
        assert not a.is_writer
        assert a.position is not None
        in_flight = Batch(log_id=a.position.log_id, entry_id="in-flight-entry",
                          epoch=a.position.epoch, writer=a.writer_id,
                          changes=ChangeSet.of(batch("in-flight")))
        connection = await aio_pika.connect(url, timeout=10)
        async with connection:
            channel = await connection.channel()
            await channel.default_exchange.publish(aio_pika.Message(body=in_flight.encode()),
                                                   routing_key=STREAM)

        async def applied() -> bool:
            return a.position is not None and a.position.entry_id == "in-flight-entry"
        await wait_until(applied, within=10)
        assert not a.is_writer
        with pytest.raises(LogFenced):
            await a.append(batch("decided-on-a-stale-memory"))
        assert await a.claim() is False
        await a.append(batch("after-the-claim"))
    assert lease_ids(tmp_path / "a.sqlite") == ["after-the-claim", "before-the-drop", "in-flight"]


async def test_a_claim_accepted_after_its_wait_ended_does_not_make_a_writer(
        amqp_vhost, tmp_path: Path) -> None:
    """The claim comes back too late (the ledger thread was busy): claim() has failed, and the
    allocator has not rebuilt its engine from the ledger. The claim is accepted by the log all
    the same; this replica must still not write on it, and claims again instead."""
    url = amqp_vhost.url
    async with replica(url, tmp_path / "a.sqlite", timeout_s=0.3) as a:
        busy = asyncio.create_task(a.ledger.run(lambda: time.sleep(1.5)))
        await asyncio.sleep(0.05)  # the ledger thread is taken: nothing is applied meanwhile
        with pytest.raises(LogUnavailable):
            await a.claim()
        await busy

        async def applied() -> bool:
            return a.position is not None
        await wait_until(applied, within=10)
        assert a.position is not None and (a.position.epoch, a.position.writer) == \
            (1, a.writer_id), "the log obeys the late claim"
        assert not a.is_writer
        with pytest.raises(LogFenced):
            await a.append(batch("on-a-late-claim"))
        assert await a.claim() is False  # epoch 2, waited for
        assert a.is_writer
        await a.append(batch("after-claiming-again"))
    assert lease_ids(tmp_path / "a.sqlite") == ["after-claiming-again"]
