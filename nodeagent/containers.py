"""The Docker side: lease-labelled containers on this host and their start/end events.

The hub's spawner puts the container label :data:`LEASE_LABEL` (value: the lease id) on every
notebook container. :class:`ContainerWatcher` keeps the set of running containers that carry
it and calls back at once on ``start``, ``die``, ``oom`` and ``destroy`` events, which is how a
GPU comes back the moment its notebook dies.

aiodocker's event stream does not reconnect by itself, and it ends *quietly* when the
connection drops (its reader treats a closed connection as the end of the stream). So the
watcher treats any end of the stream, any error, and an engine that stops answering pings as
a broken stream, and then:

1. marks the container list incomplete (heartbeats say ``containers_complete=False``, so the
   allocator releases nothing on the strength of a list it cannot trust);
2. backs off (bounded exponential) and re-lists the running lease containers;
3. resumes the stream with ``since`` = the time of the last event it saw, so Docker replays
   what happened during the gap (deaths included) — duplicates of events already seen are
   dropped;
4. after a short grace for that replay, reports a ``die`` itself for every container that was
   running before the gap, is no longer running, and whose end no event reported (Docker keeps
   only a bounded number of past events), so no death is missed silently.

:meth:`ContainerWatcher.stop_lease_container` stops a lease container when the allocator asks
(see :mod:`nodeagent.commands`): only a container that carries the lease label with the very
lease id named, never anything else on the host.

:meth:`ContainerWatcher.update_cpuset` sets a container's cpuset for
:mod:`nodeagent.cpu_pinning` (the ``pin_cpus`` setting).

With ``events=False`` (the agent's ``docker_events`` setting) the watcher follows no event
stream at all: :meth:`ContainerWatcher.refresh` re-lists the running lease containers, which
the agent does before every heartbeat, and nothing is reported between heartbeats. A death is
then noticed only by the allocator's heartbeat reconciliation.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import aiodocker
import aiohttp
from aiodocker.containers import DockerContainer
from aiodocker.events import DockerEvents

from allocator.tasks import Backoff, cancel_and_wait
from allocator.wire.lease_container import (
    LEASE_LABEL as LEASE_LABEL,  # re-exported: the agent's label
)
from allocator.wire.lease_container import grant_from_labels
from allocator.wire.protocol import ContainerGrant
from nodeagent.gpu_processes import ContainerDetails

log = logging.getLogger(__name__)

SHUTDOWN_STEP_S = 2.0
"""Bound on each step of closing an event stream."""

WATCHED_ACTIONS = ("start", "die", "oom", "destroy")
"""Docker container actions forwarded as container events."""

_SEEN_EVENTS = 4096
"""Recent event keys remembered to drop duplicates after a replay."""


@dataclass(frozen=True)
class LeaseContainer:
    """A running container that carries the lease label."""

    container_id: str
    lease_id: str
    name: str = ""
    started_at: float | None = None
    """Epoch seconds: from the start event, or the creation time when only listed."""
    grant: ContainerGrant | None = None
    """The grant its labels carry (see :mod:`allocator.wire.lease_container`); None without grant
    labels."""


@dataclass(frozen=True)
class ContainerChange:
    """One watched event of a lease container."""

    container_id: str
    lease_id: str
    action: str
    at: float
    exit_code: int | None = None
    name: str = ""
    synthesized: bool = False
    """True for a death the watcher inferred after a gap in the event stream."""
    grant: ContainerGrant | None = None
    """The grant the container's labels carry (Docker puts the labels on every event)."""


class StopOutcome(StrEnum):
    """What :meth:`ContainerWatcher.stop_lease_container` did."""

    STOPPED = "stopped"
    """It ran and has stopped now (SIGTERM, and SIGKILL if the grace ran out)."""
    NOT_RUNNING = "not_running"
    """It exists but had ended already."""
    GONE = "gone"
    """No such container (removed already): nothing to do."""
    WRONG_LEASE = "wrong_lease"
    """It does not carry the lease label with that lease id: left alone."""


ChangeCallback = Callable[[ContainerChange], Awaitable[None] | None]
ResyncCallback = Callable[[], Awaitable[None] | None]
CallObserver = Callable[[str, float, bool], None]
"""``(call, seconds, ok)`` after every Docker API call, for the agent's metrics; the calls
are named as in :data:`nodeagent.metrics.DOCKER_CALLS`."""


async def _call(callback: Callable[..., Any] | None, *args: Any) -> None:
    if callback is None:
        return
    try:
        result = callback(*args)
        if inspect.isawaitable(result):
            await result
    except Exception:
        # A failing consumer must not kill the watcher: the next event still matters.
        log.exception("container watcher callback failed")


def read_grant(labels: dict[str, Any], container_id: str) -> ContainerGrant | None:
    """The grant of a container's labels; a grant that does not parse is logged and left out
    (the container is still reported by its lease id, as a spawner of an older release's)."""
    grant = grant_from_labels({str(k): str(v) for k, v in labels.items()})
    if isinstance(grant, str):
        log.warning("container %s: its grant labels do not make a grant (%s); reporting it by "
                    "its lease id only", container_id[:12], grant)
        return None
    return grant


def change_from_event(event: dict[str, Any]) -> ContainerChange | None:
    """A Docker events-API message as a :class:`ContainerChange`, or None if not ours.

    Container events carry the container's labels in ``Actor.Attributes`` next to ``name``,
    ``image`` and (for ``die``) ``exitCode``; Swarm adds ``com.docker.swarm.*`` labels.
    """
    if event.get("Type") != "container":
        return None
    action = str(event.get("Action") or event.get("status") or "")
    # Docker reports some actions with a suffix ("exec_start: sh"); ours never have one.
    if action not in WATCHED_ACTIONS:
        return None
    actor = event.get("Actor") or {}
    attributes = actor.get("Attributes") or {}
    lease_id = attributes.get(LEASE_LABEL)
    container_id = actor.get("ID") or event.get("id")
    if not lease_id or not container_id:
        return None
    time_nano = event.get("timeNano")
    at = time_nano / 1e9 if isinstance(time_nano, int) else time.time()
    exit_code = attributes.get("exitCode")
    return ContainerChange(
        container_id=container_id,
        lease_id=lease_id,
        action=action,
        at=at,
        exit_code=int(exit_code) if exit_code not in (None, "") else None,
        name=attributes.get("name", ""),
        grant=read_grant(attributes, container_id) if action == "start" else None,
    )


def _format_since_ns(nanos: int) -> str:
    """Docker's ``since`` parameter (``seconds.nanoseconds``) for a time in nanoseconds."""
    return f"{nanos // 1_000_000_000}.{nanos % 1_000_000_000:09d}"


class ContainerWatcher:
    """Tracks running lease containers of one Docker engine and reports their events.

    ``on_change`` is called for every new watched event (and for inferred deaths) as soon as
    it arrives; ``on_resync`` after every successful (re)listing, so the agent can send a
    heartbeat with the fresh, complete list at once.
    """

    def __init__(
        self,
        docker_url: str,
        *,
        on_change: ChangeCallback | None = None,
        on_resync: ResyncCallback | None = None,
        timeout_s: float = 10.0,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        replay_grace_s: float = 1.0,
        liveness_s: float = 15.0,
        events: bool = True,
        clock: Callable[[], float] = time.time,
        on_call: CallObserver | None = None,
    ) -> None:
        self.docker_url = docker_url
        self.on_call = on_call
        """Told the name, duration and success of every Docker API call."""
        self.events = events
        """Follow the event stream; False: listing mode, see :meth:`refresh`."""
        self.on_change = on_change
        self.on_resync = on_resync
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.replay_grace_s = replay_grace_s
        self.liveness_s = liveness_s
        self._clock = clock
        self._docker: aiodocker.Docker | None = None
        self._task: asyncio.Task[None] | None = None
        self._grace_tasks: set[asyncio.Task[None]] = set()
        self._running: dict[str, LeaseContainer] = {}
        self._complete = False
        self._resume_from_ns: int | None = None
        """Docker time (ns) to replay events from after a gap: the newest event seen, or
        just before the first listing."""
        self._seen: OrderedDict[tuple[str, str, int], None] = OrderedDict()
        self._ended: OrderedDict[str, None] = OrderedDict()
        self.reconnects = 0
        """Times the event stream was re-established after it broke."""
        self.events_seen = 0
        """Watched events received from Docker (duplicates excluded)."""
        self.deaths_inferred = 0
        """Deaths reported by the watcher itself after a gap (no event said so)."""
        self.last_error: str | None = None
        self._first_attempt = asyncio.Event()
        self._listed_once = False

    # ------------------------------------------------------------------ public surface

    @property
    def complete(self) -> bool:
        """Whether :meth:`running` is trustworthy: listed, and the stream is up since."""
        return self._complete

    def running(self) -> list[LeaseContainer]:
        """The lease containers running now, as far as the watcher knows."""
        return sorted(self._running.values(), key=lambda c: c.container_id)

    async def start(self) -> None:
        """Connect and start watching in the background (does not wait for the engine)."""
        if self._task is not None:
            return
        self._docker = aiodocker.Docker(
            url=self.docker_url,
            timeout=aiohttp.ClientTimeout(connect=self.timeout_s, sock_connect=self.timeout_s),
        )
        if self.events:
            self._task = asyncio.create_task(self._run(), name="docker-watcher")

    async def wait_first_listing(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until the first listing succeeded or failed, so the
        agent's first heartbeat carries a complete list when the engine is up; True if
        the list is complete now."""
        if not self.events:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout_s):
                    await self.refresh()
            return self._complete
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._first_attempt.wait()
        return self._complete

    async def refresh(self) -> bool:
        """Listing mode: re-list the running lease containers now; True if that worked.

        On failure the list is marked incomplete (heartbeats then say so, and the allocator
        releases nothing on the strength of it) until a later refresh succeeds.
        """
        if self._docker is None:
            return False
        try:
            listed = await self.list_lease_containers()
        except (aiodocker.DockerError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            error = f"{type(exc).__name__}: {exc}"
            if self._complete or error != self.last_error:
                log.warning("docker (%s): listing failed: %s", self.docker_url, error)
            self._complete = False
            self.last_error = error
            return False
        self._running = {c.container_id: c for c in listed}
        if not self._complete:
            log.info("docker: %d lease container(s) running (listing mode, no events)",
                     len(listed))
        self._complete = True
        self._first_attempt.set()
        return True

    async def stop(self) -> None:
        """Stop watching and close the Docker client."""
        await cancel_and_wait([*self._grace_tasks, self._task])
        self._task = None
        self._complete = False
        if self._docker is not None:
            await self._docker.close()
            self._docker = None

    async def engine_name(self) -> str | None:
        """The engine's node name (``docker info`` Name), or None if it does not answer.

        This is the name Swarm's ``node.hostname`` constraint matches.
        """
        docker = self._docker or aiodocker.Docker(url=self.docker_url)
        try:
            async with self._timed("info"), asyncio.timeout(self.timeout_s):
                info = await docker.system.info()
            return str(info.get("Name") or "") or None
        except (aiodocker.DockerError, aiohttp.ClientError, OSError, TimeoutError) as exc:
            log.info("docker engine at %s did not answer (%s)", self.docker_url, exc)
            return None
        finally:
            if docker is not self._docker:
                await docker.close()

    async def stop_lease_container(self, container_id: str, lease_id: str,
                                   grace_s: float) -> StopOutcome:
        """Stop a container of this engine if it carries ``swarm-gpu.lease=<lease_id>``.

        ``docker stop -t grace_s``: SIGTERM, then SIGKILL once the grace ran out; returns when
        the container has ended. The container id must be the full id or a prefix of it
        (never a name), and its label must name exactly this lease, so nothing else on the
        host is ever touched. Raises on Docker errors other than "no such container" and
        when the engine does not answer within ``timeout_s`` (plus the grace for the stop).
        """
        container = await self._inspect(container_id)
        if container is None:
            return StopOutcome.GONE
        full_id = str(container["Id"])
        labels = (container["Config"] or {}).get("Labels") or {}
        if not full_id.startswith(container_id) or labels.get(LEASE_LABEL) != lease_id:
            return StopOutcome.WRONG_LEASE
        if not (container["State"] or {}).get("Running"):
            return StopOutcome.NOT_RUNNING
        try:
            async with self._timed("stop"), asyncio.timeout(grace_s + self.timeout_s):
                await container.stop(t=math.ceil(grace_s))
        except aiodocker.DockerError as exc:
            if exc.status == 404:  # removed while we looked: as good as stopped
                return StopOutcome.GONE
            raise
        return StopOutcome.STOPPED

    async def update_cpuset(self, container_id: str, cpus: str) -> None:
        """Set a running container's cpuset (``docker update --cpuset-cpus``: ``POST
        /containers/{id}/update`` with ``CpusetCpus``), bounded by the timeout. Raises
        :class:`aiodocker.DockerError` when Docker refuses (a CPU the host does not have, no
        such container) and TimeoutError when the engine does not answer."""
        assert self._docker is not None, "start() first"
        async with self._timed("update"), asyncio.timeout(self.timeout_s):
            await self._docker._query_json(f"containers/{container_id}/update", method="POST",
                                           data={"CpusetCpus": cpus})

    async def describe(self, container_id: str) -> ContainerDetails:
        """The name and image (as it was given: ``busybox:1.36``) of any container of this
        engine, for a container that runs a process on a GPU without being a lease container
        (``docker inspect``, bounded by the timeout). Empty when no such container exists
        (any more); raises on other Docker errors and when the engine does not answer."""
        container = await self._inspect(container_id)
        if container is None:
            return ContainerDetails()
        config = container["Config"] or {}
        return ContainerDetails(name=str(container["Name"] or "").lstrip("/"),
                                image=str(config.get("Image") or container["Image"] or ""))

    async def _inspect(self, container_id: str) -> DockerContainer | None:
        """``docker inspect`` (bounded by the timeout); None when no such container exists."""
        assert self._docker is not None, "start() first"
        try:
            async with self._timed("inspect"), asyncio.timeout(self.timeout_s):
                return await self._docker.containers.get(container_id)
        except aiodocker.DockerError as exc:
            if exc.status == 404:
                return None
            raise

    async def list_lease_containers(self) -> list[LeaseContainer]:
        """Ask the engine for the running lease containers (bounded by the timeout)."""
        assert self._docker is not None, "start() first"
        async with self._timed("list"), asyncio.timeout(self.timeout_s):
            containers = await self._docker.containers.list(
                filters=json.dumps({"label": [LEASE_LABEL], "status": ["running"]})
            )
        result = []
        for container in containers:
            labels = container["Labels"] or {}
            names = container["Names"] or []
            created = container["Created"]
            result.append(
                LeaseContainer(
                    container_id=container["Id"],
                    lease_id=labels.get(LEASE_LABEL, ""),
                    name=names[0].lstrip("/") if names else "",
                    started_at=float(created) if created else None,
                    grant=read_grant(labels, container["Id"]),
                )
            )
        return [c for c in result if c.lease_id]

    @contextlib.asynccontextmanager
    async def _timed(self, call: str) -> AsyncIterator[None]:
        """Tell :attr:`on_call` how long the Docker call in the block took and whether it
        worked. Its timeout goes inside the block, so a call that timed out counts as failed;
        a 404 (no such container) is the engine's answer, not a failure; a call cancelled
        because the agent stops is not told at all."""
        started = time.monotonic()
        ok = cancelled = False
        try:
            yield
            ok = True
        except aiodocker.DockerError as exc:
            ok = exc.status == 404
            raise
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            if self.on_call is not None and not cancelled:
                self.on_call(call, time.monotonic() - started, ok)

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        backoff = Backoff(self.backoff_s, self.backoff_max_s)
        while True:
            attempt_started = time.monotonic()
            try:
                await self._connect_and_stream()  # returns only by raising
                error = "event stream ended"
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
            self._first_attempt.set()
            self._complete = False
            if time.monotonic() - attempt_started > self.backoff_max_s:
                backoff.reset()  # the stream ran for a while: a fresh failure
            self.last_error = error
            pause = backoff.next()
            log.warning("docker (%s): %s; retrying in %.1fs", self.docker_url, error, pause)
            await asyncio.sleep(pause)

    async def _connect_and_stream(self) -> None:
        assert self._docker is not None
        before = dict(self._running)
        listed_at = self._clock()
        listed = await self.list_lease_containers()
        # Replay from the last event seen; on the first connect, from just before the listing
        # so nothing between listing and subscribing is lost (duplicates are dropped).
        if self._resume_from_ns is None:
            self._resume_from_ns = int((listed_at - 1.0) * 1e9)
        since = _format_since_ns(self._resume_from_ns)
        events = DockerEvents(self._docker)  # type: ignore[no-untyped-call]
        subscriber = events.subscribe(create_task=False)  # type: ignore[no-untyped-call]
        stream = asyncio.create_task(
            events.run(
                filters=json.dumps(
                    {"type": ["container"], "event": list(WATCHED_ACTIONS),
                     "label": [LEASE_LABEL]}
                ),
                since=since,
            ),
            name="docker-events",
        )
        try:
            self._running = {c.container_id: c for c in listed}
            self._complete = True
            self._first_attempt.set()
            if not self._listed_once:
                self._listed_once = True
                log.info("docker: %d lease container(s) running; watching events",
                         len(listed))
            else:
                self.reconnects += 1
                log.info("docker: reconnected (reconnect #%d); %d lease container(s) running",
                         self.reconnects, len(listed))
                vanished = [c for cid, c in before.items() if cid not in self._running]
                if vanished:
                    self._schedule_inferred_deaths(vanished)
            await _call(self.on_resync)
            await self._consume(subscriber, stream)
        finally:
            self._complete = False
            # Each step bounded: this also runs while the watcher is being cancelled, and
            # aiodocker's stop can wait on a stream that a frozen socket never ends.
            stream.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                async with asyncio.timeout(SHUTDOWN_STEP_S):
                    await events.stop()  # type: ignore[no-untyped-call]
            with contextlib.suppress(asyncio.CancelledError, Exception):
                async with asyncio.timeout(SHUTDOWN_STEP_S):
                    await stream

    async def _consume(self, subscriber: Any, stream: asyncio.Task[None]) -> None:
        while True:
            try:
                # asyncio.timeout, not wait_for: Python 3.11's wait_for can swallow a
                # cancellation that arrives as the event does, and the watcher then never stops.
                async with asyncio.timeout(self.liveness_s):
                    event = await subscriber.get()
            except TimeoutError:
                # Quiet stream: make sure the engine is still there (a half-open
                # connection never ends the stream on its own).
                assert self._docker is not None
                async with self._timed("ping"), asyncio.timeout(self.timeout_s):
                    await self._docker.version()
                continue
            if event is None:
                # The stream ended: aiodocker ends it quietly on a dropped connection.
                error = stream.exception() if stream.done() and not stream.cancelled() else None
                raise ConnectionError(f"event stream ended ({error or 'connection closed'})")
            await self._handle(event)

    async def _handle(self, event: dict[str, Any]) -> None:
        change = change_from_event(event)
        if change is None:
            return
        key = (change.container_id, change.action, int(event.get("timeNano") or 0))
        if key in self._seen:
            return  # replayed after a reconnect: already handled
        self._seen[key] = None
        while len(self._seen) > _SEEN_EVENTS:
            self._seen.popitem(last=False)
        self.events_seen += 1
        time_nano = event.get("timeNano")
        if isinstance(time_nano, int):
            self._resume_from_ns = max(self._resume_from_ns or 0, time_nano)
        self._apply(change)
        await _call(self.on_change, change)

    def _apply(self, change: ContainerChange) -> None:
        if change.action == "start":
            self._running[change.container_id] = LeaseContainer(
                change.container_id, change.lease_id, change.name, change.at, change.grant
            )
            self._ended.pop(change.container_id, None)
        elif change.action in ("die", "destroy"):
            self._running.pop(change.container_id, None)
            self._ended[change.container_id] = None
            while len(self._ended) > _SEEN_EVENTS:
                self._ended.popitem(last=False)

    def _schedule_inferred_deaths(self, vanished: list[LeaseContainer]) -> None:
        task = asyncio.create_task(self._infer_deaths(vanished), name="docker-infer-deaths")
        self._grace_tasks.add(task)
        task.add_done_callback(self._grace_tasks.discard)

    async def _infer_deaths(self, vanished: list[LeaseContainer]) -> None:
        # Give Docker's replay the first word: it knows the exit code and the real time.
        await asyncio.sleep(self.replay_grace_s)
        for container in vanished:
            if container.container_id in self._ended or container.container_id in self._running:
                continue
            self.deaths_inferred += 1
            log.warning("docker: container %s (lease %s) ended while the event stream was "
                        "down and no event said so; reporting it dead",
                        container.container_id[:12], container.lease_id,
                        extra={"lease_id": container.lease_id})
            change = ContainerChange(
                container_id=container.container_id,
                lease_id=container.lease_id,
                action="die",
                at=self._clock(),
                name=container.name,
                synthesized=True,
            )
            self._apply(change)
            await _call(self.on_change, change)
