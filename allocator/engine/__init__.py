"""The allocator's state machine: applies one inbound message at a time to memory.

No I/O and no clock: each call gets ``now`` and a :class:`~allocator.ledger.store.Changes` to
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

:class:`Engine` is a dispatcher over parts, each owning its own state, that it builds once and
calls per message, in order (a part calls only the parts it was given):

- :mod:`allocator.engine.dispatch` - :class:`Engine`: builds the parts, routes each message to
  them, runs the timers, rebuilds memory from the ledger;
- :mod:`allocator.engine.state` - what every part shares: :class:`Sender`, the limits, the log;
- :mod:`allocator.engine.fence` - ``StartFence``: no grant on a node before its first complete
  report after a fenced start;
- :mod:`allocator.engine.nodes` - ``NodeReports``: each node's newest report, liveness, who
  may report for it, drains;
- :mod:`allocator.engine.gpus` - ``GpuInventory``: a node's GPUs as its report lists them;
- :mod:`allocator.engine.placement` - ``Placer``: where a demand fits now, the model catalog;
- :mod:`allocator.engine.idle` - ``IdleWatch``: a lease's use on the GPU, idle spells, budgets;
- :mod:`allocator.engine.processes` - ``ProcessWatch``: each GPU's processes against its
  leases: drains after a lease's end, stuck processes, outside use, outside grants;
- :mod:`allocator.engine.outbox` - ``CommandOutbox``: stop commands and hellos to node agents;
- :mod:`allocator.engine.leases` - ``LeaseBook``: the leases, the queue, the timers, and the
  transitions grant, bind, release, end;
- :mod:`allocator.engine.requests` - ``LeaseRequests``: allocate, release, serve the queue;
- :mod:`allocator.engine.node_truth` - ``NodeTruth``: adoption of containers the ledger
  forgot, grant conflicts;
- :mod:`allocator.engine.containers` - ``NodeReconciliation``: container listings and events
  held against the lease book;
- :mod:`allocator.engine.booking_windows` - ``BookingWindows``: the bookings' guarantees now,
  computed at their boundaries, the leases they cover and the room they have left;
- :mod:`allocator.engine.booking_alerts` - ``BookingShortWatch``: the admin told when a
  booking becomes short of GPUs or whole again;
- :mod:`allocator.engine.reclaim` - ``Reclaimer``: fair share in action: warn, withdraw and
  carry out reclaims and idle releases (and warn before a booking's window);
- :mod:`allocator.engine.views` - ``Views``: read-only answers (inventory, quota, leases,
  status, queue), and the figures a metrics scrape reads (:meth:`Engine.figures`).
"""

from allocator.engine.dispatch import Engine
from allocator.engine.state import CLOCK_SKEW_WARN_S, RECENT_FINAL_LEASES, Sender

__all__ = ["CLOCK_SKEW_WARN_S", "RECENT_FINAL_LEASES", "Engine", "Sender"]
