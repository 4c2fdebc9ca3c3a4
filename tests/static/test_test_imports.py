"""No test module imports another: what tests share lives in ``tests/support/`` (helpers, one
module per concept) or in a ``conftest.py`` (fixtures, which pytest hands out by name).

Importing a test module runs its module-level code, makes the fixtures it imports the
importer's own, and ties one test's helpers to another test's file. Every import under
``tests/`` and ``bench/`` (the benchmarks reuse the tests' helpers) counts, inside functions
too: the only ``tests.`` modules one may import are ``tests.support`` and its modules.
"""

from __future__ import annotations

from pathlib import Path

from tests.support.imports import Imported, imports_in, imports_of, module_name

REPO = Path(__file__).resolve().parents[2]
CHECKED = (REPO / "tests", REPO / "bench")
SHARED = "tests.support"


def reaches_a_test_module(imported: Imported) -> bool:
    """Whether ``imported`` is a module of ``tests/`` other than ``tests.support``'s."""
    target = imported.target
    if target != "tests" and not target.startswith("tests."):
        return False
    return target != SHARED and not target.startswith(SHARED + ".")


def modules_checked() -> list[Path]:
    return sorted(path for folder in CHECKED for path in folder.rglob("*.py")
                  if "__pycache__" not in path.parts)


def test_no_test_module_imports_another() -> None:
    found = [f"{path.relative_to(REPO)}:{imported.line}: {module_name(path, REPO)} imports "
             f"{imported.target} (move what it needs into tests/support/ or a conftest.py)"
             for path in modules_checked()
             for imported in imports_of(path, REPO) if reaches_a_test_module(imported)]
    assert not found, "test modules importing other test modules:\n" + "\n".join(found)


def test_each_way_of_reaching_a_test_module_is_seen() -> None:
    source = (
        "from tests.support.common import wait_until\n"
        "from tests.hub import test_hub_e2e\n"
        "from ..wire.test_compatibility import RawClient\n"
        "def late() -> None:\n"
        "    import tests.conftest\n"
    )
    imports = list(imports_in(source, "tests.bookings.test_x", is_package=False, root=REPO))
    assert [(i.line, i.target) for i in imports if reaches_a_test_module(i)] == [
        (2, "tests.hub.test_hub_e2e"), (3, "tests.wire.test_compatibility"),
        (5, "tests.conftest")]
