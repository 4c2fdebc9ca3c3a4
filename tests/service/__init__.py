"""The allocator's service (allocator/service): batches, the inbox, redeliveries, bad input."""
