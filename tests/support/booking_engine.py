"""An engine over a real ledger file with GPUs to book, and a weekly lab booked on it by an
admin."""

from __future__ import annotations

import sqlite3
from datetime import datetime
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

from allocator.bookings.local_time import instant_of
from allocator.config import AllocatorSettings
from allocator.engine import Engine, Sender
from allocator.ledger.changes import Changes
from allocator.ledger.store import Ledger
from allocator.wire.protocol import (
    BookingReply,
    BookingRequest,
    ErrorReply,
    Heartbeat,
)
from tests.support.common import GTX1070, gpus

BERLIN = ZoneInfo("Europe/Berlin")


NOW = float(instant_of(datetime(2026, 12, 1, 9, 0), BERLIN))  # a Tuesday, 09:00 in Berlin


UNTIL = "2027-02-09"


ADMIN = Sender(user_id="admin", via_nodes_exchange=False)


NODE = Sender(user_id="agent", via_nodes_exchange=True)


def lab(**changes: Any) -> dict[str, Any]:
    """A weekly lab: 2 GTX 1070 for cs101 on Tuesdays 10:00-12:00 in Berlin."""
    body: dict[str, Any] = {
        "name": "CS101 lab", "group": "cs101", "gpus": {"model": "1070", "count": 2},
        "zone": "Europe/Berlin",
        "window": {"kind": "weekly", "weekdays": ["tue"], "start": "10:00",
                   "duration_s": 7200, "until": UNTIL},
    }
    body.update(changes)
    return body


class Cluster:
    """An engine over a real ledger file: gpu-a with 4 GTX 1070, gpu-b with 2; each batch
    committed as the service commits it."""

    def __init__(self, path: Path, *, hosts: dict[str, list[Any]] | None = None) -> None:
        self.settings = AllocatorSettings(
            ledger_path=path, allow_any_node_user=True, admin_users=["admin"],
            group_quota={"cs101": 4, "ml": 2}, aliases={"1070": GTX1070})
        self.ledger = Ledger(path)
        self.ledger.open()
        self.engine = Engine(self.settings, started_at=NOW - 60)
        self.engine.load(self.ledger.call(self.ledger.load), NOW - 60)
        self.now = NOW
        self.seq = 0
        for host, listed in (hosts if hosts is not None else {
                "gpu-a": gpus("gpu-a", GTX1070, 4), "gpu-b": gpus("gpu-b", GTX1070, 2)}).items():
            self.beat(host, listed)

    def beat(self, host: str, listed: list[Any]) -> None:
        self.seq += 1
        self.apply(Heartbeat(host=host, agent_id=f"agent-{host}", seq=self.seq,
                             sent_at=self.now, interval_s=2.0, gpus=listed, containers=[],
                             containers_complete=True), NODE)

    def apply(self, message: Any, sender: Sender = ADMIN) -> Any:
        changes = Changes()
        reply = self.engine.handle(message, sender, self.now, changes)
        self.ledger.call(lambda: self.ledger.commit(changes))
        return reply

    def booking(self, op: str, sender: Sender = ADMIN, **fields: Any) -> Any:
        return self.apply(BookingRequest(op=op, by="prof", **fields), sender)

    def add(self, body: dict[str, Any]) -> BookingReply:
        reply = self.booking("add", booking=body)
        assert isinstance(reply, BookingReply), reply
        return reply

    def refused(self, body: dict[str, Any]) -> ErrorReply:
        reply = self.booking("add", booking=body)
        assert isinstance(reply, ErrorReply), reply
        return reply

    def rows(self, sql: str) -> list[tuple[Any, ...]]:
        conn = sqlite3.connect(self.ledger.path)
        try:
            return conn.execute(sql).fetchall()
        finally:
            conn.close()

    def close(self) -> None:
        self.ledger.close()
