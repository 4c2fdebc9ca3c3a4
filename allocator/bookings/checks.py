"""A booking checked against the clock and the cluster, its model resolved.

The checks, in this order, each with one :class:`~allocator.bookings.booking.BookingErrorCode`
(the first that fails is the answer):

1. ``unknown_group``: the group is not one the allocator's settings name;
2. ``unknown_model``: the model (or its MIG profile) is not one the cluster knows, by
   :mod:`allocator.wire.model_names`' rule, aliases included (the message lists the known ones);
3. ``unknown_host``: the host is not a GPU node the cluster knows;
4. ``count_over_capacity``: more GPUs than the cluster (or the host) has of the model;
5. ``window_in_past``: every occurrence has already ended (a window already begun is
   accepted: the rest of it is booked);
6. ``too_far_ahead``: the window reaches beyond ``horizon_s`` from now.

Users listed by name are not checked: the allocator does not know the hub's users. Whether a
booking fits next to the other bookings is :mod:`allocator.bookings.admission`'s question.

Pure: no I/O, no clock (``now`` is passed in).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Final

from allocator.bookings.booking import (
    Booking,
    BookingErrorCode,
    BookingProblem,
    OnceWindow,
)
from allocator.bookings.local_time import instant_of, local_at
from allocator.bookings.supply import Capacity, Draw
from allocator.bookings.windows import Occurrence, occurrences
from allocator.wire.model_names import ModelNameError, ModelNames, mig_model_name, mig_parts

DEFAULT_HORIZON_S: Final = 400 * 24 * 3600
"""How far ahead bookings may reach by default: a university year and a term's margin. It
also bounds what admission sweeps over."""


@dataclass(frozen=True)
class ResolvedBooking:
    """A booking as the policy counts it: its GPUs' model resolved to the canonical name (a MIG
    profile's instance model, ``NVIDIA A100-SXM4-40GB MIG 1g.5gb``)."""

    booking: Booking
    model: str

    @property
    def name(self) -> str:
        """The booking's name."""
        return self.booking.name

    @property
    def draw(self) -> Draw:
        """What it claims while one of its occurrences lasts."""
        return Draw(self.model, self.booking.gpus.host, self.booking.gpus.count)

    def occurrences(self, since: int, until: int) -> list[Occurrence]:
        """Its occurrences overlapping ``[since, until)``."""
        return occurrences(self.booking, since, until)



@dataclass(frozen=True)
class ClusterFacts:
    """What a booking is checked against: the settings' groups, the cluster's model names and
    the GPUs bookings may draw on."""

    groups: frozenset[str]
    names: ModelNames
    capacity: Capacity
    hosts: frozenset[str] = field(default_factory=frozenset)
    """GPU nodes known besides those of ``capacity`` (a drained node is known, with no GPU
    to book)."""


def resolve_model(booking: Booking, names: ModelNames) -> str | BookingProblem:
    """The canonical model the booking's GPUs are: the named model, or with a MIG profile the
    instance model of that profile of the named GPU model."""
    gpus = booking.gpus
    resolved = names.resolve([gpus.model])
    if isinstance(resolved, ModelNameError):
        return BookingProblem(BookingErrorCode.UNKNOWN_MODEL, resolved.message, resolved.details)
    model = resolved[0]
    if gpus.mig_profile is None:
        return model
    parts = mig_parts(model)
    parent = parts[0] if parts is not None else model
    instance = mig_model_name(parent, gpus.mig_profile)
    if instance in names.known:
        return instance
    profiles = sorted(p[1] for p in map(mig_parts, names.known) if p is not None and p[0] == parent)
    known = ", ".join(profiles) if profiles else "none (no GPU of it is in MIG mode)"
    return BookingProblem(
        BookingErrorCode.UNKNOWN_MODEL,
        f"No {parent} has MIG profile {gpus.mig_profile!r}. Its known profiles: {known}.",
        {"model": parent, "mig_profile": gpus.mig_profile, "known": profiles})


def _window_span(booking: Booking, now: int, horizon_s: int) -> BookingProblem | None:
    zone = booking.tz
    window = booking.window
    horizon = now + horizon_s
    if isinstance(window, OnceWindow):
        if instant_of(window.end, zone) <= now:
            return BookingProblem(
                BookingErrorCode.WINDOW_IN_PAST,
                f"The window ended at {window.end:%Y-%m-%d %H:%M} ({booking.zone}); it is "
                f"{local_at(now, zone):%Y-%m-%d %H:%M} there now.",
                {"end": window.end.isoformat()})
        last_instant = instant_of(window.end, zone)
    else:
        assert window.until is not None  # the model refuses a recurrence without an end
        last_start = datetime.combine(window.until, window.start)
        last_instant = instant_of(last_start + timedelta(seconds=window.duration_s), zone)
        if not occurrences(booking, now, last_instant + 1):
            return BookingProblem(
                BookingErrorCode.WINDOW_IN_PAST,
                f"Every occurrence up to {window.until} has ended; it is "
                f"{local_at(now, zone):%Y-%m-%d %H:%M} in {booking.zone} now.",
                {"until": window.until.isoformat()})
    if last_instant > horizon:
        return BookingProblem(
            BookingErrorCode.TOO_FAR_AHEAD,
            f"The window reaches {local_at(last_instant, zone):%Y-%m-%d} ({booking.zone}); "
            f"bookings may reach {horizon_s // 86400} days ahead, to "
            f"{local_at(horizon, zone):%Y-%m-%d}.",
            {"horizon_s": horizon_s})
    return None


def check_booking(booking: Booking, now: int, facts: ClusterFacts, *,
                  horizon_s: int = DEFAULT_HORIZON_S) -> ResolvedBooking | BookingProblem:
    """The booking with its model resolved, or the first rule it breaks (see the module)."""
    if booking.group is not None and booking.group not in facts.groups:
        known = ", ".join(sorted(facts.groups)) or "none are configured"
        return BookingProblem(BookingErrorCode.UNKNOWN_GROUP,
                              f"No group is called {booking.group!r}. Known groups: {known}.",
                              {"group": booking.group, "known": sorted(facts.groups)})
    model = resolve_model(booking, facts.names)
    if isinstance(model, BookingProblem):
        return model
    host = booking.gpus.host
    hosts = set(facts.hosts) | {h for by_host in facts.capacity.gpus.values() for h in by_host}
    if host is not None and host not in hosts:
        return BookingProblem(BookingErrorCode.UNKNOWN_HOST,
                              f"No GPU node is called {host!r}. Known hosts: "
                              f"{', '.join(sorted(hosts)) or 'none yet'}.",
                              {"host": host, "known": sorted(hosts)})
    has = facts.capacity.on(model, host)
    if booking.gpus.count > has:
        where = f"{host} has" if host is not None else "the cluster has"
        return BookingProblem(
            BookingErrorCode.COUNT_OVER_CAPACITY,
            f"{booking.gpus.count} GPUs of {model} asked for; {where} {has} "
            f"({facts.capacity.hosts_text(model)}).",
            {"count": booking.gpus.count, "model": model, "host": host, "capacity": has})
    span = _window_span(booking, now, horizon_s)
    return span if span is not None else ResolvedBooking(booking, model)

