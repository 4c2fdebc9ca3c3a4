"""TCP ports for the servers the tests start: one helper, so that two servers of one run never
get the same port.

``bind(("127.0.0.1", 0))`` and closing the socket does not reserve the port: the kernel may
hand the same one to the next caller, and a test that asks twice (a hub's public port and its
proxy's API port) can get it twice. Here each process counts through its own block of ports
below the kernel's ephemeral range (no outgoing connection takes them), one block per
pytest-xdist worker, and returns the next one that is free now. The blocks (28000-32499) stay
clear of the ports the stack and the demo use (15671-15682, 18800+, 20000-27990, 25672+).
"""

from __future__ import annotations

import itertools
import os
import re
import socket
import threading

FIRST_PORT = 28000
BLOCK_SIZE = 500
BLOCKS = 9
"""28000 + 9 * 500 = 32500, under Linux's default ephemeral range (32768-60999)."""


def _block() -> int:
    """This process's block: its xdist worker's number (``gw3`` is 3), 0 outside xdist."""
    found = re.fullmatch(r"gw(\d+)", os.environ.get("PYTEST_XDIST_WORKER", ""))
    return int(found.group(1)) % BLOCKS if found else 0


_lock = threading.Lock()
_next = itertools.cycle(range(FIRST_PORT + _block() * BLOCK_SIZE,
                              FIRST_PORT + (_block() + 1) * BLOCK_SIZE))


def _free_now(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, and that this process has not
    handed out in its last ``BLOCK_SIZE`` calls."""
    with _lock:
        for _ in range(BLOCK_SIZE):
            port = next(_next)
            if _free_now(port):
                return port
    raise RuntimeError(f"no free TCP port in this worker's block of {BLOCK_SIZE}")
