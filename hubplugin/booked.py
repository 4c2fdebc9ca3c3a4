"""The spawn form's marks for bookings: which choices a booking of the user's covers ("booked
for CS101 lab until 12:00") and which a booking of others will take back soon ("reclaimable at
10:00 for a booking").

The allocator decides, never the hub: its inventory reply carries the bookings
(``InventoryReply.bookings``, 0.3.0) and :mod:`allocator.bookings.outlook` says what they mean
for one user; this module only puts those words on the form's model options, profile cards
and one note. An allocator before 0.3.0 sends no bookings, and the form is as it was.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from allocator.bookings.outlook import UserOutlook, gpus_text
from allocator.wire.model_names import display_name

from .borrowing import choice_units
from .options import ModelCatalog, Profile


def choice_text(outlook: UserOutlook, model: str, units: float | None, now: float) -> str | None:
    """What bookings mean for a choice of ``units`` GPUs of ``model`` (None: nothing)."""
    booked = outlook.booked_for(model, units)
    if booked is not None:
        return booked.text(now)
    taken = outlook.take_back_for(model, units)
    return taken.text(now) if taken is not None else None


def mark_models(options: list[dict[str, Any]], outlook: UserOutlook, now: float) -> None:
    """Each model option (``value`` the canonical model) says what bookings mean for it."""
    for option in options:
        model = option["value"]
        booked = outlook.booked_for(model)
        taken = outlook.take_back_for(model, None)
        text = (booked.text(now) if booked is not None
                else taken.model_text(now) if taken is not None else None)
        option["booking"] = text
        if text is not None:
            option["label"] = f"{option['label']} · {text}"


def mark_profiles(cards: list[dict[str, Any]], profiles: Sequence[Profile],
                  catalog: ModelCatalog | None, outlook: UserOutlook, now: float) -> None:
    """Each profile card of one model says what bookings mean for its choice."""
    by_slug = {p.slug: p for p in profiles}
    for card in cards:
        card["booking"] = None
        options = by_slug[card["slug"]].options()
        if catalog is None or not options.wants_gpu or options.any_model:
            continue
        model = catalog.canonical(options.model)
        if model is not None:
            card["booking"] = choice_text(outlook, model, choice_units(options, catalog), now)


def booking_notes(outlook: UserOutlook, now: float) -> dict[str, list[str]]:
    """The form's note: the user's bookings in effect or soon, and what others' take back."""
    return {
        "booked": [f"{b.schedule.name}: {gpus_text(b.schedule, display_name(b.schedule.model))}"
                   f", {b.text(now)} ({b.schedule.zone})" for b in outlook.booked],
        "taken": [f"{display_name(t.schedule.model)}"
                  f"{' on ' + t.schedule.host if t.schedule.host else ''}: "
                  f"{t.model_text(now)} ({t.schedule.zone})" for t in outlook.take_backs],
    }
