"""The inbox's lanes and the acknowledgements that settle a batch (pure; hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.inbox import Acknowledgement, Inbox, acknowledgements


def test_requests_go_ahead_and_a_batch_keeps_arrival_order() -> None:
    inbox: Inbox[str] = Inbox()
    for name in ("h1", "h2", "h3", "h4"):
        inbox.put(name, request=False)
    inbox.put("r1", request=True)
    inbox.put("h5", request=False)
    inbox.put("r2", request=True)
    # Four places: both requests, and the two oldest node messages (their half).
    assert inbox.take(4) == ["h1", "h2", "r1", "r2"]
    assert list(inbox) == ["h3", "h4", "h5"]


def test_node_messages_keep_half_of_a_batch_against_a_stream_of_requests() -> None:
    inbox: Inbox[str] = Inbox()
    for i in range(10):
        inbox.put(f"h{i}", request=False)
    for i in range(100):
        inbox.put(f"r{i}", request=True)
    batch = inbox.take(8)
    assert [item for item in batch if item.startswith("h")] == ["h0", "h1", "h2", "h3"]
    assert [item for item in batch if item.startswith("r")] == ["r0", "r1", "r2", "r3"]


def test_one_lane_alone_fills_the_batch() -> None:
    inbox: Inbox[str] = Inbox()
    for i in range(5):
        inbox.put(f"h{i}", request=False)
    assert inbox.take(3) == ["h0", "h1", "h2"]
    for i in range(5):
        inbox.put(f"r{i}", request=True)
    assert inbox.take(10) == ["h3", "h4", "r0", "r1", "r2", "r3", "r4"]
    assert not inbox


@settings(max_examples=300, deadline=None)
@given(lanes=st.lists(st.booleans(), max_size=60), sizes=st.lists(st.integers(1, 9), min_size=1))
def test_take_respects_the_lanes(lanes: list[bool], sizes: list[int]) -> None:
    inbox: Inbox[int] = Inbox()
    for number, request in enumerate(lanes):
        inbox.put(number, request=request)
    taken: list[int] = []
    for most in sizes * (len(lanes) + 1):
        if not inbox:
            break
        waiting_nodes = sum(1 for n in inbox if not lanes[n])
        batch = inbox.take(most)
        assert len(batch) == min(most, len(batch) + len(inbox)), "it took as much as it could"
        assert batch == sorted(batch), "a batch is applied in arrival order"
        assert sum(1 for n in batch if not lanes[n]) >= min(waiting_nodes, most // 2)
        taken += batch
    assert not inbox
    # Each lane came out in its own arrival order, and nothing was lost or taken twice.
    assert [n for n in taken if lanes[n]] == [n for n, r in enumerate(lanes) if r]
    assert [n for n in taken if not lanes[n]] == [n for n, r in enumerate(lanes) if not r]


def test_acknowledgements_of_a_batch_that_is_every_delivery_up_to_its_last() -> None:
    assert acknowledgements([("a", 1), ("a", 2), ("a", 3)], []) == [
        Acknowledgement("a", 3, multiple=True)]


def test_requests_taken_ahead_are_acknowledged_alone() -> None:
    # 1, 2 applied; 3, 4 node messages still waiting; 5, 7 requests taken ahead of them.
    assert acknowledgements([("a", 1), ("a", 2), ("a", 5), ("a", 7)], [("a", 3), ("a", 4)]) == [
        Acknowledgement("a", 2, multiple=True),
        Acknowledgement("a", 5, multiple=False), Acknowledgement("a", 7, multiple=False)]


def test_each_channel_is_settled_on_its_own() -> None:
    # A new channel after a reconnect numbers its deliveries from 1 again.
    assert acknowledgements([("old", 9), ("new", 1), ("new", 3)], [("new", 2)]) == [
        Acknowledgement("old", 9, multiple=True), Acknowledgement("new", 1, multiple=True),
        Acknowledgement("new", 3, multiple=False)]


@settings(max_examples=300, deadline=None)
@given(lanes=st.lists(st.booleans(), min_size=1, max_size=60),
       sizes=st.lists(st.integers(1, 9), min_size=1))
def test_acknowledgements_settle_exactly_what_was_applied(lanes: list[bool], sizes: list[int]
                                                          ) -> None:
    """The broker's view: deliveries 1..n; a multiple ack settles every unsettled one up to
    its tag. After each batch, what is settled must be exactly what has been applied."""
    inbox: Inbox[int] = Inbox()
    for tag, request in enumerate(lanes, start=1):
        inbox.put(tag, request=request)
    unsettled = set(range(1, len(lanes) + 1))
    applied: set[int] = set()
    for most in sizes * (len(lanes) + 1):
        if not inbox:
            break
        batch = inbox.take(most)
        applied.update(batch)
        for ack in acknowledgements([("c", tag) for tag in batch],
                                    [("c", tag) for tag in inbox]):
            assert ack.tag in unsettled, "an acknowledgement of a settled delivery"
            if ack.multiple:
                unsettled -= {tag for tag in unsettled if tag <= ack.tag}
            else:
                unsettled.discard(ack.tag)
        assert unsettled == set(range(1, len(lanes) + 1)) - applied
    assert not unsettled
