"""The allocator's memory of decided requests (allocator/decided.py): a redelivery of one is
recognised for as long as it is kept, and the memory stays bounded."""

from __future__ import annotations

from allocator.service.decided import DecidedRequests


def test_a_decided_request_is_known_until_it_expires() -> None:
    decided = DecidedRequests(keep_s=10.0)
    call = ("hub", "amq.rabbitmq.reply-to.abc", "c1")
    decided.add(call, now=100.0)
    assert call in decided
    assert ("hub", "amq.rabbitmq.reply-to.abc", "c2") not in decided  # the caller's retry
    decided.forget_expired(now=109.9)
    assert call in decided
    decided.forget_expired(now=110.0)
    assert call not in decided and len(decided) == 0


def test_the_oldest_are_forgotten_beyond_the_bound() -> None:
    decided = DecidedRequests(keep_s=10.0, max_kept=2)
    for n in range(3):
        decided.add(("hub", "r", f"c{n}"), now=float(n))
    assert ("hub", "r", "c0") not in decided
    assert ("hub", "r", "c1") in decided and ("hub", "r", "c2") in decided
