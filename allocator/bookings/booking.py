"""A booking as data: who gets which GPUs when, and the error codes of everything that can be
wrong with one.

A booking names its members (a group, or a list of users: one of them), its GPUs by the same
selection as a request (a model name or alias as :mod:`allocator.wire.model_names` reads it, a MIG
profile, a count, optionally a host) and a window in an IANA time zone the admin names: a
one-off start and end, or a weekly recurrence (weekdays, a local start time, a duration, and
the date it ends on). Times are local wall-clock times in that zone, in whole minutes;
:mod:`allocator.bookings.windows` turns them into UTC instants.

The models are strict (no field of the wrong type is converted, none unknown is accepted) and
every string and list is bounded. Rules that need nothing but the booking itself (a known
zone, an end after the start, a recurrence with an end, occurrences that do not overlap each
other) are checked here; rules that need the clock or the cluster are
:mod:`allocator.bookings.checks`'. Each rule fails with a :class:`BookingErrorCode`, so a
caller can branch on it; :func:`read_booking` turns pydantic's errors into one
:class:`BookingProblem`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta
from enum import StrEnum
from typing import Annotated, Any, Final, Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError, available_timezones

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from allocator.bookings.local_time import instant_of
from allocator.wire.protocol import ErrorCode, MigProfile, Name

MAX_BOOKED_GPUS: Final = 4096
"""The most GPUs one booking may hold (a booking spans hosts, unlike one lease)."""

MAX_BOOKING_USERS: Final = 1000
"""The most users a booking may list by name (a larger class is a group)."""

MAX_LEAD_S: Final = 24 * 3600
"""The longest warning a booking may give borrowers before its window."""

WEEK_S: Final = 7 * 24 * 3600

MAX_ZONE: Final = 64
"""The longest IANA zone name accepted (the longest in the database is about 30)."""


class BookingErrorCode(StrEnum):
    """Stable codes of what is wrong with a booking. Programs branch on these; each comes with
    a message for people. Each is the wire's :class:`~allocator.wire.protocol.ErrorCode` of
    the same name (``bad_booking`` is answered as ``bad_request``), written there once."""

    BAD_BOOKING = "bad_booking"
    """A field is missing, of the wrong type or out of range; the message says which."""
    UNKNOWN_ZONE = ErrorCode.UNKNOWN_ZONE.value
    """The time zone is not an IANA zone name this machine knows (``Europe/Berlin``)."""
    WINDOW_ENDS_BEFORE_START = ErrorCode.WINDOW_ENDS_BEFORE_START.value
    """The window ends at or before its start (or the recurrence ends before it starts)."""
    RECURRENCE_WITHOUT_END = ErrorCode.RECURRENCE_WITHOUT_END.value
    """A weekly booking without ``until``: a booking holds GPUs, so it must end."""
    WINDOWS_OVERLAP = ErrorCode.WINDOWS_OVERLAP.value
    """A weekly window longer than the time to the next weekday it recurs on."""
    NO_OCCURRENCE = ErrorCode.NO_OCCURRENCE.value
    """A weekly booking none of whose weekdays falls between its first and last date."""
    WINDOW_IN_PAST = ErrorCode.WINDOW_IN_PAST.value
    """Every occurrence of the window has already ended."""
    TOO_FAR_AHEAD = ErrorCode.TOO_FAR_AHEAD.value
    """The window reaches beyond the horizon bookings may be made for."""
    UNKNOWN_GROUP = ErrorCode.UNKNOWN_GROUP.value
    """No group of that name is configured."""
    UNKNOWN_MODEL = ErrorCode.UNKNOWN_MODEL.value
    """No GPU model (or MIG profile of it) of that name or alias is known."""
    UNKNOWN_HOST = ErrorCode.UNKNOWN_HOST.value
    """No GPU node of that name is known."""
    COUNT_OVER_CAPACITY = ErrorCode.COUNT_OVER_CAPACITY.value
    """More GPUs than the cluster (or the named host) has of that model."""
    COLLIDES = ErrorCode.COLLIDES.value
    """The booking does not fit next to the bookings already made for its windows."""


@dataclass(frozen=True)
class BookingProblem:
    """Why a booking is refused: a stable code, a message for people, details for programs."""

    code: BookingErrorCode
    message: str
    details: dict[str, Any] = field(default_factory=dict)


def _error(code: BookingErrorCode, message: str) -> PydanticCustomError:
    # The message goes in as context, not as the template: a zone or name a person typed may
    # hold braces, which a template would try to fill.
    return PydanticCustomError(code.value, "{detail}", {"detail": message})


def _iso_text_or(kind: type[Any], what: str) -> Any:
    """A check before pydantic's: ``kind`` itself, or ISO 8601 text. Pydantic would also read
    a number as a date or time (seconds since 1970), which no admin means."""

    def check(value: Any) -> Any:
        if isinstance(value, str) or (isinstance(value, kind) and not isinstance(value, bool)):
            return value
        raise _error(BookingErrorCode.BAD_BOOKING, f"{what} must be ISO 8601 text")

    return BeforeValidator(check)


LocalDateTime = Annotated[datetime, _iso_text_or(datetime, "a date and time ('2026-12-08T10:00')")]
LocalTime = Annotated[time, _iso_text_or(time, "a time of day ('10:00')")]
Day = Annotated[date, _iso_text_or(date, "a date ('2027-02-14')")]

Weekday = Literal["mon", "tue", "wed", "thu", "fri", "sat", "sun"]
"""A day of the week, as ``datetime.date.weekday()`` orders them (``mon`` is 0)."""

WEEKDAYS: Final[tuple[Weekday, ...]] = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


def _whole_minutes(value: datetime | time, what: str) -> None:
    if value.tzinfo is not None:
        raise _error(BookingErrorCode.BAD_BOOKING,
                     f"{what} is a local time in the booking's zone: give it without an offset")
    if value.second or value.microsecond:
        raise _error(BookingErrorCode.BAD_BOOKING, f"{what} must be in whole minutes")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class BookedGPUs(_Strict):
    """Which GPUs, as a request names them. The count is a pool over every host of the model
    (or of the one host named): each member's lease still takes its GPUs from one host."""

    model: Name = Field(description="A GPU model name or alias, as in a request.",
                        examples=["a100"])
    mig_profile: MigProfile | None = Field(
        default=None, description="A MIG profile of that model: its instances are booked.",
        examples=["1g.5gb"])
    count: StrictInt = Field(ge=1, le=MAX_BOOKED_GPUS, description="GPUs (or MIG instances).",
                             examples=[15])
    host: Name | None = Field(default=None, description="Only this node's GPUs.",
                              examples=["gpu-a"])


class OnceWindow(_Strict):
    """One window: local start and end in the booking's zone."""

    kind: Literal["once"] = "once"
    start: LocalDateTime = Field(examples=["2026-12-08T10:00"], strict=False)
    end: LocalDateTime = Field(examples=["2026-12-08T12:00"], strict=False)

    @field_validator("start", "end")
    @classmethod
    def _local_minutes(cls, value: datetime, info: ValidationInfo) -> datetime:
        _whole_minutes(value, f"the window's {info.field_name}")
        return value


class WeeklyWindow(_Strict):
    """A window on some weekdays each week: a local start time and a duration, from
    ``starts_on`` (or whenever the booking is made) to ``until`` (included)."""

    kind: Literal["weekly"] = "weekly"
    weekdays: tuple[Weekday, ...] = Field(min_length=1, max_length=7, strict=False,
                                          examples=[["tue"]])
    start: LocalTime = Field(examples=["10:00"], strict=False)
    duration_s: StrictInt = Field(gt=0, le=WEEK_S, examples=[7200],
                                  description="Whole minutes, in seconds.")
    starts_on: Day | None = Field(default=None, strict=False, examples=["2026-10-13"])
    until: Day | None = Field(default=None, strict=False, examples=["2027-02-09"],
                              description="The last day an occurrence may start on. Required.")

    @field_validator("start")
    @classmethod
    def _local_minutes(cls, value: time) -> time:
        _whole_minutes(value, "the weekly start time")
        return value

    @field_validator("weekdays")
    @classmethod
    def _distinct(cls, days: tuple[Weekday, ...]) -> tuple[Weekday, ...]:
        if len(set(days)) != len(days):
            raise _error(BookingErrorCode.BAD_BOOKING, "a weekday is listed twice")
        return tuple(sorted(days, key=WEEKDAYS.index))

    @model_validator(mode="after")
    def _consistent(self) -> WeeklyWindow:
        if self.duration_s % 60:
            raise _error(BookingErrorCode.BAD_BOOKING, "duration_s must be whole minutes")
        if self.until is None:
            raise _error(BookingErrorCode.RECURRENCE_WITHOUT_END,
                         "a weekly booking needs 'until', the last day it recurs on")
        if self.starts_on is not None and self.until < self.starts_on:
            raise _error(BookingErrorCode.WINDOW_ENDS_BEFORE_START,
                         f"the recurrence ends ({self.until}) before it starts "
                         f"({self.starts_on})")
        gap = self.shortest_gap_days() * 86400
        if self.duration_s > gap:
            raise _error(BookingErrorCode.WINDOWS_OVERLAP,
                         f"a window of {self.duration_s // 60} minutes is longer than the "
                         f"{gap // 86400} day(s) to its next weekday: one occurrence would "
                         "overlap the next")
        if self.starts_on is not None and not self.days(self.starts_on, self.until):
            raise _error(BookingErrorCode.NO_OCCURRENCE,
                         f"none of {', '.join(self.weekdays)} falls between {self.starts_on} "
                         f"and {self.until}")
        return self

    def shortest_gap_days(self) -> int:
        """Days from one chosen weekday to the next (7 for a single weekday)."""
        numbers = [WEEKDAYS.index(day) for day in self.weekdays]
        return min((numbers[(i + 1) % len(numbers)] - n) % 7 or 7
                   for i, n in enumerate(numbers))

    def days(self, first: date, last: date) -> list[date]:
        """The dates between ``first`` and ``last`` (both included, and within the booking's
        own ``starts_on``/``until``) an occurrence starts on."""
        if self.starts_on is not None:
            first = max(first, self.starts_on)
        if self.until is not None:
            last = min(last, self.until)
        chosen = {WEEKDAYS.index(day) for day in self.weekdays}
        found: list[date] = []
        day = first
        while day <= last:
            if day.weekday() in chosen:
                found.append(day)
            day += timedelta(days=1)
        return found


Window = Annotated[OnceWindow | WeeklyWindow, Field(discriminator="kind")]


def zone_named(name: str) -> ZoneInfo:
    """The IANA zone of that name, or a :class:`PydanticCustomError` coded ``unknown_zone``."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, OSError):
        # ValueError: not a zone key at all ("../etc/passwd", an absolute path); OSError: a
        # directory of the database ("Europe").
        if not available_timezones():
            # Every name would be unknown: say what to fix instead of blaming the name.
            raise _error(BookingErrorCode.UNKNOWN_ZONE,
                         f"{name!r} cannot be read: this machine has no time zone database "
                         "(install the operating system's tzdata, or the Python package "
                         "tzdata)") from None
        raise _error(BookingErrorCode.UNKNOWN_ZONE,
                     f"{name!r} is not a known IANA time zone; name one like "
                     "'Europe/Berlin' or 'America/New_York'") from None


class Booking(_Strict):
    """A booking: its members get ``gpus`` as a guarantee during each occurrence of
    ``window``; outside it those GPUs are ordinary capacity."""

    name: Name = Field(examples=["CS101 lab"])
    group: Name | None = Field(default=None, description="The members: this group's users.",
                               examples=["cs101"])
    users: tuple[Name, ...] | None = Field(
        default=None, min_length=1, max_length=MAX_BOOKING_USERS, strict=False,
        description="The members by name, instead of a group.", examples=[["alice", "bob"]])
    gpus: BookedGPUs
    zone: str = Field(max_length=MAX_ZONE, description="The IANA time zone of the window.",
                      examples=["Europe/Berlin"])
    window: Window
    lead_s: StrictInt | None = Field(
        default=None, ge=0, le=MAX_LEAD_S,
        description="How long before the window borrowers of the GPUs are warned; None: the "
        "allocator's default.")
    quota_applies: StrictBool = Field(
        default=True, description="Whether a member's own quota still limits what they take "
        "of the booking.")
    created_by: Name = Field(examples=["admin"])

    @field_validator("zone")
    @classmethod
    def _known_zone(cls, name: str) -> str:
        zone_named(name)
        return name

    @field_validator("users")
    @classmethod
    def _distinct_users(cls, users: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if users is not None and len(set(users)) != len(users):
            raise _error(BookingErrorCode.BAD_BOOKING, "a user is listed twice")
        return users

    @model_validator(mode="after")
    def _consistent(self) -> Booking:
        if (self.group is None) == (self.users is None):
            raise _error(BookingErrorCode.BAD_BOOKING,
                         "name the members by 'group' or by 'users', one of them")
        if isinstance(self.window, OnceWindow):
            # Compared as instants: a window from 02:10 to 02:40 on the night the clocks jump
            # from 02:00 to 03:00 is empty although its local end is after its start.
            zone = self.tz
            start, end = self.window.start, self.window.end
            if instant_of(end, zone) <= instant_of(start, zone):
                skipped = " (the clocks skip that time that day)" if end > start else ""
                raise _error(BookingErrorCode.WINDOW_ENDS_BEFORE_START,
                             f"the window ends ({end:%Y-%m-%d %H:%M}) at or before it starts "
                             f"({start:%Y-%m-%d %H:%M}) in {self.zone}{skipped}")
        return self

    @property
    def tz(self) -> ZoneInfo:
        """The booking's zone (``zoneinfo`` caches zones, so this is cheap)."""
        return ZoneInfo(self.zone)


_CODES: Final = frozenset(code.value for code in BookingErrorCode)


def problem_of(error: ValidationError) -> BookingProblem:
    """One problem for everything pydantic found: the code of the first error that has a
    booking's code (else ``bad_booking``), and every error in the message, each with where it
    is (``window.until: ...``)."""
    errors = error.errors(include_url=False, include_input=False)
    code = next((BookingErrorCode(e["type"]) for e in errors if e["type"] in _CODES),
                BookingErrorCode.BAD_BOOKING)
    parts = []
    for e in errors:
        # Pydantic puts the union member's tag in the location ("window.weekly.until");
        # people wrote "window.until".
        where = ".".join(str(p) for p in e["loc"] if p not in ("once", "weekly"))
        message = e["msg"].removeprefix("Value error, ")
        parts.append(f"{where}: {message}" if where else message)
    return BookingProblem(code, "; ".join(parts), {"errors": [
        {"loc": [str(p) for p in e["loc"]], "type": e["type"], "msg": e["msg"]}
        for e in errors]})


def read_booking(data: Mapping[str, Any]) -> Booking | BookingProblem:
    """A booking from a request's body (JSON types: text for dates and times), or the one
    problem that says what is wrong with it."""
    try:
        return Booking.model_validate(data)
    except ValidationError as error:
        return problem_of(error)
