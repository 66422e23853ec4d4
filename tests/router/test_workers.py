"""The virtual backlog: router accounting, reconciliation with /load, staleness."""

from __future__ import annotations

import pytest

from plaserve.cost import CostModel
from plaserve.router.config import BreakerConfig
from plaserve.router.workers import LoadReport, Worker

COST = CostModel(g1=1e-3, g2=0.0)  # 1 ms per token: costs are easy to read


def worker() -> Worker:
    return Worker("http://w", COST, BreakerConfig())


def test_cost_sums_prompts():
    assert worker().cost((100, 200)) == pytest.approx(0.3)


def test_accounting_added_at_dispatch_removed_at_first_token():
    w = worker()
    w.start(1, 0.5, 500, "long", now=0.0)
    w.start(2, 0.1, 100, "short", now=0.0)
    assert w.backlog(1.0) == pytest.approx(0.6)
    assert (w.num_inflight, w.inflight_tokens) == (2, 600)
    w.first_token(1)
    assert w.backlog(1.0) == pytest.approx(0.1)  # decoding requests are not prefill backlog
    assert w.num_inflight == 2  # ...but still in flight for least_requests / least_tokens
    w.finish(1, True, now=1.0)
    w.finish(2, True, now=1.0)
    assert w.backlog(1.0) == 0 and w.num_inflight == 0 and w.inflight_tokens == 0
    assert w.work_total == pytest.approx(0.6)


def test_report_drains_and_adds_what_it_cannot_contain():
    w = worker()
    w.start(1, 0.4, 400, "long", now=0.0)  # before the poll: in the report
    # the worker has done 0.1 s of it already
    w.load = LoadReport(backlog_s=0.3, sent=1.0, received=1.01)
    w.start(2, 0.2, 200, "long", now=1.05)  # after the poll was sent: not in the report
    assert w.backlog(1.01) == pytest.approx(0.3 + 0.2)
    assert w.backlog(1.21) == pytest.approx(0.1 + 0.2)  # 0.2 s of work done since the report
    # the reported part is done; request 2 is still counted
    assert w.backlog(2.0) == pytest.approx(0.2)
    w.first_token(2)
    assert w.backlog(2.0) == 0.0


def test_first_tokens_of_reported_requests_take_their_cost_off_the_report():
    """A report taken while the previous turn of a conversation waited: once that turn's first token is
    back, its cost is off the worker at once, not after the report's time has drained it."""
    w = worker()
    w.start(1, 0.3, 300, "short", now=0.0)
    w.load = LoadReport(backlog_s=0.5, sent=0.01, received=0.02)  # request 1 and 0.2 s of another's
    w.start(2, 0.1, 100, "short", now=0.03)  # not in the report
    assert w.backlog(0.05) == pytest.approx(0.47 + 0.1)
    w.first_token(1)
    assert w.backlog(0.05) == pytest.approx(0.2 + 0.1)
    w.first_token(1)  # counted once
    assert w.backlog(0.05) == pytest.approx(0.3)
    # the time since the report takes over once it passes what the first tokens took off
    assert w.backlog(0.42) == pytest.approx(0.1 + 0.1)
    # at 0.05: 0.3 to fall to 0.15; the report stands still until 0.32 (0.02 + 0.3), then drains
    assert w.drain_eta(0.15, 0.05, 1.0) == pytest.approx(0.27 + 0.15)
    w.first_token(2)  # after the report was sent: only its own accounting, which drops it
    assert w.backlog(0.05) == pytest.approx(0.2)
    w.load = LoadReport(backlog_s=0.5, sent=1.0, received=1.0)  # a new report starts afresh
    assert w.backlog(1.0) == pytest.approx(0.5)


def test_request_dispatched_at_the_poll_instant_counts_once_more_not_never():
    w = worker()
    w.load = LoadReport(backlog_s=0.0, sent=1.0, received=1.0)
    w.start(1, 0.2, 200, "long", now=1.0)
    assert w.backlog(1.0) == pytest.approx(0.2)


def test_stale_report_is_ignored():
    w = worker()
    w.start(1, 0.4, 400, "long", now=0.0)
    w.load = LoadReport(backlog_s=5.0, sent=0.1, received=0.1)  # includes someone else's work, say
    assert w.backlog(0.5, load_stale_s=1.0) == pytest.approx(4.6)
    assert w.backlog(1.2, load_stale_s=1.0) == pytest.approx(0.4)  # stale: own accounting only


def test_drain_eta():
    w = worker()
    w.load = LoadReport(backlog_s=1.0, sent=0.0, received=0.0)
    w.start(1, 0.3, 300, "long", now=0.5)
    # backlog at 0.5 = 0.5 (reported, drained) + 0.3 = 0.8: it reaches 0.4 after 0.4 s of draining.
    assert w.drain_eta(0.4, 0.5, 1.0) == pytest.approx(0.4)
    assert w.drain_eta(0.2, 0.5, 1.0) is None  # the 0.3 s it cannot contain needs a first token
    assert w.drain_eta(0.9, 0.5, 1.0) is None  # already below


def test_availability_and_failures():
    w = worker()
    assert w.available(0.0)
    w.set_healthy(False)
    assert not w.available(0.0)
    w.set_healthy(True)
    for i in range(3):
        w.start(i, 0.1, 100, "short", now=0.0)
        w.finish(i, False, now=0.0)
    assert not w.available(0.1) and w.failures_total == 3  # the breaker opened
    w2 = worker()
    w2.start(1, 0.1, 100, "short", now=0.0)
    w2.finish(1, False, now=0.0, worker_fault=False)  # e.g. the client left: not the worker's fault
    assert w2.failures_total == 0 and w2.breaker.failures == 0
    w2.remove()
    assert not w2.available(0.0)
