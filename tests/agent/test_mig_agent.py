"""MIG on the node agent: the simulated inventory's MIG GPUs, parent health on instances, a
re-partition under held instances, and the heartbeat the agent builds from them.

The heartbeat tests run the agent's own ``build_heartbeat`` on a simulated inventory file
(no broker needed: it is what the agent publishes); the broker and allocator paths are in
``test_mig_e2e.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from allocator.wire.model_names import display_name, mig_model_name, mig_parts
from allocator.wire.protocol import GPUInfo, Health, Heartbeat
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.health import Verdict
from nodeagent.inventory import GPUSample, InventoryUnavailable
from nodeagent.mig import REMOVED_REASON, MigLayout, inherit_parent_health
from nodeagent.simulated import (
    SimulatedSource,
    make_gpu,
    make_mig_gpu,
    make_mig_instances,
    read_inventory,
    simulated_uuid,
    update_gpu,
    write_inventory,
)
from tests.support.common import A100_40GB as A100
from tests.support.common import GTX1070 as GTX

HOST = "mig-host"


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    path = tmp_path / "inventory.json"
    write_inventory(path, {HOST: [
        make_mig_gpu(HOST, 0, A100, ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"]),
        make_gpu(HOST, 1, A100),
        make_gpu(HOST, 2, GTX),
    ]})
    return path


def test_names_and_profiles_follow_nvml() -> None:
    name = mig_model_name(A100, "1g.5gb")
    assert name == "NVIDIA A100-SXM4-40GB MIG 1g.5gb"
    assert mig_parts(name) == (A100, "1g.5gb")
    assert mig_parts("NVIDIA H100 80GB HBM3 MIG 1c.2g.20gb") == ("NVIDIA H100 80GB HBM3",
                                                                 "1c.2g.20gb")
    assert mig_parts(A100) is None
    assert display_name(name) == "NVIDIA A100-SXM4-40GB · 1g.5gb"
    assert display_name(A100) == A100


def test_simulated_mig_gpu_reports_parent_then_instances(inventory: Path) -> None:
    samples = SimulatedSource(inventory, HOST).read_gpus()
    parent, *instances = [s for s in samples if s.index == 0]
    assert parent.mig_mode is True and parent.mig_parent_uuid is None
    assert parent.compute_capability == "8.0" and parent.architecture == "ampere"
    assert [i.mig_profile for i in instances] == ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"]
    assert [i.mig_index for i in instances] == [0, 1, 2, 3]
    assert all(i.uuid.startswith("MIG-") and i.mig_parent_uuid == parent.uuid
               for i in instances)
    assert instances[2].model == f"{A100} MIG 1g.5gb"
    assert instances[0].memory_total_mib == 19968
    assert all(i.compute_capability == "8.0" for i in instances)
    gtx = next(s for s in samples if s.index == 2)
    assert (gtx.compute_capability, gtx.architecture, gtx.mig_mode) == ("6.1", "pascal", None)


def test_instances_need_mig_mode(tmp_path: Path) -> None:
    entry = make_gpu(HOST, 0, A100, mig_instances=make_mig_instances(HOST, 0, ["1g.5gb"]))
    with pytest.raises(ValueError, match="mig_mode is not true"):
        write_inventory(tmp_path / "bad.json", {HOST: [entry]})
    (tmp_path / "bad.json").write_text('{"hosts": {"mig-host": [' + _json(entry) + "]}}")
    with pytest.raises(InventoryUnavailable, match="mig_mode"):
        SimulatedSource(tmp_path / "bad.json", HOST)


def _json(entry: dict[str, Any]) -> str:
    return json.dumps(entry)


def agent_for(inventory: Path) -> NodeAgent:
    settings = AgentSettings(host=HOST, amqp_url="amqp://guest:guest@127.0.0.1:1/",
                             inventory="simulated", simulated_file=inventory, docker=False,
                             overheat_c=90.0, overheat_hysteresis_c=10.0)
    return NodeAgent(settings, source=SimulatedSource(inventory, HOST))


def by_uuid(beat: Heartbeat) -> dict[str, GPUInfo]:
    return {gpu.uuid: gpu for gpu in beat.gpus}


async def test_heartbeat_lists_instances_as_units_with_parent_and_capability(
        inventory: Path) -> None:
    beat = await agent_for(inventory).build_heartbeat()
    assert beat is not None
    gpus = by_uuid(beat)
    parent = gpus[simulated_uuid(HOST, 0)]
    assert parent.mig_mode is True and parent.compute_capability == "8.0"
    instances = [g for g in beat.gpus if g.mig_parent_uuid == parent.uuid]
    assert len(instances) == 4
    assert {g.model for g in instances} == {f"{A100} MIG {p}"
                                           for p in ("3g.20gb", "2g.10gb", "1g.5gb")}
    assert all(g.index == 0 and g.architecture == "ampere" for g in instances)
    assert gpus[simulated_uuid(HOST, 2)].compute_capability == "6.1"
    # What the agent builds is what the allocator accepts (the broker carries this JSON).
    assert Heartbeat.model_validate_json(beat.model_dump_json()) == beat


@pytest.mark.parametrize(("fault", "recovery", "reason"), [
    ({"temperature_c": 97.0}, {"temperature_c": 60.0}, "overheat"),
    ({"lost": True}, {"lost": False}, "lost"),
])
async def test_parent_health_applies_to_every_instance_and_recovers(
        inventory: Path, fault: dict[str, Any], recovery: dict[str, Any], reason: str) -> None:
    agent = agent_for(inventory)
    parent_uuid = simulated_uuid(HOST, 0)
    update_gpu(inventory, HOST, 0, **fault)
    beat = await agent.build_heartbeat()
    assert beat is not None
    instances = [g for g in beat.gpus if g.mig_parent_uuid == parent_uuid]
    assert len(instances) == 4
    assert all(g.health is Health.UNHEALTHY for g in instances)
    assert all(any(r.startswith(f"parent GPU {parent_uuid}: ") and reason in r
                   for r in g.health_reasons) for g in instances)
    # The other GPUs of the host are untouched.
    assert by_uuid(beat)[simulated_uuid(HOST, 1)].health is Health.HEALTHY

    update_gpu(inventory, HOST, 0, **recovery)
    beat = await agent.build_heartbeat()
    assert beat is not None
    assert all(g.health is Health.HEALTHY for g in beat.gpus)


async def test_a_fatal_xid_on_the_parent_makes_its_instances_unhealthy(inventory: Path) -> None:
    agent = agent_for(inventory)
    parent_uuid = simulated_uuid(HOST, 0)
    assert agent.source is not None
    update_gpu(inventory, HOST, 0, xid=79)
    for event in agent.source.wait_xids(1.0):
        agent.tracker.record_xid(event.gpu_uuid, event.xid, event.at)
    beat = await agent.build_heartbeat()
    assert beat is not None
    instances = [g for g in beat.gpus if g.mig_parent_uuid == parent_uuid]
    assert instances and all(g.health is Health.UNHEALTHY and 79 in g.recent_xids
                             for g in instances)


def _sample(uuid: str, **fields: Any) -> GPUSample:
    base: dict[str, Any] = {"index": 0, "model": A100, "memory_total_mib": 40960}
    return GPUSample(uuid=uuid, **{**base, **fields})


def _instance(uuid: str, mig_index: int, profile: str = "1g.5gb") -> GPUSample:
    return _sample(uuid, model=mig_model_name(A100, profile), mig_parent_uuid="GPU-p",
                   mig_profile=profile, mig_index=mig_index)


def test_repartition_keeps_a_held_instance_until_its_container_ends() -> None:
    layout = MigLayout()
    parent = _sample("GPU-p", mig_mode=True)
    old = [_instance("MIG-a", 0), _instance("MIG-b", 1)]
    assert layout.apply([parent, *old], held={"MIG-a"}) == [parent, *old]
    # The admin destroys both and creates one 2g.10gb at index 0; MIG-a is still held.
    new = _instance("MIG-c", 0, "2g.10gb")
    reported = layout.apply([parent, new], held={"MIG-a"})
    uuids = [s.uuid for s in reported]
    assert uuids == ["GPU-p", "MIG-c", "MIG-a"]
    kept = reported[-1]
    assert kept.mig_index not in (None, 0)  # moved off the index the new instance took
    assert layout.retained == {"MIG-a"}
    verdict = layout.verdict_of_retained(Verdict(Health.HEALTHY))
    assert verdict.health is Health.UNHEALTHY and verdict.reasons[0] == REMOVED_REASON
    # Still held a beat later: still reported, at the same place.
    assert layout.apply([parent, new], held={"MIG-a"})[-1] == kept
    # The container ended: gone for good, even if something is held again later.
    assert [s.uuid for s in layout.apply([parent, new], held=set())] == ["GPU-p", "MIG-c"]
    assert [s.uuid for s in layout.apply([parent, new], held={"MIG-a"})] == ["GPU-p", "MIG-c"]
    assert layout.retained == frozenset()


def test_a_parent_leaving_mig_mode_under_a_held_instance_stays_in_mig_mode() -> None:
    layout = MigLayout()
    layout.apply([_sample("GPU-p", mig_mode=True), _instance("MIG-a", 0)], held={"MIG-a"})
    reported = layout.apply([_sample("GPU-p", mig_mode=False)], held={"MIG-a"})
    assert [(s.uuid, s.mig_mode) for s in reported] == [("GPU-p", True), ("MIG-a", None)]
    released = layout.apply([_sample("GPU-p", mig_mode=False)], held=set())
    assert [(s.uuid, s.mig_mode) for s in released] == [("GPU-p", False)]


async def test_repartition_in_the_file_reaches_the_heartbeat(inventory: Path) -> None:
    agent = agent_for(inventory)
    hosts = read_inventory(inventory)
    hosts[HOST][0]["mig_instances"] = make_mig_instances(HOST, 0, ["7g.40gb"], first=10)
    write_inventory(inventory, hosts)
    beat = await agent.build_heartbeat()
    assert beat is not None
    instances = [g for g in beat.gpus if g.mig_parent_uuid == simulated_uuid(HOST, 0)]
    assert [(g.mig_profile, g.memory_total_mib) for g in instances] == [("7g.40gb", 40192)]


def test_the_protocol_refuses_inconsistent_mig_entries() -> None:
    parent = GPUInfo(uuid="GPU-p", index=0, model=A100, memory_total_mib=40960, mig_mode=True)
    instance = GPUInfo(uuid="MIG-a", index=0, model=mig_model_name(A100, "1g.5gb"),
                       memory_total_mib=4864, mig_parent_uuid="GPU-p", mig_profile="1g.5gb",
                       mig_index=0)
    beat: dict[str, Any] = {"host": "h", "agent_id": "a", "seq": 0, "sent_at": 1.0,
                            "interval_s": 1.0}
    Heartbeat(**beat, gpus=[parent, instance])  # consistent
    with pytest.raises(ValidationError, match="names a parent GPU"):
        Heartbeat(**beat, gpus=[with_fields(parent, mig_mode=False), instance])
    with pytest.raises(ValidationError, match="names a parent GPU"):
        Heartbeat(**beat, gpus=[instance])
    with pytest.raises(ValidationError, match="duplicate GPU index"):
        Heartbeat(**beat, gpus=[parent, instance,
                                with_fields(instance, uuid="MIG-b")])
    with pytest.raises(ValidationError, match="mig_parent_uuid, mig_profile and mig_index"):
        GPUInfo(uuid="MIG-a", index=0, model="x", memory_total_mib=1, mig_parent_uuid="GPU-p")
    with pytest.raises(ValidationError, match="compute_capability"):
        GPUInfo(uuid="GPU-x", index=0, model="x", memory_total_mib=1, compute_capability="8")


def with_fields(info: GPUInfo, **changes: Any) -> GPUInfo:
    return info.model_copy(update=changes)


verdicts = st.builds(
    Verdict,
    st.sampled_from(list(Health)),
    st.lists(st.sampled_from(["hot", "xid 79", "ecc"]), max_size=3).map(tuple),
    st.lists(st.integers(1, 120), max_size=3).map(tuple),
).map(lambda v: v if (v.health is Health.UNHEALTHY) == bool(v.reasons)
      else Verdict(Health.UNHEALTHY if v.reasons else Health.HEALTHY, v.reasons,
                   v.recent_xids))


@settings(max_examples=200, deadline=None)
@given(parent=verdicts, own=st.lists(verdicts, min_size=1, max_size=5))
def test_an_instance_is_healthy_only_when_it_and_its_parent_are(
        parent: Verdict, own: list[Verdict]) -> None:
    samples = [_sample("GPU-p", mig_mode=True),
               *(_instance(f"MIG-{i}", i) for i in range(len(own)))]
    given_verdicts = {"GPU-p": parent, **{f"MIG-{i}": v for i, v in enumerate(own)}}
    result = inherit_parent_health(samples, given_verdicts)
    assert result["GPU-p"] == parent
    for i, verdict in enumerate(own):
        got = result[f"MIG-{i}"]
        assert got.healthy == (verdict.healthy and parent.healthy)
        assert set(verdict.reasons) <= set(got.reasons)
        assert got.healthy == (not got.reasons)



def test_nvml_check_reports_mig_and_compute_capability_reads() -> None:
    """On a GPU machine: the MIG reads per physical GPU and the capability of every sample;
    elsewhere the clear error (no NVIDIA library), exit status 2."""
    repo = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "nodeagent.nvml_check", "--xid-wait", "0"],
                            cwd=repo, capture_output=True, text=True, timeout=60)
    report = json.loads(result.stdout)
    if not report["ok"]:
        assert result.returncode == 2 and "--inventory simulated" in report["error"]
        return
    assert result.returncode == 0
    physical = [g for g in report["gpus"] if g["mig_parent_uuid"] is None]
    assert [m["uuid"] for m in report["mig"]] == [g["uuid"] for g in physical]
    for gpu, mig in zip(physical, report["mig"], strict=True):
        assert "compute_capability" in gpu and "architecture" in gpu
        assert mig["mig_mode_current"] in (None, 0, 1)
        if gpu["mig_mode"]:
            assert "gpu_instance_profiles" in mig
    for instance in (g for g in report["gpus"] if g["mig_parent_uuid"] is not None):
        assert instance["uuid"].startswith("MIG-") and instance["mig_profile"]
