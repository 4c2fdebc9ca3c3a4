"""Monitoring: the alert rules, their unit tests and the Grafana dashboard, checked with
Prometheus's own ``promtool`` and against real scrapes.

- ``compose/prometheus/alerts.yml``: ``promtool check rules``; ``promtool test rules`` with
  ``alerts.test.yml``, which must test every alert firing and not firing; a runbook line for
  each in docs/operations.md.
- ``compose/prometheus/prometheus.yml``: ``promtool check config``; so is the one-machine
  cluster's ``prometheus.one-machine.yml``, which scrapes the same jobs from named targets.
- ``compose/grafana/swarm-gpu.json``: its structure, and every query valid PromQL.
- A real allocator (with the replicated ledger log) and a real node agent fed by it, scraped
  over HTTP: ``promtool check metrics`` on both, and every ``swarm_gpu_*`` metric an alert or
  a panel names (with the labels it filters, groups or joins on, and the legends it prints)
  must be in those scrapes. ``node_filesystem_*`` are node_exporter's, not swarm-gpu's, and
  are not looked for there.

``promtool`` is Debian's ``prometheus`` package (``scripts/services start`` installs it and
exports ``SWARM_GPU_PROMTOOL``).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiodocker
import pytest
import yaml

from allocator.amqp.client import AllocatorClient
from allocator.metrics import exporter as allocator_metrics
from allocator.wire.lease_container import grant_labels
from allocator.wire.protocol import AllocateRequest
from nodeagent.agent import NodeAgent
from nodeagent.config import AgentSettings
from nodeagent.simulated import make_gpu, make_mig_gpu, write_inventory
from tests.support.common import started, wait_until
from tests.support.faults import running_allocator
from tests.support.ports import free_port
from tests.support.services import require_service

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = REPO_ROOT / "compose" / "prometheus"
ALERTS = PROMETHEUS_DIR / "alerts.yml"
ALERT_TESTS = PROMETHEUS_DIR / "alerts.test.yml"
PROMETHEUS_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
ONE_MACHINE_CONFIG = PROMETHEUS_DIR / "prometheus.one-machine.yml"
DASHBOARD = REPO_ROOT / "compose" / "grafana" / "swarm-gpu.json"
OPERATIONS = REPO_ROOT / "docs" / "operations.md"

OURS = re.compile(r"\bswarm_gpu_[a-z0-9_]*[a-z0-9]\b(?!:)")
"""A metric of swarm-gpu's (allocator or agent) named in an expression."""
SELECTOR = re.compile(r"\b(swarm_gpu_[a-z0-9_]+)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
LEGEND = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")

GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h",
                     "$Hostname": ".*"}
"""What Grafana puts in for the dashboard's variables, for promtool to parse the queries."""

ALLOWED_LINT = re.compile(
    r"^swarm_gpu_agent_gpu_[a-z_]+ label names should be written in 'snake_case' not "
    r"'camelCase'$")
"""The one finding ``promtool check metrics`` may report: the per-GPU families carry DCGM
exporter's label ``modelName`` on purpose (nodeagent/metrics.py), so that dashboards written
for DCGM join on it."""


# ------------------------------------------------------------------------------ promtool


@pytest.fixture(scope="session")
def promtool() -> Path:
    """promtool from Debian's ``prometheus`` package (``SWARM_GPU_PROMTOOL``, else PATH)."""
    configured = os.environ.get("SWARM_GPU_PROMTOOL") or shutil.which("promtool")
    if not configured or not Path(configured).is_file():
        require_service("promtool", "executable not found (Debian package prometheus)")
    return Path(configured)


def run_promtool(promtool: Path, *args: str, stdin: str | None = None,
                 cwd: Path = PROMETHEUS_DIR) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(promtool), *args], input=stdin, cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def test_alert_rules_pass_promtool_check(promtool: Path) -> None:
    done = run_promtool(promtool, "check", "rules", ALERTS.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_rules())} rules found" in done.stdout


def test_alert_unit_tests_pass(promtool: Path) -> None:
    done = run_promtool(promtool, "test", "rules", ALERT_TESTS.name)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def check_config_as_deployed(promtool: Path, tmp_path: Path, config: Path) -> None:
    """``promtool check config`` as deployed: the folder with the metrics token beside the
    config (promtool checks the credentials file exists)."""
    deployed = tmp_path / "prometheus"
    shutil.copytree(PROMETHEUS_DIR, deployed)
    (deployed / "metrics-token").write_text("a-token-of-the-site\n")
    done = run_promtool(promtool, "check", "config", config.name, cwd=deployed)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_prometheus_config_is_valid(promtool: Path, tmp_path: Path) -> None:
    check_config_as_deployed(promtool, tmp_path, PROMETHEUS_CONFIG)
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    for job in config["scrape_configs"]:
        if job["job_name"] in ("swarm-gpu-allocator", "swarm-gpu-nodeagent"):
            assert job["authorization"] == {"credentials_file": "metrics-token"}, job


def test_the_one_machine_prometheus_config_is_valid_and_scrapes_as_the_other(
        promtool: Path, tmp_path: Path) -> None:
    """prometheus.one-machine.yml (compose/stack.one-machine.monitoring.yml): valid, the same
    rules and the same swarm-gpu jobs with the same token as prometheus.yml, only with named
    targets where the host network has no Swarm DNS."""
    check_config_as_deployed(promtool, tmp_path, ONE_MACHINE_CONFIG)
    one_machine = yaml.safe_load(ONE_MACHINE_CONFIG.read_text())
    cluster = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert one_machine["rule_files"] == cluster["rule_files"]

    def jobs(config: dict[str, Any]) -> dict[str, Any]:
        return {job["job_name"]: job.get("authorization") for job in config["scrape_configs"]
                if job["job_name"] in ("swarm-gpu-allocator", "swarm-gpu-nodeagent")}
    assert jobs(one_machine) == jobs(cluster) and len(jobs(cluster)) == 2
    for job in one_machine["scrape_configs"]:
        assert "dns_sd_configs" not in job and job["static_configs"], job


# --------------------------------------------------------------------------- the alerts


def alert_rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(ALERTS.read_text())
    return [rule for group in document["groups"] for rule in group["rules"] if "alert" in rule]


def test_every_alert_is_tested_firing_and_not_firing() -> None:
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    assert tests["rule_files"] == [ALERTS.name]
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in tests["tests"]:
        for check in case["alert_rule_test"]:
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = {rule["alert"] for rule in alert_rules()}
    assert len(names) == len(alert_rules()), "an alert name is used twice"
    assert names - firing == set(), "alerts never tested firing"
    assert names - quiet == set(), "alerts never tested not firing"
    assert (firing | quiet) - names == set(), "tests of alerts that do not exist"


def monitoring_section() -> str:
    text = OPERATIONS.read_text()
    start = text.index("\n## Monitoring\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def test_every_alert_has_a_runbook_line() -> None:
    section = monitoring_section()
    rows = {match.group(1): match.group(0) for match in
            re.finditer(r"^\| `(SwarmGpu\w+)` \|.*\|.*\|$", section, flags=re.MULTILINE)}
    for rule in alert_rules():
        name = rule["alert"]
        assert name in rows, f"{name}: no runbook line in docs/operations.md, Monitoring"
        meaning, response = [cell.strip() for cell in rows[name].split("|")[2:4]]
        assert meaning and response, f"{name}: its runbook line lacks meaning or response"
        assert rule["annotations"]["runbook"] == f"docs/operations.md#monitoring ({name})"
    assert set(rows) == {rule["alert"] for rule in alert_rules()}


# ------------------------------------------------------------------------- the dashboard


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def dashboard_queries() -> list[str]:
    """Every PromQL query of the dashboard: the panels' and the variables'."""
    board = dashboard()
    queries = [target["expr"] for panel in all_panels(board["panels"])
               for target in panel.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def test_the_dashboard_is_well_formed() -> None:
    board = dashboard()
    assert board["title"] and board["uid"] == "swarm-gpu"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    source = variables["datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    expected_source = {"type": "prometheus", "uid": "${datasource}"}
    panels = list(all_panels(board["panels"]))
    ids = [panel["id"] for panel in panels]
    assert all(isinstance(i, int) and i > 0 for i in ids) and len(set(ids)) == len(ids)
    for panel in panels:
        where = f"panel {panel['id']} ({panel.get('title')})"
        assert panel.get("title"), where
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), where
        assert panel["gridPos"]["x"] >= 0, where
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, where
        if panel["type"] == "row":
            assert "targets" not in panel, where
            continue
        assert panel.get("description"), where
        assert panel["datasource"] == expected_source, where
        assert panel["targets"], where
        refs = [target["refId"] for target in panel["targets"]]
        assert len(set(refs)) == len(refs), where
        for target in panel["targets"]:
            assert target["expr"].strip(), where
            assert target["datasource"] == expected_source, where
    # What the issue asks the dashboard to show, by the metrics that show it.
    queries = "\n".join(dashboard_queries())
    for metric in ("swarm_gpu_gpus", "swarm_gpu_queue_length",
                   "swarm_gpu_queue_oldest_wait_seconds", "swarm_gpu_agent_user_gpus",
                   "swarm_gpu_agent_group_gpus", "swarm_gpu_reclaim_warnings_total",
                   "swarm_gpu_agent_gpu_held", "swarm_gpu_nodes",
                   "swarm_gpu_node_last_heartbeat_timestamp_seconds",
                   "swarm_gpu_agent_gpu_healthy", "swarm_gpu_request_seconds_bucket",
                   "swarm_gpu_batches_total", "swarm_gpu_batch_phase_seconds_bucket",
                   "swarm_gpu_ledger_write_seconds_bucket",
                   "swarm_gpu_agent_gpu_utilization_ratio", "swarm_gpu_group_gpus_held"):
        assert metric in queries, metric


def test_every_dashboard_query_is_valid_promql(promtool: Path, tmp_path: Path) -> None:
    # promtool parses PromQL in recording rules: one rule per query, Grafana's variables put in.
    rules = []
    for number, query in enumerate(dashboard_queries()):
        for variable, replacement in GRAFANA_VARIABLES.items():
            query = query.replace(variable, replacement)
        assert "$" not in query, f"a Grafana variable promtool cannot parse: {query}"
        if query.startswith("label_values("):
            query = query.removeprefix("label_values(").rsplit(",", 1)[0]
        rules.append({"record": f"dashboard:query_{number}", "expr": query})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = run_promtool(promtool, "check", "rules", path.name, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


# ------------------------------------------------------------------------ real scrapes


@dataclass
class Scrape:
    """What one real scrape exports: sample names, and each family's label names."""

    text: str
    names: set[str] = field(default_factory=set)
    labels: dict[str, set[str]] = field(default_factory=dict)
    """Sample name -> the label names its samples carry (none without samples)."""

    def __post_init__(self) -> None:
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                    "summary": ("_sum", "_count", ""), "gauge": ("",), "untyped": ("",)}
        for line in self.text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split()
                base = name.removesuffix("_total") if kind == "counter" else name
                self.names.update(base + suffix for suffix in suffixes.get(kind, ("",)))
            elif line and not line.startswith("#"):
                match = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s", line)
                assert match, line
                name = match.group(1)
                self.names.add(name)
                got = self.labels.setdefault(name, set())
                got.update(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="', match.group(2) or ""))


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return str(response.read().decode())


def promtool_findings(promtool: Path, text: str) -> list[str]:
    """What ``promtool check metrics`` says about a scrape, less the one allowed finding."""
    done = run_promtool(promtool, "check", "metrics", stdin=text)
    lines = [line.strip() for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    if done.returncode not in (0, 3):  # 3: lint findings, listed
        return [f"promtool exited {done.returncode}", *lines]
    return [line for line in lines if not ALLOWED_LINT.match(line)]


def expressions() -> list[tuple[str, str, str]]:
    """(where, PromQL, what its result's labels are printed with) of every alert and every
    dashboard query."""
    found = [(f"alert {rule['alert']}", str(rule["expr"]),
              # an annotation's {{ $labels.x }} prints label x, as a legend's {{x}} does
              " ".join("{{" + label + "}}" for label in re.findall(
                  r"\$labels\.([A-Za-z_][A-Za-z0-9_]*)",
                  " ".join(rule.get("annotations", {}).values()))))
             for rule in alert_rules()]
    board = dashboard()
    for panel in all_panels(board["panels"]):
        for target in panel.get("targets", []):
            found.append((f"panel {panel['id']} {target['refId']}", target["expr"],
                          target.get("legendFormat", "")))
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            found.append((f"variable {variable['name']}", variable["query"]["query"], ""))
    return found


def missing_from(scrapes: list[Scrape], where: str, expr: str, printed: str) -> list[str]:
    """What ``expr`` names of swarm-gpu's metrics (and their labels) that no scrape has."""
    names = set().union(*(s.names for s in scrapes))
    labels: dict[str, set[str]] = {}
    for scrape in scrapes:
        for name, got in scrape.labels.items():
            labels.setdefault(name, set()).update(got)
    problems = []
    used = set(OURS.findall(expr))
    for metric in sorted(used - names):
        problems.append(f"{where}: {metric} is in no real scrape")
    # Labels a selector filters on, for metrics whose samples show their labels.
    for metric, matchers in SELECTOR.findall(expr):
        for label in MATCHER.findall(matchers):
            if metric in labels and labels[metric] and label not in labels[metric]:
                problems.append(f"{where}: {metric} has no label {label}")
    # Labels grouped, joined or printed: some metric of the expression must carry them
    # (Prometheus adds instance and job to every series; histograms have le).
    known = {"instance", "job", "le"}.union(*(labels.get(m, set()) for m in used))
    grouped = {label.strip() for group in GROUPING.findall(expr)
               for label in group.split(",") if label.strip()}
    grouped.update(LEGEND.findall(printed))
    if used and all(labels.get(m) for m in used):  # only where every metric's labels are known
        for label in sorted(grouped - known):
            problems.append(f"{where}: no metric in it has the label {label}")
    return problems


@pytest.mark.docker
async def test_real_scrapes_are_clean_and_have_every_metric_alerts_and_panels_use(
        promtool: Path, amqp_vhost: Any, ledger_path: Path, tmp_path: Path,
        docker_engine: str, busybox_image: str) -> None:
    tag = uuid.uuid4().hex[:8]
    host = f"monitoring-node-{tag}"
    inventory = tmp_path / "inventory.json"
    write_inventory(inventory, {host: [
        make_gpu(host, 0, "NVIDIA GeForce GTX 1070", utilization_pct=2.0),
        make_gpu(host, 1, "NVIDIA GeForce GTX 1070", temperature_c=97.0),  # unhealthy
        make_mig_gpu(host, 2, "NVIDIA A100-SXM4-40GB", ["1g.5gb", "3g.20gb"]),
    ]})
    settings = AgentSettings(
        host=host, amqp_url=amqp_vhost.url, inventory="simulated", simulated_file=inventory,
        interval_s=0.25, publish_timeout_s=1.0, amqp_reconnect_s=0.2, docker=True,
        docker_url=docker_engine, docker_timeout_s=3.0, xid_poll_s=0.2,
        metrics_port=free_port())
    docker = aiodocker.Docker(url=docker_engine)
    container_id = ""
    try:
        # A guarantee for the lease's group, so the guaranteed/borrowed gauge has samples.
        async with running_allocator(amqp_vhost.url, ledger_path, ledger_log="stream",
                                     start_fence_s=0, group_quota={f"group-{tag}": 1}) \
                as service, \
                started(NodeAgent(settings)), \
                AllocatorClient(amqp_vhost.url, timeout_s=10) as client:
            server = allocator_metrics.serve(service, port=0, addr="127.0.0.1")
            try:
                async def up() -> bool:
                    return any(n.host == host and n.up for n in (await client.inventory()).nodes)
                await wait_until(up, within=20)
                # A lease, its container with the grant's labels (user, groups), bound.
                lease = await client.allocate(AllocateRequest(
                    request_key=f"hub/user-{tag}/", user=f"user-{tag}",
                    groups=[f"group-{tag}"], model="NVIDIA GeForce GTX 1070"))
                container = await docker.containers.run(
                    config={"Image": busybox_image, "Cmd": ["sleep", "300"],
                            "Labels": grant_labels(lease, groups=[f"group-{tag}"]),
                            "HostConfig": {"NetworkMode": "host"}},
                    name=f"monitoring-{tag}")
                container_id = container.id

                async def scraped() -> tuple[Scrape, Scrape] | None:
                    allocator = Scrape(await asyncio.to_thread(scrape_text, server.port))
                    agent = Scrape(await asyncio.to_thread(scrape_text, settings.metrics_port))
                    bound = re.search(r'^swarm_gpu_leases\{state="bound"\} (\S+)$',
                                      allocator.text, flags=re.MULTILINE)
                    ready = ("swarm_gpu_agent_user_gpus" in agent.names
                             and "swarm_gpu_ledger_log_offset" in allocator.names
                             and bound is not None and float(bound.group(1)) >= 1)
                    return (allocator, agent) if ready else None
                allocator, agent = await wait_until(scraped, within=30, interval=0.2)
            finally:
                server.close()
    finally:
        if container_id:
            await docker.containers.container(container_id).delete(force=True)
        await docker.close()

    # The heartbeating node's messages reach this replica, the log's writer: the active one,
    # whose series the rules keep.
    assert re.search(r"^swarm_gpu_allocator_active 1(\.0)?$", allocator.text, flags=re.MULTILINE)
    assert promtool_findings(promtool, allocator.text) == []
    assert promtool_findings(promtool, agent.text) == []
    problems = [problem for where, expr, printed in expressions()
                for problem in missing_from([allocator, agent], where, expr, printed)]
    assert problems == []


def test_the_check_against_scrapes_finds_what_is_missing() -> None:
    # The check that guards the alerts and the dashboard must itself bite.
    scrape = Scrape('# HELP swarm_gpu_x_total X\n# TYPE swarm_gpu_x_total counter\n'
                    'swarm_gpu_x_total{kind="a"} 1.0\n# HELP swarm_gpu_g G\n'
                    '# TYPE swarm_gpu_g gauge\nswarm_gpu_g{model="m"} 1.0\n'
                    '# HELP swarm_gpu_h H\n# TYPE swarm_gpu_h histogram\n')

    def check(expr: str, printed: str = "") -> list[str]:
        return missing_from([scrape], "q", expr, printed)
    assert check('sum by (kind) (rate(swarm_gpu_x_total{kind="a"}[5m]))', "{{kind}}") == []
    assert check("histogram_quantile(0.9, sum by (le) (rate(swarm_gpu_h_bucket[5m])))") == []
    assert check("rate(swarm_gpu_y_total[5m])") == ["q: swarm_gpu_y_total is in no real scrape"]
    assert check('swarm_gpu_g{modle="m"}') == ["q: swarm_gpu_g has no label modle"]
    assert check("sum by (state) (swarm_gpu_g)") == ["q: no metric in it has the label state"]
    assert check("swarm_gpu_g", "{{host}}") == ["q: no metric in it has the label host"]
    assert check("swarm_gpu_g and on(instance) swarm_gpu:recorded") == []
