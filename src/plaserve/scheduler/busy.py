"""How busy the machine has been lately: the share of a recent horizon spent inside steps.

pla reads it to tell a lightly loaded machine, where there is little to reorder and cutting a long
prompt into chunks only delays it, from a busy one, where chunks let short prompts pass.
"""

from __future__ import annotations

from collections import deque

HORIZON_S = 10.0  # long enough to span the gaps inside a burst, short enough to notice one ending


class BusyMeter:
    """The share of the last ``horizon`` seconds that steps ran (by their start and end times)."""

    def __init__(self, horizon: float = HORIZON_S) -> None:
        self.horizon = horizon
        # (start, end) of recent steps, oldest first
        self.steps: deque[tuple[float, float]] = deque()
        self.since: float | None = None  # when it began to watch

    def record(self, start: float, end: float) -> None:
        if self.since is None:
            self.since = start
        self.steps.append((start, end))

    def share(self, now: float) -> float | None:
        """Busy share of ``[now - horizon, now]``; None until a whole horizon has been watched (no
        evidence yet that the machine is idle: a server that has just started may be about to be busy)."""
        if self.since is None:
            self.since = now
        if now - self.since < self.horizon:
            return None
        start = now - self.horizon
        while self.steps and self.steps[0][1] <= start:
            self.steps.popleft()
        return (
            sum(max(0.0, min(end, now) - max(begin, start)) for begin, end in self.steps)
            / self.horizon
        )
