"""The allocator's state machine: applies one inbound message at a time to memory.

No I/O and no clock: each call gets ``now`` and a :class:`~allocator.ledger.Changes` to
fill, and returns the reply (or ``None`` for fire-and-forget node messages). The service
commits the changes, then sends the replies. If a commit fails, the service throws this
engine away and rebuilds it from the ledger, so memory never runs ahead of the disk.

Lease life (docs/design.md, flows): ``queued`` → ``granted`` (GPUs claimed) → ``bound`` (the node
saw the container start) → ``releasing`` (the hub stopped it) → ``released`` (the container
is gone). Every release records its reason.

The engine decides, the service acts: commands to node agents (stop a lease's container) go
into the outbox :attr:`Engine.commands`, which the service sends once the batch that decided
them is committed, and forgets when the commit fails.

The engine is one class, :class:`Engine`, built from rooms of one concept each:

- :mod:`allocator.engine.state` - the memory (nodes, GPUs, leases, queue) and its rebuild from
  the ledger (:meth:`~allocator.engine.state.EngineState.load`);
- :mod:`allocator.engine.idle` - idle measured on the GPU: a bound lease's use, idle spells;
- :mod:`allocator.engine.views` - read-only answers: lease views, lookups, the inventory;
- :mod:`allocator.engine.outbox` - the stop-command outbox to node agents;
- :mod:`allocator.engine.leases` - the lease book: allocate, queue, grant, release, end;
- :mod:`allocator.engine.node_truth` - adoption of containers the ledger forgot, grant
  conflicts, the start fence;
- :mod:`allocator.engine.nodes` - node reconciliation: heartbeats, container events, drains;
- :mod:`allocator.engine.reclaim` - fair share in action: warn, withdraw and carry out
  reclaims and idle releases;
- :mod:`allocator.engine.dispatch` - :class:`Engine` itself: message dispatch and timers.
"""

from allocator.engine.dispatch import Engine
from allocator.engine.state import CLOCK_SKEW_WARN_S, RECENT_FINAL_LEASES, Sender

__all__ = ["CLOCK_SKEW_WARN_S", "RECENT_FINAL_LEASES", "Engine", "Sender"]
