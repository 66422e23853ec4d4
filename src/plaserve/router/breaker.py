"""A circuit breaker per worker: stop sending requests to a worker whose requests keep failing.

States: *closed* (requests flow); after ``failure_threshold`` consecutive failed requests, *open* (no
requests) for ``open_s``; then *half-open*: one request goes through as a probe. A good probe closes
the circuit; a failed one opens it again for twice as long (at most ``max_open_s``). Health checks are
separate (a worker can answer ``/health`` and still fail every request, e.g. a broken model), so only
request outcomes move the breaker. Times come from the caller, which keeps it deterministic in tests.
"""

from __future__ import annotations

from plaserve.router.config import BreakerConfig


class CircuitBreaker:
    """Closed / open / half-open, driven by :meth:`record_success` and :meth:`record_failure`."""

    def __init__(self, config: BreakerConfig) -> None:
        self.config = config
        self.failures = 0  # consecutive
        self.opened_at: float | None = None  # None: closed
        self.open_for = config.open_s
        self.probing = False  # half-open and the probe is out

    def state(self, now: float) -> str:
        """``"closed"``, ``"open"`` or ``"half_open"``."""
        if self.opened_at is None:
            return "closed"
        return "open" if now < self.opened_at + self.open_for else "half_open"

    def allows(self, now: float) -> bool:
        """Whether a new request may go to the worker now (a half-open circuit allows one probe)."""
        state = self.state(now)
        return state == "closed" or (state == "half_open" and not self.probing)

    def on_dispatch(self, now: float) -> None:
        """A request was sent; in half-open state it is the probe."""
        if self.state(now) == "half_open":
            self.probing = True

    def record_success(self) -> None:
        self.failures = 0
        self.opened_at = None
        self.open_for = self.config.open_s
        self.probing = False

    def record_failure(self, now: float) -> None:
        self.failures += 1
        if self.opened_at is not None and self.probing:  # the probe failed: open again, longer
            self.open_for = min(self.open_for * 2, self.config.max_open_s)
            self.opened_at, self.probing = now, False
        elif self.opened_at is None and self.failures >= self.config.failure_threshold:
            self.opened_at = now

    def reset(self) -> None:
        """Forget the history (a worker re-added by the operator starts closed)."""
        self.record_success()
