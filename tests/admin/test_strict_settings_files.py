"""Settings files are strict: an unknown key or a value of the wrong type is refused.

The allocator's ``allocator.toml`` and the node agent's settings file are what people type, so a
typo must not pass silently (``bind_timeout = 600`` would leave the default in force). Each
problem names the file, the line, the key (a dotted path inside a table) and, for an unknown
key, the nearest setting. The environment stays tolerant (other programs' variables may share
its prefix). Every example settings file of the README, docs/, compose/ and the demo
scripts must load. These tests write real files and read them through the real loaders and
entry points.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from pydantic_settings import BaseSettings

from allocator.bookings.booking import Booking, read_booking
from allocator.config import AllocatorSettings
from allocator.config import load_settings as load_allocator_settings
from allocator.deploy.site import Site
from allocator.settings_files import SettingsFileError, settings_file_problems
from nodeagent.config import AgentSettings
from nodeagent.config import load_settings as load_agent_settings
from nodeagent.simulated import parse_inventory
from tests.support.services import REPO_ROOT

SETTINGS_ENV = ("SWARM_GPU_CONFIG", "SWARM_GPU_AGENT_CONFIG", "SWARM_GPU_AMQP_URL",
                "SWARM_GPU_AMQP_URL_FILE", "SWARM_GPU_AGENT_AMQP_URL",
                "SWARM_GPU_AGENT_AMQP_URL_FILE", "SWARM_GPU_BIND_TIMEOUT_S")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in SETTINGS_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def refused(path: Path, loader: Any = load_allocator_settings) -> str:
    with pytest.raises(SettingsFileError) as exc:
        loader(path)
    return str(exc.value)


ALLOCATOR_FILE_PROBLEMS = [
    ('bind_timeout = 600\n', "1: bind_timeout: unknown key; did you mean bind_timeout_s?"),
    ('tick_s = 1\n\n[share_slot]\n"X" = 4\n',
     "3: share_slot: unknown key; did you mean share_slots?"),
    ('node_down_after = 20\n', "1: node_down_after: unknown key; did you mean node_down_after_s?"),
    ('ledger_sync = "full"\n',
     "1: ledger_sync: unknown key; did you mean ledger_synchronous?"),
    ('xyzzy = 1\n', "1: xyzzy: unknown key"),
    ('bind_timeout_s = "abc"\n', "1: bind_timeout_s: Input should be a valid number (got 'abc')"),
    ('bind_timeout_s = "300"\n', "1: bind_timeout_s: Input should be a valid number (got '300')"),
    ('stop_containers = "yes"\n',
     "1: stop_containers: Input should be a valid boolean (got 'yes')"),
    ('batch_max = 64.5\n', "1: batch_max: Input should be a valid integer (got 64.5)"),
    ('bind_timeout_s = -1\n', "1: bind_timeout_s: Input should be greater than 0 (got -1)"),
    ('ledger_log = "strem"\n',
     "1: ledger_log: Input should be 'off' or 'stream' (got 'strem')"),
    ('[share_slots]\n"NVIDIA GeForce GTX 1070" = "4"\n',
     '2: share_slots."NVIDIA GeForce GTX 1070": Input should be a valid integer (got \'4\')'),
    ('share_slots = { a = 1, b = "x" }\n',
     "1: share_slots.b: Input should be a valid integer (got 'x')"),
    ('[user_model_quota.alice]\na100 = "one"\n',
     "2: user_model_quota.alice.a100: Input should be a valid number (got 'one')"),
    ('admin_users = "admin"\n', "1: admin_users: Input should be a valid array (got 'admin')"),
    ('config = "other.toml"\n', "1: config: unknown key"),
]
"""An allocator.toml and what is wrong with it (line: key: problem)."""

AGENT_FILE_PROBLEMS = [
    ("intervall_s = 5\n", "1: intervall_s: unknown key; did you mean interval_s?"),
    ("overheat = 90\n", "1: overheat: unknown key; did you mean overheat_c?"),
    ('fatal_xids = "48,79"\n', "1: fatal_xids: Input should be a valid array (got '48,79')"),
    ('docker = "no"\n', "1: docker: Input should be a valid boolean (got 'no')"),
    ('inventory = "nvm"\n', "1: inventory: Input should be 'nvml' or 'simulated' (got 'nvm')"),
]
"""The same for the node agent's settings file."""


@pytest.mark.parametrize("loader, text, problem", [
    *[(load_allocator_settings, *row) for row in ALLOCATOR_FILE_PROBLEMS],
    *[(load_agent_settings, *row) for row in AGENT_FILE_PROBLEMS]])
def test_a_settings_file_refuses_each_problem_naming_file_line_and_key(
        tmp_path: Path, clean_env: pytest.MonkeyPatch, loader: Any, text: str,
        problem: str) -> None:
    path = tmp_path / "settings.toml"
    path.write_text(text)
    assert refused(path, loader) == f"{path}:{problem}"


def test_every_problem_of_a_file_is_in_the_one_line(
        tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    path = tmp_path / "allocator.toml"
    path.write_text('# typos\nbind_timeout = 600\ntick_s = "fast"\n[aliases]\n"1070" = 1070\n')
    assert refused(path) == (
        f"{path}:2: bind_timeout: unknown key; did you mean bind_timeout_s?; "
        f"{path}:3: tick_s: Input should be a valid number (got 'fast'); "
        f"{path}:5: aliases.1070: Input should be a valid string (got 1070)")


def _typos(name: str) -> st.SearchStrategy[str]:
    """A key one keystroke away from ``name``: a letter dropped, doubled or swapped."""
    def typo(at: int, kind: int) -> str:
        if kind == 0:
            return name[:at] + name[at + 1:]
        if kind == 1:
            return name[:at] + name[at] + name[at:]
        return name[:at] + name[at + 1:at + 2] + name[at] + name[at + 2:]
    return st.tuples(st.integers(0, len(name) - 2), st.integers(0, 2)).map(lambda t: typo(*t))


SETTINGS_CLASSES: list[type[BaseSettings]] = [AllocatorSettings, AgentSettings]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_typo_of_any_setting_is_refused_and_a_setting_near_it_is_offered(
        data: st.DataObject) -> None:
    cls = data.draw(st.sampled_from(SETTINGS_CLASSES))
    name = data.draw(st.sampled_from([n for n in cls.model_fields if n != "config"]))
    key = data.draw(_typos(name))
    text = f"# a comment\n{key} = 1\n"
    problems = settings_file_problems(cls, tomllib.loads(text), text)
    if key in cls.model_fields and key != "config":
        return  # the typo is another setting's name: nothing to refuse on the key
    assert len(problems) == 1 and problems[0].startswith(f"2: {key}: unknown key; did you mean ")
    offered = problems[0].rsplit(" ", 1)[1].rstrip("?")
    assert offered in cls.model_fields  # the nearest setting, not always the one meant


def test_the_environment_stays_tolerant_of_variables_that_are_no_setting(
        tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    # SWARM_GPU_ is also the start of the agent's and the page's variables.
    clean_env.setenv("SWARM_GPU_AGENT_INTERVAL_S", "7")
    clean_env.setenv("SWARM_GPU_BIND_TIMEOUT", "9")
    path = tmp_path / "allocator.toml"
    path.write_text("bind_timeout_s = 600\n")
    assert load_allocator_settings(path).bind_timeout_s == 600


def test_the_environment_overrides_a_secret_file_named_in_the_settings_file(
        tmp_path: Path, clean_env: pytest.MonkeyPatch) -> None:
    # The stack's start command sets SWARM_GPU_AMQP_URL; a settings file naming amqp_url_file
    # (the README's example) must not make that an error: the environment is the higher source.
    secret = tmp_path / "url"
    secret.write_text("amqp://from-file:pw@broker/\n")
    path = tmp_path / "allocator.toml"
    path.write_text(f'amqp_url_file = "{secret}"\n')
    assert load_allocator_settings(path).amqp_url == "amqp://from-file:pw@broker/"
    clean_env.setenv("SWARM_GPU_AMQP_URL", "amqp://from-env:pw@broker/")
    assert load_allocator_settings(path).amqp_url == "amqp://from-env:pw@broker/"
    # and an argument over the environment's file
    clean_env.delenv("SWARM_GPU_AMQP_URL")
    clean_env.setenv("SWARM_GPU_AMQP_URL_FILE", str(secret))
    assert load_allocator_settings(amqp_url="amqp://arg:pw@b/").amqp_url == "amqp://arg:pw@b/"


def run_cli(args: list[str], env: dict[str, str]) -> tuple[int, list[str]]:
    environ = {key: value for key, value in os.environ.items() if key not in SETTINGS_ENV}
    result = subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120, env={**environ, **env},
                            stdin=subprocess.DEVNULL)
    return result.returncode, result.stderr.strip().splitlines()


def test_the_processes_print_one_line_and_exit_non_zero(tmp_path: Path) -> None:
    allocator_toml = tmp_path / "allocator.toml"
    allocator_toml.write_text('ledger_path = "x.sqlite"\nbind_timeout = "abc"\n')
    expected = (f"invalid settings: {allocator_toml}:2: bind_timeout: unknown key; did you "
                "mean bind_timeout_s?")
    for command in (["serve", "--config", str(allocator_toml)],
                    ["health", "--config", str(allocator_toml)]):
        code, lines = run_cli(["allocator.admin.cli", *command], {})
        assert (code, lines) == (1, [f"gpu-allocator: {expected}"])
    code, lines = run_cli(["allocator.admin.cli", "serve"],
                          {"SWARM_GPU_CONFIG": str(allocator_toml)})
    assert (code, lines) == (1, [f"gpu-allocator: {expected}"])

    agent_toml = tmp_path / "agent.toml"
    agent_toml.write_text("intervall_s = 5\n")
    code, lines = run_cli(["nodeagent.cli", "--no-docker", "--config", str(agent_toml)], {})
    assert (code, lines) == (2, [f"gpu-nodeagent: invalid settings: {agent_toml}:1: "
                                 "intervall_s: unknown key; did you mean interval_s?"])
    code, lines = run_cli(["nodeagent.cli", "health", "--config", str(agent_toml)], {})
    assert code == 1 and len(lines) == 1 and "intervall_s: unknown key" in lines[0], lines


# ------------------------------------------------------------------ the examples must load

EXAMPLE_FILES = [REPO_ROOT / "compose" / "allocator.toml"]
"""Settings files the project ships."""

DOCUMENTS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


def toml_examples() -> list[tuple[str, str]]:
    """Every ```toml block of the README and docs/, with where it starts."""
    found = []
    for document in DOCUMENTS:
        text = document.read_text()
        for match in re.finditer(r"^```toml\n(.*?)^```", text, re.M | re.S):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{document.relative_to(REPO_ROOT)}:{line}", match.group(1)))
    return found


def docstring_examples() -> list[tuple[str, str]]:
    """The example files in the docstrings of the two settings modules."""
    found = []
    for module in ("allocator/config.py", "nodeagent/config.py"):
        text = (REPO_ROOT / module).read_text()
        match = re.search(r"::\n\n((?:    .*\n|\n)+)", text)
        assert match, f"{module} lost its example file"
        found.append((module, "\n".join(line[4:] for line in match.group(1).splitlines())))
    return found


def script_examples() -> list[tuple[str, str]]:
    """The settings files the demo scripts write (``cat >... <<TOML``), ``$DEMO`` filled in."""
    found = []
    for script in ("scripts/demo", "scripts/demo-cli"):
        text = (REPO_ROOT / script).read_text()
        blocks = re.findall(r"<<TOML\n(.*?)^\s*TOML$", text, re.M | re.S)
        assert blocks, f"{script} writes no settings file any more"
        found += [(script, block.replace("$DEMO", "/tmp/demo")) for block in blocks]
    return found


def loads_as(text: str) -> list[str]:
    """The kinds of file ``text`` is a correct example of: allocator, agent, booking, site."""
    data = tomllib.loads(text)
    kinds = []
    for kind, cls in (("allocator", AllocatorSettings), ("agent", AgentSettings)):
        if not settings_file_problems(cls, data, text):
            # The rules across settings too; a secret file named is not read here.
            cls(**{key: value for key, value in data.items() if not key.endswith("_file")})
            kinds.append(kind)
    # A booking file as gpu-ledger reads it: dates as ISO text; the allocator adds created_by.
    booking = json.loads(json.dumps({**data, "created_by": "docs"}, default=str))
    if isinstance(read_booking(booking), Booking):
        kinds.append("booking")
    try:  # a site file as swarm-gpu reads it (allocator.deploy.site.load_site)
        Site.model_validate_json(json.dumps(data, default=str), strict=True)
        kinds.append("site")
    except ValidationError:
        pass
    return kinds


def test_there_are_examples_to_check() -> None:
    assert len(toml_examples()) >= 4


@pytest.mark.parametrize("where, text", [
    pytest.param(where, text, id=where) for where, text in [
        *[(str(path.relative_to(REPO_ROOT)), path.read_text()) for path in EXAMPLE_FILES],
        *toml_examples(), *docstring_examples(), *script_examples()]])
def test_every_example_file_loads(where: str, text: str, clean_env: pytest.MonkeyPatch) -> None:
    assert loads_as(text), f"{where}: the example is no correct settings or booking file"


def test_the_shipped_allocator_toml_loads_through_the_loader(clean_env: pytest.MonkeyPatch) -> None:
    settings = load_allocator_settings(REPO_ROOT / "compose" / "allocator.toml")
    assert settings.share_slots == {"NVIDIA GeForce GTX 1070": 4}


# ------------------------------------------------------------- the other files people type

BOOKING_WITH_TYPOS = """name = "CS101 lab"
group = "cs101"
zone = "Europe/Berlin"
lead = 900
gpus = { modle = "a100", count = 15 }

[window]
kind = "weekly"
weekdays = ["tue"]
start = "10:00"
duration = 7200
until = 2027-02-09
"""


def test_a_booking_file_with_an_unknown_key_is_refused_before_the_allocator_is_asked(
        tmp_path: Path) -> None:
    path = tmp_path / "cs101.toml"
    path.write_text(BOOKING_WITH_TYPOS)
    # No broker listens at that URL: the file is refused before any connection.
    code, lines = run_cli(["allocator.admin.ledger_cli", "booking", "add", "--file", str(path),
                           "--amqp", "amqp://guest:guest@127.0.0.1:9/", "--timeout", "5"], {})
    assert (code, lines) == (2, [
        f"gpu-ledger: error: {path}:5: gpus.modle: unknown key; did you mean model?; "
        f"{path}:11: window.duration: unknown key; did you mean duration_s?; "
        f"{path}:4: lead: unknown key; did you mean lead_s?"])


def test_a_simulated_inventory_names_an_unknown_key_and_the_key_meant() -> None:
    text = json.dumps({"hosts": {"gpu-a": [
        {"uuid": "GPU-1", "index": 0, "model": "NVIDIA GeForce GTX 1070",
         "memory_total_mib": 8192, "processes": [{"pid": 7, "used_memory": 5}]}]},
        "lease": {}})
    with pytest.raises(ValueError) as exc:
        parse_inventory(text)
    assert str(exc.value) == (
        "not a simulated inventory: hosts.gpu-a.0.processes.0.used_memory: unknown key; did "
        "you mean used_memory_mib?; lease: unknown key; did you mean leases?")
