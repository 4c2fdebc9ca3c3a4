"""Prometheus metrics of the allocator, on a port of their own.

Two parts, so that the request path pays (almost) nothing:

- :meth:`AllocatorMetrics.observe_request` records one request's latency in a histogram: the
  only call the service makes per request (a dictionary lookup and an add under a lock).
- :class:`AllocatorCollector` computes everything else *at scrape time* from what the engine
  and the service already keep: the figures the engine publishes
  (:class:`~allocator.metrics.figures.EngineFigures`: its counters, the cluster, the leases)
  and the service's :class:`~allocator.metrics.counters.Counters`. The reading
  (:class:`ScrapeReading`) is taken on the allocator's event loop, between two batches,
  because the engine's dicts are only consistent there; the HTTP server thread waits for it
  (bounded) instead of reading them while the loop changes them.

Each service owns an :class:`AllocatorMetrics`, with a registry of its own, so the
process-wide default registry (and whatever else registers there) stays out of the
allocator's endpoint, and two services in one process (tests, a takeover drill) never share a
count. This module reads a service only through :class:`Observed` and :class:`Replica` (what
it is handed), and the engine only through the figures it publishes; it imports neither, nor
the ledger nor the settings (docs/design.md, module map: the metrics stand below them).
Start the endpoint with :func:`serve`; see ``docs/operations.md`` for the metric list.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Protocol, TypeVar

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from allocator.metrics import endpoint as http_endpoint
from allocator.metrics.counters import (
    COUNT_EXPORTED,
    FAMILY_EXPORTED,
    Count,
    Counters,
    Exported,
    ServiceStats,
)
from allocator.metrics.figures import GPU_STATES, SHARES, EngineFigures, FiguresSource
from allocator.wire.protocol import LeaseState

log = logging.getLogger(__name__)
T = TypeVar("T")

REQUEST_KINDS = frozenset({"allocate", "release", "status", "inventory", "drain", "queue",
                           "heartbeat", "container_event", "invalid"})
"""Label values of the request histogram; anything else is counted as ``other`` so a
hostile ``kind`` cannot grow the number of time series."""

REQUEST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

BATCH_PHASES = ("decide", "commit", "answer")
"""The parts of applying one batch, in order: ``decide`` (decode and decide in memory),
``commit`` (the ledger transaction, or the append to the replicated log and its return,
with the hand-over to the ledger's thread), ``answer`` (after the commit: stop commands,
replies, acknowledgements and pushed grants)."""

PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                 0.5, 1.0, 2.5, 5.0)

SNAPSHOT_TIMEOUT_S = 2.0
"""How long a scrape waits for the event loop; a loop blocked longer is itself the news."""


class Observed(Protocol):
    """What the metrics read of an allocator service (its engine is replaced on a reload)."""

    @property
    def engine(self) -> FiguresSource: ...

    @property
    def stats(self) -> ServiceStats: ...

    @property
    def metrics(self) -> AllocatorMetrics: ...

    @property
    def log(self) -> LogObserved | None: ...


class Replica(Observed, Protocol):
    """What the endpoint reads of a running allocator replica: :class:`Observed`, and whether
    it is the active one (:meth:`allocator.service.standby.Standby.is_active`)."""

    @property
    def active(self) -> bool: ...


class PositionObserved(Protocol):
    """What the metrics read of the log's position:
    :class:`allocator.ledger.log_position.LogPosition`."""

    @property
    def epoch(self) -> int: ...

    @property
    def offset(self) -> int: ...


class SnapshotObserved(Protocol):
    """What the metrics read of the newest snapshot a replica took:
    :class:`allocator.ledger.replication.SnapshotTaken`."""

    @property
    def seconds(self) -> float: ...

    @property
    def stored_bytes(self) -> int: ...


class LogObserved(Protocol):
    """What the metrics read of the replicated ledger log (``ledger_log = "stream"``):
    :class:`allocator.ledger.replication.ReplicatedLog`."""

    entries_applied: int
    entries_fenced: int
    snapshots_taken: int
    snapshots_loaded: int
    is_writer: bool

    @property
    def position(self) -> PositionObserved | None: ...

    @property
    def last_snapshot(self) -> SnapshotObserved | None: ...

    @property
    def caught_up(self) -> asyncio.Event: ...


class AllocatorMetrics:
    """One service's metrics: its own registry, its request histogram and its collector."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.request_seconds = Histogram(
            "swarm_gpu_request_seconds",
            "Seconds from the start of applying a message's batch (decode, decide, commit to "
            "the ledger) until its reply was sent and the batch acknowledged, by message kind",
            ["kind"],
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self.batch_phase_seconds = Histogram(
            "swarm_gpu_batch_phase_seconds",
            "Seconds each batch of messages spent in each part of being applied: decide "
            "(decode and decide in memory), commit (the ledger transaction or the log append), "
            "answer (replies, acknowledgements, pushed grants)",
            ["phase"],
            buckets=PHASE_BUCKETS,
            registry=self.registry,
        )
        self.ledger_write_seconds = Histogram(
            "swarm_gpu_ledger_write_seconds",
            "Seconds each batch's transaction took on the ledger's thread, fsync included "
            "(part of the commit phase; the rest of that phase is the hand-over to the "
            "ledger's thread and back); not with the replicated ledger log",
            buckets=PHASE_BUCKETS,
            registry=self.registry,
        )
        self._collector: AllocatorCollector | None = None
        self._lock = threading.Lock()

    def observe_request(self, kind: str, seconds: float) -> None:
        """Record the latency of one request of ``kind`` (``allocate``, ``heartbeat``...)."""
        label = kind if kind in REQUEST_KINDS else "other"
        self.request_seconds.labels(label).observe(seconds)

    def observe_batch(self, decide_s: float, commit_s: float, answer_s: float, *,
                      write_s: float | None = None) -> None:
        """Record how long one batch spent in each of :data:`BATCH_PHASES`, and of its commit
        ``write_s``, the ledger file's transaction on the ledger's thread (None: the batch
        went to the replicated log)."""
        for phase, seconds in zip(BATCH_PHASES, (decide_s, commit_s, answer_s), strict=True):
            self.batch_phase_seconds.labels(phase).observe(seconds)
        if write_s is not None:
            self.ledger_write_seconds.observe(write_s)

    def install(self, service: Replica,
                loop: asyncio.AbstractEventLoop | None = None) -> AllocatorCollector:
        """Register a collector for ``service``, replacing an earlier one (no double report)."""
        collector = AllocatorCollector(service, loop)
        with self._lock:
            if self._collector is not None:
                self.registry.unregister(self._collector)
            self.registry.register(collector)
            self._collector = collector
        return collector

    def uninstall(self, collector: AllocatorCollector) -> None:
        """Remove a collector that :meth:`install` registered (no-op if it was replaced)."""
        with self._lock:
            if self._collector is collector:
                self.registry.unregister(collector)
                self._collector = None


# --------------------------------------------------------------------------- one scrape


@dataclass
class ScrapeReading(EngineFigures):
    """What one scrape reports, read from the engine (the figures it publishes) and the
    service in one go."""

    service_counters: Counters = field(default_factory=Counters)
    log: LogFigures | None = None
    """The replicated ledger log's figures; None without one."""
    active: bool = False
    """Whether the replica is the active one (:class:`Replica`)."""
    frozen_objects: int = 0
    """Objects Python's cycle collector skips (``gc.get_freeze_count()``): what ``serve``
    froze after its last rebuild (:mod:`allocator.service.heap`); 0 where nothing froze."""


@dataclass(frozen=True)
class LogFigures:
    """The replicated ledger log as one scrape sees it."""

    entries_applied: int
    entries_fenced: int
    snapshots_taken: int
    snapshots_loaded: int
    writer: bool
    caught_up: bool
    epoch: int | None
    offset: int | None
    last_snapshot: SnapshotObserved | None


def log_figures(replicated: LogObserved) -> LogFigures:
    """Read the replicated log (on the allocator's event loop)."""
    position = replicated.position
    return LogFigures(replicated.entries_applied, replicated.entries_fenced,
                      replicated.snapshots_taken, replicated.snapshots_loaded,
                      replicated.is_writer, replicated.caught_up.is_set(),
                      position.epoch if position is not None else None,
                      position.offset if position is not None else None,
                      replicated.last_snapshot)


def read_scrape(service: Observed, now: float) -> ScrapeReading:
    """Read the engine's figures and the service (call on the allocator's event loop)."""
    figures = service.engine.figures(now)
    replicated = service.log
    return ScrapeReading(
        **{published.name: getattr(figures, published.name)
           for published in fields(EngineFigures)},
        service_counters=service.stats.counters.copy(),
        log=log_figures(replicated) if replicated is not None else None,
        frozen_objects=gc.get_freeze_count())


def read_replica_scrape(replica: Replica, now: float) -> ScrapeReading:
    """:func:`read_scrape`, with whether the replica is the active one (call on the
    allocator's event loop)."""
    snap = read_scrape(replica, now)
    snap.active = replica.active
    return snap


# --------------------------------------------------------------------------- families


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _exported(exported: Exported, counts: Mapping[str, int]) -> CounterMetricFamily:
    """``exported``'s family with ``counts``: label value -> count (without a label, the one
    count it has)."""
    if exported.label is None:
        return _counter(exported.name, exported.help, sum(counts.values()))
    family = CounterMetricFamily(exported.name, exported.help, labels=[exported.label])
    for value_label, value in sorted(counts.items()):
        family.add_metric([value_label], value)
    return family


def metric_families(snap: ScrapeReading) -> Iterator[Metric]:
    """The Prometheus families of one scrape's reading."""
    # The one figure the alerts and dashboard select the live view by: the cluster gauges
    # of a standby are not the live ones, and a restarted replica keeps its predecessor's
    # instance label, so its counters' rates cannot tell it apart for two minutes.
    yield GaugeMetricFamily("swarm_gpu_allocator_active", "1 if this replica is the active "
                            "allocator: it took a delivery within standby_after_s and, with "
                            "the ledger log, is its writer", value=int(snap.active))
    yield GaugeMetricFamily("swarm_gpu_allocator_heap_frozen_objects",
                            "Objects Python's cycle collector skips: the state loaded from "
                            "the ledger, frozen after each rebuild (0: not frozen)",
                            value=snap.frozen_objects)
    gpus = GaugeMetricFamily("swarm_gpu_gpus", "GPUs by model and state (free, held, "
                             "unhealthy, drained, down, conflict, draining, stuck_process, "
                             "outside_use)", labels=["model", "state"])
    for model in sorted({model for model, _ in snap.gpus}):
        for state in GPU_STATES:  # every state, zeros included, so series never vanish
            gpus.add_metric([model, state], snap.gpus.get((model, state), 0))
    yield gpus
    slots = GaugeMetricFamily("swarm_gpu_share_slots", "Share slots of shareable GPUs by "
                              "model, free or held", labels=["model", "state"])
    for (model, state), value in sorted(snap.slots.items()):
        slots.add_metric([model, state], value)
    yield slots
    leases = GaugeMetricFamily("swarm_gpu_leases", "Leases not yet final, by state",
                               labels=["state"])
    for state in LeaseState:
        if not state.final:
            leases.add_metric([state.value], snap.leases.get(state.value, 0))
    yield leases
    held = GaugeMetricFamily(
        "swarm_gpu_group_gpus_held", "GPUs held by the leases of each group's members (a "
        "slice counts 1/slots), by share: guaranteed (within every guarantee of the lease's "
        "owner) or borrowed (beyond one: reclaimable); groups with a guarantee only",
        labels=["group", "share"])
    for group, shares in sorted(snap.group_held.items()):
        for share in SHARES:  # both, zeros included, so series never vanish
            held.add_metric([group, share], float(shares[share]))
    yield held
    yield GaugeMetricFamily("swarm_gpu_queue_length", "Requests waiting for GPUs",
                            value=snap.queue_length)
    yield GaugeMetricFamily("swarm_gpu_queue_oldest_wait_seconds",
                            "How long the oldest queued request has waited (0 if none)",
                            value=snap.queue_oldest_wait_s)
    nodes = GaugeMetricFamily("swarm_gpu_nodes", "Nodes by state (up, down, drained)",
                              labels=["state"])
    nodes.add_metric(["up"], sum(1 for up, _, _ in snap.nodes.values() if up))
    nodes.add_metric(["down"], sum(1 for up, _, _ in snap.nodes.values() if not up))
    nodes.add_metric(["drained"], sum(1 for _, drained, _ in snap.nodes.values() if drained))
    yield nodes
    node_up = GaugeMetricFamily("swarm_gpu_node_up", "1 if the node's heartbeats arrive",
                                labels=["host"])
    beat = GaugeMetricFamily("swarm_gpu_node_last_heartbeat_timestamp_seconds",
                             "When the node's last heartbeat was received", labels=["host"])
    for host, (up, _, last) in sorted(snap.nodes.items()):
        node_up.add_metric([host], 1 if up else 0)
        if last is not None:
            beat.add_metric([host], last)
    yield node_up
    yield beat
    short = GaugeMetricFamily("swarm_gpu_booking_short_gpus", "GPUs a booking lacks in its "
                              "next short occurrence within a week, a node or GPU gone or "
                              "drained (0 when whole)", labels=["booking"])
    for booking, missing in sorted(snap.booking_short.items()):
        short.add_metric([booking], missing)
    yield short

    yield from counter_families(snap.engine_counters, snap.service_counters)
    if snap.log is not None:
        yield from log_families(snap.log)


_COUNT_FAMILIES: Mapping[Exported, tuple[Count, ...]] = {
    exported: tuple(count for count, other in COUNT_EXPORTED.items() if other == exported)
    for exported in dict.fromkeys(COUNT_EXPORTED.values())
}
"""Each family of plain counters with its members (one each, but the anomalies'), in the
order of their declaration."""


def counter_families(engine: Counters, service: Counters) -> Iterator[Metric]:
    """Every counter declared in :mod:`allocator.metrics.counters`, exported as declared there.

    A counter is counted by the engine or by the service, never both: the sum of the two
    reads it wherever it is counted.
    """
    for family, exported in FAMILY_EXPORTED.items():
        counts = Counter(engine.of(family))
        counts.update(service.of(family))
        yield _exported(exported, counts)
    for exported, members in _COUNT_FAMILIES.items():
        yield _exported(exported, {count.value: engine[count] + service[count]
                                   for count in members})


def log_families(figures: LogFigures) -> Iterator[Metric]:
    """The replicated ledger log's families (only with ``ledger_log = "stream"``)."""
    yield _counter("swarm_gpu_ledger_log_entries_applied", "Entries of the ledger log this "
                   "replica applied to its ledger", figures.entries_applied)
    yield _counter("swarm_gpu_ledger_log_entries_fenced", "Entries of the ledger log this "
                   "replica skipped as a deposed writer's", figures.entries_fenced)
    yield _counter("swarm_gpu_ledger_log_snapshots_taken", "Whole snapshots of the ledger "
                   "this replica appended to the log as its writer", figures.snapshots_taken)
    yield _counter("swarm_gpu_ledger_log_snapshots_loaded", "Snapshots this replica loaded "
                   "to catch up (its place in the log was gone, or it started empty)",
                   figures.snapshots_loaded)
    yield GaugeMetricFamily("swarm_gpu_ledger_log_writer", "1 if this replica is the ledger "
                            "log's writer (the active allocator)", value=int(figures.writer))
    yield GaugeMetricFamily("swarm_gpu_ledger_log_caught_up", "1 once this replica has "
                            "applied the log up to where it started", value=int(figures.caught_up))
    if figures.epoch is not None and figures.offset is not None:
        yield GaugeMetricFamily("swarm_gpu_ledger_log_epoch", "The epoch of the newest claim "
                                "this replica applied", value=figures.epoch)
        yield GaugeMetricFamily("swarm_gpu_ledger_log_offset", "The stream offset of the last "
                                "entry this replica applied", value=figures.offset)
    if figures.last_snapshot is not None:
        yield GaugeMetricFamily("swarm_gpu_ledger_log_last_snapshot_seconds", "How long this "
                                "replica's newest snapshot took, from reading the ledger to "
                                "its last part read back (requests wait meanwhile)",
                                value=figures.last_snapshot.seconds)
        yield GaugeMetricFamily("swarm_gpu_ledger_log_last_snapshot_bytes", "What the stream "
                                "holds of this replica's newest snapshot",
                                value=figures.last_snapshot.stored_bytes)


# --------------------------------------------------------------------------- collector


class AllocatorCollector(Collector):
    """Reads one allocator replica (:class:`Replica`) at scrape time."""

    def __init__(self, service: Replica, loop: asyncio.AbstractEventLoop | None,
                 *, clock: Callable[[], float] = time.time,
                 timeout_s: float = SNAPSHOT_TIMEOUT_S) -> None:
        self.service = service
        self.loop = loop
        self.clock = clock
        self.timeout_s = timeout_s

    def describe(self) -> Iterable[Metric]:
        # Registering must not scrape (the loop may not run yet): describe nothing, which
        # tells the registry to skip the duplicate-name check for this collector.
        return []

    def collect(self) -> Iterable[Metric]:
        try:
            snap = self._on_loop(lambda: read_replica_scrape(self.service, self.clock()))
        except Exception as exc:  # a scrape must answer, with what went wrong
            log.warning("metrics snapshot failed: %s", exc or type(exc).__name__)
            yield GaugeMetricFamily("swarm_gpu_metrics_ok", "1 if the last scrape could read "
                                    "the allocator's state", value=0)
            return
        yield GaugeMetricFamily("swarm_gpu_metrics_ok", "1 if the last scrape could read the "
                                "allocator's state", value=1)
        yield from metric_families(snap)

    def _on_loop(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the allocator's loop and wait for it (directly if already there)."""
        loop = self.loop
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if loop is None or running is loop:
            return fn()
        if loop.is_closed() or not loop.is_running():
            raise RuntimeError("the allocator's event loop is not running")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        loop.call_soon_threadsafe(run)
        try:
            return future.result(self.timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"the event loop did not answer within {self.timeout_s} s") \
                from None


@dataclass
class MetricsServer:
    """The HTTP endpoint serving one service's registry; :meth:`close` stops it."""

    endpoint: http_endpoint.MetricsServer
    metrics: AllocatorMetrics
    collector: AllocatorCollector

    @property
    def port(self) -> int:
        """The port it listens on (useful when started on port 0)."""
        return self.endpoint.port

    def close(self) -> None:
        """Stop serving and unregister the collector."""
        self.endpoint.close()
        self.metrics.uninstall(self.collector)


def serve(service: Replica, port: int, addr: str = "0.0.0.0",
          loop: asyncio.AbstractEventLoop | None = None, *,
          token: str | None = None,
          health: http_endpoint.ProcessHealth | None = None) -> MetricsServer:
    """Serve the allocator's metrics on ``addr:port`` (``/metrics``) from a daemon thread;
    with ``token`` (``metrics_token``), only to requests that send it
    (:func:`allocator.metrics.endpoint.serve_registry`); with ``health``, ``/healthz`` too.

    Call it from the allocator's event loop (or pass ``loop``): the collector reads the
    engine there.
    """
    if loop is None:
        loop = asyncio.get_running_loop()
    collector = service.metrics.install(service, loop)
    try:
        endpoint = http_endpoint.serve_registry(service.metrics.registry, port, addr, token,
                                                health)
    except OSError:
        service.metrics.uninstall(collector)
        raise
    log.info("metrics on http://%s:%d/metrics%s", addr, endpoint.port,
             " (token required)" if token is not None else "")
    return MetricsServer(endpoint, service.metrics, collector)
