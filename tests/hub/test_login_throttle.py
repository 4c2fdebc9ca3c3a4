"""The hub's login and signup limits (``hubplugin/login_throttle.py``, pure; the
authenticator that applies them is tested in ``tests/hub/test_hub_login.py``).

The point of keying by address too: a stranger who keeps guessing at ``admin`` makes only
their own next guess wait, never the admin's login from elsewhere.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hubplugin.login_throttle import LoginBackoff, SignupThrottle

STRANGER, ADMIN_DESK = "203.0.113.7", "10.0.0.2"


# ------------------------------------------------------------------------- the policy


def test_failures_beyond_the_free_ones_wait_twice_as_long_each_time() -> None:
    backoff = LoginBackoff(free_failures=3, first_wait_s=2.0, max_wait_s=60.0)
    now = 1000.0
    waits = []
    for _ in range(10):
        backoff.failed("admin", STRANGER, now)
        waits.append(backoff.wait_s("admin", STRANGER, now))
        now += waits[-1]  # the stranger tries again as soon as allowed
    assert waits == [0.0, 0.0, 0.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]
    # the same name from another address, and another name from this one: no wait
    assert backoff.wait_s("admin", ADMIN_DESK, now) == 0.0
    assert backoff.wait_s("alice", STRANGER, now) == 0.0


def test_a_success_or_a_long_quiet_ends_the_count() -> None:
    backoff = LoginBackoff(free_failures=1, first_wait_s=5.0, forget_after_s=100.0)
    backoff.failed("bob", STRANGER, 0.0)
    backoff.failed("bob", STRANGER, 1.0)
    assert backoff.wait_s("bob", STRANGER, 1.0) == 5.0
    assert backoff.wait_s("bob", STRANGER, 4.0) == 2.0
    backoff.succeeded("bob", STRANGER)
    assert backoff.wait_s("bob", STRANGER, 4.0) == 0.0
    backoff.failed("bob", STRANGER, 10.0)
    backoff.failed("bob", STRANGER, 11.0)
    assert backoff.wait_s("bob", STRANGER, 16.0) == 0.0  # 5 s earned, over
    backoff.failed("bob", STRANGER, 111.0)  # 100 s after the last: counted from one again
    assert backoff.wait_s("bob", STRANGER, 111.0) == 0.0


def test_a_flood_of_names_keeps_only_so_many_counters() -> None:
    backoff = LoginBackoff(free_failures=0, first_wait_s=1.0, max_entries=100)
    for n in range(1000):
        backoff.failed(f"name{n}", STRANGER, float(n) / 1000)
    assert len(backoff._failures) == 100
    assert backoff.wait_s("name999", STRANGER, 1.0) > 0 and \
        backoff.wait_s("name0", STRANGER, 1.0) == 0.0


@given(st.lists(st.tuples(st.sampled_from(["admin", "bob"]),
                          st.sampled_from([STRANGER, ADMIN_DESK]),
                          st.floats(0, 10)), max_size=40))
def test_a_wait_is_never_negative_nor_over_the_longest(
        tries: list[tuple[str, str, float]]) -> None:
    backoff = LoginBackoff(free_failures=2, first_wait_s=1.0, max_wait_s=30.0)
    now = 0.0
    for name, address, step in tries:
        now += step
        backoff.failed(name, address, now)
        assert 0.0 <= backoff.wait_s(name, address, now) <= 30.0


def test_signups_are_limited_per_address_and_in_total() -> None:
    throttle = SignupThrottle(per_address=2, in_total=5, window_s=100.0)
    for at in (0.0, 10.0):
        assert throttle.wait_s(STRANGER, at) == 0.0
        throttle.signed_up(STRANGER, at)
    assert throttle.wait_s(STRANGER, 20.0) == 80.0  # the first of the two leaves the window
    assert throttle.wait_s(STRANGER, 100.0) == 0.0
    for n in range(3):
        throttle.signed_up(f"198.51.100.{n}", 50.0)
    # 5 in the window from everyone together (the stranger's 10.0 one and these 3 and ...)
    throttle.signed_up(STRANGER, 100.0)
    assert throttle.wait_s("192.0.2.99", 100.0) == 10.0  # a new address waits for the total
    assert throttle.wait_s("192.0.2.99", 110.0) == 0.0
