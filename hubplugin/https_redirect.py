"""Plain HTTP to the hub, answered with a 301 to the same path over HTTPS.

JupyterHub's proxy serves one port, TLS or not, and has no redirect of its own. This is a
Tornado server of a few lines on a port of its own, started by the hub's configuration file
(``compose/jupyterhub_config.py``) on the hub's own event loop: it lives and dies with the
hub process, and a port that is taken stops the hub at its start rather than leaving it
without a redirect. It answers every method and path with ``301 Location:
https://<Host><path>`` (:func:`hubplugin.https.redirect_location`), and 400 to a request
whose Host is no host. It reads no cookie and serves nothing else.
"""

from __future__ import annotations

import asyncio
import logging

from tornado.httpserver import HTTPServer
from tornado.web import Application, HTTPError, RequestHandler

from .https import redirect_location

__all__ = ["serve_redirect"]

log = logging.getLogger("JupyterHub")


class _RedirectHandler(RequestHandler):
    """Every request: 301 to HTTPS, before any method handler runs."""

    SUPPORTED_METHODS = ("GET", "HEAD", "POST", "DELETE", "PATCH", "PUT", "OPTIONS")

    def initialize(self, https_port: int) -> None:
        self._https_port = https_port

    def prepare(self) -> None:
        request = self.request
        location = redirect_location(request.headers.get("Host"), request.uri or "/",
                                     self._https_port)
        if location is None:
            raise HTTPError(400, "no valid Host header")
        # redirect() finishes the response, so no method handler runs after prepare()
        self.redirect(location, permanent=True)


def serve_redirect(port: int, https_port: int, address: str = "") -> HTTPServer | None:
    """Listen on ``address:port`` (``""``: every address) on the running event loop, the
    hub's, and answer plain HTTP with a redirect to ``https_port``; the server. Outside a
    running loop (a JupyterHub subcommand that only reads the configuration), nothing is
    started: None."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return None
    app = Application([(r".*", _RedirectHandler, {"https_port": https_port})])
    server = HTTPServer(app, no_keep_alive=True)
    server.listen(port, address)
    log.info("Redirecting plain HTTP on %s:%d to HTTPS on port %d", address or "*", port,
             https_port)
    return server
