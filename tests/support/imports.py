"""What a Python file imports, read from its syntax tree: every ``import`` and ``from ...
import`` statement, those inside functions and ``if TYPE_CHECKING:`` blocks too, relative ones
resolved to the absolute module. For the static tests that hold the tree's import rules."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Imported:
    """One module one statement imports."""

    line: int
    target: str
    """The absolute dotted name: ``from allocator.amqp import broker`` imports
    ``allocator.amqp.broker`` (a module), ``from allocator.amqp.broker import redact``
    imports ``allocator.amqp.broker``."""


def module_name(path: Path, root: Path) -> str:
    """The dotted name of the module at ``path`` under ``root`` (a package's ``__init__.py``
    is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(dotted: str, root: Path) -> bool:
    """Whether ``dotted`` names a module or a package of the tree at ``root``."""
    path = root.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports_in(source: str, module: str, *, is_package: bool, root: Path) -> Iterator[Imported]:
    """Every module ``source`` (the text of ``module``) imports, in the order written."""
    # The package a relative import starts from: the module itself if it is a package.
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Imported(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            submodules = [f"{target}.{alias.name}" for alias in node.names
                          if is_module(f"{target}.{alias.name}", root)]
            # ``from package import module`` imports the module; names of the package
            # itself (``from allocator import __version__``) import the package.
            if len(submodules) < len(node.names):
                yield Imported(node.lineno, target)
            for submodule in submodules:
                yield Imported(node.lineno, submodule)


def imports_of(path: Path, root: Path) -> Iterator[Imported]:
    """Every module the file at ``path`` (under ``root``, the import root) imports."""
    yield from imports_in(path.read_text(encoding="utf-8"), module_name(path, root),
                          is_package=path.name == "__init__.py", root=root)
