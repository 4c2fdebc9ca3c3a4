"""``gpu-ledger status --topology HOST``: a host's links as ``nvidia-smi topo -m`` prints them,
from the running allocator (real allocator, real broker, the CLI in a subprocess)."""

from __future__ import annotations

from pathlib import Path

from allocator.amqp.client import AllocatorClient
from allocator.wire.interconnect import HostInterconnect, LinkLevel, build_interconnect
from tests.support.common import A100, GTX1070, NodeSimulator, gpus, heartbeat, wait_until
from tests.support.faults import running_allocator
from tests.support.ledger_cli import assert_one_line_error, gpu_ledger


def two_nvlink_pairs(uuids: list[str]) -> HostInterconnect:
    """GPUs 0-1 and 2-3 joined by four NVLinks each, the other pairs by a PCIe host bridge;
    GPUs 0-1 on NUMA node 0 (CPUs 0-15), 2-3 on node 1."""
    links = {(i, j): (LinkLevel.HOSTBRIDGE, 0) for i in range(4) for j in range(i + 1, 4)}
    links[(0, 1)] = links[(2, 3)] = (LinkLevel.NVLINK, 4)
    return build_interconnect(uuids, [0, 0, 1, 1], links)


async def test_status_prints_a_hosts_link_matrix_from_the_running_allocator(
        amqp_vhost, tmp_path: Path) -> None:
    ledger = tmp_path / "ledger.sqlite"
    workstation = gpus("gpu-nv", A100, 4)
    links = two_nvlink_pairs([gpu.uuid for gpu in workstation])
    async with running_allocator(amqp_vhost.url, ledger, node_down_after_s=3600), \
            NodeSimulator(amqp_vhost.url) as nodes, \
            AllocatorClient(amqp_vhost.url, timeout_s=10) as client:
        await nodes.publish(heartbeat("gpu-nv", workstation).model_copy(
            update={"interconnect": links}))
        await nodes.beat("gpu-old", gpus("gpu-old", GTX1070, 2))  # an agent before 0.3.0

        async def both_reported() -> bool:
            found = {n.host: n for n in (await client.inventory()).nodes}
            return (found.keys() == {"gpu-nv", "gpu-old"}
                    and found["gpu-nv"].interconnect is not None)
        await wait_until(both_reported)

        run = await gpu_ledger("status", "--amqp", amqp_vhost.url, "--topology", "gpu-nv")
        assert run.rc == 0, run
        lines = run.out.splitlines()
        assert lines[:6] == [
            "gpu-nv",
            "      GPU0  GPU1  GPU2  GPU3  CPU Affinity  NUMA Affinity",
            "GPU0  X     NV4   PHB   PHB   N/A           0",
            "GPU1  NV4   X     PHB   PHB   N/A           0",
            "GPU2  PHB   PHB   X     NV4   N/A           1",
            "GPU3  PHB   PHB   NV4   X     N/A           1",
        ]
        assert "Legend:" in lines and any(line.startswith("  NV#") for line in lines)

        as_json = await gpu_ledger("status", "--amqp", amqp_vhost.url, "--topology", "gpu-nv",
                                   "--json")
        assert as_json.rc == 0, as_json
        assert HostInterconnect.model_validate_json(as_json.out) == links

        assert_one_line_error(
            await gpu_ledger("status", "--amqp", amqp_vhost.url, "--topology", "gpu-old"),
            "gpu-old has not reported how its GPUs are joined", "older than 0.3.0")
        assert_one_line_error(
            await gpu_ledger("status", "--amqp", amqp_vhost.url, "--topology", "gpu-zz"),
            "no host 'gpu-zz'", "gpu-nv, gpu-old")
        assert_one_line_error(
            await gpu_ledger("status", "--ledger", ledger, "--topology", "gpu-nv"),
            "--topology reads the running allocator", "ledger file does not keep")
        # the tables of status say what they said
        table = await gpu_ledger("status", "--amqp", amqp_vhost.url)
        assert table.rc == 0 and "gpu-nv" in table.out and "GPU0" not in table.out, table
