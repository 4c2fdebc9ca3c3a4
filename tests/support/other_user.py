"""Running a command of the checkout as another (unprivileged) user.

A test that drops to another uid cannot assume that user can read the checkout: a clone in a
``mktemp -d`` folder (mode 0700) or in ``/root`` is closed to everyone but its owner. So the
test hands the other user a copy of just the files it runs, in a folder that user owns, under
a parent every user may pass through.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.services import REPO_ROOT

NOBODY = 65534
"""The uid (and gid) of ``nobody``: a user with no rights of its own on this machine."""


def passable_by_all(folder: Path) -> bool:
    """Whether every user may pass through ``folder`` and each folder above it."""
    return all(part.stat().st_mode & stat.S_IXOTH for part in (folder, *folder.parents))


def open_parent() -> Path:
    """A temporary-files folder that every user may pass through: the system's, or /tmp."""
    for candidate in (Path(tempfile.gettempdir()), Path("/tmp"), Path("/var/tmp")):
        if candidate.is_dir() and passable_by_all(candidate.resolve()):
            return candidate.resolve()
    raise RuntimeError("no temporary folder here may be passed through by every user")


@contextmanager
def copy_for(uid: int, files: Iterable[str]) -> Iterator[Path]:
    """A folder owned by ``uid`` holding copies of ``files`` (files or folders, relative to
    the checkout, kept at the same relative place); removed afterwards.

    The copy keeps each file's mode, so scripts stay executable.
    """
    root = Path(tempfile.mkdtemp(prefix="swarm-gpu-as-other-user-", dir=open_parent()))
    try:
        for name in files:
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if (REPO_ROOT / name).is_dir():
                shutil.copytree(REPO_ROOT / name, target)
            else:
                shutil.copy2(REPO_ROOT / name, target)
        for folder, _, names in os.walk(root):
            os.chown(folder, uid, uid)
            for name in names:
                os.chown(Path(folder) / name, uid, uid)
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)
