"""swarm-gpu side by side with Swarm's own generic resources, on one real engine, in one run.

    python bench/vs_swarm.py                        # about 5 minutes; prints one JSON object
    python bench/vs_swarm.py --stop-commands on off  # also without stop commands: about 6
    python bench/vs_swarm.py --gpu-processes off     # the agent reports no GPU processes

Both ways run on the same Docker engine: a private ``dockerd`` this benchmark starts (its own
data root and socket under /tmp, Swarm on 127.0.0.2 so it does not touch the shared test
engine on 127.0.0.1), advertising ``--gpus`` GPUs as the generic resource ``GPU`` — the
old way's setup. The shared engine keeps running for everybody else. Every service runs
``local/busybox`` with a command that exits on SIGTERM, so neither side waits out a stop
timeout, on the host network, created through the engine API.

(a) **generic resources**: ``docker service create --generic-resource GPU=1`` (the task gets
    ``DOCKER_RESOURCE_GPU=GPU-...``).
(b) **swarm-gpu**: the real allocator and the real node agent (simulated inventory with the
    same GPU UUIDs, watching this engine's events): ``allocate`` over RPC, then the service
    with the constraint ``node.hostname==<host>``, ``NVIDIA_VISIBLE_DEVICES`` and the lease
    label, as the hub plugin creates it. The simulated GPU lists each running container's
    main process (its real pid) as the driver would, until the process exits; with
    ``--gpu-processes on`` (the default) the agent reports it once the allocator's hello
    asks, so a hand-over goes through verified release (the ended lease's GPU drains until
    a report shows its container's processes gone); ``off``: the agent reports none.

Each trial: user 1's service starts while the GPU is free (**free start**: request to task
running); then user 1 stops (service removed; for (b) also the hub's release request) while
user 2 asks for that GPU at the same moment (**hand-over**: until user 2's task runs). In (a)
user 2's service is created at once and Swarm starts it when its scheduler sees the resource
free; in (b) user 2's request waits in the allocator's queue (``wait_s``), the agent's
``die`` event releases user 1's lease, the queue grants it, the allocator pushes the grant to
user 2's waiting client (no polling), and user 2's hub then creates the service.

(b)'s hand-over is split into its parts, on the wall clock of this one machine: **release**
(user 1's stop to the allocator's ``released_at``: the release request, sent while the service
is removed as the hub plugin does, the stop command, the container's ``die`` event through
the agent), **grant** (``released_at`` to
user 2's ``granted_at``: the queue), **delivery** (``granted_at`` to the pushed grant in user
2's hands: commit and push) and **start** (to user 2's task running). A bare aiodocker
listener on the same engine records when Docker's own ``die`` event of user 1's container
arrived: the floor the release by event is compared with.

(b) runs with the allocator's stop commands on (the default: the hub's release makes the
node agent stop the container at once) and, with ``--stop-commands on off``, also without
them, as before they existed (the container ends only when Swarm stops the removed task).

Targets for (b): hand-over within 1.3x of its own free start; release p99 within 1.2x of the
bare listener's ``die`` p99.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiodocker
from common import (
    GPU_PROCESSES,
    TRAP_TERM,
    DieListener,
    ProcessListing,
    agent_env,
    machine,
    processes,
    services,
    start_process,
    summary_ms,
    task_template,
    wait_for_allocator,
    wait_running,
)

from allocator.amqp.client import AllocatorClient
from allocator.wire.lease_container import LEASE_LABEL
from allocator.wire.protocol import AllocateRequest
from nodeagent.simulated import make_gpu

MODEL = "NVIDIA GeForce GTX 1070"
SWARM_ADDR = "127.0.0.2"
"""A loopback address of its own for the private engine's Swarm (the shared one has 127.0.0.1)."""

CAN_EXPRESS = {
    "a GPU model": {
        "generic_resources": "only with one resource kind per model, fixed at engine start "
                             "(GPU-1070=..., GPU-A100=...); no aliases, no list of acceptable "
                             "models, no minimum memory",
        "swarm_gpu": "yes: NVML model name or alias, a preference list, minimum memory"},
    "a specific host": {
        "generic_resources": "yes: a node.hostname placement constraint",
        "swarm_gpu": "yes: host in the request (the spawner adds the constraint)"},
    "a shared slice of a GPU": {
        "generic_resources": "no: a named GPU goes to one task; faking slots with a count "
                             "gives no memory budget and no framework hints",
        "swarm_gpu": "yes: share slots per model, a memory budget, framework hints"},
    "all GPUs of a host": {
        "generic_resources": "no: a task asks for a count, not 'all of one host'",
        "swarm_gpu": "yes: count 'all' (every matching GPU of one host)"},
    "several GPUs on one host": {
        "generic_resources": "yes: GPU=N", "swarm_gpu": "yes: count N"},
    "wait for a GPU, with a queue position": {
        "generic_resources": "the task stays pending; no position, no wait limit",
        "swarm_gpu": "yes: wait_s, FIFO within priority, position queryable"},
    "unhealthy GPUs left out": {
        "generic_resources": "no: the list is static until dockerd restarts with other flags",
        "swarm_gpu": "yes: NVML health (XIDs, ECC, temperature, lost), and it recovers"},
}


class GenericResourceEngine(services.PrivateDocker):
    """A private dockerd advertising GPUs as Swarm generic resources, in a Swarm of its own."""

    def __init__(self, base: Path, gpu_uuids: list[str]):
        super().__init__(base)
        self.gpu_uuids = gpu_uuids

    def start(self, *, live_restore: bool | None = None, timeout: float = 60.0) -> float:
        started = time.monotonic()
        command = [
            "dockerd", "--data-root", str(self.base / "data"),
            "--exec-root", str(self.base / "exec"), "-H", self.url,
            "--pidfile", str(self.pid_file), "--bridge=none", "--iptables=false",
            "--ip6tables=false", "--ip-masq=false",
            *(f"--node-generic-resource=GPU={gpu}" for gpu in self.gpu_uuids),
        ]
        # As for the shared engine: tasks use the local image, no registry is tried.
        env = {**os.environ, "DOCKER_SERVICE_PREFER_OFFLINE_IMAGE": "1"}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            env=env)
        while True:
            try:
                status, body = services.docker_api(self.url, "GET", "/_ping", timeout=2)
                if status == 200 and body.strip() == b"OK":
                    return time.monotonic() - started
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() - started > timeout:
                raise RuntimeError(f"private dockerd did not start:\n{self.log_tail()}")
            time.sleep(0.1)


async def swarm_init(docker: aiodocker.Docker) -> None:
    await docker.swarm.init(advertise_addr=SWARM_ADDR, listen_addr=f"{SWARM_ADDR}:2377")
    # Host-network services only: the routing mesh's ingress network is not needed.
    with contextlib.suppress(aiodocker.DockerError):
        await (await docker.networks.get("ingress")).delete()


async def remove_service(docker: aiodocker.Docker, name: str) -> None:
    with contextlib.suppress(aiodocker.DockerError):
        await docker.services.delete(name)


async def wait_no_tasks(docker: aiodocker.Docker, within: float = 60.0) -> None:
    """Until the engine holds no task at all (so the GPU is free for a clean free start)."""
    deadline = time.monotonic() + within
    while await docker.tasks.list() or await docker.containers.list(all=True):
        if time.monotonic() > deadline:
            raise TimeoutError("tasks still present")
        await asyncio.sleep(0.1)
        for container in await docker.containers.list(all=True, filters={"status": ["exited"]}):
            with contextlib.suppress(aiodocker.DockerError):
                await container.delete(force=True)


# ------------------------------------------------------------------- (a) generic resources

STOP_COMMANDS = {"on": True, "off": False}
"""The allocator's ``stop_containers`` setting, by the name ``--stop-commands`` takes."""

STOPS = ("service_rm", "container_stop")
"""How user 1's server is stopped: ``service_rm`` as dockerspawner does (Swarm stops the task:
for a task on a network, 20.10 first waits 2 s for gossip to converge, so SIGTERM comes ~3 s
later), or ``container_stop``: the task's container is stopped on its node first, then the
service is removed. With stop commands on, swarm-gpu's node agent stops the container as soon
as the hub's release reaches the allocator, whichever way the hub stopped it."""


async def stop_user1(docker: aiodocker.Docker, service: str, container: str, stop: str) -> None:
    if stop == "container_stop":
        with contextlib.suppress(aiodocker.DockerError):
            await docker.containers.container(container).stop(t=2)
    await remove_service(docker, service)


async def generic_trial(docker: aiodocker.Docker, trial: int, stop: str) -> dict[str, Any]:
    """User 1 starts on a free GPU; user 1 stops while user 2 asks for it."""
    first, second = f"bench-gr-{trial}-a", f"bench-gr-{trial}-b"

    def template() -> dict[str, Any]:  # a fresh one per call: aiodocker edits it in place
        return task_template(services.BUSYBOX_IMAGE, ["sh", "-c", TRAP_TERM],
                             generic_resources={"GPU": 1})

    try:
        started = time.monotonic()
        await docker.services.create(template(), name=first)
        container_a = await wait_running(docker, first)
        free_start = time.monotonic() - started
        await asyncio.sleep(1.0)

        async def user2_spawns() -> str:
            await docker.services.create(template(), name=second)
            return await wait_running(docker, second)

        started = time.monotonic()
        _, container = await asyncio.gather(stop_user1(docker, first, container_a, stop),
                                            user2_spawns())
        handover = time.monotonic() - started
        env = (await docker.containers.container(container).show())["Config"]["Env"]
        gpu = next((e.split("=", 1)[1] for e in env if e.startswith("DOCKER_RESOURCE_GPU=")),
                   None)
    finally:
        await remove_service(docker, first)
        await remove_service(docker, second)
    await wait_no_tasks(docker)
    return {"free_start_s": free_start, "handover_s": handover, "stop": stop, "gpu": gpu}


# -------------------------------------------------------------------------- (b) swarm-gpu


async def swarm_gpu_trial(docker: aiodocker.Docker, client: AllocatorClient,
                          dies: DieListener, listing: ProcessListing, trial: int,
                          stop: str) -> dict[str, Any]:
    first, second = f"bench-sg-{trial}-a", f"bench-sg-{trial}-b"

    def template(lease: Any) -> dict[str, Any]:
        return task_template(services.BUSYBOX_IMAGE, ["sh", "-c", TRAP_TERM],
                             labels={LEASE_LABEL: lease.lease_id}, env=lease.env,
                             constraints=[f"node.hostname=={lease.host}"])

    leases = []
    queued: list[Any] = []
    try:
        started = time.monotonic()
        lease_a = await client.allocate(AllocateRequest(
            request_key=f"hub/alice/{trial}", user="alice", model=MODEL))
        leases.append(lease_a)
        await docker.services.create(template(lease_a), name=first)
        container_a = await wait_running(docker, first)
        free_start = time.monotonic() - started
        # Its process on its GPU, as the driver lists it, until it exits.
        await listing.add(docker, container_a, lease_a.gpu_uuids[0])
        await asyncio.sleep(1.0)

        async def user1_stops() -> None:
            # As the spawner's stop: the service is removed while the lease is released.
            await asyncio.gather(
                stop_user1(docker, first, container_a, stop),
                client.release(lease_id=lease_a.lease_id, by="hub", reason="server stopped"))

        async def user2_spawns() -> tuple[Any, float, str]:
            # As the spawner: the grant is pushed to the waiting call (no status polls).
            lease = await client.allocate_and_wait(AllocateRequest(
                request_key=f"hub/bob/{trial}", user="bob", model=MODEL, wait_s=30),
                recheck_s=600, on_queued=queued.append)
            received = time.time()
            leases.append(lease)
            await docker.services.create(template(lease), name=second)
            return lease, received, await wait_running(docker, second)

        started, started_wall = time.monotonic(), time.time()
        _, (lease_b, received, container_b) = await asyncio.gather(user1_stops(),
                                                                    user2_spawns())
        handover = time.monotonic() - started
        await listing.add(docker, container_b, lease_b.gpu_uuids[0])
        running = started_wall + handover
        assert lease_b.gpu_uuids == lease_a.gpu_uuids, (lease_a, lease_b)
        released = (await client.status(lease_id=lease_a.lease_id)).released_at
        die_seen = await dies.wait(container_a)
        assert released is not None and lease_b.granted_at is not None and die_seen is not None
    finally:
        await remove_service(docker, first)
        await remove_service(docker, second)
        for lease in leases:
            with contextlib.suppress(Exception):
                await client.release(lease_id=lease.lease_id, by="hub")
    # The agent's die events free the GPU; wait for it so the next free start is free.
    for lease in leases:
        for _ in range(300):
            if (await client.status(lease_id=lease.lease_id)).state.final:
                break
            await asyncio.sleep(0.05)
    await wait_no_tasks(docker)
    return {"free_start_s": free_start, "handover_s": handover,
            "release_s": released - started_wall, "grant_s": lease_b.granted_at - released,
            "delivery_s": received - lease_b.granted_at, "start_s": running - received,
            "die_seen_s": die_seen - started_wall, "stop": stop,
            "waited_in_queue": bool(queued), "gpu": lease_b.gpu_uuids[0]}


REPORTS_PROCESSES = "the allocator reads GPU processes"
"""What the agent logs when it starts listing each GPU's processes (the allocator's hello)."""

HANDOVER_PARTS = ("release_s", "grant_s", "delivery_s", "start_s")
"""(b)'s hand-over, part by part (they add up to it)."""


# ---------------------------------------------------------------------------------- main


def figures(trials: list[dict[str, Any]], key: str) -> dict[str, float]:
    return summary_ms([t[key] for t in trials])


def rounded(trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: round(v, 3) if isinstance(v, float) else v for k, v in t.items()}
            for t in trials]


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    if shutil.which("dockerd") is None:
        raise SystemExit("dockerd not found: run scripts/services start first")
    broker = services.rabbitmq_from_env()
    gpus = [f"GPU-{uuid.uuid4()}" for _ in range(args.gpus)]
    result: dict[str, Any] = {"benchmark": "vs_swarm", "machine": machine(), "gpus": args.gpus,
                              "gpu_processes": args.gpu_processes}
    engine = GenericResourceEngine(Path(tempfile.mkdtemp(prefix="sgpu-vs-", dir="/tmp")), gpus)
    try:
        result["engine_start_s"] = round(await asyncio.to_thread(engine.start), 2)
        await asyncio.to_thread(engine.import_busybox)
        docker = aiodocker.Docker(url=engine.url)
        try:
            await swarm_init(docker)
            info = await docker.system.info()
            host = info["Name"]
            result["engine"] = {"version": info.get("ServerVersion"), "node": host,
                                "swarm": f"{SWARM_ADDR}:2377",
                                "generic_resources": [f"GPU={g}" for g in gpus]}
            generic = []
            for t in range(args.trials * len(STOPS)):
                generic.append(await generic_trial(docker, t, STOPS[t % len(STOPS)]))
            result["generic_resources"] = {
                "free_start": figures(generic, "free_start_s"),
                **{f"handover_{stop}": figures([t for t in generic if t["stop"] == stop],
                                               "handover_s") for stop in STOPS},
                "trials_s": rounded(generic),
            }
            for mode in args.stop_commands:
                result[swarm_gpu_key(mode)] = await run_swarm_gpu(
                    args, docker, engine, host, gpus, broker, STOP_COMMANDS[mode])
        finally:
            await docker.close()
    finally:
        await asyncio.to_thread(engine.cleanup)
    result["shared_engine_ok_after"] = services.check_docker(services.docker_host()) is None
    a = result["generic_resources"]
    result["ratios"] = {
        "generic_resources_handover_vs_its_free_start_p50": {
            stop: round(a[f"handover_{stop}"]["p50_ms"] / a["free_start"]["p50_ms"], 2)
            for stop in STOPS}}
    result["targets"] = {}
    for mode in args.stop_commands:
        key = swarm_gpu_key(mode)
        b = result[key]
        ratio = {stop: round(b[f"handover_{stop}"]["p50_ms"] / b["free_start"]["p50_ms"], 2)
                 for stop in STOPS}
        release_vs_die = {stop: round(b[f"handover_{stop}_parts"]["release_s"]["p99_ms"]
                                      / b[f"handover_{stop}_die_seen"]["p99_ms"], 2)
                          for stop in STOPS}
        result["ratios"][f"{key}_handover_vs_its_free_start_p50"] = ratio
        result["ratios"][f"{key}_release_vs_bare_die_event_p99"] = release_vs_die
        result["ratios"][f"generic_resources_handover_vs_{key}_handover_p50"] = {
            stop: round(a[f"handover_{stop}"]["p50_ms"] / b[f"handover_{stop}"]["p50_ms"], 2)
            for stop in STOPS}
        for stop in STOPS:
            result["targets"][f"{key} handover ({stop}) <= 1.3 x its free start"] = \
                ratio[stop] <= 1.3
            result["targets"][f"{key} release ({stop}) p99 <= 1.2 x the bare die event p99"] = \
                release_vs_die[stop] <= 1.2
    result["can_express"] = CAN_EXPRESS
    return result


async def run_swarm_gpu(args: argparse.Namespace, docker: aiodocker.Docker,
                        engine: GenericResourceEngine, host: str, gpus: list[str],
                        broker: services.RabbitMQ, stop_commands: bool) -> dict[str, Any]:
    with services.temporary_vhost(broker) as vhost, \
            tempfile.TemporaryDirectory(prefix="swarm-gpu-vs-") as tmp_name, \
            processes() as started:
        tmp = Path(tmp_name)
        inventory = tmp / "inventory.json"
        listing = ProcessListing(inventory, host, [make_gpu(host, i, MODEL, uuid=gpu)
                                                   for i, gpu in enumerate(gpus)])
        started.append(start_process(
            [sys.executable, "-m", "allocator.admin.cli", "serve"],
            {"SWARM_GPU_AMQP_URL": vhost.url, "SWARM_GPU_LEDGER_PATH": str(tmp / "l.sqlite"),
             "SWARM_GPU_ALLOW_ANY_NODE_USER": "true",
             "SWARM_GPU_STOP_CONTAINERS": str(stop_commands).lower()}, tmp / "allocator.log"))
        await wait_for_allocator(vhost.url)
        started.append(start_process(
            [sys.executable, "-m", "nodeagent"],
            {**agent_env(host, vhost.url, inventory, engine.url),
             "SWARM_GPU_AGENT_GPU_PROCESSES": GPU_PROCESSES[args.gpu_processes]},
            tmp / "agent.log"))
        try:
            async with AllocatorClient(vhost.url, timeout_s=30) as client, \
                    DieListener(docker) as dies:
                for _ in range(600):
                    if any(n.host == host and n.up for n in (await client.inventory()).nodes):
                        break
                    await asyncio.sleep(0.1)
                trials = []
                for t in range(args.trials * len(STOPS)):
                    trials.append(await swarm_gpu_trial(docker, client, dies, listing, t,
                                                        STOPS[t % len(STOPS)]))
        except BaseException:
            for log in ("allocator.log", "agent.log"):
                print(f"--- {log}\n{(tmp / log).read_text()[-3000:]}", file=sys.stderr)
            raise
        finally:
            listing.close()
        reported = REPORTS_PROCESSES in (tmp / "agent.log").read_text()
    out: dict[str, Any] = {"stop_commands": stop_commands,
                           "gpu_processes": args.gpu_processes,
                           "agent_reported_processes": reported,
                           "free_start": figures(trials, "free_start_s")}
    for stop in STOPS:
        chosen = [t for t in trials if t["stop"] == stop]
        out[f"handover_{stop}"] = figures(chosen, "handover_s")
        out[f"handover_{stop}_parts"] = {part: figures(chosen, part) for part in HANDOVER_PARTS}
        out[f"handover_{stop}_die_seen"] = figures(chosen, "die_seen_s")
    out["waited_in_queue"] = sum(1 for t in trials if t["waited_in_queue"])
    out["trials_s"] = rounded(trials)
    return out


def swarm_gpu_key(mode: str) -> str:
    """Where the figures of (b) go in the result: stop commands on (the default) or off."""
    return "swarm_gpu" if STOP_COMMANDS[mode] else "swarm_gpu_without_stop_commands"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=4, help="trials per way and stop mode")
    parser.add_argument("--gpus", type=int, default=1,
                        help="GPUs of the node (1: every hand-over needs the GPU just freed)")
    parser.add_argument("--stop-commands", nargs="+", choices=sorted(STOP_COMMANDS),
                        default=["on"],
                        help="run (b) with the allocator's stop commands on, off, or both")
    parser.add_argument("--gpu-processes", choices=sorted(GPU_PROCESSES), default="on",
                        help="the agent lists each GPU's processes once the allocator reads "
                        "them (on: the default), or never (off)")
    args = parser.parse_args()
    print(json.dumps(asyncio.run(bench(args)), indent=2))


if __name__ == "__main__":
    main()
