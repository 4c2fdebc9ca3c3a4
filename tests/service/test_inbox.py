"""The inbox's lanes and the acknowledgements that settle a batch (pure; hypothesis)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.service.inbox import Acknowledgement, Inbox, acknowledgements


def test_requests_go_ahead_and_a_batch_keeps_arrival_order() -> None:
    inbox: Inbox[str, str] = Inbox()
    for name in ("h1", "h2", "h3", "h4"):
        inbox.put(name, request=False)
    inbox.put("r1", request=True)
    inbox.put("h5", request=False)
    inbox.put("r2", request=True)
    # Up to two of each lane: both requests, and the two oldest node messages.
    assert inbox.take(2) == ["h1", "h2", "r1", "r2"]
    assert list(inbox) == ["h3", "h4", "h5"]


def test_node_messages_keep_their_places_against_a_stream_of_requests() -> None:
    inbox: Inbox[str, str] = Inbox()
    for i in range(10):
        inbox.put(f"h{i}", request=False)
    for i in range(100):
        inbox.put(f"r{i}", request=True)
    batch = inbox.take(4)
    assert [item for item in batch if item.startswith("h")] == ["h0", "h1", "h2", "h3"]
    assert [item for item in batch if item.startswith("r")] == ["r0", "r1", "r2", "r3"]


def test_each_lane_gives_up_to_most() -> None:
    inbox: Inbox[str, str] = Inbox()
    for i in range(5):
        inbox.put(f"h{i}", request=False)
    assert inbox.take(3) == ["h0", "h1", "h2"]
    for i in range(5):
        inbox.put(f"r{i}", request=True)
    assert inbox.take(5) == ["h3", "h4", "r0", "r1", "r2", "r3", "r4"]
    assert not inbox


@settings(max_examples=300, deadline=None)
@given(lanes=st.lists(st.booleans(), max_size=60), sizes=st.lists(st.integers(1, 9), min_size=1))
def test_take_respects_the_lanes(lanes: list[bool], sizes: list[int]) -> None:
    inbox: Inbox[int, str] = Inbox()
    for number, request in enumerate(lanes):
        inbox.put(number, request=request)
    taken: list[int] = []
    for most in sizes * (len(lanes) + 1):
        if not inbox:
            break
        waiting_nodes = sum(1 for n in inbox if not lanes[n])
        waiting_requests = len(inbox) - waiting_nodes
        batch = inbox.take(most)
        assert batch == sorted(batch), "a batch is applied in arrival order"
        assert sum(1 for n in batch if not lanes[n]) == min(waiting_nodes, most)
        assert sum(1 for n in batch if lanes[n]) == min(waiting_requests, most)
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
    inbox: Inbox[int, str] = Inbox()
    for tag, request in enumerate(lanes, start=1):
        inbox.put(tag, request=request, delivery=("c", tag))
    unsettled = set(range(1, len(lanes) + 1))
    applied: set[int] = set()
    for most in sizes * (len(lanes) + 1):
        if not inbox:
            break
        batch = inbox.take(most)
        applied.update(batch)
        for ack in acknowledgements([("c", tag) for tag in batch], inbox.oldest_deliveries()):
            assert ack.tag in unsettled, "an acknowledgement of a settled delivery"
            if ack.multiple:
                unsettled -= {tag for tag in unsettled if tag <= ack.tag}
            else:
                unsettled.discard(ack.tag)
        assert unsettled == set(range(1, len(lanes) + 1)) - applied
    assert not unsettled


def test_the_oldest_deliveries_are_each_lanes_first_past_its_ticks() -> None:
    inbox: Inbox[str, str] = Inbox()
    inbox.put("tick", request=False)
    inbox.put("h1", request=False, delivery=("c", 1))
    inbox.put("r2", request=True, delivery=("c", 2))
    inbox.put("h3", request=False, delivery=("c", 3))
    assert inbox.oldest_deliveries() == [("c", 2), ("c", 1)]


def test_a_new_channel_drops_what_the_closed_one_delivered() -> None:
    inbox: Inbox[str, str] = Inbox()
    inbox.put("old h1", request=False, delivery=("old", 1))
    inbox.put("tick", request=False)
    inbox.put("old r2", request=True, delivery=("old", 2))
    inbox.put("new h1", request=False, delivery=("new", 1))
    assert inbox.keep_channel("new") == ["old r2", "old h1"]
    assert list(inbox) == ["tick", "new h1"]
    assert inbox.oldest_deliveries() == [("new", 1)]
