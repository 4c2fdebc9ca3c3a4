"""Where a host's GPUs come from: the :class:`InventorySource` protocol and its samples.

Two sources implement it: :class:`nodeagent.nvml.NvmlSource` (the real GPUs) and
:class:`nodeagent.simulated.SimulatedSource` (a JSON file, for hosts without GPUs).
Everything above a source — health, heartbeats, container mapping — is the same code.

Both methods block (NVML calls are synchronous C calls), so the agent runs them in threads:
``read_gpus`` through :func:`asyncio.to_thread` under a timeout, ``wait_xids`` in a thread
of its own that loops until the agent stops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from allocator.wire.interconnect import HostInterconnect

SourceKind = Literal["nvml", "simulated"]

class InventoryUnavailable(RuntimeError):
    """The source cannot work at all on this host (no NVML library, no driver, no file).

    Raised at start, with a message a person can act on; the agent exits with it.
    """


@dataclass(frozen=True)
class ProcessSample:
    """One process that uses a GPU, as the driver reports it (host PID namespace)."""

    pid: int
    used_memory_mib: int | None = None
    """None when the driver does not say (e.g. without the right permissions)."""
    utilization_pct: float | None = None
    """Its SM utilization, % of the GPU, over NVML's last sampling period; None: not known."""
    container_id: str | None = None
    """The container the source itself says it runs in (the simulated inventory's
    ``container_id``), taken over the cgroup lookup; None: look it up."""
    name: str | None = None
    """The command name the source itself gives it; None: read ``/proc/<pid>/comm``."""
    memory_utilization_pct: float | None = None
    """Its memory (bandwidth) utilization, % of the GPU; None: not known."""


@dataclass(frozen=True)
class GPUSample:
    """One reading of one GPU. Fields a GPU does not support are None.

    A *lost* GPU (NVML: ``GpuIsLost``) keeps the identity it had when it was last read, so
    the allocator can tell which GPU went missing.
    """

    uuid: str
    index: int
    model: str
    memory_total_mib: int
    memory_used_mib: int = 0
    utilization_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    energy_mj: int | None = None
    """The GPU's total energy counter, millijoules since the driver loaded (NVML's
    ``nvmlDeviceGetTotalEnergyConsumption``; Volta and later); None where it has none. Not
    set on a MIG instance: its energy is its parent's."""
    ecc_uncorrected: int | None = None
    """Volatile (since the driver loaded) uncorrected ECC errors."""
    retired_pages: int | None = None
    """Retired pages (before Ampere) or remapped rows (Ampere and later)."""
    remap_pending: bool | None = None
    """A page retirement or row remap waits for a GPU reset to take effect."""
    remap_failed: bool | None = None
    """Row remapping failed: the memory cannot be repaired in the field."""
    mig_mode: bool | None = None
    """True for a GPU in MIG mode: it is never offered whole, its instances are."""
    lost: bool = False
    processes: tuple[ProcessSample, ...] | None = field(default_factory=tuple)
    """Every process using it (compute and graphics, one entry per pid); None when the
    driver's process listing failed, so what runs on it is not known (which is not "none")."""
    compute_capability: str | None = None
    """CUDA compute capability, ``"major.minor"`` (``"8.0"`` for an A100)."""
    architecture: str | None = None
    """NVML's architecture in lower case (``"ampere"``, ``"pascal"``)."""
    mig_parent_uuid: str | None = None
    """Set on a MIG instance: the uuid of the GPU it is carved out of. An instance's
    ``index`` is its parent's; ``mig_index`` tells the instances of one GPU apart."""
    mig_profile: str | None = None
    """A MIG instance's GPU instance profile (``1g.5gb``)."""
    mig_index: int | None = None
    """A MIG instance's index among its parent's MIG devices."""

    @property
    def is_mig_instance(self) -> bool:
        """Whether this sample is a MIG instance rather than a physical GPU."""
        return self.mig_parent_uuid is not None


@dataclass(frozen=True)
class XidEvent:
    """A critical XID error the driver reported for one GPU."""

    gpu_uuid: str
    xid: int
    at: float
    """Epoch seconds when the agent received it."""


@runtime_checkable
class InventorySource(Protocol):
    """A source of GPU samples and XID events. Implementations are thread-safe:
    ``read_gpus`` and ``wait_xids`` are called from different threads at the same time."""

    kind: SourceKind
    """Reported in heartbeats (``source``), so a simulated host is never mistaken for a real one."""

    def read_gpus(self) -> list[GPUSample]:
        """Read every GPU of the host now. Blocks; raises only if the source itself broke."""
        ...

    def wait_xids(self, timeout_s: float) -> list[XidEvent]:
        """Wait at most ``timeout_s`` for XID events and return those that arrived (maybe none)."""
        ...

    def read_interconnect(self) -> HostInterconnect | None:
        """How the host's GPUs (not MIG instances) are joined: each pair's link, each GPU's
        NUMA node and CPUs; None where the source cannot tell. Blocks; cheap after the first
        call (the links of a host do not change while it runs)."""
        ...

    def close(self) -> None:
        """Release what the source holds (NVML handles, event sets). Idempotent."""
        ...
