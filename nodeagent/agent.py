"""The node agent: reads GPUs, judges health, watches lease containers, publishes.

One :class:`NodeAgent` runs per GPU host. Its parts run side by side:

- the **heartbeat loop** (every ``interval_s``, or at once after a fatal XID or a Docker
  resync, or a lease container's death): reads the inventory in a thread (bounded by
  ``inventory_timeout_s``), evaluates health, maps GPU processes to containers (the lease
  containers' use; with ``gpu_processes``, every process on each GPU:
  :mod:`nodeagent.gpu_processes`), and publishes a heartbeat: in full at least every
  ``full_report_s`` and after an allocator's hello, else as a delta of what changed
  (:mod:`allocator.wire.heartbeat_delta`); to an allocator that reads it, the host's interconnect
  (how its GPUs are joined) in the first full report after its hello and in the full report
  after any change of it, never in a delta;
- the **Docker watcher** (:mod:`nodeagent.containers`): every start/die/oom/destroy of a lease
  container becomes a :class:`~allocator.wire.protocol.ContainerEvent` at once;
- the **XID thread**: blocks in the inventory source's ``wait_xids`` (NVML's event wait is a
  blocking C call) and hands XIDs to the loop;
- the **publisher** (:mod:`nodeagent.publisher`): bounded publishes, buffered events;
- the **command consumer** (:mod:`nodeagent.commands`): stops a lease container at once when
  the allocator asks (the hub released its lease), through the Docker watcher's client, and
  hands over the allocator's hello (what it reads: whether to report GPU processes);
- with ``pin_cpus``, the **CPU pinner** (:mod:`nodeagent.cpu_pinning`): pins each lease
  container to the CPUs near its GPUs at its start event, and, from the heartbeat loop, the
  running ones not pinned yet (those running when the agent started, or started while the
  event stream was down, or in listing mode), once the interconnect (read for it whether the
  allocator reads it or not) and the MIG instances' parents are known.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import ValidationError

from allocator.metrics.endpoint import MetricsServer, ProcessHealth
from allocator.tasks import cancel_and_wait
from allocator.wire.heartbeat_delta import Thresholds, apply_delta, delta_between
from allocator.wire.interconnect import HostInterconnect
from allocator.wire.protocol import (
    GPU_PROCESSES,
    INTERCONNECT,
    LEASE_USAGE,
    AllocatorHello,
    ContainerAction,
    ContainerEvent,
    ContainerInfo,
    GPUInfo,
    Health,
    Heartbeat,
    HeartbeatDelta,
    ProcessUse,
)
from nodeagent.cgroups import CgroupReader
from nodeagent.commands import CommandConsumer
from nodeagent.config import AgentSettings, resolve_host
from nodeagent.containers import ContainerChange, ContainerWatcher, LeaseContainer
from nodeagent.cpu_pinning import CpuPinner
from nodeagent.gpu_processes import (
    ContainerDetails,
    GPUProcesses,
    gpu_processes,
    other_containers,
)
from nodeagent.health import HealthRules, HealthTracker, Verdict
from nodeagent.inventory import GPUSample, InventorySource, XidEvent
from nodeagent.metrics import AgentMetrics, serve
from nodeagent.mig import MigLayout, inherit_parent_health
from nodeagent.publisher import Publisher
from nodeagent.simulated import SimulatedLeaseUse, SimulatedSource
from nodeagent.usage import GpuUse, Holder, UsageMeter, use_by_container

log = logging.getLogger(__name__)

DETAILS_WAIT_S = 1.0
"""The most a heartbeat waits for Docker to name the containers that use a GPU without a
lease. A lookup still running then goes on (bounded by ``docker_timeout_s``) and its answer
is in the next heartbeat; this one lists the container without its name and image."""

DETAILS_RETRY_S = 30.0
"""After a lookup failed (the engine down or slow), how long before that container is asked
about again: a heartbeat must not wait on an engine that does not answer, every time."""


def open_source(settings: AgentSettings, host: str) -> InventorySource:
    """The inventory source the settings ask for. Raises
    :class:`~nodeagent.inventory.InventoryUnavailable` with an actionable message."""
    if settings.inventory == "simulated":
        from nodeagent.simulated import SimulatedSource

        assert settings.simulated_file is not None  # checked by the settings
        return SimulatedSource(settings.simulated_file, host)
    from nodeagent.nvml import NvmlSource

    return NvmlSource()


def health_rules_of(settings: AgentSettings) -> HealthRules:
    """The health rules part of the settings."""
    return HealthRules(
        fatal_xids=frozenset(settings.fatal_xids),
        xid_quiet_s=settings.xid_quiet_s,
        xid_repeat_count=settings.xid_repeat_count,
        xid_repeat_window_s=settings.xid_repeat_window_s,
        recent_xid_s=settings.recent_xid_s,
        overheat_c=settings.overheat_c,
        overheat_hysteresis_c=settings.overheat_hysteresis_c,
        ecc_stable_s=settings.ecc_stable_s,
    )


def _within(value: float | None, low: float, high: float) -> float | None:
    # A reading outside the protocol's range is a driver glitch, not a fact: drop it
    # rather than fail the whole heartbeat.
    if value is None or not low <= value <= high:
        return None
    return float(value)


def gpu_info(sample: GPUSample, verdict: Verdict,
             processes: GPUProcesses | None = None) -> GPUInfo:
    """One GPU of a heartbeat from its sample and health verdict, with its processes when
    they are reported (None: not reported, or not known)."""
    return GPUInfo(
        uuid=sample.uuid,
        index=sample.index,
        model=sample.model,
        memory_total_mib=max(0, sample.memory_total_mib),
        memory_used_mib=max(0, sample.memory_used_mib),
        utilization_pct=_within(sample.utilization_pct, 0, 100),
        temperature_c=_within(sample.temperature_c, -100, 300),
        power_w=_within(sample.power_w, 0, 10_000),
        ecc_uncorrected=sample.ecc_uncorrected,
        retired_pages=sample.retired_pages,
        mig_mode=sample.mig_mode,
        recent_xids=list(verdict.recent_xids),
        health=verdict.health,
        health_reasons=list(verdict.reasons),
        compute_capability=sample.compute_capability,
        architecture=sample.architecture,
        mig_parent_uuid=sample.mig_parent_uuid,
        mig_profile=sample.mig_profile,
        mig_index=sample.mig_index,
        processes=None if processes is None else processes.processes,
        processes_omitted=0 if processes is None else processes.omitted,
    )


def gpu_use_by_container(
    samples: list[GPUSample], pid_containers: dict[int, str]
) -> dict[str, list[ProcessUse]]:
    """Per container id: memory (and utilization, where known) its processes use per GPU."""
    totals: dict[tuple[str, str], list[float | None]] = {}
    for sample in samples:
        for proc in sample.processes or ():
            container_id = pid_containers.get(proc.pid)
            if container_id is None:
                continue
            entry = totals.setdefault((container_id, sample.uuid), [0, None])
            entry[0] = (entry[0] or 0) + (proc.used_memory_mib or 0)
            if proc.utilization_pct is not None:
                entry[1] = min(100.0, (entry[1] or 0.0) + proc.utilization_pct)
    result: dict[str, list[ProcessUse]] = {}
    for (container_id, gpu_uuid), (memory, util) in sorted(totals.items()):
        result.setdefault(container_id, []).append(
            ProcessUse(gpu_uuid=gpu_uuid, memory_used_mib=int(memory or 0), utilization_pct=util)
        )
    return result


def simulated_use(running: Sequence[LeaseContainer], lease_use: Mapping[str, SimulatedLeaseUse],
                  host_gpu_uuids: Sequence[str]) -> dict[str, list[ProcessUse]]:
    """Per container id: the use a simulated inventory sets for its lease (see
    :mod:`nodeagent.simulated`), on each GPU of its grant (without one: of the host)."""
    result: dict[str, list[ProcessUse]] = {}
    for container in running:
        use = lease_use.get(container.lease_id)
        if use is None:
            continue
        gpu_uuids = container.grant.gpu_uuids if container.grant else host_gpu_uuids
        result[container.container_id] = [
            ProcessUse(gpu_uuid=uuid, memory_used_mib=use.memory_used_mib,
                       utilization_pct=use.utilization_pct) for uuid in gpu_uuids]
    return result


def simulated_gpu_use(running: Sequence[LeaseContainer],
                      lease_use: Mapping[str, SimulatedLeaseUse],
                      host_gpu_uuids: Sequence[str]) -> dict[str, dict[str, GpuUse]]:
    """Per container id, per GPU uuid: the use a simulated inventory sets for its lease, as
    the usage meter counts it (see :func:`simulated_use`)."""
    result: dict[str, dict[str, GpuUse]] = {}
    for container in running:
        use = lease_use.get(container.lease_id)
        if use is None:
            continue
        gpu_uuids = container.grant.gpu_uuids if container.grant else host_gpu_uuids
        result[container.container_id] = {
            uuid: GpuUse(sm_pct=use.utilization_pct, memory_pct=use.memory_utilization_pct,
                         memory_mib=use.memory_used_mib) for uuid in gpu_uuids}
    return result


def holders_of(running: Sequence[LeaseContainer], measured: Mapping[str, Mapping[str, GpuUse]]
               ) -> list[Holder]:
    """The running lease containers and the GPUs each holds: its grant's, or without one
    those it was measured on."""
    return [Holder(c.container_id, tuple(c.grant.gpu_uuids) if c.grant
                   else tuple(sorted(measured.get(c.container_id, {}))),
                   tuple(c.grant.groups) if c.grant else ())
            for c in running]


def held_gpu_uuids(running: list[LeaseContainer]) -> set[str]:
    """GPU (and MIG instance) uuids the running lease containers hold, from their grants."""
    return {uuid for c in running if c.grant is not None for uuid in c.grant.gpu_uuids}


@dataclass(frozen=True)
class _Snapshot:
    """What one inventory read in the worker thread produced."""

    samples: list[GPUSample]
    pid_containers: dict[int, str]
    """The container of each listed pid that runs in one (the source's word, else its
    cgroup)."""
    command_names: dict[int, str]
    """The command name of each listed pid (read only while processes are reported)."""
    interconnect: HostInterconnect | None = None
    """How the GPUs are joined, as the source says (read only while it is reported)."""
    interconnect_read: bool = False
    """Whether ``interconnect`` was read (else it says nothing)."""


class NodeAgent:
    """The node agent of one host. ``await start()``, later ``await stop()``."""

    def __init__(self, settings: AgentSettings, *, source: InventorySource | None = None) -> None:
        self.settings = settings
        self.agent_id = uuid.uuid4().hex
        """Changes with every start of the process, so the allocator sees restarts."""
        self.host: str = settings.host or ""
        self.seq = 0
        self.tracker = HealthTracker(health_rules_of(settings))
        self.cgroups = CgroupReader(settings.proc_root)
        self.source: InventorySource | None = source
        self.publisher: Publisher | None = None
        self.watcher: ContainerWatcher | None = None
        self.commands: CommandConsumer | None = None
        self.last_heartbeat: Heartbeat | None = None
        """The newest heartbeat built, whole (what was sent may be a delta of it)."""
        self.last_message: Heartbeat | HeartbeatDelta | None = None
        """The newest heartbeat or delta published."""
        self.deltas_sent = 0
        self.thresholds = Thresholds(
            utilization_pct=settings.delta_utilization_pct, memory_mib=settings.delta_memory_mib,
            temperature_c=settings.delta_temperature_c, power_w=settings.delta_power_w)
        self._reported: Heartbeat | None = None
        """The report the allocator holds if it got everything published: the last full
        heartbeat with every delta since applied. None after a failed publish (then the next
        heartbeat is full)."""
        self._full_sent_at: float | None = None
        """Monotonic time of the last full heartbeat published."""
        self.xids_received = 0
        self._last_samples: list[GPUSample] | None = None
        self._pending_read: asyncio.Future[_Snapshot] | None = None
        self._health: dict[str, Health] = {}
        self.usage = UsageMeter(max_gap_s=3 * settings.interval_s)
        """Each running lease container's use, counted at every heartbeat (see
        nodeagent.usage); reported once the allocator reads it."""
        self.mig_layout = MigLayout()
        """Keeps held MIG instances reported through a re-partition (see nodeagent.mig)."""
        self._wake = asyncio.Event()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._xid_thread: threading.Thread | None = None
        self._xid_stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self.metrics = AgentMetrics(settings.inventory)
        """Latencies and failures as they happen; the rest is read at scrape time."""
        self.metrics_server: MetricsServer | None = None
        self.health = ProcessHealth(settings.health_stale_s)
        """What ``/healthz`` answers (with the metrics): the event loop ran within
        ``health_stale_s``, the heartbeat loop within ``interval_s`` more, and the broker
        connection is up."""
        self.health.add("heartbeat loop", self._heartbeat_loop_problem)
        self.health.add("broker connection", self._broker_problem)
        self._health_task: asyncio.Task[None] | None = None
        self._round_started_at = time.monotonic()
        """When the heartbeat loop last began a round (monotonic), or the agent started."""
        self.allocator_reads: frozenset[str] | None = None
        """What the newest allocator hello said the allocator reads; None: no hello yet."""
        self._full_due = False
        """A hello came: the next heartbeat built from then on goes out in full."""
        self._details: dict[str, ContainerDetails] = {}
        """Name and image of the containers (not lease containers) that use a GPU now."""
        self._details_failed: dict[str, float] = {}
        """Container id -> when its lookup failed (monotonic), retried after DETAILS_RETRY_S."""
        self._describing: dict[str, asyncio.Task[None]] = {}
        """Container id -> its Docker lookup under way."""
        self.interconnect: HostInterconnect | None = None
        """How the host's GPUs are joined, as last read (only while it is reported)."""
        self.interconnect_sent: HostInterconnect | None = None
        """The interconnect of the last full report published since the newest hello; None:
        none yet, so the next full report carries it."""
        self.pinner: CpuPinner | None = None
        """Pins lease containers to their GPUs' CPUs (``pin_cpus``); None when off."""
        self._pinning_ready = False
        """An inventory read gave the interconnect and the MIG instances' parents: pinning
        may start (a container seen before waits for that heartbeat)."""
        self._mig_parents: dict[str, str] = {}
        """MIG instance uuid -> its parent GPU's uuid, as last read."""

    # ------------------------------------------------------------------ counters

    @property
    def heartbeats_sent(self) -> int:
        """Heartbeats the broker confirmed."""
        return self.publisher.heartbeats_sent if self.publisher else 0

    @property
    def publish_failures(self) -> int:
        """Failed publishes (heartbeats and event attempts; events are retried)."""
        if self.publisher is None:
            return 0
        return self.publisher.heartbeat_failures + self.publisher.event_failures

    @property
    def events_forwarded(self) -> int:
        """Container events the broker confirmed."""
        return self.publisher.events_sent if self.publisher else 0

    @property
    def events_dropped(self) -> int:
        """Container events lost to a full buffer."""
        return self.publisher.events_dropped if self.publisher else 0

    @property
    def reports_processes(self) -> bool:
        """Whether heartbeats list each GPU's processes now (``gpu_processes``: always, never,
        or once the newest allocator hello said the allocator reads them)."""
        mode = self.settings.gpu_processes
        if mode == "auto":
            return self.allocator_reads is not None and GPU_PROCESSES in self.allocator_reads
        return mode == "on"

    @property
    def reports_usage(self) -> bool:
        """Whether containers carry their usage (``ContainerInfo.usage``): once the newest
        allocator hello said the allocator reads it (an older allocator refuses the field)."""
        return self.allocator_reads is not None and LEASE_USAGE in self.allocator_reads

    @property
    def reports_interconnect(self) -> bool:
        """Whether full reports carry the host's interconnect: once the newest allocator
        hello said the allocator reads it (an older allocator refuses the field)."""
        return self.allocator_reads is not None and INTERCONNECT in self.allocator_reads

    @property
    def command_counters(self) -> Counter[str]:
        """The command consumer's counters (see :class:`~nodeagent.commands.CommandConsumer`)."""
        return self.commands.counters if self.commands else Counter()

    @property
    def docker_reconnects(self) -> int:
        """Times the Docker event stream was re-established."""
        return self.watcher.reconnects if self.watcher else 0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Resolve the host name, open the inventory, connect, and start every loop.

        Raises :class:`~nodeagent.inventory.InventoryUnavailable` if the inventory cannot
        work here; a broker or Docker engine that is down is not fatal (retried).
        """
        settings = self.settings
        self._loop = asyncio.get_running_loop()
        self._round_started_at = time.monotonic()
        if self._health_task is None:
            self._health_task = asyncio.create_task(self.health.watch_loop(), name="health")
        if settings.docker:
            self.watcher = ContainerWatcher(
                settings.docker_url,
                on_change=self._on_container_change,
                on_resync=self.wake,
                timeout_s=settings.docker_timeout_s,
                backoff_s=settings.docker_backoff_s,
                backoff_max_s=settings.docker_backoff_max_s,
                replay_grace_s=settings.docker_replay_grace_s,
                liveness_s=settings.docker_liveness_s,
                events=settings.docker_events,
                on_call=self.metrics.observe_docker_call,
            )
        if settings.pin_cpus:
            if self.watcher is None:
                log.warning("pin_cpus is on but docker is off: no container is pinned")
            else:
                self.pinner = CpuPinner(self.watcher.update_cpuset)
        engine_name = None
        if settings.host is None and self.watcher is not None:
            engine_name = await self.watcher.engine_name()
        self.host = resolve_host(settings, engine_name)
        if self.source is None:
            self.source = await asyncio.to_thread(open_source, settings, self.host)
        if settings.metrics_port and self.metrics_server is None:
            self.metrics_server = serve(self, self.metrics, settings.metrics_port,
                                        settings.metrics_addr, settings.metrics_token,
                                        self.health)
        self.publisher = Publisher(
            settings.amqp_url,
            self.host,
            timeout_s=settings.publish_timeout_s,
            reconnect_s=settings.amqp_reconnect_s,
            buffer_size=settings.event_buffer,
        )
        log.info("agent %s for host %r: inventory %s, heartbeat every %gs, docker %s",
                 self.agent_id[:8], self.host, self.source.kind, settings.interval_s,
                 (settings.docker_url + ("" if settings.docker_events else " (listing only, "
                                         "no events)")) if settings.docker else "off")
        await self.publisher.start()
        if self.watcher is not None:
            await self.watcher.start()
            await self.watcher.wait_first_listing(settings.docker_timeout_s)
        await self._start_commands()
        self._xid_stop.clear()
        self._xid_thread = threading.Thread(
            target=self._xid_worker, name="nodeagent-xid", daemon=True
        )
        self._xid_thread.start()
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeats")
        self._started = True

    async def _start_commands(self) -> None:
        settings = self.settings
        if not settings.stop_commands:
            return
        if self.watcher is None:
            log.warning("stop commands are on but docker is off: the allocator's stop "
                        "commands are not consumed")
            return
        try:
            self.commands = CommandConsumer(
                settings.amqp_url, self.host, self.watcher.stop_lease_container,
                command_users=settings.command_users, timeout_s=settings.publish_timeout_s,
                reconnect_s=settings.amqp_reconnect_s, check_s=settings.command_check_s,
                on_hello=self._on_hello)
        except ValueError as exc:
            log.error("stop commands off: %s", exc)
            return
        await self.commands.start()

    async def stop(self) -> None:
        """Stop every loop, send what is buffered (bounded), and close everything."""
        if self.commands is not None:
            await self.commands.stop()
        await cancel_and_wait([self._heartbeat_task, self._health_task,
                               *self._describing.values()])
        self._heartbeat_task = self._health_task = None
        self._describing.clear()
        if self.pinner is not None:
            await self.pinner.stop()
        if self.watcher is not None:
            await self.watcher.stop()
        self._xid_stop.set()
        # The simulated source's close() wakes its waiter at once; NVML's wait ends within
        # xid_poll_s, and its event set must not be freed while the thread waits on it.
        if self.source is not None and self.source.kind == "simulated":
            self.source.close()
        xid_thread_alive = False
        if self._xid_thread is not None:
            await asyncio.to_thread(self._xid_thread.join, self.settings.xid_poll_s + 5)
            xid_thread_alive = self._xid_thread.is_alive()
            self._xid_thread = None
        if self.source is not None:
            if xid_thread_alive:
                # Freeing NVML's event set under a thread still waiting on it could crash
                # the process; the process is ending anyway, so leave it to the OS.
                log.warning("XID thread did not end; not closing the inventory source")
            else:
                self.source.close()
        if self.publisher is not None:
            await self.publisher.stop()
        if self.metrics_server is not None:
            await asyncio.to_thread(self.metrics_server.close)
            self.metrics_server = None
        if self._started:
            log.info("agent stopped: %d heartbeats, %d events forwarded, %d publish failures, "
                     "%d docker reconnects, %d containers stopped on command",
                     self.heartbeats_sent, self.events_forwarded, self.publish_failures,
                     self.docker_reconnects, self.command_counters["outcome_stopped"])
        self._started = False

    def wake(self) -> None:
        """Send the next heartbeat now rather than at the end of the interval."""
        self._wake.set()

    # ------------------------------------------------------------------ heartbeats

    async def _heartbeat_loop(self) -> None:
        interval = self.settings.interval_s
        while True:
            started = self._round_started_at = time.monotonic()
            try:
                await self.send_heartbeat()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("heartbeat failed")
            # Wait out the interval from the start of this beat, or less if woken.
            remaining = interval - (time.monotonic() - started)
            if remaining > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(remaining):
                        await self._wake.wait()
            self._wake.clear()

    def _heartbeat_loop_problem(self) -> str | None:
        """Health check (read in the metrics' HTTP thread): the heartbeat loop began a round
        within ``interval_s + health_stale_s``. Its steps are bounded (inventory read,
        publish), so a loop that misses that is stuck while the event loop may still run."""
        age = time.monotonic() - self._round_started_at
        bound = self.settings.interval_s + self.health.stale_after_s
        if age <= bound:
            return None
        return f"no round for {age:.1f} s (interval_s + health_stale_s = {bound:g})"

    def _broker_problem(self) -> str | None:
        """Health check (read in the metrics' HTTP thread): the broker connection is up."""
        if self.publisher is None:
            return "not connected yet"
        if not self.publisher.link_up:
            return "down (the agent keeps reconnecting; see its log)"
        return None

    def _read_snapshot(self) -> _Snapshot:
        # Runs in a worker thread: NVML calls and /proc reads block.
        assert self.source is not None
        started = time.monotonic()
        try:
            samples = self.source.read_gpus()
        finally:
            self.metrics.observe_inventory_read(time.monotonic() - started)
        listed = [proc for sample in samples for proc in sample.processes or ()]
        containers = self.cgroups.containers_of(
            {proc.pid for proc in listed if proc.container_id is None})
        containers.update({proc.pid: proc.container_id for proc in listed
                           if proc.container_id is not None})
        names: dict[int, str] = {}
        if self.reports_processes:
            for proc in listed:
                if proc.pid not in names:
                    names[proc.pid] = (proc.name if proc.name is not None
                                       else self.cgroups.command_name(proc.pid))
        if not self.reports_interconnect and self.pinner is None:
            return _Snapshot(samples, containers, names)
        try:
            interconnect = self.source.read_interconnect()
        except Exception as exc:
            # The links are an extra of the report: the GPUs go out without them.
            log.warning("reading how the GPUs are joined failed (%s: %s)",
                        type(exc).__name__, exc)
            interconnect = None
        return _Snapshot(samples, containers, names, interconnect, interconnect_read=True)

    async def _read_inventory(self) -> _Snapshot:
        """One inventory snapshot, bounded by ``inventory_timeout_s``.

        A thread cannot be cancelled: a read that hangs (NVML on a GPU that fell off the bus)
        keeps its thread. So a timed-out read is not abandoned but awaited again by the next
        heartbeat, rather than starting another thread that would hang the same way.
        """
        pending = self._pending_read
        if pending is None or pending.done():
            if pending is not None and not pending.cancelled():
                pending.exception()  # a late failure nobody awaited: mark it seen
            pending = self._pending_read = asyncio.ensure_future(
                asyncio.to_thread(self._read_snapshot)
            )
        async with asyncio.timeout(self.settings.inventory_timeout_s):
            snapshot = await asyncio.shield(pending)
        self._pending_read = None
        return snapshot

    async def build_heartbeat(self) -> Heartbeat | None:
        """Read the inventory and containers now; None if there is nothing to report yet."""
        now = time.time()
        unreadable: str | None = None
        try:
            snapshot = await self._read_inventory()
            samples, pid_containers = snapshot.samples, snapshot.pid_containers
            command_names = snapshot.command_names
            self._last_samples = samples
            if snapshot.interconnect_read:
                self.interconnect = snapshot.interconnect
        except Exception as exc:
            # A heartbeat without the GPUs would read as "GPUs gone" and release their leases;
            # report the last known GPUs as unhealthy instead, so nothing new lands on them.
            unreadable = f"inventory: reading the GPUs failed ({type(exc).__name__}: {exc})"
            self.metrics.count_inventory_error()
            log.error("%s", unreadable)
            if self._last_samples is None:
                return None
            # The last samples' processes are stale: report them as not known.
            samples = [dataclasses.replace(sample, processes=None)
                       for sample in self._last_samples]
            pid_containers, command_names = {}, {}
        if self.watcher is not None and not self.watcher.events:
            await self.watcher.refresh()  # listing mode: the list is only as fresh as this
        running: list[LeaseContainer] = self.watcher.running() if self.watcher else []
        samples = self.mig_layout.apply(samples, held_gpu_uuids(running))
        if self.pinner is not None and unreadable is None:
            self._mig_parents = {sample.uuid: sample.mig_parent_uuid for sample in samples
                                 if sample.mig_parent_uuid is not None}
            self._pinning_ready = True
        if self.pinner is not None and self._pinning_ready:
            self.pinner.pin_unseen(running, self.interconnect, self._mig_parents)
        self.tracker.forget(sample.uuid for sample in samples)
        own: dict[str, Verdict] = {}
        for sample in samples:
            verdict = self.tracker.evaluate(sample, now)
            if sample.uuid in self.mig_layout.retained:
                verdict = self.mig_layout.verdict_of_retained(verdict)
            if unreadable is not None:
                verdict = Verdict(Health.UNHEALTHY, (unreadable, *verdict.reasons)[:32],
                                  verdict.recent_xids)
            own[sample.uuid] = verdict
        verdicts = inherit_parent_health(samples, own)
        processes: dict[str, GPUProcesses] = {}
        if self.reports_processes:
            processes = await self._gpu_processes(samples, pid_containers, command_names,
                                                  running)
        gpus = []
        for sample in samples:
            self._log_health_change(sample, verdicts[sample.uuid])
            gpus.append(gpu_info(sample, verdicts[sample.uuid], processes.get(sample.uuid)))
        use = gpu_use_by_container(samples, pid_containers)
        measured = use_by_container(samples, pid_containers)
        if isinstance(self.source, SimulatedSource):
            lease_use = await asyncio.to_thread(self.source.lease_use)
            host_uuids = [sample.uuid for sample in samples]
            use.update(simulated_use(running, lease_use, host_uuids))
            measured.update(simulated_gpu_use(running, lease_use, host_uuids))
        self.usage.measure(now, samples, holders_of(running, measured), measured)
        reports_usage = self.reports_usage
        containers = [
            ContainerInfo(
                container_id=c.container_id,
                lease_id=c.lease_id,
                name=c.name,
                started_at=c.started_at,
                gpu_use=use.get(c.container_id, []),
                grant=c.grant,
                usage=self.usage.usage(c.container_id) if reports_usage else None,
            )
            for c in running
        ]
        heartbeat = Heartbeat(
            host=self.host,
            agent_id=self.agent_id,
            seq=self.seq,
            sent_at=now,
            interval_s=self.settings.interval_s,
            gpus=gpus,
            containers=containers,
            containers_complete=self.watcher is not None and self.watcher.complete,
            source=self.source.kind if self.source else "nvml",
        )
        self.seq += 1
        return heartbeat

    async def send_heartbeat(self) -> bool:
        """Build and publish one heartbeat; False if it could not be built or sent."""
        # Taken before the build: a hello that comes while this one is built (maybe without
        # processes) makes the next one full.
        full_due, self._full_due = self._full_due, False
        try:
            heartbeat = await self.build_heartbeat()
        except ValidationError as exc:
            log.error("heartbeat does not validate (a bug, or a broken inventory): %s", exc)
            self._full_due |= full_due
            return False
        if heartbeat is None:
            self._full_due |= full_due
            return False
        interconnect = self._interconnect_due()
        if interconnect is not None:
            # A full report, whatever else is due: a delta never carries it.
            heartbeat = heartbeat.model_copy(update={"interconnect": interconnect})
        self.last_heartbeat = heartbeat
        assert self.publisher is not None
        message = (heartbeat if full_due or interconnect is not None
                   else self._message_for(heartbeat))
        ok = await self.publisher.publish_heartbeat(message)
        self.last_message = message
        if ok and interconnect is not None:
            self.interconnect_sent = interconnect
        if not ok:
            self._reported = None  # the allocator may not have it: the next one is full
        elif isinstance(message, HeartbeatDelta):
            self.deltas_sent += 1
            assert self._reported is not None
            self._reported = apply_delta(self._reported, message)
        else:
            self._reported = heartbeat
            self._full_sent_at = time.monotonic()
        # The first one a queue took: before the allocator declares its queue, the broker
        # returns them (see nodeagent.publisher).
        if ok and self.publisher.heartbeats_delivered == 1:
            log.info("first heartbeat sent: %d GPU(s), %d lease container(s)",
                     len(heartbeat.gpus), len(heartbeat.containers))
        return ok

    def _interconnect_due(self) -> HostInterconnect | None:
        """The interconnect the next report carries: the one read, when the allocator reads
        it and it is not the one the last full report since the newest hello carried."""
        current = self.interconnect
        if (current is None or not self.reports_interconnect
                or current is self.interconnect_sent or current == self.interconnect_sent):
            return None
        return current

    def _message_for(self, heartbeat: Heartbeat) -> Heartbeat | HeartbeatDelta:
        """What to publish for ``heartbeat``: a delta of the report the allocator holds, or
        the full heartbeat when one is due (``full_report_s``) or no delta can say it."""
        full_every = self.settings.full_report_s
        if (self._reported is None or self._full_sent_at is None or full_every <= 0
                or time.monotonic() - self._full_sent_at >= full_every):
            return heartbeat
        return delta_between(self._reported, heartbeat, self.thresholds) or heartbeat

    def _log_health_change(self, sample: GPUSample, verdict: Verdict) -> None:
        before = self._health.get(sample.uuid)
        self._health[sample.uuid] = verdict.health
        if before is None and verdict.healthy:
            return
        if before is not verdict.health:
            if verdict.healthy:
                log.info("GPU %d (%s) is healthy again", sample.index, sample.uuid)
            else:
                log.warning("GPU %d (%s) is unhealthy: %s", sample.index, sample.uuid,
                            "; ".join(verdict.reasons))

    # ------------------------------------------------------------------ GPU processes

    def _on_hello(self, hello: AllocatorHello) -> None:
        """An allocator said what it reads: report processes or not from now on (and the
        interconnect, in the next full report, when it reads that), and send the next
        heartbeat at once and in full (this allocator may hold no report of this host, or
        one without processes)."""
        before = self.reports_processes
        self.allocator_reads = frozenset(hello.reads)
        # This allocator may hold no interconnect of this host: the next full report says it.
        self.interconnect_sent = None
        if self.reports_processes != before:
            log.info("the allocator %s GPU processes: heartbeats list them %s",
                     "reads" if self.reports_processes else "does not read",
                     "from now on" if self.reports_processes else "no more")
        elif self.settings.gpu_processes != "auto":
            log.debug("allocator hello (reads %s); gpu_processes is %s",
                      ", ".join(hello.reads) or "nothing more", self.settings.gpu_processes)
        self._full_due = True
        self.wake()

    async def _gpu_processes(self, samples: list[GPUSample], pid_containers: dict[int, str],
                             command_names: dict[int, str], running: list[LeaseContainer]
                             ) -> dict[str, GPUProcesses]:
        """Each GPU's processes as the heartbeat lists them (see nodeagent.gpu_processes)."""
        lease_containers = {c.container_id for c in running}
        others = other_containers(samples, pid_containers, lease_containers)
        await self._describe_containers(others)
        return gpu_processes(samples, containers=pid_containers, command_names=command_names,
                             lease_containers=lease_containers, details=self._details,
                             driver_processes=self.settings.driver_processes)

    async def _describe_containers(self, container_ids: set[str]) -> None:
        """Ask Docker (through the watcher's client) for the name and image of the containers
        not known yet, waiting at most :data:`DETAILS_WAIT_S`; forget the ones no longer
        using a GPU, so the cache stays as small as what runs."""
        for gone in set(self._details) - container_ids:
            del self._details[gone]
        for gone in set(self._details_failed) - container_ids:
            del self._details_failed[gone]
        watcher = self.watcher
        if watcher is None:
            return
        now = time.monotonic()
        for container_id in container_ids:
            failed_at = self._details_failed.get(container_id)
            if (container_id in self._details or container_id in self._describing
                    or (failed_at is not None and now - failed_at < DETAILS_RETRY_S)):
                continue
            task = asyncio.create_task(self._describe(watcher, container_id),
                                       name="describe-container")
            self._describing[container_id] = task
        waiting = [self._describing[c] for c in container_ids if c in self._describing]
        if waiting:
            await asyncio.wait(waiting, timeout=DETAILS_WAIT_S)

    async def _describe(self, watcher: ContainerWatcher, container_id: str) -> None:
        try:
            self._details[container_id] = await watcher.describe(container_id)
            self._details_failed.pop(container_id, None)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._details_failed[container_id] = time.monotonic()
            log.warning("docker: cannot tell which container %s is (%s); its GPU processes "
                        "are listed without its name and image", container_id[:12],
                        f"{type(exc).__name__}: {exc}")
        finally:
            self._describing.pop(container_id, None)

    # ------------------------------------------------------------------ containers

    def _on_container_change(self, change: ContainerChange) -> None:
        assert self.publisher is not None
        try:
            event = ContainerEvent(
                host=self.host,
                container_id=change.container_id,
                lease_id=change.lease_id,
                action=ContainerAction(change.action),
                at=change.at,
                exit_code=change.exit_code,
                grant=change.grant,
            )
        except ValidationError as exc:
            log.error("cannot report container %s: %s", change.container_id[:12], exc)
            return
        log.info("container %s (lease %s): %s%s%s", change.container_id[:12], change.lease_id,
                 change.action,
                 f" exit {change.exit_code}" if change.exit_code is not None else "",
                 " (inferred after a gap in the event stream)" if change.synthesized else "",
                 extra={"lease_id": change.lease_id, "host": self.host})
        self.publisher.submit_event(event)
        if change.action == "start" and self.pinner is not None and self._pinning_ready:
            self.pinner.pin(LeaseContainer(change.container_id, change.lease_id, change.name,
                                           change.at, change.grant),
                            self.interconnect, self._mig_parents)
        if change.action != "start":
            # The heartbeat's container list changed too: send it now, not in an interval.
            self.wake()

    # ------------------------------------------------------------------ XIDs

    def _xid_worker(self) -> None:
        # Runs in its own thread: NVML's event wait blocks in C. Ends within xid_poll_s of
        # stop() (or at once for the simulated source, which close() wakes).
        source, loop = self.source, self._loop
        assert source is not None and loop is not None
        while not self._xid_stop.is_set():
            try:
                events = source.wait_xids(self.settings.xid_poll_s)
            except Exception:
                log.exception("waiting for XIDs failed")
                self._xid_stop.wait(self.settings.xid_poll_s)
                continue
            if events:
                with contextlib.suppress(RuntimeError):  # the loop closed under us
                    loop.call_soon_threadsafe(self._on_xids, events)

    def _on_xids(self, events: list[XidEvent]) -> None:
        fatal = False
        for event in events:
            self.xids_received += 1
            is_fatal = self.tracker.record_xid(event.gpu_uuid, event.xid, event.at)
            fatal = fatal or is_fatal
            (log.warning if is_fatal else log.info)(
                "GPU %s: XID %d%s", event.gpu_uuid, event.xid, " (fatal)" if is_fatal else ""
            )
        if fatal:
            self.wake()
