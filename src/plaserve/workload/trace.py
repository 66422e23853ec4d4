"""Request traces: arrival times and lengths, from a real trace file or a synthetic bimodal mix.

Scaling convention (the same for every function here):

* ``time_scale`` multiplies inter-arrival times: ``time_scale = 2`` stretches the trace to twice its
  duration (half the arrival rate); ``0.5`` compresses it (double the rate).
* ``length_scale`` multiplies prompt and output lengths (``0.1`` turns a 4,000-token prompt into 400),
  then lengths are rounded, clamped to at least 1 and to ``max_prompt_tokens`` / ``max_output_tokens``.

Trace files are the Azure LLM inference trace CSVs (``TIMESTAMP,ContextTokens,GeneratedTokens``, see
``/work/shared/traces``); ``TIMESTAMP`` may also be plain seconds.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Iterable


@dataclass(frozen=True)
class TraceRequest:
    """One request to replay: when it arrives and how long it is."""

    arrival: float  # seconds since the start of the replay
    prompt_tokens: int
    output_tokens: int


def parse_timestamp(text: str) -> float:
    """Seconds (epoch or any fixed origin) of ``YYYY-MM-DD HH:MM:SS[.fffffff]`` or of a plain number.

    Azure traces carry 7 fractional digits, more than ``datetime`` parses, so the fraction is read apart.
    """
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    whole, _, fraction = text.partition(".")
    # Read as UTC: only differences matter, and local time would bend them across a DST change.
    seconds = datetime.fromisoformat(whole).replace(tzinfo=timezone.utc).timestamp()
    return seconds + (float(f"0.{fraction}") if fraction else 0.0)


def scale_requests(
    requests: Iterable[TraceRequest],
    *,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> list[TraceRequest]:
    """Apply the module's scaling convention to requests whose arrivals already start at 0."""
    if time_scale <= 0 or length_scale <= 0:
        raise ValueError("time_scale and length_scale must be positive")

    def length(n: int, cap: int | None) -> int:
        n = max(1, round(n * length_scale))
        return min(n, cap) if cap is not None else n

    return [
        TraceRequest(
            r.arrival * time_scale,
            length(r.prompt_tokens, max_prompt_tokens),
            length(r.output_tokens, max_output_tokens),
        )
        for r in requests
    ]


def load_trace(
    path: str,
    *,
    start: int = 0,
    limit: int | None = None,
    time_scale: float = 1.0,
    length_scale: float = 1.0,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> list[TraceRequest]:
    """Rows ``[start, start + limit)`` of a trace CSV, arrivals relative to the first of them, scaled.

    Rows are sorted by arrival (the Azure files are sorted already; this guards hand-made ones).
    """
    if start < 0 or (limit is not None and limit < 0):
        raise ValueError("start and limit must be non-negative")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(sorted(missing))}")
        rows = []
        for i, row in enumerate(reader):
            if i < start:
                continue
            if limit is not None and len(rows) >= limit:
                break
            rows.append(
                (
                    parse_timestamp(row["TIMESTAMP"]),
                    int(row["ContextTokens"]),
                    int(row["GeneratedTokens"]),
                )
            )
    rows.sort(key=lambda r: r[0])
    t0 = rows[0][0] if rows else 0.0
    raw = [TraceRequest(t - t0, prompt, output) for t, prompt, output in rows]
    return scale_requests(
        raw,
        time_scale=time_scale,
        length_scale=length_scale,
        max_prompt_tokens=max_prompt_tokens,
        max_output_tokens=max_output_tokens,
    )


def synthetic_bimodal(
    n: int,
    rate: float,
    *,
    seed: int = 0,
    short: tuple[int, int] = (16, 256),
    long: tuple[int, int] = (1024, 4096),
    long_share: float = 0.2,
    output: tuple[int, int] = (8, 64),
) -> list[TraceRequest]:
    """``n`` requests with Poisson arrivals at ``rate`` per second (the first at 0): a share
    ``long_share`` of prompts uniform in ``long``, the rest uniform in ``short``; outputs uniform in
    ``output`` (all ranges inclusive)."""
    if n < 0 or rate <= 0 or not 0 <= long_share <= 1:
        raise ValueError("need n >= 0, rate > 0 and 0 <= long_share <= 1")
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        lo, hi = long if rng.random() < long_share else short
        out.append(TraceRequest(t, rng.randint(lo, hi), rng.randint(*output)))
    return out


def fit_to_context(req: TraceRequest, max_model_len: int | None) -> TraceRequest:
    """Shorten a request so prompt + output fits ``max_model_len`` (outputs first keep their length)."""
    if max_model_len is None:
        return req
    output = max(1, min(req.output_tokens, max_model_len - 1))
    prompt = max(1, min(req.prompt_tokens, max_model_len - output))
    return replace(req, prompt_tokens=prompt, output_tokens=output)
