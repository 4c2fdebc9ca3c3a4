"""Health evaluation of the node agent: pure rules with time passed in."""

from __future__ import annotations

from dataclasses import replace
from typing import cast

from hypothesis import given, settings
from hypothesis import strategies as st

from allocator.wire.protocol import Health
from nodeagent.health import HealthRules, HealthTracker
from nodeagent.inventory import GPUSample

UUID = "GPU-00000000-0000-4000-8000-000000000001"
RULES = HealthRules(
    fatal_xids=frozenset({48, 79, 94}),
    xid_quiet_s=60.0,
    xid_repeat_count=3,
    xid_repeat_window_s=600.0,
    recent_xid_s=300.0,
    overheat_c=90.0,
    overheat_hysteresis_c=10.0,
    ecc_stable_s=120.0,
)


def gpu(**fields: object) -> GPUSample:
    base = GPUSample(uuid=UUID, index=0, model="NVIDIA GeForce GTX 1070",
                     memory_total_mib=8192, temperature_c=40.0, ecc_uncorrected=0)
    return replace(base, **fields)  # type: ignore[arg-type]


def test_a_plain_gpu_is_healthy() -> None:
    verdict = HealthTracker(RULES).evaluate(gpu(), now=1000.0)
    assert verdict.health is Health.HEALTHY
    assert verdict.reasons == ()
    assert verdict.recent_xids == ()


def test_lost_is_unhealthy_at_once_and_recovers_when_it_reads_again() -> None:
    tracker = HealthTracker(RULES)
    assert tracker.evaluate(gpu(), 0).healthy
    lost = tracker.evaluate(gpu(lost=True), 1)
    assert lost.health is Health.UNHEALTHY
    assert lost.reasons[0].startswith("lost")
    assert tracker.evaluate(gpu(), 2).healthy


def test_fatal_xid_is_transient_after_the_quiet_period() -> None:
    tracker = HealthTracker(RULES)
    assert tracker.record_xid(UUID, 79, now=100.0) is True
    during = tracker.evaluate(gpu(), 100.0 + 59)
    assert not during.healthy
    assert during.reasons[0].startswith("xid 79")
    assert during.recent_xids == (79,)
    after = tracker.evaluate(gpu(), 100.0 + 60)
    assert after.healthy
    assert after.recent_xids == (79,)  # still listed for the operator
    assert tracker.evaluate(gpu(), 100.0 + 301).recent_xids == ()


def test_a_new_fatal_xid_restarts_the_quiet_period() -> None:
    tracker = HealthTracker(RULES)
    tracker.record_xid(UUID, 94, 0)
    tracker.record_xid(UUID, 94, 50)
    assert not tracker.evaluate(gpu(), 100).healthy
    assert tracker.evaluate(gpu(), 110).healthy


def test_repeated_fatal_xids_stay_unhealthy() -> None:
    tracker = HealthTracker(RULES)
    for at in (0.0, 100.0, 200.0):
        tracker.record_xid(UUID, 48, at)
    verdict = tracker.evaluate(gpu(), 200.0 + 10_000)
    assert not verdict.healthy
    assert "repeated" in verdict.reasons[0]


def test_fatal_xids_spread_beyond_the_window_are_each_transient() -> None:
    tracker = HealthTracker(RULES)
    for at in (0.0, 400.0, 800.0):  # never 3 within 600 s
        tracker.record_xid(UUID, 48, at)
        assert not tracker.evaluate(gpu(), at + 1).healthy
        assert tracker.evaluate(gpu(), at + 61).healthy


def test_non_fatal_xids_are_listed_but_harmless() -> None:
    tracker = HealthTracker(RULES)
    for at in range(10):
        assert tracker.record_xid(UUID, 13, float(at)) is False  # a user's bad kernel
    verdict = tracker.evaluate(gpu(), 10)
    assert verdict.healthy
    assert verdict.recent_xids == (13,) * 10


def test_overheat_has_hysteresis() -> None:
    tracker = HealthTracker(RULES)
    assert tracker.evaluate(gpu(temperature_c=89.9), 0).healthy
    hot = tracker.evaluate(gpu(temperature_c=90.0), 1)
    assert not hot.healthy and hot.reasons[0].startswith("overheat: 90 C")
    assert not tracker.evaluate(gpu(temperature_c=85.0), 2).healthy
    assert not tracker.evaluate(gpu(temperature_c=80.0), 3).healthy  # not below 80 yet
    assert not tracker.evaluate(gpu(temperature_c=None), 4).healthy  # no reading: no news
    assert tracker.evaluate(gpu(temperature_c=79.9), 5).healthy
    assert tracker.evaluate(gpu(temperature_c=85.0), 6).healthy  # heating up again, below limit


def test_ecc_rise_is_unhealthy_until_stable() -> None:
    tracker = HealthTracker(RULES)
    assert tracker.evaluate(gpu(ecc_uncorrected=5), 0).healthy  # history: the baseline
    risen = tracker.evaluate(gpu(ecc_uncorrected=7), 10)
    assert not risen.healthy and "from 5 to 7" in risen.reasons[0]
    assert not tracker.evaluate(gpu(ecc_uncorrected=7), 129).healthy
    assert tracker.evaluate(gpu(ecc_uncorrected=7), 130).healthy
    assert not tracker.evaluate(gpu(ecc_uncorrected=8), 131).healthy
    assert not tracker.evaluate(gpu(ecc_uncorrected=9), 200).healthy  # restarts the clock
    assert tracker.evaluate(gpu(ecc_uncorrected=9), 320).healthy


def test_ecc_counter_reset_is_a_new_baseline() -> None:
    tracker = HealthTracker(RULES)
    tracker.evaluate(gpu(ecc_uncorrected=9), 0)
    assert tracker.evaluate(gpu(ecc_uncorrected=0), 1).healthy  # driver reloaded
    assert not tracker.evaluate(gpu(ecc_uncorrected=1), 2).healthy


def test_memory_repair_flags() -> None:
    tracker = HealthTracker(RULES)
    assert "row remapping failed" in tracker.evaluate(gpu(remap_failed=True), 0).reasons[0]
    assert "waits for a GPU reset" in tracker.evaluate(gpu(remap_pending=True), 0).reasons[0]
    assert tracker.evaluate(gpu(remap_pending=False, remap_failed=False), 0).healthy


def test_every_reason_is_listed() -> None:
    tracker = HealthTracker(RULES)
    tracker.evaluate(gpu(ecc_uncorrected=0), 0)
    tracker.record_xid(UUID, 79, 1)
    verdict = tracker.evaluate(gpu(lost=True, temperature_c=95, ecc_uncorrected=1,
                                   remap_failed=True), 2)
    assert [r.split(":")[0] for r in verdict.reasons] == [
        "lost", "xid 79", "overheat", "ecc", "memory"]


def test_forget_drops_gpus_that_left() -> None:
    tracker = HealthTracker(RULES)
    for at in (0.0, 1.0, 2.0):
        tracker.record_xid(UUID, 48, at)
    tracker.forget([])
    assert tracker.evaluate(gpu(), 3).healthy


# ----------------------------------------------------------------------------- properties

events = st.lists(
    st.tuples(
        st.floats(0, 5000, allow_nan=False),
        st.one_of(
            st.tuples(st.just("xid"), st.sampled_from([13, 31, 43, 48, 79, 94])),
            st.tuples(st.just("temp"), st.floats(20, 110, allow_nan=False)),
            st.tuples(st.just("ecc"), st.integers(0, 20)),
            st.tuples(st.just("lost"), st.booleans()),
        ),
    ),
    max_size=40,
)


def run(steps: list[tuple[float, tuple[str, object]]]) -> tuple[HealthTracker, GPUSample, float]:
    """Apply time-ordered steps; returns the tracker, the last sample and the last time."""
    tracker = HealthTracker(RULES)
    sample = gpu()
    now = 0.0
    for at, (kind, value) in sorted(steps, key=lambda step: step[0]):
        now = at
        if kind == "xid":
            tracker.record_xid(UUID, int(value), now)  # type: ignore[call-overload]
        elif kind == "temp":
            sample = replace(sample, temperature_c=cast(float, value))
        elif kind == "ecc":
            sample = replace(sample, ecc_uncorrected=cast(int, value))
        else:
            sample = replace(sample, lost=cast(bool, value))
        tracker.evaluate(sample, now)
    return tracker, sample, now


@settings(max_examples=300, deadline=None)
@given(events)
def test_healthy_exactly_when_no_reason(steps: list) -> None:
    tracker, sample, now = run(steps)
    verdict = tracker.evaluate(sample, now)
    assert verdict.healthy == (verdict.reasons == ())
    assert len(verdict.recent_xids) <= 64


@settings(max_examples=300, deadline=None)
@given(events)
def test_lost_and_hot_are_always_unhealthy(steps: list) -> None:
    tracker, sample, now = run(steps)
    assert not tracker.evaluate(replace(sample, lost=True), now).healthy
    assert not tracker.evaluate(replace(sample, temperature_c=RULES.overheat_c), now).healthy


@settings(max_examples=300, deadline=None)
@given(events, st.integers(1, 4))
def test_everything_recovers_after_long_quiet_unless_xids_repeated(steps: list,
                                                                   cool_reads: int) -> None:
    """A cool, found GPU with a stable ECC count is healthy once every period has passed,
    unless fatal XIDs repeated within the window (then never)."""
    tracker, sample, now = run(steps)
    fatal_times = sorted(at for at, (kind, value) in steps
                         if kind == "xid" and value in RULES.fatal_xids)
    repeated = any(
        fatal_times[i + RULES.xid_repeat_count - 1] - fatal_times[i] <= RULES.xid_repeat_window_s
        for i in range(len(fatal_times) - RULES.xid_repeat_count + 1)
    )
    calm = replace(sample, lost=False, temperature_c=RULES.cool_c - 1)
    later = now + max(RULES.xid_quiet_s, RULES.ecc_stable_s) + 1
    for i in range(cool_reads):
        verdict = tracker.evaluate(calm, later + i)
    assert verdict.healthy == (not repeated), verdict.reasons


@settings(max_examples=200, deadline=None)
@given(events, st.lists(st.sampled_from([13, 31, 43, 45]), max_size=20))
def test_non_fatal_xids_never_change_health(steps: list, benign: list[int]) -> None:
    with_benign, without = HealthTracker(RULES), HealthTracker(RULES)
    ordered = sorted(steps, key=lambda step: step[0])
    sample = gpu()
    for n, (at, (kind, value)) in enumerate(ordered):
        if kind == "xid":
            with_benign.record_xid(UUID, int(value), at)
            without.record_xid(UUID, int(value), at)
        elif kind == "temp":
            sample = replace(sample, temperature_c=value)
        elif kind == "ecc":
            sample = replace(sample, ecc_uncorrected=value)
        else:
            sample = replace(sample, lost=value)
        if n < len(benign):
            with_benign.record_xid(UUID, benign[n], at)
        assert with_benign.evaluate(sample, at).health is without.evaluate(sample, at).health
