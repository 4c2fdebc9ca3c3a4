"""The HTTP endpoint of a Prometheus registry, and who may read it.

The allocator (:mod:`allocator.metrics`) and the node agent (:mod:`nodeagent.metrics`) serve
their metrics alike: :func:`serve_registry` answers ``GET /metrics`` (any path, as
``prometheus_client`` does) from a daemon thread, one thread per request.

With a token (the ``metrics_token`` setting, or ``metrics_token_file``), a request without
``Authorization: Bearer <token>`` is answered ``401 Unauthorized`` and reads nothing: the
metrics name every user, group, host and GPU, and a port is only as private as the network
it is on (docs/reliability.md, "Networks"). Prometheus sends the token with
``authorization: credentials_file:`` (compose/prometheus/prometheus.yml). Without a token
anyone who reaches the port reads the metrics, as in 0.1.0; :func:`serve_registry` then logs
a warning unless the address is a loopback one.

It imports prometheus_client, pydantic(-settings), :mod:`allocator.settings_files` and the
standard library.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.registry import Collector
from pydantic import Field
from pydantic_settings import BaseSettings

from allocator.settings_files import secret_file_field

__all__ = ["TOKEN_REALM", "MetricsServer", "MetricsTokenSettings", "serve_registry", "token_guard"]

log = logging.getLogger(__name__)

TOKEN_REALM = "swarm-gpu metrics"
"""The realm a 401 names in its ``WWW-Authenticate: Bearer`` header."""

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def token_guard(app: WsgiApp, token: str) -> WsgiApp:
    """``app``, answering only requests that carry ``Authorization: Bearer <token>``.

    Anything else gets 401 with a one-line reason and nothing of ``app``. The comparison
    takes the same time whatever the token sent, so the answer's timing does not give the
    token away a byte at a time.
    """
    expected = f"Bearer {token}".encode()

    def guarded(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        sent = environ.get("HTTP_AUTHORIZATION")
        if sent is not None and hmac.compare_digest(sent.encode("latin-1"), expected):
            return app(environ, start_response)
        if sent is None:
            reason = "the metrics need a token: send Authorization: Bearer <metrics_token>"
        else:
            reason = "wrong metrics token"
        start_response("401 Unauthorized", [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("WWW-Authenticate", f'Bearer realm="{TOKEN_REALM}"'),
        ])
        return [reason.encode() + b"\n"]

    return guarded


class MetricsTokenSettings(BaseSettings):
    """The token of a process's metrics port, one setting for every process that serves
    metrics (allocator, node agent): its settings class takes it from here."""

    metrics_token: str | None = Field(
        default=None, min_length=16, repr=False,
        description="A token Prometheus must send (Authorization: Bearer <token>) to read "
        "the metrics; any other request is answered 401. None: whoever reaches the metrics "
        "port reads them (they name every user, group, host and GPU). Prefer "
        "metrics_token_file.",
    )
    metrics_token_file: Path | None = secret_file_field("metrics_token")


class _Quiet(WSGIRequestHandler):
    """Logs no line per request (Prometheus scrapes every few seconds)."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    """One thread per request, so a slow scrape does not hold up the next one; the threads
    are daemons, so a stuck request does not keep the process alive."""

    daemon_threads = True


@dataclass
class MetricsServer:
    """A running metrics endpoint; :meth:`close` stops it."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        """The port it listens on (useful when started on port 0)."""
        return int(self.server.server_address[1])

    def close(self) -> None:
        """Stop serving and free the port."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return addr == "localhost"


def serve_registry(registry: Collector, port: int, addr: str,
                   token: str | None) -> MetricsServer:
    """Serve ``registry`` on ``addr:port`` from a daemon thread; with ``token``, only to
    requests that carry it (:func:`token_guard`).

    Raises :class:`OSError` when the port cannot be bound.
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(
        addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

    class Server(_ThreadingServer):
        address_family = family

    app: WsgiApp = make_wsgi_app(registry)
    if token is not None:
        app = token_guard(app, token)
    elif not _is_loopback(addr):
        log.warning("metrics on %s:%d without a token: whoever reaches the port reads them "
                    "(set metrics_token_file)", addr, port)
    server = make_server(str(sockaddr[0]), port, app, Server, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return MetricsServer(server, thread)
