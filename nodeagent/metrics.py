"""Prometheus metrics of the node agent, on a port of their own (``metrics_port``, 9465).

Two parts, as in :mod:`allocator.metrics.exporter`, so that the agent's loops pay (almost) nothing:

- :class:`AgentMetrics` holds what must be recorded when it happens: the latency of each
  inventory read (NVML, or the simulated file) and of each Docker API call, in histograms,
  and their failures. The agent calls its ``observe_*`` and ``count_*`` methods (a lock and
  an add each).
- :class:`AgentCollector` reads everything else *at scrape time* from what the agent already
  keeps: its publisher's, command consumer's and CPU pinner's counters, and the newest
  heartbeat it built, which gives each GPU's health, utilization, memory and temperature and
  the lease containers with their grants (users, groups, GPUs held).

The per-GPU gauges carry the labels NVIDIA's DCGM exporter uses where they mean the same,
``gpu`` (the index), ``UUID``, ``modelName`` and ``Hostname`` (and, for a MIG instance,
``GPU_I_PROFILE`` with ``UUID`` and ``modelName`` of its parent GPU, as DCGM reports them),
so dashboards and alerts written for DCGM exporter join on them. A MIG instance also carries
``mig_uuid``, its own ``MIG-...`` uuid (the allocator's name for it); empty for a whole GPU.
``modelName`` is camelCase because DCGM's is: ``promtool check metrics`` says so about these
families, and nothing else.

The collector runs in the HTTP server's thread and reads the agent without its event loop:
every value it reads is an int, a counter copied in one C call, or the newest heartbeat,
which the agent replaces whole and never changes (a reference read is atomic). Each agent has
a registry of its own, so two agents in one process (tests) never share a count.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from allocator.metrics.endpoint import MetricsServer, ProcessHealth, serve_registry
from allocator.wire.protocol import Health, Heartbeat
from nodeagent.cpu_pinning import PIN_OUTCOMES

if TYPE_CHECKING:
    from nodeagent.commands import CommandConsumer
    from nodeagent.containers import ContainerWatcher
    from nodeagent.cpu_pinning import CpuPinner
    from nodeagent.publisher import Publisher
    from nodeagent.usage import UsageMeter

log = logging.getLogger(__name__)

MIB = 1024 * 1024

DOCKER_CALLS = ("list", "inspect", "stop", "info", "ping", "update")
"""The Docker API calls the agent makes, as :class:`~nodeagent.containers.ContainerWatcher`
names them: list the lease containers, inspect one before a stop command (or a container
without a lease that runs a process on a GPU, for its name and image), stop it, ``docker
info`` for the node's name, the liveness ping of a quiet event stream, and the update that
pins a lease container to its GPUs' CPUs (``pin_cpus``). Every one has its series from the
start, at 0."""

CALL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                10.0, 30.0)
"""Seconds. An NVML read of 8 GPUs takes milliseconds, a Docker listing tens of them; a stop
command's ``stop`` waits out the container's grace (10 s by default)."""

STOP_OUTCOMES_TAKEN = ("stopped", "gone", "not_running")
"""Stop commands carried out: the container stopped, was gone already, or had ended."""
STOP_OUTCOMES_REFUSED = ("refused_user", "invalid", "wrong_host", "wrong_lease")
"""Stop commands refused: from a broker user not in ``command_users``, not a command, for
another host, or for a container that is not that lease's (left alone)."""
STOP_OUTCOMES_OTHER = ("duplicate", "failed")
"""A stop of a container already being stopped for the same lease; a Docker error or timeout."""
STOP_OUTCOMES = (*STOP_OUTCOMES_TAKEN, *STOP_OUTCOMES_REFUSED, *STOP_OUTCOMES_OTHER)
"""Every ``outcome`` label of ``swarm_gpu_agent_stop_commands_total``."""

_OUTCOME_COUNTER = {
    outcome: f"outcome_{outcome}" if outcome in (*STOP_OUTCOMES_TAKEN, "wrong_lease")
    else outcome for outcome in STOP_OUTCOMES}
"""Outcome label -> the command consumer's counter: what a stop did is ``outcome_<StopOutcome>``
(:class:`~nodeagent.commands.CommandConsumer`), the rest is counted under its own name."""

GPU_LABELS = ("gpu", "UUID", "modelName", "Hostname", "GPU_I_PROFILE", "mig_uuid")
"""The labels of every per-GPU family (see the module's docstring)."""


class AgentMetrics:
    """One agent's metrics: its own registry, its histograms and failure counts."""

    def __init__(self, source: str) -> None:
        """``source``: the inventory's kind (``nvml`` or ``simulated``), the ``source`` label
        of the inventory metrics."""
        self.source = source
        self.registry = CollectorRegistry()
        self.inventory_read_seconds = Histogram(
            "swarm_gpu_agent_inventory_read_seconds",
            "Seconds one read of the GPUs took (source nvml: every NVML query of every GPU; "
            "simulated: reading the file), failed reads included; a read past "
            "inventory_timeout_s is observed when it ends, one that never ends only in "
            "swarm_gpu_agent_inventory_errors_total",
            ["source"], buckets=CALL_BUCKETS, registry=self.registry)
        self.inventory_read_seconds.labels(source)
        self.docker_call_seconds = Histogram(
            "swarm_gpu_agent_docker_call_seconds",
            "Seconds one Docker API call took, by call (list, inspect, stop, info, ping, "
            "update), "
            "failed calls included", ["call"], buckets=CALL_BUCKETS, registry=self.registry)
        for call in DOCKER_CALLS:
            self.docker_call_seconds.labels(call)
        self._lock = threading.Lock()
        self.inventory_errors = 0
        self.docker_errors: Counter[str] = Counter({call: 0 for call in DOCKER_CALLS})
        self._collector: AgentCollector | None = None

    def observe_inventory_read(self, seconds: float) -> None:
        """Record one inventory read's duration (from the reading thread, when the read ends).

        A read past the timeout is recorded with its true duration once it ends, not when the
        heartbeat gives up on it: a hung read's duration is not known, and recording the
        timeout instead would make a histogram of the setting rather than of NVML.
        """
        self.inventory_read_seconds.labels(self.source).observe(seconds)

    def count_inventory_error(self) -> None:
        """Count an inventory read that failed or ran past ``inventory_timeout_s``."""
        with self._lock:
            self.inventory_errors += 1

    def observe_docker_call(self, call: str, seconds: float, ok: bool) -> None:
        """Record one Docker API call (a :data:`nodeagent.containers.CallObserver`)."""
        self.docker_call_seconds.labels(call).observe(seconds)
        if not ok:
            with self._lock:
                self.docker_errors[call] += 1

    def failures(self) -> tuple[int, dict[str, int]]:
        """Failed inventory reads, and failed Docker calls by call, counted so far."""
        with self._lock:
            return self.inventory_errors, dict(self.docker_errors)

    def install(self, agent: Observed) -> AgentCollector:
        """Register the collector that reads ``agent`` at scrape time (once)."""
        with self._lock:
            if self._collector is None:
                self._collector = AgentCollector(agent, self)
                self.registry.register(self._collector)
            return self._collector


class Observed(Protocol):
    """What the collector reads of a node agent (:class:`nodeagent.agent.NodeAgent`)."""

    host: str
    publisher: Publisher | None
    commands: CommandConsumer | None
    watcher: ContainerWatcher | None
    pinner: CpuPinner | None
    last_heartbeat: Heartbeat | None
    deltas_sent: int
    xids_received: int
    usage: UsageMeter


# --------------------------------------------------------------------------- figures


@dataclass
class Figures:
    """What one scrape reports, read from the agent in one go."""

    host: str = ""
    heartbeats_sent: int = 0
    heartbeat_failures: int = 0
    heartbeats_unroutable: int = 0
    full_reports_unread: int = 0
    deltas_sent: int = 0
    events_forwarded: int = 0
    event_failures: int = 0
    events_dropped: int = 0
    events_buffered: int = 0
    broker_connected: bool = False
    commands_received: int = 0
    command_outcomes: dict[str, int] = field(default_factory=dict)
    commands_consuming: bool = False
    docker_watched: bool = False
    docker_complete: bool = False
    docker_reconnects: int = 0
    deaths_inferred: int = 0
    cpu_pinning: dict[str, int] = field(default_factory=dict)
    xids: int = 0
    inventory_errors: int = 0
    docker_errors: dict[str, int] = field(default_factory=dict)
    heartbeat: Heartbeat | None = None
    lease_usage: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    """Per (group, GPU uuid): joules and SM-seconds counted for lease containers."""


def read_figures(agent: Observed, metrics: AgentMetrics) -> Figures:
    """Read the agent's counters and its newest heartbeat (from any thread)."""
    figures = Figures(host=agent.host, deltas_sent=agent.deltas_sent,
                      xids=agent.xids_received, heartbeat=agent.last_heartbeat,
                      lease_usage=dict(agent.usage.counted))  # one C-level copy
    publisher = agent.publisher
    if publisher is not None:
        figures.heartbeats_sent = publisher.heartbeats_sent
        figures.heartbeat_failures = publisher.heartbeat_failures
        figures.heartbeats_unroutable = publisher.heartbeats_unroutable
        figures.full_reports_unread = publisher.full_reports_unread
        figures.events_forwarded = publisher.events_sent
        figures.event_failures = publisher.event_failures
        figures.events_dropped = publisher.events_dropped
        figures.events_buffered = publisher.buffered
        figures.broker_connected = publisher.connected
    commands = agent.commands
    if commands is not None:
        counts = dict(commands.counters)  # one C-level copy: safe beside the loop's adds
        figures.commands_received = counts.get("received", 0)
        figures.command_outcomes = {outcome: counts.get(counter, 0)
                                    for outcome, counter in _OUTCOME_COUNTER.items()}
        figures.commands_consuming = commands.consuming
    watcher = agent.watcher
    if watcher is not None:
        figures.docker_watched = True
        figures.docker_complete = watcher.complete
        figures.docker_reconnects = watcher.reconnects
        figures.deaths_inferred = watcher.deaths_inferred
    pinner = agent.pinner
    if pinner is not None:
        figures.cpu_pinning = dict(pinner.counters)  # one C-level copy, as the commands'
    figures.inventory_errors, figures.docker_errors = metrics.failures()
    return figures


# --------------------------------------------------------------------------- families


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def gpu_label_values(heartbeat: Heartbeat) -> dict[str, list[str]]:
    """Per unit uuid in ``heartbeat``: its values of :data:`GPU_LABELS`."""
    models = {gpu.uuid: gpu.model for gpu in heartbeat.gpus}
    values = {}
    for gpu in heartbeat.gpus:
        if gpu.mig_parent_uuid is not None:
            # DCGM reports a MIG instance under its parent's UUID and model name, told apart
            # by the instance's profile; mig_uuid keeps the allocator's name for it.
            values[gpu.uuid] = [str(gpu.index), gpu.mig_parent_uuid,
                                models.get(gpu.mig_parent_uuid, gpu.model), heartbeat.host,
                                gpu.mig_profile or "", gpu.uuid]
        else:
            values[gpu.uuid] = [str(gpu.index), gpu.uuid, gpu.model, heartbeat.host, "", ""]
    return values


def gpu_families(heartbeat: Heartbeat | None) -> Iterator[Metric]:
    """The per-GPU gauges, and the lease containers' holdings, of the newest heartbeat.

    Every family is yielded, empty before the first heartbeat, so a scrape always declares
    them.
    """
    labels = list(GPU_LABELS)
    healthy = GaugeMetricFamily(
        "swarm_gpu_agent_gpu_healthy", "1 if the agent judges the GPU (or MIG instance) "
        "healthy, 0 if not (fatal XID, overheating, ECC, lost, unreadable)", labels=labels)
    utilization = GaugeMetricFamily(
        "swarm_gpu_agent_gpu_utilization_ratio", "GPU utilization, 0 to 1, as NVML reports "
        "it (DCGM_FI_DEV_GPU_UTIL / 100)", labels=labels)
    used = GaugeMetricFamily(
        "swarm_gpu_agent_gpu_memory_used_bytes", "GPU memory in use (DCGM_FI_DEV_FB_USED, "
        "in bytes)", labels=labels)
    total = GaugeMetricFamily(
        "swarm_gpu_agent_gpu_memory_total_bytes", "GPU memory in all", labels=labels)
    temperature = GaugeMetricFamily(
        "swarm_gpu_agent_gpu_temperature_celsius", "GPU temperature (DCGM_FI_DEV_GPU_TEMP)",
        labels=labels)
    held = GaugeMetricFamily(
        "swarm_gpu_agent_gpu_held", "1 if a running lease container's grant names this GPU "
        "(or MIG instance), else 0", labels=labels)
    users = GaugeMetricFamily(
        "swarm_gpu_agent_user_gpus", "GPUs (shared=\"true\": slices) the user's running "
        "lease containers on this host hold, by their grant labels", labels=["user", "shared"])
    groups = GaugeMetricFamily(
        "swarm_gpu_agent_group_gpus", "GPUs (shared=\"true\": slices) held on this host by "
        "running lease containers asked for with this group", labels=["group", "shared"])
    containers = GaugeMetricFamily(
        "swarm_gpu_agent_lease_containers", "Running lease containers on this host, as the "
        "newest heartbeat listed them", value=0 if heartbeat is None else len(
            heartbeat.containers))
    if heartbeat is not None:
        held_uuids: set[str] = set()
        per_user: Counter[tuple[str, str]] = Counter()
        per_group: Counter[tuple[str, str]] = Counter()
        for container in heartbeat.containers:
            grant = container.grant
            if grant is None:
                continue
            held_uuids.update(grant.gpu_uuids)
            shared = "true" if grant.shared else "false"
            per_user[grant.user, shared] += len(grant.gpu_uuids)
            for group in grant.groups:
                per_group[group, shared] += len(grant.gpu_uuids)
        values = gpu_label_values(heartbeat)
        for gpu in heartbeat.gpus:
            label_values = values[gpu.uuid]
            healthy.add_metric(label_values, 1 if gpu.health is Health.HEALTHY else 0)
            if gpu.utilization_pct is not None:
                utilization.add_metric(label_values, gpu.utilization_pct / 100)
            used.add_metric(label_values, gpu.memory_used_mib * MIB)
            total.add_metric(label_values, gpu.memory_total_mib * MIB)
            if gpu.temperature_c is not None:
                temperature.add_metric(label_values, gpu.temperature_c)
            held.add_metric(label_values, 1 if gpu.uuid in held_uuids else 0)
        for (user, shared), count in sorted(per_user.items()):
            users.add_metric([user, shared], count)
        for (group, shared), count in sorted(per_group.items()):
            groups.add_metric([group, shared], count)
    yield from (healthy, utilization, used, total, temperature, held, users, groups, containers)


def usage_families(heartbeat: Heartbeat | None,
                   counted: Mapping[tuple[str, str], tuple[float, float]]
                   ) -> Iterator[Metric]:
    """The lease containers' measured usage since the agent started (nodeagent.usage), by
    group and GPU (DCGM exporter's labels; a MIG instance's SM time under its own, its energy
    under its parent's): counters that a dashboard sums by ``group`` or ``modelName``.

    Every family is yielded, empty before the first heartbeat; a GPU the newest heartbeat
    does not list is left out."""
    labels = ["group", *GPU_LABELS]
    energy = CounterMetricFamily(
        "swarm_gpu_agent_lease_energy_joules", "Energy the lease containers of a group used "
        "on the GPU: their share of its energy counter (DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION, "
        "in joules; a shared GPU split by SM utilization)", labels=labels)
    used = CounterMetricFamily(
        "swarm_gpu_agent_lease_used_gpu_seconds", "GPU-seconds the lease containers of a "
        "group really used on the GPU (or MIG instance): SM utilization, a fraction of the "
        "GPU, times seconds", labels=labels)
    if heartbeat is not None:
        values = gpu_label_values(heartbeat)
        for (group, uuid), (joules, sm_s) in sorted(counted.items()):
            label_values = values.get(uuid)
            if label_values is None:
                continue
            if joules > 0:
                energy.add_metric([group, *label_values], joules)
            if sm_s > 0:
                used.add_metric([group, *label_values], sm_s)
    yield from (energy, used)


def agent_families(figures: Figures) -> Iterator[Metric]:
    """The Prometheus families of one reading of the agent."""
    yield _counter("swarm_gpu_agent_heartbeats_sent", "Heartbeats (full or deltas) the broker "
                   "confirmed", figures.heartbeats_sent)
    yield _counter("swarm_gpu_agent_heartbeat_failures", "Heartbeats that could not be "
                   "published (dropped: the next one follows in an interval, and is full)",
                   figures.heartbeat_failures)
    yield _counter("swarm_gpu_agent_heartbeats_unroutable", "Heartbeats the broker confirmed "
                   "but handed back: no queue took them (the allocator has not declared its "
                   "queue yet; the next heartbeat is full)", figures.heartbeats_unroutable)
    yield _counter("swarm_gpu_agent_full_reports_unread", "Full reports that reached the "
                   "allocator's queue while no allocator consumed it (the next heartbeat is "
                   "full again)", figures.full_reports_unread)
    yield _counter("swarm_gpu_agent_heartbeat_deltas_sent", "Heartbeats sent as deltas of the "
                   "report the allocator holds", figures.deltas_sent)
    yield _counter("swarm_gpu_agent_events_forwarded", "Container events (start, die, oom, "
                   "destroy) the broker confirmed", figures.events_forwarded)
    yield _counter("swarm_gpu_agent_event_publish_failures", "Attempts to publish a container "
                   "event that failed (the event stays buffered and is retried)",
                   figures.event_failures)
    yield _counter("swarm_gpu_agent_events_dropped", "Container events lost because the "
                   "buffer (event_buffer) was full during a broker outage",
                   figures.events_dropped)
    yield _gauge("swarm_gpu_agent_events_buffered", "Container events waiting to be "
                 "published", figures.events_buffered)
    yield _gauge("swarm_gpu_agent_broker_connected", "1 if the publishing connection to the "
                 "broker is open", int(figures.broker_connected))
    yield _counter("swarm_gpu_agent_stop_commands_received", "Messages taken off this host's "
                   "command queue", figures.commands_received)
    outcomes = CounterMetricFamily(
        "swarm_gpu_agent_stop_commands", "Stop commands by outcome: carried out (stopped, "
        "gone, not_running), refused (refused_user, invalid, wrong_host, wrong_lease), "
        "duplicate, failed", labels=["outcome"])
    for outcome in STOP_OUTCOMES:
        outcomes.add_metric([outcome], figures.command_outcomes.get(outcome, 0))
    yield outcomes
    yield _gauge("swarm_gpu_agent_stop_commands_consuming", "1 if the agent consumes its "
                 "command queue now (stop_commands on and the broker reachable)",
                 int(figures.commands_consuming))
    yield _gauge("swarm_gpu_agent_docker_watched", "1 if the agent watches a Docker engine "
                 "(the docker setting)", int(figures.docker_watched))
    yield _gauge("swarm_gpu_agent_docker_complete", "1 if the lease container list is "
                 "trustworthy (listed, and the event stream up since)",
                 int(figures.docker_complete))
    yield _counter("swarm_gpu_agent_docker_reconnects", "Times the Docker event stream was "
                   "established again after it broke", figures.docker_reconnects)
    yield _counter("swarm_gpu_agent_docker_deaths_inferred", "Lease container deaths the agent "
                   "reported itself after a gap in the event stream", figures.deaths_inferred)
    errors = CounterMetricFamily(
        "swarm_gpu_agent_docker_call_errors", "Docker API calls that failed or timed out, by "
        "call (a 404 for a container that is gone is an answer, not an error)",
        labels=["call"])
    for call, count in sorted(figures.docker_errors.items()):
        errors.add_metric([call], count)
    yield errors
    pinning = CounterMetricFamily(
        "swarm_gpu_agent_cpu_pinning", "Pinnings of lease containers to the CPUs near their "
        "GPUs (pin_cpus), by outcome: pinned, failed (Docker refused, the container was "
        "gone, no answer), unknown (the CPUs of its GPUs are not known: left alone)",
        labels=["outcome"])
    for outcome in PIN_OUTCOMES:
        pinning.add_metric([outcome.value], figures.cpu_pinning.get(outcome.value, 0))
    yield pinning
    yield _counter("swarm_gpu_agent_inventory_errors", "Reads of the GPUs that failed or ran "
                   "past inventory_timeout_s (the GPUs are then reported unhealthy)",
                   figures.inventory_errors)
    yield _counter("swarm_gpu_agent_xids", "XID events received from the driver (fatal or "
                   "not)", figures.xids)
    yield from gpu_families(figures.heartbeat)
    yield from usage_families(figures.heartbeat, figures.lease_usage)


# --------------------------------------------------------------------------- collector


class AgentCollector(Collector):
    """Reads one node agent (:class:`Observed`) at scrape time."""

    def __init__(self, agent: Observed, metrics: AgentMetrics) -> None:
        self.agent = agent
        self.metrics = metrics

    def describe(self) -> Iterable[Metric]:
        # Registering must not read the agent (it may not have started): describe nothing,
        # which tells the registry to skip the duplicate-name check for this collector.
        return []

    def collect(self) -> Iterable[Metric]:
        yield from agent_families(read_figures(self.agent, self.metrics))


def serve(agent: Observed, metrics: AgentMetrics, port: int, addr: str,
          token: str | None = None,
          health: ProcessHealth | None = None) -> MetricsServer | None:
    """Serve the agent's metrics on ``addr:port`` (``/metrics``) from a daemon thread; with
    ``token`` (``metrics_token``), only to requests that send it
    (:func:`allocator.metrics.endpoint.serve_registry`); with ``health``, ``/healthz`` too.

    None when the port cannot be bound (in use, or an address this host does not have): the
    error is logged and the agent runs on, since its heartbeats matter more than its metrics
    (Prometheus shows the target down).
    """
    metrics.install(agent)
    try:
        server = serve_registry(metrics.registry, port, addr, token, health)
    except OSError as exc:
        log.error("metrics: cannot listen on %s:%d (%s); running without metrics (set "
                  "metrics_port to a free port, or 0 for none)", addr, port, exc)
        return None
    log.info("metrics on http://%s:%d/metrics%s", addr, server.port,
             " (token required)" if token is not None else "")
    return server
