"""The release is written in one place, and what names it agrees.

``allocator.__version__`` is the release; ``pyproject.toml`` reads it (a dynamic version), so
the package, the ``client-release`` header and the images cannot disagree. The image tags that
the stack file, the Dockerfile and the docs name are that release (a doc naming an older tag
would have an admin deploy the wrong code), every git tag they name exists, and every deploy
in docs/operations.md keeps step 8's image variables.
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from pathlib import Path

import allocator
from tests.support.services import REPO_ROOT, require_service

IMAGE_TAG = re.compile(r"\bswarm-gpu(?:-[a-z]+)?:([A-Za-z0-9][A-Za-z0-9_.-]*)")
"""An image of the project with a literal tag (``swarm-gpu:0.3.0``, ``swarm-gpu-hub:0.3.0``);
a tag from a variable (``swarm-gpu:$VERSION``) is not literal."""

GIT_TAG = re.compile(r"\bgit\s+(?:show|checkout|diff|log|switch)\b[^\n`]*?\b(v\d+\.\d+\.\d+)\b")
"""A git tag a command in the docs names (``git show v0.1.0:compose/stack.yml``)."""

RELEASE_COMMIT = re.compile(r"--grep[= ]'\^Release (\d+\.\d+\.\d+)'")
"""A release commit the docs find by its message (``git log --grep '^Release 0.2.0'``)."""


def named_files() -> list[Path]:
    """What an admin reads and deploys: the README, docs/ and every file of compose/."""
    files = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    files += sorted(path for path in (REPO_ROOT / "compose").rglob("*") if path.is_file())
    return files


def read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:  # an image, a binary
        return ""


def git(*args: str) -> str:
    try:
        result = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                                timeout=60, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        require_service("git history", f"not a git checkout with its history: {exc}")
    return result.stdout


def test_the_version_is_written_once() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"], "pyproject.toml names a version of its own"
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {
        "attr": "allocator.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", allocator.__version__)
    literal = re.findall(r'^__version__ = "(.*)"$',
                         (REPO_ROOT / "allocator" / "__init__.py").read_text(), re.M)
    assert literal == [allocator.__version__]  # a literal: setuptools reads it without import


def test_the_changelog_is_headed_by_this_release() -> None:
    top = re.search(r"^## (\S+)", (REPO_ROOT / "CHANGELOG.md").read_text(), re.M)
    assert top is not None and top.group(1) == allocator.__version__


def test_every_image_tag_named_is_this_release() -> None:
    wrong = []
    for path in named_files():
        for number, line in enumerate(read(path).splitlines(), start=1):
            for tag in IMAGE_TAG.findall(line):
                if tag != allocator.__version__:
                    wrong.append(f"{path.relative_to(REPO_ROOT)}:{number}: {tag}")
    assert not wrong, f"image tags other than {allocator.__version__}: {wrong}"


def test_the_stack_file_and_the_build_name_this_release() -> None:
    # Not only "no wrong tag": the defaults are there, with this release's tag.
    stack = (REPO_ROOT / "compose" / "stack.yml").read_text()
    assert f"${{SWARM_GPU_IMAGE:-swarm-gpu:{allocator.__version__}}}" in stack
    assert f"${{SWARM_GPU_HUB_IMAGE:-swarm-gpu-hub:{allocator.__version__}}}" in stack
    build = (REPO_ROOT / "docs" / "operations.md").read_text()
    assert f"-t registry.example.org/swarm-gpu:{allocator.__version__} ." in build


def test_every_git_tag_and_release_commit_named_exists() -> None:
    named = {(path, tag) for path in named_files() for tag in GIT_TAG.findall(read(path))}
    releases = {(path, version) for path in named_files()
                for version in RELEASE_COMMIT.findall(read(path))}
    tags = set(git("tag", "--list").split())
    missing = [f"{path.relative_to(REPO_ROOT)}: git tag {tag}" for path, tag in sorted(named)
               if tag not in tags]
    for path, version in sorted(releases):
        if not git("log", "--format=%h", f"--grep=^Release {re.escape(version)}\\b"):
            missing.append(f"{path.relative_to(REPO_ROOT)}: no commit 'Release {version}'")
    assert not missing, missing


def test_every_deploy_in_the_docs_keeps_the_images() -> None:
    # A deploy without step 8's variables falls back to the stack file's bare default tags,
    # which no node can pull from a registry.
    text = (REPO_ROOT / "docs" / "operations.md").read_text()
    blocks = re.findall(r"^```sh\n(.*?)^```", text, re.M | re.S)
    deploys = [block for block in blocks if "docker stack deploy" in block]
    assert len(deploys) >= 3
    for block in deploys:
        assert ". ./swarm-gpu.env" in block or "SWARM_GPU_IMAGE=" in block, block
        assert "--with-registry-auth" in block, block
