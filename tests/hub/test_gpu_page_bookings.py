"""End to end, in Chromium: bookings as users and admins see them. A real hub (its spawn form
and the GPU page) asks the real allocator over the real broker, where an admin made two
bookings: one of the students' in effect now, one of the staff's starting within its lead."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from allocator.amqp.client import AllocatorClient
from tests.support.common import GTX1070, RTX3090, started
from tests.support.gpu_page import RECLAIMS, SEEN, TEST_BUDGET_S, lease_for, open_page
from tests.support.hub_browser import Browser
from tests.support.hub_harness import Hub

pytestmark = [pytest.mark.hub, pytest.mark.browser, pytest.mark.slow]

BERLIN = ZoneInfo("Europe/Berlin")


@pytest.fixture
async def allocator(amqp_vhost: Any, ledger_path: Path) -> AsyncIterator[Any]:
    """The real allocator: the hub's groups students and staff are known (bookings name
    them); guest (the tests' broker user) is an admin."""
    from allocator.config import AllocatorSettings
    from allocator.service import AllocatorService

    async with started(AllocatorService(AllocatorSettings(
        amqp_url=amqp_vhost.url, ledger_path=ledger_path, allow_any_node_user=True,
        admin_users=["guest"], tick_s=0.1, start_fence_s=0, node_down_after_s=3600,
        aliases={"1070": GTX1070, "3090": RTX3090}, reclaim_grace_s=600,
        group_quota={"students": 4, "staff": 4}))) as service:
        yield service


def clock(local: datetime) -> str:
    return f"{local:%H:%M}" if local.date() == datetime.now(BERLIN).date() \
        else f"{local:%a %H:%M}"


MODELS = """Object.fromEntries([...document.querySelectorAll('#sg-model option')].map(
    o => [o.value, o.textContent]))"""


async def test_the_form_marks_booked_and_reclaimable_choices_and_the_page_shows_bookings(
    cluster: Any, client: AllocatorClient, page_hub: Hub, chromium_path: Path,
    tmp_path: Path,
) -> None:
    """The staff's lab books one RTX 3090 now for two hours; CS101 (students) books both GTX
    1070 from the next minutes, warned an hour ahead: dave (staff) holds one of them."""
    async with asyncio.timeout(TEST_BUDGET_S):
        for user in ("alice", "dave", "admin"):
            await page_hub.login_password(user)
        daves = await lease_for(client, page_hub, "dave", "1070")
        now = datetime.now(BERLIN).replace(second=0, microsecond=0, tzinfo=None)
        ends = now + timedelta(hours=2)
        lab = now + timedelta(minutes=3)
        await client.add_booking({
            "name": "Staff lab", "group": "staff", "zone": "Europe/Berlin",
            "gpus": {"model": "3090", "count": 1},
            "window": {"kind": "once", "start": now.isoformat(), "end": ends.isoformat()}})
        await client.add_booking({
            "name": "CS101 lab", "group": "students", "zone": "Europe/Berlin", "lead_s": 3600,
            "gpus": {"model": "1070", "count": 2},
            "window": {"kind": "once", "start": lab.isoformat(),
                       "end": (lab + timedelta(hours=1)).isoformat()}})

        def form(user: str) -> dict[str, Any]:
            with Browser(chromium_path, tmp_path / f"form-{user}") as browser:
                tab = browser.page()
                browser.log_in(tab, page_hub.url, user, page_hub.passwords[user])
                browser.navigate(tab, f"{page_hub.url}/hub/spawn")
                return {"models": browser.evaluate(tab, MODELS), "note": browser.evaluate(
                    tab, "document.getElementById('sg-bookings')?.innerText || ''")}

        alice = await asyncio.to_thread(form, "alice")
        assert alice["models"][GTX1070].endswith(
            f" · booked for CS101 lab from {clock(lab)} to "
            f"{clock(lab + timedelta(hours=1))}"), alice
        assert "Booked for you: CS101 lab: 2 \u00d7 NVIDIA GeForce GTX 1070" in alice["note"]
        dave = await asyncio.to_thread(form, "dave")
        assert dave["models"][RTX3090].endswith(
            f" · booked for Staff lab until {clock(ends)}"), dave
        # one GTX 1070 is free and CS101 needs two: even one is reclaimable at its start
        assert dave["models"][GTX1070].endswith(
            f" · reclaimable at {clock(lab)} for a booking"), dave
        assert "Booked for others soon:" in dave["note"]

        def page(user: str, until: str) -> dict[str, Any]:
            with Browser(chromium_path, tmp_path / f"page-{user}", width=1200) as browser:
                tab = open_page(browser, page_hub, user, until=until)
                seen: dict[str, Any] = browser.evaluate(tab, SEEN)
                seen.update(browser.evaluate(tab, RECLAIMS))
                seen["bookings"] = browser.evaluate(tab, """[...document.querySelectorAll(
                    '#sg-bookings tr.sg-booking')].map(r => [...r.cells].map(c => c.innerText))""")
                seen["calendar"] = browser.evaluate(tab, """[...document.querySelectorAll(
                    '#sg-calendar td.sg-booked')].map(c => c.innerText)""")
                seen["scripts"] = browser.evaluate(
                    tab, "document.querySelectorAll('script').length")
                return seen

        as_alice = await asyncio.to_thread(
            page, "alice", "!!document.getElementById('sg-bookings')")
        ((name, gpus, members, _, state),) = as_alice["bookings"]
        assert (name, gpus, members) == ("CS101 lab", "2 \u00d7 NVIDIA GeForce GTX 1070",
                                         "group students")
        assert state == "not in effect" and as_alice["calendar"] == [], "the calendar is admins'"
        # dave: a member of the staff's lab, warned for CS101's, and (staff) an admin here
        as_dave = await asyncio.to_thread(
            page, "dave", "document.querySelectorAll('.sg-reclaim').length > 0")
        assert [lease for lease, _ in as_dave["reclaims"]] == [daves.lease_id], as_dave
        assert "its GPUs are booked for CS101 lab" in as_dave["notes"][0], as_dave
        assert [row[0] for row in as_dave["bookings"]] == ["Staff lab"]
        assert "in effect" in as_dave["bookings"][0][4]
        as_admin = await asyncio.to_thread(
            page, "admin", "!!document.getElementById('sg-calendar')")
        assert "Staff lab (1)" in as_admin["calendar"], as_admin["calendar"]
        assert any("CS101 lab (2)" in cell for cell in as_admin["calendar"])
        assert "Times in Europe/Berlin" in as_admin["text"]
        assert [row[0] for row in as_admin["bookings"]] == ["Staff lab"], "admin is staff too"
        assert as_admin["scripts"] == 0
