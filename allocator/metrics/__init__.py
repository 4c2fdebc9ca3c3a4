"""Metrics: the allocator's counters, their export, and the HTTP endpoint."""
