"""Helpers of the fault tests: allocator processes, ledger audits, figures to report.

Every fault test ends with :func:`audit_ledger`, which runs the invariant checker
(:func:`allocator.ledger.invariants.check_ledger`) on the ledger file and adds the accounting the
fault tests promise: one lease per request key, no GPU in two holding leases, and the GPUs
held equal to the GPUs of the leases that hold them.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import itertools
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aio_pika

from allocator.ledger.invariants import NodeReport, Violation, check_ledger
from allocator.ledger.readonly import open_readonly

REPO_ROOT = Path(__file__).resolve().parents[2]

HOLDING = ("granted", "bound", "releasing")

LEDGER_LOGS = ("off", "stream")
"""The two ways allocators keep the ledger (``ledger_log``): one SQLite file they share, or
the replicated log, each replica applying it to a file of its own (what compose/stack.yml
ships). A fault test runs in both where the fault means something in both; where it does
not, its module says why."""


def replica_ledger(ledger_path: Path, replica: str, ledger_log: str) -> Path:
    """The ledger file of allocator ``replica``: the shared one without the log, a file of
    its own with it (replicas on different nodes, each on its own disk)."""
    if ledger_log == "off":
        return ledger_path
    return ledger_path.with_name(f"{ledger_path.stem}-{replica}{ledger_path.suffix}")


def fault_name(name: str, ledger_log: str) -> str:
    """The name :func:`report` files a fault under: as before for ``off``, ``_stream`` added
    for the replicated log."""
    return name if ledger_log == "off" else f"{name}_stream"


def report(name: str, **figures: Any) -> dict[str, Any]:
    """Print the figures of one fault run as one JSON line (``pytest -rA`` or ``-s`` shows it).

    With ``SWARM_GPU_FAULT_RESULTS`` set to a file, the line is appended there too, so that
    ``docs/reliability.md`` can be refreshed from a run.
    """
    line = json.dumps({"fault": name, **figures}, sort_keys=True)
    print(f"FAULT-RESULT {line}")
    target = os.environ.get("SWARM_GPU_FAULT_RESULTS")
    if target:
        with open(target, "a", encoding="utf-8") as handle:
            handle.write(line + "\n")
    return figures


# ------------------------------------------------------------------------------ ledger


@dataclass
class LedgerAudit:
    """What the ledger says after a fault, checked."""

    violations: list[Violation]
    leases: dict[str, dict[str, Any]]
    """lease id -> row (state, request_key, host, gpu_uuids, release_reason...)."""
    leases_per_key: Counter[str]
    held_gpus: list[str]
    """Every GPU uuid a holding lease lists (twice for two slices of one GPU)."""
    double_booked: list[str] = field(default_factory=list)

    def by_state(self) -> Counter[str]:
        return Counter(row["state"] for row in self.leases.values())

    def holding(self) -> dict[str, dict[str, Any]]:
        return {i: r for i, r in self.leases.items() if r["state"] in HOLDING}


def audit_ledger(path: Path, reports: dict[str, NodeReport] | None = None) -> LedgerAudit:
    """Run the invariant checker on the ledger at ``path`` (with ``reports``, also against
    what the nodes said runs on them) and collect the accounting."""
    conn = open_readonly(path)
    try:
        violations = check_ledger(conn, reports, grace_s=1.0)
        conn.row_factory = sqlite3.Row
        leases = {}
        for row in conn.execute("SELECT * FROM leases"):
            record = dict(row)
            record["gpu_uuids"] = json.loads(record["gpu_uuids"] or "[]")
            leases[record["lease_id"]] = record
    finally:
        conn.close()
    per_key = Counter(row["request_key"] for row in leases.values())
    held = [u for row in leases.values() if row["state"] in HOLDING for u in row["gpu_uuids"]]
    exclusive = Counter(u for row in leases.values() if row["state"] in HOLDING
                        and not row["shared"] for u in row["gpu_uuids"])
    # Shared slices may share a GPU (the checker bounds their slots and memory); an
    # exclusive holder may not share it with anyone.
    double = sorted(u for u, n in Counter(held).items() if n > 1 and exclusive[u])
    return LedgerAudit(violations, leases, per_key, held, double)


async def first_kept_offset(url: str, stream: str = "swarm-gpu.ledger-log") -> int:
    """The offset of the oldest entry the ledger log's stream still keeps (above 0 once
    RabbitMQ has dropped its oldest segments)."""
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=1)
        queue = await channel.declare_queue(stream, durable=True, passive=True)
        first: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            if not first.done():
                first.set_result(int(message.headers["x-stream-offset"]))  # type: ignore[arg-type]
        await queue.consume(on_message, arguments={"x-stream-offset": "first"})
        return await asyncio.wait_for(first, 10)


async def log_entries(url: str, through: int, stream: str = "swarm-gpu.ledger-log"
                      ) -> dict[int, Any]:
    """offset -> entry (:mod:`allocator.ledger.log_entries`) of the ledger log's stream, from the
    oldest entry it keeps through offset ``through``."""
    from allocator.ledger.log_entries import decode_entry

    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=100)
        queue = await channel.declare_queue(stream, durable=True, passive=True)
        entries: dict[int, Any] = {}
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            offset = int(message.headers["x-stream-offset"])  # type: ignore[arg-type]
            if offset <= through:
                entries[offset] = decode_entry(message.body)
            await message.ack()
            if offset >= through and not done.done():
                done.set_result(None)
        await queue.consume(on_message, arguments={"x-stream-offset": "first"})
        await asyncio.wait_for(done, 10)
        return entries


def leases_granted_in(entries: dict[int, Any]) -> dict[str, dict[str, int]]:
    """request key -> {lease id: offset of the first batch entry holding that lease}: which
    leases the log's batches gave each request key, and where."""
    found: dict[str, dict[str, int]] = {}
    for offset in sorted(entries):
        entry = entries[offset]
        if entry.kind != "batch":
            continue
        for lease_id, row in entry.changes.to_changes().leases.items():
            key = row.get("request_key")
            if key is not None:
                found.setdefault(key, {}).setdefault(lease_id, offset)
    return found


def backup_ledger(ledger: Path, target: Path) -> None:
    """docs/operations.md's backup of a running allocator's ledger: ``VACUUM INTO``, one
    consistent snapshot while the allocator keeps writing."""
    target.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(ledger)
    try:
        conn.execute("VACUUM INTO ?", (str(target),))
    finally:
        conn.close()


def gpu_ledger_check(path: Path, *, live_amqp: str | None = None,
                     listen_s: float = 2.0) -> subprocess.CompletedProcess[str]:
    """``gpu-ledger check --ledger PATH``, the operator's command after a fault; with
    ``live_amqp``, ``--live``: the ledger against what the nodes' heartbeats say runs."""
    command = [sys.executable, "-m", "allocator.admin.ledger_cli", "check", "--ledger", str(path)]
    if live_amqp is not None:
        command += ["--live", "--amqp", live_amqp, "--listen", str(listen_s), "--grace", "1",
                    "--json"]
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=60, check=False)


def assert_sound(audit: LedgerAudit) -> None:
    """The checks every fault test ends with (the invariant checker first; it also finds a
    request key with two active leases)."""
    assert audit.violations == [], "\n".join(str(v) for v in audit.violations)
    assert audit.double_booked == [], f"GPUs held exclusively and by another lease: " \
        f"{audit.double_booked}"


# ------------------------------------------------------------------ allocator processes


def allocator_env(amqp_url: str, ledger_path: Path, **settings: Any) -> dict[str, str]:
    """The environment of ``python -m allocator.admin.cli serve``: ``SWARM_GPU_*`` settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SWARM_GPU_") or k in ("SWARM_GPU_SERVICES_DIR",)}
    values: dict[str, Any] = {
        "amqp_url": amqp_url, "ledger_path": str(ledger_path), "allow_any_node_user": True,
        "admin_users": ["guest"],
    }
    values.update(settings)
    for key, value in values.items():
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, list | dict):
            text = json.dumps(value)
        else:
            text = str(value)
        env[f"SWARM_GPU_{key.upper()}"] = text
    env["PYTHONUNBUFFERED"] = "1"
    return env


class AllocatorProcess:
    """``python -m allocator.admin.cli serve`` as a child process, its output in a log file."""

    def __init__(self, name: str, amqp_url: str, ledger_path: Path, log_dir: Path,
                 **settings: Any) -> None:
        self.name = name
        self.env = allocator_env(amqp_url, ledger_path, **settings)
        self.log_path = log_dir / f"allocator-{name}.log"
        self.process: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: ASYNC230, SIM115 - handed to the child
        try:
            self.process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "allocator.admin.cli", "serve", cwd=REPO_ROOT, env=self.env,
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=asyncio.subprocess.STDOUT)
        finally:
            log.close()

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    async def wait_consuming(self, within: float = 30.0) -> None:
        """Until the process logs that it consumes (active or standby)."""
        deadline = time.monotonic() + within
        while "allocator consuming" not in self.log():
            assert self.process is not None
            if self.process.returncode is not None:
                raise AssertionError(f"allocator {self.name} exited "
                                     f"{self.process.returncode}:\n{self.log()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"allocator {self.name} not consuming within {within}s:"
                                     f"\n{self.log()[-3000:]}")
            await asyncio.sleep(0.05)

    def kill(self) -> None:
        """``kill -9``: no clean-up, no goodbye to the broker."""
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)

    async def stop(self, within: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not end in time; the exit status."""
        process = self.process
        if process is None:
            return None
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
            try:
                async with asyncio.timeout(within):
                    await process.wait()
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        return process.returncode


# ------------------------------------------------------------------ in-process allocator


@contextlib.asynccontextmanager
async def running_allocator(amqp_url: str, ledger_path: Path, **overrides: Any):
    """An :class:`~allocator.service.AllocatorService` with short timers (and ``overrides``).

    Any broker user may report for any host and ``guest`` is an admin, as in the ``allocator``
    fixture; the fault tests need their own timer settings.
    """
    from allocator.config import AllocatorSettings
    from allocator.service import AllocatorService
    from tests.support.common import started

    values: dict[str, Any] = {"amqp_url": amqp_url, "ledger_path": ledger_path,
                              "allow_any_node_user": True, "admin_users": ["guest"],
                              "tick_s": 0.1}
    values.update(overrides)
    async with started(AllocatorService(AllocatorSettings(**values))) as service:
        yield service


async def await_state(client: Any, lease_id: str, *states: Any, within: float = 10.0,
                      interval: float = 0.05) -> tuple[Any, float]:
    """Poll a lease until it is in one of ``states``: (the lease, seconds it took)."""
    started = time.monotonic()
    while True:
        lease = await client.status(lease_id=lease_id)
        if lease.state in states:
            return lease, time.monotonic() - started
        if time.monotonic() - started > within:
            raise AssertionError(f"lease {lease_id} still {lease.state.value} after {within}s "
                                 f"(waiting for {[s.value for s in states]})")
        await asyncio.sleep(interval)


# ----------------------------------------------------------------- a small disk


class SmallDisk:
    """An ext4 filesystem of a few MiB on a loop device, mounted with ``errors=remount-ro``,
    so a test can fill it (``fill``), make the kernel turn it read-only as on a disk error
    (``fail``), and repair it (``repair``: unmount, fsck, mount, as an operator would)."""

    def __init__(self, image: Path, mountpoint: Path, size_mib: int) -> None:
        self.image = image
        self.mountpoint = mountpoint
        self.size_mib = size_mib
        self.filler = mountpoint / "filler"

    def _run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), capture_output=True, text=True, timeout=60,
                              check=False)

    def create(self) -> str | None:
        """Make and mount the filesystem; None, or why it cannot be done here."""
        for tool in ("mkfs.ext4", "mount", "umount", "e2fsck"):
            if shutil.which(tool) is None:
                return f"{tool} not found"
        with open(self.image, "wb") as handle:
            handle.truncate(self.size_mib << 20)
        made = self._run("mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal",
                         str(self.image))
        if made.returncode != 0:
            return f"mkfs.ext4: {made.stderr.strip()}"
        self.mountpoint.mkdir(exist_ok=True)
        return self.mount()

    def mount(self, *options: str) -> str | None:
        mounted = self._run("mount", "-o", ",".join(("loop", "errors=remount-ro", *options)),
                            str(self.image), str(self.mountpoint))
        return None if mounted.returncode == 0 else f"mount: {mounted.stderr.strip()}"

    @property
    def device(self) -> str:
        found = self._run("findmnt", "-n", "-o", "SOURCE", str(self.mountpoint))
        return found.stdout.strip()

    def mounted(self) -> bool:
        return self._run("mountpoint", "-q", str(self.mountpoint)).returncode == 0

    def fill(self) -> int:
        """Write a file until the disk is full; the bytes written."""
        written = 0
        with open(self.filler, "wb") as handle:
            try:
                while True:
                    handle.write(b"\0" * 4096)
                    handle.flush()
                    written += 4096
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
        return written

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def fail(self) -> None:
        """An ext4 error: the kernel remounts the filesystem read-only at once."""
        trigger = Path("/sys/fs/ext4") / Path(self.device).name / "trigger_fs_error"
        trigger.write_text("1")

    def repair(self) -> None:
        """Unmount, fsck and mount again (needs every file on it closed)."""
        self.unmount()
        self._run("e2fsck", "-fy", str(self.image))
        problem = self.mount()
        assert problem is None, problem

    def remount_readonly(self) -> None:
        done = self._run("mount", "-o", "remount,ro", str(self.mountpoint))
        assert done.returncode == 0, done.stderr

    def unmount(self) -> None:
        if self.mounted() and self._run("umount", str(self.mountpoint)).returncode != 0:
            self._run("umount", "-l", str(self.mountpoint))


@contextlib.contextmanager
def small_disk(tmp_path: Path, size_mib: int = 8):
    """A :class:`SmallDisk` for the ledger, unmounted (and its loop device freed) after.

    Skips (fails in CI) where loop devices cannot be mounted.
    """
    from tests.support.services import require_service

    disk = SmallDisk(tmp_path / "ledger-disk.ext4", tmp_path / "ledger-disk", size_mib)
    problem = disk.create()
    if problem is not None:
        require_service("a loop-mounted filesystem", problem)
    try:
        yield disk
    finally:
        disk.unmount()


# ------------------------------------------------------------ a stream of lease cycles


@dataclass
class CycleLoad:
    """What :func:`cycle` workers sent and were told, around one fault at ``fault_at``."""

    calls: int = 0
    retried: Counter[str] = field(default_factory=Counter)
    """Why calls were sent again: timeout, unavailable, storage_error."""
    granted: dict[str, Any] = field(default_factory=dict)
    """request key -> the lease its client was told about."""
    answers_at: list[float] = field(default_factory=list)
    """monotonic time of every answer."""
    fault_at: float | None = None
    """Set by the test when the fault happens (monotonic)."""
    cycles_after_fault: Counter[int] = field(default_factory=Counter)
    refused: int = 0
    """Requests the broker refused and the clients sent again on a new channel."""

    def answered_after_fault(self) -> list[float]:
        """Seconds from the fault to each answer after it."""
        assert self.fault_at is not None
        return [t - self.fault_at for t in self.answers_at if t > self.fault_at]

    def longest_gap_s(self) -> float:
        """The longest time without any answer."""
        times = sorted(self.answers_at)
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)


async def until_answered(load: CycleLoad, call: Any) -> Any:
    """Call until the allocator answers; a timeout, an outage or a ``storage_error`` (nothing
    recorded for sure) is sent again as it is, with the same request key."""
    from allocator.amqp.client import AllocatorError, AllocatorTimeout, AllocatorUnavailable
    from allocator.wire.protocol import ErrorCode

    while True:
        load.calls += 1
        try:
            result = await call()
        except AllocatorTimeout:
            load.retried["timeout"] += 1
            continue
        except AllocatorUnavailable:
            load.retried["unavailable"] += 1
            await asyncio.sleep(0.2)
            continue
        except AllocatorError as exc:
            assert exc.code is ErrorCode.STORAGE_ERROR, exc
            load.retried["storage_error"] += 1
            await asyncio.sleep(0.2)
            continue
        load.answers_at.append(time.monotonic())
        return result


async def cycle(number: int, url: str, load: CycleLoad, *, cycles_after_fault: int,
                call_timeout_s: float = 3.0) -> None:
    """One worker: allocate (a new request key each time), then release at once, until it
    has done ``cycles_after_fault`` cycles after the fault. Each call is retried until it is
    answered (:func:`until_answered`)."""
    from allocator.amqp.client import AllocatorClient
    from allocator.wire.protocol import AllocateRequest, LeaseState

    async with AllocatorClient(url, timeout_s=call_timeout_s, connect_timeout_s=3) as client:
        n = 0
        while load.cycles_after_fault[number] < cycles_after_fault:
            key = f"hub/user{number}/server{n}"
            request = AllocateRequest(request_key=key, user=f"user{number}")
            lease = await until_answered(load, lambda r=request: client.allocate(r))
            assert lease.request_key == key and lease.state is LeaseState.GRANTED, lease
            assert load.granted.setdefault(key, lease).lease_id == lease.lease_id
            # Released by an admin at once (a hub's release waits for the container's end,
            # and there is none here): the GPU is free for the next cycle.
            released = await until_answered(load, lambda i=lease.lease_id: client.release(
                lease_id=i, force=True, by="load", reason="cycle"))
            assert released.lease_id == lease.lease_id
            n += 1
            if load.fault_at is not None:
                load.cycles_after_fault[number] += 1
        load.refused += client.requests_refused


def assert_one_lease_per_answer(audit: LedgerAudit, load: CycleLoad) -> None:
    """Every request was answered, with exactly one lease, the one its client was told about;
    every cycle's lease is released."""
    assert set(audit.leases_per_key) == set(load.granted), "every request answered, no other"
    assert set(audit.leases_per_key.values()) == {1}, "a request key with two leases"
    assert {row["request_key"]: i for i, row in audit.leases.items()} == {
        key: lease.lease_id for key, lease in load.granted.items()}
    assert all(row["state"] == "released" for row in audit.leases.values())


def lease_states(path: Path) -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """lease id -> (request key, state, GPUs) in a ledger file: what two replicas compare."""
    return {i: (row["request_key"], row["state"], tuple(row["gpu_uuids"]))
            for i, row in audit_ledger(path).leases.items()}


# ----------------------------------------------------------------- a link to break


class Proxy:
    """A byte-for-byte stream proxy (unix socket or TCP) whose link the test can break.

    ``cut()`` closes every connection and stops listening (the service looks down: new
    connections are refused); ``freeze()`` keeps connections open but passes no bytes (a
    black hole, where calls hang rather than fail); ``restore()`` undoes either.
    """

    def __init__(self, upstream: Callable[[], Awaitable[tuple[asyncio.StreamReader,
                                                                asyncio.StreamWriter]]]) -> None:
        self._upstream = upstream
        self._server: asyncio.Server | None = None
        self._listen: Callable[[], Awaitable[asyncio.Server]] | None = None
        self._pipes: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()

    async def serve_unix(self, path: Path) -> str:
        async def listen() -> asyncio.Server:
            # asyncio removes a stale socket file itself before binding
            return await asyncio.start_unix_server(self._handle, path=str(path))

        self._listen = listen
        self._server = await listen()
        return f"unix://{path}"

    async def serve_tcp(self) -> int:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]

        async def listen() -> asyncio.Server:
            return await asyncio.start_server(self._handle, "127.0.0.1", port,
                                              reuse_address=True)

        self._listen = listen
        return int(port)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await self._upstream()
        except OSError:
            writer.close()
            return
        self._writers.update((writer, up_writer))
        tasks = [asyncio.create_task(self._pipe(reader, up_writer)),
                 asyncio.create_task(self._pipe(up_reader, writer))]
        self._pipes.update(tasks)
        for task in tasks:
            task.add_done_callback(self._pipes.discard)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            self._writers.discard(writer)

    def drop(self) -> None:
        """Close every connection at once and keep listening (synchronous: callable where
        nothing may be awaited): the peers see their connection end, as when a broker
        node closes it, and reconnect at once."""
        for writer in list(self._writers):
            writer.close()

    async def _close_connections(self) -> None:
        for task in list(self._pipes):
            task.cancel()
        for writer in list(self._writers):
            writer.close()
        await asyncio.gather(*self._pipes, return_exceptions=True)
        self._writers.clear()

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        await self._close_connections()

    def freeze(self) -> None:
        self._flowing.clear()

    async def restore(self) -> None:
        """Listen again; frozen connections are dropped (the peers reconnect)."""
        if not self._flowing.is_set():
            await self._close_connections()
            self._flowing.set()
        if self._server is None:
            assert self._listen is not None
            self._server = await self._listen()

    async def close(self) -> None:
        self._flowing.set()
        await self.cut()
