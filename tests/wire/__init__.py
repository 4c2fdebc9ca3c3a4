"""The wire (allocator/wire): messages, labels, heartbeat deltas, compatibility between releases."""
