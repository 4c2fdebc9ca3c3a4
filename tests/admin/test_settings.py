"""Settings precedence (command line > environment > TOML file > default) and bad settings.

Both processes read settings through pydantic-settings' sources (allocator.settings_files);
the node agent's flags are made from its settings fields. These tests go through the real
entry points: the agent's command-line parser and load_settings, and the two CLIs as child
processes for the one-line error.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from allocator.config import AllocatorSettings
from allocator.config import load_settings as load_allocator_settings
from nodeagent.cli import parse_args
from nodeagent.config import load_settings as load_agent_settings
from tests.support.services import REPO_ROOT

AGENT_ENV = ("SWARM_GPU_AGENT_CONFIG", "SWARM_GPU_AGENT_INTERVAL_S", "SWARM_GPU_AGENT_HOST",
             "SWARM_GPU_AGENT_OVERHEAT_C")
ALLOCATOR_ENV = ("SWARM_GPU_CONFIG", "SWARM_GPU_TICK_S", "SWARM_GPU_BATCH_MAX")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in AGENT_ENV + ALLOCATOR_ENV:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def agent_from(argv: list[str]) -> float:
    """The interval the agent would run with for this command line."""
    _, given = parse_args(argv)
    return load_agent_settings(**given).interval_s


def test_agent_precedence_command_line_then_environment_then_file_then_default(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "agent.toml"
    config.write_text("interval_s = 7\noverheat_c = 80\n")
    assert agent_from([]) == 5.0  # the field's default
    clean_env.setenv("SWARM_GPU_AGENT_CONFIG", str(config))
    assert agent_from([]) == 7.0  # the file over the default
    clean_env.setenv("SWARM_GPU_AGENT_INTERVAL_S", "8")
    assert agent_from([]) == 8.0  # the environment over the file
    assert agent_from(["--interval", "9"]) == 9.0  # the command line over the environment
    assert agent_from(["--interval-s", "9.5"]) == 9.5  # the field's own flag name
    # the file still gives what nobody else sets
    _, given = parse_args(["--interval", "9"])
    assert load_agent_settings(**given).overheat_c == 80


def test_agent_config_file_is_a_setting_like_the_others(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    from_env, from_flag = tmp_path / "env.toml", tmp_path / "flag.toml"
    from_env.write_text("interval_s = 3\n")
    from_flag.write_text("interval_s = 4\n")
    clean_env.setenv("SWARM_GPU_AGENT_CONFIG", str(from_env))
    assert agent_from([]) == 3.0
    assert agent_from(["--config", str(from_flag)]) == 4.0  # --config over the environment


def test_agent_flags_of_earlier_releases_still_work(clean_env: pytest.MonkeyPatch) -> None:
    _, given = parse_args(["--host", "h", "--amqp-url", "amqp://u:p@b/", "--inventory",
                           "simulated", "--simulated-file", "/x.json", "--interval", "2",
                           "--docker-url", "unix:///d.sock", "--no-docker",
                           "--no-docker-events", "--no-stop-commands",
                           "--command-users", "allocator,admin"])
    settings = load_agent_settings(**given)
    assert (settings.host, settings.amqp_url, settings.inventory) == (
        "h", "amqp://u:p@b/", "simulated")
    assert settings.simulated_file == Path("/x.json") and settings.interval_s == 2.0
    assert settings.docker_url == "unix:///d.sock"
    assert not (settings.docker or settings.docker_events or settings.stop_commands)
    assert settings.command_users == ["allocator", "admin"]


def test_agent_help_comes_from_the_fields() -> None:
    result = subprocess.run([sys.executable, "-m", "nodeagent.cli", "--help"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60, check=True)
    flat = " ".join(result.stdout.split())
    assert "--overheat-hysteresis-c" in flat  # a setting the old hand-written parser lacked
    assert "hovering at the threshold does not flap" in flat  # its field's description
    assert "--log-level" in flat


def test_allocator_precedence_arguments_then_environment_then_file_then_default(
    tmp_path: Path, clean_env: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "allocator.toml"
    config.write_text("tick_s = 2\nbatch_max = 7\n[share_slots]\n\"X\" = 4\n")
    assert load_allocator_settings().tick_s == 0.5
    clean_env.setenv("SWARM_GPU_CONFIG", str(config))
    assert load_allocator_settings().tick_s == 2.0
    assert AllocatorSettings().share_slots == {"X": 4}  # a direct construction reads it too
    clean_env.setenv("SWARM_GPU_TICK_S", "3")
    settings = load_allocator_settings()
    assert (settings.tick_s, settings.batch_max) == (3.0, 7)
    assert load_allocator_settings(tick_s=4).tick_s == 4.0


def one_line_error(args: list[str], env: dict[str, str]) -> tuple[int, list[str]]:
    result = subprocess.run([sys.executable, "-m", *args], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=120, env={**os.environ, **env},
                            stdin=subprocess.DEVNULL)
    return result.returncode, result.stderr.strip().splitlines()


def test_a_bad_value_is_one_line_naming_the_setting(tmp_path: Path) -> None:
    code, lines = one_line_error(["nodeagent.cli", "--interval", "-1", "--no-docker"], {})
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("gpu-nodeagent: invalid settings: interval_s: ")
    assert "greater than 0" in lines[0] and "'-1'" in lines[0]

    code, lines = one_line_error(["allocator.admin.cli", "serve"], {"SWARM_GPU_BATCH_MAX": "0"})
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("gpu-allocator: invalid settings: batch_max: ")

    broken = tmp_path / "broken.toml"
    broken.write_text("tick_s = [\n")
    code, lines = one_line_error(["allocator.admin.cli", "serve", "--config", str(broken)], {})
    assert code == 1 and len(lines) == 1 and "not valid TOML" in lines[0], lines

    missing = tmp_path / "missing.toml"
    code, lines = one_line_error(["nodeagent.cli"], {"SWARM_GPU_AGENT_CONFIG": str(missing)})
    assert code == 2 and lines == [f"gpu-nodeagent: invalid settings: settings file not found: "
                                   f"{missing}"], lines


@pytest.mark.parametrize("max_bytes, segment_bytes, snapshot_bytes, refused", [
    (None, None, None, False),  # the defaults: 20 GiB, 500 MB segments, 256 MiB
    (64 << 10, 4 << 10, 14 << 10, False),  # (64 KiB - 2 x 4 KiB) / 4 = 14 KiB
    (64 << 10, 4 << 10, (14 << 10) + 1, True),
    (1 << 30, None, 32 << 20, True),  # 1 GiB less two default segments leaves 74 MB
])
def test_ledger_log_retention_that_could_drop_the_newest_snapshot_is_refused(
        clean_env: pytest.MonkeyPatch, max_bytes: int | None, segment_bytes: int | None,
        snapshot_bytes: int | None, refused: bool) -> None:
    given: dict[str, Any] = {name: value for name, value in (("ledger_log_max_bytes", max_bytes),
                                            ("ledger_log_segment_bytes", segment_bytes),
                                            ("ledger_log_snapshot_bytes", snapshot_bytes))
             if value is not None}
    if not refused:
        load_allocator_settings(ledger_log="stream", **given)
        return
    with pytest.raises(ValueError, match="could drop the newest snapshot"):
        load_allocator_settings(ledger_log="stream", **given)
    load_allocator_settings(ledger_log="off", **given)  # only the log's retention matters
    env = {f"SWARM_GPU_{name.upper()}": str(value) for name, value in given.items()}
    code, lines = one_line_error(["allocator.admin.cli", "serve"],
                                 {**env, "SWARM_GPU_LEDGER_LOG": "stream"})
    assert code == 1 and len(lines) == 1, lines
    assert lines[0].startswith("gpu-allocator: invalid settings: ")
    assert "ledger_log_snapshot_bytes" in lines[0] and "raise ledger_log_max_bytes" in lines[0]
