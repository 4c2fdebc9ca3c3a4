"""How often the hub's login and signup forms may be tried: pure policy, no I/O, the time
passed in.

Failed logins are counted per account name **and** client address (:class:`LoginBackoff`):
after ``free_failures`` failures in a row, each further try from that address for that name
waits twice as long as the last (``first_wait_s``, then double, up to ``max_wait_s``). A
stranger who guesses at ``admin`` from an address of their own slows only their own guesses:
the admin, from another address, logs in at once. The counter for a name and an address ends
with a success there, or ``forget_after_s`` after its last failure.

Signups are counted per client address and over all addresses together
(:class:`SignupThrottle`): at most ``per_address`` in a ``window_s`` from one address, and at
most ``in_total`` from all, so that one person cannot fill the admins' list at
``/hub/authorize`` with accounts, nor many addresses (IPv6 gives anyone plenty) together.

Both keep a bounded number of entries (``max_entries``): beyond it, the oldest are forgotten,
so a flood of names or addresses cannot grow the hub's memory.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

__all__ = ["LoginBackoff", "SignupThrottle"]


@dataclass
class _Failures:
    count: int
    last_at: float


@dataclass
class LoginBackoff:
    """Failed logins per (name, address) and the wait they earn (exponential)."""

    free_failures: int = 3
    """Failures in a row that cost nothing (typos)."""
    first_wait_s: float = 2.0
    """The wait after the first failure beyond ``free_failures``; each further one doubles."""
    max_wait_s: float = 900.0
    """The longest wait."""
    forget_after_s: float = 3600.0
    """A counter with no failure for this long starts again at zero."""
    max_entries: int = 100_000
    """Counters kept at most; the oldest go first."""
    _failures: OrderedDict[tuple[str, str], _Failures] = field(
        default_factory=OrderedDict, repr=False)

    def wait_s(self, name: str, address: str, now: float) -> float:
        """Seconds until ``address`` may try ``name`` again (0: now)."""
        failures = self._current(name, address, now)
        if failures is None or failures.count <= self.free_failures:
            return 0.0
        earned = min(self.first_wait_s * 2.0 ** (failures.count - self.free_failures - 1),
                     self.max_wait_s)
        return max(0.0, earned - (now - failures.last_at))

    def failed(self, name: str, address: str, now: float) -> None:
        """A failed login of ``name`` from ``address`` at ``now``."""
        key = (name, address)
        failures = self._current(name, address, now)
        self._failures[key] = _Failures((failures.count if failures else 0) + 1, now)
        self._failures.move_to_end(key)
        while len(self._failures) > self.max_entries:
            self._failures.popitem(last=False)

    def succeeded(self, name: str, address: str) -> None:
        """A successful login of ``name`` from ``address``: its counter ends."""
        self._failures.pop((name, address), None)

    def _current(self, name: str, address: str, now: float) -> _Failures | None:
        failures = self._failures.get((name, address))
        if failures is not None and now - failures.last_at >= self.forget_after_s:
            del self._failures[(name, address)]
            return None
        return failures


@dataclass
class SignupThrottle:
    """Signups per client address and in total, each within a sliding window."""

    per_address: int = 3
    in_total: int = 30
    window_s: float = 3600.0
    max_entries: int = 100_000
    """Addresses kept at most; the one seen longest ago goes first."""
    _by_address: OrderedDict[str, deque[float]] = field(default_factory=OrderedDict,
                                                        repr=False)
    _all: deque[float] = field(default_factory=deque, repr=False)

    def wait_s(self, address: str, now: float) -> float:
        """Seconds until ``address`` may sign up again (0: now)."""
        waits = [0.0]
        recent = self._recent(self._by_address.get(address), now)
        if recent is not None and len(recent) >= self.per_address:
            waits.append(recent[0] + self.window_s - now)
        everyone = self._recent(self._all, now)
        assert everyone is not None
        if len(everyone) >= self.in_total:
            waits.append(everyone[0] + self.window_s - now)
        return max(waits)

    def signed_up(self, address: str, now: float) -> None:
        """A signup from ``address`` at ``now`` (whether or not it made an account: each
        try costs the admins a look, or the hub a password hash)."""
        times = self._by_address.setdefault(address, deque())
        times.append(now)
        self._by_address.move_to_end(address)
        self._all.append(now)
        while len(self._by_address) > self.max_entries:
            self._by_address.popitem(last=False)

    def _recent(self, times: deque[float] | None, now: float) -> deque[float] | None:
        while times and times[0] <= now - self.window_s:
            times.popleft()
        return times
