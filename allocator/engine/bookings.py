"""The bookings the allocator keeps (:mod:`allocator.bookings`): loaded from the ledger,
added and removed by admins' ``booking`` requests, each change written to the ledger (and so
replicated with its log) with an event that says who made it.

:class:`BookingBook` owns them in the order they were admitted (that order decides who is
served first when GPUs went away, :mod:`allocator.bookings.supply`). What the engine's other
parts read is :meth:`BookingBook.resolved`: each booking with its model resolved against the
cluster's model names, resolved again when the inventory changes (a model may appear, or
its last GPU go). A booking whose model the cluster does not know now is kept and left out
of :meth:`~BookingBook.resolved` until it is known again.

The policy (checks, admission, shortfall) is the pure core's; this part adds the clock, the
cluster and the ledger.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from pydantic import BaseModel

from allocator.bookings.admission import admit
from allocator.bookings.booking import Booking, BookingErrorCode, BookingProblem, read_booking
from allocator.bookings.checks import (
    DEFAULT_HORIZON_S,
    ClusterFacts,
    ResolvedBooking,
    check_booking,
    resolve_model,
)
from allocator.bookings.shortfall import shortfalls
from allocator.bookings.supply import Capacity
from allocator.bookings.windows import occurrences
from allocator.config import AllocatorSettings
from allocator.engine.nodes import NodeReports
from allocator.engine.state import Sender, log
from allocator.ledger.changes import Changes
from allocator.ledger.loaded import BookingRow, LoadedState
from allocator.placement.cluster import Cluster
from allocator.placement.demand import model_names
from allocator.wire.model_names import ModelNames
from allocator.wire.protocol import (
    BookingOccurrence,
    BookingReply,
    BookingRequest,
    BookingView,
    ErrorCode,
    ErrorReply,
    error_reply,
)

NEXT_OCCURRENCES: Final = 3
"""How many coming occurrences a booking's view lists."""

MAX_SHORTFALLS: Final = 5
"""How many short occurrences a booking's view lists (the first ones)."""


def error_code_of(code: BookingErrorCode) -> ErrorCode:
    """The protocol's code of a booking problem: the same name, but a malformed booking is
    a ``bad_request`` like any malformed request."""
    if code is BookingErrorCode.BAD_BOOKING:
        return ErrorCode.BAD_REQUEST
    return ErrorCode(code.value)


def refusal(problem: BookingProblem) -> ErrorReply:
    """A booking problem as the error reply that carries it."""
    return error_reply(error_code_of(problem.code), problem.message, **problem.details)


def booking_groups(settings: AllocatorSettings) -> frozenset[str]:
    """The groups a booking may name: those the settings give a quota or borrow limit (of
    every model or of one)."""
    return frozenset({*settings.group_quota, *settings.group_borrow_limit,
                      *settings.group_model_quota, *settings.group_model_borrow_limit})


@dataclass(frozen=True)
class StoredBooking:
    """A booking held, with its ledger row (who made it, when)."""

    row: BookingRow
    booking: Booking


class BookingBook:
    """The bookings, in the order they were admitted, and the admins' requests that change
    them."""

    def __init__(self, settings: AllocatorSettings, cluster: Cluster, nodes: NodeReports) -> None:
        self.settings = settings
        self.cluster = cluster
        self.nodes = nodes
        self._stored: dict[str, StoredBooking] = {}
        """By name, in the order admitted (a dict keeps the order of insertion)."""
        self._resolved: tuple[ResolvedBooking, ...] | None = None
        """:meth:`resolved`'s answer until the bookings or the inventory change."""
        self.version = 0
        """Goes up whenever the bookings or the GPUs change (memory only; compared, never
        read as a number)."""

    # ------------------------------------------------------------------ state

    def load(self, state: LoadedState) -> None:
        """Take the ledger's bookings. A row that no longer reads as a booking (written by a
        newer release, or a zone this machine's database lacks) is left out and logged: it
        stays in the ledger, and a later start that reads it holds it again."""
        self._stored.clear()
        for row in state.bookings:
            booking = read_booking(row.booking)
            if isinstance(booking, BookingProblem):
                log.error("booking %r in the ledger does not read (%s: %s); it is not held",
                          row.name, booking.code.value, booking.message)
                continue
            self._stored[row.name] = StoredBooking(row, booking)
        self._resolved = None
        self.version += 1

    def inventory_changed(self) -> None:
        """The GPUs changed: resolve the bookings' models again when next asked."""
        self._resolved = None
        self.version += 1

    def all(self) -> Sequence[Booking]:
        """Every booking held, in the order admitted."""
        return [stored.booking for stored in self._stored.values()]

    def resolved(self) -> Sequence[ResolvedBooking]:
        """The bookings whose model the cluster knows now, resolved, in the order admitted."""
        if self._resolved is None:
            names = self._names()
            found = []
            for stored in self._stored.values():
                model = resolve_model(stored.booking, names)
                if isinstance(model, str):
                    found.append(ResolvedBooking(stored.booking, model))
            self._resolved = tuple(found)
        return self._resolved

    def capacity(self, now: float) -> Capacity:
        """The GPUs bookings may draw on now: present, not a GPU in MIG mode itself (its
        instances count), not drained, within what the site declared for its node
        (``declared_gpus``), on a node that is up and not drained."""
        nodes = self.cluster.nodes
        counted = []
        for gpu in self.cluster.gpus.values():
            node = nodes.get(gpu.host)
            if (node is None or node.drained or gpu.drained or not gpu.present
                    or gpu.mig_enabled or gpu.undeclared is not None
                    or not self.nodes.up(node, now)):
                continue
            counted.append((gpu.host, gpu.model))
        return Capacity.of_gpus(counted)

    def _names(self) -> ModelNames:
        return model_names(self.cluster, self.settings.aliases)

    # ------------------------------------------------------------------ requests

    def handle(self, request: BookingRequest, sender: Sender, now: float,
               changes: Changes) -> BaseModel:
        """An admin's booking request: add, remove or list."""
        if sender.user_id not in self.settings.admin_users:
            return error_reply(ErrorCode.FORBIDDEN,
                               f"booking is for admins; broker user {sender.user_id!r} is not "
                               "in admin_users")
        by = f"{request.by} ({sender.user_id})"
        if request.op == "add":
            assert request.booking is not None  # the request's own check
            return self._add(request.booking, request.by, by, request.reason, now, changes)
        if request.op == "remove":
            assert request.name is not None
            return self._remove(request.name, by, request.reason, now, changes)
        return BookingReply(op="list", at=now, bookings=self.views(now))

    def _add(self, body: dict[str, Any], who: str, by: str, reason: str, now: float,
             changes: Changes) -> BaseModel:
        booking = read_booking({**body, "created_by": who})
        if isinstance(booking, BookingProblem):
            return refusal(booking)
        if booking.name in self._stored:
            return error_reply(ErrorCode.CONFLICT,
                               f"a booking named {booking.name!r} exists; remove it first "
                               "(or give another name)", name=booking.name)
        capacity = self.capacity(now)
        facts = ClusterFacts(booking_groups(self.settings), self._names(), capacity,
                             frozenset(self.cluster.nodes))
        checked = check_booking(booking, int(now), facts)
        if isinstance(checked, BookingProblem):
            return refusal(checked)
        admission = admit(checked, self.resolved(), capacity, int(now))
        problem = admission.problem(checked)
        if problem is not None:
            return refusal(problem)
        row = BookingRow(booking.name, booking.model_dump(mode="json"), now, by)
        self._stored[booking.name] = StoredBooking(row, booking)
        self._resolved = None
        self.version += 1
        changes.booking(row)
        gpus = booking.gpus
        changes.event(now, "booking_added", host=gpus.host, booking=booking.name, by=by,
                      reason=reason, model=checked.model, count=gpus.count,
                      group=booking.group, users=list(booking.users or ()), zone=booking.zone,
                      occurrences=admission.occurrences)
        return BookingReply(op="add", at=now, bookings=self.views(now, only=booking.name))

    def _remove(self, name: str, by: str, reason: str, now: float,
                changes: Changes) -> BaseModel:
        stored = self._stored.get(name)
        if stored is None:
            return error_reply(ErrorCode.NOT_FOUND,
                               f"no booking {name!r}; held: "
                               + (", ".join(self._stored) or "none"),
                               known=list(self._stored))
        view = self.views(now, only=name)
        del self._stored[name]
        self._resolved = None
        self.version += 1
        row = stored.row
        changes.booking(BookingRow(row.name, row.booking, row.created_at, row.created_by,
                                   removed_at=now, removed_by=by))
        changes.event(now, "booking_removed", booking=name, by=by, reason=reason)
        return BookingReply(op="remove", at=now, bookings=view)

    # ------------------------------------------------------------------ views

    def views(self, now: float, only: str | None = None) -> list[BookingView]:
        """Every booking (or the one named ``only``) with its next occurrences and its short
        ones, in the order admitted."""
        t = int(now)
        resolved = self.resolved()
        model_of = {booking.name: booking for booking in resolved}
        short: dict[str, list[str]] = {}
        for found in shortfalls(resolved, self.capacity(now), t, t + DEFAULT_HORIZON_S):
            texts = short.setdefault(found.booking, [])
            if len(texts) < MAX_SHORTFALLS:
                texts.append(found.text(model_of[found.booking]))
        views = []
        for name, stored in self._stored.items():
            if only is not None and name != only:
                continue
            booking = stored.booking
            known = model_of.get(name)
            if known is None:
                model = None
                texts = [f"Booking {name!r}: no GPU of {booking.gpus.model!r} is known now; "
                         "it is kept and gets its GPUs when they are back."]
            else:
                model, texts = known.model, short.get(name, [])
            upcoming = occurrences(booking, t, t + DEFAULT_HORIZON_S)[:NEXT_OCCURRENCES]
            views.append(BookingView(
                name=name, booking=stored.row.booking, model=model,
                created_at=stored.row.created_at, created_by=stored.row.created_by,
                next=[BookingOccurrence(start=o.start, end=o.end,
                                        local_start=o.local_start.isoformat())
                      for o in upcoming],
                shortfalls=texts))
        return views
