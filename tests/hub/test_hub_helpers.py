"""The spawner's pure helpers: profile overrides, swapped settings, progress, permissions."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from traitlets import Dict, HasTraits, Unicode

from hubplugin.options import (
    GPUMode,
    OptionsError,
    choice_from_user_options,
    load_profiles,
    permissions_for,
)
from hubplugin.overrides import OverrideError, SavedSettings, profile_settings, settings_swapped
from hubplugin.progress import SpawnProgress


class Settings(HasTraits):
    image = Unicode("base")
    environment = Dict()


def test_profile_settings_call_callables_and_merge_dicts() -> None:
    target = Settings(environment={"A": "1"})
    spawner = SimpleNamespace(name="alice")
    values = profile_settings(
        {"image": lambda s: f"img-{s.name}", "environment": {"B": "2"}},
        lambda name: getattr(target, name), target.has_trait, spawner,
    )
    assert values == {"image": "img-alice", "environment": {"A": "1", "B": "2"}}
    assert target.environment == {"A": "1"}  # computed, not applied


def test_an_unknown_setting_applies_nothing() -> None:
    target = Settings()
    saved = SavedSettings()
    with pytest.raises(OverrideError, match="'mem_limitt'"):
        saved.apply(target, profile_settings({"image": "x", "mem_limitt": "8G"},
                                             lambda name: getattr(target, name),
                                             target.has_trait, None))
    assert target.image == "base"


def test_saved_settings_undo_the_last_apply_only() -> None:
    target = Settings(environment={"A": "1"})
    saved = SavedSettings()
    saved.apply(target, {"image": "one", "environment": {"A": "1", "B": "2"}})
    saved.apply(target, {"image": "two"})  # the first apply is undone first
    assert (target.image, target.environment) == ("two", {"A": "1"})
    saved.restore(target)
    assert (target.image, target.environment) == ("base", {"A": "1"})


def test_swapped_settings_come_back_when_the_block_fails() -> None:
    target = Settings()
    with pytest.raises(RuntimeError), settings_swapped(target, {"image": "lease"}):
        assert target.image == "lease"
        raise RuntimeError("start failed")
    assert target.image == "base"


def test_progress_gives_every_event_in_order_then_ends() -> None:
    async def scenario() -> list[dict[str, Any]]:
        progress = SpawnProgress()
        progress.begin()
        progress.emit("asked", 10)
        reader = asyncio.ensure_future(_collect(progress))
        await asyncio.sleep(0)
        progress.emit("queued")
        progress.end()
        return await asyncio.wait_for(reader, 60)

    assert asyncio.run(scenario()) == [{"message": "asked", "progress": 10},
                                       {"message": "queued"}]


async def _collect(progress: SpawnProgress) -> list[dict[str, Any]]:
    return [event async for event in progress.events()]


def test_the_largest_group_limit_counts_within_one_request() -> None:
    common: dict[str, Any] = {
        "group_models": {}, "default_models": ["*"], "allowed_hosts": None,
        "max_share_memory_mib": None, "default_share_memory_mib": None,
        "allow_all_gpus_of_host": True,
    }
    staff = permissions_for(["staff"], user_max_gpus=1, group_max_gpus={"staff": 4, "ml": 9},
                       **common)
    assert staff.max_gpus == 4
    assert permissions_for([], user_max_gpus=10**6, group_max_gpus={}, **common).max_gpus == 64
    assert permissions_for([], user_max_gpus=-3, group_max_gpus={}, **common).max_gpus == 0


def test_a_spawn_that_only_picks_an_image_gets_the_default() -> None:
    profiles = load_profiles([{"slug": "gpu", "display_name": "GPU", "mode": "exclusive",
                               "default": True}])
    options, profile = choice_from_user_options({"image": "x"}, profiles, [], GPUMode.NONE)
    assert profile is not None and options.mode is GPUMode.EXCLUSIVE
    options, profile = choice_from_user_options({}, [], [], GPUMode.SHARED)
    assert profile is None and options.mode is GPUMode.SHARED
    with pytest.raises(OptionsError, match="Unknown profile"):
        choice_from_user_options({"profile": "gpu"}, [], [], GPUMode.NONE)
