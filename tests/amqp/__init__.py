"""The broker client (allocator/amqp): URLs, the RPC over the real broker."""
