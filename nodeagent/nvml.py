"""The real inventory source: the host's NVIDIA GPUs through NVML (``nvidia-ml-py``).

Written against the real library; on a machine without the NVIDIA driver
:class:`NvmlSource` raises :class:`~nodeagent.inventory.InventoryUnavailable` at once with a
message that points at ``--inventory simulated``. ``python -m nodeagent.nvml_check`` prints
everything read here, for checking on a real GPU machine.

What is read per GPU, each field on its own so one unsupported query (``NotSupported`` on
consumer cards, ``NoPermission`` in some containers) costs that field only (None):
UUID, index, name, memory total/used, utilization, temperature, power, volatile uncorrected
ECC count, retired pages (before Ampere) or remapped rows (Ampere and later), MIG mode,
CUDA compute capability, architecture and the running processes (compute and graphics;
a failed listing is reported as not known, never as none). A GPU whose
queries raise ``GpuIsLost`` is reported *lost* under the identity it had at its last good
read, and so are the MIG instances it had then.

A GPU in MIG mode (``nvmlDeviceGetMigMode``) is reported with ``mig_mode=True`` and then
each of its MIG devices as a sample of its own: ``nvmlDeviceGetMaxMigDeviceCount`` slots,
``nvmlDeviceGetMigDeviceHandleByIndex`` for each (an empty slot raises ``NotFound``), and per
device its ``MIG-...`` uuid, name (``NVIDIA A100-SXM4-40GB MIG 1g.5gb``), memory and
processes. The profile is read from the name, or where the name lacks it from the GPU
instance's profile (``nvmlDeviceGetGpuInstanceId`` → ``nvmlDeviceGetGpuInstanceById`` →
``nvmlGpuInstanceGetInfo`` → ``nvmlDeviceGetGpuInstanceProfileInfoById``). These reads are
written against nvidia-ml-py's API and tested only through the simulated inventory and for
a host without the library; ``python -m nodeagent.nvml_check`` prints them on a GPU machine.

How the GPUs are joined (NVLink, PCIe, NUMA node, CPUs) is read by
:mod:`nodeagent.interconnect_nvml`, once per number of GPUs NVML lists.

XIDs come from an NVML event set registered for ``nvmlEventTypeXidCriticalError`` on every
GPU that supports it; :meth:`NvmlSource.wait_xids` blocks in ``nvmlEventSetWait_v2`` for at
most its timeout, so the agent calls it from a thread of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from typing import Any

from allocator.wire.interconnect import HostInterconnect
from allocator.wire.model_names import mig_parts
from nodeagent.interconnect_nvml import InterconnectReader
from nodeagent.inventory import (
    GPUSample,
    InventoryUnavailable,
    ProcessSample,
    SourceKind,
    XidEvent,
)

log = logging.getLogger(__name__)

MIB = 1024 * 1024

HINT = (
    "On a host without NVIDIA GPUs run the agent with "
    "`--inventory simulated --simulated-file FILE` (see nodeagent.simulated)."
)


def _load_pynvml() -> Any:
    try:
        import pynvml  # type: ignore[import-untyped]
    except ImportError as exc:  # the agent's optional dependency is missing
        raise InventoryUnavailable(
            f"the nvidia-ml-py package is not installed (pip install nvidia-ml-py). {HINT}"
        ) from exc
    return pynvml


ARCHITECTURES = {
    2: "kepler", 3: "maxwell", 4: "pascal", 5: "volta", 6: "turing", 7: "ampere", 8: "ada",
    9: "hopper", 10: "blackwell",
}
"""NVML's ``NVML_DEVICE_ARCH_*`` values as the names requests use (others: None)."""


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases return bytes, newer ones str.
    return value.decode() if isinstance(value, bytes) else value


def processes_of_mig_parent(listed: tuple[ProcessSample, ...] | None,
                            instances: list[GPUSample]) -> tuple[ProcessSample, ...] | None:
    """What a GPU in MIG mode reports as its own processes: those its listing shows that
    none of its MIG instances lists. NVML may list an instance's processes on the parent as
    well, and a lease container of an instance must not read as using the whole GPU. None
    (not known) when the parent's or any instance's listing failed."""
    if listed is None or any(instance.processes is None for instance in instances):
        return None
    on_instances = {proc.pid for instance in instances for proc in instance.processes or ()}
    return tuple(proc for proc in listed if proc.pid not in on_instances)


class NvmlSource:
    """An :class:`~nodeagent.inventory.InventorySource` over NVML."""

    kind: SourceKind = "nvml"

    def __init__(self) -> None:
        self._nvml = nvml = _load_pynvml()
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise InventoryUnavailable(
                f"NVML could not start ({exc}): no NVIDIA driver or library on this host? {HINT}"
            ) from exc
        self._lock = threading.Lock()
        self._closed = False
        self.driver_version: str | None = self._optional(nvml.nvmlSystemGetDriverVersion)
        if self.driver_version is not None:
            self.driver_version = _text(self.driver_version)
        self._identity: dict[int, GPUSample] = {}
        """index → the GPU's identity at its last good read, for lost GPUs."""
        self._mig_identity: dict[int, list[GPUSample]] = {}
        """index → its MIG instances at the last good read, reported lost with it."""
        self._event_set: Any = None
        self.xid_supported: dict[str, bool] = {}
        self._register_xid_events()
        self._interconnect: HostInterconnect | None = None
        self._interconnect_of: int | None = None
        """The number of GPUs NVML listed when the interconnect was read (None: not yet)."""

    # ------------------------------------------------------------------ helpers

    def _optional(self, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, or None where the GPU or driver does not support it."""
        nvml = self._nvml
        try:
            return fn(*args)
        except nvml.NVMLError_GpuIsLost:
            raise
        except (
            nvml.NVMLError_NotSupported,
            nvml.NVMLError_NoPermission,
            nvml.NVMLError_FunctionNotFound,
        ):
            return None
        except nvml.NVMLError as exc:
            log.debug("NVML %s failed: %s", getattr(fn, "__name__", fn), exc)
            return None

    def _register_xid_events(self) -> None:
        nvml = self._nvml
        try:
            self._event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.warning("NVML event set unavailable (%s): XIDs will not be watched", exc)
            return
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(nvml.nvmlDeviceGetUUID(handle))
                nvml.nvmlDeviceRegisterEvents(
                    handle, nvml.nvmlEventTypeXidCriticalError, self._event_set
                )
                self.xid_supported[uuid] = True
            except nvml.NVMLError as exc:
                # Not supported on some boards (and on any lost GPU): health then rests on
                # the other signals for that GPU.
                log.warning("GPU %d: XID events unavailable (%s)", index, exc)
                self.xid_supported[f"index-{index}"] = False

    # ------------------------------------------------------------------ InventorySource

    def read_gpus(self) -> list[GPUSample]:
        """Read every GPU (and the MIG instances of those in MIG mode) now."""
        nvml = self._nvml
        with self._lock:
            count = nvml.nvmlDeviceGetCount()
            samples: list[GPUSample] = []
            for index in range(count):
                samples.extend(self._read_one(index))
            return samples

    def _read_one(self, index: int) -> list[GPUSample]:
        """The GPU at ``index``, followed by its MIG instances when it is in MIG mode."""
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            name = _text(nvml.nvmlDeviceGetName(handle))
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            total_mib = int(memory.total // MIB)
            mig_mode = self._mig_mode(handle)
            capability = self._compute_capability(handle)
            architecture = self._architecture(handle)
            sample = GPUSample(
                uuid=uuid,
                index=index,
                model=name,
                memory_total_mib=total_mib,
                memory_used_mib=int(memory.used // MIB),
                utilization_pct=self._utilization(handle),
                temperature_c=self._optional(
                    nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU
                ),
                power_w=self._power(handle),
                energy_mj=self._energy(handle),
                ecc_uncorrected=self._optional(
                    nvml.nvmlDeviceGetTotalEccErrors,
                    handle,
                    nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                    nvml.NVML_VOLATILE_ECC,
                ),
                mig_mode=mig_mode,
                processes=self._processes(handle),
                compute_capability=capability,
                architecture=architecture,
                **self._memory_repair(handle),
            )
            instances = self._mig_instances(sample, handle) if mig_mode else []
            if instances:
                sample = dataclasses.replace(
                    sample, processes=processes_of_mig_parent(sample.processes, instances))
            self._identity[index] = sample
            self._mig_identity[index] = instances
            return [sample, *instances]
        except nvml.NVMLError_GpuIsLost:
            known = self._identity.get(index)
            if known is None:
                log.error("GPU %d is lost and was never read: cannot report it", index)
                return []
            log.error("GPU %d (%s) is lost", index, known.uuid)
            return [
                GPUSample(
                    uuid=gone.uuid, index=index, model=gone.model,
                    memory_total_mib=gone.memory_total_mib, mig_mode=gone.mig_mode,
                    compute_capability=gone.compute_capability,
                    architecture=gone.architecture, mig_parent_uuid=gone.mig_parent_uuid,
                    mig_profile=gone.mig_profile, mig_index=gone.mig_index, lost=True,
                    processes=None,  # nothing can be read off a lost GPU
                )
                for gone in (known, *self._mig_identity.get(index, []))
            ]

    def _mig_instances(self, parent: GPUSample, handle: Any) -> list[GPUSample]:
        """The MIG devices of a GPU in MIG mode (empty slots skipped)."""
        nvml = self._nvml
        slots = self._optional(nvml.nvmlDeviceGetMaxMigDeviceCount, handle) or 0
        instances = []
        for mig_index in range(int(slots)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig_index)
            except nvml.NVMLError_GpuIsLost:
                raise
            except nvml.NVMLError:
                continue  # NotFound: no MIG device in this slot
            try:
                uuid = _text(nvml.nvmlDeviceGetUUID(mig))
                name = _text(nvml.nvmlDeviceGetName(mig))
                memory = nvml.nvmlDeviceGetMemoryInfo(mig)
            except nvml.NVMLError_GpuIsLost:
                raise
            except nvml.NVMLError as exc:
                # Destroyed between the two calls (an admin re-partitions): next read.
                log.warning("GPU %d MIG device %d unreadable: %s", parent.index, mig_index, exc)
                continue
            instances.append(
                GPUSample(
                    uuid=uuid,
                    index=parent.index,
                    model=name,
                    memory_total_mib=int(memory.total // MIB),
                    memory_used_mib=int(memory.used // MIB),
                    processes=self._processes(mig),
                    compute_capability=parent.compute_capability,
                    architecture=parent.architecture,
                    mig_parent_uuid=parent.uuid,
                    mig_profile=self._profile(name, handle, mig),
                    mig_index=mig_index,
                )
            )
        return instances

    def _profile(self, name: str, parent: Any, mig: Any) -> str | None:
        """The MIG device's profile: from its NVML name, else from its GPU instance."""
        parts = mig_parts(name)
        return parts[1] if parts is not None else self._gpu_instance_profile(parent, mig)

    def _gpu_instance_profile(self, parent: Any, mig: Any) -> str | None:
        """The GPU instance profile's name (``1g.5gb``) through the instance's profile id."""
        nvml = self._nvml
        gpu_instance_id = self._optional(nvml.nvmlDeviceGetGpuInstanceId, mig)
        if gpu_instance_id is None:
            return None
        instance = self._optional(nvml.nvmlDeviceGetGpuInstanceById, parent, gpu_instance_id)
        info = None if instance is None else self._optional(nvml.nvmlGpuInstanceGetInfo, instance)
        if info is None:
            return None
        profile = self._optional(
            nvml.nvmlDeviceGetGpuInstanceProfileInfoById, parent, info.profileId
        )
        if profile is None:
            return None
        # The v2 structure's name reads "MIG 1g.5gb".
        text = _text(profile.name).strip()
        return text.removeprefix("MIG ").strip() or None

    def mig_report(self) -> list[dict[str, Any]]:
        """Per GPU, the raw MIG reads (read only): current and pending MIG mode, the number
        of MIG device slots, and each GPU instance profile the GPU supports with its memory,
        how many instances of it fit on an empty GPU and how many still fit now. For
        ``python -m nodeagent.nvml_check``; the agent itself reads only :meth:`read_gpus`."""
        nvml = self._nvml
        report = []
        with self._lock:
            for index in range(nvml.nvmlDeviceGetCount()):
                entry: dict[str, Any] = {"index": index}
                try:
                    handle = nvml.nvmlDeviceGetHandleByIndex(index)
                    entry["uuid"] = _text(nvml.nvmlDeviceGetUUID(handle))
                    modes = self._optional(nvml.nvmlDeviceGetMigMode, handle)
                    entry["mig_mode_current"] = None if modes is None else int(modes[0])
                    entry["mig_mode_pending"] = None if modes is None else int(modes[1])
                    entry["compute_capability"] = self._compute_capability(handle)
                    entry["architecture_raw"] = self._optional(
                        nvml.nvmlDeviceGetArchitecture, handle)
                    entry["architecture"] = self._architecture(handle)
                    if modes is not None and modes[0] == nvml.NVML_DEVICE_MIG_ENABLE:
                        entry["max_mig_devices"] = self._optional(
                            nvml.nvmlDeviceGetMaxMigDeviceCount, handle)
                        entry["gpu_instance_profiles"] = self._profiles(handle)
                except nvml.NVMLError as exc:
                    entry["error"] = str(exc)
                report.append(entry)
        return report

    def _profiles(self, handle: Any) -> list[dict[str, Any]]:
        nvml = self._nvml
        profiles = []
        for profile in range(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
            info = self._optional(nvml.nvmlDeviceGetGpuInstanceProfileInfo, handle, profile)
            if info is None:
                continue  # this profile does not exist on this GPU
            profiles.append({
                "profile": profile,
                "id": int(info.id),
                "name": _text(info.name),
                "memory_mib": int(info.memorySizeMB),
                "slices": int(info.sliceCount),
                "instances_max": int(info.instanceCount),
                "instances_free": self._optional(
                    nvml.nvmlDeviceGetGpuInstanceRemainingCapacity, handle, int(info.id)),
            })
        return profiles

    def _compute_capability(self, handle: Any) -> str | None:
        capability = self._optional(self._nvml.nvmlDeviceGetCudaComputeCapability, handle)
        if capability is None:
            return None
        major, minor = capability
        return f"{int(major)}.{int(minor)}"

    def _architecture(self, handle: Any) -> str | None:
        value = self._optional(self._nvml.nvmlDeviceGetArchitecture, handle)
        return None if value is None else ARCHITECTURES.get(int(value))

    def _utilization(self, handle: Any) -> float | None:
        rates = self._optional(self._nvml.nvmlDeviceGetUtilizationRates, handle)
        return None if rates is None else float(rates.gpu)

    def _power(self, handle: Any) -> float | None:
        milliwatts = self._optional(self._nvml.nvmlDeviceGetPowerUsage, handle)
        return None if milliwatts is None else milliwatts / 1000.0

    def _energy(self, handle: Any) -> int | None:
        millijoules = self._optional(self._nvml.nvmlDeviceGetTotalEnergyConsumption, handle)
        return None if millijoules is None else int(millijoules)

    def _mig_mode(self, handle: Any) -> bool | None:
        modes = self._optional(self._nvml.nvmlDeviceGetMigMode, handle)
        return None if modes is None else modes[0] == self._nvml.NVML_DEVICE_MIG_ENABLE

    def _memory_repair(self, handle: Any) -> dict[str, Any]:
        """Remapped rows (Ampere+) or else retired pages (older boards)."""
        nvml = self._nvml
        rows = self._optional(nvml.nvmlDeviceGetRemappedRows, handle)
        if rows is not None:
            corrected, uncorrected, pending, failed = rows
            return {
                "retired_pages": int(corrected) + int(uncorrected),
                "remap_pending": bool(pending),
                "remap_failed": bool(failed),
            }
        total = None
        for cause in (
            nvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            nvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        ):
            pages = self._optional(nvml.nvmlDeviceGetRetiredPages, handle, cause)
            if pages is not None:
                total = (total or 0) + len(pages)
        pending_status = self._optional(nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
        return {
            "retired_pages": total,
            "remap_pending": None if pending_status is None else bool(pending_status),
            "remap_failed": None,
        }

    def _processes(self, handle: Any) -> tuple[ProcessSample, ...] | None:
        """Every process on a GPU or MIG device: the compute ones and the graphics ones, one
        entry per pid (a process with both kinds of context is listed by both calls, with
        the same memory; the larger reading is kept). None when a listing failed: the
        compute one for any reason, the graphics one for any but ``NotSupported`` or
        ``FunctionNotFound`` (a board or driver without graphics contexts has none)."""
        nvml = self._nvml
        memory: dict[int, int | None] = {}
        for call, optional in ((nvml.nvmlDeviceGetComputeRunningProcesses, False),
                               (nvml.nvmlDeviceGetGraphicsRunningProcesses, True)):
            try:
                listed = call(handle)
            except nvml.NVMLError_GpuIsLost:
                raise
            except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound) as exc:
                if optional:
                    continue
                log.debug("NVML %s failed: %s", call.__name__, exc)
                return None
            except nvml.NVMLError as exc:
                log.debug("NVML %s failed: %s", call.__name__, exc)
                return None
            for proc in listed:
                used = proc.usedGpuMemory  # None when the driver does not say
                mib = None if used is None else int(used // MIB)
                pid = int(proc.pid)
                known = memory.get(pid)
                memory[pid] = mib if known is None else max(known, mib or 0)
        util_by_pid: dict[int, tuple[float, float]] = {}
        # Per-process SM and memory utilisation over the last few seconds (the newest sample
        # of each pid); unsupported on many boards and on MIG devices.
        since_us = int((time.time() - 10) * 1_000_000)
        for sample in self._optional(nvml.nvmlDeviceGetProcessUtilization, handle, since_us) or []:
            util_by_pid[int(sample.pid)] = (float(sample.smUtil), float(sample.memUtil))
        result = []
        for pid, used_mib in memory.items():
            util = util_by_pid.get(pid)
            result.append(
                ProcessSample(
                    pid=pid,
                    used_memory_mib=used_mib,
                    utilization_pct=None if util is None else min(100.0, max(0.0, util[0])),
                    memory_utilization_pct=(None if util is None
                                            else min(100.0, max(0.0, util[1]))),
                )
            )
        return tuple(result)

    def read_interconnect(self) -> HostInterconnect | None:
        """How the GPUs are joined (:mod:`nodeagent.interconnect_nvml`): read at the first
        call and again only when NVML lists another number of GPUs; None where it cannot
        be read."""
        nvml = self._nvml
        with self._lock:
            count = int(nvml.nvmlDeviceGetCount())
            if count != self._interconnect_of:
                self._interconnect = InterconnectReader(nvml).read()
                self._interconnect_of = count
            return self._interconnect

    def wait_xids(self, timeout_s: float) -> list[XidEvent]:
        """Block in ``nvmlEventSetWait_v2`` for at most ``timeout_s``; XIDs that arrived."""
        nvml = self._nvml
        if self._event_set is None or self._closed:
            time.sleep(timeout_s)  # nothing to wait on; keep the caller's loop at its pace
            return []
        events: list[XidEvent] = []
        timeout_ms = max(1, int(timeout_s * 1000))
        while True:
            try:
                data = nvml.nvmlEventSetWait_v2(self._event_set, timeout_ms)
            except nvml.NVMLError_Timeout:
                return events
            except nvml.NVMLError as exc:
                log.warning("NVML event wait failed: %s", exc)
                time.sleep(min(timeout_s, 1.0))
                return events
            if data.eventType & nvml.nvmlEventTypeXidCriticalError:
                try:
                    uuid = _text(nvml.nvmlDeviceGetUUID(data.device))
                except nvml.NVMLError:
                    uuid = "unknown"
                events.append(XidEvent(gpu_uuid=uuid, xid=int(data.eventData), at=time.time()))
            timeout_ms = 1  # drain whatever else is queued, then return

    def close(self) -> None:
        """Free the event set and shut NVML down. Idempotent."""
        nvml = self._nvml
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._event_set is not None:
                with contextlib.suppress(nvml.NVMLError):
                    nvml.nvmlEventSetFree(self._event_set)
                self._event_set = None
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlShutdown()
