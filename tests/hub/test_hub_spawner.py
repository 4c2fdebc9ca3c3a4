"""GPUSwarmSpawner's configuration, state and error mapping, without a hub (fast)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
from dockerspawner import SwarmSpawner
from tornado import web
from traitlets import TraitError

from allocator import PUBLIC_SURFACE
from allocator.amqp.client import AllocatorError, AllocatorTimeout, AllocatorUnavailable
from allocator.wire.protocol import ErrorCode
from hubplugin.options import GPUMode, options_from_form
from hubplugin.spawner import GPUSwarmSpawner, allocator_http_error

PROFILES = [
    {"slug": "cpu", "display_name": "CPU"},
    {"slug": "gpu", "display_name": "GPU", "mode": "exclusive", "default": True,
     "spawner_override": {"mem_limit": "8G", "environment": {"B": "2"}}},
    {"slug": "staff-only", "display_name": "Staff", "groups": ["staff"], "mode": "exclusive"},
]


def make(user: str = "alice", groups: tuple[str, ...] = ("students",), **config: Any
         ) -> GPUSwarmSpawner:
    fake_user = SimpleNamespace(name=user, groups=[SimpleNamespace(name=g) for g in groups],
                                url=f"/user/{user}/")
    return GPUSwarmSpawner(user=fake_user, **config)


def test_hooks_are_wired_by_default() -> None:
    spawner = make()
    assert spawner.options_from_form is options_from_form
    assert callable(spawner.options_form)
    assert callable(spawner.apply_user_options)
    assert spawner.request_key == "hub/alice/"
    assert make(hub_id="h2").request_key == "h2/alice/"


def test_start_timeout_leaves_room_for_the_queue() -> None:
    assert make().start_timeout == 120
    assert make(wait_s=600).start_timeout == 720
    spawner = make(wait_s=600, start_timeout=100)
    assert spawner.start_timeout == 100
    assert spawner._effective_wait() == 70.0  # the hub's own limit wins


def test_bad_configuration_is_refused() -> None:
    with pytest.raises(TraitError, match="duplicate slugs"):
        make(gpu_profiles=[{"slug": "a", "display_name": "A"}] * 2)
    with pytest.raises(TraitError, match="default_gpu_mode"):
        make(default_gpu_mode="all")
    with pytest.raises(TraitError, match="wait_s"):
        make(wait_s=-1)


def test_permissions_from_groups() -> None:
    config: dict[str, Any] = {"group_models": {"students": ["1070"], "staff": ["*"]},
                              "default_models": [],
              "group_max_gpus": {"staff": 8}}
    student = make(**config).gpu_permissions()
    assert student.allowed_models == ["1070"] and student.max_gpus == 1
    staff = make("carol", ("staff",), **config).gpu_permissions()
    assert staff.allowed_models is None and staff.max_gpus == 8
    visitor = make("vic", (), **config).gpu_permissions()
    assert visitor.allowed_models == [] and not visitor.may_use_gpus
    called = make(user_max_gpus=lambda spawner: 3 if spawner.user.name == "alice" else 0)
    assert called.gpu_permissions().max_gpus == 3


def test_state_survives_clear_state_until_released() -> None:
    spawner = make()
    spawner.load_state({"gpu_lease_id": "L1", "gpu_request_key": "hub/alice/",
                        "object_id": "svc"})
    assert spawner.get_state()["gpu_lease_id"] == "L1"
    spawner.clear_state()  # DockerSpawner.stop() does this before the post-stop hook
    assert spawner.get_state()["gpu_request_key"] == "hub/alice/"
    fresh = make()
    fresh.load_state({})
    assert "gpu_lease_id" not in fresh.get_state()


def test_choice_defaults_to_the_default_profile_or_mode() -> None:
    spawner = make(gpu_profiles=PROFILES)
    spawner.user_options = {}
    options, profile = spawner.gpu_choice()
    assert profile is not None and profile.slug == "gpu" and options.mode is GPUMode.EXCLUSIVE
    plain = make(default_gpu_mode="shared")
    plain.user_options = {"image": "x"}
    options, profile = plain.gpu_choice()
    assert profile is None and options.mode is GPUMode.SHARED


@pytest.mark.parametrize(
    ("user_options", "needle"),
    [
        ({"profile": "staff-only"}, "Unknown profile 'staff-only'"),
        ({"count": 10**6, "mode": "exclusive"}, "between 1 and 64"),
        ({"evil": True}, "unknown option 'evil'"),
    ],
)
def test_forged_choice_is_a_400_with_a_message(user_options: dict, needle: str) -> None:
    spawner = make(gpu_profiles=PROFILES)
    spawner.user_options = user_options
    with pytest.raises(web.HTTPError) as err:
        spawner.apply_user_options(spawner, user_options)
    assert err.value.status_code == 400
    assert needle in err.value.jupyterhub_message  # type: ignore[attr-defined]


def test_a_forbidden_choice_is_refused_before_the_allocator_is_asked() -> None:
    spawner = make(group_models={"students": ["1070"]})
    spawner.user_options = {"mode": "exclusive", "model": "a100"}
    with pytest.raises(web.HTTPError) as err:
        spawner.apply_user_options(spawner, spawner.user_options)
    assert err.value.status_code == 400
    assert err.value.log_message is not None
    assert "may not use GPU model 'a100'" in err.value.log_message % err.value.args


# ------------------------------------------- SwarmSpawner's contract where GPUs are not involved

NO_ALLOCATOR: dict[str, Any] = {"allocator_url": "amqp://guest:guest@127.0.0.1:9/",
                                "allocator_connect_timeout": 0.5,
                                "allocator_form_timeout": 0.5}
"""An allocator nobody answers at: a spawner that asks it renders its GPU form anyway, with
a note, after a refused connection."""

NO_GPU_USERS = [{"default_models": []}, {"user_max_gpus": 0}]


def swarm_spawner(**config: Any) -> SwarmSpawner:
    """A plain SwarmSpawner, to compare with."""
    return SwarmSpawner(user=SimpleNamespace(name="vic", groups=[], url="/user/vic/"), **config)


@pytest.mark.parametrize("config", NO_GPU_USERS, ids=["no-models", "no-gpus"])
async def test_a_user_who_may_use_no_gpu_gets_a_straight_spawn(config: dict[str, Any]) -> None:
    # the admin preselects whole GPUs for those who may use them
    spawner = make("vic", (), default_gpu_mode="exclusive", **config, **NO_ALLOCATOR)
    form = await spawner.get_options_form()
    assert form == "" == await swarm_spawner().get_options_form()  # the hub spawns at once
    spawner.user_options = {}
    spawner.apply_user_options(spawner, {})  # no "You may not use GPUs": nobody asked for one
    options, profile = spawner.gpu_choice()
    assert options.mode is GPUMode.NONE and profile is None


@pytest.mark.parametrize("config", NO_GPU_USERS, ids=["no-models", "no-gpus"])
async def test_a_user_who_may_use_no_gpu_gets_dockerspawners_image_form(
    config: dict[str, Any]
) -> None:
    images = ["jupyter/minimal", "jupyter/scipy"]
    spawner = make("vic", (), allowed_images=images, **config, **NO_ALLOCATOR)
    form = await spawner.get_options_form()
    assert form == await swarm_spawner(allowed_images=images).get_options_form()
    assert 'name="image"' in form and 'name="mode"' not in form
    spawner.user_options = spawner.options_from_form({"image": ["jupyter/scipy"]})
    assert spawner.user_options == {"image": "jupyter/scipy"}
    spawner.apply_user_options(spawner, spawner.user_options)
    assert spawner.gpu_choice()[0].mode is GPUMode.NONE


async def test_a_user_with_a_gpu_profile_still_gets_the_gpu_form() -> None:
    spawner = make("vic", (), default_models=[], gpu_profiles=PROFILES, **NO_ALLOCATOR)
    form = await spawner.get_options_form()
    assert 'id="sg-form"' in form and 'name="profile"' in form


def test_a_form_that_sends_only_an_image_gets_the_default_gpu_choice() -> None:
    # an admin's own options_form, or dockerspawner's, that offers only images
    spawner = make(default_gpu_mode="exclusive", allowed_images=["lab", "minimal"],
                   options_form='<select name="image"><option>lab</option></select>')
    spawner.user_options = spawner.options_from_form({"image": ["lab"], "_xsrf": ["t"]})
    assert spawner.user_options == {"image": "lab"}
    options, profile = spawner.gpu_choice()
    assert options.mode is GPUMode.EXCLUSIVE and profile is None
    with_profiles = make(gpu_profiles=PROFILES)
    with_profiles.user_options = with_profiles.options_from_form({"image": ["lab"]})
    options, profile = with_profiles.gpu_choice()
    assert profile is not None and profile.slug == "gpu"  # the admin's default profile
    # REST user_options with only an image: the same
    spawner.user_options = {"image": "lab"}
    assert spawner.gpu_choice()[0].mode is GPUMode.EXCLUSIVE


def test_profile_overrides_are_applied_and_undone() -> None:
    spawner = make(gpu_profiles=PROFILES, environment={"A": "1"})
    profile = spawner.profiles()[1]
    spawner._apply_profile_override(profile)
    assert spawner.mem_limit == 8 * 1024**3
    assert spawner.environment == {"A": "1", "B": "2"}
    spawner._apply_profile_override(None)
    assert not spawner.mem_limit and spawner.environment == {"A": "1"}  # None reads back as 0


@pytest.mark.parametrize(
    ("error", "status", "needle"),
    [
        (AllocatorUnavailable("connection refused"), 503, "cannot be reached"),
        (AllocatorTimeout("no answer in 10 s"), 503, "cannot be reached"),
        (AllocatorError(ErrorCode.NO_CAPACITY, "all busy"), 409, "No GPU is free"),
        (AllocatorError(ErrorCode.UNKNOWN_MODEL, "known: x"), 400, "refused (unknown_model)"),
        (AllocatorError(ErrorCode.QUOTA_EXCEEDED, "2 of 2"), 403, "quota_exceeded"),
        (AllocatorError(ErrorCode.STORAGE_ERROR, "disk full"), 503, "failed (storage_error)"),
        (AllocatorError(ErrorCode.INTERNAL_ERROR, "bug"), 503, "failed (internal_error)"),
    ],
)
def test_allocator_errors_become_clear_http_errors(error: AllocatorError, status: int,
                                                   needle: str) -> None:
    http = allocator_http_error(error)
    assert http.status_code == status
    assert needle in http.jupyterhub_message  # type: ignore[attr-defined]
    assert error.message in http.jupyterhub_message  # type: ignore[attr-defined]


def test_hubplugin_imports_only_the_allocators_public_surface() -> None:
    code = (
        "import sys, hubplugin.spawner, hubplugin.form, hubplugin.builders, hubplugin.options,"
        " hubplugin.page.app;"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('allocator'))))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True)
    loaded = set(result.stdout.split())
    assert loaded <= {"allocator", *PUBLIC_SURFACE}
