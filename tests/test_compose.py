"""``compose/stack.yml`` validated by the real Docker CLI, and consistent with the rest.

``docker stack config`` (or ``docker compose config`` where the CLI has no ``stack config``)
parses the file, checks it against the compose schema and interpolates variables, as
``docker stack deploy`` does before it creates anything. The tests then check what the
deployment depends on: the agent is global on GPU nodes, the allocator's replicas run one per
node on the replicated ledger log, every broker URL names a user and vhost of the definitions
file, and the config files the stack mounts parse.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from services import require_service

from allocator.config import load_settings

COMPOSE = Path(__file__).resolve().parents[1] / "compose"
STACK = COMPOSE / "stack.yml"


def docker_config(docker_engine: str, stack_file: Path) -> subprocess.CompletedProcess[str]:
    """Run the Docker CLI's own validation of a stack file."""
    docker = shutil.which("docker")
    if docker is None:
        require_service("the docker CLI", "not on PATH")
    env = {"DOCKER_HOST": docker_engine, "PATH": "/usr/local/bin:/usr/bin:/bin"}
    result = subprocess.run([docker, "stack", "config", "-c", str(stack_file)],
                            capture_output=True, text=True, env=env, timeout=60)
    if result.returncode != 0 and "unknown command" in result.stderr:
        result = subprocess.run([docker, "compose", "-f", str(stack_file), "config"],
                                capture_output=True, text=True, env=env, timeout=60)
        if result.returncode != 0 and "unknown command" in result.stderr:
            require_service("a docker CLI that validates stack files",
                            "it has neither 'stack config' nor 'compose config'")
    return result


@pytest.fixture(scope="module")
def stack(docker_engine: str) -> dict[str, Any]:
    result = docker_config(docker_engine, STACK)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


def test_the_cli_accepts_the_stack(stack):
    assert set(stack["services"]) == {"rabbitmq", "allocator", "nodeagent", "jupyterhub"}
    assert set(stack["secrets"]) == {"swarm-gpu-rabbitmq-definitions",
                                     "swarm-gpu-allocator-password", "swarm-gpu-hub-password",
                                     "swarm-gpu-hub-login-password",
                                     "swarm-gpu-hub-admin-password", "swarm-gpu-hub-api-token"}
    assert all(secret.get("external") for secret in stack["secrets"].values())


def test_the_cli_refuses_a_broken_stack(docker_engine, tmp_path):
    """The validation is real: a misspelt key is rejected (the CLI checks the schema; values
    like the deploy mode and the config files' existence are checked by the tests below)."""
    for name in ("rabbitmq.conf", "allocator.toml", "jupyterhub_config.py"):
        shutil.copy(COMPOSE / name, tmp_path / name)
    broken = tmp_path / "stack.yml"
    broken.write_text(STACK.read_text().replace("replicas: 2", "replicaz: 2"))
    result = docker_config(docker_engine, broken)
    assert result.returncode != 0
    assert "replicaz" in result.stderr


def test_node_agent_runs_on_every_gpu_node(stack):
    agent = stack["services"]["nodeagent"]
    assert agent["deploy"]["mode"] == "global"
    assert agent["deploy"]["placement"]["constraints"] == ["node.labels.swarm-gpu.gpu == true"]
    assert agent["environment"]["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert agent["environment"]["SWARM_GPU_AGENT_HOST"] == "{{.Node.Hostname}}"
    mounts = {m["target"]: m for m in agent["volumes"]}
    assert mounts["/var/run/docker.sock"]["source"] == "/var/run/docker.sock"
    assert mounts["/host/proc"]["read_only"] is True
    assert agent["environment"]["SWARM_GPU_AGENT_PROC_ROOT"] == "/host/proc"
    assert mounts["/etc/swarm-gpu/agent-password"]["read_only"] is True


def test_allocator_replicas_run_on_different_nodes_with_the_replicated_log(stack):
    allocator = stack["services"]["allocator"]
    assert allocator["deploy"]["replicas"] == 2
    assert allocator["deploy"]["placement"]["constraints"] == [
        "node.labels.swarm-gpu.allocator == true"]
    # One per node, so never two on one node's ledger volume; the log keeps them in step.
    assert allocator["deploy"]["placement"]["max_replicas_per_node"] == 1
    assert allocator["environment"]["SWARM_GPU_LEDGER_LOG"] == "stream"
    ledger = Path(allocator["environment"]["SWARM_GPU_LEDGER_PATH"])
    volumes = {m["target"]: m for m in allocator["volumes"]}
    assert volumes[str(ledger.parent)]["type"] == "volume", "the ledger is on the volume"
    assert "ledger" in stack["volumes"]
    assert allocator["environment"]["SWARM_GPU_METRICS_PORT"] == "9464"


def test_rabbitmq_loads_the_definitions(stack):
    rabbitmq = stack["services"]["rabbitmq"]
    (secret,) = rabbitmq["secrets"]
    conf = (COMPOSE / "rabbitmq.conf").read_text()
    (path,) = re.findall(r"^load_definitions\s*=\s*(\S+)", conf, re.MULTILINE)
    assert secret["target"] == path
    assert rabbitmq["image"].startswith("rabbitmq:3.10") and "management" in rabbitmq["image"]
    assert "${SWARM_GPU_BROKER_IMAGE:-rabbitmq:3.10-management}" in STACK.read_text()


def test_every_broker_url_names_a_defined_user_and_the_vhost(stack):
    definitions = json.loads((COMPOSE / "rabbitmq-definitions.json").read_text())
    users = {user["name"] for user in definitions["users"]}
    (vhost,) = [v["name"] for v in definitions["vhosts"]]
    found = {}
    for name, service in stack["services"].items():
        command = " ".join(service.get("command") or [])
        for user, url_vhost in re.findall(r"amqp://([^:]+):[^@]+@rabbitmq:5672/([\w.-]+)",
                                          command):
            found[name] = user
            assert url_vhost == vhost
            pattern = user.replace("${SWARM_GPU_AGENT_HOST}", "gpu-a")
            assert pattern in users, f"{name} logs in as {user}, not in the definitions"
    assert found == {"allocator": "allocator", "nodeagent": "agent-${SWARM_GPU_AGENT_HOST}",
                     "jupyterhub": "hub"}


def test_mounted_config_files_parse(stack):
    settings = load_settings(COMPOSE / "allocator.toml")
    definitions = json.loads((COMPOSE / "rabbitmq-definitions.json").read_text())
    admins = {u["name"] for u in definitions["users"] if "administrator" in u["tags"]}
    assert set(settings.admin_users) == admins
    assert settings.node_user_template == "agent-{host}"
    hub_config = COMPOSE / "jupyterhub_config.py"
    compile(hub_config.read_text(), str(hub_config), "exec")
    for name, config in stack["configs"].items():
        assert Path(config["file"]).is_file(), name


def test_dockerfile_builds_from_the_repo_root():
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    stages = re.findall(r"^FROM \S+ AS (\S+)$", dockerfile, re.MULTILINE)
    assert stages == ["swarm-gpu", "hub"], \
        "the legacy builder builds every stage up to --target: swarm-gpu must come first"
    bases = re.findall(r"^FROM \$\{(\w+)\} AS", dockerfile, re.MULTILINE)
    assert bases == ["PYTHON_BASE", "HUB_BASE"], "base images are build arguments"
    for arg in bases:
        assert re.search(rf"^ARG {arg}=\S+$", dockerfile, re.MULTILINE), arg
    # Both builders read the context's root .dockerignore (the legacy one reads no other).
    ignore = (COMPOSE.parent / ".dockerignore").read_text().split()
    assert ignore[ignore.index("*") + 1:][:5] == [
        "!pyproject.toml", "!README.md", "!allocator/", "!nodeagent/", "!hubplugin/"]
    assert not (COMPOSE / "Dockerfile.dockerignore").exists(), "one ignore file, not two"
    repo = COMPOSE.parent
    for sources in re.findall(r"^COPY (.+) \S+$", dockerfile, re.MULTILINE):
        for source in sources.split():
            assert (repo / source).exists(), source
    assert 'pip install ".[agent]"' in dockerfile
