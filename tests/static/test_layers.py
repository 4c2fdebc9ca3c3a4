"""The floors of ``allocator/``: every module imports only its own floor and the floors below.

:data:`FLOORS` is the order, lowest first, and the one place it is written;
docs/design.md's module map states it in the same order (checked here too). Every import
counts: at the top of a module, inside a function, under ``if TYPE_CHECKING:``, relative.
A module on a floor not listed fails too, so a new package is placed when it is made.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.imports import Imported, imports_in, imports_of, module_name

REPO = Path(__file__).resolve().parents[2]
ALLOCATOR = REPO / "allocator"
DESIGN = REPO / "docs" / "design.md"

FLOORS = (
    "allocator",       # the package itself: its version and PUBLIC_SURFACE, importing nothing
    "tasks",           # bounded shutdown of background tasks
    "settings_files",  # how a process reads its settings
    "wire",            # the messages and the rules both ends of the wire share
    "amqp",            # the broker: addresses, the RPC client, the declarer
    "logs",            # how every process logs (hides the broker URL's password)
    "metrics",         # counters, the figures a scrape reads, their export, the endpoint
    "config",          # the allocator's settings, over the surface's settings above
    "bookings",        # pure: bookings, their windows, admission, guarantees
    "placement",       # pure: where a demand fits, fair share (reads the guarantees)
    "ledger",          # the SQLite ledger, its rows (placement's cluster), its log
    "engine",          # the state machine: fills the ledger's change set
    "service",         # the process: broker, engine, ledger, metrics wired
    "admin",           # the admins' commands: over everything else
    "deploy",          # swarm-gpu: a site file to a running stack, over the Swarm's CLI
)
"""The floors of ``allocator/``, lowest first: a module of one may import its own floor and
the floors below, never one above. A floor is the first name under ``allocator``
(``allocator.engine.leases`` is on ``engine``); the package's own ``__init__`` is
``allocator``."""


def floor_of(module: str) -> str:
    """The floor of an allocator module (``allocator.engine.leases`` -> ``engine``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def allocator_modules() -> list[Path]:
    return sorted(path for path in ALLOCATOR.rglob("*.py") if "__pycache__" not in path.parts)


def back_edges(path: Path, imports: list[Imported]) -> list[str]:
    """Each of ``imports`` (made by the module at ``path``) that reaches a floor above the
    module's own, in words: where, which module, which floors."""
    importer = module_name(path, REPO)
    own = FLOORS.index(floor_of(importer))
    found = []
    for imported in imports:
        if imported.target != "allocator" and not imported.target.startswith("allocator."):
            continue
        theirs = floor_of(imported.target)
        if FLOORS.index(theirs) > own:
            found.append(f"{path.relative_to(REPO)}:{imported.line}: {importer} imports "
                         f"{imported.target}: floor {floor_of(importer)!r} reaches up to "
                         f"{theirs!r}")
    return found


def test_every_module_stands_on_a_listed_floor() -> None:
    unplaced = sorted({floor_of(module_name(path, REPO)) for path in allocator_modules()}
                      - set(FLOORS))
    assert not unplaced, f"put these in FLOORS (tests/static/test_layers.py): {unplaced}"


def test_no_import_reaches_a_floor_above() -> None:
    found = [edge for path in allocator_modules()
             for edge in back_edges(path, list(imports_of(path, REPO)))]
    assert not found, "imports up the floors of allocator/:\n" + "\n".join(found)


def test_every_kind_of_import_is_seen() -> None:
    """The walk finds imports in functions, under TYPE_CHECKING, and relative ones: a back
    edge written any of these ways fails :func:`test_no_import_reaches_a_floor_above`."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import declare\n"
        "if TYPE_CHECKING:\n"
        "    from allocator.engine import Engine\n"
        "def late() -> None:\n"
        "    import allocator.service.app\n"
        "    from ..admin import reports\n"
    )
    path = ALLOCATOR / "amqp" / "client.py"
    imports = list(imports_in(source, "allocator.amqp.client", is_package=False, root=REPO))
    assert [(i.line, i.target) for i in imports if i.target.startswith("allocator")] == [
        (2, "allocator.amqp.declare"), (4, "allocator.engine"),
        (6, "allocator.service.app"), (7, "allocator.admin.reports")]
    edges = back_edges(path, imports)
    assert len(edges) == 3
    assert edges[0] == ("allocator/amqp/client.py:4: allocator.amqp.client imports "
                        "allocator.engine: floor 'amqp' reaches up to 'engine'")


@pytest.mark.parametrize("importer, imported", [("engine", "ledger"), ("admin", "service"),
                                                ("config", "metrics")])
def test_a_floor_above_may_import_one_below(importer: str, imported: str) -> None:
    path = ALLOCATOR / importer / "x.py"
    assert not back_edges(path, [Imported(1, f"allocator.{imported}.y")])
    assert back_edges(ALLOCATOR / imported / "x.py", [Imported(1, f"allocator.{importer}.y")])


def test_the_design_states_the_same_order() -> None:
    text = DESIGN.read_text(encoding="utf-8")
    match = re.search(r"^Floors, lowest first: (?P<floors>.*?)\.$", text,
                      re.MULTILINE | re.DOTALL)
    assert match is not None, "docs/design.md states no 'Floors, lowest first: ...' line"
    stated = tuple(re.findall(r"`([\w.]+)`", match.group("floors")))
    assert stated == FLOORS, f"docs/design.md states {stated}; FLOORS is {FLOORS}"
