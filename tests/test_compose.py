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


# ------------------------------------------------------------- the three-node broker

BROKER_CLUSTER = COMPOSE / "stack.broker-cluster.yml"
ONE_MACHINE = COMPOSE / "stack.one-machine.yml"
ONE_MACHINE_BROKER_CLUSTER = COMPOSE / "stack.one-machine.broker-cluster.yml"
BROKER_NODES = ("rabbitmq", "rabbitmq-2", "rabbitmq-3")
ONE_MACHINE_ENV = {
    # What scripts/cluster exports for the one-machine files (`scripts/cluster env`).
    "SWARM_GPU_MANAGER_ADDR": "127.0.0.21", "SWARM_GPU_BROKER_2_ADDR": "127.0.0.22",
    "SWARM_GPU_BROKER_3_ADDR": "127.0.0.23",
    "SWARM_GPU_BROKER_ADDRS": "127.0.0.21,127.0.0.22,127.0.0.23",
    "SWARM_GPU_BROKER_PORT": "5682", "SWARM_GPU_CLUSTER_DIR": "/srv/cluster",
}
AMQP_URL = re.compile(r"amqp://([^:]+):[^@]+@([^/]+)/([\w.-]+)")


def merged_config(docker_engine: str, *files: Path,
                  env: dict[str, str] | None = None) -> dict[str, Any]:
    """``docker stack config -c A -c B ...``: the files merged as ``docker stack deploy``
    merges them."""
    docker = shutil.which("docker")
    if docker is None:
        require_service("the docker CLI", "not on PATH")
    args = [docker, "stack", "config"]
    for file in files:
        args += ["-c", str(file)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60,
                            env={"DOCKER_HOST": docker_engine,
                                 "PATH": "/usr/local/bin:/usr/bin:/bin", **(env or {})})
    if result.returncode != 0 and "unknown command" in result.stderr:
        require_service("a docker CLI that merges stack files", "it has no 'stack config'")
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = yaml.safe_load(result.stdout)
    return config


def broker_urls_of(service: dict[str, Any]) -> list[tuple[str, list[str], str]]:
    """(user, [host:port, ...], vhost) of every AMQP URL in a service's command."""
    command = " ".join(service.get("command") or [])
    return [(user, hosts.split(","), vhost) for user, hosts, vhost in AMQP_URL.findall(command)]


def cluster_conf_nodes() -> list[str]:
    conf = (COMPOSE / "rabbitmq-cluster.conf").read_text()
    return re.findall(r"^cluster_formation\.classic_config\.nodes\.\d+\s*=\s*(\S+)$", conf,
                      re.MULTILINE)


@pytest.fixture(scope="module")
def cluster_stack(docker_engine: str) -> dict[str, Any]:
    return merged_config(docker_engine, STACK, BROKER_CLUSTER)


def test_the_broker_cluster_file_adds_two_broker_nodes(cluster_stack):
    assert set(cluster_stack["services"]) == {"rabbitmq", "rabbitmq-2", "rabbitmq-3",
                                              "allocator", "nodeagent", "jupyterhub"}
    assert cluster_stack["secrets"]["swarm-gpu-rabbitmq-cookie"]["external"] is True
    conf = (COMPOSE / "rabbitmq-cluster.conf").read_text()
    assert re.search(r"^cluster_formation\.peer_discovery_backend\s*=\s*classic_config$", conf,
                     re.MULTILINE)
    assert re.search(r"^cluster_partition_handling\s*=\s*pause_minority$", conf, re.MULTILINE)


def test_each_broker_node_has_its_name_its_volume_its_node_and_the_shared_cookie(cluster_stack):
    services = cluster_stack["services"]
    nodes = cluster_conf_nodes()
    script = (COMPOSE / "rabbitmq-cluster-node.sh").read_text()
    (script_conf,) = re.findall(r"^conf=(\S+)$", script, re.MULTILINE)
    volumes, labels = set(), set()
    for index, name in enumerate(BROKER_NODES, start=1):
        broker = services[name]
        # The node name the service sets is the conf's entry of that index, on its host name
        # (the part after @ is what the other nodes and the clients resolve).
        node_name = broker["environment"]["RABBITMQ_NODENAME"]
        assert node_name == nodes[index - 1]
        assert node_name.split("@")[1] == broker["hostname"] == name
        assert broker["user"] == "999:999"
        (data,) = [v for v in broker["volumes"] if v["target"] == "/var/lib/rabbitmq"]
        assert data["type"] == "volume"
        volumes.add(data["source"])
        secrets = {s["target"]: s for s in broker["secrets"]}
        cookie = secrets["/var/lib/rabbitmq/.erlang.cookie"]
        assert cookie["source"] == "swarm-gpu-rabbitmq-cookie"
        assert (cookie["uid"], cookie["gid"], cookie["mode"]) == ("999", "999", 0o400)
        assert secrets["/etc/rabbitmq/definitions.json"]["source"] == \
            "swarm-gpu-rabbitmq-definitions"
        configs = {c["target"]: c for c in broker["configs"]}
        assert configs[script_conf]["source"] == "rabbitmq-cluster-conf"
        assert configs["/etc/rabbitmq/conf.d/20-swarm-gpu.conf"]["source"] == "rabbitmq-conf"
        # One health check each, as stack.yml's (`docker stack deploy` appends an override's
        # list to the base's: the test must be given once).
        assert broker["healthcheck"]["test"] == [
            "CMD", "rabbitmq-diagnostics", "-q", "check_port_connectivity"]
        start = configs[broker["command"][-1]]
        assert start["source"] == "rabbitmq-cluster-node" and start["mode"] == 0o555
        deploy = broker["deploy"]
        assert deploy["replicas"] == 1 and deploy["endpoint_mode"] == "dnsrr"
        constraints = deploy["placement"]["constraints"]
        assert "node.labels.swarm-gpu.broker == true" in constraints
        (label,) = [c for c in constraints if "swarm-gpu.broker-node" in c]
        assert label == f"node.labels.swarm-gpu.broker-node == {index}"
        labels.add(label)
    assert volumes == {"rabbitmq-data", "rabbitmq-2-data", "rabbitmq-3-data"}, \
        "the first node keeps stack.yml's volume (a one-node broker's data), each its own"
    assert len(labels) == 3
    for config in cluster_stack["configs"].values():
        assert Path(config["file"]).is_file()


def test_the_broker_nodes_start_script_is_valid_shell():
    result = subprocess.run(["sh", "-n", str(COMPOSE / "rabbitmq-cluster-node.sh")],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    # It reads the node list the way the conf writes it: run its own sed line on the conf.
    script = (COMPOSE / "rabbitmq-cluster-node.sh").read_text()
    (line,) = [line for line in script.splitlines() if line.startswith("nodes=$(sed")]
    sed = line.removeprefix("nodes=$(").removesuffix(' "$conf")')
    listed = subprocess.run(["sh", "-c", f'{sed} "$0"', str(COMPOSE / "rabbitmq-cluster.conf")],
                            capture_output=True, text=True, timeout=30, check=True).stdout
    assert listed.split() == cluster_conf_nodes() == [
        "rabbit@rabbitmq", "rabbit-2@rabbitmq-2", "rabbit-3@rabbitmq-3"]


def test_every_part_names_the_three_broker_nodes(cluster_stack):
    definitions = json.loads((COMPOSE / "rabbitmq-definitions.json").read_text())
    (vhost,) = [v["name"] for v in definitions["vhosts"]]
    users = {}
    for name, service in cluster_stack["services"].items():
        for user, hosts, url_vhost in broker_urls_of(service):
            users[name] = user
            assert url_vhost == vhost
            assert sorted(hosts) == sorted(f"{node}:5672" for node in BROKER_NODES), name
    assert users == {"allocator": "allocator", "nodeagent": "agent-${SWARM_GPU_AGENT_HOST}",
                     "jupyterhub": "hub"}


def test_on_one_machine_every_broker_name_resolves_and_no_two_nodes_share_a_socket(
        docker_engine):
    stack = merged_config(docker_engine, STACK, ONE_MACHINE, BROKER_CLUSTER,
                          ONE_MACHINE_BROKER_CLUSTER, env=ONE_MACHINE_ENV)
    services = stack["services"]
    addresses = {}
    for name, service in services.items():
        hosts: dict[str, str] = {}
        for entry in service.get("extra_hosts", []):
            host, _, address = entry.partition(":")
            assert hosts.setdefault(host, address) == address, f"{name}: {host} twice"
        for _, urls, _ in broker_urls_of(service):
            for url in urls:
                host, port = url.split(":")
                assert host in hosts, f"{name} cannot resolve {host}"
                assert port == ONE_MACHINE_ENV["SWARM_GPU_BROKER_PORT"]
        if name in BROKER_NODES:
            assert set(BROKER_NODES) <= set(hosts), f"{name} resolves its peers"
            addresses[name] = hosts
    sockets = set()
    for name in BROKER_NODES:
        env = services[name]["environment"]
        address = addresses[name][name]
        assert env["RABBITMQ_NODE_IP_ADDRESS"] == address, "AMQP on the node's own address"
        assert f'{{ip,"{address}"}}' in env["RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS"]
        # One epmd for the machine, on every node's address (scripts/cluster runs it).
        assert env["ERL_EPMD_PORT"] == "4379"
        assert env["ERL_EPMD_ADDRESS"] == ONE_MACHINE_ENV["SWARM_GPU_BROKER_ADDRS"]
        for socket in ((address, env["RABBITMQ_NODE_PORT"]), ("*", env["RABBITMQ_DIST_PORT"]),
                       (address, "15682")):
            assert socket not in sockets, f"{name}: {socket} taken by another node"
            sockets.add(socket)
    # None of the machine's own broker's ports (5672, 15672, 25672, epmd 4369).
    assert not {port for _, port in sockets} & {"5672", "15672", "25672", "4369"}


# ------------------------------------------------------------------- secrets

SECRET_NAME = re.compile(r"PASSWORD|PASSWD|SECRET|TOKEN|COOKIE|CREDENTIAL", re.IGNORECASE)
URL_WITH_PASSWORD = re.compile(r"[a-z][\w+.-]*://[^\s/:@]+:([^\s@]+)@", re.IGNORECASE)
PASSWORD_FROM_A_FILE = re.compile(
    r"\$+\(cat (/run/secrets/[\w.-]+|/etc/swarm-gpu/agent-password)\)")
"""How a command may put a password into a URL: read from a Docker secret, or from the
node's own agent password file, when the task starts (never in the service spec)."""


def secret_problems(services: dict[str, Any]) -> list[str]:
    """What in these services shows a secret: an environment variable holding a URL with a
    password or named like a secret (a ``*_FILE`` variable names a file, which is fine), or
    a command whose URL has a password that is not read from a file."""
    problems = []
    for name, service in services.items():
        environment = service.get("environment") or {}
        if isinstance(environment, list):
            environment = dict(item.partition("=")[::2] for item in environment)
        for key, value in environment.items():
            if URL_WITH_PASSWORD.search(str(value or "")):
                problems.append(f"{name}: {key} holds a URL with a password")
            if SECRET_NAME.search(key) and not key.endswith("_FILE") and value:
                problems.append(f"{name}: {key} holds a secret")
        for part in service.get("command") or []:
            for password in URL_WITH_PASSWORD.findall(str(part)):
                if not PASSWORD_FROM_A_FILE.fullmatch(password):
                    problems.append(f"{name}: its command has the password {password!r}")
    return problems


def test_no_service_shows_a_password(stack, cluster_stack, docker_engine):
    """Passwords reach the services as secret files only: no environment variable of a
    service (what `docker service inspect` shows to whoever may use the Docker API) holds
    one, and the commands read them from files. For every way the stack is deployed."""
    one_machine = merged_config(docker_engine, STACK, ONE_MACHINE, BROKER_CLUSTER,
                                ONE_MACHINE_BROKER_CLUSTER, env=ONE_MACHINE_ENV)
    for config in (stack, cluster_stack, one_machine):
        assert secret_problems(config["services"]) == []
    # and the check sees what it is for
    leaky = {"hub": {"environment": {"SWARM_GPU_AMQP_URL": "amqp://hub:pw@rabbitmq/x",
                                     "HUB_ADMIN_PASSWORD": "pw", "HUB_TOKEN_FILE": "/run/x"},
                     "command": ["sh", "-c", "X=amqp://a:hunter2@rabbitmq/x exec a",
                                 "Y=amqp://a:$$(cat /run/secrets/a)@rabbitmq/x exec a"]}}
    assert secret_problems(leaky) == [
        "hub: SWARM_GPU_AMQP_URL holds a URL with a password",
        "hub: HUB_ADMIN_PASSWORD holds a secret",
        "hub: its command has the password 'hunter2'"]


def test_the_hub_config_reads_its_secrets_from_files():
    """compose/jupyterhub_config.py: the login passwords and the API token come from secret
    files, the broker URL from SWARM_GPU_AMQP_URL_FILE (or the URL its start command built);
    no password is written into the file."""
    text = (COMPOSE / "jupyterhub_config.py").read_text()
    assert 'os.environ.get("SWARM_GPU_AMQP_URL_FILE")' in text
    assert "allocator_url_file" in text and "SWARM_GPU_PAGE_AMQP_URL_FILE" in text
    for name in ("swarm-gpu-hub-login-password", "swarm-gpu-hub-admin-password",
                 "swarm-gpu-hub-api-token"):
        assert f'secret("{name}")' in text, name
    passwords = {m for m in URL_WITH_PASSWORD.findall(text)}
    assert passwords <= {"CHANGE-ME", "$(cat"}, passwords
