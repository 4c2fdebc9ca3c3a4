"""What a user picks on the spawn page or sends as REST ``user_options``, and may pick.

Pure: no I/O, no clock. The spawner parses user input into :class:`GPUOptions`, resolves a
named profile, checks the result against the user's :class:`GPUPermissions` (from the
admin's settings) and, when it has one, the allocator's current
:class:`~allocator.wire.protocol.InventoryReply` (for better messages), and builds the
:class:`~allocator.wire.protocol.AllocateRequest`.

Both input paths produce the same model. REST clients send::

    {"mode": "exclusive", "model": "1070", "count": 2}
    {"mode": "exclusive", "model": "any", "all_gpus_of_host": true, "host": "gpu-a"}
    {"mode": "shared", "model": "1070", "share_memory_mib": 2048}
    {"mode": "exclusive", "model": "a100", "count": 4, "topology": "nvlink"}
    {"profile": "small-share"}
    {"mode": "none"}

Every problem is an :class:`OptionsError` (a ``ValueError``) whose message a user can act on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from allocator.placement.gpu_sets import DEMANDED_LEVEL, TopologyDemand
from allocator.wire.capacity import gpu_groups, most_per_host
from allocator.wire.model_names import ModelNameError, ModelNames, same_model
from allocator.wire.protocol import (
    MAX_COUNT,
    MAX_GROUPS,
    MAX_MIB,
    MAX_MODELS,
    MAX_WAIT_S,
    AllocateRequest,
    Architecture,
    ComputeCapability,
    InventoryReply,
    ModelSummary,
    Name,
    ShareRequest,
)

ANY_MODEL = "any"
"""The ``model`` value that accepts every model the user may use."""

CUSTOM_PROFILE = "custom"
"""The form's profile value for "choose the GPU yourself"."""

PASSTHROUGH_KEYS = frozenset({"image"})
"""user_options keys that are not GPU options and are left to DockerSpawner (``image``)."""

GPU_FORM_FIELDS = ("profile", "mode", "model", "count", "all_gpus_of_host", "host",
                   "share_memory_mib")
"""The spawn form's fields that make a GPU choice; a form without any (dockerspawner's image
form, an admin's own) makes none, and the spawn gets the admin's default."""


class OptionsError(ValueError):
    """User input that cannot be honoured. ``str(error)`` is the message for the user."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field


class GPUMode(StrEnum):
    """How a server uses GPUs."""

    NONE = "none"
    """No GPU: the container gets ``NVIDIA_VISIBLE_DEVICES=void``."""
    EXCLUSIVE = "exclusive"
    """Whole GPUs, nobody else on them."""
    SHARED = "shared"
    """One share slot of one GPU with a memory budget."""


class GPUOptions(BaseModel):
    """A user's GPU choice, from the spawn form or REST ``user_options``."""

    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)

    mode: GPUMode = Field(default=GPUMode.NONE, description="none, exclusive or shared.")
    # Name: the wire's own bounds (printable, at most MAX_NAME characters), so that what the
    # form accepts is what an AllocateRequest can carry.
    model: Name = Field(
        default=ANY_MODEL,
        description='A model name or alias, or "any".',
        examples=["any", "1070", "NVIDIA GeForce GTX 1070"],
    )
    count: int = Field(default=1, description="Whole GPUs on one host (exclusive mode).")
    all_gpus_of_host: bool = Field(
        default=False, description="Every GPU (of the model) of one host, instead of count."
    )
    host: Name | None = Field(
        default=None, description="Only this node.", examples=["gpu-a"],
    )
    share_memory_mib: int | None = Field(
        default=None, description="Memory budget of a shared slice; default: the admin's."
    )
    min_compute_capability: ComputeCapability | None = Field(
        default=None, description='Only GPUs of at least this CUDA compute capability ("8.0").')
    architecture: Architecture | None = Field(
        default=None, description='Only GPUs of this architecture ("ampere").')
    topology: TopologyDemand | None = Field(
        default=None,
        description='Several whole GPUs all joined at least this well: "nvlink", '
        '"pcie-switch" (one PCIe switch) or "socket" (one CPU socket); None: the best '
        "available, whatever it is.")
    profile: str | None = Field(
        default=None, min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="Slug of one of the admin's named profiles.",
    )

    @field_validator("count", mode="before")
    @classmethod
    def _count_is_whole(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("must be a whole number of GPUs")
        return value

    @field_validator("count")
    @classmethod
    def _count_in_range(cls, value: int) -> int:
        if not 1 <= value <= MAX_COUNT:
            raise ValueError(f"must be between 1 and {MAX_COUNT} (you asked for {value})")
        return value

    @field_validator("share_memory_mib", mode="before")
    @classmethod
    def _memory_is_whole(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError("must be a whole number of MiB")
        return value

    @field_validator("share_memory_mib")
    @classmethod
    def _memory_in_range(cls, value: int | None) -> int | None:
        if value is not None and not 1 <= value <= MAX_MIB:
            raise ValueError(f"must be between 1 and {MAX_MIB} MiB (you asked for {value})")
        return value

    @property
    def wants_gpu(self) -> bool:
        return self.mode is not GPUMode.NONE

    @property
    def any_model(self) -> bool:
        return self.model.lower() == ANY_MODEL

    def normalized(self) -> GPUOptions:
        """Drop fields that mean nothing in this mode, so equal choices compare equal."""
        if self.mode is GPUMode.NONE:
            return GPUOptions(mode=GPUMode.NONE, profile=self.profile)
        if self.mode is GPUMode.SHARED:
            return self.model_copy(update={"count": 1, "all_gpus_of_host": False,
                                           "topology": None})
        if self.count == 1 and not self.all_gpus_of_host:
            # one GPU has no link to another: a demanded level means nothing
            return self.model_copy(update={"share_memory_mib": None, "topology": None})
        return self.model_copy(update={"share_memory_mib": None})

    def describe(self) -> str:
        """The GPU part in words, lower case: "2 whole GPUs (1070) on gpu-a"."""
        if self.mode is GPUMode.NONE:
            return "no GPU"
        model = "any model" if self.any_model else self.model
        where = f" on {self.host}" if self.host else ""
        if self.mode is GPUMode.SHARED:
            budget = f", {self.share_memory_mib} MiB" if self.share_memory_mib else ""
            return f"shared slice of one GPU ({model}{budget}){where}"
        if self.all_gpus_of_host:
            return f"all GPUs of one host ({model}){where}"
        if self.min_compute_capability or self.architecture:
            needs = [f"compute capability {self.min_compute_capability}+"
                     if self.min_compute_capability else "", self.architecture or ""]
            where += " (" + ", ".join(n for n in needs if n) + ")"
        if self.topology is not None:
            where += f", joined by {DEMANDED_LEVEL[self.topology].words} or better"
        plural = "GPU" if self.count == 1 else "GPUs"
        return f"{self.count} whole {plural} ({model}){where}"

    def to_user_options(self) -> dict[str, Any]:
        """The JSON ``user_options`` form of this choice (defaults left out)."""
        return self.model_dump(mode="json", exclude_defaults=True) or {"mode": "none"}


def _field_label(loc: Sequence[Any]) -> str:
    labels = {
        "mode": "GPU mode",
        "model": "GPU model",
        "count": "GPU count",
        "all_gpus_of_host": "all GPUs of a host",
        "host": "host",
        "share_memory_mib": "shared memory budget (MiB)",
        "min_compute_capability": "minimum compute capability",
        "architecture": "GPU architecture",
        "topology": "GPU connection",
        "profile": "profile",
    }
    name = str(loc[0]) if loc else ""
    return labels.get(name, name or "options")


def _describe(exc: ValidationError) -> OptionsError:
    parts = []
    first_field = None
    for err in exc.errors(include_url=False)[:4]:
        loc = err.get("loc", ())
        first_field = first_field or (str(loc[0]) if loc else None)
        label = _field_label(loc)
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            known = ", ".join(sorted([*GPUOptions.model_fields, *PASSTHROUGH_KEYS]))
            parts.append(f"unknown option '{loc[0] if loc else '?'}' (known options: {known})")
            continue
        if err["type"] == "enum":
            msg = "must be one of: none, exclusive, shared"
        if loc and loc[0] == "topology":
            msg = f"must be one of: any, {', '.join(DEMANDED_LEVEL)} (not {err['input']!r})"
        msg = msg.removeprefix("Value error, ")
        parts.append(f"{label}: {msg}")
    return OptionsError("Invalid GPU options: " + "; ".join(parts) + ".", field=first_field)


def parse_user_options(user_options: Mapping[str, Any] | None) -> GPUOptions:
    """Parse REST/stored ``user_options``. Keys in :data:`PASSTHROUGH_KEYS` are ignored here."""
    if user_options is None:
        return GPUOptions()
    if not isinstance(user_options, Mapping):
        raise OptionsError("user_options must be a JSON object")
    data = {k: v for k, v in user_options.items() if k not in PASSTHROUGH_KEYS}
    try:
        return GPUOptions.model_validate(data)
    except ValidationError as exc:
        raise _describe(exc) from None


def _first(formdata: Mapping[str, Sequence[str]], key: str) -> str | None:
    values = formdata.get(key)
    if not values:
        return None
    value = values[0]
    if not isinstance(value, str):
        raise OptionsError(f"the form field '{key}' must be text")
    value = value.strip()
    return value or None


def _whole_number(text: str, label: str, field: str) -> int:
    try:
        return int(text, 10)
    except ValueError:
        raise OptionsError(f"{label} must be a whole number, not '{text[:40]}'",
                           field=field) from None


def options_from_form(formdata: Mapping[str, Sequence[str]]) -> dict[str, Any]:
    """Turn the spawn form's fields (``{name: [values]}``) into JSON ``user_options``.

    Fields of the form: ``profile`` (a slug or ``custom``), ``mode``, ``model``, ``count``
    (a number or ``all``), ``host`` (empty = any), ``share_memory_mib``, ``topology``
    (``any`` or a demanded level; only the forms of clusters whose hosts report their links
    have it), and ``image`` if the admin offers images. Unknown fields (the hub's
    ``_xsrf``...) are ignored. Choosing a profile ignores the custom fields, as a browser
    would still submit them. A form with none of the GPU fields (:data:`GPU_FORM_FIELDS`)
    chooses nothing: only ``image`` is kept, and the spawn gets the default choice, as a
    REST spawn without GPU options does.
    """
    out: dict[str, Any] = {}
    image = _first(formdata, "image")
    if image is not None:
        out["image"] = image
    if all(_first(formdata, field) is None for field in GPU_FORM_FIELDS):
        # "no GPU" pinned here would override the admin's default_gpu_mode and profiles
        return out
    profile = _first(formdata, "profile")
    if profile is not None and profile != CUSTOM_PROFILE:
        parse_user_options({"profile": profile})  # validates the slug
        return {**out, "profile": profile}

    raw: dict[str, Any] = {}
    mode = _first(formdata, "mode")
    if mode is not None:
        raw["mode"] = mode
    model = _first(formdata, "model")
    if model is not None:
        raw["model"] = model
    count = _first(formdata, "count")
    if count is not None:
        if count.lower() == "all":
            raw["all_gpus_of_host"] = True
        else:
            raw["count"] = _whole_number(count, "GPU count", "count")
    if _first(formdata, "all_gpus_of_host") in ("on", "true", "1", "yes"):
        raw["all_gpus_of_host"] = True
    host = _first(formdata, "host")
    if host is not None and host.lower() != "any":
        raw["host"] = host
    memory = _first(formdata, "share_memory_mib")
    if memory is not None:
        raw["share_memory_mib"] = _whole_number(
            memory, "Shared memory budget", "share_memory_mib"
        )
    topology = _first(formdata, "topology")
    if topology is not None and topology.lower() != "any":
        raw["topology"] = topology
    options = parse_user_options(raw).normalized()
    return {**out, **options.to_user_options()}


# --------------------------------------------------------------------------- profiles


class Profile(BaseModel):
    """A named preset the admin offers first on the spawn page (like kubespawner's profiles).

    A profile fixes the GPU request; ``spawner_override`` sets spawner traits for servers
    started with it (``image``, ``mem_limit``, ``cpu_limit``, ``environment``...). Profiles
    are the admin's own choice, so their GPU request is not held to ``group_models``,
    ``user_max_gpus`` or ``allowed_hosts``; ``groups`` decides who may use them.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    slug: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
    display_name: str = Field(min_length=1, max_length=200)
    description: str = Field(default="", max_length=2000)
    default: bool = False
    groups: list[str] | None = Field(
        default=None, description="Only members of these groups may use it; None = everyone."
    )
    mode: GPUMode = GPUMode.NONE
    model: str = ANY_MODEL
    count: int = Field(default=1, ge=1, le=MAX_COUNT)
    all_gpus_of_host: bool = False
    host: str | None = None
    share_memory_mib: int | None = Field(default=None, ge=1)
    min_compute_capability: ComputeCapability | None = None
    architecture: Architecture | None = None
    topology: TopologyDemand | None = None
    spawner_override: dict[str, Any] = Field(default_factory=dict)

    @field_validator("slug")
    @classmethod
    def _not_custom(cls, slug: str) -> str:
        if slug == CUSTOM_PROFILE:
            raise ValueError(f"'{CUSTOM_PROFILE}' is reserved for the form's own choice")
        return slug

    def options(self) -> GPUOptions:
        """The GPU choice this profile stands for."""
        return GPUOptions(
            mode=self.mode,
            model=self.model,
            count=self.count,
            all_gpus_of_host=self.all_gpus_of_host,
            host=self.host,
            share_memory_mib=self.share_memory_mib,
            min_compute_capability=self.min_compute_capability,
            architecture=self.architecture,
            topology=self.topology,
            profile=self.slug,
        ).normalized()

    def allowed_for(self, groups: Iterable[str]) -> bool:
        return self.groups is None or bool(set(self.groups) & set(groups))

    def summary(self) -> str:
        """One line describing the GPU part, for the form."""
        text = self.options().describe()
        return text[0].upper() + text[1:]


def load_profiles(raw: Iterable[Mapping[str, Any] | Profile]) -> list[Profile]:
    """Validate the admin's ``gpu_profiles`` (raises ``ValueError`` naming the bad entry)."""
    profiles: list[Profile] = []
    for i, entry in enumerate(raw):
        try:
            profiles.append(entry if isinstance(entry, Profile) else Profile.model_validate(entry))
        except ValidationError as exc:
            raise ValueError(f"gpu_profiles[{i}] is invalid: {exc}") from None
    slugs = [p.slug for p in profiles]
    dupes = sorted({s for s in slugs if slugs.count(s) > 1})
    if dupes:
        raise ValueError(f"gpu_profiles has duplicate slugs: {', '.join(dupes)}")
    return profiles


def visible_profiles(profiles: Iterable[Profile], groups: Iterable[str]) -> list[Profile]:
    groups = list(groups)
    return [p for p in profiles if p.allowed_for(groups)]


def resolve_profile(
    options: GPUOptions, profiles: Sequence[Profile], groups: Iterable[str]
) -> tuple[GPUOptions, Profile | None]:
    """Replace a profile reference by the profile's own choice.

    REST clients that name a profile must not also set GPU fields: the profile fixes them.
    """
    if options.profile is None:
        return options, None
    by_slug = {p.slug: p for p in profiles}
    profile = by_slug.get(options.profile)
    groups = list(groups)
    if profile is None or not profile.allowed_for(groups):
        offered = [p.slug for p in profiles if p.allowed_for(groups)]
        listing = ", ".join(offered) if offered else "none"
        raise OptionsError(
            f"Unknown profile '{options.profile}'. Profiles you may use: {listing}.",
            field="profile",
        )
    fixed = options.model_dump(exclude_defaults=True, exclude={"profile"})
    if fixed:
        raise OptionsError(
            f"Profile '{profile.slug}' fixes the GPU choice; leave out "
            f"{', '.join(sorted(fixed))} or choose no profile.",
            field="profile",
        )
    return profile.options(), profile


def choice_from_user_options(
    user_options: Mapping[str, Any] | None,
    profiles: Sequence[Profile],
    groups: Iterable[str],
    default_mode: GPUMode,
) -> tuple[GPUOptions, Profile | None]:
    """The user's choice with its profile resolved (raises :class:`OptionsError`).

    ``profiles`` are those the user may use. A spawn without GPU options (a REST spawn, or one
    that only picks an image) gets the default profile, or else ``default_mode``.
    """
    raw = dict(user_options or {})
    options = parse_user_options(raw)
    if not makes_gpu_choice(raw):
        default = next((p for p in profiles if p.default), None)
        options = GPUOptions(profile=default.slug) if default else GPUOptions(mode=default_mode)
    return resolve_profile(options, profiles, groups)


def makes_gpu_choice(user_options: Mapping[str, Any] | None) -> bool:
    """Whether ``user_options`` choose anything about GPUs (more than :data:`PASSTHROUGH_KEYS`);
    those that do not get the default choice."""
    return bool((user_options or {}).keys() - PASSTHROUGH_KEYS)


def offers_gpu_choice(permissions: GPUPermissions, profiles: Iterable[Profile]) -> bool:
    """Whether a user has a GPU to choose: GPUs of their own choice, or a profile with one.

    A user with neither gets no GPU form: the spawn is SwarmSpawner's (a straight spawn, or
    dockerspawner's image choice), and starts without a GPU.
    """
    return permissions.may_use_gpus or any(p.options().wants_gpu for p in profiles)


def default_mode_for(permissions: GPUPermissions, default_mode: GPUMode) -> GPUMode:
    """The mode of a spawn that chooses nothing: the admin's ``default_mode``, but no GPU for a
    user who may not pick GPUs, whose straight spawn must start (as SwarmSpawner's does)
    rather than be refused a GPU nobody asked for."""
    return default_mode if permissions.may_use_gpus else GPUMode.NONE


# --------------------------------------------------------------------------- permissions


class GPUPermissions(BaseModel):
    """What one user may ask for, derived from the spawner's admin settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    allowed_models: list[str] | None = Field(
        default=None, description="Models (names or aliases) this user may use; None = any."
    )
    max_gpus: int = Field(default=1, ge=0, le=MAX_COUNT, description="Per server.")
    allowed_hosts: list[str] | None = Field(default=None, description="None = any host.")
    max_share_memory_mib: int | None = Field(default=None, ge=1)
    default_share_memory_mib: int | None = Field(default=None, ge=1)
    allow_all_gpus_of_host: bool = True
    groups: list[str] = Field(default_factory=list, description="For messages.")

    @property
    def may_use_gpus(self) -> bool:
        return self.max_gpus > 0 and (self.allowed_models is None or bool(self.allowed_models))


def allowed_models_for(
    groups: Iterable[str],
    group_models: Mapping[str, Sequence[str]],
    default_models: Sequence[str] | None,
) -> list[str] | None:
    """The models a user may use: the union over their groups; ``"*"`` means any (None).

    A user in none of ``group_models``' groups gets ``default_models``.
    """
    groups = list(groups)
    matched = [g for g in groups if g in group_models]
    if not matched:
        if default_models is None or "*" in default_models:
            return None
        return list(dict.fromkeys(default_models))
    models: list[str] = []
    for group in matched:
        if "*" in group_models[group]:
            return None
        models.extend(group_models[group])
    return list(dict.fromkeys(models))


def permissions_for(
    groups: Sequence[str],
    *,
    group_models: Mapping[str, Sequence[str]],
    default_models: Sequence[str] | None,
    user_max_gpus: int,
    group_max_gpus: Mapping[str, int],
    allowed_hosts: Sequence[str] | None,
    max_share_memory_mib: int | None,
    default_share_memory_mib: int | None,
    allow_all_gpus_of_host: bool,
) -> GPUPermissions:
    """What a user in ``groups`` may ask for, from the spawner's admin settings.

    The GPU limit is the largest of ``user_max_gpus`` and the user's groups' limits, bounded
    by what one request may ask for.
    """
    limits = [limit for group, limit in group_max_gpus.items() if group in set(groups)]
    return GPUPermissions(
        allowed_models=allowed_models_for(groups, group_models, default_models),
        max_gpus=min(max(0, int(max([user_max_gpus, *limits]))), MAX_COUNT),
        allowed_hosts=list(allowed_hosts) if allowed_hosts is not None else None,
        max_share_memory_mib=max_share_memory_mib,
        default_share_memory_mib=default_share_memory_mib,
        allow_all_gpus_of_host=allow_all_gpus_of_host,
        groups=list(groups),
    )


class ModelCatalog:
    """The models the allocator's inventory lists, matched by the allocator's own rule.

    Spellings are :mod:`allocator.wire.model_names`' (case, spaces, punctuation and vendor words
    do not matter; aliases count), so the hub accepts exactly what the allocator accepts.
    """

    def __init__(self, models: Iterable[ModelSummary]):
        self.models = {m.model: m for m in models}
        self.names = ModelNames.from_summaries(self.models.values())

    def canonical(self, name: str) -> str | None:
        """The canonical model a spelling means, or None (unknown or ambiguous)."""
        return self.names.canonical(name)

    def canonical_or_raw(self, name: str) -> str:
        return self.canonical(name) or name

    def known(self) -> list[str]:
        return sorted(self.models)


def _same_model(a: str, b: str, catalog: ModelCatalog | None) -> bool:
    return same_model(a, b, catalog.names if catalog is not None else None)


def _plural(n: int, word: str = "GPU") -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class CheckedRequest(BaseModel):
    """A GPU choice the user is permitted: what to ask the allocator for."""

    model_config = ConfigDict(frozen=True)

    options: GPUOptions
    model: str | None = None
    models: list[str] | None = None
    count: int | str = 1
    host: str | None = None
    share_memory_mib: int | None = None
    shared: bool = False

    @property
    def min_compute_capability(self) -> str | None:
        """Passed through to the allocator, which alone knows each GPU's capability."""
        return self.options.min_compute_capability

    @property
    def architecture(self) -> str | None:
        """Passed through to the allocator, which alone knows each GPU's architecture."""
        return self.options.architecture


@dataclass(frozen=True)
class _Context:
    """What every per-field check reads: the choice, the limits and what the cluster has."""

    options: GPUOptions
    permissions: GPUPermissions
    inventory: InventoryReply | None
    catalog: ModelCatalog | None
    trusted: bool

    @property
    def who(self) -> str:
        return f" (groups: {', '.join(self.permissions.groups)})" if self.permissions.groups else ""


def check_options(
    options: GPUOptions,
    permissions: GPUPermissions,
    inventory: InventoryReply | None = None,
    *,
    trusted: bool = False,
) -> CheckedRequest | None:
    """Check a choice against what the user may ask for (and the inventory, when known).

    Returns None for "no GPU". ``trusted`` (an admin's profile) skips the per-user limits:
    models, count, hosts and share size; sanity checks against the inventory still apply.
    One check per field, in this order: may use GPUs, model, host, then the shared slice or
    the number of whole GPUs and their connection (``topology``: refused where the inventory
    shows no host that reported its links; the caller reads the inventory for a choice that
    demands one).
    """
    options = options.normalized()
    if not options.wants_gpu:
        return None
    ctx = _Context(options, permissions, inventory,
                   ModelCatalog(inventory.models) if inventory is not None else None, trusted)
    _check_may_use_gpus(ctx)
    model, models = _check_model(ctx)
    eligible = _eligible_models(ctx, model, models)
    host = _check_host(ctx)
    # A request that names no model, nor a list, is the one whose "all GPUs of a host" may
    # mix models (allocator.wire.capacity); the allocator gets exactly that request.
    per_host = _gpus_per_host(ctx, eligible, host, any_model=model is None and models is None)
    what = "any model you may use" if model is None else model
    if options.mode is GPUMode.SHARED:
        memory, models = _check_share(ctx, eligible, model, models, what)
        if host is not None and per_host and per_host.get(host, 0) == 0:
            raise OptionsError(f"Host '{host}' has no GPU of {what}.", field="host")
        return CheckedRequest(
            options=options, model=model, models=models, count=1, host=host,
            share_memory_mib=memory, shared=True,
        )
    count = _check_count(ctx, per_host, host, what, one_model=model is not None)
    _check_topology(ctx)
    return CheckedRequest(options=options, model=model, models=models, count=count, host=host)


def _check_topology(ctx: _Context) -> None:
    """A demanded connection goes only to an allocator known to read it: one whose inventory
    shows a host that reported its links (docs/protocol.md, "Compatibility": an older
    allocator would ignore the demand and grant any GPUs)."""
    if ctx.options.topology is None or ctx.inventory is None:
        return
    if not any(node.interconnect is not None for node in ctx.inventory.nodes):
        raise OptionsError(
            "No GPU host has reported how its GPUs are joined, so no connection can be "
            "promised; ask without one (connection: any).",
            field="topology",
        )


def _check_may_use_gpus(ctx: _Context) -> None:
    if not ctx.trusted and not ctx.permissions.may_use_gpus:
        raise OptionsError(
            f"You may not use GPUs{ctx.who}. Start without a GPU, or ask an administrator.",
            field="mode",
        )


def _check_model(ctx: _Context) -> tuple[str | None, list[str] | None]:
    """The model asked for (canonical when the catalog knows it), or the list to send."""
    options, catalog = ctx.options, ctx.catalog
    allowed = None if ctx.trusted else ctx.permissions.allowed_models
    if options.any_model:
        if allowed is None:
            return None, None
        if catalog is not None:
            # only models the cluster has: the allocator refuses unknown names
            names = [c for c in (catalog.canonical(m) for m in allowed) if c is not None]
            if not names:
                raise OptionsError(
                    f"None of the GPU models you may use ({', '.join(allowed)}) is in "
                    "the cluster right now.",
                    field="model",
                )
        else:
            names = list(allowed)
        return None, list(dict.fromkeys(names))[:MAX_MODELS]
    if catalog is not None:
        resolved = catalog.names.resolve([options.model])
        if isinstance(resolved, ModelNameError):
            # the allocator's own refusal, from the same rule
            raise OptionsError(resolved.message, field="model")
    if allowed is not None and not any(_same_model(options.model, a, catalog) for a in allowed):
        raise OptionsError(
            f"You may not use GPU model '{options.model}'{ctx.who}. "
            f"Models you may use: {', '.join(allowed) or 'none'}.",
            field="model",
        )
    return (catalog.canonical_or_raw(options.model) if catalog else options.model), None


def _eligible_models(ctx: _Context, model: str | None,
                     models: list[str] | None) -> list[ModelSummary] | None:
    """The models this request could land on, as the inventory knows them (None: unknown)."""
    catalog = ctx.catalog
    if catalog is None:
        return None
    if model is not None:
        return [catalog.models[model]]
    if models is not None:
        return [catalog.models[m] for m in models if m in catalog.models]
    return list(catalog.models.values())


def _check_host(ctx: _Context) -> str | None:
    host, permissions, inventory = ctx.options.host, ctx.permissions, ctx.inventory
    if host is None:
        return None
    allowed = permissions.allowed_hosts
    if not ctx.trusted and allowed is not None and host not in allowed:
        raise OptionsError(
            f"You may not use host '{host}'. "
            f"Hosts you may use: {', '.join(allowed) or 'none'}.",
            field="host",
        )
    if inventory is not None and host not in {n.host for n in inventory.nodes}:
        known_hosts = ", ".join(sorted(n.host for n in inventory.nodes)) or "none"
        raise OptionsError(f"Unknown host '{host}'. Hosts with GPUs: {known_hosts}.",
                           field="host")
    return host


def _gpus_per_host(ctx: _Context, eligible: list[ModelSummary] | None,
                   host: str | None, *, any_model: bool) -> dict[str, int]:
    """Host -> the most GPUs (total, not just free) one request of the eligible models can
    get there, by the allocator's own rule (:mod:`allocator.wire.capacity`: a count is of one
    model); empty when unknown."""
    if ctx.inventory is None or eligible is None:
        return {}
    eligible_names = {m.model for m in eligible}
    allowed_hosts = ctx.permissions.allowed_hosts
    counted = [
        (gpu.host, gpu.model) for gpu in ctx.inventory.gpus
        # a GPU in MIG mode is no unit: its instances are counted instead
        if not gpu.mig_enabled and gpu.model in eligible_names
        and (ctx.trusted or allowed_hosts is None or gpu.host in allowed_hosts)
    ]
    per_host = most_per_host(gpu_groups(
        counted, all_of_host=ctx.options.all_gpus_of_host, any_model=any_model))
    if host is not None:
        per_host = {host: per_host.get(host, 0)}
    return per_host


def _check_share(ctx: _Context, eligible: list[ModelSummary] | None, model: str | None,
                 models: list[str] | None, what: str) -> tuple[int | None, list[str] | None]:
    """The slice's budget, and the models narrowed to those that can be shared."""
    permissions = ctx.permissions
    memory = ctx.options.share_memory_mib or permissions.default_share_memory_mib
    if (
        not ctx.trusted
        and memory is not None
        and permissions.max_share_memory_mib is not None
        and memory > permissions.max_share_memory_mib
    ):
        raise OptionsError(
            f"A shared slice may have at most {permissions.max_share_memory_mib} MiB; "
            f"you asked for {memory} MiB.",
            field="share_memory_mib",
        )
    if eligible is None:
        return memory, models
    shareable = [m for m in eligible if m.share_slots > 1]
    if not shareable:
        raise OptionsError(
            f"GPU model {what} cannot be shared (whole GPUs only); "
            "choose exclusive mode or another model.",
            field="mode",
        )
    if memory is not None:
        fitting = [m for m in shareable if m.memory_total_mib >= memory]
        if not fitting:
            biggest = max(shareable, key=lambda m: m.memory_total_mib)
            raise OptionsError(
                f"A shared slice of {memory} MiB is larger than the GPU: "
                f"{biggest.model} has {biggest.memory_total_mib} MiB.",
                field="share_memory_mib",
            )
        shareable = fitting
    if model is None and len(shareable) < len(eligible):
        models = [m.model for m in shareable][:MAX_MODELS]
    return memory, models


def _check_count(ctx: _Context, per_host: dict[str, int], host: str | None,
                 what: str, *, one_model: bool) -> int | str:
    """The number of whole GPUs (or ``"all"``) within the user's limit and the hosts.

    ``per_host`` is :func:`_gpus_per_host`'s; ``one_model`` says the request names one model
    (else the messages say why GPUs of several models on one host do not add up)."""
    options, permissions = ctx.options, ctx.permissions
    limit = MAX_COUNT if ctx.trusted else permissions.max_gpus
    if options.all_gpus_of_host:
        if not ctx.trusted and not permissions.allow_all_gpus_of_host:
            raise OptionsError(
                "'All GPUs of a host' is not offered here; choose a number of GPUs.",
                field="count",
            )
        if per_host:
            if host is not None and per_host[host] == 0:
                raise OptionsError(f"Host '{host}' has no GPU of {what}.", field="host")
            largest = max(per_host.values())
            if largest > limit:
                fits = sorted(h for h, n in per_host.items() if 0 < n <= limit)
                hint = (f" Hosts within your limit: {', '.join(fits)}." if fits else "")
                raise OptionsError(
                    f"'All GPUs of a host' could give you {_plural(largest)}, more than your "
                    f"limit of {limit} per server.{hint}",
                    field="count",
                )
        return "all"
    if options.count > limit:
        raise OptionsError(
            f"You may use at most {_plural(limit)} per server; you asked for "
            f"{options.count}.",
            field="count",
        )
    if per_host:
        largest = max(per_host.values())
        if largest == 0 and host is not None:
            raise OptionsError(f"Host '{host}' has no GPU of {what}.", field="host")
        if options.count > largest and not one_model:
            where = f"Host '{host}' has only" if host is not None else "No host has more than"
            raise OptionsError(
                f"{where} {_plural(largest)} of one model ({what}); you asked for "
                f"{options.count}. The GPUs of one server are all of one model.",
                field="count",
            )
        if options.count > largest and host is not None:
            raise OptionsError(
                f"Host '{host}' has only {_plural(largest)} of {what}; you asked for "
                f"{options.count}.",
                field="count",
            )
        if options.count > largest:
            raise OptionsError(
                f"No host has {_plural(options.count)} of {what} (the largest has "
                f"{largest}).",
                field="count",
            )
    return options.count


def request_key(hub_id: str, user: str, server_name: str) -> str:
    """The idempotency key of one server: ``hub/user/server`` (server is "" by default)."""
    return f"{hub_id}/{user}/{server_name}"


def build_allocate_request(
    checked: CheckedRequest,
    *,
    hub_id: str,
    user: str,
    server_name: str = "",
    groups: Sequence[str] = (),
    wait_s: float = 0.0,
    priority: int = 0,
) -> AllocateRequest:
    """The RPC request for a checked choice."""
    share = ShareRequest(memory_mib=checked.share_memory_mib) if checked.shared else None
    return AllocateRequest(
        request_key=request_key(hub_id, user, server_name),
        user=user,
        groups=list(groups)[:MAX_GROUPS],
        model=checked.model,
        models=checked.models,
        count=checked.count,
        host=checked.host,
        share=share,
        min_compute_capability=checked.min_compute_capability,
        architecture=checked.architecture,
        topology=checked.options.topology,
        wait_s=min(max(wait_s, 0.0), MAX_WAIT_S),
        priority=priority,
    )
