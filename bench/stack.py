#!/usr/bin/env python3
"""The deployed stack on the three-node Swarm of ``scripts/cluster``: spawn and release times.

Run ``scripts/cluster up`` first. Alternated rounds through the hub's REST API (admin token):

- spawn to running: ``POST /hub/api/users/NAME/server`` until the hub says the server is
  ready, with one GTX 1070 (the GPU spawner asks the allocator, sets the constraint, the
  device and the lease label) against the same spawner without a GPU (profile ``cpu``); the
  ratio of the medians;
- kill to free: ``docker kill`` of a GPU notebook's container on its worker node until
  ``gpu-ledger status`` in the allocator's container shows the GPU free (polled every 0.1 s,
  so the figure includes one ``docker exec``: an upper bound).

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.stack import Cluster, eventually, read_env  # noqa: E402


def spawn_seconds(cluster: Cluster, user: str, options: dict[str, object]) -> float:
    started = time.monotonic()
    cluster.spawn(user, options)
    cluster.ready(user)
    return time.monotonic() - started


def kill_to_free(cluster: Cluster, user: str) -> float:
    """``docker kill`` of the user's notebook container until its GPU is free."""
    lease_id, node, _ = cluster.lease_of(user)
    eventually(lambda: (cluster.lease(lease_id) or ({}, {}))[1].get("state") == "bound",
               "the lease bound")
    container = cluster.container_on(node, lease_id)
    assert container is not None
    cluster.docker(node, "kill", container)
    killed = time.monotonic()
    eventually(lambda: cluster.lease(lease_id) is None, "the GPU free", interval=0.1)
    return time.monotonic() - killed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cluster-dir", type=Path, default=REPO / ".cluster")
    args = parser.parse_args()
    cluster = Cluster(args.cluster_dir, read_env(args.cluster_dir / "env"))
    cluster.user("bench", "staff")
    gpu, cpu, kill = [], [], []
    for _ in range(args.rounds):
        cpu.append(spawn_seconds(cluster, "bench", {"profile": "cpu"}))
        cluster.stop("bench")
        gpu.append(spawn_seconds(cluster, "bench", {"mode": "exclusive", "model": "1070"}))
        kill.append(kill_to_free(cluster, "bench"))
        cluster.stop("bench")
    print(json.dumps({
        "rounds": args.rounds,
        "spawn_to_running_gpu_s": round(statistics.median(gpu), 2),
        "spawn_to_running_cpu_s": round(statistics.median(cpu), 2),
        "gpu_over_cpu": round(statistics.median(gpu) / statistics.median(cpu), 2),
        "kill_to_free_s": round(statistics.median(kill), 2),
        "kill_to_free_max_s": round(max(kill), 2),
        "samples": {"gpu": [round(s, 2) for s in gpu], "cpu": [round(s, 2) for s in cpu],
                    "kill": [round(s, 2) for s in kill]},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
