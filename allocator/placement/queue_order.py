"""The order in which queued requests are served."""

from __future__ import annotations


def queue_order_key(priority: int, enqueued_at: float, lease_id: str) -> tuple[int, float, str]:
    """Sort key of queued requests: higher priority first, then first come first served.

    The lease id only breaks exact ties so the order is total and stable across restarts.
    """
    return (-priority, enqueued_at, lease_id)
