"""The HTTP endpoint of a Prometheus registry, and who may read it.

The allocator (:mod:`allocator.metrics.exporter`) and the node agent (:mod:`nodeagent.metrics`)
serve their metrics alike: :func:`serve_registry` answers ``GET /metrics`` (any path, as
``prometheus_client`` does) from a daemon thread, one thread per request.

With a token (the ``metrics_token`` setting, or ``metrics_token_file``), a request without
``Authorization: Bearer <token>`` is answered ``401 Unauthorized`` and reads nothing: the
metrics name every user, group, host and GPU, and a port is only as private as the network
it is on (docs/reliability.md, "Networks"). Prometheus sends the token with
``authorization: credentials_file:`` (compose/prometheus/prometheus.yml). Without a token
anyone who reaches the port reads the metrics, as in 0.1.0; :func:`serve_registry` then logs
a warning unless the address is a loopback one.

The same port answers ``GET /healthz`` (:data:`HEALTH_PATH`) from a :class:`ProcessHealth`:
``200 ok`` when the process is healthy, else ``503`` with one line per failing check. Healthy
means its event loop ran within ``health_stale_s`` (:meth:`ProcessHealth.watch_loop` stamps
the time every second or so; the HTTP thread, which keeps answering while the loop is blocked,
compares that stamp's age with the bound) and every check the process registered
(:meth:`ProcessHealth.add`, e.g. its broker connection) passes. ``/healthz`` needs no token,
on purpose: it tells only "ok" or the names of failing checks (nothing of users, hosts or
GPUs, no address or credential), and Swarm's healthcheck, a load balancer or a blackbox probe
can then ask it without holding the metrics secret. :func:`ask_health` is the client of
``gpu-allocator health`` and ``gpu-nodeagent health``.

It imports prometheus_client, pydantic(-settings), :mod:`allocator.settings_files` and the
standard library.
"""

from __future__ import annotations

import asyncio
import hmac
import http.client
import ipaddress
import logging
import socket
import threading
import time
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

__all__ = ["DEFAULT_HEALTH_STALE_S", "HEALTH_PATH", "TOKEN_REALM", "HealthSettings",
           "MetricsServer", "MetricsTokenSettings", "ProcessHealth", "ask_health",
           "health_address", "health_guard", "serve_registry", "token_guard"]

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


HEALTH_PATH = "/healthz"
"""The path of the health endpoint (any other path is the metrics)."""

DEFAULT_HEALTH_STALE_S = 15.0
"""How long the event loop may go without running before the process counts as unhealthy.
Long enough for the slowest step that legitimately holds the loop (a ledger reload, a
snapshot of a large ledger); short enough that Swarm's healthcheck finds a wedged process
within a minute with its default retries."""

Check = Callable[[], str | None]
"""A named health check: None when it passes, else what fails in a few words. It is called in
the HTTP server's thread, so it must not block and may only read what is safe to read from
another thread (a flag, a timestamp, an ``asyncio.Event``'s ``is_set()``)."""


class HealthSettings(BaseSettings):
    """The health endpoint's bound, one setting for every process that serves ``/healthz``
    (allocator, node agent): its settings class takes it from here."""

    health_stale_s: float = Field(
        default=DEFAULT_HEALTH_STALE_S, ge=0.5, le=3600,
        description="GET /healthz on the metrics port answers 503 (unhealthy) when the "
        "process's event loop has not run for this many seconds: a long synchronous call "
        "blocks it while the HTTP thread still answers. The healthcheck command (health) "
        "asks that endpoint.",
    )


class ProcessHealth:
    """What ``GET /healthz`` answers: the event loop's watchdog and the process's checks.

    The watchdog (:meth:`watch_loop`, a task on the event loop) stamps ``time.monotonic()``
    every :attr:`stamp_every_s`; :meth:`failing`, called in the HTTP thread, reports the loop
    when that stamp is older than ``stale_after_s`` (or was never made).
    """

    def __init__(self, stale_after_s: float = DEFAULT_HEALTH_STALE_S) -> None:
        if stale_after_s <= 0:
            raise ValueError("stale_after_s must be positive")
        self.stale_after_s = stale_after_s
        self.stamp_every_s = min(1.0, stale_after_s / 5)
        """Often enough that a stamp is never a large part of the bound."""
        self._stamped_at: float | None = None
        self._checks: dict[str, Check] = {}

    def add(self, name: str, check: Check) -> None:
        """Register ``check`` under ``name`` (the start of its line when it fails)."""
        if name in self._checks:
            raise ValueError(f"a health check named {name!r} is already registered")
        self._checks[name] = check

    async def watch_loop(self) -> None:
        """Stamp the time every :attr:`stamp_every_s`, until cancelled: run it as a task on
        the event loop whose health it tells."""
        while True:
            self._stamped_at = time.monotonic()
            await asyncio.sleep(self.stamp_every_s)

    def failing(self) -> list[str]:
        """One line per failing check (the event loop first); empty when healthy."""
        stamped = self._stamped_at
        lines = []
        if stamped is None:
            lines.append("event loop: not watched yet")
        else:
            age = time.monotonic() - stamped
            if age > self.stale_after_s:
                lines.append(f"event loop: has not run for {age:.1f} s "
                             f"(health_stale_s = {self.stale_after_s:g})")
        for name, check in list(self._checks.items()):
            try:
                problem = check()
            except Exception as exc:  # a broken check is a failing one, not a 500
                problem = f"check failed: {type(exc).__name__}: {exc}"
            if problem is not None:
                lines.append(f"{name}: {problem}")
        return lines


def health_guard(app: WsgiApp, health: ProcessHealth) -> WsgiApp:
    """``app``, but ``GET /healthz`` answered from ``health``: 200 ``ok``, or 503 with one
    line per failing check. Outside any token guard: see the module's docstring."""

    def routed(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("PATH_INFO") != HEALTH_PATH:
            return app(environ, start_response)
        lines = health.failing()
        status = "503 Service Unavailable" if lines else "200 OK"
        start_response(status, [("Content-Type", "text/plain; charset=utf-8"),
                                ("Cache-Control", "no-store")])
        return ["".join(f"{line}\n" for line in lines or ["ok"]).encode()]

    return routed


def health_address(addr: str) -> str:
    """Where a health command on this machine reaches a port bound to ``addr``: loopback
    for a wildcard address (``0.0.0.0``, ``::``), else ``addr`` itself."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return addr
    if ip.is_unspecified:
        return "::1" if ip.version == 6 else "127.0.0.1"
    return addr


def ask_health(addr: str, port: int, timeout_s: float = 5.0) -> str | None:
    """``GET /healthz`` from ``addr:port``: None when healthy, else what fails, in one line
    (the failing checks joined with "; ", or why nothing answered)."""
    where = f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}"
    connection = http.client.HTTPConnection(addr, port, timeout=timeout_s)
    try:
        connection.request("GET", HEALTH_PATH)
        response = connection.getresponse()
        body = response.read(64 * 1024).decode("utf-8", errors="replace")
    except ConnectionRefusedError:
        return f"nothing answers on port {port} ({where}): the process is not running, or " \
               "its metrics port is another or failed to open (see its log)"
    except TimeoutError:
        return f"no answer from {where}{HEALTH_PATH} within {timeout_s:g} s"
    except (OSError, http.client.HTTPException) as exc:
        return f"cannot ask {where}{HEALTH_PATH}: {str(exc) or type(exc).__name__}"
    finally:
        connection.close()
    lines = [line.strip() for line in body.splitlines() if line.strip()]
    if response.status == 200:
        return None
    if response.status == 503:
        return "unhealthy: " + "; ".join(lines)
    return (f"{where}{HEALTH_PATH} answered {response.status} {response.reason}, not a "
            "health answer: another program on that port, or a swarm-gpu before 0.2.0")


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
                   token: str | None, health: ProcessHealth | None = None) -> MetricsServer:
    """Serve ``registry`` on ``addr:port`` from a daemon thread; with ``token``, only to
    requests that carry it (:func:`token_guard`); with ``health``, ``GET /healthz`` too, to
    anyone (:func:`health_guard`).

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
    if health is not None:
        app = health_guard(app, health)
    server = make_server(str(sockaddr[0]), port, app, Server, handler_class=_Quiet)
    thread = threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return MetricsServer(server, thread)
