"""Bookings in the engine's time: the guarantees in effect now, the shares they give over the
leases that hold GPUs (:mod:`allocator.bookings.in_effect`), and the next instant either can
change.

The guarantees are computed at a booking boundary (a lead's start, a window's start or end),
when the bookings or the GPUs change (``BookingBook.resolved()`` is then another object), or
when a node or GPU is drained, undrained, lost or back (``NodeReports.availability_version``:
the capacity the guarantees are judged against changed), never on a tick between those: a
tick compares the clock with the next boundary and, without bookings, does nothing else. The
capacity they are judged against (:meth:`allocator.engine.bookings.BookingBook.capacity`) is
read at those instants too.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from datetime import datetime
from fractions import Fraction
from typing import Final
from zoneinfo import ZoneInfo

from allocator.bookings.checks import ResolvedBooking
from allocator.bookings.guarantees import Guarantee, guarantees_at
from allocator.bookings.in_effect import Held, Share, Shares, in_room, shares_of
from allocator.config import AllocatorSettings
from allocator.engine.bookings import BookingBook
from allocator.ledger.lease import LeaseRecord

LOOK_AHEAD_S: Final = 8 * 24 * 3600
"""How far ahead the next boundary is looked for: a weekly booking has one within a week and
its lead; when none is found the guarantees are computed again then."""


class BookingWindows:
    """The guarantees bookings give now, computed at boundaries only.

    Its state is memory only, rebuilt from the bookings whenever they or the clock's boundary
    change. Invariant: ``guarantees`` are those of ``resolved`` at an instant from which no
    boundary of them has passed before ``next_at``.
    """

    def __init__(self, settings: AllocatorSettings, bookings: BookingBook) -> None:
        self.settings = settings
        self.bookings = bookings
        """The bookings made: ``resolved()`` in the order they were admitted (the same object
        until they change, so that a tick compares them by identity), and the GPUs they draw
        on at an instant (``capacity``)."""
        self.resolved: Sequence[ResolvedBooking] = ()
        self.guarantees: tuple[Guarantee, ...] = ()
        self.computed_at: int | None = None
        self.availability_seen = -1
        """``NodeReports.availability_version`` when the guarantees were computed."""
        self.next_at: int = 0
        """The next instant (epoch seconds) a guarantee begins, changes state or ends."""
        self.booking_of: dict[str, str] = {}
        """Lease id -> the booking covering it, as of the last :meth:`shares`."""
        self.reclaim_for_booking: dict[str, str] = {}
        """Warned lease id -> the booking it is warned for (memory only: the warning itself
        is on the lease, in the ledger, and the next plan names the booking again)."""
        self.current = Shares()
        """The shares as of the last :meth:`shares`."""
        self.rooms: dict[str, Fraction] = {}
        """Active booking -> its room now: the last shares' less what was granted in it
        since (:meth:`take`)."""
        self.changed = False
        """The guarantees were computed anew since :meth:`take_changed`."""

    def now(self, now: float) -> tuple[Guarantee, ...]:
        """The guarantees active or upcoming at ``now`` (cheap between boundaries)."""
        resolved = self.bookings.resolved()
        if not resolved:
            if self.guarantees or self.resolved:
                self.resolved, self.guarantees, self.computed_at = (), (), None
                self._forget_shares()
                self.changed = True
            return ()
        t = int(now)
        # A new object: bookings added or removed, or the inventory changed (capacity).
        if resolved is not self.resolved or self.computed_at is None or t >= self.next_at \
                or t < self.computed_at \
                or self.bookings.nodes.availability_version != self.availability_seen:
            self._compute(resolved, t)
        return self.guarantees

    def _compute(self, resolved: Sequence[ResolvedBooking], t: int) -> None:
        lead_default = self.settings.booking_lead_s
        self.resolved = resolved
        self.availability_seen = self.bookings.nodes.availability_version
        self.guarantees = tuple(guarantees_at(resolved, t, self.bookings.capacity(float(t)),
                                              default_lead_s=lead_default))
        self.computed_at = t
        self.changed = True
        self.next_at = min((self._next_boundary(b, t, lead_default) for b in resolved),
                           default=t + LOOK_AHEAD_S)
        if not self.guarantees:
            self._forget_shares()

    def _forget_shares(self) -> None:
        """No booking is in effect: no lease is covered, no room is left."""
        self.booking_of, self.current, self.rooms = {}, Shares(), {}

    @staticmethod
    def _next_boundary(booking: ResolvedBooking, t: int, lead_default: int) -> int:
        lead = booking.booking.lead_s if booking.booking.lead_s is not None else lead_default
        for occurrence in booking.occurrences(t, t + lead + LOOK_AHEAD_S):
            for instant in (occurrence.start - lead, occurrence.start, occurrence.end):
                if instant > t:
                    return instant
        return t + LOOK_AHEAD_S

    def shares(self, now: float, holding: Iterable[LeaseRecord]) -> Shares:
        """The shares of the bookings in effect at ``now`` over the leases holding GPUs; also
        remembered per lease for the leases' views."""
        guarantees = self.now(now)
        if not guarantees:
            self._forget_shares()
            return self.current
        shares = shares_of(guarantees, [
            Held(r.lease_id, r.user, r.groups, r.model, r.host or "", r.units,
                 r.granted_at or 0.0) for r in holding])
        active = {s.name for s in shares.active()}
        self.booking_of = {lease_id: name for lease_id, name in shares.covered_by.items()
                           if name in active}
        self.current = shares
        self.rooms = {s.name: s.room for s in shares.active()}
        return shares

    def take_changed(self) -> bool:
        """Whether the guarantees were computed anew since the last call (a boundary passed
        or the bookings changed: the queue's order and what fits may have changed)."""
        changed, self.changed = self.changed, False
        return changed

    def booked_share(self, user: str, groups: Sequence[str], models: Collection[str] | None,
                     host: str | None) -> Share | None:
        """The first active booking the user is a member of with room left now, whose GPUs
        a request for ``models`` (None: any) on ``host`` (None: any) may take."""
        if not self.rooms:
            return None
        for share in self.current.active():
            g = share.guarantee
            if (self.rooms.get(share.name, Fraction(0)) > 0 and g.covers(user, groups)
                    and (models is None or g.model in models)
                    and (host is None or g.host is None or g.host == host)):
                return share
        return None

    def in_room(self, share: Share, model: str | None, host: str, units: Fraction) -> bool:
        """Whether ``units`` of ``model`` on ``host`` fit in the share's room now."""
        return in_room(share.guarantee, self.rooms.get(share.name, Fraction(0)), model, host,
                       units)

    def take(self, share: Share, units: Fraction) -> None:
        """A grant in the share's room: less room for the next request until the shares are
        computed again."""
        self.rooms[share.name] = self.rooms.get(share.name, Fraction(0)) - units

    def zone_of(self, booking: str) -> ZoneInfo | None:
        """The booking's zone, for messages."""
        return next((b.booking.tz for b in self.resolved if b.name == booking), None)

    def reclaim_text(self, booking: str, reclaim_at: float) -> str:
        """``reclaimable at 10:00 for the booking CS101`` (the time in the booking's zone)."""
        zone = self.zone_of(booking)
        when = datetime.fromtimestamp(reclaim_at, zone or ZoneInfo("UTC"))
        return f"reclaimable at {when:%H:%M} for the booking {booking}"
