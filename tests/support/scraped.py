"""An engine as the metrics read a service (:class:`allocator.metrics.exporter.Observed`),
without the service around it: for tests and benchmarks of what a scrape reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from allocator.engine import Engine
from allocator.metrics.counters import ServiceStats
from allocator.metrics.exporter import AllocatorMetrics


@dataclass
class EngineOnly:
    """What the metrics read of a service: here, only the engine is of interest."""

    engine: Engine
    stats: ServiceStats = field(default_factory=ServiceStats)
    metrics: AllocatorMetrics = field(default_factory=AllocatorMetrics)
    log: None = None
