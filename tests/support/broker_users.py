"""A second broker user with full rights on a test's vhost, removed afterwards."""

from __future__ import annotations

import contextlib
import urllib.parse
import uuid

from tests.support import services


@contextlib.contextmanager
def broker_user(rabbitmq: services.RabbitMQ, vhost: services.AmqpVhost):
    """A second broker user with full rights on the vhost (the other host's agent)."""
    name = f"{services.VHOST_PREFIX}agent-{uuid.uuid4().hex[:8]}"
    password = uuid.uuid4().hex
    quoted = urllib.parse.quote(name, safe="")
    rabbitmq.api("PUT", f"/api/users/{quoted}", {"password": password, "tags": ""})
    try:
        rabbitmq.api("PUT", f"/api/permissions/{urllib.parse.quote(vhost.name, safe='')}/{quoted}",
                     {"configure": ".*", "write": ".*", "read": ".*"})
        url = (f"amqp://{quoted}:{password}@{rabbitmq.host}:{rabbitmq.port}/"
               f"{urllib.parse.quote(vhost.name, safe='')}")
        yield name, url
    finally:
        with contextlib.suppress(Exception):
            rabbitmq.api("DELETE", f"/api/users/{quoted}")
