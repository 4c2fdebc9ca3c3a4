"""swarm-gpu allocator: GPU leases over AMQP RPC from a SQLite ledger.

Public surface for other parts: :mod:`allocator.protocol` (messages),
:mod:`allocator.topology` (broker names) and :mod:`allocator.client` (the RPC client).
"""

__version__ = "0.1.0"
