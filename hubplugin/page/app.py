"""The GPU page as a JupyterHub service: a small Tornado app behind the hub's OAuth.

The hub starts it (a managed service, ``compose/jupyterhub_config.py``) and routes
``/services/gpu/`` to it. Every view is :class:`~jupyterhub.services.auth.HubOAuthenticated`:
a browser without the hub's login is sent to the hub's login and back; the hub tells the page
who the user is, whether they are an admin and their groups (the ``identify`` scopes every
OAuth token has). The page asks the allocator itself (``inventory`` with leases, over the
broker, with the hub's broker user) and keeps its own usage history
(:mod:`hubplugin.page.history`), sampled every ``sample_interval_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from typing import Any
from urllib.parse import urlparse

from jupyterhub.services.auth import HubOAuthCallbackHandler, HubOAuthenticated
from jupyterhub.utils import url_path_join
from tornado import web
from tornado.httpserver import HTTPServer

from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.tasks import cancel_and_wait
from allocator.wire.protocol import InventoryReply

from ..templating import template
from .history import UsageHistory
from .settings import PageSettings
from .view import Viewer, Window, page_context, samples_of

log = logging.getLogger("hubplugin.page")

TEMPLATE = "gpu_page.html.j2"
"""The page's template name: an admin's file of this name replaces the packaged one."""

CONTENT_SECURITY_POLICY = (
    "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; "
    "frame-ancestors 'self'; form-action 'none'; base-uri 'none'"
)
"""The page loads nothing and runs no script: styles are inline, charts are inline SVG."""


class GPUPage:
    """The page's state: the allocator client, the history and the newest inventory."""

    def __init__(self, settings: PageSettings) -> None:
        self.settings = settings
        self.client = AllocatorClient(settings.amqp_url, timeout_s=settings.allocator_timeout_s,
                                      connect_timeout_s=settings.allocator_timeout_s)
        self.history = UsageHistory(settings.history_path, keep_s=settings.history_hours * 3600)
        self.latest: InventoryReply | None = None
        self.window = Window(span_s=settings.history_hours * 3600,
                             gap_s=settings.sample_interval_s * 2.5)

    async def inventory(self) -> InventoryReply:
        """The cluster now, with every active lease (raises :class:`AllocatorError`)."""
        reply = await self.client.inventory(include_leases=True)
        self.latest = reply
        return reply

    async def sample(self) -> None:
        """One sample of every lease's use into the history."""
        await self.history.record(samples_of(await self.inventory()))

    async def sample_forever(self) -> None:
        """Sample every ``sample_interval_s``; an allocator that does not answer is retried."""
        while True:
            started = time.monotonic()
            try:
                await self.sample()
            except AllocatorError as exc:
                log.warning("No usage sample: %s", exc)
            except Exception:  # a bug in one sample must not end the history
                log.exception("Usage sample failed")
            pause = self.settings.sample_interval_s - (time.monotonic() - started)
            await asyncio.sleep(max(pause, 0.0))

    def viewer(self, model: dict[str, Any]) -> Viewer:
        """Who looks, from the hub's user model: admins and members of ``admin_groups``
        see the cluster."""
        groups = set(model.get("groups") or ())
        admin = bool(model.get("admin")) or bool(groups & set(self.settings.admin_groups))
        return Viewer(name=str(model["name"]), is_admin=admin,
                      groups=tuple(sorted(str(g) for g in groups)))

    async def render(self, viewer: Viewer, hub_prefix: str) -> str:
        """The page's HTML for this viewer."""
        unavailable = None
        inventory: InventoryReply | None
        try:
            inventory = await self.inventory()
        except AllocatorError as exc:
            inventory, unavailable = self.latest, exc.message
        now = time.time()
        # only the viewer's own leases have charts
        lease_ids = [lease.lease_id for lease in (inventory.leases or [])
                     if lease.user == viewer.name] if inventory else []
        history = await self.history.points(lease_ids, since=now - self.window.span_s)
        context = page_context(inventory, viewer, history, now=now, window=self.window,
                               hub_id=self.settings.hub_id, unavailable=unavailable,
                               hub_prefix=hub_prefix)
        context["refresh_s"] = self.settings.refresh_s
        return template(TEMPLATE, self.settings.template_paths).render(context)


class PageHandler(HubOAuthenticated, web.RequestHandler):  # type: ignore[misc]
    """``GET /services/gpu/``: the page of whoever is logged in to the hub."""

    def initialize(self, page: GPUPage) -> None:
        self.page = page

    @web.authenticated
    async def get(self) -> None:
        model = self.get_current_user()
        html = await self.page.render(self.page.viewer(model), self.hub_auth.hub_prefix)
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        self.set_header("Content-Security-Policy", CONTENT_SECURITY_POLICY)
        self.set_header("X-Content-Type-Options", "nosniff")
        self.write(html)


def make_app(page: GPUPage, prefix: str) -> web.Application:
    """The Tornado application under the service's prefix (``/services/gpu/``)."""
    return web.Application(
        [
            (prefix, PageHandler, {"page": page}),
            (prefix.rstrip("/"), web.RedirectHandler, {"url": prefix}),
            (url_path_join(prefix, "oauth_callback"), HubOAuthCallbackHandler),
        ],
        # signs HubOAuth's login cookie; a new one per process only means that a browser
        # goes through the hub's (already logged in) OAuth again after a restart
        cookie_secret=secrets.token_bytes(32),
        xsrf_cookies=False,  # nothing to post: the page only reads
    )


PARENT_CHECK_S = 5.0
"""How often the page checks that the hub that started it still runs."""


async def until_parent_exits() -> None:
    """Return once the process that started this one has exited. JupyterHub starts a managed
    service in a session of its own, so a hub that dies without stopping it (killed, or an
    exit at start) would leave the page running with nobody to route to it."""
    parent = os.getppid()
    while True:
        await asyncio.sleep(PARENT_CHECK_S)
        if os.getppid() != parent:  # re-parented: the hub has exited
            break
    log.warning("The hub that started the GPU page (pid %d) is gone: stopping", parent)


async def serve(settings: PageSettings, *, url: str, prefix: str) -> None:
    """Run the page until cancelled or its hub is gone: open the history, sample, answer."""
    page = GPUPage(settings)
    await page.history.open()
    sampler = asyncio.create_task(page.sample_forever(), name="gpu-page-sampler")
    address = urlparse(url)
    server = HTTPServer(make_app(page, prefix), xheaders=True)
    server.listen(address.port or 80, address.hostname or "127.0.0.1")
    log.info("GPU page at %s%s, history in %s", url.rstrip("/"), prefix, settings.history_path)
    try:
        await until_parent_exits()
    finally:
        server.stop()
        await cancel_and_wait([sampler], within=5.0)
        with contextlib.suppress(AllocatorError):
            await page.client.close()
        await page.history.close()
