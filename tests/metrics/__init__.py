"""Metrics and health: the allocator's counters and endpoint, alerts, dashboards."""
