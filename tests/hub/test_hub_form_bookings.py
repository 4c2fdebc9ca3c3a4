"""The spawn form's marks for bookings (pure): the choices a booking of the user's covers, the
ones a booking of others takes back soon, and a form as before without bookings."""

from __future__ import annotations

from allocator.bookings.outlook import outlook_for
from allocator.bookings.schedule import bookings_view
from allocator.wire.protocol import InventoryReply
from hubplugin.booked import choice_text
from hubplugin.form import render_form
from tests.support.bookings_seen import CS101, FOUR, ML, NINE, held
from tests.support.hub_form import PROFILES, STAFF, parse
from tests.support.hub_inventory import A100, GTX1070, RTX3090, inventory


def booked_cluster() -> InventoryReply:
    """The form's usual inventory (gpu-a: two GTX 1070, one free), at 09:00 Berlin on the
    day CS101 (08:30-12:00, group cs101) and ML (10:00-11:30, group ml) each book 2 GTX 1070;
    bob holds one of them."""
    reply = inventory()
    free = {(m.model, host): n for m in reply.models for host, n in m.hosts.items()}
    view = bookings_view([CS101, ML], NINE, FOUR, [held("L-bob", "bob", ())], free)
    return reply.model_copy(update={"at": NINE, "bookings": view})


def model_labels(html: str) -> dict[str, str]:
    return {str(o["value"]): str(o["text"]) for o in parse(html).selects["model"]}


def test_a_members_choices_say_booked_for_their_booking_until_its_end() -> None:
    reply = booked_cluster()
    alice = outlook_for(reply.bookings, "alice", ["cs101"], reply.at)
    html = render_form(reply, permissions=STAFF, profiles=PROFILES, bookings=alice)
    labels = model_labels(html)
    assert labels[GTX1070].endswith(" · booked for CS101 lab until 12:00"), labels
    assert "booked" not in labels[RTX3090] and "booked" not in labels[A100]
    form = parse(html)
    text = " ".join(form.text)
    assert "Booked for you:" in text
    assert "CS101 lab: 2 \u00d7 NVIDIA GeForce GTX 1070, booked for CS101 lab until 12:00 " \
           "(Europe/Berlin)" in text
    # the profile of one GTX 1070 is covered too; the CPU profile is no GPU's
    assert "booked for CS101 lab until 12:00" in html.split('value="one-1070"')[1] \
        .split("</label>")[0]
    assert "sg-booking" not in html.split('value="cpu"')[1].split("</label>")[0]


def test_a_choice_of_more_gpus_than_booked_is_not_marked_booked() -> None:
    """CS101 books 2 GTX 1070: a choice of 1 or 2 is covered, one of 3 is not (its third GPU
    is ordinary capacity), and so is not said to be booked."""
    reply = booked_cluster()
    alice = outlook_for(reply.bookings, "alice", ["cs101"], reply.at)
    covered = {units: choice_text(alice, GTX1070, units, reply.at) for units in (1.0, 2.0, 3.0)}
    assert covered[1.0] == covered[2.0] == "booked for CS101 lab until 12:00", covered
    assert covered[3.0] is None or "booked for" not in covered[3.0], covered


def test_others_see_which_choices_a_booking_reclaims_soon() -> None:
    reply = booked_cluster()
    bob = outlook_for(reply.bookings, "bob", ["students"], reply.at)
    html = render_form(reply, permissions=STAFF, profiles=PROFILES, bookings=bob)
    labels = model_labels(html)
    # one GTX 1070 is free: CS101 (in effect) needs 2 more, so even one is reclaimable now
    assert labels[GTX1070].endswith(" · reclaimable now for a booking"), labels
    assert "reclaimable" not in labels[RTX3090] and "reclaimable" not in labels["any"]
    text = " ".join(parse(html).text)
    assert "Booked for others soon:" in text and "Booked for you" not in text
    assert "NVIDIA GeForce GTX 1070: reclaimable now for a booking (Europe/Berlin)" in text
    assert "NVIDIA GeForce GTX 1070: reclaimable at 10:00 for a booking" in text
    one_1070 = html.split('value="one-1070"')[1].split("</label>")[0]
    assert "reclaimable now for a booking" in one_1070


def test_a_form_without_bookings_is_as_before() -> None:
    reply = inventory()
    plain = render_form(reply, permissions=STAFF, profiles=PROFILES)
    nobody = render_form(reply, permissions=STAFF, profiles=PROFILES,
                         bookings=outlook_for(None, "bob", [], reply.at))
    assert plain == nobody
    assert "sg-bookings" not in plain and "booked" not in plain


def test_booking_names_are_escaped() -> None:
    reply = booked_cluster()
    assert reply.bookings is not None
    hostile = reply.bookings.model_copy(update={"bookings": [
        b.model_copy(update={"name": "<script>alert(1)</script>"})
        for b in reply.bookings.bookings]})
    html = render_form(reply, permissions=STAFF, bookings=outlook_for(
        hostile, "alice", ["cs101"], reply.at))
    assert "<script>alert(1)" not in html and "&lt;script&gt;alert(1)" in html
