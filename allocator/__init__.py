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
or JSON lines, passwords hidden).
The node agent and the hub plugin import nothing else of the allocator.
"""

__version__ = "0.2.0"

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
})
"""The modules other parts may import."""
