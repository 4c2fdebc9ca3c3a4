"""swarm-gpu allocator: GPU leases over AMQP RPC from a SQLite ledger.

Public surface for other parts (:data:`PUBLIC_SURFACE`):

- :mod:`allocator.wire`, all of it: the messages (:mod:`~allocator.wire.protocol`), the broker
  names (:mod:`~allocator.wire.topology`), which spellings mean which GPU model
  (:mod:`~allocator.wire.model_names`), the label and environment of a lease's container
  (:mod:`~allocator.wire.lease_container`), what a heartbeat delta carries and how it applies
  (:mod:`~allocator.wire.heartbeat_delta`), how many GPUs of one request one host can give
  (:mod:`~allocator.wire.capacity`: the rule the hub's form checks and the policy share), how
  one host's GPUs are joined (:mod:`~allocator.wire.interconnect`);
- :mod:`allocator.amqp.broker` (broker addresses: one URL naming several broker nodes),
  :mod:`allocator.amqp.client` (the RPC client) and :mod:`allocator.amqp.declare` (the one
  declarer of exchanges and queues, and the refusals a caller lives with);
- :mod:`allocator.placement.gpu_sets`: which GPUs of a host a request gets by their links
  (the best link the hub's form shows and the placement's choice are this one rule);
- :mod:`allocator.metrics.endpoint`: the HTTP endpoint of a Prometheus registry, its token;
- :mod:`allocator.bookings.outlook`: what one user sees of bookings;
- :mod:`allocator.tasks` (bounded shutdown of background tasks),
  :mod:`allocator.settings_files` (how a process reads its settings) and
  :mod:`allocator.logs` (how every process logs: text or JSON lines, passwords hidden).

The packages that hold them (``allocator.wire``, ``allocator.amqp``, ...) import nothing in
their ``__init__``, so importing a surface module loads no other part of the allocator. The
node agent and the hub plugin import nothing else of the allocator.
"""

__version__ = "0.3.0"

PUBLIC_SURFACE = frozenset({
    "allocator.wire",
    "allocator.wire.protocol",
    "allocator.wire.topology",
    "allocator.wire.model_names",
    "allocator.wire.lease_container",
    "allocator.wire.heartbeat_delta",
    "allocator.wire.capacity",
    "allocator.wire.interconnect",
    "allocator.amqp",
    "allocator.amqp.broker",
    "allocator.amqp.client",
    "allocator.amqp.declare",
    "allocator.placement",
    "allocator.placement.gpu_sets",
    "allocator.metrics",
    "allocator.metrics.endpoint",
    "allocator.bookings",
    "allocator.bookings.outlook",
    "allocator.tasks",
    "allocator.settings_files",
    "allocator.logs",
})
"""The modules other parts may import."""
