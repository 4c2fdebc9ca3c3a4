"""The allocator's state machine: applies one inbound message at a time to memory.

No I/O and no clock: each call gets ``now`` and a :class:`~allocator.ledger.changes.Changes` to
fill, and returns the reply (or ``None`` for fire-and-forget node messages). The service
commits the changes, then sends the replies. If a commit fails, the service rebuilds the
engine's memory from the ledger (:meth:`Engine.load`), so memory never runs ahead of the disk.

Lease life (docs/design.md, flows): ``queued`` → ``granted`` (GPUs claimed) → ``bound`` (the node
saw the container start) → ``releasing`` (the hub stopped it) → ``released`` (the container
is gone). Every release records its reason.

The engine decides, the service acts: commands to node agents (stop a lease's container; the
hello that tells an agent what this allocator reads) go into the outbox
(:attr:`Engine.commands`, the hellos beside them), which the service takes once the batch that
decided them is committed (:meth:`Engine.take_agent_commands`), and forgets when the commit
fails.

:class:`Engine` (:mod:`allocator.engine.dispatch`) is a dispatcher over parts, each owning
its own state, that it builds once and calls per message, in order (a part calls only the
parts it was given). Which module holds which part: docs/design.md, "Module map".
"""

from allocator.engine.dispatch import Engine
from allocator.engine.state import CLOCK_SKEW_WARN_S, RECENT_FINAL_LEASES, Sender

__all__ = ["CLOCK_SKEW_WARN_S", "RECENT_FINAL_LEASES", "Engine", "Sender"]
