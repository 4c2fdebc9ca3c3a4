"""Bookings in effect: what the guarantees of one instant
(:func:`allocator.bookings.guarantees.guarantees_at`) mean for the leases that hold GPUs and the
requests that wait.

* **Covered.** Each booking covers its members' leases on its GPUs (its model, and its host if
  it names one), oldest grant first, while their units add up to at most what it guarantees;
  bookings are served in the order they were admitted, and a lease is covered by one booking
  at most. A covered lease is never borrowed and never a reclaim victim.
* **Room.** What a booking guarantees less what its covered leases hold: a member's request
  that fits in it is within a guarantee (it may reclaim), and queues ahead of borrowers.
* **Standing on it.** A lease of a non-member on a booking's GPUs that no booking covers may be
  reclaimed for a member's request that fits in the booking's room, whatever its owner's own
  guarantee (the booking holds those GPUs for its window).
* **Before the window** (from ``start - lead_s``): the non-members' leases a booking will need,
  given the GPUs of its kind that are free now, are warned; no more of them than needed.

Upcoming bookings count their members' leases as covered too (so a member already running
is not counted as a GPU to clear). Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from allocator.bookings.guarantees import Guarantee, GuaranteeState


@dataclass(frozen=True)
class Held:
    """A lease that holds GPUs, as bookings see it."""

    lease_id: str
    user: str
    groups: tuple[str, ...]
    model: str | None
    """Its one model (None: it mixes models, and no booking covers it)."""
    host: str
    units: Fraction
    granted_at: float


def on_its_gpus(guarantee: Guarantee, model: str | None, host: str | None) -> bool:
    """Whether GPUs of ``model`` on ``host`` are of the booking's kind."""
    return (model is not None and model == guarantee.model
            and (guarantee.host is None or guarantee.host == host))


def in_room(guarantee: Guarantee, room: Fraction, model: str | None, host: str | None,
            units: Fraction) -> bool:
    """Whether a grant of ``units`` of ``model`` on ``host`` falls in a booking's room: on
    its GPUs, and no more than the ``room`` it has left. The one test of it, for the grant,
    placement's quota and fair share's plan alike."""
    return on_its_gpus(guarantee, model, host) and units <= room


@dataclass(frozen=True)
class Share:
    """One booking in effect: its guarantee, the leases it covers, and its room."""

    guarantee: Guarantee
    covered: tuple[str, ...]
    """Lease ids it covers, oldest grant first."""
    room: Fraction
    """What it guarantees less what its covered leases hold (never below 0)."""

    @property
    def name(self) -> str:
        """The booking's name."""
        return self.guarantee.booking


@dataclass(frozen=True)
class Shares:
    """Every booking in effect at one instant, in the order they were admitted."""

    shares: tuple[Share, ...] = ()
    covered_by: Mapping[str, str] = field(default_factory=dict)
    """Lease id -> the booking covering it."""

    def active(self) -> list[Share]:
        """The shares whose window runs now."""
        return [s for s in self.shares if s.guarantee.state is GuaranteeState.ACTIVE]

    def upcoming(self) -> list[Share]:
        """The shares whose window starts within their lead."""
        return [s for s in self.shares if s.guarantee.state is GuaranteeState.UPCOMING]

    def share_for(self, user: str, groups: Sequence[str], models: Collection[str] | None,
                  host: str | None) -> Share | None:
        """The first active booking the user is a member of, with room, whose GPUs the request
        may take (``models`` None: any model; ``host`` None: any host)."""
        for share in self.shares:
            g = share.guarantee
            if (g.state is GuaranteeState.ACTIVE and share.room > 0 and g.covers(user, groups)
                    and (models is None or g.model in models)
                    and (host is None or g.host is None or g.host == host)):
                return share
        return None


def shares_of(guarantees: Sequence[Guarantee], held: Sequence[Held]) -> Shares:
    """The shares of ``guarantees`` (active and upcoming, in the order admitted) over the
    leases ``held``."""
    if not guarantees:
        return Shares()
    oldest_first = sorted(held, key=lambda h: (h.granted_at, h.lease_id))
    covered_by: dict[str, str] = {}
    shares: list[Share] = []
    for guarantee in guarantees:
        total = Fraction(0)
        covered: list[str] = []
        limit = Fraction(guarantee.guaranteed)
        for holding in oldest_first:
            if (holding.lease_id in covered_by
                    or not on_its_gpus(guarantee, holding.model, holding.host)
                    or not guarantee.covers(holding.user, holding.groups)):
                continue
            if total + holding.units > limit:
                continue  # a smaller, younger lease may still fit: keep looking
            total += holding.units
            covered.append(holding.lease_id)
            covered_by[holding.lease_id] = guarantee.booking
        shares.append(Share(guarantee, tuple(covered), max(limit - total, Fraction(0))))
    return Shares(tuple(shares), covered_by)


@dataclass(frozen=True)
class Occupant:
    """A non-member's lease on a booking's GPUs that no booking covers."""

    lease_id: str
    gpu_uuids: frozenset[str]
    """Its GPUs of the booking's kind."""
    idle_s: float
    granted_at: float
    warned: bool


def to_clear(share: Share, free_gpus: int, occupants: Sequence[Occupant],
             claimed_by: Mapping[str, frozenset[str]], idle_window_s: float) -> list[str]:
    """The occupants to warn before ``share``'s window starts: the fewest, in the order
    reclaim takes victims (already warned, then idle for the window, longest idle first,
    then the newest grant), whose going frees the GPUs the booking lacks beyond the
    ``free_gpus`` of its kind. ``claimed_by``: GPU uuid -> every lease claiming it (a GPU is
    freed when all of them go). Empty when nothing is lacking."""
    lacking = share.room - free_gpus
    if lacking <= 0:
        return []
    order = sorted(occupants, key=lambda o: (
        not o.warned, o.idle_s < idle_window_s,
        -o.idle_s if o.idle_s >= idle_window_s else 0.0, -o.granted_at, o.lease_id))
    chosen: list[str] = []
    going: set[str] = set()
    freed: set[str] = set()
    for occupant in order:
        chosen.append(occupant.lease_id)
        going.add(occupant.lease_id)
        for uuid in occupant.gpu_uuids:
            if claimed_by.get(uuid, frozenset()) <= going:
                freed.add(uuid)
        if len(freed) >= lacking:
            break
    return chosen
