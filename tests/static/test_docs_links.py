"""Every link and every repository path the README and docs/ name leads somewhere.

A relative link must name a file (or folder) of the repository, and its ``#anchor`` a heading
of that file, by GitHub's rule for heading anchors. A path in backticks that starts with one
of the repository's top-level folders (``allocator/wire/protocol.py``, ``tests/faults/...``,
``scripts/cluster up``) must exist; a glob (``tests/faults/test_fault_*.py``) must match
something. Code blocks are commands and output, not references, and are left out.
"""

from __future__ import annotations

import re
import unicodedata
from functools import cache
from pathlib import Path

import pytest

from tests.support.services import REPO_ROOT

DOCUMENTS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]

TOP_FOLDERS = ("allocator", "nodeagent", "hubplugin", "tests", "scripts", "compose", "docs",
               "bench", ".ci")

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
REPO_PATH = re.compile(rf"^(?:{'|'.join(re.escape(f) for f in TOP_FOLDERS)})/[\w.*/-]*$")


def prose(text: str) -> str:
    """``text`` with its fenced code blocks blanked (line numbers kept)."""
    return FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation dropped (not ``-`` or
    ``_``), each space a ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = text.strip().lower()
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LNM")
    return kept.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """The anchors of a markdown file's headings; a repeated heading gets ``-1``, ``-2``..."""
    seen: dict[str, int] = {}
    found = set()
    for match in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", prose(path.read_text()), re.M):
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return frozenset(found)


def line_of(text: str, at: int) -> int:
    return text.count("\n", 0, at) + 1


def broken_links(document: Path, root: Path = REPO_ROOT) -> list[str]:
    """Each link of ``document`` that leads nowhere, as ``FILE:LINE: TARGET (why)``."""
    text = prose(document.read_text())
    broken = []
    for match in LINK.finditer(text):
        target = match.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        where = f"{document.relative_to(root)}:{line_of(text, match.start())}: {target}"
        path = (document.parent / path_part).resolve() if path_part else document
        if not path.exists():
            broken.append(f"{where} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{where} (no such heading)")
    return broken


def missing_paths(document: Path, root: Path = REPO_ROOT) -> list[str]:
    """Each repository path in backticks in ``document`` that does not exist."""
    text = prose(document.read_text())
    missing = []
    for match in CODE_SPAN.finditer(text):
        for token in match.group(2).split():
            token = token.split("::")[0].split("#")[0].rstrip(":,.;)")
            if not REPO_PATH.match(token) or "..." in token:
                continue
            exists = any(root.glob(token)) if "*" in token else (root / token).exists()
            if not exists:
                missing.append(f"{document.relative_to(root)}:"
                               f"{line_of(text, match.start())}: {token}")
    return missing


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file_and_heading(document: Path) -> None:
    assert not broken_links(document)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_repository_path_in_backticks_exists(document: Path) -> None:
    assert not missing_paths(document)


@pytest.mark.parametrize("heading, anchor", [
    ("## Fair share: guarantees, borrowing, idle GPUs",
     "fair-share-guarantees-borrowing-idle-gpus"),
    ("### 1. Back up the ledger", "1-back-up-the-ledger"),
    ("## Replicas on different nodes (the replicated ledger log)",
     "replicas-on-different-nodes-the-replicated-ledger-log"),
    ("## Processes on a GPU: verified release, outside use, slice budgets",
     "processes-on-a-gpu-verified-release-outside-use-slice-budgets"),
    ("### `gpu-ledger` and the [booking](x.md) request", "gpu-ledger-and-the-booking-request"),
    ("## Add or remove a GPU node", "add-or-remove-a-gpu-node"),
])
def test_anchors_follow_githubs_rule(heading: str, anchor: str) -> None:
    assert slug(heading.lstrip("#").strip()) == anchor


def test_the_checks_find_a_broken_link_and_path(tmp_path: Path) -> None:
    # The checks themselves, on a small tree with known faults.
    for name in ("allocator/wire/protocol.py", "tests/faults/test_fault_a.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("# Design\n\n## Module map\n")
    document = tmp_path / "docs" / "page.md"
    document.write_text("# Title\n\n[ok](#title) [bad](#nowhere) [file](design.md#module-map)\n"
                        "[gone](design.md#no-such) [missing](nothing.md) [up](../allocator/)\n"
                        "`allocator/wire/protocol.py` `allocator/protocol.py` "
                        "`tests/faults/test_fault_*.py` `tests/test_fault_*.py`\n"
                        "```sh\n[not a link](nothing.md) `allocator/none.py`\n```\n")
    assert broken_links(document, tmp_path) == [
        "docs/page.md:3: #nowhere (no such heading)",
        "docs/page.md:4: design.md#no-such (no such heading)",
        "docs/page.md:4: nothing.md (no such file)"]
    assert missing_paths(document, tmp_path) == [
        "docs/page.md:5: allocator/protocol.py", "docs/page.md:5: tests/test_fault_*.py"]
