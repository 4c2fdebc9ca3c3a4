"""The code stays typed and linted: ``mypy`` (strict, see pyproject.toml) and ``ruff check``;
the tests are type-checked too, with the relaxations of :data:`TEST_MYPY_RELAXED`.

Both run as the developer would run them, from the repository root. A missing tool skips
the test on a developer machine and fails it when ``SWARM_GPU_REQUIRE_SERVICES=1`` (CI).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from tests.support.services import REPO_ROOT, services_required

TIMEOUT_S = 300


def run_tool(module: str, *args: str) -> None:
    if importlib.util.find_spec(module) is None:
        message = f"{module} is not installed for {sys.executable} (pip install -e '.[test]')"
        if services_required():
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    try:
        result = subprocess.run(
            [sys.executable, "-m", module, *args],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired as exc:
        output = b"".join(
            part.encode() if isinstance(part, str) else part
            for part in (exc.stdout, exc.stderr) if part
        )
        pytest.fail(f"`{module} {' '.join(args)}` ran for more than {TIMEOUT_S}s:\n"
                    f"{output.decode(errors='replace')}", pytrace=False)
    if result.returncode != 0:
        pytest.fail(f"`{module} {' '.join(args)}` exited {result.returncode}:\n"
                    f"{result.stdout}{result.stderr}", pytrace=False)


TEST_MYPY_RELAXED = (
    "--allow-untyped-defs", "--allow-incomplete-defs", "--allow-untyped-calls",
    "--check-untyped-defs",  # ...but every body is checked, annotated or not
    "--no-warn-return-any", "--allow-any-generics",  # fixtures hand out untyped values
    "--disable-error-code", "import-untyped",  # yaml, pynvml: no type hints
    "--follow-imports", "silent",  # the product is checked strictly by test_mypy_strict
)
"""How the tests differ from strict: pytest fixtures and parametrized tests may leave their
parameters unannotated; a new test file is covered without being listed anywhere."""


@pytest.mark.slow
def test_mypy_strict() -> None:
    run_tool("mypy", "allocator", "nodeagent", "hubplugin")


@pytest.mark.slow
def test_mypy_over_the_tests_and_the_benchmarks() -> None:
    run_tool("mypy", *TEST_MYPY_RELAXED, "tests", "bench")


BENCHMARKS = sorted(path.name for path in (REPO_ROOT / "bench").glob("*.py")
                    if path.name != "common.py")
"""The benchmark scripts (``common.py`` is their shared helpers)."""


@pytest.mark.parametrize("script", BENCHMARKS)
def test_each_benchmark_loads_and_says_how_to_run_it(script: str) -> None:
    """A benchmark is run by hand, not in CI: its imports and options are checked here, so a
    move of the code it imports cannot leave it broken until someone next runs it."""
    done = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / script), "--help"],
                          capture_output=True, text=True, timeout=60, cwd=REPO_ROOT, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout


def test_ruff() -> None:
    run_tool("ruff", "check", ".")
