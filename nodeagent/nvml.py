"""The real inventory source: the host's NVIDIA GPUs through NVML (``nvidia-ml-py``).

Written against the real library; on a machine without the NVIDIA driver
:class:`NvmlSource` raises :class:`~nodeagent.inventory.InventoryUnavailable` at once with a
message that points at ``--inventory simulated``. ``python -m nodeagent.nvml_check`` prints
everything read here, for checking on a real GPU machine.

What is read per GPU, each field on its own so one unsupported query (``NotSupported`` on
consumer cards, ``NoPermission`` in some containers) costs that field only (None):
UUID, index, name, memory total/used, utilization, temperature, power, volatile uncorrected
ECC count, retired pages (before Ampere) or remapped rows (Ampere and later), MIG mode and
the running compute processes. A GPU whose queries raise ``GpuIsLost`` is reported *lost*
under the identity it had at its last good read.

XIDs come from an NVML event set registered for ``nvmlEventTypeXidCriticalError`` on every
GPU that supports it; :meth:`NvmlSource.wait_xids` blocks in ``nvmlEventSetWait_v2`` for at
most its timeout, so the agent calls it from a thread of its own.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

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


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases return bytes, newer ones str.
    return value.decode() if isinstance(value, bytes) else value


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
        self._identity: dict[int, tuple[str, str, int]] = {}
        """index → (uuid, name, memory MiB) at the last good read, for lost GPUs."""
        self._event_set: Any = None
        self.xid_supported: dict[str, bool] = {}
        self._register_xid_events()

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
        """Read every GPU now."""
        nvml = self._nvml
        with self._lock:
            count = nvml.nvmlDeviceGetCount()
            samples = []
            for index in range(count):
                sample = self._read_one(index)
                if sample is not None:
                    samples.append(sample)
            return samples

    def _read_one(self, index: int) -> GPUSample | None:
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            name = _text(nvml.nvmlDeviceGetName(handle))
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            total_mib = int(memory.total // MIB)
            self._identity[index] = (uuid, name, total_mib)
            return GPUSample(
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
                ecc_uncorrected=self._optional(
                    nvml.nvmlDeviceGetTotalEccErrors,
                    handle,
                    nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                    nvml.NVML_VOLATILE_ECC,
                ),
                mig_mode=self._mig_mode(handle),
                processes=self._processes(handle),
                **self._memory_repair(handle),
            )
        except nvml.NVMLError_GpuIsLost:
            known = self._identity.get(index)
            if known is None:
                log.error("GPU %d is lost and was never read: cannot report it", index)
                return None
            uuid, name, total_mib = known
            log.error("GPU %d (%s) is lost", index, uuid)
            return GPUSample(
                uuid=uuid, index=index, model=name, memory_total_mib=total_mib, lost=True
            )

    def _utilization(self, handle: Any) -> float | None:
        rates = self._optional(self._nvml.nvmlDeviceGetUtilizationRates, handle)
        return None if rates is None else float(rates.gpu)

    def _power(self, handle: Any) -> float | None:
        milliwatts = self._optional(self._nvml.nvmlDeviceGetPowerUsage, handle)
        return None if milliwatts is None else milliwatts / 1000.0

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

    def _processes(self, handle: Any) -> tuple[ProcessSample, ...]:
        nvml = self._nvml
        procs = self._optional(nvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
        util_by_pid: dict[int, float] = {}
        # Per-process SM utilisation over the last few seconds; unsupported on many boards.
        since_us = int((time.time() - 10) * 1_000_000)
        for sample in self._optional(nvml.nvmlDeviceGetProcessUtilization, handle, since_us) or []:
            util_by_pid[int(sample.pid)] = float(sample.smUtil)
        result = []
        for proc in procs:
            used = proc.usedGpuMemory  # None when the driver does not say
            util = util_by_pid.get(int(proc.pid))
            result.append(
                ProcessSample(
                    pid=int(proc.pid),
                    used_memory_mib=None if used is None else int(used // MIB),
                    utilization_pct=None if util is None else min(100.0, max(0.0, util)),
                )
            )
        return tuple(result)

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
