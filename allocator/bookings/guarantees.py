"""The guarantees bookings give at one instant: what the engine consumes as time-bounded
guarantees of their members.

At an instant ``t`` a booking is

* **active** while one of its occurrences runs (``start <= t < end``): its members are
  guaranteed its GPUs until the occurrence's end;
* **upcoming** from ``lead_s`` before an occurrence's start (the booking's own ``lead_s``, or
  the allocator's default): borrowers of those GPUs are warned now, reclaimed at the start.

Each guarantee carries what the booking asked for (``count``) and what can be given
(``guaranteed``): all of it, unless GPUs went away since it was admitted, when the bookings
running at that instant are served in the order they were admitted
(:func:`allocator.bookings.supply.served`); an upcoming one is judged at its start, against
the bookings running then. So the guarantees active at any instant never add up to more GPUs
than exist, on any host or of any model.

Pure: no I/O, no clock (``t`` is passed in).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from allocator.bookings.checks import ResolvedBooking
from allocator.bookings.supply import Capacity, served
from allocator.bookings.windows import Occurrence


class GuaranteeState(StrEnum):
    """Where ``t`` stands against a booking's occurrence."""

    ACTIVE = "active"
    """Within the occurrence."""
    UPCOMING = "upcoming"
    """Within the lead before it."""


@dataclass(frozen=True)
class Guarantee:
    """What one booking guarantees its members around ``t``."""

    booking: str
    group: str | None
    users: tuple[str, ...] | None
    model: str
    host: str | None
    count: int
    """GPUs booked."""
    guaranteed: int
    """GPUs that can be given (``count`` unless GPUs went away)."""
    starts_at: int
    ends_at: int
    state: GuaranteeState
    quota_applies: bool
    """Whether a member's own quota still limits what they take of it."""

    def covers(self, user: str, groups: Sequence[str]) -> bool:
        """Whether a user (with their groups) is a member."""
        if self.group is not None:
            return self.group in groups
        return user in (self.users or ())


def _running_at(bookings: Sequence[ResolvedBooking], instant: int) -> list[int]:
    """The bookings (by position, the order they were admitted) with an occurrence at
    ``instant``."""
    return [i for i, b in enumerate(bookings) if b.occurrences(instant, instant + 1)]


def _given_at(bookings: Sequence[ResolvedBooking], instant: int,
              capacity: Capacity) -> dict[int, int]:
    """What each booking running at ``instant`` is given then, by position."""
    running = _running_at(bookings, instant)
    return dict(zip(running, served([bookings[i].draw for i in running], capacity),
                    strict=True))


def guarantees_at(bookings: Sequence[ResolvedBooking], t: int, capacity: Capacity, *,
                  default_lead_s: int) -> list[Guarantee]:
    """Every booking active or upcoming at ``t`` (bookings in the order they were admitted),
    with what it guarantees, in that order."""
    found: list[Guarantee] = []
    given: dict[int, dict[int, int]] = {}  # instant -> what each booking gets then
    for index, resolved in enumerate(bookings):
        booking = resolved.booking
        lead = booking.lead_s if booking.lead_s is not None else default_lead_s
        nearest: Occurrence | None = next(
            (o for o in resolved.occurrences(t, t + lead + 1) if o.start - lead <= t), None)
        if nearest is None:
            continue
        state = GuaranteeState.ACTIVE if nearest.start <= t else GuaranteeState.UPCOMING
        judged_at = max(t, nearest.start)
        if judged_at not in given:
            given[judged_at] = _given_at(bookings, judged_at, capacity)
        found.append(Guarantee(
            booking=resolved.name, group=booking.group, users=booking.users,
            model=resolved.model, host=booking.gpus.host, count=booking.gpus.count,
            guaranteed=given[judged_at].get(index, 0),
            starts_at=nearest.start, ends_at=nearest.end, state=state,
            quota_applies=booking.quota_applies))
    return found
