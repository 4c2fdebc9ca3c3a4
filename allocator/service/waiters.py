"""Where to push the outcome of a queued request: the waiting client's reply address.

A request that must wait is answered at once with a ``queued`` lease. The allocator remembers
the reply address (``reply_to``) and correlation id of that answer, and of each later
``allocate`` retry or ``status`` call that found the lease still queued: the newest
:data:`ADDRESSES_PER_LEASE` of them (a client that reconnected has a new address; another
caller's ``status`` must not take the push away from the waiting hub). When the lease leaves
the queue (granted, its wait ran out, withdrawn), the service publishes the lease once more
to each, after the decision is committed, and forgets them (docs/protocol.md, "Waiting in the
queue").

Kept in memory only: an allocator that restarts forgets the addresses, and its clients learn
the outcome from the ``status`` call they repeat every ``recheck_s`` while they wait. Pure
bookkeeping, no I/O: the service sends.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from allocator.wire.protocol import OLDEST_READER


@dataclass(frozen=True)
class ReplyAddress:
    """Where a waiting client reads its answers: a direct reply-to address (or a queue under
    ``reply_to_prefix``) and the correlation id its answers carry."""

    reply_to: str
    correlation_id: str
    release: tuple[int, int, int] = OLDEST_READER
    """The release whose reply fields the client reads (its request's
    :data:`~allocator.wire.protocol.CLIENT_RELEASE_HEADER`): pushes are written for it too."""


ADDRESSES_PER_LEASE = 4
"""How many reply addresses a queued lease keeps (the newest; memory stays bounded by the
queue's length)."""


class Waiters:
    """Queued lease id -> the reply addresses of its newest answers, oldest first."""

    def __init__(self) -> None:
        self._by_lease: dict[str, list[ReplyAddress]] = {}

    def __len__(self) -> int:
        return len(self._by_lease)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._by_lease

    def remember(self, lease_id: str, address: ReplyAddress) -> None:
        """An answer about queued ``lease_id`` went to ``address``: push there too."""
        addresses = self._by_lease.setdefault(lease_id, [])
        if address in addresses:
            addresses.remove(address)
        addresses.append(address)
        del addresses[:-ADDRESSES_PER_LEASE]

    def take(self, lease_ids: Iterable[str]) -> list[tuple[str, ReplyAddress]]:
        """Forget and return the addresses of those of ``lease_ids`` that have any (the
        leases just left the queue): one (lease id, address) pair per address."""
        taken = []
        for lease_id in lease_ids:
            for address in self._by_lease.pop(lease_id, []):
                taken.append((lease_id, address))
        return taken

    def lease_ids(self) -> list[str]:
        """Every lease with an address (to check them all after a reload)."""
        return list(self._by_lease)

    def clear(self) -> None:
        """Forget every address."""
        self._by_lease.clear()
