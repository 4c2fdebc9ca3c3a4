"""docs/design.md's module map, and the allocator imports the package docstrings state, held to
the tree.

The map is the section ``## Module map``: blocks headed by a bold package path
(``**`allocator/`**``), each with a table whose first column names paths under that package.
Every ``.py`` module of ``allocator/``, ``nodeagent/`` and ``hubplugin/`` (recursively, less
``__init__.py`` and ``__main__.py``) must be named there, and every path named there must
exist. The node agent's and the hub plugin's docstrings each state the allocator modules the
package imports; that list must be exactly what their code imports.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from allocator import PUBLIC_SURFACE

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design.md"
PACKAGES = ("allocator", "nodeagent", "hubplugin")
LEFT_OUT = frozenset({"__init__.py", "__main__.py"})

BLOCK_HEADER = re.compile(r"^\*\*`(?P<package>[\w/]+/)`\*\*")
BACKTICKED = re.compile(r"`([^`]+)`")
ALLOCATOR_MODULE = re.compile(r"\ballocator(?:\.\w+)+")  # allocator.bookings.outlook too


def module_map_section(text: str) -> str:
    """The text of ``## Module map`` up to the next second-level heading."""
    match = re.search(r"^## Module map\n(?P<body>.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match is not None, "docs/design.md has no '## Module map' section"
    return match.group("body")


def named_paths(section: str) -> set[str]:
    """Every path the map names, relative to the repository: the first column of each table
    row, under the package of the block the row stands in."""
    paths: set[str] = set()
    package: str | None = None
    for line in section.splitlines():
        header = BLOCK_HEADER.match(line)
        if header is not None:
            package = header.group("package")
            continue
        if not line.startswith("|") or package is None:
            continue
        cells = line.strip().strip("|").split("|")
        for name in BACKTICKED.findall(cells[0]):
            paths.add(package + name.strip())
    return paths


def modules_on_disk() -> set[str]:
    return {
        path.relative_to(REPO).as_posix()
        for package in PACKAGES
        for path in (REPO / package).rglob("*.py")
        if path.name not in LEFT_OUT and "__pycache__" not in path.parts
    }


@pytest.fixture(scope="module")
def mapped() -> set[str]:
    return named_paths(module_map_section(DESIGN.read_text(encoding="utf-8")))


def test_the_map_parses_into_every_package(mapped: set[str]) -> None:
    for package in (*PACKAGES, "allocator/engine"):
        assert any(path.startswith(package + "/") for path in mapped), package


def test_every_module_is_in_the_map(mapped: set[str]) -> None:
    missing = sorted(modules_on_disk() - mapped)
    assert not missing, f"modules missing from docs/design.md's module map: {missing}"


def test_every_path_in_the_map_exists(mapped: set[str]) -> None:
    absent = sorted(path for path in mapped if not (REPO / path).exists())
    assert not absent, f"docs/design.md's module map names paths that do not exist: {absent}"


def test_the_map_names_no_left_out_file(mapped: set[str]) -> None:
    named = sorted(path for path in mapped if Path(path).name in LEFT_OUT)
    assert not named, f"the map says it leaves these out: {named}"


def is_module(dotted: str) -> bool:
    """Whether ``dotted`` (``allocator.amqp.broker``) names a module or a package of the tree."""
    path = REPO.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def allocator_imports(package: str) -> set[str]:
    """The allocator modules a package's code imports (``from allocator.amqp import broker``
    counts as ``allocator.amqp.broker``, as it is a module)."""
    found: set[str] = set()
    for path in (REPO / package).rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found.update(
                    alias.name for alias in node.names
                    if alias.name == "allocator" or alias.name.startswith("allocator.")
                )
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                    node.module == "allocator" or node.module.startswith("allocator.")):
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    found.add(submodule if is_module(submodule) else node.module)
    return found


def stated_imports(package: str) -> set[str]:
    """The allocator modules the package docstring's paragraph on its imports names."""
    init = REPO / package / "__init__.py"
    docstring = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
    assert docstring, f"{package}/__init__.py has no docstring"
    paragraphs = [p for p in docstring.split("\n\n") if "It imports" in p]
    assert len(paragraphs) == 1, (
        f"{package}/__init__.py: expected one paragraph starting 'It imports', "
        f"found {len(paragraphs)}"
    )
    return set(ALLOCATOR_MODULE.findall(paragraphs[0]))


@pytest.mark.parametrize("package", ["nodeagent", "hubplugin"])
def test_a_packages_allocator_imports_are_the_ones_its_docstring_states(package: str) -> None:
    imported = allocator_imports(package)
    stated = stated_imports(package)
    assert imported, f"{package} imports nothing of the allocator? the parser is broken"
    assert imported == stated, (
        f"{package}/__init__.py states {sorted(stated)}; the code imports {sorted(imported)}"
    )


@pytest.mark.parametrize("module", sorted(PUBLIC_SURFACE))
def test_a_surface_module_loads_only_the_surface(module: str) -> None:
    """Imported alone, in a fresh interpreter, a module of the public surface pulls in no other
    allocator module: its package's ``__init__`` imports nothing, and it imports only surface
    modules. Otherwise the agent or the hub would load the engine or the ledger with it."""
    code = (f"import importlib, sys; importlib.import_module({module!r}); "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('allocator'))))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    loaded = set(done.stdout.split())
    assert module in loaded
    assert loaded <= {"allocator", *PUBLIC_SURFACE}, sorted(loaded - PUBLIC_SURFACE)


def test_the_surface_names_only_modules_of_the_tree() -> None:
    assert not [m for m in PUBLIC_SURFACE if not is_module(m)]
