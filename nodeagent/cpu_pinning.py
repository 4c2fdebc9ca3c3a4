"""Pinning a lease's container to the CPUs near its GPUs (the agent's ``pin_cpus`` setting).

A Swarm service cannot be given a cpuset, but Docker lets anyone with its API change a
running container's (``POST /containers/{id}/update`` with ``CpusetCpus``, what ``docker
update --cpuset-cpus`` sends), a Swarm task's container too. So, with ``pin_cpus`` on, the
agent pins each lease container it sees start (and each one already running when it starts)
to the union of the CPUs near the GPUs its grant labels name, from the agent's own reading
of the host's interconnect (:attr:`allocator.wire.interconnect.HostGpu.cpus`). A MIG instance
takes its parent GPU's CPUs; a shared slice is pinned as its GPU's socket too.

:func:`cpus_near` is the pure part. :class:`CpuPinner` carries it out through a call it is
given (the Docker watcher's, bounded by its timeout), one task per container, never twice at
once for one container, and counts each outcome: ``pinned``, ``failed`` (Docker refused, the
container was gone, the engine did not answer: logged once per container, never retried
until the container starts again) and ``unknown`` (the CPUs of its GPUs are not known: no
grant labels, no interconnect, a GPU the reading does not name or gives no CPUs for; nothing
is done).

Swarm does not know of the pinning: a restarted task is a new container, pinned again when
it starts; until the agent's update lands (milliseconds after the start), the container runs
on every CPU.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from enum import StrEnum
from typing import TYPE_CHECKING

from allocator.tasks import cancel_and_wait
from allocator.wire.interconnect import HostInterconnect, cpulist_ranges

if TYPE_CHECKING:
    from nodeagent.containers import LeaseContainer

log = logging.getLogger(__name__)


class PinOutcome(StrEnum):
    """What pinning one container came to (the ``outcome`` label of its counter)."""

    PINNED = "pinned"
    """Docker took the cpuset."""
    FAILED = "failed"
    """Docker refused it (a CPU it does not have), the container was gone, or the engine did
    not answer in time."""
    UNKNOWN = "unknown"
    """The CPUs near its GPUs are not known: nothing was done."""


PIN_OUTCOMES = tuple(PinOutcome)

UpdateCpuset = Callable[[str, str], Awaitable[None]]
"""``(container_id, cpulist)``: set the container's cpuset; raises when that did not work."""


def cpulist_union(cpulists: Iterable[str]) -> str:
    """The CPUs of several Linux cpulists as one (``"0-3"`` and ``"4,8"`` → ``"0-4,8"``):
    ranges in increasing order, those that touch or overlap joined. ValueError for a list not
    in Linux's form (:func:`allocator.wire.interconnect.cpulist_ranges`)."""
    ranges = sorted(r for cpulist in cpulists for r in cpulist_ranges(cpulist))
    joined: list[list[int]] = []
    for low, high in ranges:
        if joined and low <= joined[-1][1] + 1:
            joined[-1][1] = max(joined[-1][1], high)
        else:
            joined.append([low, high])
    return ",".join(f"{low}" if low == high else f"{low}-{high}" for low, high in joined)


def cpus_near(gpu_uuids: Sequence[str], interconnect: HostInterconnect | None,
              mig_parents: Mapping[str, str]) -> str | None:
    """The CPUs near every GPU of ``gpu_uuids`` (a MIG instance: its parent's, by
    ``mig_parents``) as one cpulist; None when any of them is not known (no GPUs, no
    interconnect, a GPU it does not name or gives no CPUs for). Never the CPUs of some of the
    GPUs only: that would keep the others' threads off their own socket."""
    if not gpu_uuids or interconnect is None:
        return None
    cpulists = []
    for uuid in gpu_uuids:
        gpu_uuid = mig_parents.get(uuid, uuid)
        if gpu_uuid not in interconnect.uuids:
            return None
        cpus = interconnect.gpus[interconnect.index_of(gpu_uuid)].cpus
        if cpus is None:
            return None
        cpulists.append(cpus)
    return cpulist_union(cpulists)


class CpuPinner:
    """Pins lease containers to their GPUs' CPUs through ``update``, one task per container.

    :meth:`pin` pins one container (a start event: again even if it was pinned before, since
    a restarted container may have lost it); :meth:`pin_unseen` pins the running ones not
    handled yet (at the agent's start, after a gap in the event stream, in listing mode) and
    forgets the ones no longer running.
    """

    def __init__(self, update: UpdateCpuset) -> None:
        self._update = update
        self.counters: Counter[str] = Counter({outcome.value: 0 for outcome in PinOutcome})
        """Containers by :class:`PinOutcome` (read by the metrics' thread: one C-level copy)."""
        self._handled: set[str] = set()
        """Container ids whose pinning ended (any outcome) while they run."""
        self._tasks: dict[str, asyncio.Task[None]] = {}
        """Container id -> its pinning under way."""

    def pin(self, container: LeaseContainer, interconnect: HostInterconnect | None,
            mig_parents: Mapping[str, str]) -> None:
        """Pin ``container`` now (in a task), unless its pinning is under way already."""
        if container.container_id in self._tasks:
            return
        self._handled.discard(container.container_id)
        self._start(container, interconnect, mig_parents)

    def pin_unseen(self, running: Sequence[LeaseContainer],
                   interconnect: HostInterconnect | None,
                   mig_parents: Mapping[str, str]) -> None:
        """Pin every container of ``running`` not handled yet; forget the others."""
        running_ids = {c.container_id for c in running}
        self._handled &= running_ids
        for container in running:
            if container.container_id not in self._handled \
                    and container.container_id not in self._tasks:
                self._start(container, interconnect, mig_parents)

    async def wait(self) -> None:
        """Wait for the pinnings under way (tests, and a clean stop)."""
        while self._tasks:
            await asyncio.wait(list(self._tasks.values()))

    async def stop(self) -> None:
        """Cancel the pinnings under way."""
        await cancel_and_wait(list(self._tasks.values()))
        self._tasks.clear()

    def _start(self, container: LeaseContainer, interconnect: HostInterconnect | None,
               mig_parents: Mapping[str, str]) -> None:
        task = asyncio.create_task(self._pin(container, interconnect, mig_parents),
                                   name="pin-cpus")
        self._tasks[container.container_id] = task

    async def _pin(self, container: LeaseContainer, interconnect: HostInterconnect | None,
                   mig_parents: Mapping[str, str]) -> None:
        short = container.container_id[:12]
        extra = {"lease_id": container.lease_id}
        try:
            gpu_uuids = container.grant.gpu_uuids if container.grant is not None else []
            cpus = cpus_near(gpu_uuids, interconnect, mig_parents)
            if cpus is None:
                self.counters[PinOutcome.UNKNOWN] += 1
                log.info("container %s (lease %s): the CPUs near its GPUs are not known (%s); "
                         "left on every CPU", short, container.lease_id,
                         "no grant labels" if container.grant is None
                         else "no interconnect read" if interconnect is None
                         else f"GPUs {', '.join(gpu_uuids)}", extra=extra)
                return
            try:
                await self._update(container.container_id, cpus)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.counters[PinOutcome.FAILED] += 1
                log.warning("container %s (lease %s): pinning it to CPUs %s failed (%s); it "
                            "runs on every CPU", short, container.lease_id, cpus,
                            f"{type(exc).__name__}: {exc}", extra=extra)
                return
            self.counters[PinOutcome.PINNED] += 1
            log.info("container %s (lease %s): pinned to CPUs %s, near its GPUs", short,
                     container.lease_id, cpus, extra=extra)
        finally:
            self._handled.add(container.container_id)
            self._tasks.pop(container.container_id, None)
