"""How a host's GPUs are joined, from the agent's reading to the allocator's node.

Pure parts: the simulated inventory's topology (presets and an interconnect written out),
the matrix ``nvidia-smi topo -m`` style, the CPU list's form, and the NVML reading's
conversions and NVLink counting over plain data. The engine part runs the real engine over
a real SQLite ledger: a full heartbeat's interconnect kept on its node, one that names other
GPUs ignored, a report without one keeping it, a reload forgetting it (and greeting again).
The agent's side over the real broker is in ``tests/agent/test_nodeagent.py`` (it needs the
agent's command queue, so the Docker engine).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from pydantic import ValidationError

from allocator.config import AllocatorSettings
from allocator.engine import Engine, Sender
from allocator.ledger.changes import Changes
from allocator.ledger.loaded import LoadedState
from allocator.ledger.store import Ledger
from allocator.wire.interconnect import (
    MAX_CPULIST,
    HostGpu,
    HostInterconnect,
    LinkLevel,
    hgx_host,
    matrix_lines,
    nvlink_pairs_host,
)
from allocator.wire.protocol import (
    GPU_PROCESSES,
    INTERCONNECT,
    LEASE_USAGE,
    AllocatorHello,
    GPUInfo,
    Heartbeat,
    HeartbeatDelta,
    decode_inbound,
    encode,
)
from nodeagent.interconnect_nvml import SWITCH, cpulist_of, nvlink_counts, pci_address
from nodeagent.simulated import (
    SimulatedSource,
    make_gpu,
    make_mig_gpu,
    parse_inventory,
    preset_interconnect,
    simulated_uuid,
    write_inventory,
)

H100 = "NVIDIA H100 80GB HBM3"


# ------------------------------------------------------------------ the simulated topology


def _source(tmp_path: Path, count: int, topology: object, host: str = "h") -> SimulatedSource:
    path = tmp_path / "inventory.json"
    write_inventory(path, {host: [make_gpu(host, i, H100) for i in range(count)]},
                    topology={host: topology})  # type: ignore[dict-item]
    return SimulatedSource(path, host)


def test_an_hgx_host_joins_all_28_pairs_by_nvlink(tmp_path: Path) -> None:
    interconnect = _source(tmp_path, 8, "hgx").read_interconnect()
    assert interconnect is not None
    assert interconnect.uuids == tuple(simulated_uuid("h", i) for i in range(8))
    assert len(interconnect.links) == 28
    assert {(link.level, link.nvlinks) for link in interconnect.links} == {
        (LinkLevel.NVLINK, 18)}
    assert [gpu.numa_node for gpu in interconnect.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [gpu.cpus for gpu in interconnect.gpus] == ["0-31"] * 4 + ["32-63"] * 4


def test_a_two_socket_pcie_host_has_levels_by_switch_and_socket(tmp_path: Path) -> None:
    interconnect = _source(tmp_path, 8, "pcie-two-socket").read_interconnect()
    assert interconnect is not None
    levels = {(i, j): interconnect.link_at(i, j).level
              for i in range(8) for j in range(i + 1, 8)}
    assert [pair for pair, level in levels.items() if level is LinkLevel.SINGLE] == [
        (0, 1), (2, 3), (4, 5), (6, 7)]
    assert levels[(0, 2)] is levels[(1, 3)] is levels[(5, 7)] is LinkLevel.NODE
    assert levels[(0, 4)] is levels[(3, 4)] is levels[(1, 7)] is LinkLevel.SYSTEM
    assert sum(level is LinkLevel.SYSTEM for level in levels.values()) == 16
    assert all(link.nvlinks == 0 for link in interconnect.links)
    assert [gpu.numa_node for gpu in interconnect.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_nvlink_pairs_and_the_builders_of_allocator_interconnect_agree() -> None:
    uuids = [f"GPU-pairs-{i}" for i in range(4)]
    simulated = preset_interconnect("nvlink-pairs", uuids)
    built = nvlink_pairs_host()
    assert [(link.level, link.nvlinks) for link in simulated.links] == [
        (link.level, link.nvlinks) for link in built.links]
    hgx = preset_interconnect("hgx", [f"GPU-hgx-{i}" for i in range(8)])
    assert [(link.level, link.nvlinks) for link in hgx.links] == [
        (link.level, link.nvlinks) for link in hgx_host().links]
    assert [gpu.numa_node for gpu in hgx.gpus] == [gpu.numa_node for gpu in hgx_host().gpus]


def test_a_single_gpu_host_reports_its_gpu_without_links(tmp_path: Path) -> None:
    interconnect = _source(tmp_path, 1, "pcie-two-socket").read_interconnect()
    assert interconnect is not None
    assert interconnect.links == ()
    assert interconnect.gpus == (HostGpu(uuid=simulated_uuid("h", 0), numa_node=0,
                                         cpus="0-31"),)


def test_presets_skip_mig_instances_and_a_host_not_named_has_none(tmp_path: Path) -> None:
    path = tmp_path / "inventory.json"
    write_inventory(path, {"h": [make_mig_gpu("h", 0, "NVIDIA A100-SXM4-40GB", ["3g.20gb"]),
                                 make_gpu("h", 1, "NVIDIA A100-SXM4-40GB")],
                           "other": [make_gpu("other", 0, H100)]},
                    topology={"h": "nvlink-pairs"})
    interconnect = SimulatedSource(path, "h").read_interconnect()
    assert interconnect is not None
    assert interconnect.uuids == (simulated_uuid("h", 0), simulated_uuid("h", 1))
    assert SimulatedSource(path, "other").read_interconnect() is None


def test_an_interconnect_written_out_must_name_the_hosts_gpus(tmp_path: Path) -> None:
    uuids = [simulated_uuid("h", i) for i in range(2)]
    written = preset_interconnect("pcie-two-socket", uuids).model_dump(mode="json")
    source = _source(tmp_path, 2, written)
    assert source.read_interconnect() == preset_interconnect("pcie-two-socket", uuids)
    gpus = {"h": [make_gpu("h", i, H100) for i in range(2)]}
    other = preset_interconnect("hgx", ["GPU-x", "GPU-y"]).model_dump(mode="json")
    with pytest.raises(ValueError, match="names GPUs"):
        write_inventory(tmp_path / "bad.json", gpus, topology={"h": other})
    with pytest.raises(ValueError, match="lists no GPUs"):
        write_inventory(tmp_path / "bad.json", gpus, topology={"nobody": "hgx"})
    with pytest.raises(ValueError, match="topology"):
        parse_inventory('{"hosts": {}, "topology": {"h": "dgx-superpod"}}')


def test_a_topology_change_in_the_file_is_read(tmp_path: Path) -> None:
    source = _source(tmp_path, 2, "hgx")
    first = source.read_interconnect()
    assert first is not None and first.link_at(0, 1).level is LinkLevel.NVLINK
    write_inventory(source.path, {"h": [make_gpu("h", i, H100) for i in range(2)]},
                    topology={"h": "pcie-two-socket"})
    changed = source.read_interconnect()
    # Two GPUs on two sockets: one on each.
    assert changed is not None and changed.link_at(0, 1).level is LinkLevel.SYSTEM
    assert source.read_interconnect() is changed, "read again only when the file changes"


# ------------------------------------------------------------------ the matrix and the CPUs


def test_the_matrix_reads_like_nvidia_smi_topo() -> None:
    interconnect = HostInterconnect(
        gpus=(HostGpu(uuid="a", numa_node=0, cpus="0-15,32-47"),
              HostGpu(uuid="b", numa_node=0, cpus="0-15,32-47"),
              HostGpu(uuid="c", numa_node=None, cpus=None)),
        links=tuple(preset_interconnect("nvlink-pairs", ["a", "b", "c"]).links))
    assert matrix_lines(interconnect, legend=False) == [
        "      GPU0  GPU1  GPU2  CPU Affinity  NUMA Affinity",
        "GPU0  X     NV4   PHB   0-15,32-47    0",
        "GPU1  NV4   X     PHB   0-15,32-47    0",
        "GPU2  PHB   PHB   X     N/A           N/A",
    ]
    with_legend = matrix_lines(interconnect)
    assert with_legend[:4] == matrix_lines(interconnect, legend=False)
    assert with_legend[4:6] == ["", "Legend:"]
    assert any(line.strip().startswith("NV#") for line in with_legend)


@pytest.mark.parametrize("cpus", ["0", "0-15,32-47", "1,3,5-7", "0-65535"])
def test_a_cpu_list_in_linux_form_is_taken(cpus: str) -> None:
    assert HostGpu(uuid="a", cpus=cpus).cpus == cpus


@pytest.mark.parametrize("cpus", ["", "7-3", "0-3,2", "4,1", "0-65536", "0 - 3", "0-3,",
                                  "a-b", "1" * 6, ",".join(["0"] * 600)])
def test_a_cpu_list_out_of_form_is_refused(cpus: str) -> None:
    with pytest.raises(ValidationError):
        HostGpu(uuid="a", cpus=cpus)


def test_nvmls_cpu_bitmask_becomes_a_cpu_list() -> None:
    assert cpulist_of([0x0000_FFFF_0000_FFFF]) == "0-15,32-47"
    assert cpulist_of([1 << 63, 0b11]) == "63-65"
    assert cpulist_of([0b1010_0101]) == "0,2,5,7"
    assert cpulist_of([0, 0]) is None
    every_other = [int("01" * 32, 2)] * 16  # 512 CPUs, each alone: longer than MAX_CPULIST
    assert cpulist_of(every_other) is None
    assert len(",".join(str(i) for i in range(0, 1024, 2))) > MAX_CPULIST


def test_nvml_bus_ids_become_the_kernels_pci_addresses() -> None:
    assert pci_address("00000000:18:00.0") == "0000:18:00.0"
    assert pci_address(b"00000001:AF:1F.7\x00") == "0001:af:1f.7"
    assert pci_address("18:00.0") == "0000:18:00.0"
    assert pci_address("no bus") is None
    assert pci_address("0000:18:00.9") is None


def test_nvlinks_are_counted_per_pair_through_switches_and_bridges() -> None:
    hgx = nvlink_counts([[SWITCH] * 18 for _ in range(8)])
    assert len(hgx) == 28 and set(hgx.values()) == {18}
    # Two NVLink bridges of 4 links, each link seen from both ends.
    bridges = nvlink_counts([[1] * 4, [0] * 4, [3] * 4, [2] * 4])
    assert bridges == {(0, 1): 4, (2, 3): 4}
    # A GPU with fewer working switch links joins the others by as many; no NVLink at all
    # leaves a pair out (its PCIe level decides).
    uneven = nvlink_counts([[SWITCH] * 18, [SWITCH] * 12, []])
    assert uneven == {(0, 1): 12}
    # A far end that names no GPU of the host (or the GPU itself) is not a link between two.
    assert nvlink_counts([[5, 0], [7]]) == {}


# ------------------------------------------------------------------ the allocator's node


NODE = Sender(user_id="agent", via_nodes_exchange=True)
SEQ = itertools.count()


def _engine(tmp_path: Path) -> Engine:
    settings = AllocatorSettings.model_validate({"ledger_path": tmp_path / "ledger.sqlite",
                                                 "allow_any_node_user": True})
    engine = Engine(settings, started_at=0.0)
    engine.load(_empty_state(tmp_path), 0.0, fenced=False)
    return engine


def _empty_state(tmp_path: Path) -> LoadedState:
    ledger = Ledger(tmp_path / "empty.sqlite")
    ledger.open()
    try:
        return ledger.call(ledger.load)
    finally:
        ledger.close()


UUIDS = [f"GPU-a-{i}" for i in range(4)]


def _beat(at: float, interconnect: HostInterconnect | None = None, *,
          uuids: list[str] = UUIDS) -> Heartbeat:
    """A full report of host ``a``, off the wire as the service decodes it."""
    beat = Heartbeat(host="a", agent_id="agent-a", seq=next(SEQ), sent_at=at, interval_s=2,
                     gpus=[GPUInfo(uuid=u, index=i, model=H100, memory_total_mib=81559)
                           for i, u in enumerate(uuids)],
                     interconnect=interconnect)
    decoded = decode_inbound(encode(beat))
    assert isinstance(decoded, Heartbeat)
    return decoded


def _delta(at: float) -> HeartbeatDelta:
    return HeartbeatDelta(host="a", agent_id="agent-a", seq=next(SEQ), sent_at=at,
                          interval_s=2)


def test_the_allocator_keeps_the_reported_interconnect_on_the_node(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    changes = Changes()
    engine.handle(_beat(1.0), NODE, 1.0, changes)
    node = engine.cluster.nodes["a"]
    assert node.interconnect is None, "an agent before 0.3.0 reports none"
    assert engine.take_agent_commands() == [
        AllocatorHello(host="a", reads=[GPU_PROCESSES, INTERCONNECT, LEASE_USAGE])]
    pairs = preset_interconnect("nvlink-pairs", UUIDS)
    engine.handle(_beat(2.0, pairs), NODE, 2.0, changes)
    assert node.interconnect == pairs
    engine.handle(_delta(3.0), NODE, 3.0, changes)
    engine.handle(_beat(4.0), NODE, 4.0, changes)
    assert node.interconnect == pairs, "a report without one keeps the one taken"
    sockets = preset_interconnect("pcie-two-socket", UUIDS)
    engine.handle(_beat(5.0, sockets), NODE, 5.0, changes)
    assert node.interconnect == sockets
    assert engine.counters["interconnect_mismatch"] == 0


def test_an_interconnect_of_other_gpus_is_ignored_not_the_heartbeat(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    changes = Changes()
    pairs = preset_interconnect("nvlink-pairs", UUIDS)
    engine.handle(_beat(1.0, pairs), NODE, 1.0, changes)
    node = engine.cluster.nodes["a"]
    assert node.interconnect == pairs
    # The agent now lists a fifth GPU, but its interconnect names the four it had.
    five = [*UUIDS, "GPU-a-4"]
    engine.handle(_beat(2.0, pairs, uuids=five), NODE, 2.0, changes)
    assert node.gpu_uuids == five, "the heartbeat itself is taken"
    assert node.interconnect == pairs, "the node keeps the interconnect it had"
    assert engine.counters["interconnect_mismatch"] == 1
    # The deltas standing on that report carry the same interconnect: judged once.
    engine.handle(_delta(3.0), NODE, 3.0, changes)
    engine.handle(_delta(4.0), NODE, 4.0, changes)
    assert engine.counters["interconnect_mismatch"] == 1
    # One naming a GPU twice or leaving one out never gets this far: it does not decode.
    body = encode(_beat(5.0, pairs)).replace(b'"GPU-a-3","numa_node"', b'"GPU-a-2","numa_node"')
    assert not isinstance(decode_inbound(body), Heartbeat)
    fitting = preset_interconnect("hgx", five)
    engine.handle(_beat(6.0, fitting, uuids=five), NODE, 6.0, changes)
    assert node.interconnect == fitting


def test_a_reload_forgets_the_interconnect_and_greets_the_agent_again(tmp_path: Path) -> None:
    engine = _engine(tmp_path)
    changes = Changes()
    pairs = preset_interconnect("nvlink-pairs", UUIDS)
    engine.handle(_beat(1.0, pairs), NODE, 1.0, changes)
    engine.take_agent_commands()
    engine.load(_empty_state(tmp_path), 2.0)
    engine.handle(_beat(3.0), NODE, 3.0, changes)
    assert engine.cluster.nodes["a"].interconnect is None
    assert engine.take_agent_commands() == [
        AllocatorHello(host="a", reads=[GPU_PROCESSES, INTERCONNECT, LEASE_USAGE])], "asked again"
    engine.handle(_beat(4.0, pairs), NODE, 4.0, changes)
    assert engine.cluster.nodes["a"].interconnect == pairs
