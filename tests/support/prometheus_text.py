"""A Prometheus endpoint read over HTTP, and one sample picked out of its text."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[str, list[tuple[dict[str, str], float]]]
"""Sample name -> (labels, value) of each of its samples."""


def scrape_text(port: int) -> str:
    """GET /metrics from the agent's real HTTP endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


async def scrape(port: int) -> Samples:
    return parse(await asyncio.to_thread(scrape_text, port))


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The value of the one sample of ``name`` whose labels include ``labels``."""
    found = [v for got, v in samples.get(name, [])
             if all(got.get(k) == want for k, want in labels.items())]
    assert len(found) <= 1, f"{name}{labels}: {len(found)} samples"
    return found[0] if found else None
