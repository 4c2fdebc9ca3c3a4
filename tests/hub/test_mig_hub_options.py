"""The hub's GPU options for MIG and compute capability (pure): user options and admin profiles
carry ``min_compute_capability`` and ``architecture`` to the allocator, and a GPU in MIG mode is
not counted as a GPU of its model. The inventory is the real engine's reply."""

from __future__ import annotations

from pathlib import Path

import pytest

from allocator.config import AllocatorSettings
from allocator.engine import Engine
from allocator.ledger.changes import Changes
from allocator.wire.protocol import GPUInfo, Heartbeat, InventoryReply
from hubplugin.options import (
    GPUPermissions,
    OptionsError,
    build_allocate_request,
    check_options,
    load_profiles,
    parse_user_options,
)
from tests.support.common import A100_40GB as A100
from tests.support.common import NODE
from tests.support.mig import mig_beat

STAFF = GPUPermissions(max_gpus=8, groups=["staff"], allow_all_gpus_of_host=True)
TWO = GPUPermissions(max_gpus=2, groups=["staff"], allow_all_gpus_of_host=True)


def mig_inventory(tmp_path: Path) -> InventoryReply:
    """Host m: an A100 in MIG mode with two 1g.5gb; host w: one whole A100."""
    engine = Engine(AllocatorSettings(ledger_path=tmp_path / "l.sqlite",
                                      allow_any_node_user=True), started_at=0.0)
    engine.handle(mig_beat(1, 1.0, ["1g.5gb", "1g.5gb"]), NODE, 1.0, Changes())
    engine.handle(Heartbeat(host="w", agent_id="agent-w", seq=1, sent_at=1.0, interval_s=2,
                            gpus=[GPUInfo(uuid="GPU-w", index=0, model=A100,
                                          memory_total_mib=40960, compute_capability="8.0",
                                          architecture="ampere")]), NODE, 1.0, Changes())
    return engine.inventory(2.0)


def test_capability_and_architecture_reach_the_request(tmp_path: Path) -> None:
    options = parse_user_options({"mode": "exclusive", "min_compute_capability": "8.0",
                                  "architecture": "ampere"})
    checked = check_options(options, STAFF, mig_inventory(tmp_path))
    assert checked is not None
    request = build_allocate_request(checked, hub_id="hub", user="ann", server_name="",
                                     groups=["staff"])
    assert (request.min_compute_capability, request.architecture) == ("8.0", "ampere")


@pytest.mark.parametrize(("options", "label"), [
    ({"mode": "exclusive", "min_compute_capability": "8"}, "minimum compute capability"),
    ({"mode": "exclusive", "architecture": "Ampere!"}, "GPU architecture"),
])
def test_bad_capability_options_are_refused_clearly(options: dict[str, str], label: str) -> None:
    with pytest.raises(OptionsError) as refused:
        parse_user_options(options)
    assert label in refused.value.message


def test_a_profile_can_ask_for_a_capability() -> None:
    (profile,) = load_profiles([{"slug": "modern", "display_name": "A modern GPU",
                                 "mode": "exclusive", "min_compute_capability": "8.0"}])
    assert profile.options().min_compute_capability == "8.0"
    assert "compute capability 8.0+" in profile.summary()


def test_the_gpu_in_mig_mode_is_not_counted_as_its_model(tmp_path: Path) -> None:
    inventory = mig_inventory(tmp_path)
    # Host m has no whole A100: asking for one there is refused by the hub already.
    with pytest.raises(OptionsError, match="Host 'm' has no GPU"):
        check_options(parse_user_options({"mode": "exclusive", "model": A100, "host": "m"}),
                      STAFF, inventory)
    # All of host m's instances fit a limit of two: the parent does not make it three.
    checked = check_options(parse_user_options({"mode": "exclusive", "host": "m",
                                                "all_gpus_of_host": True}), TWO, inventory)
    assert checked is not None and checked.count == "all"
