"""``swarm-gpu deploy`` on the suite's real Docker engine in Swarm mode: secrets, labels, a
tiny stack of busybox services, a second run that changes nothing, a rotated secret, and a
crash-looping service that ends the wait with its error.

Each test has a stack name and label prefix of its own, and removes its stack, secrets and
labels afterwards. The real stack is the stack e2e's to deploy, not these tests'.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from allocator.deploy.cli import main
from allocator.deploy.steps import SECRET_STACK_LABEL
from allocator.deploy.swarm import Docker

pytestmark = [pytest.mark.docker, pytest.mark.slow]

STACK_FILE = """\
version: "3.8"
services:
  web:
    image: {image}
    # Runs only where the admin password arrived as the secret the plan names.
    command: ["sh", "-c", "test -s /run/secrets/admin && exec sleep 3600"]
    secrets:
      - source: admin
        target: admin
    deploy:
      placement:
        constraints: ["node.labels.${{SWARM_GPU_LABEL_PREFIX}}.gpu == true"]
      restart_policy: {{condition: any, delay: 1s}}
{extra}
networks:
  # The suite's engine has no bridge: no overlay network either.
  default:
    external: true
    name: host
secrets:
  admin:
    external: true
    name: ${{SWARM_GPU_SECRET_HUB_ADMIN_PASSWORD}}
"""

CRASHING = """\
  ledger:
    image: {image}
    command: ["sh", "-c", "echo cannot open the ledger >&2; exit 3"]
    deploy:
      restart_policy: {{condition: any, delay: 1s}}
"""

SITE_FILE = """\
secrets = "secrets"

[stack]
name = "{stack}"
files = ["stack.yml"]
label_prefix = "{stack}"
wait_s = 150

[hub]
domain = "hub.example.org"

[images]
resolve = "never"

[[nodes]]
name = "{node}"
address = "127.0.0.1"
roles = ["manager", "hub", "broker", "allocator", "gpu"]
"""


@dataclass
class TrialSite:
    """A site of the test's own on the suite's engine."""

    path: Path
    stack: str
    node: str
    docker: Docker

    def deploy(self, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
        status = main(["deploy", str(self.path)])
        out, err = capsys.readouterr()
        return status, out, err

    def secrets(self) -> set[str]:
        return self.docker.secrets(f"{SECRET_STACK_LABEL}={self.stack}")

    def labels(self) -> dict[str, str]:
        node = next(n for n in self.docker.nodes() if n.hostname == self.node)
        return {k: v for k, v in node.labels.items() if k.startswith(self.stack + ".")}

    def running_tasks(self, service: str) -> set[str]:
        out = self.docker.run("service", "ps", "-q", "--filter", "desired-state=running",
                              f"{self.stack}_{service}")
        return set(out.split())


def wait_until(condition: object, what: str, limit_s: float = 90) -> None:
    """Until ``condition()`` holds; a test failure naming ``what`` after ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {limit_s:.0f} s: {what}"
        time.sleep(0.5)


def remove_all(site: TrialSite) -> None:
    """The test's stack, then its secrets (once no task holds them) and labels."""
    docker = site.docker
    if docker.services(site.stack):
        docker.stack_remove(site.stack)
    wait_until(lambda: not docker.services(site.stack), "the stack's services removed")

    def secrets_gone() -> bool:
        for name in site.secrets():
            docker.remove_secret(name)
        return not site.secrets()

    wait_until(secrets_gone, "the test's secrets removed")
    node = next(n for n in docker.nodes() if n.hostname == site.node)
    if site.labels():
        docker.update_labels(node.id, {}, sorted(site.labels()))


def make_site(tmp_path: Path, image: str, extra: str = "") -> Iterator[TrialSite]:
    docker = Docker()
    stack = f"t{uuid.uuid4().hex[:10]}"
    node_id = docker.run("info", "--format", "{{.Swarm.NodeID}}").strip()
    node = next(n.hostname for n in docker.nodes() if n.id == node_id)
    (tmp_path / "stack.yml").write_text(STACK_FILE.format(image=image, extra=extra))
    path = tmp_path / "site.toml"
    path.write_text(SITE_FILE.format(stack=stack, node=node))
    site = TrialSite(path, stack, node, docker)
    try:
        yield site
    finally:
        remove_all(site)


@pytest.fixture
def trial(tmp_path: Path, docker_engine: str, busybox_image: str) -> Iterator[TrialSite]:
    yield from make_site(tmp_path, busybox_image)


@pytest.fixture
def crashing(tmp_path: Path, docker_engine: str, busybox_image: str) -> Iterator[TrialSite]:
    yield from make_site(tmp_path, busybox_image, CRASHING.format(image=busybox_image))


def test_deploy_makes_everything_and_a_second_run_changes_nothing(
        trial: TrialSite, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = trial.deploy(capsys)
    assert status == 0, err
    assert f"created {trial.stack}_web" in out
    assert "first admin: admin, password " in out
    assert "hub: https://hub.example.org/" in out
    secrets = trial.secrets()
    assert len(secrets) == 10
    assert any(name.startswith(f"{trial.stack}-hub-admin-password-") for name in secrets)
    assert trial.labels() == {f"{trial.stack}.{role}": "true"
                              for role in ("hub", "broker", "allocator", "gpu")}
    tasks = trial.running_tasks("web")
    assert len(tasks) == 1

    status, out, err = trial.deploy(capsys)
    assert status == 0, err
    assert "nothing to change" in out
    assert "first admin" not in out  # its password is shown once, at the run that made it
    assert trial.secrets() == secrets
    assert trial.running_tasks("web") == tasks  # the same task: nothing restarted

    assert main(["status", str(trial.path)]) == 0
    out = capsys.readouterr().out
    assert f"node {trial.node}: manager, ready; roles allocator, broker, gpu, hub\n" in out
    assert f"service {trial.stack}_web: running\n" in out
    assert "certificate hub.pem: expires " in out


def test_a_node_not_in_the_swarm_is_one_line_and_nothing_is_made(
        trial: TrialSite, capsys: pytest.CaptureFixture[str]) -> None:
    text = trial.path.read_text()
    trial.path.write_text(text + text[text.index("[[nodes]]"):].replace(
        f'name = "{trial.node}"', 'name = "no-such-node"').replace(
        '"manager", "hub", ', ""))
    status, _, err = trial.deploy(capsys)
    assert status == 1
    assert err == ("swarm-gpu deploy: nodes: no-such-node is not in the swarm: join it "
                   "(docker swarm join) or take it out of the site file\n")
    assert not (trial.path.parent / "secrets").exists()
    assert trial.secrets() == set()
    assert trial.labels() == {}


def test_a_changed_secret_file_is_a_new_secret_and_the_old_goes(
        trial: TrialSite, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = trial.deploy(capsys)
    assert status == 0, err
    old = {name for name in trial.secrets() if "-hub-admin-password-" in name}
    tasks = trial.running_tasks("web")
    (trial.path.parent / "secrets" / "passwords" / "hub-admin-password").unlink()

    status, out, err = trial.deploy(capsys)
    assert status == 0, err
    new = {name for name in trial.secrets() if "-hub-admin-password-" in name}
    assert len(new) == 1 and new != old
    assert f"updated {trial.stack}_web" in out
    assert f"removed secret {old.pop()}" in out
    assert "first admin: admin, password " in out
    assert trial.running_tasks("web").isdisjoint(tasks)  # it moved onto the new secret


def test_a_crash_looping_service_ends_the_wait_with_its_error(
        crashing: TrialSite, capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = crashing.deploy(capsys)
    assert status == 1
    assert err.count("\n") == 1
    assert err.startswith(f"swarm-gpu deploy: services running: {crashing.stack}_ledger keeps "
                          "failing: task: non-zero exit (3)")
    assert "cannot open the ledger" in err
