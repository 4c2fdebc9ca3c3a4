"""The shipped RabbitMQ definitions loaded into a real broker, and publishing as one of their
users."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import aio_pika

from allocator.config import AllocatorSettings
from allocator.wire.protocol import (
    encode,
)
from tests.support import services
from tests.support.common import GTX1070, gpus, heartbeat

COMPOSE = Path(__file__).resolve().parents[2] / "compose"


def load_renderer() -> ModuleType:
    spec = importlib.util.spec_from_file_location("render_definitions",
                                                  COMPOSE / "render_definitions.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


render_definitions = load_renderer()


TEMPLATE = json.loads((COMPOSE / "rabbitmq-definitions.json").read_text())


@dataclass
class Broker:
    """The loaded definitions: URLs per user and the settings of an allocator among them."""

    rabbitmq: services.RabbitMQ
    vhost: str
    prefix: str
    passwords: dict[str, str]

    def url(self, user: str) -> str:
        name = self.prefix + user
        return (f"amqp://{urllib.parse.quote(name, safe='')}:{self.passwords[user]}@"
                f"{self.rabbitmq.host}:{self.rabbitmq.port}/"
                f"{urllib.parse.quote(self.vhost, safe='')}")

    def settings(self, ledger: Path) -> AllocatorSettings:
        return AllocatorSettings(
            amqp_url=self.url("allocator"), ledger_path=ledger, allow_any_node_user=False,
            node_user_template=self.prefix + "agent-{host}",
            admin_users=[self.prefix + "admin"], tick_s=0.1)


def load(rabbitmq: services.RabbitMQ, template: dict, vhost: str, prefix: str,
         passwords: dict[str, str]) -> None:
    definitions = render_definitions.render(template, passwords=passwords,
                                            agents=["gpu-a", "gpu-b"], vhost=vhost,
                                            user_prefix=prefix)
    rabbitmq.api("POST", "/api/definitions", definitions)
    deadline = time.monotonic() + 30
    while True:
        info = rabbitmq.api("GET", f"/api/vhosts/{urllib.parse.quote(vhost, safe='')}")
        states = (info or {}).get("cluster_state") or {}
        if states and all(state == "running" for state in states.values()):
            return
        assert time.monotonic() < deadline, f"vhost {vhost} not running: {states}"
        time.sleep(0.05)


SHIPPED_USERS = ("admin", "allocator", "hub", "agent-gpu-a", "agent-gpu-b")
"""The broker users of the committed definitions, with two agents."""


@contextlib.contextmanager
def loaded_broker(rabbitmq: services.RabbitMQ, template: dict, name: str,
                  users: Iterable[str] = SHIPPED_USERS) -> Iterator[Broker]:
    """``template`` loaded under a vhost and user names of this test's own (``name`` tells
    the vhost apart), each user with a fresh password; all of it deleted afterwards."""
    tag = uuid.uuid4().hex[:8]
    vhost = f"{services.VHOST_PREFIX}{os.getpid()}-{name}-{tag}"
    prefix = f"t{tag}-"
    passwords = {user: uuid.uuid4().hex for user in users}
    try:
        load(rabbitmq, template, vhost, prefix, passwords)
        yield Broker(rabbitmq, vhost, prefix, passwords)
    finally:
        services.delete_vhost(rabbitmq, vhost)
        rabbitmq.api("POST", "/api/users/bulk-delete",
                     {"users": [prefix + user for user in passwords]})


async def publish(url: str, exchange: str, routing_key: str, body: bytes, *,
                  user_id: str | None = None) -> None:
    """Publish once with publisher confirms, so a refusal surfaces here as an exception."""
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        target = await channel.get_exchange(exchange, ensure=False)
        await target.publish(aio_pika.Message(body, user_id=user_id), routing_key=routing_key,
                             timeout=10)


def agent_beat(host: str, **kwargs) -> bytes:
    return encode(heartbeat(host, gpus(host, GTX1070, 2), **kwargs))
