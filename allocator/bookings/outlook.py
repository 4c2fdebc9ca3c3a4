"""What one user sees of bookings, read from an inventory reply's
:class:`~allocator.wire.protocol.BookingsView` (:mod:`allocator.bookings.schedule` builds it).

Public surface (``allocator.PUBLIC_SURFACE``): the spawn form and the GPU page import it, so
the rules stay the allocator's and the hub only renders what they say:

* **membership** (:func:`is_member`): a booking is its group's users, or the users it lists
  (the rule of :meth:`allocator.bookings.guarantees.Guarantee.covers`);
* **booked for you** (:class:`Booked`): a booking of the user's that is in effect, or starts
  within the view's ``soon_s``: "booked for CS101 lab until 12:00";
* **reclaimable** (:class:`TakeBack`): a booking of others that takes back GPUs of a model
  now or soon: a choice of more than its ``spare`` GPUs of that model is "reclaimable at
  10:00 for a booking".

Times are the booking zone's wall clock, as the allocator wrote them. Pure: no I/O, no clock
(``now`` is passed in); it imports only :mod:`allocator.wire.protocol` and the standard library.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from allocator.wire.protocol import BookedTime, BookingSchedule, BookingsView


def is_member(schedule: BookingSchedule, user: str, groups: Sequence[str]) -> bool:
    """Whether ``user`` (with ``groups``) is one of the booking's members."""
    if schedule.group is not None:
        return schedule.group in groups
    return user in (schedule.users or ())


def _local(text: str) -> datetime:
    return datetime.fromisoformat(text)


def _today_in(zone: str, now: float) -> datetime | None:
    try:
        return datetime.fromtimestamp(now, UTC).astimezone(ZoneInfo(zone)).replace(tzinfo=None)
    except (ZoneInfoNotFoundError, ValueError):
        return None


def clock_text(local: str, zone: str, now: float) -> str:
    """``10:00`` on the zone's day of ``now``, ``Tue 10:00`` on another day."""
    when = _local(local)
    today = _today_in(zone, now)
    if today is not None and today.date() == when.date():
        return f"{when:%H:%M}"
    return f"{when:%a %H:%M}"


def window_text(window: BookedTime) -> str:
    """``Tue 2026-12-08 10:00-12:00`` (an en dash between; the end's date too when it is
    another day)."""
    start, end = _local(window.local_start), _local(window.local_end)
    ends = f"{end:%H:%M}" if end.date() == start.date() else f"{end:%a %Y-%m-%d %H:%M}"
    return f"{start:%a %Y-%m-%d %H:%M}\u2013{ends}"


def gpus_text(schedule: BookingSchedule, display: str | None = None) -> str:
    """``2 x NVIDIA GeForce GTX 1070`` (a multiplication sign; ``display``: the model as the
    caller shows it), with ``on gpu-a`` when it names a host."""
    where = f" on {schedule.host}" if schedule.host else ""
    return f"{schedule.count} \u00d7 {display or schedule.model}{where}"


@dataclass(frozen=True)
class Booked:
    """A booking of the user's that is in effect now or starts soon."""

    schedule: BookingSchedule
    window: BookedTime
    """Its window now, or its next one."""
    in_effect: bool

    def text(self, now: float) -> str:
        """``booked for CS101 lab until 12:00`` (in effect) or ``booked for CS101 lab from
        10:00 to 12:00``."""
        zone = self.schedule.zone
        end = clock_text(self.window.local_end, zone, now)
        if self.in_effect:
            return f"booked for {self.schedule.name} until {end}"
        start = clock_text(self.window.local_start, zone, now)
        return f"booked for {self.schedule.name} from {start} to {end}"


@dataclass(frozen=True)
class TakeBack:
    """A booking of others that reclaims GPUs of its model (on its host, if it names one)
    from non-members now or soon."""

    schedule: BookingSchedule
    at: float
    spare: int
    """A non-member's lease of more GPUs of its kind than this may be reclaimed at ``at``."""

    def applies(self, units: float | None) -> bool:
        """Whether a choice of ``units`` GPUs (a slice: less than one; None: not known
        before placement, "all GPUs of a host") may be reclaimed for it."""
        return units is None or units > self.spare

    def text(self, now: float) -> str:
        """``reclaimable at 10:00 for a booking`` (``now`` while it is in effect)."""
        if self.at <= now:
            return "reclaimable now for a booking"
        local = self.schedule.windows[0].local_start if self.schedule.windows else None
        when = clock_text(local, self.schedule.zone, now) if local is not None else "soon"
        return f"reclaimable at {when} for a booking"

    def model_text(self, now: float) -> str:
        """For a model whatever the count: ``beyond 1 GPU, reclaimable at 10:00 for a
        booking`` (just :meth:`text` when none is spare)."""
        if self.spare <= 0:
            return self.text(now)
        return f"beyond {self.spare} GPU{'' if self.spare == 1 else 's'}, {self.text(now)}"


@dataclass(frozen=True)
class UserOutlook:
    """What one user sees of bookings at one instant."""

    mine: list[BookingSchedule] = field(default_factory=list)
    """Every booking of the user's with a window in the coming week (or a next one)."""
    booked: list[Booked] = field(default_factory=list)
    """Those in effect now or starting soon, in the order admitted."""
    take_backs: list[TakeBack] = field(default_factory=list)
    """Others' bookings that take back GPUs now or soon, soonest first."""

    def booked_for(self, model: str, units: float | None = None) -> Booked | None:
        """The first booking of the user's on GPUs of ``model`` in effect or soon that covers a
        choice of ``units`` GPUs (None: any number; a choice of more GPUs than the booking
        has is not covered by it, its excess being ordinary capacity)."""
        return next((b for b in self.booked if b.schedule.model == model
                     and (units is None or units <= b.schedule.count)), None)

    def take_back_for(self, model: str, units: float | None) -> TakeBack | None:
        """The soonest of others' bookings that may reclaim a choice of ``units`` GPUs of
        ``model`` (None when the user's own booking covers that model now or soon)."""
        if self.booked_for(model, units) is not None:
            return None
        return next((t for t in self.take_backs
                     if t.schedule.model == model and t.applies(units)), None)


def outlook_for(view: BookingsView | None, user: str, groups: Sequence[str],
                now: float) -> UserOutlook:
    """What ``user`` (with ``groups``) sees of the bookings in ``view`` at ``now``."""
    if view is None:
        return UserOutlook()
    mine: list[BookingSchedule] = []
    booked: list[Booked] = []
    take_backs: list[TakeBack] = []
    for schedule in view.bookings:
        member = is_member(schedule, user, groups)
        if member:
            mine.append(schedule)
            window = schedule.windows[0] if schedule.windows else None
            if window is not None and window.start <= now + view.soon_s and window.end > now:
                booked.append(Booked(schedule, window, in_effect=window.start <= now))
        elif schedule.takes_back_at is not None and schedule.spare is not None:
            take_backs.append(TakeBack(schedule, schedule.takes_back_at, schedule.spare))
    take_backs.sort(key=lambda t: t.at)
    return UserOutlook(mine, booked, take_backs)
