"""Decayed usage's math (allocator.placement.decayed_usage), and the reclaim order it feeds
(fairshare.victim_order): exact values, and properties over random leases."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.placement import fairshare
from allocator.placement.decayed_usage import (
    HOUR_S,
    Accumulator,
    Charge,
    Held,
    Usages,
    decayed,
    held,
    history_since,
    model_weights,
)

HALF_LIFE_H = 24.0

times = st.floats(min_value=0, max_value=30 * 24 * HOUR_S, allow_nan=False)
units = st.sampled_from([0.25, 0.5, 1.0, 2.0, 8.0])
weights = st.sampled_from([0.5, 1.0, 1.5, 4.0])


@st.composite
def leases(draw: st.DrawFn) -> tuple[float, float, float, float]:
    """(units, weight, start, end) with start <= end."""
    a, b = draw(times), draw(times)
    return draw(units), draw(weights), min(a, b), max(a, b)


def test_an_hour_held_just_now_counts_about_one_and_one_a_half_life_ago_half() -> None:
    now = 1_000 * HOUR_S
    # exactly: H/ln2 * (1 - 2^(-1/H)) for H = 24: 0.98566...
    assert held(1, 1, now - HOUR_S, now, now, HALF_LIFE_H) == pytest.approx(
        24 / math.log(2) * (1 - 2 ** (-1 / 24)))
    assert held(1, 1, now - HOUR_S, now, now + HALF_LIFE_H * HOUR_S, HALF_LIFE_H) == \
        pytest.approx(held(1, 1, now - HOUR_S, now, now, HALF_LIFE_H) / 2)
    # Held for ever, the usage tends to H/ln2 GPU-hours per GPU.
    assert held(1, 1, 0, now, now, HALF_LIFE_H) == pytest.approx(24 / math.log(2), rel=1e-6)
    assert held(2, 1.5, now - HOUR_S, now, now, HALF_LIFE_H) == pytest.approx(
        3 * held(1, 1, now - HOUR_S, now, now, HALF_LIFE_H))


def test_model_weights_make_each_models_whole_pool_count_the_same() -> None:
    assert model_weights(["a"] * 8) == {"a": 1.0}
    w = model_weights(["a"] * 6 + ["b"] * 2)
    assert w == {"a": pytest.approx(8 / 12), "b": pytest.approx(2.0)}
    assert 6 * w["a"] == pytest.approx(2 * w["b"])
    assert model_weights([]) == {}


def test_history_goes_back_ten_half_lives_and_none_when_off() -> None:
    assert history_since(100 * HOUR_S, 2) == pytest.approx(80 * HOUR_S)
    assert history_since(100 * HOUR_S, 0) is None


@settings(max_examples=300, deadline=None)
@given(lease=leases(), extra=st.floats(min_value=1, max_value=48 * HOUR_S),
       later=st.floats(min_value=0, max_value=10 * 24 * HOUR_S))
def test_usage_grows_with_hold_time(lease: tuple[float, float, float, float], extra: float,
                                    later: float) -> None:
    """Holding longer (an earlier start or a later end) never counts less."""
    u, w, start, end = lease
    now = end + later + extra
    base = held(u, w, start, end, now, HALF_LIFE_H)
    assert held(u, w, start - extra, end, now, HALF_LIFE_H) >= base
    assert held(u, w, start, end + extra, now, HALF_LIFE_H) >= base
    if end > start:
        assert held(u, w, start, end + extra, now, HALF_LIFE_H) > base


@settings(max_examples=300, deadline=None)
@given(spans=st.lists(leases(), min_size=1, max_size=6),
       h=st.sampled_from([0.5, 6.0, 24.0, 168.0]))
def test_usage_halves_after_one_half_life_with_nothing_held(
        spans: list[tuple[float, float, float, float]], h: float) -> None:
    acc = Accumulator(h)
    for u, w, start, end in spans:
        acc.fold(u, w, start, end)
    now = max(end for _, _, _, end in spans) + 3 * HOUR_S
    assert acc.at(now + h * HOUR_S) == pytest.approx(acc.at(now) / 2, rel=1e-9, abs=1e-12)
    assert decayed(5.0, now, now + 2 * h * HOUR_S, h) == pytest.approx(1.25)


@settings(max_examples=200, deadline=None)
@given(spans=st.lists(leases(), max_size=6), active=st.lists(leases(), max_size=3),
       now=times)
def test_a_half_life_of_zero_counts_nothing(spans: list[tuple[float, float, float, float]],
                                           active: list[tuple[float, float, float, float]],
                                           now: float) -> None:
    acc = Accumulator(0.0)
    for u, w, start, end in spans:
        acc.fold(u, w, start, end)
        assert held(u, w, start, end, now, 0.0) == 0.0
    assert acc.at(now, [Held(u, w, start) for u, w, start, _ in active]) == 0.0


@settings(max_examples=300, deadline=None)
@given(spans=st.lists(leases(), min_size=1, max_size=8), data=st.data())
def test_folding_is_order_independent_and_equals_the_sum(
        spans: list[tuple[float, float, float, float]], data: st.DataObject) -> None:
    shuffled = data.draw(st.permutations(spans))
    one, two = Accumulator(HALF_LIFE_H), Accumulator(HALF_LIFE_H)
    for u, w, start, end in spans:
        one.fold(u, w, start, end)
    for u, w, start, end in shuffled:
        two.fold(u, w, start, end)
    now = max(end for _, _, _, end in spans) + data.draw(st.floats(0, 72 * HOUR_S))
    expected = sum(held(u, w, s, e, now, HALF_LIFE_H) for u, w, s, e in spans)
    assert one.at(now) == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert two.at(now) == pytest.approx(expected, rel=1e-9, abs=1e-12)


@settings(max_examples=200, deadline=None)
@given(lease=leases(), later=st.floats(min_value=0, max_value=48 * HOUR_S))
def test_a_lease_held_counts_on_the_fly_as_it_will_once_folded(
        lease: tuple[float, float, float, float], later: float) -> None:
    """What :meth:`Accumulator.at` adds for a lease still held is what folding it in at its
    end gives: the rebuild after a restart and the running engine agree."""
    u, w, start, end = lease
    on_the_fly = Accumulator(HALF_LIFE_H).at(end, [Held(u, w, start)])
    folded = Accumulator(HALF_LIFE_H)
    folded.fold(u, w, start, end)
    assert folded.at(end) == pytest.approx(on_the_fly, rel=1e-9, abs=1e-12)
    assert folded.at(end + later) <= on_the_fly + 1e-12


def candidate(lease_id: str, granted_at: float, idle_s: float = 0.0,
              recent_use: tuple[float, float] = (0.0, 0.0)) -> fairshare.Candidate:
    return fairshare.Candidate(lease_id=lease_id, gpu_uuids=(f"GPU-{lease_id}",),
                               granted_at=granted_at, idle_s=idle_s, warned=False,
                               borrowed=True, idle_releasable=False, recent_use=recent_use)


def test_victims_idle_first_then_the_heaviest_recent_user_then_the_newest_grant() -> None:
    heavy_old = candidate("heavy-old", 10.0, recent_use=(30.0, 0.0))
    light_new = candidate("light-new", 20.0, recent_use=(2.0, 0.0))
    idle_light = candidate("idle", 5.0, idle_s=900.0, recent_use=(0.0, 0.0))
    tie_group = candidate("tie-heavier-group", 1.0, recent_use=(2.0, 50.0))
    order = fairshare.victim_order([light_new, heavy_old, idle_light, tie_group], 600.0)
    assert [c.lease_id for c in order] == ["idle", "heavy-old", "tie-heavier-group",
                                           "light-new"]
    # Without decayed usage (all zeros): newest grant first, as before.
    plain = [candidate(c.lease_id, c.granted_at, c.idle_s) for c in order]
    assert [c.lease_id for c in fairshare.victim_order(plain, 600.0)] == [
        "idle", "light-new", "heavy-old", "tie-heavier-group"]


def test_usages_count_a_lease_for_its_user_and_each_of_its_groups() -> None:
    usages = Usages(HALF_LIFE_H)
    now = 100 * HOUR_S
    usages.fold(Charge("alice", ("ml", "cv"), 1.0, 1.0, now - 3 * HOUR_S), now - HOUR_S)
    bob_now = Charge("bob", ("ml",), 0.5, 2.0, now - HOUR_S)
    by_user, by_group = usages.at(now, [bob_now])
    alice = held(1, 1, now - 3 * HOUR_S, now - HOUR_S, now, HALF_LIFE_H)
    bob = held(0.5, 2, now - HOUR_S, now, now, HALF_LIFE_H)
    assert by_user == {"alice": pytest.approx(alice), "bob": pytest.approx(bob)}
    assert by_group == {"ml": pytest.approx(alice + bob), "cv": pytest.approx(alice)}
    only_users, only_groups = usages.at(now, [bob_now], users={"carol", "bob"}, groups={"cv"})
    assert only_users == {"carol": 0.0, "bob": pytest.approx(bob)}
    assert only_groups == {"cv": pytest.approx(alice)}
    off = Usages(0.0)
    off.fold(Charge("alice", ("ml",), 1.0, 1.0, 0.0), now)
    assert off.at(now, [bob_now]) == ({"bob": 0.0}, {"ml": 0.0})
