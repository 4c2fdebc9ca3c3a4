"""The admin is told when a booking becomes short of GPUs and when it is whole again
(allocator.engine.booking_alerts): one ``booking_short`` / ``booking_whole`` event per change
of state in a real SQLite ledger, the ``swarm_gpu_booking_short_gpus`` gauge, nothing
repeated by heartbeats, ticks or a restart. The engine and ledger are those of
tests/bookings/test_bookings_engine.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from allocator.engine import Engine
from allocator.engine.booking_alerts import RECHECK_S
from allocator.ledger.changes import Changes
from allocator.metrics import exporter as metrics
from allocator.wire.protocol import BookingReply, DrainRequest, ErrorReply
from tests.support.booking_engine import NOW, Cluster, lab
from tests.support.common import GTX1070, gpus
from tests.support.scraped import EngineOnly

LAB_START = int(NOW) + 3600
"""The lab's first occurrence: Tuesday 2026-12-01 10:00 in Berlin, an hour after NOW."""


class Watched(Cluster):
    """The cluster of tests/bookings/test_bookings_engine.py, with its ticks and what was told."""

    def tick(self, seconds: float = 1.0) -> None:
        self.now += seconds
        changes = Changes()
        self.engine.tick(self.now, changes)
        self.ledger.call(lambda: self.ledger.commit(changes))

    def beat_all(self) -> None:
        self.beat("gpu-a", gpus("gpu-a", GTX1070, 4))
        self.beat("gpu-b", gpus("gpu-b", GTX1070, 2))

    def told(self) -> list[tuple[str, dict[str, Any]]]:
        return [(kind, json.loads(detail)) for kind, detail in self.rows(
            "SELECT kind, detail FROM events WHERE kind IN ('booking_short', 'booking_whole') "
            "ORDER BY id")]

    def drain(self, host: str, drained: bool = True) -> None:
        reply = self.apply(DrainRequest(host=host, drained=drained, reason="maintenance"))
        assert not isinstance(reply, ErrorReply), reply

    def restart(self) -> None:
        self.engine = Engine(self.settings, started_at=self.now)
        self.engine.load(self.ledger.call(self.ledger.load), self.now)


def gauge(engine: Engine) -> dict[str, float]:
    """The ``swarm_gpu_booking_short_gpus`` samples of a scrape of ``engine``."""
    reading = metrics.read_scrape(EngineOnly(engine), engine.nodes.started_at)
    [family] = [f for f in metrics.metric_families(reading)
                if f.name == "swarm_gpu_booking_short_gpus"]
    return {sample.labels["booking"]: sample.value for sample in family.samples}


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Watched]:
    made = Watched(tmp_path / "ledger.sqlite")
    yield made
    made.close()


def test_a_drained_node_makes_a_booking_short_once_and_undrained_whole_again(
        cluster: Watched) -> None:
    cluster.add(lab(gpus={"model": "1070", "count": 5}))
    cluster.tick()
    assert cluster.told() == []  # whole from the start: nothing to tell
    assert gauge(cluster.engine) == {"CS101 lab": 0}

    cluster.drain("gpu-b")
    cluster.tick()
    [(kind, detail)] = cluster.told()
    assert kind == "booking_short"
    assert (detail["booking"], detail["start"], detail["gets"], detail["count"]) == (
        "CS101 lab", LAB_START, 4, 5)
    assert "1 of its 5 GPU(s)" in detail["text"]
    assert "Tue 2026-12-01 10:00 (Europe/Berlin)" in detail["text"]
    assert gauge(cluster.engine) == {"CS101 lab": 1}

    for _ in range(5):  # heartbeats and ticks that change nothing tell nothing again
        cluster.beat_all()
        cluster.tick(2.0)
    assert len(cluster.told()) == 1

    cluster.drain("gpu-b", drained=False)
    cluster.tick()
    assert [kind for kind, _ in cluster.told()] == ["booking_short", "booking_whole"]
    assert cluster.told()[1][1]["booking"] == "CS101 lab"
    assert gauge(cluster.engine) == {"CS101 lab": 0}
    cluster.beat_all()
    cluster.tick()
    assert len(cluster.told()) == 2


def test_a_lost_node_makes_a_booking_short_and_its_return_whole(cluster: Watched) -> None:
    cluster.add(lab(gpus={"model": "1070", "count": 5}))
    down_after = cluster.settings.node_down_after_s
    for _ in range(int(down_after) + 2):  # gpu-b falls silent; gpu-a keeps reporting
        cluster.beat("gpu-a", gpus("gpu-a", GTX1070, 4))
        cluster.tick(1.0)
    assert [(kind, detail["gets"]) for kind, detail in cluster.told()] == [
        ("booking_short", 4)]
    assert gauge(cluster.engine) == {"CS101 lab": 1}
    cluster.beat_all()
    cluster.tick()
    assert [kind for kind, _ in cluster.told()] == ["booking_short", "booking_whole"]


def test_heartbeats_that_change_nothing_do_not_compute_again(cluster: Watched) -> None:
    cluster.add(lab(gpus={"model": "1070", "count": 5}))
    cluster.tick()
    computed_until = cluster.engine.short_watch.recheck_at
    for _ in range(5):
        cluster.beat_all()
        cluster.tick(2.0)
    assert cluster.engine.short_watch.recheck_at == computed_until  # not computed at a later t
    cluster.drain("gpu-b")
    cluster.tick()
    assert cluster.engine.short_watch.recheck_at != computed_until


def test_a_restart_tells_nothing_twice(cluster: Watched) -> None:
    cluster.add(lab(gpus={"model": "1070", "count": 5}))
    cluster.drain("gpu-b")
    cluster.tick()
    assert len(cluster.told()) == 1
    cluster.restart()
    cluster.beat_all()
    cluster.tick()
    assert len(cluster.told()) == 1
    assert gauge(cluster.engine) == {"CS101 lab": 1}  # the state is computed again
    cluster.drain("gpu-b", drained=False)
    cluster.tick()
    cluster.restart()
    cluster.beat_all()
    cluster.tick()
    assert [kind for kind, _ in cluster.told()] == ["booking_short", "booking_whole"]


def test_a_booking_removed_and_made_again_is_told_of_anew(cluster: Watched) -> None:
    """The ledger's last word on an earlier booking of the same name is not this one's."""
    cluster.add(lab(gpus={"model": "1070", "count": 5}))
    cluster.drain("gpu-b")
    cluster.tick()
    assert isinstance(cluster.booking("remove", name="CS101 lab"), BookingReply)
    cluster.drain("gpu-b", drained=False)
    cluster.add(lab(gpus={"model": "1070", "count": 5}))
    cluster.tick()
    cluster.restart()
    cluster.beat_all()
    cluster.tick()
    assert [kind for kind, _ in cluster.told()] == ["booking_short"]


def test_a_booking_request_tells_at_once(cluster: Watched) -> None:
    """A booking added is told of in the same batch, not at the next tick; so is a booking
    another request found short."""
    cluster.add(lab(gpus={"model": "1070", "count": 5}))
    cluster.drain("gpu-b")  # no tick: not yet told
    assert cluster.told() == []
    cluster.add(lab(name="ML seminar", group="ml", gpus={"model": "1070", "count": 1},
                    window={"kind": "weekly", "weekdays": ["wed"], "start": "10:00",
                            "duration_s": 3600, "until": "2027-02-09"}))
    assert [(kind, detail["booking"]) for kind, detail in cluster.told()] == [
        ("booking_short", "CS101 lab")]
    assert gauge(cluster.engine) == {"CS101 lab": 1, "ML seminar": 0}


def test_with_no_bookings_nothing_is_computed_or_exported(cluster: Watched) -> None:
    cluster.drain("gpu-b")
    cluster.tick()
    assert cluster.engine.short_watch.recheck_at == float("inf")
    assert cluster.told() == []
    assert gauge(cluster.engine) == {}


def test_the_next_short_occurrence_is_looked_at_when_the_first_is_over(
        cluster: Watched) -> None:
    cluster.add(lab(gpus={"model": "1070", "count": 5}))
    cluster.drain("gpu-b")
    cluster.tick()
    assert cluster.engine.short_watch.recheck_at <= cluster.now + RECHECK_S
    cluster.now = LAB_START + 7200  # the first lab is over; the next Tuesday's is short
    cluster.beat_all()
    cluster.tick()
    assert cluster.engine.short_watch.states["CS101 lab"].start == LAB_START + 7 * 24 * 3600
    assert len(cluster.told()) == 1  # still short: nothing new to tell
