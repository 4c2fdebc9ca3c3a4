"""One engine over one host, a clock the test moves and its heartbeats: bookings' windows
opening and closing."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from allocator.config import AllocatorSettings
from allocator.engine import Engine
from allocator.ledger.changes import Changes
from allocator.wire.protocol import (
    AllocateRequest,
    BookingReply,
    BookingRequest,
    ContainerAction,
    ContainerEvent,
    ContainerInfo,
    GPUInfo,
    Heartbeat,
    LeaseReply,
)
from tests.support.common import ADMIN, HUB, NODE

HOST = "gpu-a"


MODEL = "NVIDIA GeForce GTX 1070"


NINE = datetime(2026, 12, 8, 9, 0, tzinfo=UTC).timestamp()
"""09:00 UTC on the day of the tests' bookings."""


class BookedCluster:
    """One engine over one host of ``gpus`` GPUs, a clock the test moves, and heartbeats."""

    def __init__(self, tmp_path: Path, gpus: int = 2, **settings: Any) -> None:
        base: dict[str, Any] = {
            "group_quota": {"cs101": 0}, "group_borrow_limit": {"cs101": 16},
            "admin_users": ["admin"], "reclaim_grace_s": 60.0, "idle_window_s": 30.0}
        self.settings = AllocatorSettings(
            ledger_path=tmp_path / "ledger.sqlite", allow_any_node_user=True,
            start_fence_s=0, **{**base, **settings})
        self.engine = Engine(self.settings, started_at=NINE - 60)
        self.gpus = gpus
        self.now = NINE
        self.seq = 0
        self.changes = Changes()
        self.running: dict[str, ContainerInfo] = {}
        self.beat()

    def send(self, message: Any, sender: Any = HUB) -> Any:
        return self.engine.handle(message, sender, self.now, self.changes)

    def beat(self) -> None:
        self.seq += 1
        self.send(Heartbeat(
            host=HOST, agent_id="a1", seq=self.seq, sent_at=self.now, interval_s=2,
            gpus=[GPUInfo(uuid=f"GPU-{i}", index=i, model=MODEL, memory_total_mib=8192)
                  for i in range(self.gpus)],
            containers=list(self.running.values()), source="simulated"), NODE)

    def until(self, when: float, step: float = 5.0) -> None:
        """Heartbeats and ticks up to ``when``."""
        while self.now < when:
            self.now = min(self.now + step, when)
            self.beat()
            self.engine.tick(self.now, self.changes)

    def book(self, name: str = "CS101", count: int = 1, start: str = "10:00",
             end: str = "11:00", **fields: Any) -> None:
        body = {"name": name, "group": "cs101", "gpus": {"model": MODEL, "count": count},
                "zone": "UTC", "window": {"kind": "once", "start": f"2026-12-08T{start}",
                                          "end": f"2026-12-08T{end}"}, **fields}
        reply = self.send(BookingRequest(op="add", booking=body, by="prof"), ADMIN)
        assert isinstance(reply, BookingReply), reply

    def ask(self, user: str, server: str = "", member: bool = False,
            **fields: Any) -> LeaseReply:
        reply = self.send(AllocateRequest(
            request_key=f"hub/{user}/{server}", user=user,
            groups=["cs101"] if member else [], **fields))
        assert isinstance(reply, LeaseReply), reply
        return reply

    def hold(self, user: str, server: str = "", member: bool = False) -> str:
        """A bound lease of ``user``."""
        lease_id = self.ask(user, server, member).lease.lease_id
        self.start(lease_id)
        return lease_id

    def start(self, lease_id: str) -> None:
        """The lease's container starts."""
        container_id = f"c-{lease_id}"
        self.send(ContainerEvent(host=HOST, container_id=container_id, lease_id=lease_id,
                                 action=ContainerAction.START, at=self.now), NODE)
        self.running[lease_id] = ContainerInfo(container_id=container_id, lease_id=lease_id)

    def died(self, lease_id: str) -> None:
        info = self.running.pop(lease_id)
        self.send(ContainerEvent(host=HOST, container_id=info.container_id, lease_id=lease_id,
                                 action=ContainerAction.DIE, at=self.now), NODE)

    def lease(self, lease_id: str) -> Any:
        record = self.engine.find(lease_id, None)
        assert record is not None
        return self.engine.lease_reply(record).lease

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [{**row, **json.loads(row["detail"] or "{}")}
                for row in self.changes.events if row["kind"] == kind]
