"""The spawn form lists MIG profiles with their free counts like models: the allocator's own
inventory reply (real engine, a heartbeat of a host with an A100 in MIG mode) rendered by the
hub's form. Pure: no services."""

from __future__ import annotations

from pathlib import Path

from allocator.config import AllocatorSettings
from allocator.engine import Engine
from allocator.ledger.changes import Changes
from allocator.wire.protocol import AllocateRequest, LeaseReply
from hubplugin.form import render_form
from hubplugin.options import GPUPermissions
from tests.support.common import A100_40GB as A100
from tests.support.common import HUB, MIG_1G, NODE
from tests.support.hub_form import parse
from tests.support.mig import mig_beat

STAFF = GPUPermissions(max_gpus=4, groups=["staff"])


def test_profiles_are_listed_with_free_counts_and_the_mig_gpu_is_not(tmp_path: Path) -> None:
    engine = Engine(AllocatorSettings(ledger_path=tmp_path / "l.sqlite",
                                      allow_any_node_user=True), started_at=0.0)
    engine.handle(mig_beat(1, 1.0, ["3g.20gb", "1g.5gb", "1g.5gb"]), NODE, 1.0, Changes())
    granted = engine.handle(AllocateRequest(request_key="k", user="u", model=MIG_1G), HUB,
                            1.5, Changes())
    assert isinstance(granted, LeaseReply)
    form = parse(render_form(engine.inventory(2.0), permissions=STAFF))
    options = {o["value"]: str(o["text"]) for o in form.selects["model"]}
    assert set(options) == {"any", MIG_1G, f"{A100} MIG 3g.20gb"}  # no whole A100 offered
    assert "NVIDIA A100-SXM4-40GB · 1g.5gb" in options[MIG_1G]
    assert "1/2 free" in options[MIG_1G]
    assert "1/1 free" in options[f"{A100} MIG 3g.20gb"]
    assert "Any model (2 of 3 GPUs free)" in options["any"]
    text = " ".join(form.text)
    assert "NVIDIA A100-SXM4-40GB · 3g.20gb" in text and "1 of 2" in text
