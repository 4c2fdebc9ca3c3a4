"""Allocator settings: environment variables (``SWARM_GPU_*``) over an optional TOML file.

Precedence, highest first (pydantic-settings' sources, :mod:`allocator.settings_files`):
keyword arguments, environment, the TOML file named by ``SWARM_GPU_CONFIG`` (or passed as
``config_file``), defaults. Nested tables in TOML map to dict settings, e.g.::

    ledger_path = "/var/lib/swarm-gpu/ledger.sqlite"
    [share_slots]
    "NVIDIA GeForce GTX 1070" = 4
    [aliases]
    "1070" = "NVIDIA GeForce GTX 1070"
    [group_quota]
    students = 1
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, NonNegativeInt, StringConstraints, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from allocator.amqp.broker import DEFAULT_AMQP_URL, BrokerTLSSettings
from allocator.logs import LogSettings
from allocator.metrics.endpoint import HealthSettings, MetricsTokenSettings
from allocator.settings_files import FileSettings, secret_file_field
from allocator.wire.model_names import ModelNames, unbranded
from allocator.wire.topology import (
    ALLOCATOR_QUEUE,
    LEDGER_LOG_STREAM,
    RABBITMQ_SEGMENT_BYTES,
    SNAPSHOT_BYTES,
)

ENV_PREFIX = "SWARM_GPU_"


class ConfigurationError(ValueError):
    """Settings that cannot work together; the message says which, in one line."""


class PolicySettings(BaseSettings):
    """The knobs of placement: sharing, aliases, quotas. Plain data for the pure policy."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    share_slots: dict[str, int] = Field(
        default_factory=dict,
        description="Share slots per GPU, by canonical model name. 1 or absent = exclusive only.",
    )
    default_share_slots: int = Field(
        default=1, ge=1, le=64,
        description="Share slots per GPU of a model not in share_slots. 1: exclusive only.")
    aliases: dict[str, str] = Field(
        default_factory=dict, description="Extra model aliases: alias -> canonical NVML name."
    )
    user_quota: dict[str, float] = Field(
        default_factory=dict, description="Max GPUs held at once, by user (a slice counts 1/slots)."
    )
    group_quota: dict[str, float] = Field(
        default_factory=dict, description="Max GPUs held at once by all members of a group."
    )
    default_user_quota: float | None = Field(default=None, description="None = unlimited.")
    user_borrow_limit: dict[str, float] = Field(
        default_factory=dict,
        description="The most a user may hold at once, borrowed GPUs included: the user's quota "
        "(user_quota) is the guarantee, anything held above it is borrowed and reclaimable. "
        "Absent: the guarantee (no borrowing).")
    group_borrow_limit: dict[str, float] = Field(
        default_factory=dict,
        description="The most all members of a group may hold at once, borrowed included "
        "(group_quota is the group's guarantee). Absent: the guarantee.")
    user_model_quota: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description="Per model: user -> {model or alias: GPUs guaranteed of that model}, "
        "besides (not instead of) user_quota.")
    user_model_borrow_limit: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description="user -> {model: the most held of that model, borrowed included}; absent: "
        "that model's guarantee.")
    group_model_quota: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description="group -> {model or alias: GPUs of that model guaranteed to its members "
        "together}.")
    group_model_borrow_limit: dict[str, dict[str, float]] = Field(
        default_factory=dict, description="group -> {model: borrow limit}; absent: guarantee.")
    default_user_borrow_limit: float | None = Field(
        default=None, description="Borrow limit of users not in user_borrow_limit whose quota "
        "is default_user_quota; None = that quota (no borrowing).")

    @model_validator(mode="after")
    def _borrow_limits_above_guarantees(self) -> PolicySettings:
        for problem in borrow_limit_problems(self):
            raise ValueError(problem)
        return self


def borrow_limit_problems(settings: PolicySettings) -> list[str]:
    """Every borrow limit that is below its guarantee, or given where no guarantee is, in words."""
    problems = []
    scopes = (("user", settings.user_quota, settings.user_borrow_limit),
              ("group", settings.group_quota, settings.group_borrow_limit))
    for scope, guarantees, limits in scopes:
        for name, limit in sorted(limits.items()):
            guarantee = guarantees.get(name)
            if guarantee is None and scope == "user":
                guarantee = settings.default_user_quota
            if guarantee is None:
                problems.append(f"{scope}_borrow_limit[{name!r}] = {limit:g} has no guarantee to "
                                f"borrow above: set {scope}_quota[{name!r}]")
            elif limit < guarantee:
                problems.append(f"{scope}_borrow_limit[{name!r}] = {limit:g} is below its "
                                f"guarantee {scope}_quota[{name!r}] = {guarantee:g}")
    per_model = (("user", settings.user_model_quota, settings.user_model_borrow_limit),
                 ("group", settings.group_model_quota, settings.group_model_borrow_limit))
    for scope, model_guarantees, model_limits in per_model:
        for name, by_model in sorted(model_limits.items()):
            for model, limit in sorted(by_model.items()):
                guarantee = model_guarantees.get(name, {}).get(model)
                where = f"{scope}_model_borrow_limit[{name!r}][{model!r}] = {limit:g}"
                if guarantee is None:
                    problems.append(f"{where} has no guarantee to borrow above: set "
                                    f"{scope}_model_quota[{name!r}][{model!r}]")
                elif limit < guarantee:
                    problems.append(f"{where} is below its guarantee {scope}_model_quota"
                                    f"[{name!r}][{model!r}] = {guarantee:g}")
    default_limit = settings.default_user_borrow_limit
    if default_limit is not None:
        if settings.default_user_quota is None:
            problems.append(f"default_user_borrow_limit = {default_limit:g} has no guarantee to "
                            "borrow above: set default_user_quota")
        elif default_limit < settings.default_user_quota:
            problems.append(f"default_user_borrow_limit = {default_limit:g} is below "
                            f"default_user_quota = {settings.default_user_quota:g}")
    return problems


class AllocatorSettings(PolicySettings, FileSettings, BrokerTLSSettings, LogSettings,
                        MetricsTokenSettings, HealthSettings):
    """Everything the allocator process reads at start (``config``: the TOML file); the
    broker's TLS files: :class:`allocator.amqp.broker.BrokerTLSSettings`; ``log_level`` and
    ``log_format``: :class:`allocator.logs.LogSettings`; ``health_stale_s``:
    :class:`allocator.metrics.endpoint.HealthSettings`."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    amqp_url: str = Field(
        default=DEFAULT_AMQP_URL,
        description="Broker URL; a broker cluster's nodes may all be named in it "
        "(amqp://user:pw@node1:5672,node2:5672,node3:5672/vhost): the allocator connects to "
        "the first that answers and, after a drop, to the next (allocator/amqp/broker.py).",
    )
    amqp_url_file: Path | None = secret_file_field("amqp_url")
    broker_wait_s: float = Field(
        default=180.0, ge=0,
        description="At start, how long to keep trying to reach the broker before exiting: "
        "on a first deploy the allocator may start before RabbitMQ listens. Each failed "
        "attempt logs one line; the pause doubles from 1 s up to 10 s. 0 = try once. With "
        "ledger_log = 'stream' it also bounds, at a first start, the wait for every broker "
        "node of amqp_url to answer before the log's stream is declared, and the search "
        "for a node holding a replica of the stream.",
    )
    queue_name: str = Field(default=ALLOCATOR_QUEUE, description="Inbound queue name.")
    ledger_path: Path = Field(
        default=Path("swarm-gpu-ledger.sqlite"),
        description="The ledger, a SQLite file (WAL mode: keep it on a local disk, not NFS).")
    ledger_synchronous: Literal["full", "normal"] = Field(
        default="full",
        description="SQLite's synchronous mode. 'full': every decision is fsynced before it is "
        "answered, and survives a power cut. 'normal': it is in the WAL (survives a crash of "
        "the allocator, not of the machine) and each request saves one fsync (what that costs: "
        "docs/benchmarks.md, durability modes).",
    )
    bind_timeout_s: float = Field(
        default=300.0, gt=0, description="A granted lease no container binds by then is reclaimed."
    )
    node_down_after_s: float = Field(
        default=15.0, gt=0, description="A node with no heartbeat for this long is down."
    )
    gpu_move_after_s: float = Field(
        default=600.0, ge=0,
        description="A GPU that another host reports while its own host does not hold it "
        "(down, or no longer listing it) moves to that host only once the claim has stood "
        "this long and the claiming host's report is complete; until then it is a conflict "
        "and placed on neither. Longer than a reboot, so a host that comes back keeps its "
        "GPUs; short against how long a card or a disk takes to move.",
    )
    stop_grace_s: float = Field(
        default=60.0, gt=0,
        description="Leases on a node silent this long are released (reason node_silent).",
    )
    container_gone_grace_s: float = Field(
        default=2.0, ge=0,
        description="A bound lease whose container a heartbeat no longer lists is released once "
        "the heartbeat is this much newer than the bind.",
    )
    stop_containers: bool = Field(
        default=True,
        description="Ask the node agent to stop a lease's container when the hub releases the "
        "bound lease, when an admin force-releases it, and when a container runs for a lease "
        "that is already finished. Off: the GPU comes free only when Swarm stops the task "
        "(about 3 s after the service is removed).",
    )
    container_stop_grace_s: float = Field(
        default=10.0, ge=0, le=3600,
        description="Grace a stopped container gets between SIGTERM and SIGKILL (not to be "
        "confused with stop_grace_s, the node silence).",
    )
    container_stop_retry_s: float = Field(
        default=30.0, gt=0,
        description="A container that heartbeats still list this long after its stop grace "
        "ran out is asked to stop again (the first command may have been lost).",
    )
    tick_s: float = Field(default=0.5, gt=0, description="How often timers are checked.")
    standby_after_s: float = Field(
        default=30.0, gt=0,
        description="An allocator with no delivery for this long, whose ledger another process "
        "writes, counts as a standby and runs no timers (single-active-consumer gives "
        "deliveries to the active one only).",
    )
    batch_max: int = Field(
        default=64, ge=1, le=4096,
        description="Messages per ledger commit, of each kind: up to this many requests and "
        "this many node messages (heartbeats, container events).")
    heartbeat_linger_s: float = Field(
        default=0.05, ge=0, le=10,
        description="A batch of nothing but heartbeats (and timer ticks) waits up to this long "
        "for more before it is applied and committed, so an idle cluster's heartbeats share "
        "commits instead of paying one each; any other message (a request, a container event) "
        "ends the wait at once. 0 applies every batch as soon as it is taken.",
        examples=[0.05, 0],
    )
    prefetch: int = Field(
        default=2048, ge=1, le=65535,
        description="Deliveries the broker may hand the allocator before it acknowledges "
        "them. Requests are taken ahead of the node messages held here, so this is how far a "
        "request can pass a backlog of heartbeats (after a restart, or under load); each "
        "held delivery costs a few KiB of memory.",
    )
    telemetry_persist_s: float = Field(
        default=30.0, ge=0, description="GPU telemetry is written to the ledger at most this often."
    )
    admin_users: list[str] = Field(
        default_factory=lambda: ["admin"],
        description="Broker users (AMQP user_id) allowed to drain and force-release, and "
        "to release, look up and list every hub's leases (a hub acts on its own only).",
    )
    node_users: dict[str, str] = Field(
        default_factory=dict, description="host -> broker user that may report for it."
    )
    node_user_template: str = Field(
        default="agent-{host}", description="Broker user of a host not in node_users."
    )
    allow_any_node_user: bool = Field(
        default=False,
        description="Accept heartbeats for any host from any broker user (single-user setups).",
    )
    max_hosts_per_node_user: int = Field(
        default=4096, ge=1,
        description="Hosts one broker user may bring into the cluster by its heartbeats; past "
        "it, heartbeats for further new hosts are refused and counted (anomaly host_limit). "
        "Matters where one user may report for any host (allow_any_node_user).",
    )
    max_gpus_per_host: int = Field(
        default=256, ge=1, le=65536,
        description="GPUs one host may have on record, present or gone (replaced cards stay "
        "on record); past it, further new GPU uuids of that host are ignored and counted "
        "(anomaly gpu_limit).",
    )
    declared_gpus: dict[str, dict[str, NonNegativeInt]] = Field(
        default_factory=dict,
        description="host -> {model (as its agent reports it, or an alias): GPUs of that "
        "model the site installed there}. Optional, per host: of a host listed, at most that "
        "many GPUs of each model are placed (the first by index); GPUs beyond it, or of a "
        "model not listed, stay out of placement and are shown as a conflict (event and "
        "anomaly undeclared_gpu), so that an agent credential cannot draw placements to GPUs "
        "that do not exist. A host not listed is taken as its agent reports it (up to "
        "max_gpus_per_host).",
    )
    refused_events_per_minute: int = Field(
        default=10, ge=0, le=10_000,
        description="Ledger events a refused node message writes (heartbeat_rejected, "
        "request_refused...), at most this many per minute for one broker user (for all "
        "the hosts it does not report for together). The rest are only counted "
        "(swarm_gpu_node_events_unrecorded), so that one agent credential cannot fill the "
        "ledger's disk. 0: counted only. The events of accepted reports have their own "
        "budget, node_events_per_minute.",
    )
    node_events_per_minute: int = Field(
        default=30, ge=0, le=10_000,
        description="Ledger events one host's accepted reports (heartbeats, deltas, container "
        "events) may write a minute, whatever they say (GPU health, adoptions, containers "
        "ended, anomalies its reports repeat such as duplicate_gpu): per broker user and "
        "host. The rest are only counted (swarm_gpu_node_events_unrecorded), so that one "
        "agent credential cannot fill the ledger's disk with events of its own host. 0: "
        "counted only. Also the adoptions one host's containers may make a minute; the "
        "rest wait as conflicts (adoption_deferred), their GPUs kept out, until a later "
        "report.",
    )
    history_retention_days: float = Field(
        default=400.0, ge=0,
        description="Events, and finished leases with their state history, older than this "
        "are deleted from the ledger (allocator/ledger/retention.py); active leases are kept "
        "however old. 0 keeps everything forever. Export first what must be kept longer "
        "(gpu-ledger export; docs/operations.md, Retention).",
    )
    history_prune_interval_s: float = Field(
        default=3600.0, gt=0,
        description="How often the allocator deletes what history_retention_days no longer "
        "keeps (the first time a minute after start, or sooner when this is shorter).",
    )
    history_prune_batch: int = Field(
        default=1000, ge=1, le=100_000,
        description="Events, or finished leases with their history, deleted per transaction "
        "while pruning (about 10 ms each at 1000, measured): the longest a prune holds the "
        "ledger's writer is one such transaction.",
    )
    reply_to_prefix: str | None = Field(
        default=None, min_length=1,
        description="Besides RabbitMQ direct reply-to addresses, accept reply_to queues whose "
        "name starts with this (clients that consume a reply queue of their own); None: direct "
        "reply-to only. Any other reply_to is refused unanswered and counted, so that no sender "
        "can make the allocator publish into a queue of its choice.",
    )
    metrics_port: int | None = Field(default=None, description="Prometheus port; None = off.")
    request_timeout_s: float = Field(default=10.0, gt=0, description="Bound on broker calls.")
    start_fence_s: float = Field(
        default=30.0, ge=0, le=3600,
        description="After a start, the ledger may be behind the nodes (deleted, restored from "
        "a backup, another node's volume): nothing is granted on a node before its first "
        "complete report is applied, and a request that does not fit meanwhile waits in the "
        "queue (at most this long, or its own wait_s if longer) instead of being refused. The "
        "fence ends once every node the ledger knows has reported (a ledger that knows no "
        "node: once the first one has), or after this long: then a node whose agent cannot "
        "list its containers is placed as usual. 0 turns the fence off.",
    )
    ledger_log: Literal["off", "stream"] = Field(
        default="off",
        description="'stream': every committed batch is appended to a RabbitMQ stream "
        "(ledger_log_stream) and read back before it is answered; every replica applies the "
        "stream to its own ledger, so a standby on another node, with its own disk, takes over "
        "with the whole ledger (docs/design.md, high availability). 'off': one ledger file, "
        "shared by the replicas (one node).",
    )
    ledger_log_stream: str = Field(
        default=LEDGER_LOG_STREAM, min_length=1, max_length=200,
        description="The stream queue of the replicated ledger log.",
    )
    ledger_log_max_bytes: int = Field(
        default=20 * 1024**3, ge=64 * 1024,
        description="Retention of the log stream (its x-max-length-bytes): RabbitMQ drops its "
        "oldest segments beyond this. A replica whose place in the log is older than what is "
        "kept, or that starts empty, catches up from the newest snapshot "
        "(ledger_log_snapshot_bytes). Fixed when the stream is first declared.",
    )
    ledger_log_segment_bytes: int = Field(
        default=RABBITMQ_SEGMENT_BYTES, ge=4096, le=3_000_000_000,
        description="Segment size of the log stream (its x-stream-max-segment-size-bytes; "
        "the default is RabbitMQ's). Retention drops whole segments, so the stream keeps at "
        "least ledger_log_max_bytes less about one segment. Fixed when the stream is first "
        "declared.",
    )
    ledger_log_snapshot_bytes: int = Field(
        default=SNAPSHOT_BYTES, ge=1024,
        description="The active allocator appends a snapshot of the ledger's state (nodes, "
        "GPUs, leases; not the lease history and events) each time the log has grown by this "
        "many bytes since the last one. A replica that is new, empty or was offline longer "
        "than the stream keeps loads the newest snapshot and replays only what follows it, so "
        "this bounds its catch-up; each snapshot holds the writer for as long as it takes "
        "(docs/benchmarks.md). At most a quarter of ledger_log_max_bytes less two segments, "
        "so that the stream always keeps the newest snapshot.",
    )

    @model_validator(mode="after")
    def _ledger_log_keeps_a_snapshot(self) -> AllocatorSettings:
        if self.ledger_log == "stream":
            problem = ledger_log_retention_problem(self.ledger_log_max_bytes,
                                                   self.ledger_log_segment_bytes,
                                                   self.ledger_log_snapshot_bytes)
            if problem:
                raise ValueError(problem)
        return self

    reclaim_grace_s: float = Field(
        default=300.0, ge=0, le=24 * 3600,
        description="Between the warning that a borrowed (or idle) lease will be stopped and "
        "the stop: the user sees the deadline on the lease and can save their work.")
    idle_window_s: float = Field(
        default=600.0, gt=0,
        description="A lease whose own processes stay under the idle thresholds this long is "
        "idle: reclaimed before busy borrowed leases, and counted in idle GPU-hours.")
    booking_lead_s: int = Field(
        default=600, ge=0, le=24 * 3600,
        description="How long before a booking's window the leases of non-members on the "
        "GPUs it will need are warned, for a booking without its own lead_s.")
    idle_utilization_pct: float = Field(
        default=5.0, ge=0, le=100,
        description="Utilization (of the lease's processes, mean over its GPUs) below which a "
        "heartbeat's sample counts as idle. A sample without utilization is not idle.")
    idle_memory_mib: int | None = Field(
        default=None, ge=0,
        description="When set, a sample also needs less GPU memory than this to be idle; None: "
        "memory held is no sign of work (a notebook keeps its tensors while idle).")
    idle_release_after_s: float | None = Field(
        default=None, gt=0,
        description="When set, a lease idle longer than this (guaranteed or not) is released, "
        "after a warning of reclaim_grace_s, while a request that its GPUs would let fit waits. "
        "None: off.")
    usage_half_life_h: float = Field(
        default=0.0, ge=0, le=24 * 365,
        description="Half-life, in hours, of the decayed usage that fair share remembers (as "
        "Slurm's PriorityDecayHalfLife): GPU-hours held, weighted by the model's scarcity. "
        "Waiters of equal priority are served least recent use first; among borrowed leases "
        "that are not idle, the heaviest recent user's is reclaimed first. 0: off.")
    price_per_gpu_hour: dict[Annotated[str, StringConstraints(min_length=1)],
                             Annotated[float, Field(ge=0, allow_inf_nan=False)]] = Field(
        default_factory=dict,
        description="Showback (gpu-ledger usage): the price of one GPU-hour held, by model "
        "(NVML's name, as the ledger records it: 'NVIDIA A100-SXM4-40GB'). A model not named "
        "costs nothing per GPU-hour. With price_per_kwh unset too: no cost column.")
    price_per_kwh: float | None = Field(
        default=None, ge=0, allow_inf_nan=False,
        description="Showback (gpu-ledger usage): the price of one kWh measured (the leases' "
        "share of their GPUs' energy counters). None: energy costs nothing.")
    usage_history_s: float = Field(
        default=3 * 3600.0, ge=0, le=7 * 24 * 3600,
        description="Per-minute GPU use kept in memory per lease for the leases reply.")
    release_verify_s: float = Field(
        default=10.0, ge=0, le=3600,
        description="After a lease whose container ran ends, its GPUs are draining (not "
        "placed) until a report taken after the end shows none of that container's processes "
        "on them, for at most this long; a process still there then marks the GPU "
        "stuck_process, out of placement until it is gone (nothing is killed). Only GPUs whose "
        "agent reports processes (0.2.0 agents, NVML answering) drain.")
    over_budget_grace_s: float = Field(
        default=30.0, ge=0, le=24 * 3600,
        description="A shared slice whose processes use more GPU memory than its budget this "
        "long on end is over budget: warned (over_budget_since on the lease, event "
        "over_budget), and stopped with over_budget_action = \"stop\".")
    over_budget_action: Literal["warn", "stop"] = Field(
        default="warn",
        description="What a slice over budget for over_budget_grace_s gets: \"warn\" (the "
        "warning on the lease and the user's GPU page) or \"stop\" (its container is stopped, "
        "reason over_budget; needs stop_containers and 0.2.0 agents). Enforcement after the "
        "fact, not isolation: MIG isolates.")

    @model_validator(mode="after")
    def _over_budget_stop_needs_stops(self) -> AllocatorSettings:
        if self.over_budget_action == "stop" and not self.stop_containers:
            raise ValueError('over_budget_action = "stop" needs stop_containers = true: '
                             "without it no container is stopped and the lease would stay "
                             "releasing")
        return self
    strict_guarantees: bool = Field(
        default=False,
        description="Refuse to start when the user guarantees, or the group guarantees, add up "
        "to more GPUs than the cluster has (cluster_gpus, or the ledger's GPUs), or the "
        "per-model ones of a model to more than its GPUs (cluster_model_gpus, or the ledger's).")
    cluster_gpus: int | None = Field(
        default=None, ge=0,
        description="GPUs the guarantees are checked against with strict_guarantees; None: the "
        "present GPUs the ledger knows at start.")
    cluster_model_gpus: dict[str, NonNegativeInt] = Field(
        default_factory=dict,
        description="model or alias -> GPUs of that model the per-model guarantees are checked "
        "against with strict_guarantees; a model not named: its present GPUs the ledger knows "
        "at start.")


def ledger_log_retention_problem(max_bytes: int, segment_bytes: int,
                                 snapshot_bytes: int) -> str | None:
    """Why the log stream could drop its newest snapshot before the next one is whole, or None.

    RabbitMQ drops a stream's oldest segments while the rest is over ``max_bytes``, so it
    keeps at least ``max_bytes`` less one segment (which may overrun its size by a chunk: two
    are allowed). The newest whole snapshot starts at most ``snapshot_bytes`` of entries, the
    snapshot written after them and itself before the log's end; with a snapshot no larger
    than ``snapshot_bytes`` (the writer logs an error when one is) that is under four times
    ``snapshot_bytes``.
    """
    kept = max_bytes - 2 * segment_bytes
    if 4 * snapshot_bytes > kept:
        return (f"ledger_log_snapshot_bytes = {snapshot_bytes} is more than a quarter of "
                f"ledger_log_max_bytes = {max_bytes} less two ledger_log_segment_bytes = "
                f"{segment_bytes}: the stream could drop the newest snapshot before the next "
                "one is whole; lower it or raise ledger_log_max_bytes")
    return None


def guarantee_problem(settings: AllocatorSettings, cluster_gpus: float,
                      model_gpus: Mapping[str, int] | None = None) -> str | None:
    """With strict guarantees: why the guarantees cannot all be honoured at once, or None.

    ``cluster_gpus`` is the cluster's size; ``model_gpus`` the present GPUs of each model the
    ledger knows (canonical name -> GPUs). The per-model guarantees of a model are checked
    against its GPUs, ``cluster_model_gpus`` where that names the model.
    """
    for scope, guarantees in (("user", settings.user_quota), ("group", settings.group_quota)):
        total = sum(guarantees.values())
        if total > cluster_gpus:
            return (f"the {scope} guarantees ({scope}_quota) add up to {total:g} GPUs, more than "
                    f"the cluster's {cluster_gpus:g} (strict_guarantees is set)")
    return _model_guarantee_problem(settings, model_gpus or {})


def _model_guarantee_problem(settings: AllocatorSettings,
                             model_gpus: Mapping[str, int]) -> str | None:
    names = ModelNames.build(model_gpus, settings.aliases)

    def model_of(name: str) -> str:
        # A name the cluster does not know still groups with its other spellings.
        return names.canonical(name) or unbranded(name) or name

    gpus: dict[str, float] = {model_of(model): count for model, count in model_gpus.items()}
    for model, count in settings.cluster_model_gpus.items():
        gpus[model_of(model)] = count
    for scope, per_model in (("user", settings.user_model_quota),
                             ("group", settings.group_model_quota)):
        totals: dict[str, float] = {}
        spelled: dict[str, str] = {}
        for by_model in per_model.values():
            for model, guarantee in by_model.items():
                key = model_of(model)
                totals[key] = totals.get(key, 0) + guarantee
                spelled.setdefault(key, key if key in names.known else model)
        for key in sorted(totals):
            if totals[key] > gpus.get(key, 0):
                return (f"the {scope} guarantees of model {spelled[key]} ({scope}_model_quota) "
                        f"add up to {totals[key]:g} GPUs, more than the cluster has of that "
                        f"model: {gpus.get(key, 0):g} (strict_guarantees is set)")
    return None


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> AllocatorSettings:
    """The settings: ``overrides`` over the environment over the TOML file over defaults.

    ``config_file`` names the TOML file (else ``SWARM_GPU_CONFIG`` does).
    """
    if config_file is not None:
        overrides["config"] = config_file
    return AllocatorSettings(**overrides)
