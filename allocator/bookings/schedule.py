"""What users see of bookings: the bookings of the coming week as the inventory reply carries
them (:class:`~allocator.wire.protocol.BookingsView`), with what each takes back soon.

For every booking with a window overlapping ``[now, now + WEEK_S)`` (or, lacking one, its next
window within the horizon): its members, what it books, those windows in UTC and on its zone's
wall clock, and whether one runs now. A booking in effect now, or starting within
:data:`SOON_S`, also says

* ``guaranteed``: what it can be given then (:func:`allocator.bookings.guarantees.guarantees_at`
  judged at ``max(now, start)``: fewer than booked when GPUs went away);
* its *room*: that less what its members' leases hold of its GPUs now
  (:func:`allocator.bookings.in_effect.shares_of`);
* ``takes_back_at`` and ``spare`` when it has room: from when a non-member's lease on GPUs of
  its kind may be reclaimed for it, and how many GPUs of its kind are free now beyond the rooms
  of it and of the bookings of that model taking back no later. A non-member who takes more
  than ``spare`` of them now may lose the rest at ``takes_back_at``; one who takes no more is
  not reclaimed for it unless others take the free GPUs meanwhile. So the mark is a forecast
  from now, never a promise; the reclaim itself is the engine's, by the same shares.

The spawn form and the GPU page read this through :mod:`allocator.bookings.outlook`. Pure: no
I/O, no clock (``now`` is passed in).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from math import ceil
from typing import Final

from allocator.bookings.checks import DEFAULT_HORIZON_S, ResolvedBooking
from allocator.bookings.guarantees import Guarantee, GuaranteeState, guarantees_at
from allocator.bookings.in_effect import Held, shares_of
from allocator.bookings.local_time import local_at
from allocator.bookings.supply import Capacity
from allocator.bookings.windows import Occurrence
from allocator.wire.protocol import BookedTime, BookingSchedule, BookingsView

WEEK_S: Final = 7 * 24 * 3600
"""How far ahead the windows go: the page's calendar is one week."""

SOON_S: Final = 8 * 3600
"""How far ahead a booking's start counts as soon: a notebook started now may well run that
long (a working day), so the form warns of a booking that starts within it."""


def _booked_time(occurrence: Occurrence, booking: ResolvedBooking) -> BookedTime:
    # The end as the zone's clock reads it then (a window spanning a clock change is an hour
    # longer or shorter than its duration).
    local_end = local_at(occurrence.end, booking.booking.tz)
    return BookedTime(start=occurrence.start, end=occurrence.end,
                      local_start=occurrence.local_start.isoformat(),
                      local_end=local_end.isoformat())


def _guarantee_at(resolved: Sequence[ResolvedBooking], index: int, instant: int,
                  capacity: Capacity,
                  cache: dict[int, list[Guarantee]]) -> Guarantee | None:
    """The guarantee of ``resolved[index]`` active at ``instant``."""
    if instant not in cache:
        cache[instant] = [g for g in guarantees_at(resolved, instant, capacity,
                                                   default_lead_s=0)
                          if g.state is GuaranteeState.ACTIVE]
    name = resolved[index].name
    return next((g for g in cache[instant] if g.booking == name), None)


def bookings_view(resolved: Sequence[ResolvedBooking], now: float, capacity: Capacity,
                  held: Sequence[Held], free: Mapping[tuple[str, str], int]) -> BookingsView:
    """The bookings of the coming week (``resolved``: in the order admitted), with what they
    take back soon. ``held``: the leases holding GPUs now; ``free``: whole GPUs free now per
    ``(model, host)``."""
    t = int(now)
    week_to = t + WEEK_S
    cache: dict[int, list[Guarantee]] = {}
    schedules: list[BookingSchedule] = []
    soon: list[tuple[int, int, Guarantee]] = []  # (takes back at, position, guarantee)
    for index, booking in enumerate(resolved):
        found = booking.occurrences(t, week_to)
        if not found:
            found = booking.occurrences(week_to, t + DEFAULT_HORIZON_S)[:1]
        if not found:
            continue
        first = found[0]
        in_effect = first.start <= t
        guarantee = None
        if first.start <= t + SOON_S:
            guarantee = _guarantee_at(resolved, index, max(t, first.start), capacity, cache)
            if guarantee is not None:
                soon.append((max(t, first.start), index, guarantee))
        members = booking.booking
        schedules.append(BookingSchedule(
            name=booking.name, group=members.group,
            users=list(members.users) if members.users is not None else None,
            model=booking.model, host=members.gpus.host, count=members.gpus.count,
            zone=members.zone, windows=[_booked_time(o, booking) for o in found],
            in_effect=in_effect,
            guaranteed=guarantee.guaranteed if guarantee is not None else None))
    taking = _takes_back(soon, held, free)
    schedules = [s.model_copy(update=dict(zip(("takes_back_at", "spare"), taking[s.name],
                                              strict=True)))
                 if s.name in taking else s for s in schedules]
    return BookingsView(week_from=t, week_to=week_to, soon_s=SOON_S, bookings=schedules)


def _takes_back(soon: Sequence[tuple[int, int, Guarantee]], held: Sequence[Held],
                free: Mapping[tuple[str, str], int]) -> dict[str, tuple[float, int]]:
    """Booking name -> (takes back at, spare), for those in effect or soon with room."""
    rooms: list[tuple[int, int, Guarantee, Fraction]] = []
    for at, index, guarantee in sorted(soon):
        # Each on its own: a member's lease counts for the booking it would be covered by at
        # that booking's start, whichever other booking covers it now.
        (share,) = shares_of([guarantee], held).shares
        if share.room > 0:
            rooms.append((at, index, guarantee, share.room))
    found: dict[str, tuple[float, int]] = {}
    for at, _, guarantee, _ in rooms:
        model, host = guarantee.model, guarantee.host
        free_now = sum(n for (m, h), n in free.items()
                       if m == model and (host is None or h == host))
        taken = sum((room for other_at, _, other, room in rooms
                     if other.model == model and other_at <= at
                     and (host is None or other.host is None or other.host == host)),
                    Fraction(0))
        found[guarantee.booking] = (float(at), max(free_now - ceil(taken), 0))
    return found
