"""Benchmark results: per-request records, their summary by length class, a table, and plots.

The summary is what ``summary.json`` holds: ``{"short": S, "long": S, "all": S}`` where each ``S`` has
``count``, ``errors``, ``ttft_ms`` (p50/p90/p99), ``tbt_ms`` (p50/p99), ``e2e_ms`` (p50/p99),
``slo_violation_rate``, ``output_throughput_tok_s`` and ``goodput_req_s``. Percentiles are over
successful requests; a failed request counts as an SLO violation. Missing data is ``null``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Sequence

import numpy as np

from plaserve.plotting import pyplot

CLASSES = ("short", "long")


@dataclass
class RequestRecord:
    """What the client saw of one request. Times are seconds; ``arrival`` counts from the run's start."""

    length_class: str
    prompt_tokens: int
    output_tokens: int
    arrival: float
    ttft: float | None
    e2e: float | None
    tbts: list[float] = field(default_factory=list)
    slo_ttft: float | None = None  # the TTFT this request should meet (None: no SLO)
    error: str | None = None

    def as_dict(self) -> dict:
        """The record's fields, shallowly (``dataclasses.asdict`` deep-copies every list: slow for
        the tens of thousands of records of a simulated hour)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def met_slo(self) -> bool:
        """Succeeded, got a first token, and (if it has an SLO) got it in time."""
        return (
            self.ok
            and self.ttft is not None
            and (self.slo_ttft is None or self.ttft <= self.slo_ttft)
        )


def _percentiles(values_ms: list[float], qs: Sequence[int]) -> dict[str, float | None]:
    if not values_ms:
        return {f"p{q}": None for q in qs}
    arr = np.asarray(values_ms, dtype=float)
    return {f"p{q}": float(np.percentile(arr, q)) for q in qs}


def _summarize_class(records: list[RequestRecord], duration_s: float) -> dict:
    ok = [r for r in records if r.ok]
    met = sum(r.met_slo for r in records)
    return {
        "count": len(records),
        "errors": len(records) - len(ok),
        "ttft_ms": _percentiles([r.ttft * 1000 for r in ok if r.ttft is not None], (50, 90, 99)),
        "tbt_ms": _percentiles([g * 1000 for r in ok for g in r.tbts], (50, 99)),
        "e2e_ms": _percentiles([r.e2e * 1000 for r in ok if r.e2e is not None], (50, 99)),
        "slo_violation_rate": 1 - met / len(records) if records else None,
        "output_throughput_tok_s": sum(r.output_tokens for r in ok) / duration_s,
        "goodput_req_s": met / duration_s,
    }


def summarize(records: Sequence[RequestRecord], duration_s: float) -> dict:
    """The summary.json dict: per class ``short``, ``long`` and ``all`` (see the module docstring).

    ``duration_s`` is the run's wall time, the denominator of throughput and goodput.
    """
    if duration_s <= 0:
        raise ValueError(f"duration_s must be positive, got {duration_s}")
    out = {
        cls: _summarize_class([r for r in records if r.length_class == cls], duration_s)
        for cls in CLASSES
    }
    out["all"] = _summarize_class(list(records), duration_s)
    return out


def _fmt(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(summary: dict) -> str:
    """A fixed-width table of a summary, one row per class."""
    head = (
        f"{'class':<6} {'n':>5} {'err':>4} {'TTFT p50':>9} {'p90':>7} {'p99':>7} {'TBT p50':>8} {'p99':>7} "
        f"{'E2E p50':>8} {'p99':>8} {'SLO viol':>8} {'tok/s':>8} {'goodput':>8}"
    )
    lines = [head, "-" * len(head)]
    for cls in (*CLASSES, "all"):
        s = summary[cls]
        viol = s["slo_violation_rate"]
        lines.append(
            f"{cls:<6} {s['count']:>5} {s['errors']:>4} {_fmt(s['ttft_ms']['p50']):>9} {_fmt(s['ttft_ms']['p90']):>7} "
            f"{_fmt(s['ttft_ms']['p99']):>7} {_fmt(s['tbt_ms']['p50'], 1):>8} {_fmt(s['tbt_ms']['p99'], 1):>7} "
            f"{_fmt(s['e2e_ms']['p50']):>8} {_fmt(s['e2e_ms']['p99']):>8} "
            f"{'-' if viol is None else f'{viol * 100:.1f}%':>8} {s['output_throughput_tok_s']:>8.1f} "
            f"{s['goodput_req_s']:>8.2f}"
        )
    lines.append(
        "times in ms; TBT = gap between streamed chunks; goodput = requests meeting their TTFT SLO per second"
    )
    return "\n".join(lines)


def write_run(out_dir: str, summary: dict, run: dict, records: Sequence[RequestRecord]) -> None:
    """Write a run's ``summary.json``, ``run.json`` (what was run) and ``requests.jsonl`` (one record a
    line) to ``out_dir``: the files ``plaserve bench`` and ``plaserve simulate`` both leave."""
    os.makedirs(out_dir, exist_ok=True)
    for name, data in (("summary.json", summary), ("run.json", run)):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(data, f, indent=2)
    with open(os.path.join(out_dir, "requests.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(r.as_dict()) + "\n")


def plot(records: Sequence[RequestRecord], out_dir: str) -> list[str]:
    """Write ``ttft_cdf.png`` (TTFT CDF by class) and ``latency_over_time.png`` (TTFT and end-to-end
    latency against arrival time) to ``out_dir``; returns their paths."""
    plt = pyplot()
    if plt is None:
        return []

    os.makedirs(out_dir, exist_ok=True)
    colors = {"short": "tab:blue", "long": "tab:red"}
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for cls in CLASSES:
        ttfts = sorted(
            r.ttft * 1000 for r in records if r.length_class == cls and r.ok and r.ttft is not None
        )
        if ttfts:
            ax.step(
                ttfts,
                np.arange(1, len(ttfts) + 1) / len(ttfts),
                where="post",
                color=colors[cls],
                label=f"{cls} (n={len(ttfts)})",
            )
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF by length class")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    paths.append(os.path.join(out_dir, "ttft_cdf.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)

    fig, (ax_ttft, ax_e2e) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for cls in CLASSES:
        done = [r for r in records if r.length_class == cls and r.ok]
        ax_ttft.scatter(
            [r.arrival for r in done if r.ttft is not None],
            [r.ttft * 1000 for r in done if r.ttft is not None],
            s=8,
            color=colors[cls],
            label=cls,
        )
        ax_e2e.scatter(
            [r.arrival for r in done if r.e2e is not None],
            [r.e2e * 1000 for r in done if r.e2e is not None],
            s=8,
            color=colors[cls],
            label=cls,
        )
        failed = [r.arrival for r in records if r.length_class == cls and not r.ok]
        if failed:
            ax_ttft.scatter(
                failed, [0] * len(failed), marker="x", color=colors[cls], label=f"{cls} failed"
            )
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_e2e.set_ylabel("end-to-end (ms)")
    ax_e2e.set_xlabel("arrival time (s)")
    ax_ttft.set_title("latency over time")
    for ax in (ax_ttft, ax_e2e):
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    paths.append(os.path.join(out_dir, "latency_over_time.png"))
    fig.tight_layout()
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths
