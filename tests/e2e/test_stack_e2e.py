"""swarm-gpu deployed as an admin deploys it, on a real three-node Swarm (``scripts/cluster``).

``scripts/cluster up`` builds the images (a Debian base from mmdebstrap, the broker from
Debian's rabbitmq-server, compose/Dockerfile's stages), pushes them to a local registry, and
runs ``docker stack deploy -c compose/stack.yml -c compose/stack.one-machine.yml`` on a manager
and two GPU workers, each its own Docker engine with its own host name. The tests then use the
cluster as an admin and users would: ``docker`` against each node, ``gpu-ledger`` in the
allocator's container (where docs/operations.md says), the hub's REST API with the admin token,
and the spawn form in headless Chromium. The GPUs are simulated (the agents' only stand-in):
gpu-1 has two GTX 1070, gpu-2 an RTX 3090 and a GTX 1070.

One cluster for the whole module, so CI builds the images once; the tests run in file order
and each leaves the cluster as it found it (no server running, every GPU free). The module
ends with ``scripts/cluster down`` unless SWARM_GPU_CLUSTER_KEEP=1 (then the next run's
``scripts/cluster up`` finds it running and only rebuilds what changed).

The cluster comes up with ``--monitoring`` (compose/stack.monitoring.yml, Prometheus with
compose/prometheus/alerts.yml): one more image and service on the module's one cluster costs
far less CI time than a cluster of its own for the monitoring test would.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import os
import secrets
import shutil
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest

from allocator.amqp.client import (
    AllocatorClient,
    AllocatorError,
    AllocatorTimeout,
    AllocatorUnavailable,
)
from allocator.wire.protocol import AllocateRequest
from tests.support.hub_browser import Browser
from tests.support.stack import (
    ALLOCATOR_NODES,
    GTX1070,
    LEASE_LABEL,
    NODES,
    REPO_ROOT,
    RTX3090,
    UP_TIMEOUT_S,
    WITHIN_S,
    Cluster,
    T,
    cluster_up,
    eventually,
)

pytestmark = [pytest.mark.docker, pytest.mark.hub, pytest.mark.slow,
              pytest.mark.timeout(UP_TIMEOUT_S + 600)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with cluster_up("--monitoring") as running:
        yield running


# ------------------------------------------------------------------------------ tests


def test_every_service_runs_and_is_healthy(cluster: Cluster) -> None:
    services = {}
    for line in cluster.manager("service", "ls", "--format",
                                "{{.Name}} {{.Mode}} {{.Replicas}}").stdout.splitlines():
        name, mode, replicas = line.split()[:3]
        if name.startswith(f"{cluster.stack}_"):  # not the users' notebook services
            services[name] = (mode, replicas)
    stack = cluster.stack
    assert services == {
        f"{stack}_rabbitmq": ("replicated", "1/1"),
        f"{stack}_allocator": ("replicated", "2/2"),
        f"{stack}_nodeagent": ("global", "2/2"),
        f"{stack}_jupyterhub": ("replicated", "1/1"),
        f"{stack}_prometheus": ("replicated", "1/1"),
    }
    # The agents run on the GPU nodes, one each; broker and hub on the manager; the two
    # allocator replicas on the two nodes labelled for them, one each.
    where: dict[str, list[str]] = {}
    for line in cluster.manager("stack", "ps", stack, "--filter", "desired-state=running",
                                "--format", "{{.Name}} {{.Node}}").stdout.splitlines():
        name, node = line.split()
        where.setdefault(name.split(".")[0], []).append(node)
    assert sorted(where[f"{stack}_nodeagent"]) == ["gpu-1", "gpu-2"]
    assert where[f"{stack}_rabbitmq"] == ["manager-1"]
    assert sorted(where[f"{stack}_allocator"]) == sorted(ALLOCATOR_NODES)
    # Every service has a health check (gpu-allocator health, gpu-nodeagent health, the hub's
    # /hub/health, the broker's and Prometheus's own), and every container of the stack
    # passes it: broker, hub and Prometheus on the manager, an allocator and an agent on
    # each GPU node.
    def healthy() -> dict[str, list[str]] | None:
        found = {}
        for node in NODES:
            health = cluster.docker(node, "ps", "--format", "{{.Names}} {{.Status}}").stdout
            running = [line for line in health.splitlines() if line.startswith(f"{stack}_")]
            if not all("(healthy)" in line for line in running):
                return None
            found[node] = sorted(line.split()[0].split(".")[0] for line in running)
        return found
    by_node = eventually(healthy, "every container of the stack healthy")
    assert by_node == {
        "manager-1": [f"{stack}_jupyterhub", f"{stack}_prometheus", f"{stack}_rabbitmq"],
        "gpu-1": [f"{stack}_allocator", f"{stack}_nodeagent"],
        "gpu-2": [f"{stack}_allocator", f"{stack}_nodeagent"]}, by_node
    status, body = cluster.api("GET", "/")
    assert status == 200 and "version" in body


NODE_SILENT = "SwarmGpuNodeSilent"
ALERT_WITHIN_S = 300.0
"""Bound on a node-silent alert firing: the allocator's node_down_after_s (20 s), the rule's
``for: 2m``, and a few of the one-machine Prometheus's 5 s scrapes and evaluations."""


def test_prometheus_scrapes_everything_and_a_silent_node_fires_its_alert_until_it_is_back(
        cluster: Cluster) -> None:
    """compose/stack.monitoring.yml: Prometheus scrapes both allocator replicas and both
    agents with the metrics token (every target up) and loads every rule of alerts.yml. The
    agent of gpu-2 stopped (its node's swarm-gpu.gpu label removed, as when a node leaves
    the GPU pool), SwarmGpuNodeSilent fires for gpu-2 in Prometheus; the label back, Swarm
    starts the agent again and the alert resolves."""
    def targets() -> list[tuple[str, str, str]] | None:
        found = sorted((t["labels"]["job"], t["scrapeUrl"], t["health"])
                       for t in cluster.prometheus("/targets")["activeTargets"])
        return found if found and all(health == "up" for _, _, health in found) else None
    up = eventually(targets, "every Prometheus target up")
    assert [(job, url) for job, url, _ in up] == [
        ("swarm-gpu-allocator", "http://127.0.0.1:9461/metrics"),
        ("swarm-gpu-allocator", "http://127.0.0.1:9462/metrics"),
        ("swarm-gpu-nodeagent", "http://127.0.0.22:9465/metrics"),
        ("swarm-gpu-nodeagent", "http://127.0.0.23:9465/metrics")], up
    rules = {rule["name"] for group in cluster.prometheus("/rules")["groups"]
             for rule in group["rules"]}
    assert NODE_SILENT in rules and "SwarmGpuNoActiveAllocator" in rules, rules
    # Both nodes up in Prometheus's view before one goes: the rule needs gpu-2 seen up.
    def both_up() -> bool:
        result = cluster.prometheus("/query?query=" + urllib.parse.quote(
            "max by (host) (swarm_gpu_node_up)"))["result"]
        return {r["metric"]["host"]: r["value"][1] for r in result} == {"gpu-1": "1",
                                                                          "gpu-2": "1"}
    eventually(both_up, "swarm_gpu_node_up 1 for gpu-1 and gpu-2")
    # None pending before: a replica restarted less than 2 minutes ago (the deploy) still
    # has its predecessor's message rate, and so the standby's view counts as the live one.
    eventually(lambda: cluster.alerts(NODE_SILENT) == {}, f"no {NODE_SILENT} alert before",
               within=ALERT_WITHIN_S, interval=2)

    agent = f"{cluster.stack}_nodeagent"
    cluster.manager("node", "update", "--label-rm", "swarm-gpu.gpu", "gpu-2")
    try:
        eventually(lambda: not cluster.docker("gpu-2", "ps", "-q", "-f", f"name={agent}")
                   .stdout.strip(), "the agent on gpu-2 stopped")
        silent = time.monotonic()
        eventually(lambda: cluster.alerts(NODE_SILENT) == {"gpu-2": "firing"},
                   f"{NODE_SILENT} firing for gpu-2", within=ALERT_WITHIN_S, interval=2)
        print(f"agent stopped to {NODE_SILENT} firing: {time.monotonic() - silent:.0f} s")
    finally:
        cluster.manager("node", "update", "--label-add", "swarm-gpu.gpu=true", "gpu-2")
    back = time.monotonic()
    eventually(lambda: cluster.alerts(NODE_SILENT) == {}, f"{NODE_SILENT} resolved",
               interval=2)
    print(f"label back to {NODE_SILENT} resolved: {time.monotonic() - back:.0f} s")
    eventually(lambda: any(h["host"] == "gpu-2" and h["up"]
                           for h in cluster.ledger_status()["hosts"]), "gpu-2 up again")
    eventually(lambda: cluster.free() == {"gpu-1": 2, "gpu-2": 2}, "every GPU free")


def plain_answer(address: str, port: int, hello: bytes) -> bytes:
    """What a port answers to ``hello`` sent in plain text (b"" when it closes or says
    nothing within 10 s)."""
    with socket.create_connection((address, port), timeout=30) as conn:
        conn.settimeout(10)
        conn.sendall(hello)
        try:
            return conn.recv(64)
        except (TimeoutError, ConnectionResetError):
            return b""


AMQP_HEADER = b"AMQP\x00\x00\x09\x01"


def test_the_broker_answers_over_tls_only(cluster: Cluster) -> None:
    """The broker listens for AMQP over TLS and serves its HTTP API on HTTPS, with the
    certificate scripts/certs made (checked against the cluster's CA for the node's address);
    by its own account it has no other listener, and neither port answers in plain text."""
    address = cluster.env["SWARM_GPU_MANAGER_ADDR"]
    port = int(cluster.env["SWARM_GPU_BROKER_PORT"])
    overview = cluster.broker_api("/overview")
    listeners = {(listener["protocol"], listener["port"]) for listener in overview["listeners"]}
    assert listeners == {("amqp/ssl", port), ("https", 15682), ("clustering", 25682)}, listeners
    # AMQP over TLS: the handshake checks the certificate, then the broker starts AMQP.
    tls = ssl.create_default_context(cafile=str(cluster.broker_ca))
    with socket.create_connection((address, port), timeout=30) as raw, \
            tls.wrap_socket(raw, server_hostname=address) as conn:
        conn.sendall(AMQP_HEADER)
        assert conn.recv(1) == b"\x01", "a connection.start method frame"
    # In plain text the same ports speak neither AMQP nor HTTP (a TLS alert, or nothing).
    assert not plain_answer(address, port, AMQP_HEADER).startswith((b"\x01", b"AMQP"))
    assert not plain_answer(address, 15682, b"GET /api/overview HTTP/1.0\r\n\r\n"
                            ).startswith(b"HTTP/")


REGISTRY = "127.0.0.20:5000"
"""The trial cluster's registry (scripts/cluster), on the network every notebook shares."""
MANIFESTS = "application/vnd.docker.distribution.manifest.v2+json"


def registry_call(method: str, path: str, headers: dict[str, str] | None = None
                  ) -> tuple[int, dict[str, str]]:
    request = urllib.request.Request(f"http://{REGISTRY}{path}", method=method,
                                     headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, dict(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers)


def test_the_trial_registry_serves_pulls_but_takes_no_push_or_delete(cluster: Cluster) -> None:
    """What a notebook on the one-machine cluster's network could try against the registry
    its nodes pull from: a pull works, an upload and a delete are refused, and so is a push
    from an engine (only `scripts/cluster push` opens it for writing, while it pushes)."""
    image = cluster.env["SWARM_GPU_IMAGE"]
    name, tag = image.removeprefix(f"{REGISTRY}/").rsplit(":", 1)
    status, headers = registry_call("GET", f"/v2/{name}/manifests/{tag}", {"Accept": MANIFESTS})
    assert status == 200, status
    digest = headers["Docker-Content-Digest"]
    assert registry_call("POST", f"/v2/{name}/blobs/uploads/")[0] == 405
    assert registry_call("DELETE", f"/v2/{name}/manifests/{digest}")[0] == 405
    # A tag of this run's own: the registry's storage outlives `scripts/cluster down`.
    tag = f"trojan-{secrets.token_hex(4)}"
    trojan = f"{REGISTRY}/{name}:{tag}"
    cluster.manager("tag", image, trojan)
    push = cluster.manager("push", trojan, check=False, timeout=300)
    assert push.returncode != 0, push.stdout
    assert registry_call("GET", f"/v2/{name}/manifests/{tag}", {"Accept": MANIFESTS})[0] == 404
    # The script's own push goes through, and the registry is read-only again after it.
    pushed = cluster.script("push", trojan)
    assert pushed.returncode == 0, pushed.stderr
    assert registry_call("GET", f"/v2/{name}/manifests/{tag}", {"Accept": MANIFESTS})[0] == 200
    assert registry_call("POST", f"/v2/{name}/blobs/uploads/")[0] == 405


def test_every_gpu_node_is_up_in_gpu_ledger_status(cluster: Cluster) -> None:
    def both_up() -> dict[str, Any] | None:
        status = cluster.ledger_status()
        up = {h["host"] for h in status["hosts"] if h["up"]}
        return status if up == {"gpu-1", "gpu-2"} else None
    status = eventually(both_up, "gpu-1 and gpu-2 up in gpu-ledger status")
    models = sorted((g["host"], g["model"]) for g in status["gpus"])
    assert models == [("gpu-1", GTX1070), ("gpu-1", GTX1070), ("gpu-2", GTX1070),
                      ("gpu-2", RTX3090)]
    assert all(g["state"] == "free" for g in status["gpus"])
    # The table form, as an admin reads it.
    table = cluster.gpu_ledger("status").stdout
    assert "gpu-1" in table and "gpu-2" in table and RTX3090 in table


def test_rest_spawn_lands_on_the_node_and_gpus_of_its_lease(cluster: Cluster) -> None:
    cluster.user("alice", "staff")
    cluster.spawn("alice", {"mode": "exclusive", "model": "3090"})
    cluster.ready("alice")
    lease_id, node, env = cluster.lease_of("alice")
    assert node == "gpu-2", "the only RTX 3090 is on gpu-2"
    held = eventually(lambda: cluster.lease(lease_id), "alice's lease in the ledger")
    gpu, holder = held
    assert gpu["host"] == "gpu-2" and gpu["model"] == RTX3090 and holder["user"] == "alice"
    assert env["NVIDIA_VISIBLE_DEVICES"] == gpu["uuid"]
    # The task runs on gpu-2's own engine, its container labelled with the lease and given
    # exactly that GPU; the agent there reports it, so the lease is bound.
    container = eventually(lambda: cluster.container_on("gpu-2", lease_id),
                           "alice's container on gpu-2")
    assert cluster.container_on("gpu-1", lease_id) is None
    inspect = json.loads(cluster.docker("gpu-2", "inspect", container).stdout)[0]
    assert f"NVIDIA_VISIBLE_DEVICES={gpu['uuid']}" in inspect["Config"]["Env"]
    assert inspect["Config"]["Labels"][LEASE_LABEL] == lease_id
    eventually(lambda: (cluster.lease(lease_id) or ({}, {}))[1].get("state") == "bound",
               "alice's lease bound")


def test_a_killed_notebook_frees_its_gpu_by_the_agents_event(cluster: Cluster) -> None:
    lease_id, node, _ = cluster.lease_of("alice")
    container = cluster.container_on(node, lease_id)
    assert container is not None
    cluster.docker(node, "kill", container)
    killed = time.monotonic()
    eventually(lambda: cluster.lease(lease_id) is None, "alice's GPU free", interval=0.1)
    print(f"kill to GPU free on {node}: {time.monotonic() - killed:.2f} s")
    assert cluster.free()["gpu-2"] == 2
    cluster.stop("alice")


def test_stopping_the_server_frees_its_gpu(cluster: Cluster) -> None:
    cluster.user("bob", "students")
    cluster.spawn("bob", {"mode": "exclusive", "model": "1070"})
    cluster.ready("bob")
    lease_id, node, env = cluster.lease_of("bob")
    gpu, _ = eventually(lambda: cluster.lease(lease_id), "bob's lease")
    assert gpu["model"] == GTX1070 and gpu["host"] == node
    assert env["NVIDIA_VISIBLE_DEVICES"] == gpu["uuid"]
    cluster.stop("bob")
    eventually(lambda: cluster.lease(lease_id) is None, "bob's GPU free")
    gone = cluster.manager("service", "ls", "-q", "-f", "name=jupyter-bob").stdout.strip()
    assert gone == "", "the notebook service is removed"
    assert cluster.container_on(node, lease_id) is None


def sign_up(browser: Browser, page: str, hub_url: str, name: str) -> str:
    """``name`` signs up at /hub/signup in ``page`` with a new password, which it returns."""
    password = secrets.token_urlsafe(16)
    browser.navigate(page, f"{hub_url}/hub/signup")
    browser.submit(page, f"""
        document.querySelector('#username_input').value = {json.dumps(name)};
        document.querySelector('#password_input').value = {json.dumps(password)};
        document.querySelector('#password_confirmation_input').value =
            {json.dumps(password)};
        document.querySelector('form').submit();
    """)
    return password


def authorize(browser: Browser, admin_page: str, hub_url: str, name: str) -> None:
    """An admin logged in at ``admin_page`` authorizes ``name``'s signup from the list at
    /hub/authorize."""
    browser.navigate(admin_page, f"{hub_url}/hub/authorize")
    browser.submit(admin_page,
                   f"document.querySelector('form[action$=\"/authorize/{name}\"]').submit()")


def test_the_spawn_form_in_chromium(cluster: Cluster, chromium_path: Path,
                                    tmp_path: Path) -> None:
    cluster.user("carol", "students")
    hub_host = urllib.parse.urlsplit(cluster.hub_url).hostname or ""
    with Browser(chromium_path, tmp_path / "chromium", timeout=60,
                 hosts=(hub_host,)) as browser:
        # carol signs up; the first admin, logged in with the password scripts/cluster made,
        # authorizes her from the list at /hub/authorize; then she logs in.
        page = browser.page()
        password = sign_up(browser, page, cluster.hub_url, "carol")
        with Browser(chromium_path, tmp_path / "chromium-admin", timeout=60,
                     hosts=(hub_host,)) as admins_browser:  # cookies of its own
            admin = admins_browser.page()
            admins_browser.log_in(admin, cluster.hub_url, "admin",
                                  cluster.secret("hub-admin-password"))
            authorize(admins_browser, admin, cluster.hub_url, "carol")
        browser.log_in(page, cluster.hub_url, "carol", password)
        browser.navigate(page, f"{cluster.hub_url}/hub/spawn")
        profiles = browser.evaluate(
            page, "[...document.querySelectorAll('input[name=profile]')].map(e => e.value)")
        text = browser.evaluate(page, "document.body.innerText")
        browser.evaluate(page, "document.querySelector('input[name=profile][value=gtx1070]')"
                               ".click()")
        browser.submit(page, "document.querySelector('#spawn_form').requestSubmit()")
        url = browser.url(page)
    # a student sees the GTX 1070 profiles, not the staff ones; the free GPUs are listed
    assert "gtx1070" in profiles and "two-3090" not in profiles, profiles
    assert "gpu-1" in text and "gpu-2" in text, text
    assert "/spawn-pending/carol" in url or "/user/carol" in url, url
    cluster.ready("carol")
    lease_id, node, env = cluster.lease_of("carol")
    gpu, holder = eventually(lambda: cluster.lease(lease_id), "carol's lease")
    assert holder["user"] == "carol" and gpu["model"] == GTX1070 and gpu["host"] == node
    assert env["NVIDIA_VISIBLE_DEVICES"] == gpu["uuid"]
    cluster.stop("carol")
    eventually(lambda: cluster.lease(lease_id) is None, "carol's GPU free")


BOOKING_ZONE = "Europe/Berlin"
"""The bookings' zone: their times are its wall clock (whole hours from UTC, so its whole
minutes are UTC's)."""
EXAM = "DL101 exam"
EXAM_LEAD_S = 15
"""The exam booking's lead: kate, who holds its GPU, is warned this long before it starts."""
BEFORE_LEAD_S = 10
"""At least this long from computing the window to its lead: ``gpu-ledger booking add``."""


def booking_time(instant: float, zone: ZoneInfo) -> str:
    """An instant as a booking's window takes it: local, in whole minutes."""
    return datetime.fromtimestamp(instant, zone).strftime("%Y-%m-%dT%H:%M")


def test_a_class_booking_takes_its_gpu_back_for_a_member_at_the_start(
        cluster: Cluster, chromium_path: Path, tmp_path: Path) -> None:
    """docs/operations.md, "Bookings", with the real clock: the admin books the RTX 3090 for
    a class (``gpu-ledger booking add`` in the allocator's container) while kate, not in
    it, holds it. kate is warned at the lead, naming the booking; liam, in the class, spawns
    through the hub and gets kate's GPU at the start, and kate's notebook is stopped. liam's
    spawn form marks the booked choices, the admin's GPU page shows the week's calendar and
    kate's warning (with SWARM_GPU_UPDATE_DOCS=1 both become the README's pictures).

    Bookings are in whole minutes, so the window starts at the first whole minute that
    leaves time to add it before its lead: the test waits for the lead and up to a minute
    more, and the browsers do their part meanwhile."""
    began = time.monotonic()
    zone = ZoneInfo(BOOKING_ZONE)
    kates_lease, node, _, gpu, _ = cluster.granted("kate", "staff",
                                                   {"mode": "exclusive", "model": "3090"})
    assert node == "gpu-2" and gpu["model"] == RTX3090
    cluster.user("liam", "staff")
    start = math.ceil((time.time() + EXAM_LEAD_S + BEFORE_LEAD_S) / 60) * 60
    today = datetime.fromtimestamp(start, zone).date()
    lab_days = [today + timedelta(days=2), today + timedelta(days=4)]
    added_at = time.time()
    shots = {"form": tmp_path / "bookings-spawn-form.png",
             "calendar": tmp_path / "bookings-calendar.png"}
    hub, hub_host = cluster.hub_url, urllib.parse.urlsplit(cluster.hub_url).hostname or ""
    try:
        added = cluster.admin_gpu_ledger(
            "booking", "add", "--name", EXAM, "--users", "liam,mona", "--model", "3090",
            "--count", "1", "--zone", BOOKING_ZONE, "--once", booking_time(start, zone),
            booking_time(start + 600, zone), "--lead", f"{EXAM_LEAD_S}s", "--by", "admin")
        assert f"booking {EXAM!r} added" in added.stdout, added.stdout
        assert time.time() < start - EXAM_LEAD_S, "the booking was added after its lead"
        # A weekly lab of the students' group, days ahead: for the calendar.
        cluster.admin_gpu_ledger(
            "booking", "add", "--name", "CS101 lab", "--group", "students", "--model", "1070",
            "--count", "2", "--zone", BOOKING_ZONE,
            "--weekly", ",".join(f"{day:%a}".lower() for day in lab_days), "--at", "10:00",
            "--duration", "2h", "--from", f"{lab_days[0]}",
            "--until", f"{lab_days[0] + timedelta(days=14)}", "--by", "admin")
        listed = json.loads(cluster.admin_gpu_ledger("booking", "list", "--json").stdout)
        assert sorted(view["name"] for view in listed) == ["CS101 lab", EXAM], listed

        def warning() -> dict[str, Any] | None:
            events = json.loads(cluster.gpu_ledger(
                "export", "events", "--user", "kate", "--since", f"{added_at:.0f}",
                "--format", "json", "--time-format", "epoch").stdout)
            return next((e for e in events if e["kind"] == "reclaim_warning"
                         and e["lease_id"] == kates_lease), None)
        with Browser(chromium_path, tmp_path / "chromium", timeout=60,
                     hosts=(hub_host,)) as browser, \
                Browser(chromium_path, tmp_path / "chromium-admin", timeout=60,
                        hosts=(hub_host,)) as admins_browser:
            page, admin = browser.page(), admins_browser.page()
            password = sign_up(browser, page, hub, "liam")
            admins_browser.log_in(admin, hub, "admin", cluster.secret("hub-admin-password"))
            authorize(admins_browser, admin, hub, "liam")
            browser.log_in(page, hub, "liam", password)
            browser.navigate(page, f"{hub}/hub/spawn")
            form = str(browser.evaluate(page, "document.body.innerText"))
            browser.screenshot(page, shots["form"], full_page=True)
            warned = eventually(warning, "kate warned for the booking",
                                within=start - time.time() + WITHIN_S)
            admins_browser.navigate(admin, f"{hub}/services/gpu/")
            page_text = str(admins_browser.evaluate(admin, "document.body.innerText"))
            admins_browser.screenshot(admin, shots["calendar"], full_page=True)
        assert f"booked for {EXAM}" in form, form
        assert start - EXAM_LEAD_S - 1 <= warned["at"] < start, (warned, start)
        assert warned["detail"]["booking"] == EXAM, warned
        assert warned["detail"]["reclaim_at"] == start, warned
        assert "Bookings this week" in page_text and "CS101 lab" in page_text, page_text
        assert EXAM in page_text and "liam, mona" in page_text, page_text
        for name, shot in shots.items():
            assert shot.stat().st_size > 10_000, name
            if os.environ.get("SWARM_GPU_UPDATE_DOCS") == "1":
                shutil.copyfile(shot, REPO_ROOT / "docs" / shot.name)

        # liam asks (before the start unless the browsers took long): granted at the start.
        asked = time.time()
        cluster.spawn("liam", {"mode": "exclusive", "model": "3090"})
        cluster.ready("liam")
        ready = time.time()
        liams_lease, liams_node, env = cluster.lease_of("liam")
        liams_gpu, _ = eventually(lambda: cluster.lease(liams_lease), "liam's lease")
        assert liams_node == "gpu-2" and liams_gpu["uuid"] == gpu["uuid"]
        assert env["NVIDIA_VISIBLE_DEVICES"] == gpu["uuid"]
        leases = {row["lease_id"]: row for row in json.loads(cluster.gpu_ledger(
            "export", "leases", "--since", f"{added_at:.0f}", "--format", "json",
            "--time-format", "epoch").stdout)}
        assert leases[liams_lease]["granted_at"] >= start, leases[liams_lease]
        kates = leases[kates_lease]
        assert kates["release_reason"] == "reclaimed" and kates["released_at"] >= start, kates
        assert cluster.container_on("gpu-2", kates_lease) is None
        print(f"liam asked {asked - start:+.1f} s from the window's start, his server was "
              f"ready {ready - start:.1f} s after it; "
              f"waited for the window (lead {EXAM_LEAD_S} s, whole minutes): "
              f"{start - added_at:.0f} s; the whole test: {time.monotonic() - began:.0f} s")
    finally:
        for name in (EXAM, "CS101 lab"):
            cluster.admin_gpu_ledger("booking", "remove", name, "--by", "admin", check=False)
        cluster.stop("liam")
        cluster.stop("kate")  # the hub's record of it: the reclaim stopped the container
    assert json.loads(cluster.admin_gpu_ledger("booking", "list", "--json").stdout) == []
    eventually(lambda: cluster.free() == {"gpu-1": 2, "gpu-2": 2}, "every GPU free")


UPGRADED_VERSION_SUFFIX = "+upgrade"
"""What the second image's allocator.__version__ adds to the package's version."""


def upgraded_image(cluster: Cluster, context: Path) -> tuple[str, str]:
    """(tag, version) of a second build of the stack's image, pushed to the cluster's
    registry: the same code with another ``allocator.__version__``, as a new release is to
    Swarm (a new image reference for ``docker service update --image``)."""
    image = cluster.env["SWARM_GPU_IMAGE"]
    version = image.rsplit(":", 1)[1] + UPGRADED_VERSION_SUFFIX
    tag = f"{image}-upgrade"
    context.mkdir()
    (context / "Dockerfile").write_text(
        f"FROM {image}\nUSER root\n"
        f"RUN sed -i 's/^__version__ = .*/__version__ = \"{version}\"/' "
        "\"$(python3 -c 'import allocator; print(allocator.__file__)')\"\n"
        "USER swarm-gpu\n")
    cluster.manager("build", "-q", "-t", tag, str(context), timeout=300)
    pushed = cluster.script("push", tag)  # the registry takes pushes from the script only
    assert pushed.returncode == 0, pushed.stderr
    return tag, version


@dataclass
class AllocatorLoad:
    """Allocate-and-release cycles against the allocator, through the broker as the hub makes
    them (the hub's broker user), from threads of this process while the test does something
    else. A call with no answer is asked again with the same request key (an allocate is
    idempotent by its key, a release harmless twice), as the spawner does."""

    amqp_url: str
    avoid: set[str]
    """GPUs held by leases outside this load: granting one of them is a doubled lease."""
    answered: list[tuple[float, str]] = dataclass_field(default_factory=list)
    """(when, what) of each answered call."""
    retried: int = 0
    doubled: list[str] = dataclass_field(default_factory=list)
    unanswered: list[str] = dataclass_field(default_factory=list)
    granted: set[str] = dataclass_field(default_factory=set)
    _held: dict[str, str] = dataclass_field(default_factory=dict)
    _lock: threading.Lock = dataclass_field(default_factory=threading.Lock)
    _stop: threading.Event = dataclass_field(default_factory=threading.Event)
    _threads: list[threading.Thread] = dataclass_field(default_factory=list)

    def start(self, workers: int) -> None:
        for worker in range(workers):
            thread = threading.Thread(target=asyncio.run, args=(self._cycles(worker),),
                                      name=f"allocator-load-{worker}")
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=WITHIN_S * 2)
            assert not thread.is_alive(), f"{thread.name} did not finish"

    async def _answer(self, what: str, call: Callable[[], Awaitable[T]]) -> T | None:
        """The answer to ``call``, asked again while none comes (None: none within
        WITHIN_S); a refusal is an answer too, raised as AllocatorError."""
        deadline = time.monotonic() + WITHIN_S
        while True:
            try:
                answer = await call()
            except AllocatorError as exc:
                if not isinstance(exc, AllocatorTimeout | AllocatorUnavailable):
                    with self._lock:
                        self.answered.append((time.monotonic(), f"{what}: refused"))
                    raise
                if time.monotonic() > deadline:
                    self.unanswered.append(f"{what}: {exc}")
                    return None
                with self._lock:
                    self.retried += 1
                continue
            with self._lock:
                self.answered.append((time.monotonic(), what))
            return answer

    async def _cycles(self, worker: int) -> None:
        async with AllocatorClient(self.amqp_url, timeout_s=10) as client:
            cycle = 0
            while not self._stop.is_set():
                key = f"upgrade/load-{worker}/{cycle}"
                cycle += 1
                request = AllocateRequest(request_key=key, user=f"load-{worker}", model="1070")
                try:
                    lease = await self._answer(f"allocate {key}",
                                               functools.partial(client.allocate, request))
                except AllocatorError:  # an answer: a refusal (no GPU free just now)
                    await asyncio.sleep(0.5)
                    continue
                if lease is None:
                    return
                with self._lock:
                    self.granted.add(lease.lease_id)
                    for uuid in lease.gpu_uuids:
                        holder = self._held.get(uuid) or ("outside the load"
                                                          if uuid in self.avoid else None)
                        if holder is not None:
                            self.doubled.append(f"{uuid}: {lease.lease_id} and {holder}")
                        self._held[uuid] = lease.lease_id
                await asyncio.sleep(0.2)
                with self._lock:  # given up before the release is sent: no false doubles
                    for uuid in lease.gpu_uuids:
                        self._held.pop(uuid, None)
                if await self._answer(f"release {lease.lease_id}", functools.partial(
                        client.release, lease_id=lease.lease_id, reason="load")) is None:
                    return


def running_images(cluster: Cluster, service: str) -> dict[str, str]:
    """node -> the image reference of the running task of ``service`` there."""
    found = {}
    for line in cluster.manager("service", "ps", "--filter", "desired-state=running",
                                "--format", "{{.Node}} {{.Image}} {{.CurrentState}}",
                                f"{cluster.stack}_{service}").stdout.splitlines():
        node, image, state = line.split()[:3]
        if state == "Running":
            found[node] = image
    return found


def test_a_rolling_update_to_a_new_image_under_load_keeps_every_lease(
        cluster: Cluster, tmp_path: Path) -> None:
    """The upgrade as docs/operations.md has it: a new image, ``docker service update
    --image`` of the allocator (one replica at a time, the other taking over) and then of the
    agents, while allocate/release calls keep coming. No lease is lost (a notebook's stays
    bound on its GPU), none is doubled (no GPU granted twice at once), every call is
    answered, some only when asked again; the ledger checks clean afterwards."""
    cluster.user("dave", "students")
    cluster.spawn("dave", {"mode": "exclusive", "model": "1070"})
    cluster.ready("dave")
    lease_id, _, _ = cluster.lease_of("dave")
    eventually(lambda: (cluster.lease(lease_id) or ({}, {}))[1].get("state") == "bound",
               "dave's lease bound")
    daves_gpu, _ = cluster.lease(lease_id) or ({}, {})
    image, version = upgraded_image(cluster, tmp_path / "upgrade")
    before = set(cluster.allocators().values())
    address = cluster.env["SWARM_GPU_MANAGER_ADDR"]
    load = AllocatorLoad(
        f"amqps://hub:{cluster.secret('broker-passwords/hub')}@{address}:"
        f"{cluster.env['SWARM_GPU_BROKER_PORT']}/swarm-gpu?cafile={cluster.broker_ca}",
        avoid={daves_gpu["uuid"]})
    load.start(workers=2)
    try:
        eventually(lambda: len(load.answered) >= 4, "the load's first calls answered")
        updating = time.monotonic()
        for service in ("allocator", "nodeagent"):
            cluster.manager("service", "update", "--image", image, "--detach=false", "--quiet",
                            f"{cluster.stack}_{service}", timeout=600)
        updated = time.monotonic()
        eventually(lambda: len([t for t, _ in load.answered if t > updated]) >= 4,
                   "the load's calls answered after the update")
    finally:
        load.stop()
    during = [what for when, what in load.answered if updating <= when <= updated]
    print(f"rolling update of allocator and agents: {updated - updating:.0f} s; "
          f"{len(load.answered)} calls answered ({len(during)} during the update), "
          f"{load.retried} asked again")
    assert load.unanswered == [] and load.doubled == []
    assert during, "calls were answered while the replicas were replaced"
    # Every replica and agent runs the new image, the new version in it.
    assert running_images(cluster, "allocator") == {node: image for node in ALLOCATOR_NODES}
    assert running_images(cluster, "nodeagent") == {"gpu-1": image, "gpu-2": image}
    replaced = cluster.allocators()
    assert set(replaced) == ALLOCATOR_NODES and not before & set(replaced.values())
    for node, container in replaced.items():
        said = cluster.docker(node, "exec", container, "python3", "-c",
                              "import allocator; print(allocator.__version__)").stdout.strip()
        assert said == version, (node, said)
    # dave's lease kept, on its GPU; every lease of the load released; nothing held twice.
    gpu, holder = eventually(lambda: cluster.lease(lease_id), "dave's lease after the update")
    assert holder["user"] == "dave" and holder["state"] == "bound"
    assert gpu["uuid"] == daves_gpu["uuid"]
    eventually(lambda: not lease_ids(cluster.ledger_status()) & load.granted,
               "every lease of the load released")
    status = cluster.ledger_status()
    assert {u: ids for u, ids in exclusive_holders(status).items() if len(ids) > 1} == {}
    check = cluster.gpu_ledger("check", check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    # the next spawn is served by the new replicas
    cluster.user("ellen", "staff")  # students may hold 1 GPU at once (allocator.toml)
    cluster.spawn("ellen", {"mode": "exclusive", "model": "1070"})
    cluster.ready("ellen")
    ellens_lease, _, _ = cluster.lease_of("ellen")
    ellens_gpu, _ = eventually(lambda: cluster.lease(ellens_lease), "ellen's lease")
    assert ellens_gpu["uuid"] != gpu["uuid"]
    cluster.stop("ellen")
    cluster.stop("dave")
    eventually(lambda: cluster.free() == {"gpu-1": 2, "gpu-2": 2}, "every GPU free")


def test_a_worker_engine_stopped_and_started_its_leases_follow_what_runs(
        cluster: Cluster) -> None:
    cluster.user("frank", "students")
    cluster.spawn("frank", {"mode": "exclusive", "model": "1070", "host": "gpu-1"})
    cluster.ready("frank")
    lease_id, node, _ = cluster.lease_of("frank")
    assert node == "gpu-1"
    eventually(lambda: (cluster.lease(lease_id) or ({}, {}))[1].get("state") == "bound",
               "frank's lease bound")
    stop = cluster.script("stop-node", "gpu-1")
    assert stop.returncode == 0, stop.stderr
    start = cluster.script("start-node", "gpu-1")
    assert start.returncode == 0, start.stderr
    # The engine came back without frank's container (Swarm does not restart a notebook
    # task: restart condition none); the agent, restarted by Swarm, reports what runs there.
    assert cluster.container_on("gpu-1", lease_id) is None
    eventually(lambda: cluster.lease(lease_id) is None, "frank's GPU free after the restart")

    def gpu1_up() -> bool:
        return any(h["host"] == "gpu-1" and h["up"] for h in cluster.ledger_status()["hosts"])
    eventually(gpu1_up, "gpu-1 up again")
    cluster.stop("frank")
    # and the node takes new work
    cluster.spawn("frank", {"mode": "exclusive", "model": "1070", "host": "gpu-1"})
    cluster.ready("frank")
    lease_id, node, _ = cluster.lease_of("frank")
    assert node == "gpu-1" and cluster.lease(lease_id) is not None
    cluster.stop("frank")
    eventually(lambda: cluster.lease(lease_id) is None, "frank's GPU free")


def test_stack_rm_and_deploy_again_keeps_the_leases_in_the_ledger_volume(
        cluster: Cluster) -> None:
    cluster.user("grace", "staff")
    cluster.spawn("grace", {"mode": "exclusive", "model": "1070"})
    cluster.ready("grace")
    lease_id, node, _ = cluster.lease_of("grace")
    eventually(lambda: (cluster.lease(lease_id) or ({}, {}))[1].get("state") == "bound",
               "grace's lease bound")
    cluster.manager("stack", "rm", cluster.stack)

    def stack_gone() -> bool:
        names = cluster.manager("ps", "-a", "--format", "{{.Names}}").stdout.split()
        return not [n for n in names if n.startswith(f"{cluster.stack}_")]
    eventually(stack_gone, "the stack's containers gone")
    for replica_node in ALLOCATOR_NODES:  # each replica's own copy of the ledger
        volumes = cluster.docker(replica_node, "volume", "ls", "--format",
                                 "{{.Name}}").stdout.split()
        assert f"{cluster.stack}_ledger" in volumes, replica_node
    deploy = cluster.script("deploy")
    assert deploy.returncode == 0, deploy.stderr
    gpu, holder = eventually(lambda: cluster.lease(lease_id), "grace's lease after the deploy")
    assert holder["user"] == "grace" and gpu["host"] == node
    # grace's notebook kept running through it; the hub (its volume too) still stops it
    assert cluster.container_on(node, lease_id) is not None
    eventually(lambda: cluster.lease(lease_id)[1]["state"] == "bound",  # type: ignore[index]
               "grace's lease bound again")
    cluster.stop("grace")
    eventually(lambda: cluster.lease(lease_id) is None, "grace's GPU free")


def exclusive_holders(status: dict[str, Any]) -> dict[str, list[str]]:
    """GPU uuid -> lease ids of its exclusive holders, from gpu-ledger status."""
    return {gpu["uuid"]: [h["lease_id"] for h in gpu["holders"] if not h.get("shared")]
            for gpu in status["gpus"]}


def lease_ids(status: dict[str, Any]) -> set[str]:
    return {h["lease_id"] for gpu in status["gpus"] for h in gpu["holders"]}


def test_the_active_allocators_node_stopped_the_other_replica_serves_the_whole_ledger(
        cluster: Cluster) -> None:
    """The replicas on two nodes, each on its own ledger volume (the replicated ledger log):
    the node of the active one stops (its engine, its containers, its ledger volume out of
    reach); the replica on the other node takes over with every lease, grants a new spawn,
    and no GPU is held twice. The stopped node comes back and its replica catches up."""
    active_node, active = cluster.active_allocator()
    (standby_node,) = ALLOCATOR_NODES - {active_node}
    standby = cluster.allocators()[standby_node]
    epoch = cluster.writer_epoch(active_node, active)
    assert epoch is not None
    # A notebook on each replica's node: kept (the survivor's) and lost with its node.
    cluster.user("henry", "staff")
    cluster.spawn("henry", {"mode": "exclusive", "model": "1070", "host": standby_node})
    cluster.user("iris", "staff")
    cluster.spawn("iris", {"mode": "exclusive", "model": "1070", "host": active_node})
    cluster.ready("henry")
    cluster.ready("iris")
    kept, _, _ = cluster.lease_of("henry")
    lost, _, _ = cluster.lease_of("iris")
    def bound(lease_id: str) -> bool:
        return (cluster.lease(lease_id) or ({}, {}))[1].get("state") == "bound"
    eventually(lambda: bound(kept) and bound(lost), "henry's and iris's leases bound")
    # The standby's own copy already holds both (applied from the log, not shared).
    before = cluster.ledger_status()
    eventually(lambda: lease_ids(cluster.ledger_status(on=(standby_node, standby)))
               >= {kept, lost}, "the standby's ledger holding both leases")

    stopping = time.monotonic()
    stop = cluster.script("stop-node", active_node)
    assert stop.returncode == 0, stop.stderr
    stopped_s = time.monotonic() - stopping
    try:
        def took_over() -> bool:
            claimed = cluster.writer_epoch(standby_node, standby)
            return claimed is not None and claimed > epoch
        eventually(took_over, f"the replica on {standby_node} the writer")
        print(f"stop-node {active_node} took {stopped_s:.1f} s; from its start to the replica "
              f"on {standby_node} writing: {time.monotonic() - stopping:.1f} s (measured "
              "by polling logs, an upper bound)")
        assert cluster.active_allocator() == (standby_node, standby)
        # Every lease granted before is known, on the GPU it had (the lost node's lease
        # stays until its node has been silent for stop_grace_s, then node_silent).
        exported = json.loads(cluster.gpu_ledger("export", "leases", "--format", "json").stdout)
        for lease_id in (kept, lost):
            was = [g["uuid"] for g in before["gpus"]
                   if lease_id in {h["lease_id"] for h in g["holders"]}]
            (row,) = [r for r in exported if r["lease_id"] == lease_id]
            assert sorted(row["gpu_uuids"]) == sorted(was), row
        gpu, holder = eventually(lambda: cluster.lease(kept), "henry's lease after takeover")
        assert holder["state"] == "bound" and gpu["host"] == standby_node
        # A new spawn is served by the replica that took over.
        cluster.user("jack", "staff")
        model = "3090" if standby_node == "gpu-2" else "1070"
        cluster.spawn("jack", {"mode": "exclusive", "model": model, "host": standby_node})
        cluster.ready("jack")
        new, node, _ = cluster.lease_of("jack")
        assert node == standby_node
        new_gpu, _ = eventually(lambda: cluster.lease(new), "jack's lease")
        status = cluster.ledger_status()
        double_booked = {u: ids for u, ids in exclusive_holders(status).items() if len(ids) > 1}
        assert double_booked == {}
        held_before = {g["uuid"] for g in before["gpus"]
                       if {h["lease_id"] for h in g["holders"]} & {kept, lost}}
        assert new_gpu["uuid"] not in held_before
        check = cluster.gpu_ledger("check", check=False)
        assert check.returncode == 0, check.stdout + check.stderr
        cluster.stop("jack")
        cluster.stop("henry")
    finally:
        start = cluster.script("start-node", active_node)
        assert start.returncode == 0, start.stderr
    # The node is back: its replica (its own volume) caught up from the log.
    cluster.stop("iris")
    back = cluster.allocators()
    assert set(back) == ALLOCATOR_NODES, back
    def holders(status: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
        return {gpu["uuid"]: gpu["holders"] for gpu in status["gpus"]}
    eventually(lambda: holders(cluster.ledger_status(on=(active_node, back[active_node])))
               == holders(cluster.ledger_status()), f"the replica on {active_node} caught up")
    eventually(lambda: cluster.free() == {"gpu-1": 2, "gpu-2": 2}, "every GPU free")


def test_a_missing_label_or_node_password_is_told_in_the_service_state(
        cluster: Cluster) -> None:
    """docs/operations.md, Troubleshooting: `docker service ps --no-trunc` names it."""
    agent = f"{cluster.stack}_nodeagent"
    password = cluster.dir / "nodes" / "gpu-2" / "agent-password"
    aside = password.with_name("agent-password.aside")
    password.rename(aside)
    try:
        cluster.manager("service", "update", "--force", "--detach", agent)

        def refused() -> str | None:
            errors = cluster.manager("service", "ps", "--no-trunc", "--format",
                                     "{{.Node}} {{.Error}}", agent).stdout
            lines = [line for line in errors.splitlines()
                     if line.startswith("gpu-2 ") and "agent-password" in line]
            return lines[0] if lines else None
        error = eventually(refused, "the agent's task on gpu-2 refused")
        assert "bind source path does not exist" in error, error
    finally:
        aside.rename(password)
    # The refused update is paused (the stack's failure_action), and the CLI's watch of the
    # next one may still read that pause, or a task of the refused update ending, before the
    # new update's own state: ask again then (at most twice); a failure of the new update
    # itself pauses it again, every time, and fails here.
    for attempt in range(3):
        restored = cluster.manager("service", "update", "--force", "--detach=false", "--quiet",
                                   agent, timeout=300, check=attempt == 2)
        if restored.returncode == 0:
            break
        assert "update paused" in restored.stderr, restored.stderr

    allocator = f"{cluster.stack}_allocator"
    # Without their label the allocator's nodes no longer meet the constraint: Swarm stops
    # the replicas and keeps the new tasks pending, saying why.
    for replica_node in sorted(ALLOCATOR_NODES):
        cluster.manager("node", "update", "--label-rm", "swarm-gpu.allocator", replica_node)
    try:
        def pending() -> str | None:
            errors = cluster.manager("service", "ps", "--no-trunc", "--format",
                                     "{{.CurrentState}} {{.Error}}", allocator).stdout
            lines = [line for line in errors.splitlines() if line.startswith("Pending")
                     and "scheduling constraints not satisfied" in line]
            return lines[0] if lines else None
        state = eventually(pending, "the allocator's task pending, saying why")
        assert "no suitable node" in state, state
    finally:
        for replica_node in sorted(ALLOCATOR_NODES):
            cluster.manager("node", "update", "--label-add", "swarm-gpu.allocator=true",
                            replica_node)
    deploy = cluster.script("deploy")
    assert deploy.returncode == 0, deploy.stderr


def test_back_up_and_restore_as_the_operations_guide_says(cluster: Cluster,
                                                          tmp_path: Path) -> None:
    """docs/operations.md, "Back up and restore the ledger", step by step on the stack: a
    backup taken from the running allocator with `docker exec … gpu-ledger backup` and
    `docker cp`; a lease granted after it; then the restore of one replica's volume with the
    replicated log kept (step 4's first case): allocator scaled to 0, `gpu-ledger restore`
    and `gpu-ledger check` in a container on the node's ledger volume, scaled back to 2.
    The restored replica catches up from the backup's position: it holds both leases."""
    stack, image = cluster.stack, cluster.env["SWARM_GPU_IMAGE"]
    allocator = f"{stack}_allocator"
    before_id, _, _, _, _ = cluster.granted("gina", "students",
                                            {"mode": "exclusive", "model": "1070"})
    node, container = cluster.active_allocator()
    cluster.docker(node, "exec", container, "gpu-ledger", "backup", "--force",
                   "/tmp/ledger-backup.sqlite")
    backup = tmp_path / "ledger-backup.sqlite"
    cluster.docker(node, "cp", f"{container}:/tmp/ledger-backup.sqlite", str(backup))
    cluster.docker(node, "exec", container, "rm", "/tmp/ledger-backup.sqlite")
    backup.chmod(0o644)
    tmp_path.chmod(0o755)  # the image's user (uid 10001) reads it through the bind mount
    after_id, _, _, _, _ = cluster.granted("hank", "staff", {"mode": "exclusive",
                                                             "model": "1070"})
    restored_node = sorted(ALLOCATOR_NODES)[0]
    cluster.manager("service", "scale", "--detach=false", f"{allocator}=0", timeout=300)
    eventually(lambda: not cluster.allocators(), "no allocator task running")
    # As the guide's commands, with --network none: these engines have no bridge network.
    run = ("run", "--rm", "--network", "none", "-v", f"{stack}_ledger:/var/lib/swarm-gpu")
    restored = cluster.docker(restored_node, *run, "-v", f"{tmp_path}:/backup:ro", image,
                              "gpu-ledger", "restore", f"/backup/{backup.name}", timeout=300)
    assert "position kept" in restored.stdout + restored.stderr, restored
    checked = cluster.docker(restored_node, *run, image, "gpu-ledger", "check", timeout=300)
    assert checked.stdout.startswith("ok:"), checked
    cluster.manager("service", "scale", "--detach=false", f"{allocator}=2", timeout=600)
    replicas = eventually(lambda: cluster.allocators() if set(cluster.allocators())
                          == ALLOCATOR_NODES else None, "both allocator replicas back")
    on = (restored_node, replicas[restored_node])

    def both_leases_held() -> bool:
        held = {holder["lease_id"] for gpu in cluster.ledger_status(on=on)["gpus"]
                for holder in gpu["holders"]}
        return {before_id, after_id} <= held
    eventually(both_leases_held, "the restored replica holding the lease granted after "
               "the backup (caught up from the log)")
    assert cluster.gpu_ledger("check", on=on).stdout.startswith("ok:")
    cluster.stop("gina")
    cluster.stop("hank")
    eventually(lambda: cluster.free() == {"gpu-1": 2, "gpu-2": 2}, "every GPU free")


def test_no_container_of_the_stack_logged_a_password_or_token(cluster: Cluster) -> None:
    """Last in the module, so it reads the logs of the whole run: every container of the
    stack on every node, those of replaced tasks included (a broker, allocator, agent or hub
    that logged a broker URL with its password, a token or the hub admin's password would
    hand it to whoever reads the logs)."""
    secrets_dir = cluster.dir / "secrets"
    credentials = {path.relative_to(secrets_dir).as_posix(): path.read_text().strip()
                   for path in [*secrets_dir.glob("broker-passwords/*"),
                                secrets_dir / "hub-admin-password",
                                secrets_dir / "hub-api-token", secrets_dir / "metrics-token"]}
    assert len(credentials) >= 8 and all(len(value) >= 16 for value in credentials.values())
    read = 0
    for node in NODES:
        containers = cluster.docker(node, "ps", "-aq", "--filter",
                                    f"label=com.docker.stack.namespace={cluster.stack}",
                                    timeout=60).stdout.split()
        for container in containers:
            logs = cluster.docker(node, "logs", container, timeout=120, check=False)
            text = logs.stdout + logs.stderr
            read += len(text)
            leaked = sorted(name for name, value in credentials.items() if value in text)
            assert not leaked, f"container {container} on {node} logged {leaked}"
    assert read > 10_000, f"only {read} characters of logs read: the logs were not found"
