"""GPU health as the node agent judges it: pure functions of samples, XIDs and time.

No I/O and no clock reads: the caller passes ``now`` (epoch seconds) in, so every rule is
tested directly. A GPU is unhealthy while any of these holds, and each gives a reason:

- **lost**: the driver lost the GPU. Unhealthy at once; healthy again only when the GPU
  reads normally (in practice after a reset or reboot).
- **fatal XID**: one of :attr:`HealthRules.fatal_xids` arrived. Many are transient (a
  contained ECC error, an NVLink hiccup), so the GPU recovers after ``xid_quiet_s`` without
  another one. If ``xid_repeat_count`` of them arrive within ``xid_repeat_window_s`` the
  fault is not transient: the GPU stays unhealthy for the life of this tracker (the agent
  restarts after the GPU is reset or the host reboots, and then starts clean).
- **overheat**: temperature at or above ``overheat_c``; healthy again only below
  ``overheat_c - overheat_hysteresis_c``, so a GPU at the threshold does not flap.
- **ECC**: the volatile uncorrected ECC count rose; healthy again once it has not changed
  for ``ecc_stable_s``. The first reading is the baseline (errors from before the agent
  started are history, not news); a count that falls (driver reload) is a new baseline.
- **row remap failed / pending**: the memory could not be repaired, or a repair waits for a
  reset. Unhealthy while the driver says so.

Non-fatal XIDs change nothing but are listed in ``recent_xids`` for the operator.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from allocator.wire.protocol import Health
from nodeagent.inventory import GPUSample

MAX_REASONS = 32
"""The protocol's limit on reasons per GPU."""
MAX_RECENT_XIDS = 64
"""The protocol's limit on recent XIDs per GPU."""


@dataclass(frozen=True)
class HealthRules:
    """The rules a GPU's health is judged by: which XIDs are fatal, for how long, the
    temperature and ECC limits (from :class:`nodeagent.config.AgentSettings`)."""

    fatal_xids: frozenset[int] = frozenset({48, 63, 64, 74, 79, 92, 94, 95, 119, 120})
    xid_quiet_s: float = 600.0
    xid_repeat_count: int = 3
    xid_repeat_window_s: float = 3600.0
    recent_xid_s: float = 3600.0
    overheat_c: float = 90.0
    overheat_hysteresis_c: float = 10.0
    ecc_stable_s: float = 600.0

    @property
    def cool_c(self) -> float:
        """Below this an overheated GPU counts as cooled down."""
        return self.overheat_c - self.overheat_hysteresis_c


@dataclass(frozen=True)
class Verdict:
    """A GPU's health now, why, and the XIDs it had lately (oldest first)."""

    health: Health
    reasons: tuple[str, ...] = ()
    recent_xids: tuple[int, ...] = ()

    @property
    def healthy(self) -> bool:
        """Shorthand for ``health is Health.HEALTHY``."""
        return self.health is Health.HEALTHY


@dataclass
class _GPUState:
    """What the tracker remembers about one GPU between evaluations."""

    xids: deque[tuple[float, int]] = field(default_factory=deque)
    """Every XID (time, code) within the longest window that matters, oldest first."""
    last_fatal_at: float | None = None
    last_fatal_xid: int | None = None
    repeated_xid: int | None = None
    """Set when fatal XIDs repeated: the GPU stays unhealthy."""
    overheated: bool = False
    ecc_baseline: int | None = None
    ecc_rose_at: float | None = None
    ecc_rose_from: int | None = None


class HealthTracker:
    """Health of every GPU of one host, evaluated from samples and XIDs with time passed in.

    Not thread-safe: the agent calls it from its event loop only.
    """

    def __init__(self, rules: HealthRules) -> None:
        self.rules = rules
        self._gpus: dict[str, _GPUState] = {}

    def _state(self, uuid: str) -> _GPUState:
        state = self._gpus.get(uuid)
        if state is None:
            state = self._gpus[uuid] = _GPUState()
        return state

    def record_xid(self, uuid: str, xid: int, now: float) -> bool:
        """Note an XID of one GPU at ``now``; returns whether it is fatal by the rules."""
        state = self._state(uuid)
        state.xids.append((now, xid))
        self._trim(state, now)
        if xid not in self.rules.fatal_xids:
            return False
        state.last_fatal_at = now
        state.last_fatal_xid = xid
        window_start = now - self.rules.xid_repeat_window_s
        fatal_in_window = sum(
            1 for at, code in state.xids if at >= window_start and code in self.rules.fatal_xids
        )
        if fatal_in_window >= self.rules.xid_repeat_count:
            state.repeated_xid = xid
        return True

    def _trim(self, state: _GPUState, now: float) -> None:
        # Keep only what a window still needs, so memory stays bounded on a chatty GPU.
        keep_s = max(self.rules.recent_xid_s, self.rules.xid_repeat_window_s)
        while state.xids and (
            state.xids[0][0] < now - keep_s or len(state.xids) > 4 * MAX_RECENT_XIDS
        ):
            state.xids.popleft()

    def evaluate(self, sample: GPUSample, now: float) -> Verdict:
        """Judge one GPU from its latest sample; updates the hysteresis and ECC memory."""
        rules = self.rules
        state = self._state(sample.uuid)
        self._trim(state, now)
        reasons: list[str] = []

        if sample.lost:
            reasons.append("lost: the driver lost this GPU (fell off the bus?); reset needed")

        if state.repeated_xid is not None:
            reasons.append(
                f"xid {state.repeated_xid}: fatal XIDs repeated ({rules.xid_repeat_count} "
                f"within {rules.xid_repeat_window_s:g}s); unhealthy until the GPU is reset"
            )
        elif state.last_fatal_at is not None:
            quiet_until = state.last_fatal_at + rules.xid_quiet_s
            if now < quiet_until:
                reasons.append(
                    f"xid {state.last_fatal_xid}: fatal XID {now - state.last_fatal_at:.0f}s "
                    f"ago; healthy again after {rules.xid_quiet_s:g}s without one"
                )
            else:
                state.last_fatal_at = None
                state.last_fatal_xid = None

        if sample.temperature_c is not None:
            if sample.temperature_c >= rules.overheat_c:
                state.overheated = True
            elif sample.temperature_c < rules.cool_c:
                state.overheated = False
        if state.overheated:
            reasons.append(
                f"overheat: {sample.temperature_c:g} C (limit {rules.overheat_c:g} C, "
                f"healthy again below {rules.cool_c:g} C)"
                if sample.temperature_c is not None
                else f"overheat: last reading was at or above {rules.overheat_c:g} C"
            )

        ecc = sample.ecc_uncorrected
        if ecc is not None:
            if state.ecc_baseline is None or ecc < state.ecc_baseline:
                state.ecc_baseline = ecc  # first reading, or the driver reset its counters
            elif ecc > state.ecc_baseline:
                if state.ecc_rose_at is None:
                    state.ecc_rose_from = state.ecc_baseline
                state.ecc_rose_at = now
                state.ecc_baseline = ecc
        if state.ecc_rose_at is not None:
            if now - state.ecc_rose_at < rules.ecc_stable_s:
                reasons.append(
                    f"ecc: uncorrected errors rose from {state.ecc_rose_from} to "
                    f"{state.ecc_baseline}; healthy again after {rules.ecc_stable_s:g}s "
                    "without a new one"
                )
            else:
                state.ecc_rose_at = None
                state.ecc_rose_from = None

        if sample.remap_failed:
            reasons.append("memory: row remapping failed; the GPU needs service")
        elif sample.remap_pending:
            reasons.append("memory: a page retirement or row remap waits for a GPU reset")

        return Verdict(
            health=Health.UNHEALTHY if reasons else Health.HEALTHY,
            reasons=tuple(reasons[:MAX_REASONS]),
            recent_xids=self.recent_xids(sample.uuid, now),
        )

    def recent_xids(self, uuid: str, now: float) -> tuple[int, ...]:
        """The XID codes of one GPU within ``recent_xid_s``, oldest first (at most 64)."""
        state = self._gpus.get(uuid)
        if state is None:
            return ()
        since = now - self.rules.recent_xid_s
        codes = [code for at, code in state.xids if at >= since]
        return tuple(codes[-MAX_RECENT_XIDS:])

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the memory of GPUs not in ``keep`` (they left the inventory)."""
        keep_set = set(keep)
        for uuid in list(self._gpus):
            if uuid not in keep_set:
                del self._gpus[uuid]
