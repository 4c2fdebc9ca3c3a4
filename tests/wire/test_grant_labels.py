"""The grant labels: what the spawner writes is what the agent reads back."""

from __future__ import annotations

import pytest

from allocator.wire.lease_container import (
    GPUS_LABEL,
    GROUPS_LABEL,
    HOST_LABEL,
    LEASE_LABEL,
    MEMORY_LABEL,
    SHARED_LABEL,
    grant_from_labels,
    grant_labels,
)
from allocator.wire.protocol import ContainerGrant, Lease, LeaseState


def lease(**fields: object) -> Lease:
    values: dict[str, object] = {
        "lease_id": "l1", "request_key": "hub/alice/gpu", "user": "alice",
        "state": LeaseState.GRANTED, "host": "gpu-a", "gpu_uuids": ["GPU-1", "GPU-2"],
        "created_at": 1.0}
    values.update(fields)
    return Lease.model_validate(values)


def test_exclusive_grant_round_trips() -> None:
    labels = grant_labels(lease(), server_name="gpu")
    assert labels[LEASE_LABEL] == "l1"
    assert labels[GPUS_LABEL] == "GPU-1,GPU-2"
    assert MEMORY_LABEL not in labels
    assert grant_from_labels(labels) == ContainerGrant(
        host="gpu-a", gpu_uuids=["GPU-1", "GPU-2"], user="alice", server_name="gpu",
        request_key="hub/alice/gpu")


def test_shared_grant_round_trips_with_its_budget() -> None:
    labels = grant_labels(lease(gpu_uuids=["GPU-1"], shared=True, memory_mib=4096))
    assert (labels[SHARED_LABEL], labels[MEMORY_LABEL]) == ("1", "4096")
    grant = grant_from_labels(labels)
    assert isinstance(grant, ContainerGrant)
    assert (grant.shared, grant.memory_mib, grant.server_name) == (True, 4096, "")


def test_a_lease_label_alone_is_no_grant() -> None:
    assert grant_from_labels({LEASE_LABEL: "l1"}) is None
    assert grant_from_labels({}) is None


@pytest.mark.parametrize(("change", "why"), [
    ({MEMORY_LABEL: "lots"}, "not a whole number"),
    ({GPUS_LABEL: ""}, "gpu_uuids"),
    ({GPUS_LABEL: "GPU-1,GPU-1"}, "named twice"),
    ({HOST_LABEL: ""}, "host"),
    ({SHARED_LABEL: "1"}, "memory budget"),
])
def test_labels_that_make_no_grant_say_why(change: dict[str, str], why: str) -> None:
    labels = {**grant_labels(lease()), **change}
    answer = grant_from_labels(labels)
    assert isinstance(answer, str) and why in answer, answer


def test_the_groups_round_trip_even_with_commas_in_a_name() -> None:
    labels = grant_labels(lease(), groups=["staff", "lab, north"])
    assert labels[GROUPS_LABEL] == '["lab, north","staff"]'
    grant = grant_from_labels(labels)
    assert isinstance(grant, ContainerGrant) and grant.groups == ["lab, north", "staff"]


def test_a_container_labelled_before_the_groups_label_has_no_groups() -> None:
    labels = grant_labels(lease(), groups=["staff"])
    del labels[GROUPS_LABEL]
    grant = grant_from_labels(labels)
    assert isinstance(grant, ContainerGrant) and grant.groups == []


@pytest.mark.parametrize(("value", "why"), [
    ("staff", "not JSON"), ('{"g": 1}', "not a list of group names"), ("[1]", "not a list"),
    ('[""]', "groups"),
])
def test_groups_labels_that_make_no_grant_say_why(value: str, why: str) -> None:
    answer = grant_from_labels({**grant_labels(lease()), GROUPS_LABEL: value})
    assert isinstance(answer, str) and why in answer, answer
