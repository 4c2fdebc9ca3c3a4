"""Helpers the benchmarks share: percentiles, server processes, /proc figures, the ledger.

Standard library plus the project itself; the benchmarks put the repository root on
``sys.path``, for :mod:`tests.support.services` (which creates and deletes vhosts).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import signal
import sqlite3
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aiodocker.events import DockerEvents

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from allocator.amqp.client import AllocatorClient, AllocatorError  # noqa: E402
from nodeagent.simulated import write_inventory  # noqa: E402
from tests.support import services  # noqa: E402  (vhosts of the local broker)

__all__ = ["services"]

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def percentile(values: list[float], fraction: float) -> float:
    """The value below which ``fraction`` of ``values`` lie (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def summary_ms(seconds: list[float]) -> dict[str, float]:
    """count, p50, p99 and max of durations given in seconds, in milliseconds."""
    if not seconds:
        return {"count": 0}
    return {
        "count": len(seconds),
        "p50_ms": round(statistics.median(seconds) * 1000, 2),
        "p99_ms": round(percentile(seconds, 0.99) * 1000, 2),
        "max_ms": round(max(seconds) * 1000, 2),
    }


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    load = os.getloadavg()
    return {"cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "load_avg_1m_at_start": round(load[0], 2),
            "date": time.strftime("%Y-%m-%d %H:%M %Z")}


def start_process(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[str]:
    """A server process whose output goes to a log file (a pipe nobody reads would block it)."""
    with log.open("a") as handle:
        return subprocess.Popen(args, env={**os.environ, **env}, stdout=handle,
                                stderr=subprocess.STDOUT, text=True, cwd=REPO)


def stop_process(process: subprocess.Popen[str], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if it does not end in time."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextlib.contextmanager
def processes() -> Iterator[list[subprocess.Popen[str]]]:
    """A list to put started processes in; every one still running is stopped at the end."""
    started: list[subprocess.Popen[str]] = []
    try:
        yield started
    finally:
        for process in reversed(started):
            stop_process(process)


class Profiler:
    """py-spy sampling a running process, its stacks written collapsed (``-f raw``).

    Non-blocking (the process is not paused to read its stacks), so the figures measured
    meanwhile stay the process's own; every thread (the ledger's too), idle ones left out as
    far as py-spy can tell: a thread blocked in ``epoll_wait`` or an fsync still counts.
    py-spy comes from the registries (``pip install py-spy``); it needs ptrace rights.
    """

    def __init__(self, pid: int, out: Path, *, rate: int = 500) -> None:
        self.out = out
        self._process = start_process(
            [py_spy(), "record", "--pid", str(pid), "--nonblocking", "--threads",
             "-r", str(rate), "-f", "raw", "-o", str(out)],
            {}, out.with_suffix(".log"))

    def stop(self) -> dict[str, Any]:
        """Stop sampling (py-spy writes its file on SIGINT) and summarize what it saw."""
        self._process.send_signal(signal.SIGINT)
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        return profile_summary(self.out)


def py_spy() -> str:
    """The py-spy beside this Python (the checkout's virtual environment), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else "py-spy"


def profile_summary(path: Path, count: int = 15) -> dict[str, Any]:
    """What a collapsed-stacks file says, in shares of all on-CPU samples: the busiest
    functions counting what they call (``inclusive_pct``, the project's and SQLite's frames
    and the transport's), and the functions the CPU was in itself (``self_pct``)."""
    if not path.exists():
        return {}
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        samples = int(count_text)
        total += samples
        frames = [frame for frame in stack.split(";") if not frame.startswith("thread ")]
        for frame in dict.fromkeys(frames):
            inclusive[frame] = inclusive.get(frame, 0) + samples
        if frames:
            own[frames[-1]] = own.get(frames[-1], 0) + samples

    def top(counts: dict[str, int], keep: Any) -> dict[str, float]:
        ranked = sorted((item for item in counts.items() if keep(item[0])),
                        key=lambda item: -item[1])[:count]
        return {frame: round(100 * n / max(total, 1), 1) for frame, n in ranked}

    def ours(frame: str) -> bool:
        return any(part in frame for part in ("allocator/", "sqlite", "aio_pika/",
                                              "aiormq/", "pamqp/", "asyncio/"))

    return {"samples": total, "inclusive_pct": top(inclusive, ours),
            "self_pct": top(own, lambda frame: True)}


def allocator_command() -> list[str]:
    return [sys.executable, "-m", "allocator.admin.cli", "serve"]


async def wait_for_allocator(amqp_url: str, within: float = 30.0) -> None:
    """Until the allocator answers (it declares the topology when it starts)."""
    deadline = time.monotonic() + within
    while True:
        try:
            async with AllocatorClient(amqp_url, timeout_s=1) as client:
                await client.queue()
                return
        except AllocatorError:
            if time.monotonic() > deadline:
                raise RuntimeError("the allocator did not start") from None
            await asyncio.sleep(0.1)


class ProcStat:
    """CPU time and memory of one process, from /proc (Linux)."""

    def __init__(self, pid: int):
        self.pid = pid

    def cpu_seconds(self) -> float:
        """User + system CPU seconds so far."""
        text = Path(f"/proc/{self.pid}/stat").read_text()
        fields = text[text.rindex(")") + 2:].split()
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS

    def memory_mib(self) -> dict[str, float]:
        """Resident memory now (VmRSS) and its peak so far (VmHWM), MiB."""
        values: dict[str, float] = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = round(int(rest.split()[0]) / 1024, 1)
        return {"rss_mib": values.get("VmRSS", 0.0), "peak_rss_mib": values.get("VmHWM", 0.0)}


class CpuMeter:
    """CPU use of a process between :meth:`start` and :meth:`stop`, in % of one core."""

    def __init__(self, pid: int):
        self.stat = ProcStat(pid)
        self._cpu = 0.0
        self._wall = 0.0

    def start(self) -> None:
        self._cpu, self._wall = self.stat.cpu_seconds(), time.monotonic()

    def stop(self) -> float:
        cpu, wall = self.stat.cpu_seconds(), time.monotonic()
        return round(100 * (cpu - self._cpu) / max(wall - self._wall, 1e-9), 1)


def broker_pid() -> int | None:
    """The RabbitMQ node's process (beam.smp) on this machine, if one runs here."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == "beam.smp":
                    return int(entry.name)
            except OSError:
                continue
    return None


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, all cores (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / CLOCK_TICKS, sum(fields) / CLOCK_TICKS


class CpuMeters:
    """CPU use of several processes and of the whole machine between start and stop."""

    def __init__(self, pids: dict[str, int | None]):
        self.meters = {name: CpuMeter(pid) for name, pid in pids.items() if pid is not None}
        self._machine = (0.0, 0.0)

    def start(self) -> None:
        for meter in self.meters.values():
            meter.start()
        self._machine = machine_cpu_seconds()

    def stop(self) -> dict[str, float]:
        """% of one core per process, and the machine's busy % of all its cores."""
        result = {}
        for name, meter in self.meters.items():
            try:
                result[name] = meter.stop()
            except OSError:
                continue
        busy, total = machine_cpu_seconds()
        result["machine_busy_pct_of_all_cores"] = round(
            100 * (busy - self._machine[0]) / max(total - self._machine[1], 1e-9), 1)
        return result


def read_ledger(path: Path, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Rows of a query on a ledger, read-only (WAL: the allocator writing is never blocked)."""
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        return connection.execute(sql, params).fetchall()
    finally:
        connection.close()


def file_sizes_mib(path: Path) -> dict[str, float]:
    """Sizes of a SQLite database and its WAL, MiB."""
    sizes = {}
    for suffix in ("", "-wal", "-shm"):
        candidate = Path(f"{path}{suffix}")
        if candidate.exists():
            sizes[candidate.name.split(".")[-1] or "db"] = round(
                candidate.stat().st_size / 2**20, 2)
    return sizes


# ------------------------------------------------------------------------ Swarm services

TRAP_TERM = 'trap "exit 0" TERM; while true; do sleep 0.1; done'
"""A task command that exits at once on SIGTERM, so no one waits out a stop timeout."""


def task_template(image: str, command: list[str], *, labels: dict[str, str] | None = None,
                  env: dict[str, str] | None = None, constraints: list[str] | None = None,
                  generic_resources: dict[str, int] | None = None) -> dict[str, Any]:
    """A Swarm task template as ``docker service create --network host
    --restart-condition none`` makes it (the API takes no image resolution step)."""
    template: dict[str, Any] = {
        "ContainerSpec": {"Image": image, "Command": command,
                          "Labels": dict(labels or {}),
                          "Env": dict(env or {}),  # aiodocker turns it into KEY=value
                          "StopGracePeriod": 2_000_000_000},
        "RestartPolicy": {"Condition": "none"},
        "Networks": [{"Target": "host"}],
        "Placement": {"Constraints": list(constraints or [])},
    }
    if generic_resources:
        template["Resources"] = {"Reservations": {"GenericResources": [
            {"DiscreteResourceSpec": {"Kind": kind, "Value": value}}
            for kind, value in generic_resources.items()]}}
    return template


async def task_state(docker: Any, service: str) -> tuple[str | None, str | None]:
    """(state, container id) of the newest task of a service."""
    tasks = await docker.tasks.list(filters={"service": service})
    if not tasks:
        return None, None
    newest = max(tasks, key=lambda t: t.get("CreatedAt", ""))
    status = newest.get("Status") or {}
    container = (status.get("ContainerStatus") or {}).get("ContainerID")
    return status.get("State"), container


async def wait_running(docker: Any, service: str, *, within: float = 60.0,
                       poll_s: float = 0.02) -> str:
    """Poll until the service's task runs; its container id."""
    deadline = time.monotonic() + within
    while True:
        state, container = await task_state(docker, service)
        if state == "running" and container:
            return container
        if state in ("failed", "rejected", "shutdown", "complete"):
            raise RuntimeError(f"task of {service} ended as {state}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"task of {service} not running after {within} s ({state})")
        await asyncio.sleep(poll_s)


class DieListener:
    """Docker's own ``die`` events, as a bare aiodocker listener sees them: the baseline the
    allocator's release by event is compared with (same engine, same run).

    ``seen[container_id]`` is the wall-clock time (``time.time()``) the event arrived here.
    """

    def __init__(self, docker: Any):
        self.docker = docker
        self.seen: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None
        self._arrived = asyncio.Event()

    async def __aenter__(self) -> DieListener:
        events = DockerEvents(self.docker)
        subscriber = events.subscribe(create_task=False)
        stream = asyncio.create_task(events.run(
            filters=json.dumps({"type": ["container"], "event": ["die"]})))

        async def read() -> None:
            try:
                while (event := await subscriber.get()) is not None:
                    self.seen.setdefault(event.get("id", ""), time.time())
                    self._arrived.set()
            finally:
                stream.cancel()
                with contextlib.suppress(BaseException):
                    await stream

        self._task = asyncio.create_task(read())
        await asyncio.sleep(0.2)  # the subscription is open before anything is stopped
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task

    async def wait(self, container_id: str, within: float = 30.0) -> float | None:
        """When ``container_id``'s ``die`` arrived (None if not within ``within`` s)."""
        deadline = time.monotonic() + within
        while container_id not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._arrived.wait()
        return self.seen[container_id]


def agent_env(host: str, amqp_url: str, inventory: Path, docker_url: str,
              interval_s: float = 2.0) -> dict[str, str]:
    """The environment of a node agent (``python -m nodeagent``) for ``host`` with a simulated
    inventory, watching ``docker_url``, carrying out the stop commands of ``guest`` (the
    allocator's broker user in the benchmarks; in a cluster: ``allocator``)."""
    return {"SWARM_GPU_AGENT_HOST": host, "SWARM_GPU_AGENT_AMQP_URL": amqp_url,
            "SWARM_GPU_AGENT_INVENTORY": "simulated",
            "SWARM_GPU_AGENT_SIMULATED_FILE": str(inventory),
            "SWARM_GPU_AGENT_INTERVAL_S": f"{interval_s:g}",
            "SWARM_GPU_AGENT_DOCKER_URL": docker_url, "SWARM_GPU_AGENT_COMMAND_USERS": "guest"}


GPU_PROCESSES = {"on": "auto", "off": "off"}
"""The agent's ``gpu_processes`` setting by the name ``--gpu-processes`` takes: ``on`` is the
default (auto: reported once the allocator's hello says it reads them), ``off`` never."""


class ProcessListing:
    """A simulated inventory whose GPUs list processes as the driver lists them: each
    container's main process (its real pid, so the agent maps it to the container through
    ``/proc/<pid>/cgroup``) on its lease's GPU, from :meth:`add` until the process exits. A
    pidfd tells the moment it exits, and the file is rewritten then: the agent's next report
    shows it gone, as NVML's listing would once the process has ended."""

    def __init__(self, path: Path, host: str, gpus: list[dict[str, Any]],
                 memory_mib: int = 256):
        self.path, self.host, self.gpus, self.memory_mib = path, host, gpus, memory_mib
        self.on_gpu: dict[int, str] = {}
        """pid -> the GPU uuid it is listed on."""
        self._pidfds: dict[int, int] = {}
        self.write()

    def write(self) -> None:
        listed: dict[str, list[dict[str, Any]]] = {}
        for pid, gpu_uuid in self.on_gpu.items():
            listed.setdefault(gpu_uuid, []).append(
                {"pid": pid, "used_memory_mib": self.memory_mib})
        write_inventory(self.path, {self.host: [
            {**gpu, "processes": listed.get(gpu["uuid"], [])} for gpu in self.gpus]})

    async def add(self, docker: Any, container_id: str, gpu_uuid: str) -> None:
        """List ``container_id``'s main process on ``gpu_uuid`` until it exits."""
        pid = int((await docker.containers.container(container_id).show())["State"]["Pid"])
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            return  # already ended: the driver would not list it
        self.on_gpu[pid] = gpu_uuid
        self._pidfds[pid] = pidfd
        asyncio.get_running_loop().add_reader(pidfd, self._exited, pid)
        self.write()

    def _exited(self, pid: int) -> None:
        pidfd = self._pidfds.pop(pid)
        asyncio.get_running_loop().remove_reader(pidfd)
        os.close(pidfd)
        del self.on_gpu[pid]
        self.write()

    def close(self) -> None:
        """Stop watching (the processes still listed stay in the file)."""
        loop = asyncio.get_running_loop()
        for pidfd in self._pidfds.values():
            loop.remove_reader(pidfd)
            os.close(pidfd)
        self._pidfds.clear()
