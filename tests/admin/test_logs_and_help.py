"""Logs and the admin's command line: text or JSON lines, never a password; ``--help`` lists
every setting; a start that cannot work says what to fix in one line.

The JSON lines and the password guard are checked in this process through the real logging
module, and end to end on a real allocator process (the real broker, a broker user with a
password of this test's own, DEBUG level) through its start and a request. The start-up
failures run the console script against the real broker as an admin would meet them (bad
settings: tests/admin/test_settings.py), and a node agent logs the allocator's line for a missing
vhost. The simulated inventory's example in docs/operations.md is
read by the agent's own parser.
"""

from __future__ import annotations

import datetime
import io
import json
import logging
import os
import re
import subprocess
import sys
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from allocator.admin.cli import main as allocator_main
from allocator.amqp.client import AllocatorClient, AllocatorError
from allocator.config import AllocatorSettings
from allocator.logs import (
    CONTEXT_FIELDS,
    JUPYTERHUB_JSON_LOGGING,
    LogFormat,
    configure_logging,
    hide_passwords,
)
from allocator.settings_files import setting_environment
from allocator.wire.protocol import AllocateRequest
from nodeagent.cli import main as agent_main
from nodeagent.config import AgentSettings
from nodeagent.simulated import make_gpu, parse_inventory, write_inventory
from tests.support import services
from tests.support.faults import AllocatorProcess, allocator_env
from tests.support.ports import free_port
from tests.support.services import REPO_ROOT

SECRET = "s3cr3t-" + uuid.uuid4().hex[:12]


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """The root logger sent to a buffer by :func:`configure_logging`, put back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    stream = io.StringIO()
    try:
        yield stream
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(level)
        logging.captureWarnings(False)


def test_json_lines_carry_timestamp_level_logger_message_and_the_context(
        captured: io.StringIO) -> None:
    configure_logging("INFO", "json", stream=captured)
    log = logging.getLogger("allocator.test")
    log.info("granted %d GPU(s)", 2, extra={"lease_id": "L-1", "host": "gpu-a", "user": "alice"})
    log.debug("not written at INFO")
    log.warning("no context")
    lines = [json.loads(line) for line in captured.getvalue().splitlines()]
    assert len(lines) == 2, lines
    first, second = lines
    assert first["message"] == "granted 2 GPU(s)"
    assert (first["level"], first["logger"]) == ("INFO", "allocator.test")
    assert {key: first[key] for key in CONTEXT_FIELDS} == {
        "lease_id": "L-1", "host": "gpu-a", "user": "alice"}
    stamp = datetime.datetime.fromisoformat(first["timestamp"].replace("Z", "+00:00"))
    assert stamp.utcoffset() == datetime.timedelta(0)
    assert abs(stamp.timestamp() - datetime.datetime.now(datetime.UTC).timestamp()) < 60
    assert set(second) == {"timestamp", "level", "logger", "message"}, second


def test_text_lines_are_the_format_of_0_1_0(captured: io.StringIO) -> None:
    configure_logging("debug", "text", stream=captured)
    logging.getLogger("nodeagent").debug("heartbeat %d", 7, extra={"lease_id": "L-1"})
    line = captured.getvalue().rstrip("\n")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} DEBUG nodeagent: heartbeat 7",
                        line), line


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_a_url_password_is_never_written(captured: io.StringIO, log_format: LogFormat) -> None:
    configure_logging("DEBUG", log_format, stream=captured)
    log = logging.getLogger("allocator.test")
    url = f"amqp://allocator:{SECRET}@node1:5672,node2:5672/swarm"
    log.info("connecting to %s", url)
    log.info("in a field", extra={"host": url})
    try:
        raise ConnectionError(f"cannot reach {url}")
    except ConnectionError:
        log.exception("failed")
    written = captured.getvalue()
    assert SECRET not in written
    # In the message and the exception; in JSON also in the field (text shows no fields).
    hidden = {"text": 2, "json": 3}[log_format]
    assert written.count("amqp://allocator:***@node1:5672,node2:5672/swarm") == hidden, written


def test_hide_passwords_leaves_urls_without_one_alone() -> None:
    text = "http://127.0.0.1:9465/metrics amqp://guest@h/ and http://host:8080/a@b"
    assert hide_passwords(text) == text
    assert hide_passwords("x amqps://u:p%40ss@h:5671/v?cafile=/c.pem y") == \
        "x amqps://u:***@h:5671/v?cafile=/c.pem y"


# ----------------------------------------------------------------------------- --help


def help_text(main: Callable[[list[str]], object], args: list[str],
              capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """What a console script's ``main(args + ["--help"])`` prints, without its white space
    (argparse wraps where it likes, hyphenated words included)."""
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as exited:
        main([*args, "--help"])
    assert exited.value.code == 0
    return squeezed(capsys.readouterr().out)


def squeezed(text: str) -> str:
    return "".join(text.split())


def test_allocator_serve_help_lists_every_setting_with_default_environment_and_description(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    text = help_text(allocator_main, ["serve"], capsys, monkeypatch)
    for name, info in AllocatorSettings.model_fields.items():
        assert info.description, f"setting {name} has no description for --help"
        environment = setting_environment(AllocatorSettings, name)
        assert squeezed(f"{name} {info.description} (default: ") in text, name
        assert squeezed(f"environment: {environment})") in text, name
    assert squeezed("(default: 180; environment: SWARM_GPU_BROKER_WAIT_S)") in text


def test_agent_help_gives_each_flag_its_setting_default_and_environment(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    text = help_text(agent_main, [], capsys, monkeypatch)
    for name, info in AgentSettings.model_fields.items():
        assert info.description, f"setting {name} has no description for --help"
        environment = setting_environment(AgentSettings, name)
        assert f"--{name.replace('_', '-')}" in text, name
        assert squeezed(f"{info.description} (default: ") in text, name
        assert squeezed(f"environment: {environment})") in text, name
    assert squeezed("(default: 5; environment: SWARM_GPU_AGENT_INTERVAL_S)") in text


# ----------------------------------------------------------------------------- start-up


def test_every_start_up_failure_is_one_line_that_says_what_to_fix(
        rabbitmq: services.RabbitMQ, tmp_path: Path) -> None:
    broker = f"{rabbitmq.host}:{rabbitmq.port}"
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not a ledger" * 100)
    missing_vhost = f"{services.VHOST_PREFIX}{os.getpid()}-missing-{uuid.uuid4().hex[:6]}"
    cases = {
        "vhost": (f"amqp://{rabbitmq.user}:{rabbitmq.password}@{broker}/{missing_vhost}",
                  {}, [f"refused to open vhost '{missing_vhost}'", "does not exist",
                       "check the vhost in amqp_url"]),
        "password": (f"amqp://{rabbitmq.user}:{SECRET}@{broker}/", {},
                     [f"refused the login of user '{rabbitmq.user}'",
                      "check the user and password of amqp_url"]),
        "unreachable": (f"amqp://guest:{SECRET}@127.0.0.1:{free_port()}/", {},
                        ["cannot reach the broker", "broker_wait_s = 0 s",
                         "check the host and port of amqp_url"]),
        "ledger": (f"amqp://guest:{SECRET}@127.0.0.1:{free_port()}/",
                   {"ledger_path": str(garbage)}, ["is not a readable ledger", "restore it"]),
    }
    running = {}
    for case, (url, settings, _) in cases.items():
        ledger = settings.pop("ledger_path", tmp_path / f"{case}.sqlite")
        env = allocator_env(url, Path(ledger), broker_wait_s=0, **settings)
        running[case] = subprocess.Popen(
            [sys.executable, "-m", "allocator.admin.cli", "serve"], cwd=REPO_ROOT, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for case, process in running.items():
        stdout, stderr = process.communicate(timeout=120)
        lines = stderr.strip().splitlines()
        assert process.returncode == 1, (case, stderr)
        assert len(lines) == 1 and lines[0].startswith("gpu-allocator: "), (case, stderr)
        assert "Traceback" not in stderr and SECRET not in stderr + stdout, (case, stderr)
        for words in cases[case][2]:
            assert words in lines[0], (case, words, lines[0])


def test_the_agent_says_a_missing_vhost_in_the_allocators_line(
        rabbitmq: services.RabbitMQ, tmp_path: Path) -> None:
    """A node agent does not exit on a broker it cannot use (it retries), but the line it logs
    for a missing vhost is the allocator's start-up line, not aiormq's frame error."""
    missing_vhost = f"{services.VHOST_PREFIX}{os.getpid()}-missing-{uuid.uuid4().hex[:6]}"
    url = (f"amqp://{rabbitmq.user}:{rabbitmq.password}@{rabbitmq.host}:{rabbitmq.port}/"
           f"{missing_vhost}")
    host = f"vhost-node-{uuid.uuid4().hex[:6]}"
    inventory = tmp_path / "inventory.json"
    write_inventory(inventory, {host: [make_gpu(host, 0, "NVIDIA GeForce GTX 1070")]})
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_GPU_AGENT_")}
    env["PYTHONUNBUFFERED"] = "1"
    agent_log = tmp_path / "agent.log"
    with open(agent_log, "wb") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", "nodeagent", "--host", host, "--amqp-url", url,
             "--inventory", "simulated", "--simulated-file", str(inventory), "--no-docker",
             "--metrics-port", "0", "--amqp-reconnect-s", "0.2"],
            cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
            stderr=subprocess.STDOUT)
    try:
        allocator = subprocess.run(
            [sys.executable, "-m", "allocator.admin.cli", "serve"], cwd=REPO_ROOT,
            env=allocator_env(url, tmp_path / "ledger.sqlite", broker_wait_s=0),
            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
        assert allocator.returncode == 1, allocator.stderr
        line = allocator.stderr.strip().removeprefix("gpu-allocator: ")
        assert f"refused to open vhost '{missing_vhost}'" in line, allocator.stderr
        deadline = time.monotonic() + 30
        while f"broker: connect failed: {line}" not in agent_log.read_text():
            assert agent.poll() is None, agent_log.read_text()[-3000:]
            assert time.monotonic() < deadline, agent_log.read_text()[-3000:]
            time.sleep(0.1)
    finally:
        agent.terminate()
        agent.wait(timeout=30)
    # The agent's own lines (aio-pika's and aiormq's may name the frame as they like).
    own = [line for line in agent_log.read_text().splitlines()
           if re.match(r"\S+ \S+ [A-Z]+ nodeagent[.:]", line)]
    assert own, agent_log.read_text()[-3000:]
    assert not [line for line in own if "InvalidFrameError" in line
                or "Connection.Close" in line], own


# ----------------------------------------------------------------------------- end to end


@pytest.fixture
def broker_user(rabbitmq: services.RabbitMQ) -> Iterator[str]:
    """A broker user with the password :data:`SECRET` and every right on a vhost of its own:
    the AMQP URL."""
    name = f"t{uuid.uuid4().hex[:8]}-allocator"
    quoted = urllib.parse.quote(name, safe="")
    rabbitmq.api("PUT", f"/api/users/{quoted}", {"password": SECRET, "tags": ""})
    try:
        with services.temporary_vhost(rabbitmq) as vhost:
            rabbitmq.api("PUT", f"/api/permissions/{urllib.parse.quote(vhost.name, safe='')}/"
                         f"{quoted}", {"configure": ".*", "write": ".*", "read": ".*"})
            yield (f"amqp://{quoted}:{SECRET}@{rabbitmq.host}:{rabbitmq.port}/"
                   f"{urllib.parse.quote(vhost.name, safe='')}")
    finally:
        rabbitmq.api("DELETE", f"/api/users/{quoted}")


async def test_a_debug_json_log_of_a_start_and_requests_never_holds_the_password(
        broker_user: str, tmp_path: Path) -> None:
    process = AllocatorProcess("json", broker_user, tmp_path / "ledger.sqlite", tmp_path,
                               log_format="json", log_level="debug", admin_users=[])
    await process.start()
    try:
        await process.wait_consuming(within=60)
        async with AllocatorClient(broker_user, timeout_s=20) as client:
            inventory = await client.inventory()
            assert inventory.models == []
            lease = await client.allocate(AllocateRequest(request_key="logs/alice",
                                                          user="alice", model="1070"))
            await client.release(lease_id=lease.lease_id)
            with pytest.raises(AllocatorError):
                await client.release(lease_id="no-such-lease")
    finally:
        code = await process.stop()
    written = process.log()
    assert code == 0, written[-3000:]
    assert SECRET not in written
    lines = [json.loads(line) for line in written.splitlines() if line.strip()]
    assert all({"timestamp", "level", "logger", "message"} <= set(line) for line in lines)
    assert any(line["level"] == "DEBUG" for line in lines), "DEBUG was asked for"
    assert any("allocator consuming" in line["message"] for line in lines)


def test_the_hub_writes_json_lines_with_the_documented_logging_config(
        capsys: pytest.CaptureFixture[str]) -> None:
    from jupyterhub.app import JupyterHub

    hub_log = logging.getLogger("JupyterHub")
    handlers = list(hub_log.handlers)
    try:
        app = JupyterHub(logging_config=JUPYTERHUB_JSON_LOGGING)
        app.log.info("spawner of %s: broker %s", "alice", f"amqp://hub:{SECRET}@rabbitmq:5671/",
                     extra={"user": "alice", "lease_id": "L-9"})
        line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    finally:
        for handler in set(hub_log.handlers) - set(handlers):
            hub_log.removeHandler(handler)
    assert (line["logger"], line["level"], line["user"], line["lease_id"]) == (
        "JupyterHub", "INFO", "alice", "L-9")
    assert line["message"] == "spawner of alice: broker amqp://hub:***@rabbitmq:5671/"


def test_the_documented_simulated_inventory_is_one_the_agent_reads() -> None:
    text = (REPO_ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    section = text.split("## Simulated GPUs (hosts without GPUs)\n", 1)[1].split("\n## ", 1)[0]
    example = section.split("```json\n", 1)[1].split("```", 1)[0]
    inventory = parse_inventory(example)
    gpus = [sample for gpu in inventory.hosts["gpu-a"] for sample in gpu.samples()]
    assert [gpu.model for gpu in gpus] == [
        "NVIDIA GeForce GTX 1070", "NVIDIA A100-SXM4-40GB",
        "NVIDIA A100-SXM4-40GB MIG 3g.20gb", "NVIDIA A100-SXM4-40GB MIG 1g.5gb"]
    assert inventory.hosts["gpu-b"] == []
    assert inventory.leases["5d80169b2c1e4f0aa31b7c9e2d6f8a10"].memory_used_mib == 800
