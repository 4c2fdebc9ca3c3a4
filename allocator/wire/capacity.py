"""How many GPUs one request can get from one host: the rule the allocator's policy and the
hub's options check share, so that they never disagree on what could ever fit.

Pure: plain data in and out, no I/O, nothing else of the allocator imported (the hub loads
this module). Callers pick the GPUs that count (present, not a GPU in MIG mode, of a model
the request accepts, on a host it may use); this module says how one request may combine
them:

* The GPUs of one request are on one host and, for a number of whole GPUs, all of **one
  model**: a host with one GTX 1070 and one RTX 3090 gives a request of "2 GPUs" nothing,
  whichever models it accepts.
* "All GPUs of a host" is every counted GPU of the host, of every model together when the
  request accepts **any** model (no model and no list named); when it names a model, or a
  list of them, it is every GPU of the one model it gets there.

The allocator's :func:`allocator.placement.policy.feasible` answers "could this ever fit" from these
groups; the hub's :func:`hubplugin.options.check_options` refuses early, with its own words,
exactly what the allocator would refuse.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class GPUGroup:
    """GPUs of one host that one request can take together."""

    host: str
    model: str | None
    """Their one model; None for "all GPUs of a host" of any model, which mixes models."""
    gpus: int
    """How many."""


def mixes_models(*, all_of_host: bool, any_model: bool) -> bool:
    """Whether one request's GPUs may be of several models: only "all GPUs of a host" of a
    request that accepts any model (the lease of a count is one model: its container sees one
    kind of GPU, and a per-model quota counts it as that model)."""
    return all_of_host and any_model


def gpu_groups(gpus: Iterable[tuple[str, str]], *, all_of_host: bool = False,
               any_model: bool = False) -> list[GPUGroup]:
    """The groups of ``(host, model)`` GPUs one request can take together, largest first
    (ties by host, then model: a stable order for messages).

    ``gpus`` are the GPUs that count for the request, one ``(host, model)`` pair each.
    ``all_of_host`` and ``any_model`` say what kind of request it is (:func:`mixes_models`).
    """
    mixed = mixes_models(all_of_host=all_of_host, any_model=any_model)
    counts: dict[tuple[str, str | None], int] = {}
    for host, model in gpus:
        key = (host, None if mixed else model)
        counts[key] = counts.get(key, 0) + 1
    groups = [GPUGroup(host, model, n) for (host, model), n in counts.items()]
    return sorted(groups, key=lambda g: (-g.gpus, g.host, g.model or ""))


def most_per_host(groups: Iterable[GPUGroup]) -> dict[str, int]:
    """Host -> the most GPUs one request can get there (its largest group), sorted by host."""
    most: dict[str, int] = {}
    for group in groups:
        most[group.host] = max(most.get(group.host, 0), group.gpus)
    return dict(sorted(most.items()))


def largest_group(groups: Iterable[GPUGroup]) -> GPUGroup | None:
    """The group that can give one request the most GPUs (ties: first host, then model), or
    None when no GPU counts."""
    return min(groups, key=lambda g: (-g.gpus, g.host, g.model or ""), default=None)


def fits_count(count: int, groups: Iterable[GPUGroup]) -> bool:
    """Whether some host can give one request ``count`` whole GPUs (of one model)."""
    largest = largest_group(groups)
    return largest is not None and largest.gpus >= count
