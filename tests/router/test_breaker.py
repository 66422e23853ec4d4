"""The circuit breaker's states, on explicit times."""

from __future__ import annotations

from plaserve.router.breaker import CircuitBreaker
from plaserve.router.config import BreakerConfig


def test_opens_after_consecutive_failures_and_probes_after_open_period():
    b = CircuitBreaker(BreakerConfig(failure_threshold=3, open_s=5.0, max_open_s=12.0))
    b.record_failure(0.0)
    b.record_failure(0.1)
    b.record_success()  # a success resets the count
    b.record_failure(0.2)
    b.record_failure(0.3)
    assert b.state(0.3) == "closed" and b.allows(0.3)
    b.record_failure(1.0)
    assert b.state(1.0) == "open" and not b.allows(5.9)
    assert b.state(6.0) == "half_open" and b.allows(6.0)
    b.on_dispatch(6.0)  # the probe is out: nothing else goes
    assert not b.allows(6.1)
    b.record_failure(6.5)  # the probe failed: open twice as long
    assert b.state(16.4) == "open" and b.state(16.5) == "half_open"
    b.on_dispatch(16.5)
    b.record_failure(16.6)  # ...and again, capped at max_open_s
    assert b.state(28.5) == "open" and b.state(28.6) == "half_open"
    b.on_dispatch(28.6)
    b.record_success()
    assert b.state(28.7) == "closed" and b.allows(28.7)
    # Closed again: the open period starts over at open_s.
    for t in (30.0, 30.1, 30.2):
        b.record_failure(t)
    assert b.state(35.1) == "open" and b.state(35.2) == "half_open"
