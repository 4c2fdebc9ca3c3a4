"""End to end: the GPU page (``/services/gpu/``) as a real JupyterHub runs it, in Chromium.

A real hub starts the page from ``compose/jupyterhub_config.py`` as its managed service; the
page asks the real allocator over the real broker, where simulated nodes report GPUs and the
lease containers running on them (with their processes' GPU use). Users log in through the
hub's login form in headless Chromium and open the page as they would.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import signal
import time
from collections.abc import AsyncIterator
from html import unescape
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp
import pytest

from allocator.amqp.client import AllocatorClient
from allocator.wire.protocol import (
    AllocateRequest,
    GPUProcess,
    Lease,
    LeaseState,
    ProcessState,
)
from tests.support.common import GTX1070, RTX3090, started, wait_until
from tests.support.gpu_page import (
    RECLAIMS,
    SEEN,
    TEST_BUDGET_S,
    UPDATE_DOCS,
    USERS,
    Cluster,
    lease_for,
    open_page,
)
from tests.support.hub_browser import Browser
from tests.support.hub_harness import Hub

pytestmark = [pytest.mark.hub, pytest.mark.browser, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
async def allocator(amqp_vhost: Any, ledger_path: Path) -> AsyncIterator[Any]:
    """The real allocator, with guarantees: each user is guaranteed one GPU and may borrow
    one more; a reclaim warning stays pending for ten minutes."""
    from allocator.config import AllocatorSettings
    from allocator.service import AllocatorService

    async with started(AllocatorService(AllocatorSettings(
        amqp_url=amqp_vhost.url, ledger_path=ledger_path, allow_any_node_user=True,
        admin_users=["guest"], tick_s=0.1, start_fence_s=0,
        aliases={"1070": GTX1070, "3090": RTX3090},
        default_user_quota=1, default_user_borrow_limit=2, reclaim_grace_s=600))) as service:
        yield service


async def page_answers(hub: Hub) -> str:
    """Wait until the hub routes the page to a running service; the URL an anonymous
    visitor ends up at."""
    async with aiohttp.ClientSession() as session:
        async def routed() -> str | None:
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(hub.page_url) as response:
                    await response.read()
                    if response.status == 200:
                        return str(response.url)
            return None
        return await wait_until(routed, within=60, interval=0.5)


@pytest.mark.timeout(600 if UPDATE_DOCS else 300)  # the demo behind the picture takes 3 min
async def test_users_see_their_own_gpus_and_admins_every_gpu(
    cluster: Cluster, client: AllocatorClient, page_hub: Hub, chromium_path: Path,
    tmp_path: Path,
) -> None:
    async with asyncio.timeout(TEST_BUDGET_S):
        # alice: one GTX 1070 within her guarantee, busy; a second one borrowed, busy too.
        # bob: an RTX 3090 whose processes do nothing.
        alice = await lease_for(client, page_hub, "alice", "1070")
        borrowed = await lease_for(client, page_hub, "alice", "1070", server="extra")
        bob = await lease_for(client, page_hub, "bob", "3090")
        own = await lease_for(client, page_hub, "admin", "3090")
        assert (alice.borrowed, borrowed.borrowed, bob.borrowed) == (False, True, False)
        cluster.busy("gpu-a", alice.gpu_indices[0], 73.0, 3072)
        cluster.busy("gpu-a", borrowed.gpu_indices[0], 41.0, 1024)
        cluster.busy("gpu-b", bob.gpu_indices[0], 0.0, 512)
        cluster.busy("gpu-b", own.gpu_indices[0], 88.0, 18432)
        for lease in (alice, borrowed, bob, own):
            cluster.run(lease)

        # Nobody logged in: the hub's login, not the page.
        landed = await page_answers(page_hub)
        assert "/hub/login" in landed, landed


        for user in ("alice", "admin"):
            await page_hub.login_password(user)

        def drive() -> tuple[dict[str, Any], dict[str, Any]]:
            # one browser (its own cookies) per user, as two people would have
            with Browser(chromium_path, tmp_path / "chromium-alice") as browser:
                tab = open_page(browser, page_hub, "alice",
                                until="document.querySelectorAll("
                                      "'.sg-lease svg polyline.sg-util').length > 0")
                as_alice = browser.evaluate(tab, SEEN)
            with Browser(chromium_path, tmp_path / "chromium-admin", width=1100) as browser:
                tab = open_page(browser, page_hub, "admin",
                                until="!!document.getElementById('sg-cluster')")
                as_admin = browser.evaluate(tab, SEEN)
            return as_alice, as_admin

        as_alice, as_admin = await asyncio.to_thread(drive)

        # alice: her own two leases (never bob's), each with its host, model, utilization
        # and memory now, guaranteed or borrowed, and a chart of samples.
        assert as_alice["url"] == page_hub.page_url
        assert sorted(as_alice["leases"]) == sorted([alice.lease_id, borrowed.lease_id])
        mine, extra = as_alice["cards"][alice.lease_id], as_alice["cards"][borrowed.lease_id]
        assert "default server" in mine and "gpu-a" in mine and GTX1070 in mine
        assert "73 %" in mine and "3 GiB of 8 GiB" in mine and "within your guarantee" in mine
        assert "server “extra”" in extra and "41 %" in extra and "borrowed" in extra
        # Each of her leases has a utilization line (one or more runs: a sample without a
        # value, or a pause in sampling on a loaded machine, breaks a line into two).
        assert sorted(as_alice["charted"]) == sorted([alice.lease_id, borrowed.lease_id])
        assert bob.lease_id not in as_alice["text"] and "bob" not in as_alice["text"]
        assert as_alice["cluster"] == [], "only admins see every GPU"

        # admin: their own lease, and all four GPUs, who holds them, idle and borrowing.
        assert as_admin["leases"] == [own.lease_id]
        rows = {(row[0], row[1]): row for row in as_admin["cluster"]}
        assert set(rows) == {("gpu-a", "0"), ("gpu-a", "1"), ("gpu-b", "0"), ("gpu-b", "1")}
        held = {row[6].split(" ")[0] + ":" + row[8]: row for row in rows.values()
                if row[3] == "held"}
        assert sorted(held) == ["admin:guaranteed", "alice:borrowed", "alice:guaranteed",
                                "bob:guaranteed"]
        assert held["bob:guaranteed"][7] != "—", "bob's processes do nothing: idle"
        assert held["alice:guaranteed"][7] == "—"

        # dave, within his guarantee, waits for a GTX 1070: alice's borrowed one is to be
        # reclaimed. She sees the deadline; he sees his place in the queue.
        waiting = await client.allocate(AllocateRequest(
            request_key=page_hub.request_key("dave"), user="dave", groups=USERS["dave"],
            model="1070", wait_s=900))
        assert waiting.state is LeaseState.QUEUED

        async def warned() -> Lease | None:
            lease = await client.status(lease_id=borrowed.lease_id)
            return lease if lease.reclaim_at is not None else None
        warning = await wait_until(warned, within=60, interval=0.2)
        assert warning.reclaim_at is not None

        for user in ("alice", "dave"):
            await page_hub.login_password(user)

        def look_again() -> tuple[dict[str, Any], dict[str, Any]]:
            with Browser(chromium_path, tmp_path / "chromium-alice-again") as browser:
                tab = open_page(browser, page_hub, "alice",
                                until="!!document.querySelector('.sg-reclaim')")
                as_alice = browser.evaluate(tab, RECLAIMS)
            with Browser(chromium_path, tmp_path / "chromium-dave") as browser:
                tab = open_page(browser, page_hub, "dave",
                                until="!!document.querySelector('.sg-queued')")
                as_dave = browser.evaluate(tab, RECLAIMS)
            return as_alice, as_dave

        as_alice, as_dave = await asyncio.to_thread(look_again)
        deadline = time.strftime("%H:%M UTC", time.gmtime(warning.reclaim_at))
        assert as_alice["reclaims"] == [[borrowed.lease_id, f"{warning.reclaim_at:.0f}"]]
        assert f"server “extra” will be stopped at {deadline}" in as_alice["notes"][0]
        assert as_dave["queued"] == [[waiting.lease_id, "1"]]
        assert as_dave["reclaims"] == []

    if UPDATE_DOCS:
        await demo_screenshot(cluster, page_hub, chromium_path, tmp_path,
                              {alice.lease_id: 73.0, borrowed.lease_id: 41.0,
                               bob.lease_id: 0.0, own.lease_id: 88.0})


async def demo_screenshot(cluster: Cluster, hub: Hub, chromium_path: Path, tmp_path: Path,
                          busy: dict[str, float]) -> None:
    """The docs' pictures (SWARM_GPU_UPDATE_DOCS=1): the leases' GPUs keep working for
    three minutes (bob's goes quiet half way), the page samples them every second into its
    three-minute history, then alice's view (her borrowed GPU warned, as dave waits) and the
    admin's are taken."""
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < 170:
        for host, running in cluster.running.items():
            for n, (lease, _since) in enumerate(running):
                level = busy[lease.lease_id]
                if level:
                    level += 14 * math.sin(elapsed / (7 + 3 * n)) + 5 * math.sin(elapsed / 1.7)
                elif elapsed < 90:
                    level = 35 + 10 * math.sin(elapsed / 5)
                gpu = cluster.gpus[host][lease.gpu_indices[0]]
                cluster.busy(host, lease.gpu_indices[0], max(0.0, min(level, 100.0)),
                             gpu.memory_used_mib)
        await asyncio.sleep(1.0)
    shots = {"alice": tmp_path / "gpu-page.png", "admin": tmp_path / "gpu-page-admin.png"}
    for user in shots:
        await hub.login_password(user)

    def take() -> None:
        for user, shot in shots.items():
            with Browser(chromium_path, tmp_path / f"chromium-demo-{user}",
                         width=1100) as browser:
                tab = open_page(browser, hub, user, until="!!document.querySelector('svg')")
                browser.screenshot(tab, shot, full_page=True)

    await asyncio.to_thread(take)
    for shot in shots.values():
        assert shot.stat().st_size > 10_000
        shutil.copyfile(shot, REPO_ROOT / "docs" / shot.name)


async def test_the_spawn_form_says_which_choices_would_be_borrowed(
    cluster: Cluster, client: AllocatorClient, page_hub: Hub, chromium_path: Path,
    tmp_path: Path,
) -> None:
    """dave (staff: up to 8 GPUs by the hub's policy) is guaranteed one GPU, may borrow one
    more, and holds none: one GPU is within his guarantee, two would be borrowed, three would
    be refused."""
    async with asyncio.timeout(TEST_BUDGET_S):
        await page_hub.login_password("dave")

        def drive(profile: str) -> dict[str, Any]:
            with Browser(chromium_path, tmp_path / profile) as browser:
                tab = browser.page()
                browser.log_in(tab, page_hub.url, "dave", page_hub.passwords["dave"])
                browser.navigate(tab, f"{page_hub.url}/hub/spawn")
                note = "!document.getElementById('sg-borrowed-note').hidden"
                seen: dict[str, Any] = {"cards": browser.evaluate(tab, """
                    Object.fromEntries([...document.querySelectorAll('label.sg-card')].map(
                        c => [c.querySelector('input').value, c.innerText]))""")}
                for count in ("1", "2", "3"):
                    browser.evaluate(tab, f"""
                        document.querySelector('input[name=profile][value=custom]').click();
                        document.querySelector('input[name=mode][value=exclusive]').click();
                        document.getElementById('sg-count').value = '{count}';
                        document.getElementById('sg-form').dispatchEvent(
                            new Event('change', {{bubbles: true}}));""")
                    seen[count] = browser.evaluate(tab, note)
                browser.evaluate(tab, """
                    document.querySelector('input[name=profile][value="two-3090"]').click();""")
                seen["two-3090"] = browser.evaluate(tab, note)
                seen["limits"] = browser.evaluate(
                    tab, "document.getElementById('sg-custom').innerText")
                return seen

        seen = await asyncio.to_thread(drive, "chromium-before")
        assert "Borrowed beyond your guarantee" in seen["cards"]["two-3090"]
        assert "Borrowed" not in seen["cards"]["gtx1070"]
        # three is beyond his borrow limit: refused, not borrowed
        assert (seen["1"], seen["2"], seen["3"], seen["two-3090"]) == (False, True, False, True)
        assert "1 GPU guaranteed to you (you hold 0); beyond it, up to 2 GPUs in all" \
            in seen["limits"], seen["limits"]

        # once he holds his guaranteed GPU, one more would be borrowed, two are too many
        await lease_for(client, page_hub, "dave", "1070", server="first")
        seen = await asyncio.to_thread(drive, "chromium-after")
        assert (seen["1"], seen["2"]) == (True, False)
        assert "Borrowed beyond your guarantee" in seen["cards"]["gtx1070"]


async def test_the_page_ends_with_a_hub_that_dies(page_hub: Hub) -> None:
    """JupyterHub starts the page in a session of its own: a hub killed outright cannot stop
    it, so the page notices and ends by itself."""
    await page_answers(page_hub)
    assert page_hub.proc is not None
    page_address = urlparse(page_hub.env["SWARM_GPU_PAGE_URL"])
    os.kill(page_hub.proc.pid, signal.SIGKILL)

    async def page_gone() -> bool:
        try:
            _, writer = await asyncio.open_connection(page_address.hostname, page_address.port)
        except OSError:
            return True
        writer.close()
        await writer.wait_closed()
        return False
    await wait_until(page_gone, within=60, interval=0.5)


# ------------------------------------------------------------------- security

PAGE_CSP = ("default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; "
            "frame-ancestors 'self'; form-action 'none'; base-uri 'none'")
"""The page's policy, written out here on purpose (not imported from the page): a change to
it must be a change to this test too. Nothing loads from elsewhere and no script runs; its
one stylesheet is the template's inline <style> (an admin's template may replace it, so no
hash), its charts inline SVG."""


async def page_as(hub: Hub, user: str) -> tuple[int, dict[str, str], str]:
    """Log in through the hub's login form, then open the page (through the hub's OAuth,
    as a browser does); the page's status, headers and HTML."""
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as session:
        async with session.get(f"{hub.url}/hub/login") as response:
            await response.text()
        xsrf = next((c.value for c in session.cookie_jar if c.key == "_xsrf"), "")
        async with session.post(f"{hub.url}/hub/login?next=",
                                data={"username": user, "_xsrf": xsrf,
                                      "password": await hub.login_password(user)},
                                allow_redirects=False) as response:
            assert response.status in (302, 303), f"login as {user}: {response.status}"
        async with session.get(hub.page_url) as response:
            assert str(response.url) == hub.page_url, "ended elsewhere than the page"
            return response.status, dict(response.headers), await response.text()


async def test_the_page_sets_a_strict_content_security_policy_that_chromium_enforces(
    page_hub: Hub, chromium_path: Path, tmp_path: Path,
) -> None:
    """The policy is on the real answer, and Chromium holds the page to it: a script put
    into the page does not run, and the page's own styles still apply."""
    async with asyncio.timeout(TEST_BUDGET_S):
        await page_answers(page_hub)
        status, headers, html = await page_as(page_hub, "alice")
        assert status == 200, html
        assert headers["Content-Security-Policy"] == PAGE_CSP
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert headers["Cache-Control"] == "no-store", "one user's page in no shared cache"
        assert "<script" not in html, "the page is server-rendered: it needs no script"

        await page_hub.login_password("alice")

        def look() -> dict[str, Any]:
            with Browser(chromium_path, tmp_path / "chromium-csp") as browser:
                tab = open_page(browser, page_hub, "alice",
                                until="!!document.querySelector('header.sg-top')")
                seen: dict[str, Any] = browser.evaluate(tab, """new Promise(resolve => {
                    const layout = getComputedStyle(document.querySelector('header.sg-top'))
                        .display;
                    document.addEventListener('securitypolicyviolation',
                        e => resolve({layout, violated: e.violatedDirective}), {once: true});
                    const script = document.createElement('script');
                    script.textContent = 'window.sgInjected = true';
                    document.body.append(script);
                    setTimeout(() => resolve({layout, violated: null,
                                              ran: window.sgInjected === true}), 3000);
                })""")
                return seen

        seen = await asyncio.to_thread(look)
        assert seen["layout"] == "flex", "the template's inline <style> must still apply"
        assert seen["violated"] in ("script-src-elem", "script-src"), seen


async def test_a_hub_identity_without_the_page_scope_gets_403(page_hub: Hub) -> None:
    """The page lets in only identities with access:services!service=gpu: a token of alice
    that does not carry that scope, and the hub service e2e (admin rights over users, but
    not this scope), are refused; alice's full token is let in."""
    async with asyncio.timeout(TEST_BUDGET_S):
        await page_answers(page_hub)
        status, body = await page_hub.api(
            "POST", "/users/alice/tokens",
            {"note": "no page", "expires_in": 600, "scopes": ["read:users!user=alice"]},
            user="alice")
        assert status == 201, body
        narrow = body["token"]
        async with aiohttp.ClientSession() as session:
            async def get(token: str) -> tuple[int, str]:
                async with session.get(page_hub.page_url, allow_redirects=False,
                                       headers={"Authorization": f"token {token}"}) as response:
                    return response.status, await response.text()

            status, html = await get(narrow)
            assert status == 403, (status, html[:300])
            assert "sg-page" not in html and "alice" not in html
            status, html = await get(page_hub.admin_token)
            assert status == 403, (status, html[:300])
            status, html = await get(page_hub.tokens["alice"])
            assert status == 200 and 'id="sg-page"' in html, (status, html[:300])


async def test_every_gpu_and_its_holder_is_for_admins_only(
    cluster: Cluster, client: AllocatorClient, page_hub: Hub,
) -> None:
    """The cluster table (every GPU and who holds it) is in the answer to a hub admin and
    to a member of an admin group (staff), and not in the answer to anyone else: not even
    a trace of another user's lease. A stray container on a free GPU and alice's container
    on bob's GPU (outside her grant) are named to admins; alice is warned of her container,
    and sees the stray's GPU only as in use outside swarm-gpu."""
    async with asyncio.timeout(TEST_BUDGET_S):
        bobs = await lease_for(client, page_hub, "bob", "1070")
        alices = await lease_for(client, page_hub, "alice", "1070")
        cluster.run(alices)
        cluster.use("gpu-b", 0, [GPUProcess(pid=4242, memory_used_mib=900, name="python",
                                            container_id="f00dcafe", container_name="miner",
                                            image="lab/miner:1")])
        cluster.use("gpu-a", bobs.gpu_indices[0], [GPUProcess(
            pid=31337, memory_used_mib=256, container_id=f"c-{alices.lease_id[:12]}")])

        async def processes_judged() -> bool:
            reply = await client.inventory(include_leases=True)
            states = {(g.host, g.index): g.process_state for g in reply.gpus}
            flagged = {lease.lease_id: lease.outside_grant for lease in reply.leases or []}
            return (states["gpu-b", 0] is ProcessState.OUTSIDE_USE
                    and bool(flagged.get(alices.lease_id)))
        await wait_until(processes_judged, within=30, interval=0.2)
        await page_answers(page_hub)

        pages = {user: await page_as(page_hub, user) for user in ("alice", "admin", "dave")}
        for user, (status, _, html) in pages.items():
            assert status == 200, (user, html[:300])

        _, _, alice = pages["alice"]
        assert 'id="sg-cluster"' not in alice and "(admin)" not in alice
        assert alices.lease_id in alice
        assert bobs.lease_id not in alice and ">bob" not in alice
        assert f"also uses GPU {bobs.gpu_indices[0]} ({GTX1070}) on gpu-a, which it was not " \
            "given" in alice
        assert '<td>gpu-b</td><td>0</td>' in alice and "in use outside swarm-gpu" in alice
        assert "miner" not in alice and "4242" not in alice
        for user in ("admin", "dave"):  # the hub's admin; dave is in the admin group staff
            _, _, html = pages[user]
            assert 'id="sg-cluster"' in html and "(admin)" in html, user
            assert "gpu-b" in html and ">bob" in html, user
            assert "pid 4242 in container miner (lab/miner:1)" in html, user
            assert "pid 31337 in alice's default server" in unescape(html), user
