"""`gpu-ledger` run as a subprocess, and the one-line errors it answers with."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Run:
    """What a CLI run did."""

    rc: int
    out: str
    err: str

    def json(self):
        return json.loads(self.out)


async def gpu_ledger(*args: str | Path, env: dict[str, str] | None = None,
                     limit_s: float = 60) -> Run:
    """Run ``gpu-ledger`` in a subprocess without blocking the allocator's event loop."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "allocator.admin.ledger_cli", *map(str, args), cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "COLUMNS": "200", **(env or {})})
    out, err = await asyncio.wait_for(process.communicate(), limit_s)
    assert process.returncode is not None
    return Run(process.returncode, out.decode(), err.decode())


def assert_one_line_error(run: Run, *words: str) -> None:
    assert run.rc == 2, run
    lines = run.err.strip().splitlines()
    assert len(lines) == 1, run.err
    assert lines[0].startswith("gpu-ledger: error: ")
    for word in words:
        assert word in lines[0], lines[0]
