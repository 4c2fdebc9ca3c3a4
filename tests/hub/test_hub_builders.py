"""From a lease to the service's env, placement constraints and labels (pure); and the example
hub configuration's placement, read by traitlets' own loader."""

from __future__ import annotations

import copy
from fractions import Fraction

import pytest
from traitlets.config import Config
from traitlets.config.loader import PyFileConfigLoader

from allocator.placement.cluster import GPU, Cluster
from allocator.placement.container_env import lease_env
from allocator.placement.demand import Placement
from allocator.wire.lease_container import grant_from_labels
from allocator.wire.protocol import ContainerGrant, LeaseState
from hubplugin.builders import (
    LEASE_LABEL,
    BuildError,
    build_service_spec,
    describe_lease,
    gpu_env,
    placement_constraints,
)
from tests.support.hub_inventory import GTX1070, lease
from tests.support.services import REPO_ROOT


def test_no_gpu_means_void() -> None:
    assert gpu_env(None) == {"NVIDIA_VISIBLE_DEVICES": "void"}
    spec = build_service_spec(
        None,
        extra_container_spec={"labels": {"team": "x", LEASE_LABEL: "stale"}},
        extra_placement_spec={"constraints": ["node.role == worker"]},
    )
    assert spec.env == {"NVIDIA_VISIBLE_DEVICES": "void"}
    assert spec.extra_container_spec == {"labels": {"team": "x"}}
    assert spec.extra_placement_spec == {"constraints": ["node.role == worker"]}
    assert spec.extra_task_spec == {}, "no lease: the admin's restart policy stands"
    assert spec.lease_id is None and spec.summary == "no GPU"


def test_the_container_gets_the_allocators_env_and_nothing_else() -> None:
    allocators = {"NVIDIA_VISIBLE_DEVICES": "GPU-1,GPU-2", "SWARM_GPU_LEASE": "L-42",
                  "SWARM_GPU_HOST": "gpu-a", "SWARM_GPU_GPU_COUNT": "2"}
    env = gpu_env(lease(gpu_uuids=["GPU-1", "GPU-2"], gpu_indices=[0, 1], env=allocators))
    assert env == allocators


def test_uuids_win_over_the_lease_env() -> None:
    env = gpu_env(lease(env={"NVIDIA_VISIBLE_DEVICES": "all"}))
    assert env["NVIDIA_VISIBLE_DEVICES"] == "GPU-aaaa"


def test_a_granted_slice_carries_the_allocators_budget_and_hints() -> None:
    cluster = Cluster()
    cluster.gpus["GPU-aaaa"] = GPU(uuid="GPU-aaaa", host="gpu-a", index=0, model=GTX1070,
                                   memory_total_mib=8192)
    placement = Placement("gpu-a", ("GPU-aaaa",), True, 2048, Fraction(1, 4))
    env = gpu_env(lease(shared=True, memory_mib=2048,
                        env=lease_env(placement, cluster, "L-42")))
    assert env["SWARM_GPU_SHARED"] == "1"
    assert env["SWARM_GPU_MEMORY_LIMIT_MIB"] == "2048"
    assert env["TF_FORCE_GPU_ALLOW_GROWTH"] == "true"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.25"
    assert "SWARM_GPU_MEMORY_MIB" not in env and "SWARM_GPU_LEASE_ID" not in env, "one name each"


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"state": LeaseState.QUEUED}, "queued, not granted"),
        ({"state": LeaseState.RELEASED}, "released, not granted"),
        ({"host": None}, "no host"),
        ({"gpu_uuids": []}, "no GPU"),
        ({"gpu_uuids": ["GPU-1,GPU-2"]}, "malformed"),
        ({"gpu_uuids": ["GPU-1\nX=1"]}, "malformed"),
        ({"env": {"EVIL": "a\nb"}}, "control characters"),
        ({"host": "gpu-a\n"}, "control characters"),
    ],
)
def test_unusable_leases_are_refused(overrides: dict, needle: str) -> None:
    with pytest.raises(BuildError, match=needle):
        build_service_spec(lease(**overrides))


def test_the_example_hub_config_pins_a_gpu_notebook_only_to_its_lease_host() -> None:
    # A GPU may be granted on any node the agent runs on, a manager included: a constraint of
    # the example's that such a node cannot meet (node.role == worker) would leave the
    # notebook pending for good.
    config: Config = PyFileConfigLoader(
        "jupyterhub_config.py", path=str(REPO_ROOT / "compose")).load_config()
    spawner = config.GPUSwarmSpawner
    admin = spawner.extra_placement_spec.get("constraints") \
        if "extra_placement_spec" in spawner else None
    for host in ("manager-1", "gpu-1"):
        assert placement_constraints(admin, host) == [f"node.hostname == {host}"]


def test_constraints_keep_the_admins_and_add_the_host() -> None:
    admin = ["node.role == worker", "node.labels.gpu == true"]
    assert placement_constraints(admin, "gpu-a") == [
        "node.role == worker", "node.labels.gpu == true", "node.hostname == gpu-a",
    ]
    assert placement_constraints(None, "gpu-a") == ["node.hostname == gpu-a"]
    assert placement_constraints(["node.hostname==gpu-a"], "gpu-a") == ["node.hostname == gpu-a"]
    assert placement_constraints(["node.hostname != gpu-b"], "gpu-a") == [
        "node.hostname != gpu-b", "node.hostname == gpu-a",
    ]
    assert placement_constraints(["a", "a"], None) == ["a"]


@pytest.mark.parametrize("constraint", ["node.hostname == gpu-b", "node.hostname != gpu-a"])
def test_admin_constraint_that_excludes_the_host(constraint: str) -> None:
    with pytest.raises(BuildError, match="excludes host 'gpu-a'"):
        placement_constraints([constraint], "gpu-a")


def test_full_spec_merges_without_touching_the_admins_settings() -> None:
    container = {"labels": {"team": "ml"}, "hostname": "nb"}
    placement = {"constraints": ["node.role == worker"], "preferences": [("spread", "x")]}
    create = {"labels": {"owner": "hub"}}
    originals = copy.deepcopy((container, placement, create))
    spec = build_service_spec(
        lease(), extra_container_spec=container, extra_placement_spec=placement,
        extra_create_kwargs=create, groups=["students"],
    )
    assert (container, placement, create) == originals
    assert spec.extra_container_spec == {
        "labels": {"team": "ml", LEASE_LABEL: "L-42", "swarm-gpu.host": "gpu-a",
                   "swarm-gpu.gpus": "GPU-aaaa", "swarm-gpu.shared": "0",
                   "swarm-gpu.user": "alice", "swarm-gpu.server": "",
                   "swarm-gpu.request-key": "hub/alice/", "swarm-gpu.groups": '["students"]'},
        "hostname": "nb",
    }
    assert spec.extra_placement_spec == {
        "constraints": ["node.role == worker", "node.hostname == gpu-a"],
        "preferences": [("spread", "x")],
    }
    assert spec.extra_create_kwargs == {"labels": {"owner": "hub", LEASE_LABEL: "L-42"}}
    assert spec.lease_id == "L-42" and spec.host == "gpu-a"
    assert spec.env["NVIDIA_VISIBLE_DEVICES"] == "GPU-aaaa"


def test_admin_cannot_override_the_lease_label() -> None:
    spec = build_service_spec(lease(), extra_container_spec={"labels": {LEASE_LABEL: "forged"}})
    assert spec.extra_container_spec["labels"][LEASE_LABEL] == "L-42"


def test_the_container_carries_the_whole_grant_and_nothing_forged() -> None:
    """What the agent reads back is what the allocator granted: an allocator that lost the
    lease adopts exactly this grant (a forged or stale grant label is replaced or dropped)."""
    sliced = lease(shared=True, memory_mib=2048, request_key="hub/alice/big")
    forged = {"labels": {"swarm-gpu.gpus": "GPU-1,GPU-2,GPU-3", "swarm-gpu.memory-mib": "99"}}
    spec = build_service_spec(sliced, extra_container_spec=forged, server_name="big")
    grant = grant_from_labels(spec.extra_container_spec["labels"])
    assert grant == ContainerGrant(host="gpu-a", gpu_uuids=["GPU-aaaa"], shared=True,
                                   memory_mib=2048, user="alice", server_name="big",
                                   request_key="hub/alice/big")
    assert spec.extra_create_kwargs == {"labels": {LEASE_LABEL: "L-42"}}
    unlabelled = build_service_spec(None, extra_container_spec=forged)
    assert unlabelled.extra_container_spec == {"labels": {}}


def test_bound_lease_is_usable() -> None:
    spec = build_service_spec(lease(state=LeaseState.BOUND))
    assert spec.extra_placement_spec["constraints"] == ["node.hostname == gpu-a"]


def test_descriptions() -> None:
    assert describe_lease(None) == "no GPU"
    assert describe_lease(lease()) == f"1 {GTX1070} on gpu-a"
    assert describe_lease(lease(gpu_uuids=["a", "b"])) == f"2 x {GTX1070} on gpu-a"
    assert describe_lease(lease(shared=True, memory_mib=512)) == (
        f"a shared slice of one {GTX1070} (512 MiB) on gpu-a"
    )


def test_a_lease_holding_service_is_never_restarted_by_swarm() -> None:
    # Swarm would restart a dead task in a new container with the old NVIDIA_VISIBLE_DEVICES,
    # after the lease (and its GPUs) were released.
    admin = {"restart_policy": {"Condition": "any"}, "log_driver": {"Name": "json-file"}}
    spec = build_service_spec(lease(), extra_task_spec=admin)
    assert spec.extra_task_spec == {"restart_policy": {"Condition": "none"},
                                    "log_driver": {"Name": "json-file"}}
    assert admin["restart_policy"] == {"Condition": "any"}, "the admin's dict is not modified"
