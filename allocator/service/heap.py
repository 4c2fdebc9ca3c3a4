"""The engine's rebuilt memory kept out of Python's cycle collector.

A full collection walks every object the process tracks. An allocator that has loaded a
ledger of 1,000 hosts x 8 GPUs and 10,000 leases tracks about 175,000, and a full collection
of them stalls the event loop for about 110 ms (``bench/engine.py``, ``full_collection_ms``):
every request waiting meanwhile waits for it, and Python starts one whenever enough objects
have survived since the last. Nearly all of those objects are the state just rebuilt from
the ledger, which lives until the next rebuild and holds no garbage cycles worth finding.

:func:`settle_after_rebuild` collects once, then moves every surviving object to the
collector's permanent generation (:func:`gc.freeze`), which no later collection walks.
Objects frozen are still freed by reference counting when the engine drops them; only a
reference cycle among them would outlive its use, until the next rebuild, which thaws
everything first so that the state it replaces is collected.

Process-wide: only a process that is nothing but an allocator may do this (the ``serve``
command, :attr:`allocator.service.AllocatorService` with ``freeze_heap``), never a library
caller or a test process that runs an allocator beside other code.
"""

from __future__ import annotations

import gc


def settle_after_rebuild() -> None:
    """Collect what the rebuild left behind, then keep every surviving object out of later
    collections (see the module's docstring)."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
