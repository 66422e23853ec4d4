"""Length buckets and the adaptive window."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from plaserve.scheduler.buckets import batch_sizes, bucket_for, make_buckets, pick_bucket_batch
from plaserve.scheduler.window import AdaptiveWindow


def test_buckets_are_powers_of_two_up_to_the_threshold():
    assert make_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert make_buckets(513) == [16, 32, 64, 128, 256, 512]  # 512 tokens still short (< 513)
    assert make_buckets(100) == [16, 32, 64, 128]
    assert batch_sizes(16) == [1, 2, 4, 8, 16] and batch_sizes(12) == [1, 2, 4, 8]


def test_bucket_for_picks_the_smallest_that_fits():
    b = make_buckets(512)
    assert [bucket_for(n, b) for n in (1, 16, 17, 100, 511, 513)] == [16, 16, 32, 128, 512, None]


def test_batch_takes_the_oldest_requests_bucket_only():
    b = make_buckets(512)
    lengths = [100, 20, 120, 90, 300, 70, 110]  # oldest first
    batch, bucket = pick_bucket_batch(lengths, lambda n: n, b, lambda k: 3)
    assert bucket == 128 and batch == [100, 120, 90]  # 70 is bucket 128 too but the batch is full
    batch, bucket = pick_bucket_batch([20, 100], lambda n: n, b, lambda k: 8)
    assert bucket == 32 and batch == [20]  # no cross-bucket padding
    assert pick_bucket_batch([], lambda n: n, b, lambda k: 8) is None


@given(st.lists(st.floats(0, 1.0), min_size=1, max_size=50), st.integers(1, 32), st.integers(0, 32))
def test_window_stays_within_bounds(gaps, target, queued):
    w = AdaptiveWindow(0.001, 0.02)
    t = 0.0
    for g in gaps:
        t += g
        w.observe_arrival(t)
        width = w.width(target, queued)
        assert width == 0 or 0.001 <= width <= 0.02  # shut, or open within its bounds


def test_window_follows_the_arrival_rate():
    w = AdaptiveWindow(0.001, 0.05)
    assert w.width(8, 1) == 0  # no rate known yet: do not wait
    for i in range(50):
        w.observe_arrival(i * 0.002)  # 500/s: 7 more arrive in 14 ms
    assert abs(w.width(8, 1) - 0.014) < 1e-6
    assert w.width(8, 8) == 0  # full
    for i in range(50):
        w.observe_arrival(1 + i * 0.5)  # 2/s: a full batch would take seconds, waiting is pointless
    assert w.width(8, 1) == 0
