"""Node agent settings: environment variables (``SWARM_GPU_AGENT_*``) over an optional TOML file.

Precedence, highest first (pydantic-settings' sources, :mod:`allocator.settings_files`):
keyword arguments (the command line, whose flags are made from these fields), environment,
the TOML file named by ``--config`` or ``SWARM_GPU_AGENT_CONFIG``, defaults. Example file::

    amqp_url = "amqp://agent-gpu-a:secret@rabbitmq:5672/"
    interval_s = 5
    inventory = "nvml"
    fatal_xids = [48, 63, 64, 74, 79, 92, 94, 95, 119, 120]
    overheat_c = 90
    overheat_hysteresis_c = 10

List settings may also be given in the environment as JSON or comma separated:
``SWARM_GPU_AGENT_FATAL_XIDS=48,79``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from allocator.amqp.broker import DEFAULT_AMQP_URL, BrokerTLSSettings
from allocator.logs import LogSettings
from allocator.metrics.endpoint import HealthSettings, MetricsTokenSettings
from allocator.settings_files import FileSettings, list_from_text, secret_file_field
from nodeagent.gpu_processes import DEFAULT_DRIVER_PROCESSES

ENV_PREFIX = "SWARM_GPU_AGENT_"

DEFAULT_DOCKER_URL = "unix:///var/run/docker.sock"

DEFAULT_FATAL_XIDS: tuple[int, ...] = (48, 63, 64, 74, 79, 92, 94, 95, 119, 120)
"""XID codes that make a GPU unhealthy. Chosen from NVIDIA's XID catalogue for what they
say about the *hardware*, not about the program that ran on it:

- 48  double-bit (uncorrectable) ECC error: memory is bad until a reset retires the page.
- 63  ECC page retirement / row-remap recorded: memory is degrading; a reset applies the remap.
- 64  ECC page retirement / row-remap *failed*: the bad memory could not be fenced off.
- 74  NVLink error: links between GPUs failed; multi-GPU jobs break until a reset.
- 79  GPU has fallen off the bus: unreachable until the host reboots (usually also "lost").
- 92  high single-bit ECC error rate: memory is degrading fast.
- 94  contained ECC error: the affected program was killed; the GPU goes on, but new work
      should not land on it at once.
- 95  uncontained ECC error: every program on the GPU is affected; a reset is needed.
- 119 GSP RPC timeout and 120 GSP error: the GPU's firmware stopped answering.

Left out on purpose: 13 (graphics engine exception), 31 (GPU memory page fault), 43 (GPU
stopped processing) and 45 (pre-emptive cleanup). These are what a user's own bug, an
out-of-bounds access or a killed notebook produce; counting them would let any user take
GPUs out of service. All of them still appear in ``recent_xids`` for the operator.
"""


def docker_host_or_standard_socket() -> str:
    """``DOCKER_HOST`` if set, else Docker's standard socket."""
    return os.environ.get("DOCKER_HOST") or DEFAULT_DOCKER_URL


class AgentSettings(FileSettings, BrokerTLSSettings, LogSettings, MetricsTokenSettings,
                    HealthSettings):
    """Everything the node agent reads at start (``config``: the TOML file); the broker's
    TLS files: :class:`allocator.amqp.broker.BrokerTLSSettings`; ``log_level`` and ``log_format``:
    :class:`allocator.logs.LogSettings`; ``health_stale_s``:
    :class:`allocator.metrics.endpoint.HealthSettings`."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        extra="ignore",
        # the command line (nodeagent.cli): --amqp-url, --docker / --no-docker, lists as a,b
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_avoid_json=True,
        cli_hide_none_type=True,
        cli_shortcuts={"interval-s": "interval"},
    )

    host: str | None = Field(
        default=None,
        description="This node's name as the allocator and Swarm know it (the spawner "
        "constrains on node.hostname). None: the Docker engine's node name if the engine "
        "answers, else socket.gethostname().",
    )
    amqp_url: str = Field(
        default=DEFAULT_AMQP_URL,
        description="Broker URL (several nodes of a broker cluster: host1:port1,host2:port2; "
        "allocator/amqp/broker.py). Its user is sent as the AMQP user_id of every message.",
    )
    amqp_url_file: Path | None = secret_file_field("amqp_url")
    interval_s: float = Field(default=5.0, gt=0, le=3600, description="Heartbeat period.")
    full_report_s: float = Field(
        default=20.0, ge=0, le=3600,
        description="A full heartbeat at least this often; the beats in between are deltas "
        "(what changed since the previous beat) whenever a delta can say it. 0: every "
        "heartbeat is full. Keep it below the allocator's start_fence_s (30 s), so that a "
        "restarted allocator has every node's full report before its start fence ends.",
    )
    delta_utilization_pct: float = Field(
        default=5.0, ge=0, le=100,
        description="A GPU's (or a container's) utilization counts as changed for a delta "
        "when it left the band of this width (0-5, 5-10, ...) that holds the value last "
        "reported: never this much off, and every crossing of a multiple of it is sent. Keep "
        "the allocator's idle_utilization_pct a multiple of it.")
    delta_memory_mib: int = Field(
        default=256, ge=0, le=1 << 20,
        description="Same for memory used (a GPU's, or a container's on a GPU), in MiB.")
    delta_temperature_c: float = Field(
        default=5.0, ge=0, le=300, description="Same for a GPU's temperature.")
    delta_power_w: float = Field(
        default=25.0, ge=0, le=10_000, description="Same for a GPU's power draw.")
    inventory: Literal["nvml", "simulated"] = Field(
        default="nvml", description="Where GPUs come from: NVML, or a simulated inventory file."
    )
    simulated_file: Path | None = Field(
        default=None, description="The simulated inventory JSON (inventory = 'simulated')."
    )
    docker_url: str = Field(
        default_factory=docker_host_or_standard_socket,
        description="Docker engine endpoint; default DOCKER_HOST or the standard socket.",
    )
    docker: bool = Field(
        default=True,
        description="Watch lease containers. Off: heartbeats list no containers and say "
        "containers_complete=False, so the allocator releases nothing because of them.",
    )
    docker_events: bool = Field(
        default=True,
        description="Follow Docker's event stream, so a lease container's start and death "
        "reach the allocator the moment they happen. Off (listing mode): no container events "
        "are sent; the lease containers are re-listed before every heartbeat, and the GPU of a "
        "container that died comes back through heartbeat reconciliation only, about one "
        "interval later. For engines whose event stream cannot be used, and to measure that "
        "path (bench/release.py).",
    )
    stop_commands: bool = Field(
        default=True,
        description="Carry out the allocator's stop commands: stop a lease container at once "
        "when the hub released its lease (the GPU is free in milliseconds, not when Swarm "
        "stops the task seconds later), when an admin force-released it, or when it runs for "
        "a lease that already ended. Only containers labelled with that lease are touched. "
        "Needs docker.",
    )
    command_users: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["allocator"],
        description="Broker users (the AMQP user_id the broker verifies) whose commands are "
        "carried out: the allocator's user. Commands from anyone else are logged and ignored.",
    )
    command_check_s: float = Field(
        default=5.0, gt=0, le=300,
        description="How often the command consumer checks that its connection, channel and "
        "consumer are still there (it also notices at once when the broker says so).",
    )
    metrics_port: int = Field(
        default=9465, ge=0, le=65535,
        description="Port of the agent's Prometheus metrics (/metrics): heartbeats, events, "
        "stop commands, NVML and Docker call latency, and each GPU's health, utilization, "
        "memory and temperature with DCGM exporter's labels. 0: off. A port already in use "
        "is logged as an error and the agent runs on without metrics.",
    )
    metrics_addr: str = Field(
        default="127.0.0.1",
        description="Address the metrics port binds to. The default, loopback, shows the "
        "metrics to nobody else; set 0.0.0.0 (or the address of the network Prometheus "
        "scrapes from) to let Prometheus reach them.",
    )
    gpu_processes: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Report every process on each GPU (GPUInfo.processes: its container, "
        "or the host). auto: once the allocator said it reads them (its hello command, "
        "which reaches the agent through the command consumer: never with docker or "
        "stop_commands off); each hello's answer holds until the next. on: always, for an "
        "allocator of 0.2.0 or later only (one before refuses such heartbeats and the host "
        "goes down). off: never.")
    driver_processes: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(DEFAULT_DRIVER_PROCESSES),
        description="Command names of the driver's own daemons, left out of the processes "
        "reported when they run on the host (not in a container): they hold a context on "
        "every GPU and use none of it for anyone. Compared as the kernel keeps a command "
        "name, cut to 15 characters.")
    pin_cpus: bool = Field(
        default=False,
        description="Pin each lease container to the CPUs near its GPUs (the union of their "
        "CPU affinity, from this agent's reading of how the GPUs are joined; a MIG instance: "
        "its parent GPU's) with Docker's container update (docker update --cpuset-cpus), at "
        "its start and, for those already running, at the agent's start. A Swarm service "
        "cannot be given a cpuset; Swarm does not know of this one, and a restarted task is "
        "pinned again when it starts. Where the CPUs are not known the container is left "
        "alone (counted). Needs docker.",
    )
    proc_root: Path = Field(
        default=Path("/proc"),
        description="Where the host's /proc is visible, to map GPU processes to containers. "
        "In a Swarm service (which cannot share the host PID namespace) mount the host's "
        "/proc read-only, e.g. at /host/proc.",
    )

    # Health rules: see nodeagent.health for what each knob does.
    fatal_xids: Annotated[list[int], NoDecode] = Field(
        default_factory=lambda: list(DEFAULT_FATAL_XIDS),
        description="XID codes that make a GPU unhealthy (see DEFAULT_FATAL_XIDS for why).",
    )
    xid_quiet_s: float = Field(
        default=600.0, ge=0,
        description="A GPU with a fatal XID is healthy again after this long without one.",
    )
    xid_repeat_count: int = Field(
        default=3, ge=1,
        description="This many fatal XIDs within xid_repeat_window_s keep the GPU unhealthy "
        "until the agent restarts (after the GPU was reset or the host rebooted).",
    )
    xid_repeat_window_s: float = Field(
        default=3600.0, gt=0, description="The window of xid_repeat_count.")
    recent_xid_s: float = Field(
        default=3600.0, gt=0, description="How long an XID is listed in recent_xids."
    )
    overheat_c: float = Field(
        default=90.0,
        description="Unhealthy at or above this temperature. Most data-centre and consumer "
        "GPUs start to slow down between 85 and 95 C.",
    )
    overheat_hysteresis_c: float = Field(
        default=10.0, ge=0,
        description="An overheated GPU is healthy again below overheat_c minus this, so a GPU "
        "hovering at the threshold does not flap.",
    )
    ecc_stable_s: float = Field(
        default=600.0, ge=0,
        description="After the uncorrected ECC count rises, the GPU is unhealthy until the "
        "count has not changed for this long.",
    )

    # Bounds on everything that can hang.
    publish_timeout_s: float = Field(
        default=5.0, gt=0, description="Bound on one publish (and on connecting to the broker)."
    )
    amqp_reconnect_s: float = Field(
        default=2.0, gt=0, description="Pause between broker connection attempts."
    )
    event_buffer: int = Field(
        default=1000, ge=1,
        description="Container events kept for retry while the broker is unreachable; when "
        "full, the oldest is dropped (logged and counted).",
    )
    docker_timeout_s: float = Field(
        default=10.0, gt=0, description="Bound on one Docker API call (list, info)."
    )
    docker_backoff_s: float = Field(
        default=0.5, gt=0, description="First pause after the Docker event stream broke."
    )
    docker_backoff_max_s: float = Field(
        default=30.0, gt=0, description="Longest pause between Docker reconnect attempts."
    )
    docker_liveness_s: float = Field(
        default=15.0, gt=0,
        description="After this long without a Docker event the agent pings the engine: a "
        "half-open connection never ends the event stream by itself.",
    )
    docker_replay_grace_s: float = Field(
        default=1.0, ge=0,
        description="After a reconnect, how long the replayed events may take to report a "
        "container that vanished during the gap before the agent reports it itself.",
    )
    inventory_timeout_s: float = Field(
        default=10.0, gt=0, description="Bound on one inventory read (NVML can hang)."
    )
    xid_poll_s: float = Field(
        default=1.0, gt=0, le=60,
        description="Timeout of one XID wait in the XID thread; bounds how long stop() waits.",
    )

    @field_validator("fatal_xids", "command_users", "driver_processes", mode="before")
    @classmethod
    def _lists_from_text(cls, value: Any) -> Any:
        return list_from_text(value)

    @field_validator("metrics_addr")
    @classmethod
    def _an_ip_address(cls, value: str) -> str:
        # An address, not a host name: a name would be resolved once at start, and a typo
        # would only show as an error in the log while the agent runs on without metrics.
        try:
            ipaddress.ip_address(value)
        except ValueError:
            raise ValueError(f"{value!r} is not an IP address (e.g. 127.0.0.1 or 0.0.0.0)") \
                from None
        return value

    @model_validator(mode="after")
    def _consistent(self) -> AgentSettings:
        if self.inventory == "simulated" and self.simulated_file is None:
            raise ValueError("inventory 'simulated' needs simulated_file")
        if self.docker_backoff_max_s < self.docker_backoff_s:
            raise ValueError("docker_backoff_max_s must not be less than docker_backoff_s")
        return self


def load_settings(config_file: str | Path | None = None, **overrides: Any) -> AgentSettings:
    """The settings: ``overrides`` over the environment over the TOML file over defaults.

    ``config_file`` names the TOML file (else ``SWARM_GPU_AGENT_CONFIG`` does).
    ``overrides`` whose value is None are left out, as if not given.
    """
    given = {key: value for key, value in overrides.items() if value is not None}
    if config_file is not None:
        given["config"] = config_file
    return AgentSettings(**given)


def resolve_host(settings: AgentSettings, engine_node_name: str | None) -> str:
    """This node's name: the setting, else the Docker engine's node name, else the hostname.

    The engine's name comes first because it is what Swarm's ``node.hostname`` constraint
    matches, and the agent may run in a container whose own hostname is a container id.
    """
    if settings.host:
        return settings.host
    if engine_node_name:
        return engine_node_name
    return socket.gethostname()
