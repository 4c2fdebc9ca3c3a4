"""Requests this allocator has decided and committed, by delivery: a redelivery of one is not
decided again.

A broker node's loss can hand back a request the allocator applied, committed and answered,
because its acknowledgement went down with the node: a quorum queue keeps a delivery to a
consumer on a lost node checked out for a while and then returns it. By then the caller may
have released the lease it was told about, and deciding the returned copy again would grant
the same request key a second lease nobody holds (seen in the broker-cluster fault test).
A request is identified by what its caller sent it with (broker user, reply address and
correlation id), which a retry of the caller's never repeats (a new correlation id). Pure
bookkeeping, no I/O.
"""

from __future__ import annotations

from collections import OrderedDict

KEEP_S = 600.0
"""How long a decided request is remembered: far longer than any call's deadline, after
which a redelivery is dropped as expired anyway (requests that carry none are kept as long)."""

MAX_KEPT = 100_000
"""At most this many are remembered (the oldest are forgotten first)."""

RequestId = tuple[str, str, str]
"""(broker user, reply_to, correlation id) of a delivery."""


class DecidedRequests:
    """The requests decided lately, each until ``KEEP_S`` after it was decided."""

    def __init__(self, keep_s: float = KEEP_S, max_kept: int = MAX_KEPT) -> None:
        self.keep_s = keep_s
        self.max_kept = max_kept
        self._until: OrderedDict[RequestId, float] = OrderedDict()

    def add(self, request: RequestId, now: float) -> None:
        """Remember ``request`` as decided at ``now``."""
        self._until[request] = now + self.keep_s
        self._until.move_to_end(request)
        while len(self._until) > self.max_kept:
            self._until.popitem(last=False)

    def __contains__(self, request: RequestId) -> bool:
        return request in self._until

    def forget_expired(self, now: float) -> None:
        """Forget the requests remembered for longer than ``keep_s``."""
        while self._until:
            request, until = next(iter(self._until.items()))
            if until > now:
                return
            del self._until[request]

    def __len__(self) -> int:
        return len(self._until)
