"""What the GPU page shows of bookings (pure, and its template): a user's own bookings, the
week's calendar for admins only, and a reclaim warning that names the booking."""

from __future__ import annotations

import re
from html import unescape

from allocator.bookings.schedule import bookings_view
from allocator.wire.protocol import InventoryReply, Lease
from hubplugin.page.app import TEMPLATE
from hubplugin.page.calendar import week_calendar
from hubplugin.page.view import Viewer, page_context
from hubplugin.templating import template
from tests.support.bookings_seen import CS101, FOUR, LATER, ML, NINE, WEEKLY, held
from tests.support.hub_inventory import lease
from tests.support.page_view import WINDOW, cluster_with


def booked(leases: list[Lease]) -> InventoryReply:
    """The page tests' cluster at 09:00 Berlin on Tuesday 2026-12-08, with CS101 (08:30-12:00,
    cs101), ML (10:00-11:30, ml), Thesis (Mon and Thu 14:00-15:00, carol) and Exam (two weeks
    on, cs101) booked."""
    reply = cluster_with(leases)
    view = bookings_view([CS101, ML, WEEKLY, LATER], NINE, FOUR, [held("L-bob", "bob", ())],
                         {(m.model, h): n for m in reply.models for h, n in m.hosts.items()})
    return reply.model_copy(update={"at": NINE, "bookings": view})


def render(reply: InventoryReply, viewer: Viewer) -> str:
    context = page_context(reply, viewer, {}, now=NINE, window=WINDOW, hub_id="hub")
    return template(TEMPLATE).render({**context, "refresh_s": 0})


def rows(html: str, table: str) -> list[list[str]]:
    body = html.split(f'id="{table}"')[1].split("</table>")[0]
    return [[unescape(re.sub(r"<[^>]+>", "", cell)).strip()
             for cell in re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row)]
            for row in re.findall(r"<tr[^>]*>(.*?)</tr>", body)]


def test_a_user_sees_their_bookings_with_the_next_window_in_the_bookings_zone() -> None:
    html = render(booked([]), Viewer("alice", is_admin=False, groups=("cs101",)))
    assert rows(html, "sg-bookings") == [
        ["Booking", "GPUs", "For", "Next window", "Now"],
        ["CS101 lab", "2 \u00d7 NVIDIA GeForce GTX 1070", "group cs101",
         "Tue 2026-12-08 08:30\u201312:00 (Europe/Berlin)", "in effect: your GPUs are guaranteed"],
        ["Exam", "1 \u00d7 NVIDIA GeForce GTX 1070", "group cs101",
         "Tue 2026-12-22 09:00\u201310:00 (Europe/Berlin)", "not in effect"],
    ]
    assert 'id="sg-calendar"' not in html, "the calendar is for admins"
    carol = render(booked([]), Viewer("carol", is_admin=False))
    assert [r[0] for r in rows(carol, "sg-bookings")[1:]] == ["Thesis"]
    assert rows(carol, "sg-bookings")[1][3] == "Thu 2026-12-10 14:00\u201315:00 (Europe/Berlin)"
    assert 'id="sg-bookings"' not in render(booked([]), Viewer("bob", is_admin=False))


def test_an_admin_sees_the_weeks_calendar_days_by_hours() -> None:
    html = render(booked([]), Viewer("root", is_admin=True))
    assert 'id="sg-bookings"' not in html, "root is no member"
    assert "Times in Europe/Berlin" in html and "<script" not in html
    table = rows(html, "sg-calendar")
    assert table[0] == ["", "Tue 08 Dec", "Wed 09 Dec", "Thu 10 Dec", "Fri 11 Dec",
                        "Sat 12 Dec", "Sun 13 Dec", "Mon 14 Dec"]
    by_hour = {row[0]: row[1:] for row in table[1:]}
    assert list(by_hour) == [f"{hour:02d}:00" for hour in range(8, 15)]
    assert by_hour["08:00"][0] == "CS101 lab (2)"
    assert by_hour["10:00"][0] == "CS101 lab (2), ML lab (2)"
    assert by_hour["11:00"][0] == "CS101 lab (2), ML lab (2)"
    assert by_hour["12:00"] == [""] * 7, "CS101 ends at 12:00"
    assert by_hour["14:00"] == ["", "", "Thesis (1)", "", "", "", "Thesis (1)"]
    assert [r[0] for r in rows(html, "sg-booking-list")[1:]] == [
        "CS101 lab", "ML lab", "Thesis", "Exam"]
    assert rows(html, "sg-booking-list")[3][2] == "carol"


def test_no_calendar_without_bookings_or_from_an_allocator_before_0_3_0() -> None:
    html = render(cluster_with([]), Viewer("root", is_admin=True))
    assert 'id="sg-calendar"' not in html and 'id="sg-bookings"' not in html
    assert week_calendar(None, NINE) is None


def test_a_borrower_is_warned_that_a_booking_takes_their_gpus_back() -> None:
    warned = lease(lease_id="L-bob", request_key="hub/bob/", user="bob", host="gpu-a",
                   gpu_uuids=["GPU-gpu-a-1"], gpu_indices=[1], borrowed=True,
                   reclaim_at=NINE + 3600, reclaim_reason="reclaimed",
                   reclaim_booking="ML lab")
    html = render(booked([warned]), Viewer("bob", is_admin=False))
    (warning,) = re.findall(r'<div class="sg-note sg-danger sg-reclaim"[^>]*>(.*?)</div>', html)
    assert "will be stopped at 09:00 UTC</strong> (in 1 h)" in warning
    assert "its GPUs are booked for ML lab, whose members need them then" in warning
    plain = lease(lease_id="L-bob", request_key="hub/bob/", user="bob", host="gpu-a",
                  gpu_uuids=["GPU-gpu-a-1"], gpu_indices=[1], borrowed=True,
                  reclaim_at=NINE + 3600, reclaim_reason="reclaimed")
    assert "booked for" not in render(booked([plain]), Viewer("bob", is_admin=False))


def test_the_admins_table_says_which_booking_a_stop_is_for() -> None:
    warned = lease(lease_id="L-bob", request_key="hub/bob/", user="bob", host="gpu-a",
                   gpu_uuids=["GPU-gpu-a-1"], gpu_indices=[1], borrowed=False,
                   reclaim_at=NINE + 3600, reclaim_reason="reclaimed",
                   reclaim_booking="ML lab")
    html = render(booked([warned]), Viewer("root", is_admin=True))
    assert "· stop at 09:00 UTC for ML lab</strong>" in html
    plain = warned.model_copy(update={"reclaim_booking": None})
    html = render(booked([plain]), Viewer("root", is_admin=True))
    assert "· stop at 09:00 UTC</strong>" in html and "for ML lab" not in html
