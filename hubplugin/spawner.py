"""``GPUSwarmSpawner``: a ``dockerspawner.SwarmSpawner`` that leases GPUs from the allocator.

Life of one server (docs/design.md, flows 1 and 3):

1. ``options_form`` asks the allocator for its inventory and renders the spawn form
   (:mod:`hubplugin.form`); ``options_from_form`` turns the submitted fields into
   ``user_options`` (:mod:`hubplugin.options`). REST clients send the same ``user_options``.
2. ``apply_user_options`` (and again ``start``) checks the choice against the admin's policy:
   a forged choice fails with HTTP 400 before anything is asked of the allocator.
3. ``start`` sends ``allocate`` with the idempotent key ``<hub_id>/<user>/<server>``; a queued
   request reports its position through ``progress()`` until granted or its wait runs out.
   The granted lease becomes env, placement constraint and label (:mod:`hubplugin.builders`),
   then ``SwarmSpawner.start`` creates the service.
4. Every stop path, failed spawns included, goes through ``run_post_stop_hook``, which
   releases the lease (by id, or by request key when the id never arrived): the allocator
   marks it ``releasing`` and frees the GPUs once the node reports the container gone.

The lease id and request key live in ``get_state()`` so a restarted hub releases what it
started, and an allocate retried with the same key never books twice.
"""

from __future__ import annotations

import asyncio
import copy
import weakref
from collections.abc import AsyncIterator, Callable
from inspect import isawaitable
from typing import Any

from dockerspawner import SwarmSpawner
from tornado import web
from traitlets import (
    Bool,
    Dict,
    Float,
    Int,
    List,
    TraitError,
    Unicode,
    Union,
    default,
    validate,
)
from traitlets import (
    Callable as CallableTrait,
)

from allocator.client import AllocatorClient, AllocatorError, StillQueued
from allocator.protocol import ErrorCode, InventoryReply, Lease, LeaseState

from .builders import BuildError, build_service_spec, describe_lease
from .form import render_form
from .options import (
    GPUMode,
    GPUOptions,
    GPUPolicy,
    OptionsError,
    Profile,
    allowed_models_for,
    build_allocate_request,
    check_options,
    load_profiles,
    options_from_form,
    parse_user_options,
    request_key,
    resolve_profile,
    visible_profiles,
)

# Errors that mean "the allocator looked and said no": no lease exists for the request.
_REFUSALS = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.UNSUPPORTED_VERSION: 500,
    ErrorCode.TOO_LARGE: 400,
    ErrorCode.UNKNOWN_MODEL: 400,
    ErrorCode.UNKNOWN_HOST: 400,
    ErrorCode.UNSATISFIABLE: 400,
    ErrorCode.NOT_SHAREABLE: 400,
    ErrorCode.CONFLICT: 409,
    ErrorCode.QUOTA_EXCEEDED: 403,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.NO_CAPACITY: 409,
}
_FAILURES = {
    ErrorCode.TIMEOUT: 503,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.STORAGE_ERROR: 503,
    ErrorCode.INTERNAL_ERROR: 503,
    ErrorCode.NOT_FOUND: 503,
}


def user_error(status: int, message: str) -> web.HTTPError:
    """An HTTPError whose message JupyterHub shows to the user as is."""
    error = web.HTTPError(status, "%s", message)
    error.jupyterhub_message = message  # type: ignore[attr-defined]
    return error


def allocator_http_error(exc: AllocatorError, *, what: str = "GPU request") -> web.HTTPError:
    """Map an allocator error to an HTTP error with a message for people."""
    if exc.code in (ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE):
        return user_error(
            503,
            f"The GPU allocator cannot be reached right now ({exc.message}). Try again in a "
            "minute, or start a server without a GPU.",
        )
    if exc.code is ErrorCode.NO_CAPACITY:
        return user_error(
            409,
            f"No GPU is free for your request right now ({exc.message}). Try again later, "
            "ask for fewer GPUs or another model, or start without a GPU.",
        )
    status = _REFUSALS.get(exc.code) or _FAILURES.get(exc.code, 500)
    if status >= 500:
        return user_error(status, f"The GPU allocator failed ({exc.code.value}): {exc.message}")
    return user_error(status, f"The {what} was refused ({exc.code.value}): {exc.message}")


class GPUSwarmSpawner(SwarmSpawner):
    """SwarmSpawner that gives each server the GPUs (or the shared slice) its user picked."""

    # ------------------------------------------------------------------ configuration

    allocator_url = Unicode(
        "amqp://guest:guest@127.0.0.1:5672/",
        config=True,
        help="""AMQP URL of the broker the allocator listens on.

        Use the broker user made for hubs, e.g. ``amqp://hub:SECRET@rabbitmq:5672/swarm-gpu``.
        """,
    )

    allocator_timeout = Float(
        10.0,
        config=True,
        help="""Seconds to wait for the allocator's answer to one call (allocate, status...).

        When it passes, the spawn fails with a clear message and the request is withdrawn.
        """,
    )

    allocator_connect_timeout = Float(
        5.0, config=True, help="Seconds to wait for the broker connection."
    )

    allocator_form_timeout = Float(
        3.0,
        config=True,
        help="""Seconds the spawn form waits for the inventory before it renders without it
        (users can then still start without a GPU).""",
    )

    release_timeout = Float(
        5.0,
        config=True,
        help="""Seconds a stop waits for the allocator to acknowledge a release. If it does not,
        the lease is freed anyway when the node agent sees the container gone.""",
    )

    hub_id = Unicode(
        "hub",
        config=True,
        help="""Names this hub in request keys (``<hub_id>/<user>/<server>``).

        Give every hub that shares one allocator its own id, e.g. ``"hub-physics"``.
        """,
    )

    gpu_profiles = List(
        Dict(),
        config=True,
        help="""Named presets shown first on the spawn page, like kubespawner's profile_list.

        Each entry: ``slug``, ``display_name``, optional ``description``, ``default``,
        ``groups`` (only these groups see it), the GPU choice (``mode`` none/exclusive/shared,
        ``model``, ``count``, ``all_gpus_of_host``, ``host``, ``share_memory_mib``) and
        ``spawner_override`` (traits set for servers started with it). Example::

            c.GPUSwarmSpawner.gpu_profiles = [
                {"slug": "cpu", "display_name": "CPU only", "mode": "none", "default": True},
                {"slug": "one-1070", "display_name": "One GTX 1070",
                 "mode": "exclusive", "model": "1070", "count": 1},
                {"slug": "small-share", "display_name": "Shared slice (2 GiB)",
                 "mode": "shared", "model": "1070", "share_memory_mib": 2048},
                {"slug": "full-node", "display_name": "A whole node", "groups": ["staff"],
                 "mode": "exclusive", "all_gpus_of_host": True,
                 "spawner_override": {"mem_limit": "64G"}},
            ]

        Profiles are the admin's choice: their GPU request is not limited by
        ``group_models``, ``user_max_gpus`` or ``allowed_hosts``; ``groups`` decides who may use
        them.
        """,
    )

    group_models = Dict(
        key_trait=Unicode(),
        value_trait=List(Unicode()),
        config=True,
        help="""GPU models (names or aliases) each JupyterHub group may choose. ``"*"`` = any.

        A user may use the union of their groups' models. Users in none of these groups get
        ``default_models``. Example::

            c.GPUSwarmSpawner.group_models = {"students": ["1070"], "staff": ["*"]}
        """,
    )

    default_models = List(
        Unicode(),
        default_value=["*"],
        config=True,
        help="""Models for users in none of ``group_models``' groups. ``["*"]`` = any model,
        ``[]`` = no GPU at all.""",
    )

    user_max_gpus = Union(
        [Int(), CallableTrait()],
        default_value=1,
        config=True,
        help="""Most whole GPUs one server may ask for (0 = no GPU).

        An int, or a callable ``f(spawner) -> int``, e.g.
        ``lambda spawner: 8 if spawner.user.admin else 1``.
        ``group_max_gpus`` can raise it for members of some groups.
        """,
    )

    group_max_gpus = Dict(
        key_trait=Unicode(),
        value_trait=Int(),
        config=True,
        help="""Per-group GPU limits per server; a user gets the largest of their groups' values
        (or ``user_max_gpus`` when larger or when in none). Example: ``{"staff": 8}``.""",
    )

    allowed_hosts = List(
        Unicode(),
        default_value=None,
        allow_none=True,
        config=True,
        help="""Hosts users may pick (and that the form lists). None = any host.""",
    )

    allow_all_gpus_of_host = Bool(
        True,
        config=True,
        help="""Offer "all GPUs of a host" (still bounded by the user's GPU limit).""",
    )

    max_share_memory_mib = Int(
        None,
        allow_none=True,
        config=True,
        help="""Largest memory budget (MiB) of a shared slice a user may ask for. None = up to
        the GPU's memory.""",
    )

    share_default_memory_mib = Int(
        None,
        allow_none=True,
        config=True,
        help="""Memory budget (MiB) of a shared slice when the user gives none. None = the
        allocator's default (the GPU's memory divided by its share slots).""",
    )

    default_gpu_mode = Unicode(
        GPUMode.NONE.value,
        config=True,
        help="""Mode preselected on the form and used by REST spawns without options:
        ``none``, ``exclusive`` or ``shared``. A profile marked ``default`` wins.""",
    )

    wait_s = Float(
        0.0,
        config=True,
        help="""How long a request may wait in the allocator's queue when nothing fits now
        (0 = fail at once with "no GPU free"). The spawn page shows the queue position.
        ``start_timeout`` defaults to ``wait_s + 120`` so the hub does not give up first.""",
    )

    wait_recheck_s = Float(
        15.0,
        config=True,
        help="""While a request waits in the queue, the allocator pushes its grant the moment
        it is decided; the spawner asks ``status`` only after this many seconds without
        news (an allocator that restarted forgets where to push). It also refreshes the
        queue position shown on the spawn page.""",
    )

    gpu_form_template_paths = List(
        Unicode(),
        config=True,
        help="""Directories searched first for the spawn form's template,
        spawn_form.html.j2 (Jinja2, autoescaped), as kubespawner's
        additional_profile_form_template_paths. A file there replaces the packaged form; it
        may also {% extends "swarm_gpu/spawn_form.html.j2" %} and override one block (style,
        notes, images, profiles, custom, availability, script). The field names must stay
        those the packaged form uses.""",
    )

    gpu_priority = Union(
        [Int(), CallableTrait()],
        default_value=0,
        config=True,
        help="""Queue priority of this user's requests (higher first), or ``f(spawner) -> int``.""",
    )

    @validate("default_gpu_mode")
    def _check_mode(self, proposal: Any) -> str:
        value: str = proposal["value"]  # a Unicode trait: already a str
        if value not in {m.value for m in GPUMode}:
            raise TraitError(f"default_gpu_mode must be none, exclusive or shared, not {value!r}")
        return value

    @validate("gpu_profiles")
    def _check_profiles(self, proposal: Any) -> list[dict[str, Any]]:
        try:
            load_profiles(proposal["value"])
        except ValueError as exc:
            raise TraitError(str(exc)) from None
        profiles: list[dict[str, Any]] = proposal["value"]  # a List(Dict()) trait
        return profiles

    @validate("wait_s")
    def _check_wait(self, proposal: Any) -> float:
        value = float(proposal["value"])
        if not 0 <= value <= 24 * 3600:
            raise TraitError("wait_s must be between 0 and 86400 seconds")
        return value

    @default("start_timeout")
    def _default_start_timeout(self) -> int:
        return int(max(120.0, self.wait_s + 120.0))

    @default("options_form")
    def _default_options_form(self) -> Callable[[Any], Any]:
        return _render_options_form

    @default("options_from_form")
    def _default_options_from_form(self) -> Callable[[dict[str, list[str]]], dict[str, Any]]:
        return options_from_form

    @default("apply_user_options")
    def _default_apply_user_options(self) -> Callable[[Any, dict[str, Any]], Any]:
        return _apply_gpu_user_options

    # Traits inherited from SwarmSpawner (untyped), as start() reads and swaps them. Bare
    # annotations: no class attribute is created, the traits stay dockerspawner's.
    # DockerSpawner also accepts a callable for extra_create_kwargs, but SwarmSpawner passes
    # it to dict.update(), so only a dict works with a Swarm service.
    extra_container_spec: dict[str, Any]
    extra_placement_spec: dict[str, Any]
    extra_create_kwargs: dict[str, Any]
    extra_task_spec: dict[str, Any]

    # ------------------------------------------------------------------ state

    gpu_lease_id = Unicode(None, allow_none=True, help="Lease of the running server (state).")
    gpu_request_key = Unicode(
        None, allow_none=True, help="Request key sent to the allocator for this server (state)."
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._gpu_env: dict[str, str] = {}
        self._gpu_events: list[dict[str, Any]] = []
        self._gpu_events_done = True
        self._override_saved: dict[str, Any] = {}

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.gpu_lease_id = state.get("gpu_lease_id") or None
        self.gpu_request_key = state.get("gpu_request_key") or None

    def get_state(self) -> dict[str, Any]:
        state: dict[str, Any] = super().get_state()
        if self.gpu_lease_id:
            state["gpu_lease_id"] = self.gpu_lease_id
        if self.gpu_request_key:
            state["gpu_request_key"] = self.gpu_request_key
        return state

    def clear_state(self) -> None:
        # The lease fields survive clear_state on purpose: DockerSpawner.stop() clears the state
        # *before* JupyterHub runs the post-stop hook that releases the lease. They are reset
        # by release_gpus() and at the start of the next spawn.
        super().clear_state()

    # ------------------------------------------------------------------ helpers

    @property
    def request_key(self) -> str:
        return request_key(self.hub_id, self.user.name, self.name or "")

    def user_groups(self) -> list[str]:
        try:
            return sorted(g.name for g in self.user.groups)
        except AttributeError:
            return []

    def profiles(self) -> list[Profile]:
        """The admin's profiles this user may use."""
        return visible_profiles(load_profiles(self.gpu_profiles), self.user_groups())

    def _max_gpus(self) -> int:
        value = self.user_max_gpus(self) if callable(self.user_max_gpus) else self.user_max_gpus
        groups = set(self.user_groups())
        for group, limit in self.group_max_gpus.items():
            if group in groups:
                value = max(value, limit)
        return max(0, int(value))

    def gpu_policy(self) -> GPUPolicy:
        """What this user may ask for."""
        groups = self.user_groups()
        return GPUPolicy(
            allowed_models=allowed_models_for(groups, self.group_models, self.default_models),
            max_gpus=min(self._max_gpus(), 64),
            allowed_hosts=list(self.allowed_hosts) if self.allowed_hosts is not None else None,
            max_share_memory_mib=self.max_share_memory_mib,
            default_share_memory_mib=self.share_default_memory_mib,
            allow_all_gpus_of_host=self.allow_all_gpus_of_host,
            groups=groups,
        )

    def allocator_client(self) -> AllocatorClient:
        """The hub's shared RPC client (one per event loop and URL)."""
        return _shared_client(
            self.allocator_url, self.allocator_timeout, self.allocator_connect_timeout
        )

    def _emit(self, message: str, progress: int | None = None) -> None:
        event: dict[str, Any] = {"message": message}
        if progress is not None:
            event["progress"] = progress
        self._gpu_events.append(event)
        self.log.info("%s: %s", self._log_name, message)

    def gpu_choice(self) -> tuple[GPUOptions, Profile | None]:
        """The user's choice with profiles resolved; HTTP 400 when it cannot be parsed."""
        raw = dict(self.user_options or {})
        profiles = self.profiles()
        try:
            options = parse_user_options(raw)
            if not {k for k in raw if k != "image"}:
                default = next((p for p in profiles if p.default), None)
                options = (GPUOptions(profile=default.slug) if default
                           else GPUOptions(mode=GPUMode(self.default_gpu_mode)))
            return resolve_profile(options, profiles, self.user_groups())
        except OptionsError as exc:
            raise user_error(400, str(exc)) from None

    def check_choice(
        self, options: GPUOptions, profile: Profile | None, inventory: InventoryReply | None
    ) -> Any:
        try:
            return check_options(options, self.gpu_policy(), inventory, trusted=profile is not None)
        except OptionsError as exc:
            raise user_error(400, str(exc)) from None

    def _apply_profile_override(self, profile: Profile | None) -> None:
        for name, value in self._override_saved.items():
            setattr(self, name, value)
        self._override_saved = {}
        if profile is None:
            return
        for name, value in profile.spawner_override.items():
            if not self.has_trait(name):
                raise user_error(
                    500, f"profile {profile.slug!r} overrides unknown setting {name!r}"
                )
            current = getattr(self, name)
            self._override_saved[name] = copy.deepcopy(current)
            if callable(value):
                value = value(self)
            if isinstance(value, dict) and isinstance(current, dict):
                value = {**current, **value}
            setattr(self, name, value)

    # ------------------------------------------------------------------ spawn form

    async def gpu_options_form(self) -> str:
        """Render the spawn form from the allocator's current inventory."""
        policy = self.gpu_policy()
        inventory: InventoryReply | None = None
        unavailable = None
        try:
            inventory = await self.allocator_client().inventory(
                timeout_s=self.allocator_form_timeout
            )
        except AllocatorError as exc:
            unavailable = exc.message
            self.log.warning("Spawn form without GPU inventory: %s", exc)
        current = None
        try:
            previous = parse_user_options(self.user_options or {})
            if self.user_options:
                current = previous
        except OptionsError:
            pass
        images = self._get_allowed_images()
        return render_form(
            inventory,
            policy=policy,
            profiles=self.profiles(),
            current=current,
            default_mode=GPUMode(self.default_gpu_mode),
            unavailable=unavailable,
            wait_s=self.wait_s,
            images=images if isinstance(images, dict) and len(images) > 1 else None,
            current_image=(self.user_options or {}).get("image"),
            template_paths=self.gpu_form_template_paths,
        )

    # ------------------------------------------------------------------ start / stop

    def _effective_wait(self) -> float:
        # leave the hub's start_timeout room for creating the service
        return max(0.0, min(self.wait_s, float(self.start_timeout) - 30.0))

    async def _inventory_or_none(self) -> InventoryReply | None:
        try:
            return await self.allocator_client().inventory(timeout_s=self.allocator_timeout)
        except AllocatorError as exc:
            if exc.code in (ErrorCode.TIMEOUT, ErrorCode.UNAVAILABLE):
                raise allocator_http_error(exc) from None
            self.log.warning("No inventory for checking %s's options: %s", self._log_name, exc)
            return None

    async def _remove_orphan_service(self) -> None:
        """A service left by a hub that died mid-spawn holds the old lease: remove it first."""
        obj = await self.get_object()
        if obj is None:
            return
        self.log.warning("Removing leftover service %s before leasing GPUs", self.object_name)
        await self.remove_object()
        self.object_id = ""
        await self._release(self.request_key, None, reason="leftover service removed")

    async def acquire_gpus(self, options: GPUOptions, profile: Profile | None) -> Lease | None:
        """Lease GPUs for the choice (None for "no GPU"). Raises HTTPError with a message."""
        if not options.wants_gpu:
            return None
        # One RPC per spawn: the allocator checks the request against the cluster and refuses
        # with its own text. Only a user held to a list of models needs the cluster's model
        # names first (aliases, and which of the allowed models exist to ask for).
        restricted = profile is None and self.gpu_policy().allowed_models is not None
        inventory = await self._inventory_or_none() if restricted else None
        checked = self.check_choice(options, profile, inventory)
        if checked is None:
            return None
        priority = self.gpu_priority(self) if callable(self.gpu_priority) else self.gpu_priority
        wait = self._effective_wait()
        request = build_allocate_request(
            checked,
            hub_id=self.hub_id,
            user=self.user.name,
            server_name=self.name or "",
            groups=self.user_groups(),
            wait_s=wait,
            priority=int(priority),
        )
        await self._remove_orphan_service()
        client = self.allocator_client()
        self.gpu_request_key = request.request_key
        self._emit("Asking the GPU allocator for " + _describe_request(options), 10)
        shown: list[int | None] = []

        def on_queued(queued: Lease) -> None:
            self.gpu_lease_id = queued.lease_id
            if not shown or queued.queue_position != shown[-1]:
                shown.append(queued.queue_position)
                self._emit(_queue_message(queued.queue_position, wait), 15)

        try:
            try:
                # A queued request's grant is pushed by the allocator the moment it is decided.
                lease = await client.allocate_and_wait(
                    request, recheck_s=self.wait_recheck_s, on_queued=on_queued)
            except StillQueued:
                raise AllocatorError(
                    ErrorCode.NO_CAPACITY, f"none became free within {wait:g} s"
                ) from None
            except AllocatorError as exc:
                if exc.code is not ErrorCode.NO_CAPACITY or not shown:
                    raise
                raise AllocatorError(
                    ErrorCode.NO_CAPACITY,
                    f"none became free while you waited {wait:g} s in the queue",
                ) from None
            self.gpu_lease_id = lease.lease_id
        except AllocatorError as exc:
            if exc.code in _REFUSALS and exc.code is not ErrorCode.NO_CAPACITY:
                # the allocator refused: it holds no lease for this request
                self.gpu_request_key = None
                self.gpu_lease_id = None
            self.log.warning("GPU request %s failed: %s", request.request_key, exc)
            raise allocator_http_error(exc) from None
        if lease.state not in (LeaseState.GRANTED, LeaseState.BOUND):
            raise user_error(503, f"The GPU allocator answered with a {lease.state.value} lease")
        self._emit(f"Granted {describe_lease(lease)}", 40)
        return lease

    async def start(self) -> Any:
        self._gpu_events = []
        self._gpu_events_done = False
        if self.gpu_lease_id or self.gpu_request_key:
            # a stop path that skipped the post-stop hook: do not carry its lease over
            await self.release_gpus(reason="stale lease before a new spawn")
        try:
            options, profile = self.gpu_choice()
            self._apply_profile_override(profile)
            lease = await self.acquire_gpus(options, profile)
            try:
                spec = build_service_spec(
                    lease,
                    extra_container_spec=self.extra_container_spec,
                    extra_placement_spec=self.extra_placement_spec,
                    extra_create_kwargs=self.extra_create_kwargs,
                    extra_task_spec=self.extra_task_spec,
                    server_name=self.name or "",
                )
            except BuildError as exc:
                raise user_error(500, f"Cannot place the server: {exc}") from None
            saved = (self.extra_container_spec, self.extra_placement_spec,
                     self.extra_create_kwargs, self.extra_task_spec)
            self._gpu_env = spec.env
            self.extra_container_spec = spec.extra_container_spec
            self.extra_placement_spec = spec.extra_placement_spec
            self.extra_create_kwargs = spec.extra_create_kwargs
            self.extra_task_spec = spec.extra_task_spec
            self._emit(f"Starting the server with {spec.summary}", 50)
            try:
                return await super().start()
            finally:
                (self.extra_container_spec, self.extra_placement_spec,
                 self.extra_create_kwargs, self.extra_task_spec) = saved
        except asyncio.CancelledError:
            # The hub gave up (start_timeout) or the user cancelled a pending spawn. JupyterHub
            # does not always reach the post-stop hook after a cancellation, so withdraw the
            # request now, in a task of its own that the cancellation cannot interrupt.
            if self.gpu_lease_id or self.gpu_request_key:
                task = asyncio.ensure_future(
                    self._release(self.gpu_request_key, self.gpu_lease_id,
                                  reason="spawn cancelled")
                )
                _BACKGROUND.add(task)
                task.add_done_callback(_BACKGROUND.discard)
            raise
        finally:
            self._gpu_events_done = True

    def get_env(self) -> dict[str, str]:
        env: dict[str, str] = super().get_env()
        env.update(self._gpu_env or {"NVIDIA_VISIBLE_DEVICES": "void"})
        return env

    async def progress(self) -> AsyncIterator[dict[str, Any]]:
        """Spawn progress: the GPU request (and queue position), then the service start."""
        seen = 0
        while True:
            while seen < len(self._gpu_events):
                yield self._gpu_events[seen]
                seen += 1
            if self._gpu_events_done:
                break
            await asyncio.sleep(0.2)
        yield {"progress": 80, "message": "Waiting for the server to answer"}

    async def _release(self, key: str | None, lease_id: str | None, *, reason: str) -> None:
        if key is None and lease_id is None:
            return
        try:
            lease = await self.allocator_client().release(
                lease_id=lease_id,
                request_key=None if lease_id else key,
                by="hub",
                reason=reason,
                timeout_s=self.release_timeout,
            )
            self.log.info(
                "Released GPU lease %s of %s: %s", lease.lease_id, self._log_name,
                lease.state.value,
            )
        except AllocatorError as exc:
            if exc.code is ErrorCode.NOT_FOUND:
                return
            self.log.warning(
                "Could not release the GPU lease of %s (%s); the node agent frees it when the "
                "container is gone", self._log_name, exc,
            )

    async def release_gpus(self, reason: str = "server stopped") -> None:
        """Tell the allocator this server is stopping (a no-op without a lease)."""
        lease_id, key = self.gpu_lease_id, self.gpu_request_key
        if lease_id is None and key is None:
            return
        await self._release(key, lease_id, reason=reason)
        self.gpu_lease_id = None
        self.gpu_request_key = None

    async def run_post_stop_hook(self) -> Any:
        """Release the lease on every stop path (failed spawns included), then the admin's hook."""
        try:
            await self.release_gpus()
        except Exception:
            self.log.exception("Releasing the GPU lease of %s failed", self._log_name)
        self._gpu_env = {}
        result = super().run_post_stop_hook()
        if isawaitable(result):
            try:
                return await result
            except Exception:
                self.log.exception("post_stop_hook failed for %s", self._log_name)
        return result


async def _render_options_form(spawner: GPUSwarmSpawner) -> str:
    return await spawner.gpu_options_form()


def _apply_gpu_user_options(spawner: GPUSwarmSpawner, user_options: dict[str, Any]) -> None:
    """Reject a forged choice before the spawn starts (HTTP 400 with the reason)."""
    options, profile = spawner.gpu_choice()
    spawner.check_choice(options, profile, None)


def _describe_request(options: GPUOptions) -> str:
    model = "any model" if options.any_model else options.model
    where = f" on {options.host}" if options.host else ""
    if options.mode is GPUMode.SHARED:
        budget = f" with {options.share_memory_mib} MiB" if options.share_memory_mib else ""
        return f"a shared slice of one GPU ({model}){budget}{where}"
    if options.all_gpus_of_host:
        return f"all GPUs of one host ({model}){where}"
    n = options.count
    return f"{n} GPU{'' if n == 1 else 's'} ({model}){where}"


def _queue_message(position: int | None, wait: float) -> str:
    where = f"position {position}" if position else "waiting"
    return f"No GPU free yet: queued ({where}); waiting up to {wait:g} s for one to free up"


_BACKGROUND: set[asyncio.Future[None]] = set()
"""Release tasks started from a cancelled spawn (kept referenced until they finish)."""

_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple[Any, ...], Any]] = (
    weakref.WeakKeyDictionary()
)


def _shared_client(url: str, timeout_s: float, connect_timeout_s: float) -> AllocatorClient:
    loop = asyncio.get_running_loop()
    clients = _CLIENTS.setdefault(loop, {})
    key = (url, timeout_s, connect_timeout_s)
    client = clients.get(key)
    if client is None:
        client = clients[key] = AllocatorClient(
            url, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s
        )
    return client


__all__ = ["GPUSwarmSpawner", "allocator_http_error", "user_error"]
