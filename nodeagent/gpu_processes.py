"""What runs on each GPU, as a heartbeat reports it (``GPUInfo.processes``): pure policy.

The inventory source lists each GPU's processes by pid (NVML's compute and graphics listings,
or the simulated file); the agent reads, for each pid, its container (``/proc/<pid>/cgroup``,
:mod:`nodeagent.cgroups`) and command name (``/proc/<pid>/comm``), and for a container that is
not a lease container its name and image (Docker). This module turns that into the report:

- a process of a **lease container** carries its ``container_id`` only (the heartbeat's
  ``containers`` say which lease it runs for);
- a process of **another container** carries that container's name and image as well, for
  the admin who has to find it (empty where Docker did not tell in time);
- a process of the **host** carries neither (``container_id`` None), and is left out when its
  command name is one of the driver's own daemons (``driver_processes``): they hold a context
  on every GPU and say nothing about who uses it;
- a GPU whose listing failed reports None (not known), never "none";
- a report lists at most :data:`~allocator.wire.protocol.MAX_GPU_PROCESSES` per GPU and
  :data:`~allocator.wire.protocol.MAX_REPORTED_PROCESSES` in all, those using the most memory first;
  each GPU counts the ones left out in ``processes_omitted``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from allocator.wire.protocol import MAX_GPU_PROCESSES, MAX_REPORTED_PROCESSES, GPUProcess
from nodeagent.inventory import GPUSample, ProcessSample

COMMAND_NAME_BYTES = 15
"""The kernel keeps this much of a command name (``TASK_COMM_LEN`` less its NUL): the daemon
``nvidia-persistenced`` shows as ``nvidia-persiste``."""

DEFAULT_DRIVER_PROCESSES = (
    "nvidia-persistenced",
    "nvidia-cuda-mps-control",
    "nvidia-cuda-mps-server",
    "nv-hostengine",
    "dcgm-exporter",
)
"""The driver's own daemons (the persistence daemon, the MPS control daemon and server,
DCGM's host engine and exporter): not a use of the GPU by anyone."""


@dataclass(frozen=True)
class ContainerDetails:
    """What an admin needs to find a container that is not a lease container."""

    name: str = ""
    image: str = ""


@dataclass(frozen=True)
class GPUProcesses:
    """One GPU's part of a report: its processes (None: not known) and how many were left out."""

    processes: list[GPUProcess] | None
    omitted: int = 0


def is_driver_process(command_name: str, driver_processes: Collection[str]) -> bool:
    """Whether a host process's command name is one of ``driver_processes`` (compared as the
    kernel keeps it, cut to :data:`COMMAND_NAME_BYTES`)."""
    if not command_name:
        return False
    return any(command_name == daemon[:COMMAND_NAME_BYTES] or command_name == daemon
               for daemon in driver_processes)


def other_containers(samples: Sequence[GPUSample], containers: Mapping[int, str],
                     lease_containers: Collection[str]) -> set[str]:
    """The containers that run a process on some GPU and are not lease containers: the ones
    whose name and image the report needs."""
    return {containers[proc.pid] for sample in samples for proc in sample.processes or ()
            if proc.pid in containers and containers[proc.pid] not in lease_containers}


def _memory_order(entry: tuple[str, GPUProcess]) -> tuple[int, int]:
    # Most memory first (an unknown amount last), then by pid, so the cut is stable.
    process = entry[1]
    used = -1 if process.memory_used_mib is None else process.memory_used_mib
    return (-used, process.pid)


def gpu_processes(
    samples: Sequence[GPUSample], *,
    containers: Mapping[int, str],
    command_names: Mapping[int, str],
    lease_containers: Collection[str],
    details: Mapping[str, ContainerDetails],
    driver_processes: Collection[str] = DEFAULT_DRIVER_PROCESSES,
    per_gpu: int = MAX_GPU_PROCESSES,
    per_report: int = MAX_REPORTED_PROCESSES,
) -> dict[str, GPUProcesses]:
    """Per GPU uuid: its processes as a report lists them.

    ``containers`` maps a pid to its container (absent: a process of the host);
    ``command_names`` a pid to its command name; ``lease_containers`` are the running lease
    containers' ids; ``details`` the name and image of other containers, where known.
    """
    listed: dict[str, list[tuple[str, GPUProcess]]] = {}
    result: dict[str, GPUProcesses] = {}
    for sample in samples:
        if sample.processes is None:
            result[sample.uuid] = GPUProcesses(None)
            continue
        entries = []
        for proc in sample.processes:
            process = _process(proc, containers, command_names, lease_containers, details,
                               driver_processes)
            if process is not None:
                entries.append((sample.uuid, process))
        listed[sample.uuid] = sorted(entries, key=_memory_order)
    kept = sorted((entry for entries in listed.values() for entry in entries[:per_gpu]),
                  key=_memory_order)[:per_report]
    kept_by_gpu: dict[str, list[GPUProcess]] = {uuid: [] for uuid in listed}
    for uuid, process in kept:
        kept_by_gpu[uuid].append(process)
    for uuid, entries in listed.items():
        result[uuid] = GPUProcesses(kept_by_gpu[uuid], len(entries) - len(kept_by_gpu[uuid]))
    return result


def _process(proc: ProcessSample, containers: Mapping[int, str],
             command_names: Mapping[int, str], lease_containers: Collection[str],
             details: Mapping[str, ContainerDetails],
             driver_processes: Collection[str]) -> GPUProcess | None:
    """One listed process as reported; None for a driver daemon of the host."""
    container_id = containers.get(proc.pid)
    name = command_names.get(proc.pid, "")[:64]
    if container_id is None:
        if is_driver_process(name, driver_processes):
            return None
        return GPUProcess(pid=proc.pid, memory_used_mib=proc.used_memory_mib, name=name)
    if container_id in lease_containers:
        return GPUProcess(pid=proc.pid, memory_used_mib=proc.used_memory_mib, name=name,
                          container_id=container_id)
    known = details.get(container_id, ContainerDetails())
    return GPUProcess(pid=proc.pid, memory_used_mib=proc.used_memory_mib, name=name,
                      container_id=container_id, container_name=known.name[:255],
                      image=known.image[:255])
