"""Site files for the deploy tests: a valid one to start from, written where a test says."""

from __future__ import annotations

from pathlib import Path

SITE = """\
secrets = "secrets"

[stack]
name = "lab"
files = ["stack.yml"]

[hub]
domain = "hub.example.org"
https_port = 8443

[storage]
driver = "local"
options = { type = "nfs", o = "addr=10.0.0.5,rw", device = ":/export/home" }

[images]
registry = "registry.example.org:5000"
tag = "1.2.3"

[[nodes]]
name = "gpu-1"
address = "10.0.0.11"
roles = ["manager", "hub", "broker"]

[[nodes]]
name = "gpu-2"
address = "10.0.0.12"
roles = ["allocator", "gpu"]

[[nodes]]
name = "gpu-3"
address = "10.0.0.13"
roles = ["allocator", "gpu"]
"""
"""Three GPU servers: a manager with the hub and the broker, two GPU nodes with the ledger."""


def write_site(folder: Path, text: str = SITE) -> Path:
    """``text`` as ``folder/site.toml``."""
    path = folder / "site.toml"
    path.write_text(text, encoding="utf-8")
    return path
