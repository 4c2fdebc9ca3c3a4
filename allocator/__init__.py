"""swarm-gpu allocator: GPU leases over AMQP RPC from a SQLite ledger.

Public surface for other parts (:data:`PUBLIC_SURFACE`): :mod:`allocator.protocol`
(messages), :mod:`allocator.topology` (broker names), :mod:`allocator.broker` (broker
addresses: one URL naming several broker nodes), :mod:`allocator.client` (the RPC client),
:mod:`allocator.model_names` (which spellings mean which GPU model) and
:mod:`allocator.lease_container` (the label and environment of a lease's container),
:mod:`allocator.heartbeat_delta` (what a heartbeat delta carries and how it applies),
:mod:`allocator.tasks` (bounded shutdown of background tasks),
:mod:`allocator.settings_files` (how a process reads its settings: sources, the TOML file),
:mod:`allocator.capacity` (how many GPUs of one request one host can give, the rule the
hub's form checks and the policy share), :mod:`allocator.metrics_http` (the HTTP endpoint of a
Prometheus registry, and its token), :mod:`allocator.logs` (how every process logs: text
or JSON lines, passwords hidden), :mod:`allocator.interconnect` (how one host's GPUs are
joined: the wire's topology data) and :mod:`allocator.gpu_sets` (which GPUs of a host a
request gets by their links: the best link the hub's form shows and the placement's choice
are this one rule), :mod:`allocator.bookings.outlook` (what one user sees of bookings: which
are theirs, which choices a booking takes back soon).
The node agent and the hub plugin import nothing else of the allocator.
"""

__version__ = "0.3.0"

PUBLIC_SURFACE = frozenset({
    "allocator.protocol",
    "allocator.topology",
    "allocator.broker",
    "allocator.client",
    "allocator.model_names",
    "allocator.lease_container",
    "allocator.heartbeat_delta",
    "allocator.tasks",
    "allocator.settings_files",
    "allocator.capacity",
    "allocator.metrics_http",
    "allocator.logs",
    "allocator.interconnect",
    "allocator.gpu_sets",
    # What users see of bookings (the package's __init__ imports nothing).
    "allocator.bookings",
    "allocator.bookings.outlook",
})
"""The modules other parts may import."""
