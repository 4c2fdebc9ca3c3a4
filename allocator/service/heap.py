"""The engine's rebuilt memory kept out of Python's cycle collector.

A full collection walks every object the process tracks. An allocator that has loaded a
ledger of 1,000 hosts x 8 GPUs and 10,000 leases tracks about 187,000, and a full collection
of them stalls the event loop for 130-145 ms (``bench/engine.py``, ``full_collection_ms``):
every request waiting meanwhile waits for it, and Python starts one whenever enough objects
have survived since the last. Nearly all of those objects are the state rebuilt from the
ledger, which lives until the next rebuild and holds no garbage cycles worth finding.

:func:`rebuilding` wraps a rebuild. While the state is being made no collection runs (every
object made then is alive: each collection during a load walked the growing state for
nothing). Then every surviving object moves to the collector's permanent generation
(:func:`gc.freeze`), which no later collection walks. Frozen objects are still freed by
reference counting when the engine drops them; only a reference cycle among them outlives
its use, until the next rebuild, which first thaws everything and collects once, so that the
state it replaced is freed.

Process-wide: only a process that is nothing but an allocator may do this (the ``serve``
command: :class:`allocator.service.AllocatorService` with ``freeze_heap``), never a library
caller or a test process that runs an allocator beside other code.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def rebuilding() -> Iterator[None]:
    """Around one rebuild of the engine's memory: no collection while it is made; once it is
    made (and only then), what an earlier rebuild froze is collected if it is garbage, and
    what is alive now is frozen (see the module's docstring)."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()
    if gc.get_freeze_count():
        gc.unfreeze()
        gc.collect()
    gc.freeze()
