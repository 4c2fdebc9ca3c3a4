"""Prometheus metrics of the allocator, on a port of their own.

Two parts, so that the request path pays (almost) nothing:

- :func:`observe_request` records one request's latency in a histogram: the only call the
  service makes per request (a dictionary lookup and an add under a lock).
- :class:`AllocatorCollector` computes everything else *at scrape time* from what the engine
  and the service already keep (their counters, the cluster, the leases). The snapshot is
  taken on the allocator's event loop, between two batches, because the engine's dicts are
  only consistent there; the HTTP server thread waits for it (bounded) instead of reading
  them while the loop changes them.

Everything lives in :data:`REGISTRY`, this module's own registry, so the process-wide default
registry (and whatever else registers there) stays out of the allocator's endpoint.
Start it with :func:`serve`; see ``docs/operations.md`` for the metric list.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from allocator.protocol import Health, LeaseState

if TYPE_CHECKING:
    from allocator.service import AllocatorService

log = logging.getLogger(__name__)
T = TypeVar("T")

REGISTRY = CollectorRegistry()
"""The allocator's registry: the request histogram and, once :func:`serve` ran, the collector."""

REQUEST_KINDS = frozenset({"allocate", "release", "status", "inventory", "drain", "queue",
                           "heartbeat", "container_event", "invalid"})
"""Label values of the request histogram; anything else is counted as ``other`` so a
hostile ``kind`` cannot grow the number of time series."""

REQUEST_SECONDS = Histogram(
    "swarm_gpu_request_seconds",
    "Seconds from the start of applying a message's batch (decode, decide, commit to the "
    "ledger) until its reply was sent and the batch acknowledged, by message kind",
    ["kind"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
    registry=REGISTRY,
)

GPU_STATES = ("free", "held", "unhealthy", "drained", "down", "conflict")
"""Each present GPU is in exactly one: conflict (a running container's grant contradicts the
ledger on it) first, then held (any claim), unhealthy, drained (the GPU or its node), down
(its node is silent), else free."""

SNAPSHOT_TIMEOUT_S = 2.0
"""How long a scrape waits for the event loop; a loop blocked longer is itself the news."""


def observe_request(kind: str, seconds: float) -> None:
    """Record the latency of one request of ``kind`` (``allocate``, ``heartbeat``...)."""
    label = kind if kind in REQUEST_KINDS else "other"
    REQUEST_SECONDS.labels(label).observe(seconds)


# --------------------------------------------------------------------------- snapshot


@dataclass
class Snapshot:
    """What one scrape reports, read from the engine and the service in one go."""

    gpus: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(model, state) -> GPUs"""
    slots: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(model, free|held) -> share slots, for models with more than one slot"""
    leases: Counter[str] = field(default_factory=Counter)
    queue_length: int = 0
    queue_oldest_wait_s: float = 0.0
    nodes: dict[str, tuple[bool, bool, float | None]] = field(default_factory=dict)
    """host -> (up, drained, last heartbeat)"""
    engine_counters: Counter[str] = field(default_factory=Counter)
    service_counters: Counter[str] = field(default_factory=Counter)


def take_snapshot(service: AllocatorService, now: float) -> Snapshot:
    """Read the engine and the service (call on the allocator's event loop)."""
    engine = service.engine
    snap = Snapshot(engine_counters=Counter(engine.counters),
                    service_counters=Counter(service.stats.counters))
    inventory = engine.inventory(now)
    node_drained = {node.host: node.drained for node in inventory.nodes}
    node_up = {node.host: node.up for node in inventory.nodes}
    for node in inventory.nodes:
        snap.nodes[node.host] = (node.up, node.drained, node.last_heartbeat)
    for gpu in inventory.gpus:
        if gpu.conflict is not None:
            state = "conflict"
        elif gpu.holders:
            state = "held"
        elif gpu.health is not Health.HEALTHY:
            state = "unhealthy"
        elif gpu.drained or node_drained.get(gpu.host, False):
            state = "drained"
        elif not node_up.get(gpu.host, False):
            state = "down"
        else:
            state = "free"
        snap.gpus[gpu.model, state] += 1
        if gpu.share_slots > 1:
            snap.slots[gpu.model, "free"] += gpu.free_slots
            snap.slots[gpu.model, "held"] += gpu.share_slots - gpu.free_slots
    oldest: float | None = None
    for record in engine.leases.values():
        snap.leases[record.state.value] += 1
        if record.state is LeaseState.QUEUED:
            snap.queue_length += 1
            since = record.enqueued_at or record.created_at
            oldest = since if oldest is None else min(oldest, since)
    snap.queue_oldest_wait_s = max(now - oldest, 0.0) if oldest is not None else 0.0
    return snap


# --------------------------------------------------------------------------- families


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _labelled_counter(name: str, doc: str, label: str, counters: Mapping[str, int],
                      prefix: str, suffix: str = "") -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in sorted(counters.items()):
        if key.startswith(prefix) and key.endswith(suffix):
            family.add_metric([key[len(prefix):len(key) - len(suffix)]], value)
    return family


def metric_families(snap: Snapshot) -> Iterator[Metric]:
    """The Prometheus families of one snapshot."""
    gpus = GaugeMetricFamily("swarm_gpu_gpus", "GPUs by model and state (free, held, "
                             "unhealthy, drained, down, conflict)", labels=["model", "state"])
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

    engine, service = snap.engine_counters, snap.service_counters
    yield _labelled_counter("swarm_gpu_releases", "Leases ended, by release reason", "reason",
                            engine, "released_")
    yield _labelled_counter("swarm_gpu_refusals", "Allocate requests refused, by error code",
                            "code", engine, "refused_")
    yield _labelled_counter("swarm_gpu_container_events", "Container events from node agents",
                            "action", engine, "event_")
    yield _labelled_counter("swarm_gpu_node_messages_rejected", "Node messages refused "
                            "because their broker user does not own the host", "kind",
                            engine, "", "_rejected")
    yield _labelled_counter("swarm_gpu_invalid_messages", "Messages that did not decode, by "
                            "error code", "code", service, "invalid_")
    yield _labelled_counter("swarm_gpu_container_stops_asked", "Stop commands to node agents "
                            "decided, by reason", "reason", engine, "stop_asked_")
    anomalies = CounterMetricFamily("swarm_gpu_anomalies", "Things a node or client did that "
                                    "should not happen", labels=["kind"])
    for kind in ("zombie_container", "unknown_lease_container", "adoption_conflict",
                 "over_budget", "duplicate_gpu",
                 "node_message_wrong_exchange", "request_from_node_exchange"):
        anomalies.add_metric([kind], engine.get(kind, 0))
    yield anomalies
    for name, doc, value in (
        ("swarm_gpu_grants", "Leases granted (now or from the queue)", engine["granted"]),
        ("swarm_gpu_queued", "Requests that had to wait", engine["queued"]),
        ("swarm_gpu_binds", "Leases bound to a running container", engine["bound"]),
        ("swarm_gpu_adoptions", "Leases the ledger did not know, taken back from a running "
         "container's grant labels", engine["adopted"]),
        ("swarm_gpu_allocate_retries", "Allocate retries answered with the existing lease",
         engine["allocate_retry"]),
        ("swarm_gpu_heartbeats", "Heartbeats applied", engine["heartbeats"]),
        ("swarm_gpu_heartbeats_stale", "Heartbeats ignored as replayed or reordered",
         engine["heartbeat_stale"]),
        ("swarm_gpu_node_down_events", "Times a node was marked down", engine["node_down"]),
        ("swarm_gpu_messages_received", "Messages taken off the inbound queue",
         service["received"]),
        ("swarm_gpu_replies", "Replies sent", service["replies"]),
        ("swarm_gpu_commands_sent", "Commands published to node agents",
         service["commands_sent"]),
        ("swarm_gpu_command_failures", "Commands to node agents that could not be published",
         service["command_failures"]),
        ("swarm_gpu_reply_failures", "Replies that could not be sent", service["reply_failures"]),
        ("swarm_gpu_dead_lettered", "Messages sent to the dead-letter queue",
         service["dead_lettered"]),
        ("swarm_gpu_expired_requests_dropped", "Requests dropped because their sender had "
         "given up", service["expired_dropped"]),
        ("swarm_gpu_commit_failures", "Ledger commits that failed (nothing was granted)",
         service["commit_failures"]),
        ("swarm_gpu_batch_failures", "Batches that hit an internal error",
         service["batch_failures"]),
        ("swarm_gpu_takeovers", "Times this allocator found the ledger written by another "
         "(a standby taking over)", service["takeovers"]),
    ):
        yield _counter(name, doc, value)


# --------------------------------------------------------------------------- collector


class AllocatorCollector(Collector):
    """Reads one :class:`~allocator.service.AllocatorService` at scrape time."""

    def __init__(self, service: AllocatorService, loop: asyncio.AbstractEventLoop | None,
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
            snap = self._on_loop(lambda: take_snapshot(self.service, self.clock()))
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


_installed: AllocatorCollector | None = None
_install_lock = threading.Lock()


def install(service: AllocatorService,
            loop: asyncio.AbstractEventLoop | None = None) -> AllocatorCollector:
    """Register a collector for ``service`` in :data:`REGISTRY`, replacing an earlier one.

    One allocator per process is the deployment; replacing (not adding) keeps a restarted
    service in the same process (tests, a takeover drill) from reporting twice.
    """
    global _installed
    collector = AllocatorCollector(service, loop)
    with _install_lock:
        if _installed is not None:
            REGISTRY.unregister(_installed)
        REGISTRY.register(collector)
        _installed = collector
    return collector


def uninstall(collector: AllocatorCollector) -> None:
    """Remove a collector that :func:`install` registered (no-op if it was replaced)."""
    global _installed
    with _install_lock:
        if _installed is collector:
            REGISTRY.unregister(collector)
            _installed = None


@dataclass
class MetricsServer:
    """The HTTP endpoint serving :data:`REGISTRY`; :meth:`close` stops it."""

    server: WSGIServer
    thread: threading.Thread
    collector: AllocatorCollector

    @property
    def port(self) -> int:
        """The port it listens on (useful when started on port 0)."""
        return int(self.server.server_address[1])

    def close(self) -> None:
        """Stop serving and unregister the collector."""
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
        uninstall(self.collector)


def serve(service: AllocatorService, port: int, addr: str = "0.0.0.0",
          loop: asyncio.AbstractEventLoop | None = None) -> MetricsServer:
    """Serve the allocator's metrics on ``addr:port`` (``/metrics``) from a daemon thread.

    Call it from the allocator's event loop (or pass ``loop``): the collector reads the
    engine there.
    """
    if loop is None:
        loop = asyncio.get_running_loop()
    collector = install(service, loop)
    try:
        server, thread = start_http_server(port, addr, registry=REGISTRY)
    except OSError:
        uninstall(collector)
        raise
    log.info("metrics on http://%s:%d/metrics", addr, server.server_address[1])
    return MetricsServer(server, thread, collector)


def render(service: AllocatorService) -> dict[str, Any]:
    """The current metrics as ``{sample name with labels: value}`` (for tests and debugging)."""
    collector = AllocatorCollector(service, None)
    samples: dict[str, Any] = {}
    for family in [*collector.collect(), *REQUEST_SECONDS.collect()]:
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples
