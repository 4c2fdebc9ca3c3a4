"""Secrets from files: every broker URL (it holds a password) may be given as a file.

The allocator, the node agent and the GPU page read ``amqp_url_file`` (environment
``..._AMQP_URL_FILE``, the agent's ``--amqp-url-file``, or the TOML file), the spawner
``allocator_url_file``, the command-line clients ``SWARM_GPU_AMQP_URL_FILE``; the example hub
configuration passes the file on to the page. All through one helper
(:mod:`allocator.settings_files`): the content with its trailing newline stripped, both set
is an error, an unreadable file is one line naming it, and no error line shows the secret.
The clients are checked end to end against a real allocator on the real broker.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError
from tornado import web
from traitlets.config import Config
from traitlets.config.loader import PyFileConfigLoader

from allocator.config import load_settings as load_allocator_settings
from allocator.settings_files import settings_error_line
from hubplugin.page.settings import PageSettings
from hubplugin.spawner import GPUSwarmSpawner
from nodeagent.cli import parse_args
from nodeagent.config import load_settings as load_agent_settings
from tests.support.services import REPO_ROOT

SECRET_URL = "amqp://hub:s3cret pw@rabbitmq:5672/swarm-gpu"
"""A URL whose password has a space: only the trailing newline may be stripped."""
SECRET = "s3cret pw"

URL_VARIABLES = ("SWARM_GPU_AMQP_URL", "SWARM_GPU_AMQP_URL_FILE", "SWARM_GPU_AGENT_AMQP_URL",
                 "SWARM_GPU_AGENT_AMQP_URL_FILE", "SWARM_GPU_PAGE_AMQP_URL",
                 "SWARM_GPU_PAGE_AMQP_URL_FILE", "SWARM_GPU_CONFIG", "SWARM_GPU_AGENT_CONFIG")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No broker URL from the test environment (``.services/env`` sets one)."""
    for name in URL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def url_file(tmp_path: Path) -> Path:
    """A Docker-secret-like file: the URL and the newline `echo` or an editor adds."""
    path = tmp_path / "amqp-url"
    path.write_text(SECRET_URL + "\n")
    path.chmod(0o400)
    return path


def error_line(exc: pytest.ExceptionInfo[ValidationError]) -> str:
    line = settings_error_line(exc.value)
    assert SECRET not in line, "an error line must never show the secret"
    return line


# ------------------------------------------------------------------- the allocator


def test_allocator_reads_its_broker_url_from_a_file(
    env: pytest.MonkeyPatch, url_file: Path, tmp_path: Path
) -> None:
    env.setenv("SWARM_GPU_AMQP_URL_FILE", str(url_file))
    assert load_allocator_settings().amqp_url == SECRET_URL
    env.delenv("SWARM_GPU_AMQP_URL_FILE")
    # the TOML file may name it too (the URL itself then never sits in the TOML file)
    toml = tmp_path / "allocator.toml"
    toml.write_text(f'amqp_url_file = "{url_file}"\n')
    settings = load_allocator_settings(toml)
    assert settings.amqp_url == SECRET_URL
    assert "amqp_url_file" not in settings.model_dump(), "a path, not a setting to show"


def test_allocator_refuses_a_url_and_its_file_together(
    env: pytest.MonkeyPatch, url_file: Path
) -> None:
    env.setenv("SWARM_GPU_AMQP_URL", SECRET_URL)
    env.setenv("SWARM_GPU_AMQP_URL_FILE", str(url_file))
    with pytest.raises(ValidationError) as exc:
        load_allocator_settings()
    assert error_line(exc) == "set amqp_url or amqp_url_file, not both"


def test_an_unreadable_file_is_one_line_naming_it(
    env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-secret"
    env.setenv("SWARM_GPU_AMQP_URL_FILE", str(missing))
    with pytest.raises(ValidationError) as exc:
        load_allocator_settings()
    assert error_line(exc) == f"amqp_url_file: cannot read {missing}: No such file or directory"
    empty = tmp_path / "empty"
    empty.write_text("\n")
    env.setenv("SWARM_GPU_AMQP_URL_FILE", str(empty))
    with pytest.raises(ValidationError) as exc:
        load_allocator_settings()
    assert error_line(exc) == f"amqp_url_file: {empty} is empty"


def test_the_allocator_process_says_so_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-secret"
    code, lines = run_module(["allocator.admin.cli", "serve"],
                             {"SWARM_GPU_AMQP_URL_FILE": str(missing)})
    assert code == 1 and lines == [
        f"gpu-allocator: invalid settings: amqp_url_file: cannot read {missing}: "
        "No such file or directory"], lines


# ------------------------------------------------------------------- the node agent


def test_agent_reads_its_broker_url_from_a_file_named_anywhere(
    env: pytest.MonkeyPatch, url_file: Path
) -> None:
    _, given = parse_args(["--amqp-url-file", str(url_file)])
    assert load_agent_settings(**given).amqp_url == SECRET_URL
    env.setenv("SWARM_GPU_AGENT_AMQP_URL_FILE", str(url_file))
    assert load_agent_settings().amqp_url == SECRET_URL
    env.setenv("SWARM_GPU_AGENT_AMQP_URL", "amqp://agent-a:pw@rabbitmq/swarm-gpu")
    with pytest.raises(ValidationError) as exc:
        load_agent_settings()
    assert error_line(exc) == "set amqp_url or amqp_url_file, not both"


def test_the_agent_process_says_so_in_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-secret"
    code, lines = run_module(["nodeagent.cli", "--no-docker", "--amqp-url-file", str(missing)],
                             {})
    assert code == 2 and lines == [
        f"gpu-nodeagent: invalid settings: amqp_url_file: cannot read {missing}: "
        "No such file or directory"], lines


# ------------------------------------------------------------------- the GPU page


def test_page_reads_its_broker_url_from_a_file(env: pytest.MonkeyPatch, url_file: Path) -> None:
    env.setenv("SWARM_GPU_PAGE_AMQP_URL_FILE", str(url_file))
    assert PageSettings().amqp_url == SECRET_URL
    env.setenv("SWARM_GPU_PAGE_AMQP_URL", SECRET_URL)
    with pytest.raises(ValidationError) as exc:
        PageSettings()
    assert error_line(exc) == "set amqp_url or amqp_url_file, not both"


# ------------------------------------------------------------------- the spawner


def spawner(**config: Any) -> GPUSwarmSpawner:
    user = SimpleNamespace(name="alice", groups=[], url="/user/alice/")
    return GPUSwarmSpawner(user=user, **config)


def message(error: web.HTTPError) -> str:
    """What the hub shows for this error."""
    return (error.log_message or "") % error.args


def test_spawner_reads_allocator_url_from_a_file(url_file: Path, tmp_path: Path) -> None:
    assert spawner(allocator_url_file=str(url_file)).allocator_broker_url() == SECRET_URL
    assert spawner(allocator_url=SECRET_URL).allocator_broker_url() == SECRET_URL

    with pytest.raises(web.HTTPError) as both:
        spawner(allocator_url=SECRET_URL, allocator_url_file=str(url_file)).allocator_broker_url()
    assert both.value.status_code == 500
    assert message(both.value) == (
        "the hub's GPU settings: set allocator_url or allocator_url_file, not both")

    missing = tmp_path / "no-such-secret"
    with pytest.raises(web.HTTPError) as unreadable:
        spawner(allocator_url_file=str(missing)).allocator_broker_url()
    assert message(unreadable.value) == (
        f"the hub's GPU settings: allocator_url_file: cannot read {missing}: "
        "No such file or directory")


def test_the_example_hub_config_passes_the_file_not_the_url(
    env: pytest.MonkeyPatch, url_file: Path
) -> None:
    """compose/jupyterhub_config.py: with SWARM_GPU_AMQP_URL_FILE the spawner and the page
    get the file's name; the URL is in no environment the hub hands on."""
    env.setenv("SWARM_GPU_AMQP_URL_FILE", str(url_file))
    config = load_hub_config()
    assert config.GPUSwarmSpawner.allocator_url_file == str(url_file)
    assert "allocator_url" not in config.GPUSwarmSpawner
    (page,) = [s for s in config.JupyterHub.services if s["name"] == "gpu"]
    assert page["environment"]["SWARM_GPU_PAGE_AMQP_URL_FILE"] == str(url_file)
    assert "SWARM_GPU_PAGE_AMQP_URL" not in page["environment"]
    assert not any(SECRET in str(value) for value in page["environment"].values())
    # and the page, started with that environment, reads it
    for name, value in page["environment"].items():
        env.setenv(name, value)
    assert PageSettings().amqp_url == SECRET_URL


@pytest.mark.parametrize("hub_env", [
    {"SWARM_GPU_AMQP_URL": SECRET_URL},
    {"SWARM_GPU_AMQP_URL": "amqp://other:0ther@rabbitmq/swarm-gpu",
     "SWARM_GPU_PAGE_AMQP_URL": SECRET_URL},
])
def test_the_example_hub_config_gives_the_page_no_broker_url_in_its_environment(
    env: pytest.MonkeyPatch, hub_env: dict[str, str]
) -> None:
    """compose/jupyterhub_config.py with the broker URL itself (the stack's hub builds it
    from a password file): the GPU page, which needs the broker for the allocator's
    inventory, gets the name of a file only it and the hub can read, not the URL."""
    for name, value in hub_env.items():
        env.setenv(name, value)
    config = load_hub_config()
    (page,) = [s for s in config.JupyterHub.services if s["name"] == "gpu"]
    environment = page["environment"]
    assert "SWARM_GPU_PAGE_AMQP_URL" not in environment
    for value in environment.values():
        assert "amqp://" not in value and "amqps://" not in value, environment
        assert SECRET not in value and "0ther" not in value, environment
    url_file = Path(environment["SWARM_GPU_PAGE_AMQP_URL_FILE"])
    assert url_file.stat().st_mode & 0o777 == 0o600
    assert url_file.parent.stat().st_mode & 0o777 == 0o700
    for name, value in environment.items():
        env.setenv(name, value)
    env.delenv("SWARM_GPU_PAGE_AMQP_URL", raising=False)
    assert PageSettings().amqp_url == SECRET_URL


def load_hub_config() -> Config:
    loader = PyFileConfigLoader("jupyterhub_config.py", path=str(REPO_ROOT / "compose"))
    config: Config = loader.load_config()
    return config


# ------------------------------------------------------------------- the clients


def run_module(args: list[str], env: dict[str, str]) -> tuple[int, list[str]]:
    """Run ``python -m args`` with no broker URL of the test environment, plus ``env``."""
    base = {k: v for k, v in os.environ.items() if k not in URL_VARIABLES}
    result = subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120, env={**base, **env},
                            stdin=subprocess.DEVNULL)
    return result.returncode, (result.stderr.strip() or result.stdout.strip()).splitlines()


async def test_the_clients_reach_the_allocator_through_a_url_file(
    allocator: Any, tmp_path: Path
) -> None:
    """gpu-allocator and gpu-ledger, as an admin runs them: the URL (with the broker
    password) in a file, nowhere on the command line or in the environment."""
    url_file = tmp_path / "amqp-url"
    url_file.write_text(allocator.settings.amqp_url + "\n")
    env = {"SWARM_GPU_AMQP_URL_FILE": str(url_file)}
    base = {k: v for k, v in os.environ.items() if k not in URL_VARIABLES}
    for args in (["allocator.admin.cli", "inventory", "--json"],
                 ["allocator.admin.ledger_cli", "status", "--json"]):
        # in a thread: the allocator answers from this test's event loop
        result = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", *args], cwd=REPO_ROOT,
            capture_output=True, text=True, timeout=120, env={**base, **env},
            stdin=subprocess.DEVNULL)
        assert result.returncode == 0, (args, result.stderr)
        assert result.stdout.lstrip().startswith("{"), (args, result.stdout)

    # a pipe, as docs/operations.md runs it in a container (docker exec -i ... < file): read
    # once, although gpu-ledger status asks for the URL twice
    piped = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "allocator.admin.ledger_cli", "status", "--json"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
        env={**base, "SWARM_GPU_AMQP_URL_FILE": "/dev/stdin"},
        input=allocator.settings.amqp_url + "\n")
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.lstrip().startswith("{")

    missing = tmp_path / "no-such-secret"
    code, lines = run_module(["allocator.admin.cli", "inventory"],
                             {"SWARM_GPU_AMQP_URL_FILE": str(missing)})
    assert code == 1 and lines == [
        f"gpu-allocator: SWARM_GPU_AMQP_URL_FILE: cannot read {missing}: "
        "No such file or directory"], lines
    code, lines = run_module(["allocator.admin.ledger_cli", "status"],
                             {"SWARM_GPU_AMQP_URL_FILE": str(url_file),
                              "SWARM_GPU_AMQP_URL": allocator.settings.amqp_url})
    assert code != 0 and lines == [
        "gpu-ledger: error: set SWARM_GPU_AMQP_URL or SWARM_GPU_AMQP_URL_FILE, not both"], lines
