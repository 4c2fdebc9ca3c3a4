"""The simulated inventory source, its file writer, settings and the NVML error path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from allocator import PUBLIC_SURFACE
from nodeagent.config import AgentSettings, load_settings, resolve_host
from nodeagent.inventory import InventorySource, InventoryUnavailable, ProcessSample
from nodeagent.simulated import (
    MODELS,
    SimulatedSource,
    make_gpu,
    make_hosts,
    make_mig_gpu,
    read_inventory,
    simulated_uuid,
    update_gpu,
    write_inventory,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def inventory(tmp_path: Path) -> Path:
    path = tmp_path / "inventory.json"
    write_inventory(path, {
        "node-a": [make_gpu("node-a", 1, "NVIDIA GeForce RTX 3090"),
                   make_gpu("node-a", 0, "NVIDIA GeForce GTX 1070")],
        "node-b": [make_gpu("node-b", 0, "NVIDIA A100-SXM4-40GB")],
    })
    return path


def test_reads_its_own_hosts_gpus_in_index_order(inventory: Path) -> None:
    source = SimulatedSource(inventory, "node-a")
    assert isinstance(source, InventorySource)
    assert source.kind == "simulated"
    gpus = source.read_gpus()
    assert [(g.index, g.model, g.memory_total_mib) for g in gpus] == [
        (0, "NVIDIA GeForce GTX 1070", 8192), (1, "NVIDIA GeForce RTX 3090", 24576)]
    assert gpus[0].uuid == simulated_uuid("node-a", 0)
    assert SimulatedSource(inventory, "node-c").read_gpus() == []  # a host with no GPUs


def test_rereads_on_change_and_delivers_new_xids_once(inventory: Path) -> None:
    source = SimulatedSource(inventory, "node-a")
    assert source.wait_xids(0.01) == []
    update_gpu(inventory, "node-a", 0, temperature_c=95.0, memory_used_mib=4000)
    gpu0 = source.read_gpus()[0]
    assert (gpu0.temperature_c, gpu0.memory_used_mib) == (95.0, 4000)
    reloads = source.reloads
    source.read_gpus()
    assert source.reloads == reloads  # unchanged file: not parsed again

    update_gpu(inventory, "node-a", 1, xid=79)
    update_gpu(inventory, "node-a", 1, xid=13)
    events = source.wait_xids(1.0)
    assert [(e.gpu_uuid, e.xid) for e in events] == [(simulated_uuid("node-a", 1), 79),
                                                    (simulated_uuid("node-a", 1), 13)]
    assert source.wait_xids(0.05) == []  # once only
    update_gpu(inventory, "node-a", 1, xids=[])  # shortening delivers nothing
    assert source.wait_xids(0.05) == []
    update_gpu(inventory, "node-a", 1, xid=48)
    assert [e.xid for e in source.wait_xids(1.0)] == [48]


def test_xids_present_at_start_are_delivered(tmp_path: Path) -> None:
    path = tmp_path / "inv.json"
    write_inventory(path, {"h": [make_gpu("h", 0, "NVIDIA GeForce GTX 1070", xids=[94])]})
    assert [e.xid for e in SimulatedSource(path, "h").wait_xids(0.01)] == [94]


def test_wait_xids_wakes_when_the_file_changes(inventory: Path) -> None:
    source = SimulatedSource(inventory, "node-b")
    timer = threading.Timer(0.2, update_gpu, (inventory, "node-b", 0), {"xid": 48})
    started = time.monotonic()
    timer.start()
    events = source.wait_xids(5.0)
    waited = time.monotonic() - started
    assert [e.xid for e in events] == [48]
    assert waited < 1.0


def test_close_wakes_a_waiter(inventory: Path) -> None:
    source = SimulatedSource(inventory, "node-b")
    threading.Timer(0.1, source.close).start()
    started = time.monotonic()
    assert source.wait_xids(5.0) == []
    assert time.monotonic() - started < 1.0


def test_a_broken_file_keeps_the_last_good_one(inventory: Path) -> None:
    source = SimulatedSource(inventory, "node-a")
    inventory.write_text('{"hosts": {"node-a": [')  # an editor halfway through saving
    assert len(source.read_gpus()) == 2
    write_inventory(inventory, {"node-a": []})
    assert source.read_gpus() == []


def test_a_missing_or_bad_file_is_a_clear_error_at_start(tmp_path: Path) -> None:
    with pytest.raises(InventoryUnavailable, match="simulated inventory"):
        SimulatedSource(tmp_path / "nope.json", "h")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hosts": {"h": [{"uuid": "x"}]}}))
    with pytest.raises(InventoryUnavailable, match="index"):
        SimulatedSource(bad, "h")


def test_processes_and_optional_fields(tmp_path: Path) -> None:
    path = tmp_path / "inv.json"
    listed = [{"pid": 42, "used_memory_mib": 100}]
    write_inventory(path, {"h": [make_gpu("h", 0, "NVIDIA A100-SXM4-40GB", mig_mode=True,
                                          remap_pending=True, retired_pages=2, lost=True,
                                          processes=listed),
                                 make_gpu("h", 1, "NVIDIA A100-SXM4-40GB", processes=listed)]})
    lost, gpu = SimulatedSource(path, "h").read_gpus()
    assert (lost.mig_mode, lost.remap_pending, lost.retired_pages, lost.lost) == (
        True, True, 2, True)
    assert lost.processes is None  # nothing is known of a lost GPU's processes
    assert gpu.processes is not None
    assert [(p.pid, p.used_memory_mib, p.container_id, p.name) for p in gpu.processes] == [
        (42, 100, None, None)]


def test_a_process_may_name_its_container_and_a_listing_may_fail(tmp_path: Path) -> None:
    """A process entry's ``container_id`` and ``name`` are taken over what /proc says (so a
    dead container's process can stay listed); ``processes_error`` makes a GPU's (or a MIG
    instance's) listing fail: its processes are not known, which is not "none"."""
    path = tmp_path / "inv.json"
    cid = "ab" * 32
    write_inventory(path, {"h": [
        make_gpu("h", 0, "NVIDIA GeForce GTX 1070", processes=[
            {"pid": 7, "used_memory_mib": 5, "container_id": cid, "name": "python"}]),
        make_gpu("h", 1, "NVIDIA GeForce GTX 1070", processes_error=True,
                 processes=[{"pid": 8}]),
        make_mig_gpu("h", 2, "NVIDIA A100-SXM4-40GB", ["1g.5gb", "1g.5gb"])]})
    hosts = read_inventory(path)
    hosts["h"][2]["mig_instances"][1]["processes_error"] = True
    hosts["h"][2]["mig_instances"][0]["processes"] = [{"pid": 9, "container_id": cid}]
    write_inventory(path, hosts)
    named, failing, parent, instance, failing_instance = SimulatedSource(path, "h").read_gpus()
    assert named.processes == (ProcessSample(7, 5, None, cid, "python"),)
    assert failing.processes is None
    assert parent.processes == ()
    assert instance.processes == (ProcessSample(9, None, None, cid, None),)
    assert failing_instance.processes is None
    for bad in ({"pid": 7, "container_id": "not-an-id"}, {"pid": 7, "name": "x" * 65}):
        with pytest.raises(ValueError, match="not a simulated inventory"):
            write_inventory(tmp_path / "bad.json", {"h": [make_gpu(
                "h", 0, "NVIDIA GeForce GTX 1070", processes=[bad])]})


def test_writer_refuses_what_the_agent_would_refuse(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a simulated inventory"):
        write_inventory(tmp_path / "x.json", {"h": [{"uuid": "u"}]})
    assert not (tmp_path / "x.json").exists()
    assert list(tmp_path.iterdir()) == []  # no temp file left behind


def test_make_hosts_mixes_models() -> None:
    hosts = make_hosts(6, gpus_per_host=[2, 8])
    assert len(hosts) == 6
    assert [len(gpus) for gpus in hosts.values()] == [2, 8] * 3
    models = {gpu["model"] for gpus in hosts.values() for gpu in gpus}
    assert models == set(MODELS)
    uuids = [gpu["uuid"] for gpus in hosts.values() for gpu in gpus]
    assert len(set(uuids)) == len(uuids)


def test_command_line_writer(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    result = subprocess.run(
        [sys.executable, "-m", "nodeagent.simulated", "--hosts", "3", "--gpus", "2",
         "--host", "this-host", "--out", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=30, check=True)
    assert json.loads(result.stdout) == {"path": str(out), "hosts": 4, "gpus": 8}
    assert "this-host" in read_inventory(out)


# ------------------------------------------------------------------------------- settings


def test_settings_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('interval_s = 7\ninventory = "simulated"\nsimulated_file = "/f.json"\n'
                      'overheat_c = 80\nfatal_xids = [79]\n')
    monkeypatch.setenv("SWARM_GPU_AGENT_OVERHEAT_C", "85")
    monkeypatch.setenv("SWARM_GPU_AGENT_FATAL_XIDS", "48, 79")
    settings = load_settings(config, interval_s=None, host="cli-host")
    assert settings.interval_s == 7  # file (None from the command line does not count)
    assert settings.overheat_c == 85  # environment over file
    assert settings.fatal_xids == [48, 79]  # comma separated in the environment
    assert settings.host == "cli-host"  # command line over everything
    monkeypatch.setenv("SWARM_GPU_AGENT_FATAL_XIDS", "[63, 64]")
    assert load_settings(config).fatal_xids == [63, 64]


def test_settings_defaults_and_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SWARM_GPU_AGENT_CONFIG", raising=False)
    monkeypatch.setenv("DOCKER_HOST", "unix:///tmp/some.sock")
    settings = load_settings()
    assert settings.docker_url == "unix:///tmp/some.sock"
    assert settings.inventory == "nvml" and settings.docker is True
    assert 79 in settings.fatal_xids and 13 not in settings.fatal_xids
    monkeypatch.delenv("DOCKER_HOST")
    assert AgentSettings().docker_url == "unix:///var/run/docker.sock"
    with pytest.raises(ValueError, match="simulated_file"):
        AgentSettings(inventory="simulated")
    # the environment alone may name the source and the file name it too
    monkeypatch.setenv("SWARM_GPU_AGENT_INVENTORY", "simulated")
    monkeypatch.setenv("SWARM_GPU_AGENT_SIMULATED_FILE", "/x.json")
    assert load_settings().simulated_file == Path("/x.json")


def test_resolve_host() -> None:
    assert resolve_host(AgentSettings(host="given"), "engine") == "given"
    assert resolve_host(AgentSettings(), "engine") == "engine"
    assert resolve_host(AgentSettings(), None) == os.uname().nodename


# ----------------------------------------------------------------------------------- NVML


def nvml_gpus() -> list[str] | None:
    """The UUIDs of the GPUs NVML lists on this machine, in index order; None where NVML does
    not start (no NVIDIA driver or library).

    Asked of pynvml directly, so that the code under test does not decide which outcome its
    own test expects.
    """
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        uuids: list[str] = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            uuid = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(index))
            uuids.append(uuid.decode() if isinstance(uuid, bytes) else uuid)
        return uuids
    finally:
        pynvml.nvmlShutdown()


def test_nvml_source_imports_and_fails_clearly_without_a_driver() -> None:
    from nodeagent.nvml import NvmlSource

    expected = nvml_gpus()
    if expected is None:
        with pytest.raises(InventoryUnavailable, match="--inventory simulated"):
            NvmlSource()
        return
    # A machine with NVML: the source must work and read every GPU NVML lists.
    source = NvmlSource()
    try:
        samples = source.read_gpus()
    finally:
        source.close()
    assert [s.uuid for s in samples if not s.is_mig_instance] == expected
    assert all(sample.uuid for sample in samples)


def test_nvml_check_prints_one_json_object() -> None:
    expected = nvml_gpus()
    result = subprocess.run([sys.executable, "-m", "nodeagent.nvml_check", "--xid-wait", "0"],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    report = json.loads(result.stdout)
    if expected is None:
        assert result.returncode == 2, result.stderr
        assert report.keys() == {"ok", "error"} and report["ok"] is False
        assert "--inventory simulated" in report["error"]
    else:
        assert result.returncode == 0, result.stderr
        assert report["ok"] is True
        assert [gpu["uuid"] for gpu in report["gpus"]
                if gpu["mig_parent_uuid"] is None] == expected


def test_agent_without_nvml_exits_with_a_clear_message() -> None:
    if nvml_gpus() is not None:  # a GPU machine: the agent would run, not exit
        pytest.skip("NVML works here")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_GPU_AGENT_")}
    result = subprocess.run(
        [sys.executable, "-m", "nodeagent", "--no-docker", "--host", "h",
         "--amqp-url", "amqp://guest:guest@127.0.0.1:1/"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2, result.stderr
    assert "--inventory simulated" in result.stderr


def test_the_agent_imports_only_the_allocators_public_surface() -> None:
    code = ("import sys, nodeagent.cli, nodeagent.nvml_check, nodeagent.nvml; "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('allocator.'))))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60, check=True)
    assert set(result.stdout.split()) <= PUBLIC_SURFACE, result.stdout


def test_lease_use_is_set_per_lease_and_reported_on_its_grants_gpus(tmp_path):
    from allocator.wire.protocol import ContainerGrant
    from nodeagent.agent import simulated_use
    from nodeagent.containers import LeaseContainer
    from nodeagent.simulated import SimulatedSource, make_gpu, write_inventory

    path = tmp_path / "inventory.json"
    gpus = [make_gpu("h", i, "NVIDIA GeForce GTX 1070") for i in range(2)]
    write_inventory(path, {"h": gpus}, {"lease-1": {"utilization_pct": 42.0,
                                                    "memory_used_mib": 300}})
    source = SimulatedSource(path, "h")
    use = source.lease_use()
    assert (use["lease-1"].utilization_pct, use["lease-1"].memory_used_mib) == (42.0, 300)
    grant = ContainerGrant(host="h", gpu_uuids=[gpus[1]["uuid"]], user="u", request_key="k")
    running = [LeaseContainer("c1", "lease-1", grant=grant), LeaseContainer("c2", "lease-2"),
               LeaseContainer("c3", "lease-1")]
    by_container = simulated_use(running, use, [g["uuid"] for g in gpus])
    assert [u.gpu_uuid for u in by_container["c1"]] == [gpus[1]["uuid"]]
    assert "c2" not in by_container
    assert [u.gpu_uuid for u in by_container["c3"]] == [g["uuid"] for g in gpus]
    write_inventory(path, {"h": gpus})
    assert source.lease_use() == {}
