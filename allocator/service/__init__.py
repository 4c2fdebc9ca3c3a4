"""The allocator process: consumes the inbound queue, applies, commits, then replies.

One task (the applier) takes up to ``batch_max`` requests and ``batch_max`` node messages at
a time (requests go ahead of node messages that arrived before them; each kind keeps its
arrival order: docs/design.md "Decisions"), applies them to the
:class:`~allocator.engine.Engine`, commits the whole batch to the ledger in one transaction,
and only then sends the commands it decided, the replies and the acknowledgements. Timers are
ticks put into the same inbox, so they are serialized with messages and need no locks.

The parts, each owning its own state (the service wires them, :mod:`.app`):

- :mod:`.connect`: the broker connection, its retries and broker nodes, following the
  replicated ledger log, the consumer; :mod:`.declare`: what is declared on the broker;
- :mod:`.intake`: deliveries and ticks into the inbox (:mod:`.inbox`, pure), batches out,
  stale deliveries dropped;
- :mod:`.standby`: whether this allocator is a standby, and how it takes over;
- :mod:`.batch`: the applier: decide (:mod:`.decide`, with :mod:`.decided`), commit (the
  engine's memory and the ledger's version: :mod:`.memory`), answer; a poisoned message, a
  fenced batch, a failed commit;
- :mod:`.answers`: replies, acknowledgements and the pushes to waiting clients
  (:mod:`.waiters`, pure); :mod:`.commands`: stop commands to node agents.
"""

from allocator.service.app import AllocatorService
from allocator.service.declare import declare_topology

__all__ = ["AllocatorService", "declare_topology"]
