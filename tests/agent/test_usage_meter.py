"""What each lease container used, measured by the agent (:mod:`nodeagent.usage`): the counters
over hand-computed readings (a whole GPU, slices apportioned by SM share, an idle shared GPU
split evenly, MIG instances on one parent, a counter that went back, a long gap, a new
measurement), and the simulated inventory's energy counter and per-process utilization.
The agent over the real broker and Docker is in ``tests/agent/test_nodeagent.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from allocator.wire.protocol import GPUInfo, Heartbeat
from nodeagent.inventory import GPUSample, ProcessSample
from nodeagent.metrics import usage_families
from nodeagent.simulated import SimulatedSource, make_gpu, make_mig_gpu, write_inventory
from nodeagent.usage import HOST, GpuUse, Holder, UsageMeter, use_by_container


def gpu(uuid: str, energy_mj: int | None, *processes: ProcessSample,
        parent: str | None = None) -> GPUSample:
    if parent is not None:
        return GPUSample(uuid=uuid, index=0, model="m", memory_total_mib=1000,
                         processes=processes, mig_parent_uuid=parent, mig_profile="1g.5gb",
                         mig_index=int(uuid[-1]))
    return GPUSample(uuid=uuid, index=0, model="m", memory_total_mib=1000, energy_mj=energy_mj,
                     processes=processes)


def test_a_whole_gpu_gives_its_holder_all_its_energy_and_sm_seconds() -> None:
    meter = UsageMeter(max_gap_s=60)
    holders = [Holder("c1", ("G0",))]
    use = {"c1": {"G0": GpuUse(sm_pct=50, memory_pct=20, memory_mib=700)}}
    meter.measure(100.0, [gpu("G0", 1_000_000)], holders, use)
    first = meter.usage("c1")
    assert first is not None
    assert (first.since, first.energy_j, first.sm_s, first.peak_memory_mib) == (100.0, 0, 0, 700)
    meter.measure(110.0, [gpu("G0", 4_000_000)], holders,
                  {"c1": {"G0": GpuUse(sm_pct=50, memory_pct=20, memory_mib=300)}})
    usage = meter.usage("c1")
    assert usage is not None
    # 3,000,000 mJ over 10 s; 50 % SM and 20 % memory over 10 s; the peak stays at 700.
    assert usage.energy_j == pytest.approx(3000.0)
    assert usage.sm_s == pytest.approx(5.0)
    assert usage.memory_s == pytest.approx(2.0)
    assert usage.peak_memory_mib == 700
    assert usage.since == 100.0 and usage.energy_known


def test_slices_share_a_gpus_energy_by_sm_share_and_others_keep_theirs() -> None:
    meter = UsageMeter()
    holders = [Holder("a", ("G0",)), Holder("b", ("G0",))]
    use = {"a": {"G0": GpuUse(sm_pct=30)}, "b": {"G0": GpuUse(sm_pct=10)},
           HOST: {"G0": GpuUse(sm_pct=40)}}
    meter.measure(0.0, [gpu("G0", 0)], holders, use)
    meter.measure(10.0, [gpu("G0", 8_000_000)], holders, use)
    a, b = meter.usage("a"), meter.usage("b")
    assert a is not None and b is not None
    # 8,000 J; SM on the GPU is 80 %: a 30/80, b 10/80, the host's process 40/80 nobody's.
    assert a.energy_j == pytest.approx(3000.0)
    assert b.energy_j == pytest.approx(1000.0)
    assert a.sm_s == pytest.approx(3.0) and b.sm_s == pytest.approx(1.0)


def test_an_idle_shared_gpu_is_split_evenly_among_its_holders() -> None:
    meter = UsageMeter()
    holders = [Holder("a", ("G0",)), Holder("b", ("G0",))]
    use = {"a": {"G0": GpuUse(sm_pct=0)}, "b": {"G0": GpuUse()}}
    meter.measure(0.0, [gpu("G0", 0)], holders, use)
    meter.measure(5.0, [gpu("G0", 600_000)], holders, use)
    assert [meter.usage(c).energy_j for c in "ab"] == [  # type: ignore[union-attr]
        pytest.approx(300.0), pytest.approx(300.0)]


def test_mig_instances_share_their_parents_counter() -> None:
    meter = UsageMeter()
    holders = [Holder("a", ("MIG-1",)), Holder("b", ("MIG-2",))]
    use = {"a": {"MIG-1": GpuUse(sm_pct=75)}, "b": {"MIG-2": GpuUse(sm_pct=25)}}

    def reading(energy: int) -> list[GPUSample]:
        return [gpu("G0", energy), gpu("MIG-1", None, parent="G0"),
                gpu("MIG-2", None, parent="G0")]

    meter.measure(0.0, reading(1_000), holders, use)
    meter.measure(4.0, reading(401_000), holders, use)
    assert meter.usage("a").energy_j == pytest.approx(300.0)  # type: ignore[union-attr]
    assert meter.usage("b").energy_j == pytest.approx(100.0)  # type: ignore[union-attr]


def test_a_counter_that_went_back_a_gap_and_a_gpu_without_counter() -> None:
    meter = UsageMeter(max_gap_s=30)
    holders = [Holder("c", ("G0", "G1"))]
    use = {"c": {"G0": GpuUse(sm_pct=100), "G1": GpuUse(sm_pct=100)}}
    meter.measure(0.0, [gpu("G0", 5_000_000), gpu("G1", None)], holders, use)
    meter.measure(10.0, [gpu("G0", 1_000_000), gpu("G1", None)], holders, use)  # reloaded
    meter.measure(1000.0, [gpu("G0", 3_000_000), gpu("G1", None)], holders, use)  # a gap
    usage = meter.usage("c")
    assert usage is not None
    assert usage.energy_j == pytest.approx(2000.0)  # only the delta after the reset
    assert usage.sm_s == pytest.approx(2 * (10 + 30))  # the gap counts max_gap_s
    assert not usage.energy_known  # G1 has no counter


def test_a_container_that_goes_and_comes_back_starts_a_new_measurement() -> None:
    meter = UsageMeter()
    use = {"c": {"G0": GpuUse(sm_pct=100)}}
    meter.measure(0.0, [gpu("G0", 0)], [Holder("c", ("G0",))], use)
    meter.measure(1.0, [gpu("G0", 1000)], [Holder("c", ("G0",))], use)
    meter.measure(2.0, [gpu("G0", 2000)], [], use)
    assert meter.usage("c") is None
    meter.measure(3.0, [gpu("G0", 3000)], [Holder("c", ("G0",))], use)
    usage = meter.usage("c")
    assert usage is not None and (usage.since, usage.energy_j, usage.sm_s) == (3.0, 0, 0)


def test_use_by_container_adds_up_processes_and_keeps_the_hosts_apart() -> None:
    sample = gpu("G0", 0, ProcessSample(1, 100, 10.0, memory_utilization_pct=5.0),
                 ProcessSample(2, 200, 20.0),
                 ProcessSample(3, 50, 30.0, memory_utilization_pct=1.0))
    assert use_by_container([sample], {1: "c", 2: "c"}) == {
        "c": {"G0": GpuUse(sm_pct=30.0, memory_pct=5.0, memory_mib=300)},
        HOST: {"G0": GpuUse(sm_pct=30.0, memory_pct=1.0, memory_mib=50)}}


def test_the_simulated_counter_is_the_files_or_counted_from_power(tmp_path: Path) -> None:
    path = tmp_path / "inventory.json"
    clock = [1000.0]
    write_inventory(path, {"h": [
        make_gpu("h", 0, "NVIDIA A100-SXM4-40GB", energy_mj=5_000, processes=[
            {"pid": 7, "used_memory_mib": 10, "utilization_pct": 40,
             "memory_utilization_pct": 15}]),
        make_gpu("h", 1, "NVIDIA A100-SXM4-40GB", power_w=200.0),
        make_mig_gpu("h", 2, "NVIDIA A100-SXM4-40GB", ["3g.20gb"], power_w=None)]})
    source = SimulatedSource(path, "h", clock=lambda: clock[0])
    first = {s.uuid: s for s in source.read_gpus()}
    clock[0] += 2.5
    second = source.read_gpus()
    by_index = [s for s in second if not s.is_mig_instance]
    assert [s.energy_mj for s in by_index] == [5_000, 500_000, None]
    assert [s.energy_mj for s in first.values() if not s.is_mig_instance] == [5_000, 0, None]
    assert [s.energy_mj for s in second if s.is_mig_instance] == [None]
    assert by_index[0].processes == (ProcessSample(7, 10, 40.0, memory_utilization_pct=15.0),)


def test_the_metrics_count_by_group_and_gpu_and_never_go_back() -> None:
    """Counters per (group, GPU): a container of two groups counts for each; one that ends
    leaves its counts; the families carry DCGM exporter's labels."""
    meter = UsageMeter()
    holders = [Holder("a", ("G0",), ("lab", "ops")), Holder("b", ("G0",))]
    use = {"a": {"G0": GpuUse(sm_pct=60)}, "b": {"G0": GpuUse(sm_pct=20)}}
    meter.measure(0.0, [gpu("G0", 0)], holders, use)
    meter.measure(10.0, [gpu("G0", 8_000_000)], holders, use)
    meter.measure(20.0, [gpu("G0", 8_000_000)], [], {})  # both ended
    assert {key: (round(joules, 6), round(sm_s, 6))
            for key, (joules, sm_s) in meter.counted.items()} == {
        ("lab", "G0"): (6000.0, 6.0), ("ops", "G0"): (6000.0, 6.0), ("", "G0"): (2000.0, 2.0)}
    beat = Heartbeat(host="h", agent_id="x", seq=0, sent_at=0.0, interval_s=5,
                     gpus=[GPUInfo(uuid="G0", index=3, model="M", memory_total_mib=1000)])
    energy, used = usage_families(beat, meter.counted)
    assert energy.name == "swarm_gpu_agent_lease_energy_joules"
    by_group = {s.labels["group"]: (s.labels["gpu"], s.labels["UUID"], s.labels["modelName"],
                                    s.labels["Hostname"], round(s.value, 6))
                for s in energy.samples}
    assert by_group == {"": ("3", "G0", "M", "h", 2000.0), "lab": ("3", "G0", "M", "h", 6000.0),
                        "ops": ("3", "G0", "M", "h", 6000.0)}
    assert {s.labels["group"]: s.value for s in used.samples} == {
        "": pytest.approx(2.0), "lab": pytest.approx(6.0), "ops": pytest.approx(6.0)}
    assert [list(f.samples) for f in usage_families(None, meter.counted)] == [[], []]
