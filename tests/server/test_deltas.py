"""Streaming deltas never send text that a stop string later cuts away."""

from __future__ import annotations

from plaserve.server.deltas import DeltaTracker, stop_prefix_len


def test_stop_prefix_len() -> None:
    assert stop_prefix_len("hello wor", ("world",)) == 3
    assert stop_prefix_len("hello", ("world",)) == 0
    assert stop_prefix_len("abc\n\nUs", ("\n\nUser:", "xyz")) == 4
    assert stop_prefix_len("ab", ("abc",)) == 2
    # a whole stop string is the engine's to cut, not a prefix
    assert stop_prefix_len("abc", ("abc",)) == 0
    assert stop_prefix_len("aab", ("ab", "aab")) == 0
    assert stop_prefix_len("xa", ("ab", "aab")) == 1
    assert stop_prefix_len("anything", ()) == 0


def test_tail_that_may_start_a_stop_string_is_held_back() -> None:
    tracker = DeltaTracker(("STOP",))
    assert tracker.delta("hello S", finished=False) == "hello "
    assert tracker.delta("hello ST", finished=False) == ""
    # The engine cut the text at the stop string and finished: nothing of "ST" was ever sent.
    assert tracker.delta("hello ", finished=True) == ""


def test_held_back_text_is_released_once_it_cannot_be_a_stop() -> None:
    tracker = DeltaTracker(("STOP",))
    assert tracker.delta("a S", finished=False) == "a "
    assert tracker.delta("a SX", finished=False) == "SX"
    assert tracker.delta("a SXS", finished=False) == ""
    assert tracker.delta("a SXS", finished=True) == "S"  # finished: everything left goes out


def test_deltas_join_to_the_final_text_without_stops() -> None:
    tracker = DeltaTracker()
    texts = ["", "a", "ab", "abc d", "abc de"]
    assert "".join(tracker.delta(t, finished=t == texts[-1]) for t in texts) == "abc de"
