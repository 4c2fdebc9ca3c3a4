"""Each GPU's processes as the agent reports them: attribution, the driver's daemons, the cap,
"not known" versus "none", and the wire form an allocator before 0.2.0 can read.

The pure rules (:mod:`nodeagent.gpu_processes`), and real processes behind the pids where
``/proc`` is read. The agent itself, on the real broker with real containers, is tested in
tests/agent/test_nodeagent.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from allocator.wire.protocol import (
    MAX_GPU_PROCESSES,
    MAX_REPORTED_PROCESSES,
    NODE_MESSAGE_ADAPTER,
    GPUInfo,
    GPUProcess,
    Health,
    Heartbeat,
    encode,
)
from nodeagent.cgroups import CgroupReader
from nodeagent.gpu_processes import (
    DEFAULT_DRIVER_PROCESSES,
    ContainerDetails,
    gpu_processes,
    is_driver_process,
    other_containers,
)
from nodeagent.inventory import GPUSample, ProcessSample

CONTAINER = "c" * 64
LEASE_CONTAINER = "a" * 64
WAIT_S = 10.0


def running_program(program: str, *args: str) -> subprocess.Popen[bytes]:
    """``program`` started, once it runs (a forked child is its parent's copy until exec)."""
    path = shutil.which(program)
    assert path is not None, program
    process = subprocess.Popen([path, *args])
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            if Path(os.readlink(f"/proc/{process.pid}/exe")) == Path(path).resolve():
                return process
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{program} did not start"
        time.sleep(0.01)


def sample(uuid: str, processes: tuple[ProcessSample, ...] | None) -> GPUSample:
    return GPUSample(uuid=uuid, index=0, model="NVIDIA GeForce GTX 1070",
                     memory_total_mib=8192, processes=processes)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A real host process whose command name is the persistence daemon's (the kernel cuts
    it to 15 characters): a copy of ``sleep`` under that name."""
    sleep = shutil.which("sleep")
    assert sleep is not None
    program = tmp_path / "nvidia-persistenced"
    shutil.copy(sleep, program)
    process = running_program(str(program), "300")
    try:
        yield process
    finally:
        process.kill()
        process.wait()


@pytest.fixture
def worker() -> Iterator[subprocess.Popen[bytes]]:
    """A real host process of no container, as a user's job started outside swarm-gpu."""
    process = running_program("sleep", "300")
    try:
        yield process
    finally:
        process.kill()
        process.wait()


# ------------------------------------------------------------------------- the pure rules


def test_each_process_is_attributed_to_its_container_or_the_host() -> None:
    gpu = sample("GPU-0", (ProcessSample(10, 500), ProcessSample(11, 300),
                           ProcessSample(12, None), ProcessSample(13, 40)))
    containers = {10: LEASE_CONTAINER, 11: CONTAINER}
    names = {10: "python", 11: "train", 12: "Xorg", 13: "nvidia-persiste"}
    details = {CONTAINER: ContainerDetails("stray", "pytorch/pytorch:2.3")}
    assert other_containers([gpu], containers, {LEASE_CONTAINER}) == {CONTAINER}
    report = gpu_processes([gpu], containers=containers, command_names=names,
                           lease_containers={LEASE_CONTAINER}, details=details)
    assert report["GPU-0"].omitted == 0
    assert report["GPU-0"].processes == [
        # A lease container's process names its container only; another container's its
        # name and image too; the host's neither; the persistence daemon is left out.
        GPUProcess(pid=10, memory_used_mib=500, name="python", container_id=LEASE_CONTAINER),
        GPUProcess(pid=11, memory_used_mib=300, name="train", container_id=CONTAINER,
                   container_name="stray", image="pytorch/pytorch:2.3"),
        GPUProcess(pid=12, memory_used_mib=None, name="Xorg"),
    ]


def test_a_daemon_name_counts_only_for_a_process_of_the_host() -> None:
    assert is_driver_process("nvidia-persiste", DEFAULT_DRIVER_PROCESSES)  # as the kernel cut it
    assert is_driver_process("nv-hostengine", DEFAULT_DRIVER_PROCESSES)
    assert not is_driver_process("nvidia-persistencer", DEFAULT_DRIVER_PROCESSES)
    assert not is_driver_process("", DEFAULT_DRIVER_PROCESSES)
    gpu = sample("GPU-0", (ProcessSample(7, 10),))
    inside = gpu_processes([gpu], containers={7: CONTAINER},
                           command_names={7: "nv-hostengine"}, lease_containers=(), details={})
    assert [p.pid for p in inside["GPU-0"].processes or []] == [7]


def test_not_known_is_not_none() -> None:
    report = gpu_processes([sample("GPU-0", None), sample("GPU-1", ())], containers={},
                           command_names={}, lease_containers=(), details={})
    assert report["GPU-0"].processes is None
    assert report["GPU-1"].processes == []


def test_a_report_keeps_the_largest_processes_and_counts_the_rest_per_gpu() -> None:
    # GPU-0 lists more than one GPU may; together they list more than one report may.
    many = tuple(ProcessSample(pid, pid % 1000) for pid in range(1, 201))
    other = tuple(ProcessSample(pid, 5000 + pid) for pid in range(1001, 1301))
    report = gpu_processes([sample("GPU-0", many), sample("GPU-1", other)], containers={},
                           command_names={}, lease_containers=(), details={},
                           per_gpu=MAX_GPU_PROCESSES, per_report=100)
    first, second = report["GPU-0"], report["GPU-1"]
    assert first.processes is not None and second.processes is not None
    assert len(first.processes) + len(second.processes) == 100
    assert len(second.processes) == MAX_GPU_PROCESSES  # its own cap first
    assert first.omitted == 200 - len(first.processes)
    assert second.omitted == 300 - MAX_GPU_PROCESSES
    kept = [p.memory_used_mib or 0 for p in first.processes + second.processes]
    assert min(kept) >= max(p.used_memory_mib or 0 for p in many
                            if p.pid not in {q.pid for q in first.processes})
    assert [p.memory_used_mib for p in second.processes] == sorted(
        (p.memory_used_mib or 0 for p in second.processes), reverse=True)
    # The defaults are the protocol's, and a GPU entry takes what the cap leaves.
    full = gpu_processes([sample("GPU-0", many)], containers={}, command_names={},
                         lease_containers=(), details={})["GPU-0"]
    assert full.processes is not None and len(full.processes) == MAX_GPU_PROCESSES
    assert MAX_GPU_PROCESSES <= MAX_REPORTED_PROCESSES
    GPUInfo(uuid="GPU-0", index=0, model="m", memory_total_mib=1, memory_used_mib=0,
            health=Health.HEALTHY, processes=full.processes, processes_omitted=full.omitted)


def test_the_wire_leaves_out_processes_not_reported() -> None:
    """What an allocator of 0.1.0 reads: no processes field where none were reported (the
    agent's heartbeats until an allocator said hello), as for any heartbeat built here."""
    gpu = GPUInfo(uuid="GPU-0", index=0, model="m", memory_total_mib=1, memory_used_mib=0,
                  health=Health.HEALTHY)
    beat = Heartbeat(host="h", agent_id="a", seq=0, sent_at=1.0, interval_s=5.0,
                     gpus=[gpu, gpu.model_copy(update={"uuid": "GPU-1", "index": 1,
                                                        "processes": []})],
                     containers=[], containers_complete=True, source="simulated")
    wire = json.loads(encode(beat))
    assert "processes" not in wire["gpus"][0] and "processes_omitted" not in wire["gpus"][0]
    assert wire["gpus"][1]["processes"] == [] and "processes_omitted" not in wire["gpus"][1]
    assert NODE_MESSAGE_ADAPTER.validate_json(encode(beat)) == beat


def test_the_command_name_is_read_from_proc(daemon: subprocess.Popen[bytes],
                                            worker: subprocess.Popen[bytes]) -> None:
    reader = CgroupReader()
    assert reader.command_name(daemon.pid) == "nvidia-persiste"
    assert reader.command_name(worker.pid) == "sleep"
    assert reader.command_name(2**22 + 12345) == ""  # no such process


def test_a_mig_parent_lists_only_what_none_of_its_instances_lists() -> None:
    """NVML may list a MIG instance's processes on its parent GPU as well: a lease container
    of an instance must not read as using the whole GPU."""
    from nodeagent.nvml import processes_of_mig_parent

    instance = GPUSample(uuid="MIG-1", index=0, model="m", memory_total_mib=1,
                         processes=(ProcessSample(5, 100),), mig_parent_uuid="GPU-0")
    listed = (ProcessSample(5, None), ProcessSample(6, 10))
    assert processes_of_mig_parent(listed, [instance]) == (ProcessSample(6, 10),)
    unknown = GPUSample(uuid="MIG-2", index=0, model="m", memory_total_mib=1, processes=None,
                        mig_parent_uuid="GPU-0")
    assert processes_of_mig_parent(listed, [instance, unknown]) is None
    assert processes_of_mig_parent(None, [instance]) is None
