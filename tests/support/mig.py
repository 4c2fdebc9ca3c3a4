"""A heartbeat of a host with MIG instances."""

from __future__ import annotations

from allocator.wire.protocol import GPUInfo, Heartbeat
from tests.support.common import A100_40GB as A100

PARENT = "GPU-parent"


def mig_beat(seq: int, at: float, profiles: list[str], mig_mode: bool = True) -> Heartbeat:
    gpus = [GPUInfo(uuid=PARENT, index=0, model=A100, memory_total_mib=40960,
                    mig_mode=mig_mode, compute_capability="8.0", architecture="ampere")]
    gpus += [GPUInfo(uuid=f"MIG-{profile}-{n}", index=0, model=f"{A100} MIG {profile}",
                     memory_total_mib=4864, mig_parent_uuid=PARENT, mig_profile=profile,
                     mig_index=n, compute_capability="8.0", architecture="ampere")
             for n, profile in enumerate(profiles)]
    return Heartbeat(host="m", agent_id="agent-m", seq=seq, sent_at=at, interval_s=2,
                     gpus=gpus, containers=[], containers_complete=True, source="simulated")
