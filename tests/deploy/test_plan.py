"""The plan of a site: pure, from the site file and the secret files' digests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from allocator.deploy.plan import (
    BROKER_NAMES,
    SWARM_SECRETS,
    Plan,
    certificates,
    label_changes,
    make_plan,
    passwords,
    secret_env,
    secret_files,
)
from allocator.deploy.site import Site, load_site
from tests.support.site_files import SITE, write_site


@pytest.fixture
def site(tmp_path: Path) -> Site:
    return load_site(write_site(tmp_path))


def plan_of(site: Site, **changed: str) -> Plan:
    digests = {key: f"{index:02d}" * 32 for index, key in enumerate(SWARM_SECRETS)}
    return make_plan(site, {**digests, **changed})


def test_each_secret_has_a_versioned_name_and_its_variable(site: Site) -> None:
    plan = plan_of(site)
    assert [secret.key for secret in plan.secrets] == list(SWARM_SECRETS)
    ca = next(secret for secret in plan.secrets if secret.key == "broker-ca")
    index = SWARM_SECRETS.index("broker-ca")
    assert ca.name == f"lab-broker-ca-{f'{index:02d}' * 6}"
    assert ca.file == site.secrets / "tls" / "ca.pem"
    assert plan.env["SWARM_GPU_SECRET_BROKER_CA"] == ca.name
    assert all(len(secret.name) <= 64 for secret in plan.secrets)


def test_a_changed_file_is_a_new_name_and_nothing_else_changes(site: Site) -> None:
    before, after = plan_of(site), plan_of(site, **{"hub-api-token": "ff" * 32})
    changed = {a.key for a, b in zip(before.secrets, after.secrets, strict=True)
               if a.name != b.name}
    assert changed == {"hub-api-token"}
    assert after.env[secret_env("hub-api-token")] == "lab-hub-api-token-ffffffffffff"
    assert plan_of(site) == before  # the same files, the same plan


def test_labels_follow_roles(site: Site) -> None:
    plan = plan_of(site)
    assert plan.labels == {
        "gpu-1": {"swarm-gpu.hub": "true", "swarm-gpu.broker": "true"},
        "gpu-2": {"swarm-gpu.allocator": "true", "swarm-gpu.gpu": "true"},
        "gpu-3": {"swarm-gpu.allocator": "true", "swarm-gpu.gpu": "true"},
    }


def test_label_changes_add_missing_and_remove_only_the_prefixes_own(site: Site) -> None:
    plan = plan_of(site)
    current = {
        "gpu-1": {"swarm-gpu.hub": "true", "swarm-gpu.broker": "true", "site.rack": "3"},
        "gpu-2": {"swarm-gpu.gpu": "false", "swarm-gpu.broker": "true"},
        "gpu-3": {"swarm-gpu.allocator": "true", "swarm-gpu.gpu": "true"},
        "other": {"swarm-gpu.gpu": "true"},
    }
    changes = label_changes(plan, current)
    assert [(c.node, dict(c.add), c.remove) for c in changes] == [
        ("gpu-2", {"swarm-gpu.allocator": "true", "swarm-gpu.gpu": "true"},
         ("swarm-gpu.broker",)),
    ]
    assert label_changes(plan, plan.labels) == []


def test_the_stack_environment(site: Site) -> None:
    env = plan_of(site).env
    assert env["SWARM_GPU_IMAGE"] == "registry.example.org:5000/swarm-gpu:1.2.3"
    assert env["SWARM_GPU_NOTEBOOK_IMAGE"] == "registry.example.org:5000/swarm-gpu-notebook:1.2.3"
    assert env["SWARM_GPU_BROKER_IMAGE"] == "rabbitmq:3.10-management"
    assert env["SWARM_GPU_HUB_URL"] == "https://hub.example.org:8443/"
    assert env["SWARM_GPU_HUB_HTTPS_PORT"] == "8443"
    assert json.loads(env["SWARM_GPU_USER_VOLUME_OPTIONS"])["device"] == ":/export/home"
    assert env["SWARM_GPU_LABEL_PREFIX"] == "swarm-gpu"


def test_passwords_and_certificates_to_make(site: Site) -> None:
    made = passwords(site)
    assert {"agent-gpu-2", "agent-gpu-3", "hub-admin-password", "metrics-token"} <= set(made)
    assert "agent-gpu-1" not in made  # no GPU there, so no agent
    certs = certificates(site)
    assert certs["hub"] == ["hub.example.org"]
    assert certs["broker"] == [*BROKER_NAMES, "gpu-1", "10.0.0.11"]


def test_a_site_certificate_replaces_the_hubs(tmp_path: Path) -> None:
    text = SITE.replace('https_port = 8443', 'certificate = "hub.pem"\nkey = "hub.key"')
    site = load_site(write_site(tmp_path, text))
    assert "hub" not in certificates(site)
    assert secret_files(site)["hub-cert"] == tmp_path.resolve() / "hub.pem"


def test_every_secret_needs_its_digest(site: Site) -> None:
    with pytest.raises(ValueError, match="no digest for the secrets broker-key"):
        make_plan(site, {key: "00" * 32 for key in SWARM_SECRETS if key != "broker-key"})


def test_the_sites_own_variables_pass_through_but_never_replace_deploys(tmp_path: Path) -> None:
    text = SITE.replace('files = ["stack.yml"]',
                        'files = ["stack.yml"]\nenv = { SWARM_GPU_MANAGER_ADDR = "127.0.0.21" }')
    assert plan_of(load_site(write_site(tmp_path, text))).env["SWARM_GPU_MANAGER_ADDR"] \
        == "127.0.0.21"
    text = SITE.replace('files = ["stack.yml"]',
                        'files = ["stack.yml"]\nenv = { SWARM_GPU_IMAGE = "mine:1" }')
    with pytest.raises(ValueError, match=r"stack\.env: deploy sets SWARM_GPU_IMAGE itself"):
        plan_of(load_site(write_site(tmp_path, text)))
