"""Text deltas for streaming, holding back any tail that may turn out to be the start of a stop string.

The engine reports each request's full output text so far, already cut where a stop string matched. If
the text currently ends in ``"\\n\\nUs"`` and ``"\\n\\nUser:"`` is a stop string, the next token may
complete it and the engine will cut those characters away; so they are not sent until it is clear they
stay. What is sent is therefore always a prefix of the final text.
"""

from __future__ import annotations

from plaserve.request import TokenLogprobs


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``stops``."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class DeltaTracker:
    """Turns successive full texts (and logprobs) of one request into the deltas to send."""

    def __init__(self, stops: tuple[str, ...] = ()) -> None:
        self.stops = stops
        self.sent = 0  # characters of the text already sent
        self.logprobs_sent = 0  # entries of the logprobs already sent
        self.token_chars = 0  # characters of the sent logprobs' token texts (the next text offset)

    def delta(self, text: str, finished: bool) -> str:
        """New text that is safe to send; everything left once ``finished``."""
        end = len(text) if finished else len(text) - stop_prefix_len(text, self.stops)
        if end <= self.sent:
            return ""
        out = text[self.sent : end]
        self.sent = end
        return out

    def new_logprobs(self, entries: list[TokenLogprobs] | None) -> list[TokenLogprobs] | None:
        """The entries not sent yet (None when the request did not ask for logprobs). They go out as
        tokens arrive: a token whose text is held back still has its logprobs sent."""
        if entries is None:
            return None
        new = entries[self.logprobs_sent :]
        self.logprobs_sent = len(entries)
        return new
