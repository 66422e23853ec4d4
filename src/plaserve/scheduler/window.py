"""The adaptive batch waiting window for short prefills (the research design's AWD).

Short requests wait at the head of the short queue for a window ``W`` so that more can join their
batch. ``W`` follows the arrival rate: the window is the time a full batch is expected to take to
arrive, at least ``W_min``, when that is within ``W_max``; otherwise waiting would not fill the batch,
and the window stays shut (``W = 0``): at light load a short request leaves at once. The batch also
leaves early when it is full or when a request's deadline slack runs out
(:meth:`~plaserve.scheduler.short_queue.ShortQueue.ready_at`).
"""

from __future__ import annotations


class AdaptiveWindow:
    """Tracks the short-request arrival rate and turns it into a waiting window (seconds)."""

    def __init__(self, w_min: float, w_max: float, smoothing: float = 0.2) -> None:
        if not 0 <= w_min <= w_max:
            raise ValueError(f"need 0 <= W_min <= W_max, got {w_min}, {w_max}")
        self.w_min, self.w_max = w_min, w_max
        self.smoothing = smoothing
        self.mean_gap: float | None = None  # EWMA of the time between short arrivals
        self.last_arrival: float | None = None

    def observe_arrival(self, t: float) -> None:
        """Record one short request arriving at time ``t``."""
        if self.last_arrival is not None:
            gap = max(0.0, t - self.last_arrival)
            self.mean_gap = (
                gap
                if self.mean_gap is None
                else (1 - self.smoothing) * self.mean_gap + self.smoothing * gap
            )
        self.last_arrival = t

    def width(self, batch_target: int, queued: int) -> float:
        """Window for a batch that has ``queued`` requests and could take ``batch_target``: 0 when it is
        full, when no rate is known yet, or when the batch would not fill within ``W_max``."""
        if self.mean_gap is None or queued >= batch_target:
            return 0.0
        fill_time = (batch_target - queued) * self.mean_gap
        return max(fill_time, self.w_min) if fill_time <= self.w_max else 0.0

    def quiet(self, now: float, gaps: float, floor: float = 0.0) -> bool:
        """Whether short arrivals have paused at ``now``: none for ``gaps`` mean gaps, ``W_max`` and
        ``floor`` seconds since the last one. False until a rate is known (two have arrived)."""
        if self.mean_gap is None or self.last_arrival is None:
            return False
        return now - self.last_arrival > max(gaps * self.mean_gap, self.w_max, floor)
