"""Every counter declared in ``allocator.metrics.counters`` reaches ``/metrics``, under its name.

The declaration (``Count``, ``Family`` and how each is exported) is the one list; these
tests walk the enums themselves, so a counter added without its export, or an export the
collector leaves out, fails here.
"""

from __future__ import annotations

import asyncio
import urllib.request
from types import MappingProxyType

import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from allocator.engine import CLOCK_SKEW_WARN_S
from allocator.metrics import counters
from allocator.metrics import exporter as metrics
from allocator.metrics.counters import COUNT_EXPORTED, Count, Counters, Family

PUBLISHED = {
    # Dashboards and alerts use these names: a rename is a breaking change, made here too.
    "swarm_gpu_adoptions", "swarm_gpu_allocate_retries", "swarm_gpu_anomalies",
    "swarm_gpu_batch_failures", "swarm_gpu_batches", "swarm_gpu_binds",
    "swarm_gpu_command_failures", "swarm_gpu_commands_sent", "swarm_gpu_commit_failures",
    "swarm_gpu_hellos_sent",
    "swarm_gpu_container_events", "swarm_gpu_container_stops_asked",
    "swarm_gpu_dead_lettered", "swarm_gpu_expired_requests_dropped",
    "swarm_gpu_fenced_batches", "swarm_gpu_grants", "swarm_gpu_heartbeat_clock_skew",
    "swarm_gpu_heartbeat_delta_gaps", "swarm_gpu_heartbeat_deltas",
    "swarm_gpu_heartbeat_deltas_unapplied", "swarm_gpu_heartbeats",
    "swarm_gpu_heartbeats_unreadable",
    "swarm_gpu_heartbeats_stale", "swarm_gpu_invalid_messages",
    "swarm_gpu_ledger_rows_pruned", "swarm_gpu_messages_received",
    "swarm_gpu_node_down_events", "swarm_gpu_node_events_unrecorded",
    "swarm_gpu_node_messages_rejected",
    "swarm_gpu_poisoned_messages", "swarm_gpu_push_failures", "swarm_gpu_pushes",
    "swarm_gpu_queued", "swarm_gpu_queued_behind_fence", "swarm_gpu_reclaim_warnings",
    "swarm_gpu_redelivered_decided", "swarm_gpu_refusals", "swarm_gpu_releases",
    "swarm_gpu_replies", "swarm_gpu_reply_failures", "swarm_gpu_reply_to_refused",
    "swarm_gpu_stale_deliveries", "swarm_gpu_takeovers",
}
"""The counter families on ``/metrics`` (samples ``<name>_total``)."""

LABEL = "test-label"


def expected_samples(base: int) -> dict[str, int]:
    """``{'name{labels}': value}`` for every declared counter, counted as :func:`count_all`
    counts them: each a value of its own, so an export that reads the wrong counter fails."""
    samples = {}
    for index, count in enumerate(Count):
        exported = count.exported
        labels = "" if exported.label is None else f'{{{exported.label}="{count.value}"}}'
        samples[f"{exported.name}_total{labels}"] = base * (index + 1)
    for index, family in enumerate(Family):
        exported = family.exported
        samples[f'{exported.name}_total{{{exported.label}="{LABEL}"}}'] = base * (index + 101)
    return samples


def count_all(engine: Counters, service: Counters, base: int) -> None:
    """Count every declared counter, alternately in the engine's and the service's
    :class:`Counters`: the export must read each wherever it is counted."""
    for index, count in enumerate(Count):
        (engine if index % 2 else service).add(count, base * (index + 1))
    for index, family in enumerate(Family):
        (engine if index % 2 else service).add_to(family, LABEL, base * (index + 101))


def flatten(samples: list[Sample]) -> dict[str, float]:
    return {sample.name + ("{" + ",".join(f'{k}="{v}"' for k, v in sample.labels.items()) + "}"
                           if sample.labels else ""): sample.value
            for sample in samples}


def test_the_declared_names_are_the_published_ones() -> None:
    declared = {count.exported.name for count in Count} | {f.exported.name for f in Family}
    assert declared == PUBLISHED
    assert f"{CLOCK_SKEW_WARN_S:g} s" in Count.HEARTBEAT_CLOCK_SKEW.exported.help


def test_the_collector_exports_every_declared_counter() -> None:
    snap = metrics.ScrapeReading()
    count_all(snap.engine_counters, snap.service_counters, base=1)
    families = {family.name: family for family in metrics.metric_families(snap)}
    declared = [*Count, *Family]
    for what in declared:
        exported = what.exported
        assert exported.name in families, f"{what!r} is not exported"
        family = families[exported.name]
        assert (family.type, family.documentation) == (exported.type, exported.help), what
    samples = flatten([s for f in families.values() for s in f.samples])
    for name, value in expected_samples(base=1).items():
        assert samples.get(name) == value, name


def test_an_undeclared_export_is_refused_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    fewer = {count: exported for count, exported in COUNT_EXPORTED.items()
             if count is not Count.POISONED}
    monkeypatch.setattr(counters, "COUNT_EXPORTED", MappingProxyType(fewer))
    with pytest.raises(TypeError, match="POISONED"):
        counters._check_exports()
    twice = {**COUNT_EXPORTED, Count.POISONED: Count.GRANTED.exported}
    monkeypatch.setattr(counters, "COUNT_EXPORTED", MappingProxyType(twice))
    with pytest.raises(TypeError, match="swarm_gpu_grants"):
        counters._check_exports()


def scrape_families(port: int) -> dict[str, tuple[str, dict[str, float]]]:
    """GET /metrics as Prometheus would: family name -> (type, flattened samples)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {family.name: (family.type, flatten(family.samples))
            for family in text_string_to_metric_families(text)}


async def test_a_real_scrape_has_every_declared_counter(allocator) -> None:
    base = 1_000_000  # far above what the running allocator counts by itself meanwhile
    count_all(allocator.engine.counters, allocator.stats.counters, base)
    server = metrics.serve(allocator, port=0, addr="127.0.0.1")
    try:
        families = await asyncio.to_thread(scrape_families, server.port)
    finally:
        server.close()
    for what in [*Count, *Family]:
        exported = what.exported
        assert exported.name in families, f"{what!r} is not on /metrics"
        assert families[exported.name][0] == exported.type, what
    scraped = {name: value for _, samples in families.values()
               for name, value in samples.items()}
    for name, value in expected_samples(base).items():
        assert value <= scraped.get(name, -1) < value + base, name
