"""``GPUSwarmSpawner``: a ``dockerspawner.SwarmSpawner`` that leases GPUs from the allocator.

The spawner is the orchestration: it holds the admin's settings (traits) and the server's
state, and does the I/O (the allocator's RPCs, dockerspawner's service). Every rule it
applies is a pure helper elsewhere, as kubespawner keeps its objects in ``objects.py``:
what a user may pick and is allowed (:mod:`hubplugin.options`), the form
(:mod:`hubplugin.form`), a profile's setting overrides (:mod:`hubplugin.overrides`), the
allocate-and-wait conversation (:mod:`hubplugin.leasing`), the progress messages
(:mod:`hubplugin.progress`), the service's env, placement and labels
(:mod:`hubplugin.builders`), the user's volume (:mod:`hubplugin.volumes`) and the error pages
(:mod:`hubplugin.errors`).

Life of one server (docs/design.md, flows 1 and 3):

1. ``options_form`` asks the allocator for its inventory and renders the spawn form;
   ``options_from_form`` turns the submitted fields into ``user_options``. REST clients send
   the same ``user_options``. A user with no GPU to choose (no model, no GPU, no profile with
   one) gets what a ``SwarmSpawner`` gives: a straight spawn, or dockerspawner's image choice.
   A spawn that chooses no GPU (only an image, or nothing) gets the admin's default.
2. ``apply_user_options`` (and again ``start``) checks the choice against what the admin permits:
   a forged choice fails with HTTP 400 before anything is asked of the allocator.
3. ``start`` sends ``allocate`` with the idempotent key ``<hub_id>/<user>/<server>``; a queued
   request reports its position through ``progress()`` until granted or its wait runs out.
   The granted lease becomes env, placement constraint and labels, then
   ``SwarmSpawner.start`` creates the service.
4. ``stop`` releases the lease while it removes the service, and every stop path, failed
   spawns included, goes through ``run_post_stop_hook``, which releases it if that did not
   (by id, or by request key when the id never arrived): the allocator marks it
   ``releasing``, has the node agent stop the container, and frees the GPUs once the node
   reports the container gone.

The lease id and request key live in ``get_state()`` so a restarted hub releases what it
started, and an allocate retried with the same key never books twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from inspect import isawaitable
from typing import Any

from dockerspawner import SwarmSpawner
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

from allocator.amqp.broker import DEFAULT_AMQP_URL, with_tls
from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.bookings.outlook import outlook_for
from allocator.settings_files import setting_or_file
from allocator.wire.protocol import ErrorCode, InventoryReply, Lease, LeaseState

from .borrowing import amounts_offered, borrow_outlook
from .builders import BuildError, build_service_spec, describe_lease
from .errors import allocator_http_error, holds_no_lease, user_error
from .form import render_form
from .leasing import effective_wait, lease_gpus, run_detached, shared_client
from .options import (
    GPUMode,
    GPUOptions,
    GPUPermissions,
    ModelCatalog,
    OptionsError,
    Profile,
    build_allocate_request,
    check_options,
    choice_from_user_options,
    default_mode_for,
    load_profiles,
    makes_gpu_choice,
    offers_gpu_choice,
    options_from_form,
    parse_user_options,
    permissions_for,
    request_key,
    visible_profiles,
)
from .overrides import OverrideError, SavedSettings, profile_settings, settings_swapped
from .progress import SpawnProgress
from .volumes import (
    DEFAULT_TARGET,
    UserVolume,
    VolumeSettingError,
    check_template,
    user_volume_mount,
)


class GPUSwarmSpawner(SwarmSpawner):
    """SwarmSpawner that gives each server the GPUs (or the shared slice) its user picked."""

    # ------------------------------------------------------------------ configuration

    allocator_url = Unicode(
        DEFAULT_AMQP_URL,
        config=True,
        help="""AMQP URL of the broker the allocator listens on.

        Use the broker user made for hubs, e.g. ``amqp://hub:SECRET@rabbitmq:5672/swarm-gpu``.
        """,
    )

    allocator_url_file = Unicode(
        "",
        config=True,
        help="""A file holding ``allocator_url`` (a Docker secret, e.g.
        ``/run/secrets/swarm-gpu-hub-amqp-url``), its trailing newline stripped.

        Keeps the hub's broker password out of the hub's environment, command line and
        configuration file. Set this or ``allocator_url``, not both; the file is read when
        the first spawner asks the allocator, and a file that cannot be read is one clear
        error naming it.
        """,
    )

    allocator_ca_file = Unicode(
        "",
        config=True,
        help="""The CA certificate (PEM) that signed the broker's certificate, for an
        ``amqps://`` ``allocator_url`` (its ``cafile`` query parameter does the same; the
        GPU page's ``SWARM_GPU_PAGE_AMQP_CA_FILE``). Empty: the system's trusted CAs.
        """,
    )

    allocator_cert_file = Unicode(
        "",
        config=True,
        help="""The hub's own client certificate (PEM), where the broker asks for one.""",
    )

    allocator_key_file = Unicode(
        "",
        config=True,
        help="""The private key (PEM) of ``allocator_cert_file``, unless that file holds it.""",
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
        help="""Mode preselected on the form and used by spawns that choose no GPU (REST
        without options, a form with only an image): ``none``, ``exclusive`` or ``shared``.
        A profile marked ``default`` wins; a user who may not use GPUs gets ``none``.""",
    )

    wait_s = Float(
        0.0,
        config=True,
        help="""How long a request may wait in the allocator's queue when nothing fits now
        (0 = fail at once with "no GPU free"). The spawn page shows the queue position.
        ``start_timeout`` defaults to ``wait_s + 120`` so the hub does not give up first.""",
    )

    task_poll_s = Float(
        0.05,
        config=True,
        help="""How soon the spawner first looks whether the service's task runs (seconds);
        each later look waits 1.5 times longer, up to ``task_poll_max_s``. dockerspawner's
        own schedule starts at 1 s and grows to 11 s, so a task running after 1.1 s was
        noticed at 2.5 s, and one that took 5 s (an image pulled on its node) at 8.1 s.""",
    )

    task_poll_max_s = Float(
        1.0, config=True, help="The longest pause between two looks at the service's task."
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

    user_volume = Unicode(
        "",
        config=True,
        help="""Each user's Docker volume, mounted at ``user_volume_target`` in every server
        of theirs: a name template with ``{username}`` (dockerspawner's escaped name), e.g.
        ``swarm-gpu-home-{username}``. Empty: no volume (the server's files go with its
        container). Mounted as a volume, never as a bind (hubplugin/volumes.py).""",
    )

    user_volume_driver = Unicode(
        "",
        config=True,
        help="""The users' volumes' driver, e.g. ``local`` with NFS options, or a volume
        plugin's name, so that a user's files follow their server to any node. Empty: the
        engine's default (a ``local`` volume on the server's node).""",
    )

    user_volume_driver_options = Dict(
        key_trait=Unicode(),
        value_trait=Unicode(),
        config=True,
        help="""The driver's options for a user's volume (Docker makes the volume with them at
        its first mount); ``{username}`` in a value is the user's escaped name. Example
        (NFS): ``{"type": "nfs", "o": "addr=10.0.0.5,rw,nfsvers=4",
        "device": ":/export/home/{username}"}``.""",
    )

    user_volume_target = Unicode(
        DEFAULT_TARGET,
        config=True,
        help="""Where the user's volume is mounted: the notebook's work dir (the Jupyter
        Docker Stacks' ``/home/jovyan/work`` by default).""",
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

    @validate("user_volume")
    def _check_user_volume(self, proposal: Any) -> str:
        value: str = proposal["value"]
        if value:
            try:
                check_template(value)
            except VolumeSettingError as exc:
                raise TraitError(str(exc)) from None
        return value

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
        self._gpu_progress = SpawnProgress()
        self._profile_settings = SavedSettings()

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

    # ------------------------------------------------------------------ the user's choice

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

    def gpu_permissions(self) -> GPUPermissions:
        """What this user may ask for."""
        return permissions_for(
            self.user_groups(),
            group_models=self.group_models,
            default_models=self.default_models,
            user_max_gpus=_per_user(self.user_max_gpus, self),
            group_max_gpus=self.group_max_gpus,
            allowed_hosts=self.allowed_hosts,
            max_share_memory_mib=self.max_share_memory_mib,
            default_share_memory_mib=self.share_default_memory_mib,
            allow_all_gpus_of_host=self.allow_all_gpus_of_host,
        )

    def gpu_default_mode(self) -> GPUMode:
        """The mode of a spawn that chooses none: ``default_gpu_mode``, or no GPU for a user
        who may not pick GPUs."""
        return default_mode_for(self.gpu_permissions(), GPUMode(self.default_gpu_mode))

    def gpu_choice(self) -> tuple[GPUOptions, Profile | None]:
        """The user's choice with profiles resolved; HTTP 400 when it cannot be parsed."""
        try:
            return choice_from_user_options(self.user_options, self.profiles(),
                                            self.user_groups(), self.gpu_default_mode())
        except OptionsError as exc:
            raise user_error(400, str(exc)) from None

    def check_choice(
        self, options: GPUOptions, profile: Profile | None, inventory: InventoryReply | None
    ) -> Any:
        try:
            return check_options(options, self.gpu_permissions(), inventory,
                                 trusted=profile is not None)
        except OptionsError as exc:
            raise user_error(400, str(exc)) from None

    def _apply_profile_override(self, profile: Profile | None) -> None:
        """Set the profile's ``spawner_override`` (after undoing the last start's)."""
        self._profile_settings.restore(self)
        if profile is None:
            return
        try:
            values = profile_settings(profile.spawner_override, lambda name: getattr(self, name),
                                      self.has_trait, self)
        except OverrideError as exc:
            raise user_error(500, f"profile {profile.slug!r} overrides {exc}") from None
        self._profile_settings.apply(self, values)

    # ------------------------------------------------------------------ the allocator

    def allocator_broker_url(self) -> str:
        """``allocator_url``, or the content of ``allocator_url_file``, with the TLS files
        (``allocator_ca_file``...: :func:`allocator.amqp.broker.with_tls`).

        ``allocator_url`` counts as set only when it differs from its default: traitlets
        cannot tell a default from a configured value, and the default has no password.
        """
        default = type(self).class_traits()["allocator_url"].default_value
        url = self.allocator_url if self.allocator_url != default else None
        try:
            from_file = setting_or_file("allocator_url", url, self.allocator_url_file or None)
            return with_tls(from_file if from_file is not None else self.allocator_url,
                            ca_file=self.allocator_ca_file, cert_file=self.allocator_cert_file,
                            key_file=self.allocator_key_file)
        except ValueError as exc:  # the hub's configuration: say so, not a traceback
            raise user_error(500, f"the hub's GPU settings: {exc}") from None

    def allocator_client(self) -> AllocatorClient:
        """The hub's shared RPC client (one per event loop and URL)."""
        return shared_client(
            self.allocator_broker_url(), self.allocator_timeout, self.allocator_connect_timeout
        )

    def _emit(self, message: str, progress: int | None = None) -> None:
        self._gpu_progress.emit(message, progress)
        self.log.info("%s: %s", self._log_name, message)

    # ------------------------------------------------------------------ spawn form

    def image_options_form(self) -> str:
        """dockerspawner's own form: a choice among several ``allowed_images``, else none
        (``""``: the hub spawns at once), exactly as for a ``SwarmSpawner``."""
        return str(SwarmSpawner._default_options_form(self))

    async def gpu_options_form(self) -> str:
        """Render the spawn form from the allocator's current inventory; for a user with no
        GPU to choose, dockerspawner's form (:meth:`image_options_form`) instead."""
        permissions, profiles = self.gpu_permissions(), self.profiles()
        if not offers_gpu_choice(permissions, profiles):
            # SwarmSpawner's contract where GPUs are not involved: no GPU form, and no
            # allocator call that could only slow the page down.
            return self.image_options_form()
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
            # options that chose only an image chose no GPU: the form shows the default
            if makes_gpu_choice(self.user_options):
                current = previous
        except OptionsError:
            pass
        images = self._get_allowed_images()
        borrow = None
        if inventory is not None and permissions.may_use_gpus:
            catalog = ModelCatalog(inventory.models)
            borrow = await borrow_outlook(
                self.allocator_client(), self.user.name, self.user_groups(),
                amounts_offered(permissions, profiles, catalog),
                timeout_s=self.allocator_form_timeout)
        # What the inventory's bookings (0.3.0) mean for this user: the allocator's rule.
        bookings = (outlook_for(inventory.bookings, self.user.name, self.user_groups(),
                                inventory.at)
                    if inventory is not None and permissions.may_use_gpus else None)
        return render_form(
            inventory,
            permissions=permissions,
            profiles=profiles,
            borrow=borrow,
            bookings=bookings,
            current=current,
            default_mode=self.gpu_default_mode(),
            unavailable=unavailable,
            wait_s=self.wait_s,
            images=images if isinstance(images, dict) and len(images) > 1 else None,
            current_image=(self.user_options or {}).get("image"),
            template_paths=self.gpu_form_template_paths,
        )

    # ------------------------------------------------------------------ start / stop

    def _effective_wait(self) -> float:
        return effective_wait(self.wait_s, float(self.start_timeout))

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

    def _on_lease(self, lease: Lease) -> None:
        self.gpu_lease_id = lease.lease_id

    async def acquire_gpus(self, options: GPUOptions, profile: Profile | None) -> Lease | None:
        """Lease GPUs for the choice (None for "no GPU"). Raises HTTPError with a message."""
        if not options.wants_gpu:
            return None
        # One RPC per spawn: the allocator checks the request against the cluster and refuses
        # with its own text. Only a user held to a list of models needs the cluster's model
        # names first (aliases, and which of the allowed models exist to ask for).
        restricted = profile is None and self.gpu_permissions().allowed_models is not None
        # A demanded connection goes only to an allocator whose inventory shows it reads it
        # (an older one would ignore the demand): check_options refuses it otherwise.
        demands_links = options.normalized().topology is not None
        inventory = (await self._inventory_or_none() if restricted or demands_links
                     else None)
        if demands_links and inventory is None:
            raise user_error(503, "The GPU allocator's inventory could not be read, so a GPU "
                                  "connection cannot be promised now; ask without one "
                                  "(connection: any), or try again in a minute.")
        checked = self.check_choice(options, profile, inventory)
        if checked is None:
            return None
        request = build_allocate_request(
            checked,
            hub_id=self.hub_id,
            user=self.user.name,
            server_name=self.name or "",
            groups=self.user_groups(),
            wait_s=self._effective_wait(),
            priority=_per_user(self.gpu_priority, self),
        )
        await self._remove_orphan_service()
        self.gpu_request_key = request.request_key
        self._emit("Asking the GPU allocator for " + options.describe(), 10)
        try:
            lease = await lease_gpus(
                self.allocator_client(),
                request,
                recheck_s=self.wait_recheck_s,
                on_lease=self._on_lease,
                report=lambda message: self._emit(message, 15),
            )
        except AllocatorError as exc:
            if holds_no_lease(exc):
                self.gpu_request_key = None
                self.gpu_lease_id = None
            self.log.warning("GPU request %s failed: %s", request.request_key, exc)
            raise allocator_http_error(exc) from None
        if lease.state not in (LeaseState.GRANTED, LeaseState.BOUND):
            raise user_error(503, f"The GPU allocator answered with a {lease.state.value} lease")
        self._emit(f"Granted {describe_lease(lease)}", 40)
        return lease

    async def start(self) -> Any:
        self._gpu_progress.begin()
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
                    groups=self.user_groups(),
                )
            except BuildError as exc:
                raise user_error(500, f"Cannot place the server: {exc}") from None
            self._gpu_env = spec.env
            self._emit(f"Starting the server with {spec.summary}", 50)
            with settings_swapped(self, {
                "extra_container_spec": spec.extra_container_spec,
                "extra_placement_spec": spec.extra_placement_spec,
                "extra_create_kwargs": spec.extra_create_kwargs,
                "extra_task_spec": spec.extra_task_spec,
            }):
                return await super().start()
        except asyncio.CancelledError:
            # The hub gave up (start_timeout) or the user cancelled a pending spawn. JupyterHub
            # does not always reach the post-stop hook after a cancellation, so withdraw the
            # request now, in a task of its own that the cancellation cannot interrupt.
            if self.gpu_lease_id or self.gpu_request_key:
                run_detached(self._release(self.gpu_request_key, self.gpu_lease_id,
                                           reason="spawn cancelled"))
            raise
        finally:
            self._gpu_progress.end()

    @property
    def mounts(self) -> list[Any]:
        """SwarmSpawner's mounts (from ``volumes``) and the user's volume, a mount of type
        ``volume`` (SwarmSpawner would make it a bind, which the engine refuses)."""
        mounts = list(super().mounts)
        if self.user_volume:
            mounts.append(user_volume_mount(UserVolume(
                template=self.user_volume, driver=self.user_volume_driver,
                options=dict(self.user_volume_driver_options),
                target=self.user_volume_target), self.escaped_name))
        return mounts

    def get_env(self) -> dict[str, str]:
        env: dict[str, str] = super().get_env()
        env.update(self._gpu_env or {"NVIDIA_VISIBLE_DEVICES": "void"})
        return env

    async def progress(self) -> AsyncIterator[dict[str, Any]]:
        """Spawn progress: the GPU request (and queue position), then the service start."""
        async for event in self._gpu_progress.events():
            yield event
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

    async def start_object(self) -> None:
        """Wait until the service's task runs (SwarmSpawner's start waits here), looking
        after ``task_poll_s``, then 1.5 times longer each time, up to ``task_poll_max_s``."""
        pause = self.task_poll_s
        while True:
            task = await self.get_task()
            if not task:
                raise RuntimeError(f"Service {self.service_name} not found")
            state = str(task["Status"]["State"]).lower()
            if state not in _TASK_NOT_YET_RUNNING:
                break
            await asyncio.sleep(pause)
            pause = min(pause * 1.5, max(self.task_poll_max_s, self.task_poll_s))
        if state != "running":
            raise RuntimeError(f"Service {self.service_name} not running: {task['Status']}")

    async def stop(self, now: bool = False) -> None:
        """Remove the service, releasing the lease at the same time rather than after it.

        The release makes the node agent stop the container at once (stop on release), so
        the next user's GPU is free as soon as Docker reports the container dead, not a
        service removal later (docs/benchmarks.md, hand-over). The post-stop hook still
        releases on the paths that never reach ``stop``.
        """
        releasing = asyncio.ensure_future(self.release_gpus())
        try:
            await super().stop(now=now)
        finally:
            try:
                await releasing
            except Exception:
                self.log.exception("Releasing the GPU lease of %s failed", self._log_name)

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


def _per_user(setting: int | Callable[[Any], int], spawner: GPUSwarmSpawner) -> int:
    """A setting that is a number or ``f(spawner) -> number`` (``user_max_gpus``...)."""
    return int(setting(spawner) if callable(setting) else setting)


_TASK_NOT_YET_RUNNING = frozenset({"new", "assigned", "accepted", "starting", "pending",
                                   "preparing", "ready", "rejected"})
"""Task states that SwarmSpawner waits through (a rejected task is placed again by Swarm)."""

__all__ = ["GPUSwarmSpawner", "allocator_http_error", "user_error"]
