"""``python -m nodeagent.nvml_check``: print what the NVML source reads on this machine.

For checking the real NVML path on a machine with NVIDIA GPUs. Prints one JSON object:
the driver version, every GPU sample (with its energy counter ``energy_mj``, to compare with
``nvidia-smi --query-gpu=energy.total`` or its ``-q -d POWER``; its processes, each with its
SM and memory utilization as the usage meter reads them, to compare with ``nvidia-smi pmon``,
its container from ``/proc/<pid>/cgroup`` and its command name; its compute capability and
architecture; and
for a GPU in MIG mode each MIG instance as a sample of its own), the health
verdict of each under the default health rules (or the agent's settings from the environment /
``--config``), the raw MIG reads per GPU (current and pending mode, MIG device slots, the GPU
instance profiles with their free capacity), how the GPUs are joined (``interconnect``, as
heartbeats carry it, and ``topology``, its matrix as ``nvidia-smi topo -m`` prints it: NVLink
or PCIe level per pair, each GPU's CPUs and NUMA node), whether XID events could be
registered, and the XIDs seen while waiting ``--xid-wait`` seconds. With ``--topo`` it prints
only that matrix, as text. Everything is read only: no MIG setting is changed. On a machine
without NVML it prints ``{"ok": false, "error": ...}`` and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

from allocator.wire.interconnect import matrix_lines
from nodeagent.cgroups import CgroupReader
from nodeagent.health import HealthRules, HealthTracker
from nodeagent.inventory import InventoryUnavailable
from nodeagent.mig import inherit_parent_health


def rules_from_settings(config: str | None) -> HealthRules:
    """The health rules of the agent's settings (defaults where nothing is set)."""
    from nodeagent.agent import health_rules_of
    from nodeagent.config import load_settings

    return health_rules_of(load_settings(config, inventory="nvml"))


def check(xid_wait_s: float, rules: HealthRules) -> dict[str, Any]:
    """Read everything once (and wait for XIDs); the report as a JSON-ready dict."""
    from nodeagent.nvml import NvmlSource

    started = time.perf_counter()
    source = NvmlSource()
    try:
        read_started = time.perf_counter()
        samples = source.read_gpus()
        read_s = time.perf_counter() - read_started
        mig = source.mig_report()
        interconnect = source.read_interconnect()
        xids = source.wait_xids(xid_wait_s) if xid_wait_s > 0 else []
        tracker = HealthTracker(rules)
        now = time.time()
        for event in xids:
            tracker.record_xid(event.gpu_uuid, event.xid, now)
        verdicts = inherit_parent_health(
            samples, {sample.uuid: tracker.evaluate(sample, now) for sample in samples})
        cgroups = CgroupReader()
        gpus = []
        for sample in samples:
            verdict = verdicts[sample.uuid]
            gpus.append(
                {
                    **dataclasses.asdict(sample),
                    # Each process as the agent attributes it (None: the listing failed).
                    "processes": None if sample.processes is None else [
                        {**dataclasses.asdict(proc),
                         "container_id": proc.container_id or cgroups.container_of(proc.pid),
                         "name": cgroups.command_name(proc.pid)}
                        for proc in sample.processes],
                    "health": verdict.health.value,
                    "health_reasons": list(verdict.reasons),
                    "recent_xids": list(verdict.recent_xids),
                }
            )
        return {
            "ok": True,
            "host": platform.node(),
            "driver_version": source.driver_version,
            "gpu_count": len(samples),
            "gpus": gpus,
            "mig": mig,
            "interconnect": None if interconnect is None else interconnect.model_dump(),
            "topology": None if interconnect is None else matrix_lines(interconnect),
            "xid_events_registered": source.xid_supported,
            "xids_seen": [dataclasses.asdict(event) for event in xids],
            "read_s": round(read_s, 4),
            "total_s": round(time.perf_counter() - started, 4),
            "health_rules": {**dataclasses.asdict(rules), "fatal_xids": sorted(rules.fatal_xids)},
        }
    finally:
        source.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 NVML unavailable)."""
    parser = argparse.ArgumentParser(prog="python -m nodeagent.nvml_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--xid-wait", type=float, default=1.0,
                        help="seconds to wait for XID events (default 1)")
    parser.add_argument("--config", default=None, help="agent TOML file for the health rules")
    parser.add_argument("--topo", action="store_true",
                        help="print only how the GPUs are joined, as nvidia-smi topo -m does")
    args = parser.parse_args(argv)
    try:
        report = check(args.xid_wait, rules_from_settings(args.config))
    except InventoryUnavailable as exc:
        print(json.dumps({"ok": False, "error": str(exc)}))
        return 2
    if args.topo:
        print("\n".join(report["topology"] or ["How the GPUs are joined cannot be read here."]))
        return 0
    print(json.dumps(report, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
