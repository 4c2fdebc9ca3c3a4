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
import ssl
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from allocator.config import load_settings
from tests.support.services import require_service

COMPOSE = Path(__file__).resolve().parents[2] / "compose"
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
                                     "swarm-gpu-hub-admin-password", "swarm-gpu-hub-api-token",
                                     "swarm-gpu-metrics-token", "swarm-gpu-broker-ca",
                                     "swarm-gpu-broker-cert", "swarm-gpu-broker-key"}
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
    (secret,) = [s for s in rabbitmq["secrets"] if s["source"] == "swarm-gpu-rabbitmq-definitions"]
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
        for user, url_vhost in re.findall(r"amqps://([^:]+):[^@]+@rabbitmq:5671/([\w.-]+)",
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
AMQP_URL = re.compile(r"(amqps?)://([^:]+):[^@]+@([^/?\"]+)/([\w.-]+)")


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
    """(user, [host:port, ...], vhost) of every AMQP URL in a service's command; a plain
    ``amqp://`` one fails the test (the broker has no plain listener)."""
    command = " ".join(service.get("command") or [])
    urls = AMQP_URL.findall(command)
    assert all(scheme == "amqps" for scheme, *_ in urls), command
    return [(user, hosts.split(","), vhost) for _, user, hosts, vhost in urls]


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
            assert sorted(hosts) == sorted(f"{node}:5671" for node in BROKER_NODES), name
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
        amqps, https = one_machine_listeners(env["RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS"])
        assert amqps == https[0] == address, "AMQP and HTTPS on the node's own address"
        # One epmd for the machine, on every node's address (scripts/cluster runs it).
        assert env["ERL_EPMD_PORT"] == "4379"
        assert env["ERL_EPMD_ADDRESS"] == ONE_MACHINE_ENV["SWARM_GPU_BROKER_ADDRS"]
        for socket in ((address, ONE_MACHINE_ENV["SWARM_GPU_BROKER_PORT"]),
                       ("*", env["RABBITMQ_DIST_PORT"]), https):
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
    """compose/jupyterhub_config.py: the first admin's password and the API token come from
    secret files, the broker URL from SWARM_GPU_AMQP_URL_FILE (or the URL its start command
    built); no password is written into the file."""
    text = (COMPOSE / "jupyterhub_config.py").read_text()
    assert 'os.environ.get("SWARM_GPU_AMQP_URL_FILE")' in text
    assert "allocator_url_file" in text and "SWARM_GPU_PAGE_AMQP_URL_FILE" in text
    assert 'secret_file("swarm-gpu-hub-admin-password")' in text
    assert 'secret("swarm-gpu-hub-api-token")' in text
    passwords = {m for m in URL_WITH_PASSWORD.findall(text)}
    assert passwords <= {"CHANGE-ME", "$(cat"}, passwords


def hub_config(monkeypatch: pytest.MonkeyPatch, secrets_dir: Path, **env: str) -> Any:
    """compose/jupyterhub_config.py as JupyterHub loads it, with these secrets and variables."""
    from traitlets.config.loader import PyFileConfigLoader

    monkeypatch.setenv("SECRETS_DIR", str(secrets_dir))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return PyFileConfigLoader("jupyterhub_config.py", path=str(COMPOSE)).load_config()


def test_the_hub_config_lets_in_only_accounts_an_admin_authorized(monkeypatch, tmp_path):
    """No shared password and no allow-everyone: NativeAuthenticator's accounts, signups
    waiting for an admin, the first admin's account from its secret, and group members from
    no name in the configuration (HUB_STAFF is not read)."""
    from nativeauthenticator import NativeAuthenticator
    from traitlets.utils.importstring import import_item

    from hubplugin.login import AdminAuthorizedAuthenticator

    (tmp_path / "swarm-gpu-hub-admin-password").write_text("first-admin-password\n")
    config = hub_config(monkeypatch, tmp_path, HUB_STAFF="mallory", HUB_STUDENTS="eve")
    authenticator = import_item(config.JupyterHub.authenticator_class)
    assert authenticator is AdminAuthorizedAuthenticator
    assert issubclass(authenticator, NativeAuthenticator)
    assert "SharedPasswordAuthenticator" not in config and "DummyAuthenticator" not in config
    for section in ("Authenticator", "NativeAuthenticator", "AdminAuthorizedAuthenticator"):
        for allow in ("allow_all", "allowed_users", "allow_existing_users", "admin_users"):
            assert allow not in config[section], f"{section}.{allow} is set"
    assert config.NativeAuthenticator.open_signup is False
    assert config.NativeAuthenticator.minimum_password_length >= 10
    first_admin = config.AdminAuthorizedAuthenticator
    assert first_admin.first_admin == "admin"
    assert first_admin.first_admin_password_file == str(tmp_path / "swarm-gpu-hub-admin-password")
    assert config.JupyterHub.load_groups == {"students": {"users": []},
                                             "staff": {"users": ["admin"]}}

    # Without the secret: no first admin, and nobody in staff.
    (tmp_path / "swarm-gpu-hub-admin-password").unlink()
    config = hub_config(monkeypatch, tmp_path)
    assert "first_admin_password_file" not in config.AdminAuthorizedAuthenticator
    assert config.JupyterHub.load_groups == {"students": {"users": []}, "staff": {"users": []}}


def test_the_overlay_networks_are_encrypted(stack):
    """Swarm's overlay networks carry the control plane between nodes (broker, allocator,
    agents, hub) and the notebooks' traffic: IPsec on each, as the stack ships."""
    networks = {name: network for name, network in stack["networks"].items()
                if network.get("driver") == "overlay"}
    assert "default" in networks
    for name, network in networks.items():
        assert network.get("driver_opts", {}).get("encrypted") == "true", name


# ------------------------------------------------------------------------ the networks

CONTROL_PLANE = ("rabbitmq", "rabbitmq-2", "rabbitmq-3", "allocator", "nodeagent")


def networks_of(service: dict[str, Any]) -> set[str]:
    """The stack's networks a service joins (none named: the stack's default)."""
    return set(service.get("networks") or {"default": None})


def test_notebooks_have_a_network_only_the_hub_shares(stack, cluster_stack):
    """The spawner puts notebooks on the stack's notebooks network; the hub alone joins it
    besides them, and no control-plane service does (tests/e2e/test_notebook_network.py deploys
    this layout and tries every port from a notebook)."""
    hub = stack["services"]["jupyterhub"]
    assert hub["environment"]["SWARM_GPU_NETWORK"] == "swarm-gpu_notebooks"
    assert stack["networks"]["notebooks"]["driver"] == "overlay"
    assert not stack["networks"]["notebooks"].get("attachable")
    assert networks_of(hub) == {"default", "notebooks"}
    for config in (stack, cluster_stack):
        on_notebooks = {name for name, service in config["services"].items()
                        if "notebooks" in networks_of(service)}
        assert on_notebooks == {"jupyterhub"}
        for name in CONTROL_PLANE:
            if name in config["services"]:
                assert networks_of(config["services"][name]) == {"default"}, name


def test_the_broker_publishes_no_port_unless_the_site_adds_the_management_file(
        stack, cluster_stack, docker_engine):
    """A published port answers on its node's addresses, which notebooks reach through their
    gateway: only compose/stack.management.yml publishes the management UI. The metrics
    answer only with the metrics token."""
    for config in (stack, cluster_stack):
        for name in CONTROL_PLANE:
            if name in config["services"]:
                assert not config["services"][name].get("ports"), name
    managed = merged_config(docker_engine, STACK, COMPOSE / "stack.management.yml")
    assert [p["published"] for p in managed["services"]["rabbitmq"]["ports"]] == [15671]
    assert [p["target"] for p in managed["services"]["rabbitmq"]["ports"]] == [
        int(rabbitmq_conf()["management.ssl.port"])]
    assert [p["mode"] for p in managed["services"]["rabbitmq"]["ports"]] == ["host"]
    for name, prefix in (("allocator", "SWARM_GPU_"), ("nodeagent", "SWARM_GPU_AGENT_")):
        service = stack["services"][name]
        path = service["environment"][f"{prefix}METRICS_TOKEN_FILE"]
        assert path == "/run/secrets/swarm-gpu-metrics-token"
        assert "swarm-gpu-metrics-token" in [
            s if isinstance(s, str) else s["source"] for s in service["secrets"]]


def test_on_one_machine_the_notebooks_network_is_the_host_network(docker_engine):
    """No overlay networks there: both of the stack's networks are the host network, so the
    hub's two attachments are one (measured: Swarm runs such a task)."""
    one_machine = merged_config(docker_engine, STACK, ONE_MACHINE, env=ONE_MACHINE_ENV)
    for name in ("default", "notebooks"):
        assert one_machine["networks"][name] == {"external": True, "name": "host"}
    assert one_machine["services"]["jupyterhub"]["environment"]["SWARM_GPU_NETWORK"] == "host"



# --------------------------------------------------------------------------------- TLS

BROKER_CA_SECRET = "swarm-gpu-broker-ca"
ERL_SSL_LISTENERS = re.compile(r'-rabbit ssl_listeners \[\{"([\d.]+)",(\d+)\}\]')
ERL_MANAGEMENT_SSL = re.compile(r"-rabbitmq_management ssl_config \[(.*?)\](?:\s|$)")
ERL_TERM = re.compile(r'\{(\w+),"?([^"{}]*)"?\}')
CLIENT_URL = re.compile(r'(\w+)="([a-z]+)://[^"]*"')
"""``VARIABLE="scheme://..."`` in a service's start command: the URL it connects with."""


def rabbitmq_conf() -> dict[str, str]:
    """compose/rabbitmq.conf's settings (``key = value`` lines), each set once."""
    conf: dict[str, str] = {}
    for line in (COMPOSE / "rabbitmq.conf").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = (part.strip() for part in line.partition("="))
            assert key not in conf, f"{key} set twice"
            conf[key] = value
    return conf


def one_machine_listeners(erl_args: str) -> tuple[str, tuple[str, str]]:
    """(the AMQP-over-TLS address, (the HTTPS address, port)) that a one-machine broker
    node's Erlang arguments set in place of rabbitmq.conf's listeners; fails unless the
    management UI gets the conf's TLS files and nothing sets a plain listener."""
    assert "tcp_listeners" not in erl_args and "tcp_config" not in erl_args, erl_args
    ((amqps, _),) = ERL_SSL_LISTENERS.findall(erl_args)
    (management,) = ERL_MANAGEMENT_SSL.findall(erl_args)
    options = dict(ERL_TERM.findall(management))
    conf = rabbitmq_conf()
    for key in ("cacertfile", "certfile", "keyfile"):
        assert options[key] == conf[f"management.ssl.{key}"], key
    return amqps, (options["ip"], options["port"])


def all_deployments(docker_engine: str, stack: dict[str, Any],
                    cluster_stack: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Every way the stack is deployed, merged as ``docker stack deploy`` merges it."""
    return {
        "stack.yml": stack,
        "broker-cluster": cluster_stack,
        "one-machine": merged_config(docker_engine, STACK, ONE_MACHINE, env=ONE_MACHINE_ENV),
        "one-machine broker-cluster": merged_config(
            docker_engine, STACK, ONE_MACHINE, BROKER_CLUSTER, ONE_MACHINE_BROKER_CLUSTER,
            env=ONE_MACHINE_ENV),
    }


def test_the_broker_listens_over_tls_only(stack: dict[str, Any], cluster_stack: dict[str, Any],
                                          docker_engine: str) -> None:
    """compose/rabbitmq.conf: AMQP over TLS, no plain AMQP listener (``listeners.tcp = none``
    also wins over a RABBITMQ_NODE_PORT), the management UI on HTTPS only (no
    ``management.tcp.*``); every broker node of every deployment mounts the TLS secrets
    where the conf reads them (the key for the rabbitmq user only), and the one-machine
    files move the listeners to their own addresses without adding a plain one."""
    conf = rabbitmq_conf()
    assert conf["listeners.tcp"] == "none"
    assert int(conf["listeners.ssl.default"]) == 5671
    assert int(conf["management.ssl.port"]) == 15671
    assert not [key for key in conf if key.startswith(("management.tcp", "management.listener",
                                                       "listeners.tcp."))]
    assert conf["ssl_options.verify"] == "verify_peer"
    files = {"ca.pem": conf["ssl_options.cacertfile"], "cert.pem": conf["ssl_options.certfile"],
             "key.pem": conf["ssl_options.keyfile"]}
    for key in ("cacertfile", "certfile", "keyfile"):
        assert conf[f"management.ssl.{key}"] == conf[f"ssl_options.{key}"]
    wanted = {files["ca.pem"]: "swarm-gpu-broker-ca", files["cert.pem"]: "swarm-gpu-broker-cert",
              files["key.pem"]: "swarm-gpu-broker-key"}
    for deployment, config in all_deployments(docker_engine, stack, cluster_stack).items():
        brokers = [name for name in BROKER_NODES if name in config["services"]]
        assert brokers, deployment
        for name in brokers:
            service = config["services"][name]
            mounted = {s["target"]: s for s in service["secrets"]}
            for target, source in wanted.items():
                assert mounted[target]["source"] == source, (deployment, name, target)
            key = mounted[files["key.pem"]]
            assert (key["uid"], key["gid"], key["mode"]) == ("999", "999", 0o400), name
            erl_args = (service.get("environment") or {}).get(
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS", "")
            if deployment.startswith("one-machine"):
                one_machine_listeners(erl_args)
            else:
                assert erl_args == "", (deployment, name)
    # and the checks see what they are for
    with pytest.raises(AssertionError):
        one_machine_listeners('-rabbit ssl_listeners [{"127.0.0.21",5682}] '
                              '-rabbitmq_management tcp_config [{ip,"127.0.0.21"},{port,15682}]')


def test_every_client_connects_over_tls_and_checks_the_broker_with_its_ca(
        stack: dict[str, Any], cluster_stack: dict[str, Any], docker_engine: str) -> None:
    """In every deployment the allocator, the agents and the hub (its spawner and GPU page
    share its URL) connect with amqps:// and check the broker's certificate against the CA
    of the secret swarm-gpu-broker-ca: the URL's cafile, or the setting named as the URL's
    variable with CA_FILE for URL (SWARM_GPU_AMQP_CA_FILE, SWARM_GPU_AGENT_AMQP_CA_FILE)."""
    ca = f"/run/secrets/{BROKER_CA_SECRET}"
    for deployment, config in all_deployments(docker_engine, stack, cluster_stack).items():
        clients = {}
        for name, service in config["services"].items():
            command = " ".join(service.get("command") or [])
            environment = service.get("environment") or {}
            assert "amqp://" not in command + json.dumps(environment), (deployment, name)
            for variable, scheme in CLIENT_URL.findall(command):
                assert scheme == "amqps", (deployment, name, variable)
                url = re.search(rf'{variable}="([^"]*)"', command)
                assert url is not None
                ca_setting = variable.removesuffix("URL") + "CA_FILE"
                assert f"cafile={ca}" in url.group(1) or environment.get(ca_setting) == ca, \
                    (deployment, name, "no CA")
                secrets = [s if isinstance(s, str) else s["source"] for s in service["secrets"]]
                assert BROKER_CA_SECRET in secrets, (deployment, name)
                clients[name] = variable
        assert clients == {"allocator": "SWARM_GPU_AMQP_URL",
                           "nodeagent": "SWARM_GPU_AGENT_AMQP_URL",
                           "jupyterhub": "SWARM_GPU_AMQP_URL"}, deployment


CERTS = COMPOSE.parent / "scripts" / "certs"


def tls_handshake(folder: Path, host: str) -> None:
    """A TLS handshake in memory: a server with scripts/certs' broker certificate, a client
    that trusts only its CA and checks the certificate for ``host`` (ssl.SSLError if not)."""
    server_context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_context.load_cert_chain(folder / "broker.pem", folder / "broker.key")
    client_context = ssl.create_default_context(cafile=str(folder / "ca.pem"))
    to_server, to_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    from_server, from_client = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_context.wrap_bio(to_client, from_client, server_hostname=host)
    server = server_context.wrap_bio(to_server, from_server, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(10):
        for name, end in (("client", client), ("server", server)):
            if not done[name]:
                try:
                    end.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        to_server.write(from_client.read())
        to_client.write(from_server.read())
        if all(done.values()):
            return
    raise AssertionError("the handshake did not finish")


def test_scripts_certs_makes_a_ca_and_a_broker_certificate_for_every_name(
        tmp_path: Path) -> None:
    """scripts/certs: a CA and the broker's certificate that a client trusting only that CA
    accepts for every name given (and for no other); run again it keeps both, and with a new
    name it keeps the CA (the clients trust it already) and makes the certificate again."""
    folder = tmp_path / "tls"

    def certs(*names: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(CERTS), str(folder), *names], capture_output=True,
                              text=True, timeout=60)

    made = certs("rabbitmq", "localhost", "127.0.0.21")
    assert made.returncode == 0, made.stderr
    for host in ("rabbitmq", "localhost", "127.0.0.21"):
        tls_handshake(folder, host)
    with pytest.raises(ssl.SSLCertVerificationError):
        tls_handshake(folder, "rabbitmq-2")
    assert (folder / "broker.key").stat().st_mode & 0o777 == 0o400
    assert (folder / "ca.key").stat().st_mode & 0o777 == 0o400
    first = {name: (folder / name).read_bytes() for name in ("ca.pem", "broker.pem")}
    assert certs("rabbitmq", "localhost", "127.0.0.21").returncode == 0
    assert {name: (folder / name).read_bytes() for name in first} == first
    assert certs("rabbitmq", "rabbitmq-2", "localhost", "127.0.0.21").returncode == 0
    assert (folder / "ca.pem").read_bytes() == first["ca.pem"]
    assert (folder / "broker.pem").read_bytes() != first["broker.pem"]
    tls_handshake(folder, "rabbitmq-2")
    refused = certs("rabbitmq", "not a name")
    assert refused.returncode != 0 and "not a host name or IPv4 address" in refused.stderr


# ------------------------------------------------------- health checks and monitoring

MONITORING = COMPOSE / "stack.monitoring.yml"
ONE_MACHINE_MONITORING = COMPOSE / "stack.one-machine.monitoring.yml"
PROMETHEUS_DIR = COMPOSE / "prometheus"
ONE_MACHINE_MONITORING_ENV = {**ONE_MACHINE_ENV, "SWARM_GPU_PROMETHEUS_ADDR": "127.0.0.21"}
"""What scripts/cluster exports for the one-machine files with ``--monitoring``."""


def monitored_deployments(docker_engine: str) -> dict[str, dict[str, Any]]:
    """The stack with Prometheus (compose/stack.monitoring.yml), on a cluster and on one
    machine, merged as ``docker stack deploy`` merges them."""
    return {
        "monitoring": merged_config(docker_engine, STACK, MONITORING),
        "one-machine monitoring": merged_config(
            docker_engine, STACK, ONE_MACHINE, MONITORING, ONE_MACHINE_MONITORING,
            env=ONE_MACHINE_MONITORING_ENV),
    }


def test_every_service_has_one_health_check_in_every_deployment(
        stack: dict[str, Any], cluster_stack: dict[str, Any], docker_engine: str) -> None:
    """Swarm restarts a task whose check fails and counts a new one as running only once it
    passes. The allocator and the agent run their own ``health`` command (GET /healthz: a
    blocked event loop or a lost broker connection), the hub is asked /hub/health on the port
    it publishes. One check per service: a later file's healthcheck test is appended to an
    earlier one's when files merge, which makes a command no one meant."""
    deployments = {**all_deployments(docker_engine, stack, cluster_stack),
                   **monitored_deployments(docker_engine)}
    for deployment, config in deployments.items():
        for name, service in config["services"].items():
            test = service.get("healthcheck", {}).get("test") or []
            kinds = [part for part in test if part in ("CMD", "CMD-SHELL", "NONE")]
            assert kinds in (["CMD"], ["CMD-SHELL"]) and test[0] == kinds[0], \
                (deployment, name, test)
        services = config["services"]
        assert services["allocator"]["healthcheck"]["test"] == ["CMD", "gpu-allocator",
                                                                 "health"], deployment
        assert services["nodeagent"]["healthcheck"]["test"] == ["CMD", "gpu-nodeagent",
                                                                 "health"], deployment
    hub = stack["services"]["jupyterhub"]
    (published,) = hub["ports"]
    assert f"http://127.0.0.1:{published['target']}/hub/health" in " ".join(
        hub["healthcheck"]["test"])


def test_the_agents_metrics_reach_the_control_plane_only(
        stack: dict[str, Any], docker_engine: str) -> None:
    """Prometheus scrapes the agents: on a cluster the agent binds every address of its
    container, whose only network is the control plane's; on one machine (the host network,
    one namespace for every node) each agent binds its own node's address, not a wildcard
    that the other node's agent could not share; the token guards it from notebooks there."""
    agent = stack["services"]["nodeagent"]
    assert agent["environment"]["SWARM_GPU_AGENT_METRICS_ADDR"] == "0.0.0.0"
    assert networks_of(agent) == {"default"}
    assert agent["environment"]["SWARM_GPU_AGENT_METRICS_TOKEN_FILE"]
    one_machine = merged_config(docker_engine, STACK, ONE_MACHINE, env=ONE_MACHINE_ENV)
    addr = one_machine["services"]["nodeagent"]["environment"]["SWARM_GPU_AGENT_METRICS_ADDR"]
    # Swarm's template, rendered per node as Swarm renders it (Go's if/eq/else)
    chosen = re.fullmatch(r'(127\.0\.0\.)\{\{if eq \.Node\.Hostname "([\w-]+)"\}\}(\d+)'
                          r"\{\{else\}\}(\d+)\{\{end\}\}", addr)
    assert chosen is not None, addr
    prefix, first_node, first, other = chosen.groups()
    assert (first_node, prefix + first, prefix + other) == (
        "gpu-1", "127.0.0.22", "127.0.0.23"), "scripts/cluster's gpu-1 and gpu-2"


def test_prometheus_runs_on_the_control_plane_with_the_token_and_the_rules(
        docker_engine: str) -> None:
    """compose/stack.monitoring.yml: Prometheus on the control plane's network only, its
    port unpublished; prometheus.yml and alerts.yml side by side as the config's relative
    rule_files and credentials_file expect, and the metrics token beside them; its data on
    one labelled node. On one machine: the host network, prometheus.one-machine.yml in
    place of prometheus.yml, and both its listener and its health check on the address
    SWARM_GPU_PROMETHEUS_ADDR names."""
    deployments = monitored_deployments(docker_engine)
    for deployment, config in deployments.items():
        prometheus = config["services"]["prometheus"]
        assert not prometheus.get("ports"), deployment
        assert networks_of(prometheus) == {"default"}, deployment
        mounted = {c["target"]: config["configs"][c["source"]]["file"]
                   for c in prometheus["configs"]}
        assert set(mounted) == {"/etc/prometheus/prometheus.yml", "/etc/prometheus/alerts.yml"}
        assert Path(mounted["/etc/prometheus/alerts.yml"]) == PROMETHEUS_DIR / "alerts.yml"
        config_file = Path(mounted["/etc/prometheus/prometheus.yml"])
        prometheus_yml = yaml.safe_load(config_file.read_text())
        assert prometheus_yml["rule_files"] == ["alerts.yml"]
        (token,) = prometheus["secrets"]
        assert (token["source"], token["target"]) == ("swarm-gpu-metrics-token",
                                                      "/etc/prometheus/metrics-token")
        for job in prometheus_yml["scrape_configs"]:
            if job["job_name"] != "swarm-gpu-ledger-node":
                assert job["authorization"] == {"credentials_file": "metrics-token"}, job
        assert prometheus["deploy"]["placement"]["constraints"] == [
            "node.labels.swarm-gpu.monitoring == true"]
        assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    cluster = deployments["monitoring"]
    assert Path(cluster["configs"]["prometheus-yml"]["file"]) == PROMETHEUS_DIR / "prometheus.yml"
    assert "--web.listen-address=0.0.0.0:9090" in cluster["services"]["prometheus"]["command"]
    one_machine = deployments["one-machine monitoring"]
    assert one_machine["networks"]["default"] == {"external": True, "name": "host"}
    assert Path(one_machine["configs"]["prometheus-yml"]["file"]) == \
        PROMETHEUS_DIR / "prometheus.one-machine.yml"
    local = one_machine["services"]["prometheus"]
    assert "--web.listen-address=127.0.0.21:9090" in local["command"]
    assert "http://127.0.0.21:9090/-/ready" in local["healthcheck"]["test"]
