"""The allocator process: :class:`AllocatorService` wires the parts and owns their lifecycle.

Start: open the ledger and rebuild the engine from it (fenced: the nodes report before any
grant), refuse guarantees the cluster cannot honour, connect, follow the replicated ledger
log when it is on, declare, then run the applier and the timer and consume. Stop: the same
backwards, each step bounded. Everything between a delivery and its acknowledgement happens
in the parts this class holds; it decides nothing itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from contextlib import nullcontext

from allocator.amqp.broker import broker_user
from allocator.config import AllocatorSettings, ConfigurationError, guarantee_problem
from allocator.engine import Engine
from allocator.ledger.replication import ReplicatedLog
from allocator.ledger.retention import Pruner
from allocator.ledger.store import Ledger
from allocator.metrics import exporter
from allocator.metrics.counters import ServiceStats
from allocator.metrics.endpoint import ProcessHealth
from allocator.service import heap
from allocator.service.answers import Answers
from allocator.service.batch import Batches
from allocator.service.commands import Commands
from allocator.service.connect import STOP_STEP_S, BrokerLink
from allocator.service.decide import Decider
from allocator.service.intake import Intake
from allocator.service.memory import Memory
from allocator.service.standby import Standby, serve_while_writable
from allocator.tasks import cancel_and_wait

log = logging.getLogger(__name__)


class AllocatorService:
    """The running allocator: broker consumer, engine and ledger writer.

    What others read of it: ``engine``, ``ledger``, ``stats``, ``metrics``, ``log`` and
    ``active`` (the metrics endpoint, tests), ``started`` (set once it consumes), ``failed``
    and ``failure`` (set when its ledger turns out not to be the log's history: it serves no
    more).
    """

    def __init__(self, settings: AllocatorSettings, *, clock: Callable[[], float] = time.time,
                 freeze_heap: bool = False):
        """``freeze_heap``: after each rebuild from the ledger, keep the rebuilt state out of
        Python's cycle collector (:mod:`allocator.service.heap`). Process-wide, so only for a
        process that is nothing but this allocator (the ``serve`` command)."""
        self.settings = settings
        self.clock = clock
        # With the replicated log, the log is the durable record: a replica's file may lose
        # its last transactions in a power cut and replays them from its recorded position
        # (kept in the same transactions), so it needs no fsync per batch.
        self.ledger = Ledger(settings.ledger_path,
                             synchronous="normal" if settings.ledger_log == "stream"
                             else settings.ledger_synchronous)
        self.engine = Engine(settings, started_at=clock())
        self.stats = ServiceStats()
        self.metrics = exporter.AllocatorMetrics()
        """This service's registry and request histogram (served when metrics_port is set)."""
        self.user_id = broker_user(settings.amqp_url)
        """The broker user of the connection: the AMQP user_id of every command, which the
        broker verifies and the agents check."""
        self.metrics_server: exporter.MetricsServer | None = None
        self.health = ProcessHealth(settings.health_stale_s)
        """What ``/healthz`` answers (with the metrics): the event loop ran within
        ``health_stale_s``, and the broker connection is up. A standby is healthy by the same
        two: it consumes the same queue, waiting to be given it, and being a standby is no
        fault (a check that failed standbys would have Swarm restart them in a loop)."""
        self.health.add("broker connection", self._broker_problem)
        self.started = asyncio.Event()
        self.log: ReplicatedLog | None = None
        """The replicated ledger log (``ledger_log = "stream"``), or None: one shared file."""
        self.failure: str | None = None
        """Why this allocator stopped serving (its ledger is not the log's history)."""
        self.failed = asyncio.Event()
        self._intake = Intake(settings, self.stats, awaited=self.engine.processes.draining_on)
        self._answers = Answers(settings, self.ledger, self.engine, self.stats, self._intake)
        self._commands = Commands(settings, self.stats, self.user_id)
        self._memory = Memory(self.ledger, self.engine, clock,
                              after_reload=self._answers.push_waiting,
                              rebuilding=heap.rebuilding if freeze_heap else nullcontext)
        self._decider = Decider(settings, self.engine, self.stats, clock)
        self._link = BrokerLink(settings, self.ledger)
        self.pruner = Pruner(self.ledger, self.stats.counters,
                             retention_days=settings.history_retention_days,
                             interval_s=settings.history_prune_interval_s,
                             batch=settings.history_prune_batch, clock=clock,
                             may_prune=self._may_prune)
        """Deletes what ``history_retention_days`` no longer keeps
        (allocator/ledger/retention.py)."""
        # The parts that depend on whether a log is followed are made once start knows.
        self._standby: Standby | None = None
        self._batches: Batches | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._watchdog: asyncio.Task[None] | None = None
        self._stopped = False

    # ------------------------------------------------------------------ life

    async def start(self) -> None:
        """Open the ledger, load it, connect, declare the topology and start consuming."""
        self.ledger.open()
        # Fenced: this ledger may be behind what the nodes run (deleted, restored, another
        # node's volume); each node's first complete report comes before any grant there.
        await self._memory.reload(fenced=True)
        self._check_guarantees()
        await self._link.connect()
        if self.settings.ledger_log == "stream":
            # Follow the log before consuming requests: a ledger that is not the log's
            # history must be found out before it could serve.
            self.log = await self._link.follow_log()
            self._watchdog = asyncio.create_task(self._watch_log(self.log),
                                                 name="allocator-log-watch")
        channel, agents = await self._link.declare()
        self._answers.attach(channel)
        self._commands.attach(agents)
        self._standby = Standby(self.settings, self.stats, self._memory, self._intake,
                                self._answers, self.log)
        self._batches = Batches(self.settings, self.stats, self.metrics, intake=self._intake,
                                standby=self._standby, decider=self._decider,
                                memory=self._memory, answers=self._answers,
                                commands=self._commands, replicated=self.log)
        self._tasks = [
            asyncio.create_task(self._batches.run(), name="allocator-apply"),
            asyncio.create_task(self._tick_loop(), name="allocator-tick"),
            asyncio.create_task(self.pruner.run(), name="allocator-prune"),
            asyncio.create_task(self.health.watch_loop(), name="allocator-health-watch"),
        ]
        await self._link.consume(self._intake.on_message)
        self.started.set()
        if self.settings.metrics_port is not None:
            self.metrics_server = exporter.serve(self, self.settings.metrics_port,
                                                token=self.settings.metrics_token,
                                                health=self.health)
        log.info("allocator consuming %s; ledger %s", self.settings.queue_name,
                 self.settings.ledger_path)

    async def stop(self) -> None:
        """Stop consuming, finish the batch in hand, close the broker and the ledger.

        Stopping twice is harmless.
        """
        if self._stopped:
            return
        self._stopped = True
        # Each step bounded (asyncio.timeout, not 3.11's wait_for, which can swallow a
        # cancellation): a broker that does not answer must not hang the shutdown.
        await self._link.cancel_consumer()
        await cancel_and_wait([*self._tasks, self._watchdog], within=STOP_STEP_S)
        self._tasks, self._watchdog = [], None
        if self.log is not None:
            await self.log.stop()
        await self._link.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        self.ledger.close()

    async def __aenter__(self) -> AllocatorService:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ what others ask

    @property
    def active(self) -> bool:
        """Whether this replica is the active one, for the metrics
        (:meth:`allocator.service.standby.Standby.is_active`); False before it consumes."""
        return self._standby is not None and self._standby.is_active()

    async def is_standby(self) -> bool:
        """Whether another allocator is the active one, as far as this one can tell
        (:meth:`allocator.service.standby.Standby.is_standby`)."""
        return await self._running_standby().is_standby()

    async def _apply_batch(self, batch: list[object]) -> None:
        """Apply ``batch`` as the applier would. Not called here: tests hand it what an
        allocator may still hold when it applies its next batch."""
        if self._batches is None:
            raise RuntimeError("the allocator is not started")
        await self._batches.apply(batch)

    # ------------------------------------------------------------------ internals

    def _broker_problem(self) -> str | None:
        """The health check of the broker connection (read in the metrics' HTTP thread)."""
        return None if self._link.up else "down (the allocator keeps reconnecting; see its log)"

    def _running_standby(self) -> Standby:
        if self._standby is None:
            raise RuntimeError("the allocator is not started")
        return self._standby

    async def _tick_loop(self) -> None:
        # A standby runs no timers: it would write timer decisions to the shared ledger and
        # then have to reload after every write of the active one.
        standby = self._running_standby()
        while True:
            await asyncio.sleep(self.settings.tick_s)
            if not await standby.is_standby():
                self._intake.put_tick()

    async def _may_prune(self) -> bool:
        """Whether this process prunes its ledger now: with the replicated log every replica
        prunes its own file (docs/design.md, "Retention"); on a shared file only the active
        one, for the reason a standby runs no timers."""
        if self.log is not None:
            return True
        return not await self._running_standby().is_standby()

    async def _watch_log(self, replicated: ReplicatedLog) -> None:
        """Stop serving while this ledger cannot apply the log (disk full: it serves again
        once it can), and for good when the log turns out not to be this ledger's history."""
        await serve_while_writable(
            replicated, self.started, pause=self._link.cancel_consumer,
            resume=lambda: self._link.consume(self._intake.on_message))
        self.failure = str(replicated.mismatch)
        await self._link.cancel_consumer()
        self.failed.set()

    def _check_guarantees(self) -> None:
        """With ``strict_guarantees``: refuse to start when the guarantees cannot all be
        honoured at once by the cluster (``cluster_gpus``, or the GPUs the ledger knows), the
        per-model ones by the GPUs of their model (``cluster_model_gpus``, or the ledger's)."""
        if not self.settings.strict_guarantees:
            return
        model_gpus: dict[str, int] = {}
        for gpu in self.engine.cluster.gpus.values():
            if gpu.present and gpu.allocatable:
                model_gpus[gpu.model] = model_gpus.get(gpu.model, 0) + 1
        gpus = self.settings.cluster_gpus
        if gpus is None:
            gpus = sum(model_gpus.values())
        problem = guarantee_problem(self.settings, gpus, model_gpus)
        if problem is not None:
            self.ledger.close()
            raise ConfigurationError(problem)
