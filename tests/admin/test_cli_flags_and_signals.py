"""The command lines as an admin meets them: flags in either place, one line per failure, a
broker that must be named, and a start that a signal stops.

Each test runs the console scripts as child processes (``python -m``), against the real broker
or a port nothing listens on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import allocator
from tests.support import services
from tests.support.faults import allocator_env
from tests.support.ports import free_port
from tests.support.services import REPO_ROOT

ALLOCATOR = ["allocator.admin.cli"]
LEDGER = ["allocator.admin.ledger_cli"]


def environment(**extra: str) -> dict[str, str]:
    """This environment less every ``SWARM_GPU_*`` variable (nothing set), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SWARM_GPU_")}
    return {**env, **extra}


def run(module: list[str], args: list[str], env: dict[str, str]) -> tuple[int, list[str]]:
    result = subprocess.run([sys.executable, "-m", *module, *args], cwd=REPO_ROOT, env=env,
                            capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    return result.returncode, result.stderr.strip().splitlines()


def unreachable() -> str:
    return f"amqp://guest:guest@127.0.0.1:{free_port()}/"


@pytest.mark.parametrize("module, command, after", [
    (ALLOCATOR, ["inventory"], ["inventory", "-v"]),
    (LEDGER, ["drain", "gpu-a"], ["drain", "-v", "gpu-a"]),
    (LEDGER, ["booking", "list"], ["booking", "list", "-v"]),
])
def test_verbose_may_come_before_or_after_the_command(
        module: list[str], command: list[str], after: list[str]) -> None:
    for args in (["-v", *command], after):
        code, lines = run(module, [*args, "--amqp", unreachable(), "--timeout", "5"],
                          environment())
        assert code != 0, lines
        assert any(" DEBUG " in line for line in lines), (args, lines)  # -v took effect
    code, lines = run(module, [*command, "--amqp", unreachable(), "--timeout", "5"],
                      environment())
    assert code != 0 and len(lines) == 1, lines  # without -v: the one line


def test_serve_takes_verbose_after_the_command(tmp_path: Path) -> None:
    code, lines = run(ALLOCATOR, ["serve", "-v"], allocator_env(
        unreachable(), tmp_path / "ledger.sqlite", broker_wait_s=0))
    assert code == 1, lines
    assert any(" DEBUG " in line for line in lines), lines
    assert lines[-1].startswith("gpu-allocator: cannot reach the broker"), lines


def test_a_client_command_prints_one_line_not_the_libraries_log(
        rabbitmq: services.RabbitMQ) -> None:
    # A vhost that does not exist: aio-pika logs (INFO) that it reconnects before the error.
    url = (f"amqp://{rabbitmq.user}:{rabbitmq.password}@{rabbitmq.host}:{rabbitmq.port}/"
           f"no-such-vhost-{os.getpid()}")
    for module, args in ((ALLOCATOR, ["inventory"]), (LEDGER, ["status"])):
        code, lines = run(module, [*args, "--amqp", url, "--timeout", "5"], environment())
        assert code != 0 and len(lines) == 1, lines
        assert "aio_pika" not in lines[0] and "vhost" in lines[0], lines


@pytest.mark.parametrize("module, args, code, words", [
    (LEDGER, ["status"], 2,
     ["gpu-ledger: error: nothing to read the status from", "--ledger FILE",
      "SWARM_GPU_LEDGER_PATH", "--amqp URL", "SWARM_GPU_AMQP_URL", "SWARM_GPU_AMQP_URL_FILE"]),
    (LEDGER, ["status", "--topology", "gpu-a"], 2,
     ["gpu-ledger: error: no broker named", "--amqp URL", "SWARM_GPU_AMQP_URL"]),
    (LEDGER, ["drain", "gpu-a"], 2, ["gpu-ledger: error: no broker named", "--amqp URL"]),
    (LEDGER, ["release", "abc"], 2, ["gpu-ledger: error: no broker named"]),
    (LEDGER, ["booking", "list"], 2, ["gpu-ledger: error: no broker named"]),
    (LEDGER, ["check", "--live", "--ledger", "x.sqlite"], 2,
     ["gpu-ledger: error: no broker named"]),
    (ALLOCATOR, ["inventory"], 1,
     ["gpu-allocator: no broker named", "--amqp URL", "SWARM_GPU_AMQP_URL_FILE"]),
    (ALLOCATOR, ["leases"], 1, ["gpu-allocator: no broker named"]),
])
def test_with_nothing_set_a_command_says_what_to_set(
        module: list[str], args: list[str], code: int, words: list[str]) -> None:
    got, lines = run(module, args, environment())
    assert got == code and len(lines) == 1, lines
    for word in words:
        assert word in lines[0], (word, lines)


def test_status_with_a_ledger_named_needs_no_broker(tmp_path: Path) -> None:
    missing = tmp_path / "ledger.sqlite"
    code, lines = run(LEDGER, ["status"], environment(SWARM_GPU_LEDGER_PATH=str(missing)))
    assert (code, lines) == (2, [f"gpu-ledger: error: no ledger at {missing}"])


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_serve_while_it_waits_for_the_broker(
        tmp_path: Path, signum: signal.Signals) -> None:
    # broker_wait_s is the default 180 s: the signal, not the wait, must end the process.
    env = allocator_env(unreachable(), tmp_path / "ledger.sqlite")
    env.pop("SWARM_GPU_BROKER_WAIT_S", None)
    with subprocess.Popen([sys.executable, "-m", *ALLOCATOR, "serve"], cwd=REPO_ROOT, env=env,
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True) as process:
        try:
            assert process.stderr is not None
            first = process.stderr.readline()  # blocks until the first failed attempt is logged
            assert "not reachable (attempt 1" in first, first
            sent = time.monotonic()
            process.send_signal(signum)
            code = process.wait(timeout=30)
            took = time.monotonic() - sent
            rest = process.stderr.read().strip().splitlines()
        finally:
            if process.poll() is None:
                process.kill()
    assert code == 0, rest
    assert took < 3.0, f"serve took {took:.1f} s to stop after {signum.name}"
    assert rest[-1] == f"gpu-allocator: {signum.name} before the start was complete: stopped"


@pytest.mark.parametrize("module, prog", [(ALLOCATOR, "gpu-allocator"), (LEDGER, "gpu-ledger"),
                                          (["nodeagent"], "gpu-nodeagent")])
def test_version_is_the_release(module: list[str], prog: str) -> None:
    result = subprocess.run([sys.executable, "-m", *module, "--version"], cwd=REPO_ROOT,
                            env=environment(), capture_output=True, text=True, timeout=60,
                            check=True)
    assert result.stdout.strip() == f"{prog} {allocator.__version__}"
