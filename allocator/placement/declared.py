"""What the site declared a node has: GPUs a host reports beyond it are not placed.

Pure policy, no I/O: given the GPUs a host lists and what ``declared_gpus`` says it has (per
model, in the names admins type: reported names or aliases), say which GPUs are beyond the
declaration. The engine keeps those out of placement and shows them as a conflict
(:mod:`allocator.engine.gpus`).

A node's agent is trusted for what its host has, but its credential can report GPUs that do
not exist (up to ``max_gpus_per_host``), and placements would go to them. Where the site says
what each node has, a report beyond it is a conflict for a person to look at, not a placement
target. The first GPUs of a model by index are the declared ones, so a report that adds GPUs
never takes the place of those already there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from allocator.placement.cluster import GPU
from allocator.wire.model_names import ModelNames


def beyond_declared(host: str, gpus: Sequence[GPU], declared: Mapping[str, int],
                    aliases: Mapping[str, str]) -> dict[str, str]:
    """GPU uuid -> why it is beyond what ``declared`` (model spelling -> count) allows for
    ``host``, for each of ``gpus`` (the host's present GPUs, in index order) that is. A MIG
    instance follows its GPU: only whole GPUs are counted."""
    names = ModelNames.build({gpu.model for gpu in gpus}, aliases)
    allowed: Counter[str] = Counter()
    for spelling, count in declared.items():
        model = names.canonical(spelling)
        if model is not None:
            allowed[model] += count
    seen: Counter[str] = Counter()
    beyond: dict[str, str] = {}
    for gpu in gpus:
        if gpu.mig_parent_uuid is not None:
            continue
        seen[gpu.model] += 1
        if seen[gpu.model] > allowed[gpu.model]:
            beyond[gpu.uuid] = (
                f"{host} reports GPU {gpu.uuid} (index {gpu.index}) as its "
                f"{_nth(seen[gpu.model])} {gpu.model}, but the site declares "
                f"{allowed[gpu.model]} of that model for it (declared_gpus): not placed")
    for gpu in gpus:
        if gpu.mig_parent_uuid in beyond:
            beyond[gpu.uuid] = beyond[gpu.mig_parent_uuid]
    return beyond


def _nth(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
