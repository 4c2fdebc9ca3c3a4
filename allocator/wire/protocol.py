"""The swarm-gpu wire protocol: every message that crosses the broker, as pydantic v2 models.

Every body is one JSON object with ``"v": 1`` (the protocol version) and a ``"kind"``
that names the message. Requests go to the allocator; replies come back through
RabbitMQ's direct reply-to with the request's correlation id. Node messages
(heartbeats and container events) are fire-and-forget. ``docs/protocol.md`` documents
each message with an example; this module is the single source of truth for both.

This module is the allocator's public surface: the node agent and the hub plugin import
it (and :mod:`allocator.amqp.client`), never the ledger or the policy.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from enum import StrEnum
from typing import Annotated, Any, Final, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    StrictInt,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from allocator.wire.interconnect import HostInterconnect

PROTOCOL_VERSION: Final = 1
"""The protocol version this code speaks. A message with any other ``v`` is refused."""

MAX_BODY_BYTES = 256 * 1024
"""Bodies larger than this are refused unparsed (``too_large``): a heartbeat of a
host with 16 GPUs and 64 containers is about 20 KiB."""

MAX_COUNT = 64
"""The largest GPU count one lease may ask for; more is a ``bad_request``, not a queue entry."""

MAX_WAIT_S = 24 * 3600.0
"""The longest a request may wait in the queue."""

MAX_NAME = 200
"""The longest identifier (user, host, model, request key...) a message may carry."""

PRINTABLE = r"^[^\x00-\x1f\x7f]+$"
"""The pattern of an identifier: at least one character, none of them a control character."""

Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME, pattern=PRINTABLE)]
"""A printable identifier (user, host, model, request key...)."""

MAX_MODELS = 32
"""The most models one request may list as acceptable (``AllocateRequest.models``)."""

MAX_GROUPS = 64
"""The most groups one request may name."""

MAX_TEXT = 500
"""The longest free text (a reason, a health verdict) a message may carry."""

Text = Annotated[str, Field(max_length=MAX_TEXT)]
"""Free text for people: bounded, so that one message cannot bloat every later reply."""

Count64 = Annotated[StrictInt, Field(ge=0, le=(1 << 63) - 1)]
"""A non-negative counter that fits a signed 64-bit integer (SQLite's, and most languages')."""

WIRE: Final = {"wire": True}
"""Validation context of a body read off the broker: :func:`decode_inbound` and
:func:`decode_agent_command` validate with it, in strict mode (``"60"`` is not a number and
``"yes"`` not a boolean), and it makes ``"v"`` required. Messages built in Python get ``v``
by default."""

READ_EXTRA: Final = "ignore"
"""What a reader does with a field it does not know, in every body it reads off the wire
(requests, node messages, replies, agent commands): it ignores it, at any depth, while every
field it knows is checked as strictly as ever. The models themselves forbid unknown fields, so
a message built in Python with a misspelt field is still an error. This is the compatibility
rule of ``docs/protocol.md`` ("Compatibility"): an added field must never make an older reader
refuse a message (0.1.0 forbade them, and a new field took hosts down and made grants
unreadable); ``v`` changes only for a change an older reader must not take."""

CLIENT_RELEASE_HEADER: Final = "swarm-gpu-release"
"""The AMQP header in which a client names the newest release whose reply fields it reads
(its own version, ``"0.2.0"``). Replies carry a field added in a later release than that, or
in any release after 0.1.0 when the header is missing, only for a client that says it reads
it: a 0.1.0 client refuses a reply with a field it does not know (docs/protocol.md,
"Compatibility"). The header is outside the body, so an allocator of 0.1.0 takes the request
as it always did."""

OLDEST_READER: Final = (0, 1, 0)
"""What a request without :data:`CLIENT_RELEASE_HEADER` is answered as: release 0.1.0, the last
one whose clients refuse unknown reply fields."""

SINCE: Final = "since"
"""The ``json_schema_extra`` key of a reply field added after 0.1.0: the release that added it
(``Field(json_schema_extra={SINCE: "0.2.0"})``). Such a field goes only to a client whose
:data:`CLIENT_RELEASE_HEADER` is that release or later."""


def release_tuple(release: object) -> tuple[int, int, int] | None:
    """``"0.2.0"`` → ``(0, 2, 0)``; None for anything that is not a release number (a header a
    client filled wrongly is answered as :data:`OLDEST_READER`)."""
    if not isinstance(release, str | bytes):
        return None
    text = release.decode("ascii", "replace") if isinstance(release, bytes) else release
    parts = text.strip().split(".")
    if len(parts) != 3 or not all(part.isdigit() and len(part) <= 6 for part in parts):
        return None
    major, minor, patch = (int(part) for part in parts)
    return major, minor, patch


def _field_since(field: Any) -> tuple[int, int, int] | None:
    extra = field.json_schema_extra
    if isinstance(extra, dict):
        return release_tuple(extra.get(SINCE))
    return None


class _ReleaseAware(BaseModel):
    """A reply model with fields added after 0.1.0: serialized for an older reader (the
    serialization context's ``"release"``), it leaves out the fields added after that
    release, at any depth."""

    @model_serializer(mode="wrap")
    def _for_the_reader(self, handler: SerializerFunctionWrapHandler,
                        info: SerializationInfo) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        context = info.context
        reader = context.get("release") if isinstance(context, dict) else None
        if reader is None:
            return data
        for name, since in _added_fields(type(self)):
            if since > reader:
                data.pop(name, None)
        return data


_ADDED: dict[type[BaseModel], tuple[tuple[str, tuple[int, int, int]], ...]] = {}


def _added_fields(model: type[BaseModel]) -> tuple[tuple[str, tuple[int, int, int]], ...]:
    """The fields of ``model`` that carry :data:`SINCE`, with their release (cached per model:
    this runs for every lease of every reply to an older client)."""
    added = _ADDED.get(model)
    if added is None:
        added = tuple((name, since) for name, field in model.model_fields.items()
                      if (since := _field_since(field)) is not None)
        _ADDED[model] = added
    return added


MAX_MIB = 1 << 30
"""The largest memory size in MiB a message may carry (1 PiB)."""

MiB = Annotated[StrictInt, Field(ge=0, le=MAX_MIB)]
"""A memory size in MiB (up to 1 PiB)."""

ComputeCapability = Annotated[str, Field(pattern=r"^[0-9]{1,2}\.[0-9]{1,2}$",
                                         examples=["8.0"])]
"""A CUDA compute capability, ``"major.minor"``."""

Architecture = Annotated[str, Field(pattern=r"^[a-z0-9]{1,32}$", examples=["ampere"])]
"""A GPU architecture as NVML names it, in lower case (``pascal``, ``ampere``, ``hopper``)."""

MigProfile = Annotated[str, Field(pattern=r"^[0-9a-z.+]{1,32}$", examples=["1g.5gb"])]
"""A MIG GPU instance profile (``1g.5gb``, ``3g.20gb``, ``1c.2g.10gb``)."""


def capability_tuple(capability: str) -> tuple[int, int]:
    """``"8.6"`` → ``(8, 6)``, so capabilities compare as numbers ("10.0" > "9.0")."""
    major, _, minor = capability.partition(".")
    return int(major), int(minor or 0)


class ErrorCode(StrEnum):
    """Stable error codes. Clients branch on these; the message is for people."""

    BAD_REQUEST = "bad_request"
    """The message parsed but a field is missing, of the wrong type or out of range."""
    UNSUPPORTED_VERSION = "unsupported_version"
    """``v`` is not a version this allocator speaks."""
    TOO_LARGE = "too_large"
    """The body is larger than :data:`MAX_BODY_BYTES`."""
    UNKNOWN_MODEL = "unknown_model"
    """No GPU in the cluster has that model or alias; the message lists the known ones."""
    UNKNOWN_HOST = "unknown_host"
    """No node of that name has ever sent a heartbeat."""
    UNSATISFIABLE = "unsatisfiable"
    """Even an empty cluster could never satisfy the request (e.g. 9 GPUs on 8-GPU hosts)."""
    NO_CAPACITY = "no_capacity"
    """It could fit, but not now, and the request did not ask to wait (or its wait ran out)."""
    QUOTA_EXCEEDED = "quota_exceeded"
    """Granting would take the user or one of their groups over its GPU quota."""
    NOT_SHAREABLE = "not_shareable"
    """A shared slice was asked of a model that is configured exclusive-only."""
    NOT_FOUND = "not_found"
    """No lease or request with that id or key."""
    FORBIDDEN = "forbidden"
    """The sender may not do this (admin action from a non-admin, heartbeat for a host that
    is not the sender's)."""
    CONFLICT = "conflict"
    """The request contradicts the ledger (e.g. a request key reused for another user)."""
    STORAGE_ERROR = "storage_error"
    """The ledger could not be written (disk full, read-only); nothing was granted."""
    INTERNAL_ERROR = "internal_error"
    """A bug; the message says where to look. The request had no effect."""
    TIMEOUT = "timeout"
    """Client side only: no reply arrived within the call's timeout."""
    UNAVAILABLE = "unavailable"
    """Client side only: the broker could not be reached."""
    # What is wrong with a booking (0.3.0). Only the answer to a ``booking`` request carries
    # these, and only a 0.3.0 client sends one: no older client ever reads them.
    UNKNOWN_ZONE = "unknown_zone"
    """A booking's time zone is not an IANA zone name the allocator knows."""
    WINDOW_ENDS_BEFORE_START = "window_ends_before_start"
    """A booking's window (or its recurrence) ends at or before its start."""
    RECURRENCE_WITHOUT_END = "recurrence_without_end"
    """A weekly booking without ``until``."""
    WINDOWS_OVERLAP = "windows_overlap"
    """A weekly window longer than the time to the next weekday it recurs on."""
    NO_OCCURRENCE = "no_occurrence"
    """A weekly booking none of whose weekdays falls between its first and last date."""
    WINDOW_IN_PAST = "window_in_past"
    """Every occurrence of a booking's window has already ended."""
    TOO_FAR_AHEAD = "too_far_ahead"
    """A booking's window reaches beyond the horizon bookings may be made for."""
    UNKNOWN_GROUP = "unknown_group"
    """A booking names a group no setting of the allocator names."""
    COUNT_OVER_CAPACITY = "count_over_capacity"
    """A booking asks more GPUs than the cluster (or the named host) has of the model."""
    COLLIDES = "collides"
    """A booking does not fit next to the bookings already made for its windows; the
    details say what collides and what would fit."""


class LeaseState(StrEnum):
    """Life of a lease. ``queued`` leases hold no GPU yet."""

    QUEUED = "queued"
    GRANTED = "granted"
    BOUND = "bound"
    RELEASING = "releasing"
    RELEASED = "released"
    EXPIRED = "expired"
    """A queued request whose wait ran out before anything fitted."""

    @property
    def holds_gpus(self) -> bool:
        """Whether a lease in this state counts against its GPUs."""
        return self in (LeaseState.GRANTED, LeaseState.BOUND, LeaseState.RELEASING)

    @property
    def active(self) -> bool:
        """Whether the lease is still alive for idempotency by request key."""
        return self in (LeaseState.QUEUED, LeaseState.GRANTED, LeaseState.BOUND)

    @property
    def final(self) -> bool:
        """Whether the lease is finished for good."""
        return self in (LeaseState.RELEASED, LeaseState.EXPIRED)


class ReleaseReason(StrEnum):
    """Why a lease was released or its request ended. Every release records one."""

    CONTAINER_EXITED = "container_exited"
    """The node agent saw the container die, be killed by OOM, or be destroyed."""
    CONTAINER_GONE = "container_gone"
    """A heartbeat no longer listed the container (events were missed)."""
    NODE_SILENT = "node_silent"
    """The node sent no heartbeat for longer than the stop grace period."""
    BIND_TIMEOUT = "bind_timeout"
    """The lease was granted but no container bound it before its deadline."""
    STOPPED = "stopped"
    """The hub stopped the server and nothing was ever bound (a failed spawn)."""
    ADMIN = "admin"
    """An admin force-released it."""
    CANCELLED = "cancelled"
    """A queued request was withdrawn before it was granted."""
    WAIT_EXPIRED = "wait_expired"
    """A queued request waited ``wait_s`` without anything fitting."""
    RECLAIMED = "reclaimed"
    """A borrowed lease (beyond its owner's guarantee) was reclaimed, after a warning, for a
    request within its owner's guarantee."""
    IDLE = "idle"
    """The lease's GPUs stayed idle longer than ``idle_release_after_s`` while a request
    waited; it was released after a warning."""


class ReclaimReason(StrEnum):
    """Why a lease is warned that its container will be stopped (``Lease.reclaim_reason``)."""

    RECLAIMED = "reclaimed"
    """It is borrowed and a request within its owner's guarantee needs its GPUs."""
    IDLE = "idle"
    """It has been idle longer than ``idle_release_after_s`` and a request waits."""


class Health(StrEnum):
    """A GPU's health as its node agent judges it. Unhealthy GPUs never fit a request."""

    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"


def speaks_this_version(body: dict[str, Any]) -> bool:
    """Whether a decoded body carries ``"v"`` as exactly the integer 1 (not ``true``, not
    ``1.0``, not absent): the one version rule, for the validator and for the error code."""
    version = body.get("v")
    return type(version) is int and version == PROTOCOL_VERSION


class _Message(BaseModel):
    """Base of every message: built in Python, an unknown field is an error (a typo in this
    code); read off the wire, unknown fields are ignored (:data:`READ_EXTRA`), so that a
    newer sender's added field does not make an older reader refuse the message."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    v: Literal[1] = PROTOCOL_VERSION

    # Two small checks rather than one on the whole body before validation: a model
    # validator in "before" mode makes pydantic build the body as Python objects first,
    # which cost a third of decoding a full heartbeat.
    @field_validator("v", mode="before")
    @classmethod
    def _version_is_the_integer(cls, value: Any, info: ValidationInfo) -> Any:
        if info.context is WIRE and not speaks_this_version({"v": value}):
            raise ValueError(f"'v' must be the integer {PROTOCOL_VERSION}")
        return value

    @model_validator(mode="after")
    def _version_on_the_wire(self, info: ValidationInfo) -> Self:
        if info.context is WIRE and "v" not in self.model_fields_set:
            raise ValueError(f"'v' must be the integer {PROTOCOL_VERSION}")
        return self


# --------------------------------------------------------------------------- requests


class ShareRequest(BaseModel):
    """A shared slice: one share slot of one GPU with a memory budget."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_mib: MiB | None = Field(
        default=None,
        description="Memory budget of the slice; default: the GPU's memory divided by its slots.",
        examples=[4096],
    )


class AllocateRequest(_Message):
    """Ask for GPUs. Idempotent by ``request_key`` while the earlier lease is active."""

    kind: Literal["allocate"] = "allocate"
    request_key: Name = Field(
        description="Identifies the asking server (hub + user + server name). A retry with the "
        "same key returns the same lease instead of a second one.",
        examples=["hub1/alice/"],
    )
    user: Name = Field(examples=["alice"])
    groups: list[Name] = Field(default_factory=list, max_length=MAX_GROUPS,
                               examples=[["students"]])
    model: Name | None = Field(
        default=None, description="A model name or alias; None = any.", examples=["1070"]
    )
    models: list[Name] | None = Field(
        default=None,
        max_length=MAX_MODELS,
        description="Acceptable models in order of preference; excludes ``model``.",
        examples=[["a100", "3090"]],
    )
    min_memory_mib: MiB | None = Field(default=None, examples=[16000])
    min_compute_capability: ComputeCapability | None = Field(
        default=None, description="Only GPUs (or MIG instances) of at least this CUDA compute "
        "capability.", examples=["8.0"])
    architecture: Architecture | None = Field(
        default=None, description="Only GPUs of this architecture.", examples=["ampere"])
    topology: Literal["nvlink", "pcie-switch", "socket"] | None = Field(
        default=None, json_schema_extra={SINCE: "0.3.0"},
        description="Every pair of the lease's GPUs joined by NVLink, by one PCIe switch, or "
        "within one CPU socket (or better); None: the best-connected GPUs free, whatever "
        "their links. A host that has not reported its links cannot meet it. Send it only "
        "to a 0.3.0 allocator: an older one grants GPUs without it.", examples=["nvlink"])
    count: StrictInt | Literal["all"] = Field(
        default=1,
        description='GPUs on one host, or "all" for every matching GPU of one host.',
        examples=[1, 2, "all"],
    )
    host: Name | None = Field(default=None, description="Only this node.", examples=["gpu-a"])
    share: ShareRequest | None = Field(
        default=None, description="A shared slice instead of exclusive GPUs (count must be 1)."
    )
    wait_s: float = Field(
        default=0.0,
        ge=0.0,
        le=MAX_WAIT_S,
        description="If nothing fits now, wait in the queue this long; 0 = answer no_capacity.",
    )
    priority: StrictInt = Field(default=0, ge=-1000, le=1000, description="Higher is served first.")
    deadline: float | None = Field(
        default=None,
        description="Epoch seconds after which the sender no longer waits for the reply: "
        "the allocator drops the request unanswered and grants nothing.",
    )

    @field_validator("count")
    @classmethod
    def _count_in_range(cls, count: int | str) -> int | str:
        if isinstance(count, bool):  # bool is an int in Python; "true" GPUs is not a count.
            raise ValueError("count must be a whole number or 'all'")
        if isinstance(count, int) and not 1 <= count <= MAX_COUNT:
            raise ValueError(f"count must be between 1 and {MAX_COUNT}, or 'all'")
        return count

    @field_validator("wait_s", "deadline")
    @classmethod
    def _finite(cls, value: float | None) -> float | None:
        if value is not None and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> AllocateRequest:
        if self.model is not None and self.models is not None:
            raise ValueError("give either 'model' or 'models', not both")
        if self.models is not None and not self.models:
            raise ValueError("'models' must not be empty (omit it to accept any model)")
        if self.share is not None and self.count != 1:
            raise ValueError("a shared slice is always one GPU: count must be 1")
        return self

    @model_serializer(mode="wrap")
    def _without_an_unasked_topology(self, handler: SerializerFunctionWrapHandler
                                     ) -> dict[str, Any]:
        # 0.3.0's field is left off the wire (and the ledger) when not asked: an allocator of
        # 0.1.0 refuses a request with a field it does not know, and one of 0.2.0 a stored
        # request after a downgrade.
        data: dict[str, Any] = handler(self)
        if self.topology is None:
            data.pop("topology", None)
        return data

    def what_is_asked(self) -> dict[str, Any]:
        """The fields that say which GPUs are asked for, in wire form: a retry under the same
        ``request_key`` repeats them exactly; different ones are another request (``conflict``).
        Waiting, priority, groups and the deadline may differ between tries."""
        return self.model_dump(mode="json", include=set(WHAT_IS_ASKED))

    @property
    def acceptable_models(self) -> list[str] | None:
        """The requested model names or aliases, or None for any model."""
        if self.model is not None:
            return [self.model]
        return list(self.models) if self.models is not None else None


WHAT_IS_ASKED: Final = ("model", "models", "min_memory_mib", "min_compute_capability",
                        "architecture", "topology", "count", "host", "share")
"""The fields of :class:`AllocateRequest` that :meth:`AllocateRequest.what_is_asked` compares."""


def _exactly_one_key(lease_id: str | None, request_key: str | None) -> None:
    """A lease is named by its id or by its request key: one of them, not both."""
    if (lease_id is None) == (request_key is None):
        raise ValueError("give exactly one of 'lease_id' or 'request_key'")


class ReleaseRequest(_Message):
    """End a lease (or withdraw a queued request). Releasing twice is a no-op.

    From the hub this means "the server stopped": a bound lease becomes ``releasing``
    and frees its GPUs when the node reports the container gone. With ``force`` (admins
    only) the GPUs are freed at once.
    """

    kind: Literal["release"] = "release"
    lease_id: Name | None = None
    request_key: Name | None = None
    by: Name = Field(default="hub", description="Who asks, for the record.")
    reason: Text = ""
    force: bool = False
    deadline: float | None = None

    @model_validator(mode="after")
    def _one_key(self) -> ReleaseRequest:
        _exactly_one_key(self.lease_id, self.request_key)
        return self


class StatusRequest(_Message):
    """Look up one lease (by id) or the newest lease of a request key, with queue position."""

    kind: Literal["status"] = "status"
    lease_id: Name | None = None
    request_key: Name | None = None
    deadline: float | None = None

    @model_validator(mode="after")
    def _one_key(self) -> StatusRequest:
        _exactly_one_key(self.lease_id, self.request_key)
        return self


class InventoryRequest(_Message):
    """Ask for the cluster's nodes, GPUs, per-model summary and queue."""

    kind: Literal["inventory"] = "inventory"
    include_leases: bool = Field(default=False, description="Also list the active leases.")
    deadline: float | None = None


class DrainRequest(_Message):
    """Admin: take a node (or one GPU of it) out of placement, or put it back.

    Draining never touches running leases; it only stops new ones landing there.
    """

    kind: Literal["drain"] = "drain"
    host: Name
    gpu_uuid: Name | None = None
    drained: bool = True
    by: Name = "admin"
    reason: Text = ""
    deadline: float | None = None


class BookingRequest(_Message):
    """Admin (0.3.0): add, remove or list bookings (``allocator.bookings``).

    ``add`` takes the booking's body (a JSON object, checked by
    ``allocator.bookings.booking.read_booking``; its ``created_by`` is this request's ``by``),
    ``remove`` the booking's ``name``, ``list`` neither.
    """

    kind: Literal["booking"] = "booking"
    op: Literal["add", "remove", "list"]
    booking: dict[str, Any] | None = Field(
        default=None, description="With op add: the booking (name, group or users, gpus, "
        "zone, window, lead_s, quota_applies).")
    name: Name | None = Field(default=None, description="With op remove: the booking's name.")
    by: Name = "admin"
    reason: Text = ""
    deadline: float | None = None

    @model_validator(mode="after")
    def _what_the_op_needs(self) -> BookingRequest:
        if (self.op == "add") != (self.booking is not None):
            raise ValueError("'booking' is given with op add, and only then")
        if (self.op == "remove") != (self.name is not None):
            raise ValueError("'name' is given with op remove, and only then")
        return self


class QueueRequest(_Message):
    """List the queued requests in the order they will be served."""

    kind: Literal["queue"] = "queue"
    deadline: float | None = None


class QuotaRequest(_Message):
    """A user's quotas and what they hold now, so a spawn form can say "you hold 2 of 4"
    before a request is refused ``quota_exceeded``, and whether a choice would be borrowed."""

    kind: Literal["quota"] = "quota"
    user: Name
    groups: list[Name] = Field(default_factory=list, max_length=MAX_GROUPS,
                               description="The user's groups, as an allocate would give them.")
    count: float | None = Field(
        default=None, gt=0, le=MAX_COUNT, allow_inf_nan=False,
        description="GPUs a request would ask for (a slice: 1/slots of its GPU); when given, "
        "the reply says whether granting that many now would be borrowed.")
    model: Name | None = Field(
        default=None, description="The model (canonical name or configured alias) of those "
        "GPUs: its per-model quotas count too. Without it, every per-model quota is listed "
        "and only the whole-cluster ones decide would_borrow.")
    deadline: float | None = None


class LeasesRequest(_Message):
    """List leases: one user's (their service page) or everyone's (admins' page).

    The allocator does not know who is logged in to the hub: the hub service that asks passes
    the user's name, and shows everyone's leases to admins only.
    """

    kind: Literal["leases"] = "leases"
    user: Name | None = Field(default=None, description="Only this user's leases; None = all.")
    include_finished_s: float = Field(
        default=0.0, ge=0.0, le=MAX_WAIT_S, allow_inf_nan=False,
        description="Also the leases that ended within this many seconds.")
    include_usage: bool = Field(
        default=False, description="Fill each lease's ``usage`` (per-minute samples).")
    deadline: float | None = None


Request = Annotated[
    AllocateRequest
    | ReleaseRequest
    | StatusRequest
    | InventoryRequest
    | DrainRequest
    | QueueRequest
    | QuotaRequest
    | LeasesRequest
    | BookingRequest,
    Field(discriminator="kind"),
]
"""Any request to the allocator's RPC exchange."""


# --------------------------------------------------------------------------- node messages


MAX_REASONS = 16
"""Health reasons one GPU may carry in a heartbeat (the agent's checks give at most 6)."""
MAX_REASON = 300
"""The longest health reason; with :data:`MAX_REASONS` and 64 GPUs, one host's reasons add
at most 300 KiB to an inventory reply, not the whole body limit per GPU."""


MAX_GPU_PROCESSES = 64
"""The most processes one GPU's entry may list (``GPUInfo.processes``). The agent lists at
most :data:`MAX_REPORTED_PROCESSES` in one report, those using the most memory first, and
counts the rest in ``processes_omitted``."""

MAX_REPORTED_PROCESSES = 256
"""The most processes one report lists over all its GPUs: about 40 KiB of a heartbeat."""


class GPUProcess(BaseModel):
    """One process NVML lists on a GPU (compute or graphics), as its node agent attributes it.

    A process of a lease container carries only ``container_id``: the heartbeat's
    ``containers`` say which lease it is. A process of any other container also carries that
    container's name and image, for the admin who has to find it; a process in no container
    (the host's own) carries none.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    pid: int = Field(ge=0, le=(1 << 31) - 1, description="In the host's PID namespace.")
    memory_used_mib: MiB | None = Field(
        default=None, description="GPU memory it uses; None where NVML cannot tell.")
    name: Annotated[str, Field(max_length=64)] = Field(
        default="", description="Its command name (``/proc/<pid>/comm``); empty if gone.")
    container_id: Name | None = Field(
        default=None, description="The container it runs in; None: a process of the host.")
    container_name: Annotated[str, Field(max_length=255)] = Field(
        default="", description="That container's name, when it is not a lease container.")
    image: Annotated[str, Field(max_length=255)] = Field(
        default="", description="That container's image, when it is not a lease container.")


class GPUInfo(BaseModel):
    """One GPU as its node agent sees it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uuid: Name = Field(examples=["GPU-5f8a1b2c-0000-4000-8000-000000000001"])
    index: int = Field(ge=0, le=1024)
    model: Name = Field(description="NVML's name, the canonical model.",
                        examples=["NVIDIA GeForce GTX 1070"])
    memory_total_mib: MiB
    memory_used_mib: MiB = 0
    utilization_pct: float | None = Field(default=None, ge=0, le=100)
    temperature_c: float | None = Field(default=None, ge=-100, le=300)
    power_w: float | None = Field(default=None, ge=0, le=10_000)
    ecc_uncorrected: Count64 | None = None
    retired_pages: Count64 | None = None
    mig_mode: bool | None = Field(
        default=None, description="True: the GPU is in MIG mode. It is never granted whole; "
        "its MIG instances, listed as GPUs of their own, are.")
    recent_xids: list[Annotated[StrictInt, Field(ge=0, le=(1 << 31) - 1)]] = Field(
        default_factory=list, max_length=64)
    health: Health = Health.HEALTHY
    health_reasons: list[Annotated[str, Field(max_length=MAX_REASON)]] = Field(
        default_factory=list, max_length=MAX_REASONS)
    compute_capability: ComputeCapability | None = None
    architecture: Architecture | None = None
    mig_parent_uuid: Name | None = Field(
        default=None, description="Set on a MIG instance: the GPU (listed in the same "
        "heartbeat, in MIG mode) it is carved out of. ``uuid`` is then the ``MIG-...`` uuid, "
        "``index`` the parent's and ``model`` NVML's name for the instance.")
    mig_profile: MigProfile | None = Field(default=None, description="A MIG instance's profile.")
    mig_index: StrictInt | None = Field(
        default=None, ge=0, le=1024, description="A MIG instance's index on its parent.")
    processes: list[GPUProcess] | None = Field(
        default=None, max_length=MAX_GPU_PROCESSES,
        description="Every process using this GPU, as of this report (the driver's own "
        "daemons left out: the agent's driver_processes setting). None: not known (an agent "
        "before 0.2.0, or NVML's process call failed), and the allocator then judges the GPU "
        "by its labels and events alone, as before 0.2.0; [] means NVML listed none.")
    processes_omitted: Count64 = Field(
        default=0, description="Processes on this GPU that the report left out (beyond "
        "MAX_REPORTED_PROCESSES per report, those using the least memory).")

    @model_serializer(mode="wrap")
    def _processes_only_when_reported(self, handler: SerializerFunctionWrapHandler
                                      ) -> dict[str, Any]:
        # Absent unless reported, which an absent field means as well: an allocator of 0.1.0
        # refuses a heartbeat with a field it does not know (docs/protocol.md, Compatibility).
        data: dict[str, Any] = handler(self)
        if data.get("processes") is None:
            data.pop("processes", None)
        if not data.get("processes_omitted"):
            data.pop("processes_omitted", None)
        return data

    @model_validator(mode="after")
    def _mig_fields_together(self) -> GPUInfo:
        if self.mig_parent_uuid is None and self.mig_profile is None and self.mig_index is None:
            return self  # not a MIG instance: the common case, checked first (every heartbeat)
        instance = (self.mig_parent_uuid, self.mig_profile, self.mig_index)
        if any(v is not None for v in instance) and any(v is None for v in instance):
            raise ValueError("a MIG instance gives mig_parent_uuid, mig_profile and mig_index")
        if self.mig_parent_uuid is not None and self.mig_mode:
            raise ValueError("a MIG instance is not itself in MIG mode")
        return self

    @property
    def is_mig_instance(self) -> bool:
        """Whether this entry is a MIG instance rather than a physical GPU."""
        return self.mig_parent_uuid is not None


class ProcessUse(BaseModel):
    """GPU memory one container's processes use on one GPU."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpu_uuid: Name
    memory_used_mib: MiB
    utilization_pct: float | None = Field(default=None, ge=0, le=100)


class ContainerGrant(BaseModel):
    """The grant a lease container carries in its labels (see
    :mod:`allocator.wire.lease_container`).

    The hub's spawner sets the labels through the Docker API when it creates the service, so
    a user inside the notebook cannot change them. The node agent reports them with every
    listing and start event, and an allocator whose ledger lost the lease (a deleted or
    restored ledger) claims the GPUs again from them: the grant travels with its container.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: Name = Field(description="The node the GPUs were granted on.")
    gpu_uuids: list[Name] = Field(min_length=1, max_length=MAX_COUNT)
    shared: bool = False
    memory_mib: MiB | None = Field(default=None, description="Budget of a shared slice.")
    user: Name
    server_name: str = Field(default="", max_length=200, pattern=r"^[^\x00-\x1f\x7f]*$")
    request_key: Name
    groups: list[Name] = Field(
        default_factory=list, max_length=64,
        description="The user's groups the lease was asked with (quotas, guarantees).")

    @model_validator(mode="after")
    def _consistent(self) -> ContainerGrant:
        if len(set(self.gpu_uuids)) != len(self.gpu_uuids):
            raise ValueError("a GPU is named twice")
        if self.shared and (len(self.gpu_uuids) != 1 or self.memory_mib is None):
            raise ValueError("a shared slice is one GPU with a memory budget")
        return self

    @model_serializer(mode="wrap")
    def _without_empty_groups(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # Absent when none (containers labelled before the groups label): an allocator of
        # the release before, which knows no groups field, still takes such heartbeats.
        data: dict[str, Any] = handler(self)
        if not data.get("groups"):
            data.pop("groups", None)
        return data


class LeaseUsage(BaseModel):
    """(0.3.0) What one lease container used, measured by its node agent from NVML: counters
    that only grow over one measurement (``since``), so a lost report loses nothing and the
    allocator adds up the measurements of successive agent runs (see docs/protocol.md,
    Usage). Sent only to an allocator whose hello reads ``lease_usage``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    since: float = Field(
        allow_inf_nan=False, description="Epoch seconds on the node when this measurement "
        "began (the agent first saw the container, or started): the counters count from it, "
        "and a new ``since`` is a new measurement.")
    energy_j: float = Field(
        ge=0, allow_inf_nan=False, description="Joules: the GPUs' energy-counter deltas, a "
        "GPU shared with other leases (a slice, a MIG instance) apportioned by its processes' "
        "share of the GPU's per-process utilization (docs/operations.md, Usage).")
    sm_s: float = Field(
        ge=0, allow_inf_nan=False, description="SM-seconds: its processes' SM utilization "
        "(a fraction of one GPU) times seconds, summed over its GPUs.")
    memory_s: float = Field(
        ge=0, allow_inf_nan=False, description="Memory-seconds: its processes' memory "
        "(bandwidth) utilization, a fraction of one GPU, times seconds, summed over its GPUs.")
    peak_memory_mib: MiB = Field(
        default=0, description="The most GPU memory its processes held at once on one GPU.")
    energy_known: bool = Field(
        default=True, description="False when some GPU of the lease has no energy counter "
        "(NVML's NotSupported): ``energy_j`` then counts only the GPUs that have one.")


class ContainerInfo(BaseModel):
    """A running container that carries the lease label."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    container_id: Name
    lease_id: Name
    name: Annotated[str, Field(max_length=255)] = ""
    started_at: float | None = Field(default=None, allow_inf_nan=False)
    gpu_use: list[ProcessUse] = Field(default_factory=list, max_length=64)
    grant: ContainerGrant | None = Field(
        default=None, description="The grant from the container's labels; None when the "
        "container carries only the lease label (a spawner of an older release).")
    usage: LeaseUsage | None = Field(
        default=None, exclude_if=lambda value: value is None,
        description="(0.3.0) What the container used since its agent began measuring it; "
        "sent only to an allocator whose hello reads ``lease_usage``, absent otherwise.")


class Heartbeat(_Message):
    """Published by each node agent every few seconds: its GPUs and lease containers.

    The allocator accepts it only if the AMQP ``user_id`` that published it owns ``host``.
    ``containers`` is the complete list of lease-labelled running containers: a bound lease
    of this host that is missing from it is released after a short grace.
    """

    kind: Literal["heartbeat"] = "heartbeat"
    host: Name
    agent_id: Name = Field(description="Changes when the agent restarts.")
    seq: Count64 = Field(description="Increases by one per heartbeat of one agent_id.")
    sent_at: float = Field(allow_inf_nan=False, description="Epoch seconds on the node.")
    interval_s: float = Field(gt=0, le=3600)
    gpus: list[GPUInfo] = Field(max_length=64)
    containers: list[ContainerInfo] = Field(default_factory=list, max_length=1024)
    containers_complete: bool = Field(
        default=True,
        description="False when the agent could not list containers (Docker engine down): the "
        "allocator then releases nothing on the strength of this heartbeat.",
    )
    source: Literal["nvml", "simulated"] = "nvml"
    interconnect: HostInterconnect | None = Field(
        default=None, exclude_if=lambda value: value is None,
        description="(0.3.0) How the host's GPUs (not MIG instances) are joined: each pair's "
        "link, each GPU's NUMA node and CPUs. Sent only to an allocator whose hello reads "
        "``interconnect``, in the first full report after that hello and in a full report "
        "where it changed; absent otherwise (never in a delta), and the allocator keeps the "
        "last one it took. One that does not name exactly this report's GPUs is ignored.")

    @model_validator(mode="after")
    def _unique_gpus(self) -> Heartbeat:
        uuids = [gpu.uuid for gpu in self.gpus]
        if len(set(uuids)) != len(uuids):
            raise ValueError("duplicate GPU uuid in one heartbeat")
        # MIG instances share their parent's index; mig_index tells them apart.
        indices = [(gpu.index, gpu.mig_index) for gpu in self.gpus]
        if len(set(indices)) != len(indices):
            raise ValueError("duplicate GPU index in one heartbeat")
        parents = {gpu.uuid: gpu for gpu in self.gpus if not gpu.is_mig_instance}
        for gpu in self.gpus:
            if gpu.mig_parent_uuid is None:
                continue
            parent = parents.get(gpu.mig_parent_uuid)
            if parent is None or not parent.mig_mode:
                raise ValueError(f"MIG instance {gpu.uuid} names a parent GPU that this "
                                 "heartbeat does not list in MIG mode")
            if parent.index != gpu.index:
                raise ValueError(f"MIG instance {gpu.uuid} has another index than its parent")
        return self


class HeartbeatDelta(_Message):
    """A heartbeat that carries only what changed since its agent's previous heartbeat.

    It applies onto the report the allocator holds for the host after the agent's previous
    message (``seq - 1`` of the same ``agent_id``, a full :class:`Heartbeat` or a delta already
    applied onto one): each entry of ``gpus`` and ``containers`` replaces the entry with the
    same ``uuid`` or ``container_id`` there, everything else stays as it was. The sets of GPUs
    and containers, ``containers_complete`` and ``source`` never change in a delta (the agent
    sends a full report when one does), so a delta cannot make a container look gone. A delta
    that does not fit the report held (a gap in ``seq``, another agent, an entry the report
    does not have) is not applied: it still says the node is alive, and the next full report
    repairs the rest (see :mod:`allocator.wire.heartbeat_delta`).
    """

    kind: Literal["heartbeat_delta"] = "heartbeat_delta"
    host: Name
    agent_id: Name = Field(description="The agent's id, as in its full heartbeats.")
    seq: Count64 = Field(description="The agent's next number: full reports and deltas "
                         "share one sequence, so a missed message shows as a gap.")
    sent_at: float = Field(allow_inf_nan=False, description="Epoch seconds on the node.")
    interval_s: float = Field(gt=0, le=3600)
    gpus: list[GPUInfo] = Field(default_factory=list, max_length=64,
                                description="The GPUs whose report changed, each whole.")
    containers: list[ContainerInfo] = Field(
        default_factory=list, max_length=1024,
        description="The containers whose report (``gpu_use`` above all) changed, each whole.")

    @model_validator(mode="after")
    def _unique_entries(self) -> HeartbeatDelta:
        if len({gpu.uuid for gpu in self.gpus}) != len(self.gpus):
            raise ValueError("duplicate GPU uuid in one heartbeat delta")
        if len({c.container_id for c in self.containers}) != len(self.containers):
            raise ValueError("duplicate container id in one heartbeat delta")
        return self


class ContainerAction(StrEnum):
    """Docker container events the agent forwards."""

    START = "start"
    DIE = "die"
    OOM = "oom"
    DESTROY = "destroy"


class ContainerEvent(_Message):
    """Published by a node agent the moment a lease-labelled container starts or ends."""

    kind: Literal["container_event"] = "container_event"
    host: Name
    container_id: Name
    lease_id: Name
    action: ContainerAction
    at: float = Field(allow_inf_nan=False, description="Epoch seconds of the Docker event.")
    exit_code: Annotated[StrictInt, Field(ge=-(1 << 31), le=(1 << 31) - 1)] | None = None
    grant: ContainerGrant | None = Field(
        default=None, description="The grant from the container's labels (on start events).")


NodeMessage = Annotated[Heartbeat | HeartbeatDelta | ContainerEvent,
                      Field(discriminator="kind")]
"""Any message from a node agent."""

NODE_MESSAGE_ADAPTER: TypeAdapter[NodeMessage] = TypeAdapter(NodeMessage)

AnyInbound = Annotated[
    AllocateRequest
    | ReleaseRequest
    | StatusRequest
    | InventoryRequest
    | DrainRequest
    | QueueRequest
    | QuotaRequest
    | LeasesRequest
    | BookingRequest
    | Heartbeat
    | HeartbeatDelta
    | ContainerEvent,
    Field(discriminator="kind"),
]
"""Anything that arrives on the allocator's inbound queue."""

INBOUND_ADAPTER: TypeAdapter[AnyInbound] = TypeAdapter(AnyInbound)


# --------------------------------------------------------------------------- agent commands


MAX_STOP_GRACE_S = 3600.0
"""The longest grace a stop command may give a container before SIGKILL."""


class StopReason(StrEnum):
    """Why the allocator asks a node agent to stop a lease container."""

    RELEASED = "released"
    """The hub stopped the server (released the bound lease): the GPU comes free the moment
    the container is gone, instead of when Swarm gets round to stopping the task."""
    FORCE_RELEASED = "force_released"
    """An admin force-released the lease: its GPUs already went to someone else."""
    LEASE_FINISHED = "lease_finished"
    """The container runs for a lease that is already released or expired (a zombie, e.g. a
    late start after a bind timeout): it would use GPUs the ledger gave away."""
    RECLAIMED = "reclaimed"
    """The lease was borrowed and its grace after the reclaim warning ran out."""
    IDLE = "idle"
    """The lease stayed idle while a request waited and its grace ran out."""
    OVER_BUDGET = "over_budget"
    """A shared slice's processes used more GPU memory than its budget for longer than
    ``over_budget_grace_s``, with ``over_budget_action = "stop"``. An agent before 0.2.0
    refuses this reason (it knows only the ones above): use that action with 0.2.0 agents."""


class StopContainer(_Message):
    """Sent by the allocator to one node agent: stop this lease container.

    The agent stops the container only if it runs on its host and carries the label
    ``swarm-gpu.lease=<lease_id>``; SIGTERM, then SIGKILL after ``grace_s``. The container's
    ``die`` event then releases the lease as usual. Stopping a container that is gone is fine.
    Not a message to the allocator: it goes out through the agents exchange.
    """

    kind: Literal["stop_container"] = "stop_container"
    host: Name = Field(description="The node that runs the container.", examples=["gpu-a"])
    lease_id: Name
    container_id: Name
    grace_s: float = Field(
        default=10.0, ge=0.0, le=MAX_STOP_GRACE_S, allow_inf_nan=False,
        description="Seconds between SIGTERM and SIGKILL.")
    reason: StopReason


GPU_PROCESSES: Final = "gpu_processes"
"""A part of node messages that an allocator may read (:class:`AllocatorHello`):
``GPUInfo.processes`` and ``GPUInfo.processes_omitted``."""

INTERCONNECT: Final = "interconnect"
"""A part of node messages that an allocator may read (:class:`AllocatorHello`, 0.3.0):
``Heartbeat.interconnect``."""


LEASE_USAGE: Final = "lease_usage"
"""A part of node messages that an allocator may read (:class:`AllocatorHello`, 0.3.0):
``ContainerInfo.usage``."""


class AllocatorHello(_Message):
    """Sent by the allocator to one node agent: the parts of node messages it reads.

    An allocator before 0.2.0 refuses a heartbeat with a field it does not know, and the
    host then goes down. So an agent sends such a field only once an allocator has said it
    reads it: the allocator sends this at the first heartbeat of each agent (each
    ``agent_id``) it takes, through the agents exchange like a stop command, and again after
    it becomes the active replica. An agent before 0.2.0 refuses it (one log line) and goes
    on as before. Not a message to the allocator.
    """

    kind: Literal["hello"] = "hello"
    host: Name = Field(description="The node whose agent it is for.", examples=["gpu-a"])
    reads: list[Name] = Field(
        default_factory=list, max_length=32,
        description="Optional parts of node messages this allocator reads (a name the agent "
        "does not know is ignored): ``gpu_processes``, ``interconnect`` (0.3.0), "
        "``lease_usage`` (0.3.0).",
        examples=[["gpu_processes", "interconnect", "lease_usage"]])


AgentCommand = Annotated[StopContainer | AllocatorHello, Field(discriminator="kind")]
"""Any command to a node agent, told apart by ``kind``."""

AGENT_COMMAND_ADAPTER: TypeAdapter[AgentCommand] = TypeAdapter(AgentCommand)


def decode_agent_command(body: bytes) -> AgentCommand | str:
    """Parse a body from an agent's command queue, or say in one sentence why not.

    Never raises on input, like :func:`decode_inbound`.
    """
    if len(body) > MAX_BODY_BYTES:
        return f"the message is {len(body)} bytes; the limit is {MAX_BODY_BYTES}"
    try:
        return AGENT_COMMAND_ADAPTER.validate_json(body, strict=True, extra=READ_EXTRA,
                                                   context=WIRE)
    except ValidationError as exc:
        return describe_validation_error(exc)
    except RecursionError:  # pydantic's JSON parser limits nesting; belt and braces
        return "the body is nested too deeply"


# --------------------------------------------------------------------------- replies


class UsageSample(BaseModel):
    """A lease's own GPU use over one minute (see ``LeasesRequest.include_usage``)."""

    model_config = ConfigDict(extra="forbid")

    at: float = Field(description="Start of the minute, epoch seconds.")
    utilization_pct: float | None = Field(
        description="Mean utilization of the lease's processes; None: not reported.")
    memory_used_mib: int = Field(description="Most GPU memory its processes used.")


class Lease(_ReleaseAware):
    """A lease as the allocator reports it."""

    model_config = ConfigDict(extra="forbid")

    lease_id: str
    request_key: str
    user: str
    state: LeaseState
    host: str | None = None
    gpu_uuids: list[str] = Field(default_factory=list)
    gpu_indices: list[int] = Field(default_factory=list)
    model: str | None = None
    shared: bool = False
    memory_mib: int | None = Field(default=None, description="Budget of a shared slice.")
    env: dict[str, str] = Field(
        default_factory=dict,
        description="Environment the container must get: NVIDIA_VISIBLE_DEVICES, the lease "
        "id and, for shared slices, framework memory hints.",
    )
    created_at: float
    granted_at: float | None = None
    bound_at: float | None = None
    released_at: float | None = None
    release_reason: ReleaseReason | None = None
    container_id: str | None = None
    queue_position: int | None = Field(default=None, description="1 = next; queued leases only.")
    wait_until: float | None = None
    borrowed: bool = Field(
        default=False, description="Holds GPUs beyond its owner's guarantee (the user's or a "
        "group's): reclaimable when a request within its owner's guarantee waits.")
    reclaim_at: float | None = Field(
        default=None, description="A warning is pending: the container is stopped then.")
    reclaim_reason: ReclaimReason | None = Field(
        default=None, description="Why it is warned (kept on a lease that ended that way).")
    idle_since: float | None = Field(
        default=None, description="Since when its own processes have stayed under the idle "
        "thresholds; None: busy, or not measured (no container yet).")
    utilization_pct: float | None = Field(
        default=None, description="Its own processes' utilization (mean over its GPUs), newest "
        "heartbeat; None: not measured.")
    gpu_memory_used_mib: int | None = Field(
        default=None, description="GPU memory its own processes use, newest heartbeat.")
    outside_grant: list[str] = Field(
        default_factory=list, json_schema_extra={SINCE: "0.2.0"},
        description="GPUs its container's processes use that the lease "
        "was not granted (the container sees GPUs it should not: check the runtime's "
        "NVIDIA_VISIBLE_DEVICES), newest heartbeat.")
    over_budget_since: float | None = Field(
        default=None, json_schema_extra={SINCE: "0.2.0"},
        description="A shared slice: since when its processes use more GPU "
        "memory than its budget; None: within it, or not measured.")
    link: str | None = Field(
        default=None, json_schema_extra={SINCE: "0.3.0"}, max_length=32,
        description="The worst link between two of its GPUs: nvlink, board, pcie-switch, "
        "pcie-switches, host-bridge, socket or system (allocator.wire.interconnect.LINK_NAMES; a "
        "later release may add names); None: one GPU, or its host has not reported its "
        "links.", examples=["nvlink"])
    booking: str | None = Field(
        default=None, json_schema_extra={SINCE: "0.3.0"},
        description="The booking whose window guarantees this lease now (it is not borrowed "
        "while the window runs); None: none does.", examples=["CS101 lab"])
    reclaim_booking: str | None = Field(
        default=None, json_schema_extra={SINCE: "0.3.0"},
        description="With reclaim_at: the booking its GPUs are reclaimed for (the warning "
        "reads 'reclaimable at 10:00 for the booking CS101 lab'); None: not for a booking.",
        examples=["CS101 lab"])
    usage: list[UsageSample] | None = Field(
        default=None, description="Per-minute use, oldest first: leases reply with "
        "include_usage only.")


class LeaseReply(_Message):
    """A lease (new, existing, queued or finished)."""

    kind: Literal["lease"] = "lease"
    ok: Literal[True] = True
    lease: Lease


class ModelSummary(BaseModel):
    """Free and total GPUs and slots of one model, for the spawn form."""

    model_config = ConfigDict(extra="forbid")

    model: str
    aliases: list[str] = Field(default_factory=list)
    memory_total_mib: int
    total: int
    free: int
    share_slots: int = Field(description="Slots per GPU; 1 = exclusive only.")
    free_slots: int
    hosts: dict[str, int] = Field(default_factory=dict, description="host -> free GPUs")
    compute_capability: str | None = Field(
        default=None, description="The lowest compute capability among its GPUs.")
    architecture: str | None = None
    mig_profile: str | None = Field(
        default=None, description="Set for MIG instances: their profile (``1g.5gb``); "
        "``total`` and ``free`` then count instances.")
    mig_parent_model: str | None = Field(
        default=None, description="Set for MIG instances: the model of the GPUs they are "
        "carved out of.")


class ProcessState(StrEnum):
    """Why the processes on a GPU keep it out of placement (docs/reliability.md, "Processes
    on a GPU")."""

    DRAINING = "draining"
    """A lease on it ended; it is granted again once a report after the end shows none of that
    lease's container's processes on it (at most ``release_verify_s``)."""
    STUCK_PROCESS = "stuck_process"
    """A process of an ended lease's container still used it ``release_verify_s`` after the
    end; it stays out until the process is gone. Nothing is killed."""
    OUTSIDE_USE = "outside_use"
    """A process that no lease on it accounts for uses it: a container without a lease on
    it, or a process of the host. It stays out while that lasts."""


class ProcessView(BaseModel):
    """One process using a GPU, in an inventory reply: as the agent reported it, with the lease
    its container runs for."""

    model_config = ConfigDict(extra="forbid")

    pid: int
    memory_used_mib: int | None = None
    name: str = ""
    container_id: str | None = Field(default=None, description="None: a process of the host.")
    container_name: str = ""
    image: str = ""
    lease_id: str | None = Field(
        default=None, description="The lease its container runs for, if it is a lease "
        "container.")


class GPUView(_ReleaseAware):
    """One GPU in an inventory reply."""

    model_config = ConfigDict(extra="forbid")

    uuid: str
    host: str
    index: int
    model: str
    memory_total_mib: int
    memory_used_mib: int
    utilization_pct: float | None = None
    temperature_c: float | None = None
    health: Health
    health_reasons: list[str] = Field(default_factory=list)
    drained: bool = False
    share_slots: int
    holders: list[str] = Field(default_factory=list, description="Lease ids holding it.")
    free_slots: int
    free_memory_mib: int = Field(description="Memory not promised to shared slices.")
    compute_capability: str | None = None
    architecture: str | None = None
    mig_enabled: bool = Field(default=False, description="In MIG mode: never granted whole.")
    mig_parent_uuid: str | None = Field(
        default=None, description="Set on a MIG instance: the GPU it is carved out of.")
    mig_profile: str | None = None
    conflict: str | None = Field(
        default=None, description="Why a running container's grant contradicts the ledger on "
        "this GPU; while set, nothing is placed on it.")
    process_state: ProcessState | None = Field(
        default=None, json_schema_extra={SINCE: "0.2.0"},
        description="What its processes keep it out of placement for; None: "
        "nothing (or its processes are not known).")
    processes: list[ProcessView] | None = Field(
        default=None, json_schema_extra={SINCE: "0.2.0"},
        description="The processes using it, newest heartbeat; None: not "
        "known (see GPUInfo.processes).")


class NodeView(_ReleaseAware):
    """One node in an inventory reply."""

    model_config = ConfigDict(extra="forbid")

    host: str
    up: bool
    drained: bool
    last_heartbeat: float | None
    gpus: int
    interconnect: HostInterconnect | None = Field(
        default=None, json_schema_extra={SINCE: "0.3.0"},
        description="How its GPUs are joined (each pair's link, each GPU's NUMA node), as "
        "its agent last reported; None: not reported (an agent before 0.3.0, or none since "
        "the allocator started).")


# --- What users see of bookings (0.3.0): InventoryReply.bookings -------------------------


class BookedTime(BaseModel):
    """One occurrence of a booking's window, in epoch seconds and on the booking zone's
    wall clock."""

    model_config = ConfigDict(extra="forbid")

    start: float
    end: float = Field(description="Excluded.")
    local_start: str = Field(description="ISO 8601 without an offset, in the booking's zone.",
                             examples=["2026-12-08T10:00:00"])
    local_end: str = Field(examples=["2026-12-08T12:00:00"])


class BookingSchedule(BaseModel):
    """One booking as users see it: who it is for, what it books, its windows of the coming
    week, and what it takes back from others soon."""

    model_config = ConfigDict(extra="forbid")

    name: str
    group: str | None = Field(description="Its members: this group's users (or ``users``).")
    users: list[str] | None = None
    model: str = Field(description="The canonical model (or MIG instance model) it books.")
    host: str | None = Field(description="Only this node's GPUs; null: any node's.")
    count: int = Field(description="GPUs (or MIG instances) booked.")
    zone: str = Field(description="The IANA zone its local times are in.",
                      examples=["Europe/Berlin"])
    windows: list[BookedTime] = Field(
        description="Its occurrences that overlap the coming week (from ``week_from``), in "
        "order; a booking with none there lists its next one.")
    in_effect: bool = Field(description="A window runs now: its members' leases on its GPUs "
                            "are guaranteed.")
    guaranteed: int | None = Field(
        default=None, description="In effect now or soon: the GPUs it can be given (fewer "
        "than ``count`` when GPUs went away).")
    takes_back_at: float | None = Field(
        default=None, description="When it may reclaim non-members' leases on GPUs of its "
        "kind (now, while in effect, or its start within ``soon_s``); null: it needs no GPU "
        "beyond what is free.")
    spare: int | None = Field(
        default=None, description="With takes_back_at: GPUs of its kind (its model, on its "
        "host if it names one) free now beyond what it and the bookings before it will take: "
        "a non-member's lease of more than this many may be reclaimed then.")


class BookingsView(BaseModel):
    """Every booking with a window in the coming week (or a next one), as users see them."""

    model_config = ConfigDict(extra="forbid")

    week_from: float = Field(description="The start of the week the windows cover (now).")
    week_to: float
    soon_s: float = Field(description="How far ahead a booking's start counts as soon "
                          "(``takes_back_at``, and the spawn form's marks).")
    bookings: list[BookingSchedule]


class InventoryReply(_Message, _ReleaseAware):
    """The cluster as the allocator sees it now."""

    kind: Literal["inventory"] = "inventory"
    ok: Literal[True] = True
    at: float
    nodes: list[NodeView]
    gpus: list[GPUView]
    models: list[ModelSummary]
    queued: int
    leases: list[Lease] | None = None
    bookings: BookingsView | None = Field(
        default=None, json_schema_extra={SINCE: "0.3.0"},
        description="The bookings with a window in the coming week (or a next one), each "
        "with its members, its windows and what it takes back soon "
        "(allocator.bookings.outlook reads it for one user); null: none is held.")


class QueueReply(_Message):
    """Queued requests in serving order."""

    kind: Literal["queue"] = "queue"
    ok: Literal[True] = True
    leases: list[Lease]


class DrainReply(_Message):
    """Acknowledges a drain or undrain."""

    kind: Literal["drained"] = "drained"
    ok: Literal[True] = True
    host: str
    gpu_uuid: str | None = None
    drained: bool


class QuotaView(BaseModel):
    """One quota that applies to the user, and its use."""

    model_config = ConfigDict(extra="forbid")

    scope: Literal["user", "group"]
    name: str = Field(description="The user, or the group.")
    limit: float | None = Field(
        description="GPUs that may be held at once, borrowed ones included (a slice counts "
        "1/slots); null = no limit. The same as borrow_limit.")
    held: float = Field(description="Held now: by the user, or by all members of the group.")
    free: float | None = Field(description="limit - held (never below 0); null = no limit.")
    guaranteed: float | None = Field(
        default=None, description="GPUs guaranteed: held within it, nothing is reclaimed; "
        "null = no limit (nothing counted here is borrowed).")
    borrow_limit: float | None = Field(
        default=None, description="The most that may be held, borrowed included; null = no "
        "limit.")
    model: str | None = Field(
        default=None, description="A per-model quota's model (it counts only GPUs of that "
        "model); null: every model.")


class QuotaReply(_Message):
    """The user's own quota first, then one per group of theirs that has a quota."""

    kind: Literal["quota"] = "quota"
    ok: Literal[True] = True
    user: str
    quotas: list[QuotaView]
    would_borrow: bool | None = Field(
        default=None, description="With the request's count: whether granting that many now "
        "would go beyond a guarantee (and so be reclaimable); null without a count.")


class LeasesReply(_Message):
    """Leases: queued ones in queue order, then holding ones (newest grant first), then
    finished ones (newest end first)."""

    kind: Literal["leases"] = "leases"
    ok: Literal[True] = True
    at: float
    leases: list[Lease]
    idle_window_s: float = Field(description="How long under the thresholds counts as idle.")
    reclaim_grace_s: float = Field(description="Time between a reclaim warning and the stop.")


class BookingOccurrence(BaseModel):
    """One occurrence of a booking's window."""

    model_config = ConfigDict(extra="forbid")

    start: float = Field(description="Epoch seconds.")
    end: float = Field(description="Epoch seconds (excluded).")
    local_start: str = Field(description="The wall-clock start in the booking's zone, ISO 8601 "
                             "without an offset.", examples=["2026-12-08T10:00:00"])


class BookingView(BaseModel):
    """A booking as the allocator keeps it, with what it will do next."""

    model_config = ConfigDict(extra="forbid")

    name: str
    booking: dict[str, Any] = Field(description="The booking as admitted (the body of an add, "
                                    "with its defaults and created_by).")
    model: str | None = Field(description="The canonical model (or MIG instance model) it "
                              "books; null while the cluster knows no GPU of it.")
    created_at: float
    created_by: str = Field(description="Who added it, and the broker user that asked.")
    next: list[BookingOccurrence] = Field(description="Its next occurrences (the running one "
                                          "first), at most 3.")
    shortfalls: list[str] = Field(description="Occurrences that cannot be given all their "
                                  "GPUs since GPUs went away, for people; the booking is kept.")


class BookingReply(_Message):
    """The bookings an add or remove concerned (one), or every booking (list), in the order
    they were admitted (0.3.0)."""

    kind: Literal["booking"] = "booking"
    ok: Literal[True] = True
    op: Literal["add", "remove", "list"]
    at: float
    bookings: list[BookingView]


class ErrorBody(BaseModel):
    """What went wrong, for programs (``code``) and people (``message``)."""

    model_config = ConfigDict(extra="forbid")

    code: ErrorCode
    message: str
    details: dict[str, Any] = Field(default_factory=dict)


class ErrorReply(_Message):
    """A request that could not be done. It had no effect on the ledger."""

    kind: Literal["error"] = "error"
    ok: Literal[False] = False
    error: ErrorBody


Reply = Annotated[
    LeaseReply | InventoryReply | QueueReply | DrainReply | QuotaReply | LeasesReply
    | BookingReply | ErrorReply,
    Field(discriminator="kind"),
]
"""Any reply from the allocator."""

REPLY_ADAPTER: TypeAdapter[Reply] = TypeAdapter(Reply)


def error_reply(code: ErrorCode, message: str, **details: Any) -> ErrorReply:
    """Build an :class:`ErrorReply`."""
    return ErrorReply(error=ErrorBody(code=code, message=message, details=details))


def describe_validation_error(exc: ValidationError) -> str:
    """Turn a pydantic error into one sentence a person can act on."""
    parts = []
    for err in exc.errors(include_url=False)[:5]:
        where = ".".join(str(part) for part in err["loc"])
        parts.append(f"{where or 'body'}: {err['msg']}")
    more = len(exc.errors()) - len(parts)
    suffix = f" (and {more} more)" if more > 0 else ""
    return "; ".join(parts) + suffix


def encode(message: BaseModel, *, release: tuple[int, int, int] | None = None) -> bytes:
    """Serialize a message to its wire form (compact JSON, no nulls dropped).

    With ``release``, for a reader of that release: the reply fields added after it
    (:data:`SINCE`) are left out, so an older client reads the reply.
    """
    if release is None:
        return message.model_dump_json().encode()
    return message.model_dump_json(context={"release": release}).encode()


def reader_release(headers: Mapping[str, object] | None) -> tuple[int, int, int]:
    """The release a request's sender reads replies of (:data:`CLIENT_RELEASE_HEADER`), or
    :data:`OLDEST_READER` without the header."""
    if not headers:
        return OLDEST_READER
    return release_tuple(headers.get(CLIENT_RELEASE_HEADER)) or OLDEST_READER


def decode_inbound(body: bytes) -> AnyInbound | ErrorReply:
    """Parse a body from the allocator's queue, or say in an :class:`ErrorReply` why not.

    Never raises on input: oversized, non-JSON, invalid UTF-8, deeply nested, wrong version
    and wrong fields each map to a stable error code.
    """
    if len(body) > MAX_BODY_BYTES:
        return error_reply(
            ErrorCode.TOO_LARGE,
            f"the message is {len(body)} bytes; the limit is {MAX_BODY_BYTES}",
            limit=MAX_BODY_BYTES,
        )
    try:
        return INBOUND_ADAPTER.validate_json(body, strict=True, extra=READ_EXTRA, context=WIRE)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            return error_reply(ErrorCode.BAD_REQUEST,
                               f"the body is not valid JSON: {first['msg']}")
        try:
            data = json.loads(body)
        except (ValueError, RecursionError):
            return error_reply(ErrorCode.BAD_REQUEST, "the body is not valid JSON")
        if not isinstance(data, dict):
            return error_reply(ErrorCode.BAD_REQUEST,
                               "the body must be a JSON object with 'v' and 'kind'")
        if not speaks_this_version(data):
            given = (f"protocol version {json.dumps(data['v'])[:40]} is not supported"
                     if "v" in data else 'the body carries no "v"')
            return error_reply(
                ErrorCode.UNSUPPORTED_VERSION,
                f'{given}; every body carries "v": {PROTOCOL_VERSION} (the integer)',
                supported=[PROTOCOL_VERSION],
            )
        return error_reply(ErrorCode.BAD_REQUEST, describe_validation_error(exc))
