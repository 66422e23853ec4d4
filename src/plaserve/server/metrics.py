"""Prometheus metrics of one server, in a registry of its own (several apps can live in one process).

Request latencies are observed by the engine thread as tokens appear (prometheus_client is thread-safe);
gauges and engine counters are read at scrape time from the engine loop's latest published snapshot,
so a scrape never touches the engine itself.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LENGTH_CLASSES = ("short", "long")
FINISH_REASONS = ("stop", "length", "abort")

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)


class ServerMetrics:
    """The server's metrics. ``snapshot`` returns the engine loop's latest load snapshot (or None)."""

    def __init__(self, snapshot: Callable[[], "object | None"] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("plaserve_requests", "Finished requests by length class and finish reason",
                                ["length_class", "finish_reason"], registry=r)
        self.http_errors = Counter("plaserve_http_errors", "Requests answered with an error, by HTTP status",
                                   ["status"], registry=r)
        self.ttft = Histogram("plaserve_time_to_first_token_seconds", "Time to first token (from arrival)",
                              ["length_class"], buckets=_TTFT_BUCKETS, registry=r)
        self.tbt = Histogram("plaserve_time_between_tokens_seconds", "Time between consecutive output tokens",
                             ["length_class"], buckets=_TBT_BUCKETS, registry=r)
        self.e2e = Histogram("plaserve_e2e_request_latency_seconds", "Arrival to last token",
                             ["length_class"], buckets=_E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("plaserve_prompt_tokens", "Prompt tokens of finished requests",
                                     ["length_class"], registry=r)
        self.generation_tokens = Counter("plaserve_generation_tokens", "Generated tokens of finished requests",
                                         ["length_class"], registry=r)
        # Create every labelled child up front, so each series exists (at 0) from the first scrape.
        for cls in LENGTH_CLASSES:
            for reason in FINISH_REASONS:
                self.requests.labels(cls, reason)
            for family in (self.ttft, self.tbt, self.e2e, self.prompt_tokens, self.generation_tokens):
                family.labels(cls)
        if snapshot is not None:
            r.register(EngineCollector(snapshot))

    def observe_first_token(self, length_class: str, ttft: float) -> None:
        self.ttft.labels(length_class).observe(max(ttft, 0.0))

    def observe_token_gap(self, length_class: str, gap: float) -> None:
        self.tbt.labels(length_class).observe(max(gap, 0.0))

    def observe_finish(self, length_class: str, reason: str, e2e: float | None, prompt_tokens: int,
                       output_tokens: int) -> None:
        self.requests.labels(length_class, reason).inc()
        if e2e is not None and reason != "abort":
            self.e2e.labels(length_class).observe(max(e2e, 0.0))
        self.prompt_tokens.labels(length_class).inc(prompt_tokens)
        self.generation_tokens.labels(length_class).inc(output_tokens)

    def count_error(self, status: int) -> None:
        self.http_errors.labels(str(status)).inc()

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """Gauges and engine counters from the latest snapshot (see :class:`~plaserve.server.engine_loop.EngineSnapshot`)."""

    def __init__(self, snapshot: Callable[[], "object | None"]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        if snap is None:
            return
        load, stats = snap.load, snap.stats
        for name, key, doc in (("plaserve_queued_requests", "queued", "Requests waiting for KV blocks"),
                               ("plaserve_running_requests", "running", "Requests holding KV blocks"),
                               ("plaserve_backlog_seconds", "backlog_s", "Predicted prefill work queued and running")):
            g = GaugeMetricFamily(name, doc, labels=["length_class"])
            for cls in LENGTH_CLASSES:
                g.add_metric([cls], float(load[key].get(cls, 0)))
            yield g
        kv = load["kv"]
        yield GaugeMetricFamily("plaserve_kv_blocks_used", "KV cache blocks in use", value=kv["used_blocks"])
        yield GaugeMetricFamily("plaserve_kv_blocks_free", "KV cache blocks free", value=kv["free_blocks"])
        yield GaugeMetricFamily("plaserve_kv_utilization", "Fraction of KV blocks in use", value=kv["utilization"])
        yield GaugeMetricFamily("plaserve_pending_submissions", "Requests accepted by HTTP, not yet in the engine",
                                value=snap.pending)
        for name, key, doc in (
                ("plaserve_prefix_cache_hit_tokens", "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache"),
                ("plaserve_grid_hits", "grid_hits", "Short batches run on a pre-built (batch, bucket) runner"),
                ("plaserve_grid_fallbacks", "grid_fallbacks", "Short batches that fell back to the eager path"),
                ("plaserve_decode_grid_hits", "decode_grid_hits", "Decode steps run on a pre-built (batch, blocks) runner"),
                ("plaserve_decode_grid_fallbacks", "decode_grid_fallbacks",
                 "Decode steps that fell back to the eager path (the decode grid had no room)"),
                ("plaserve_engine_steps", "num_steps", "Engine steps run"),
                ("plaserve_preemptions", "num_preemptions", "Requests preempted for KV memory")):
            yield CounterMetricFamily(name, doc, value=float(stats.get(key, 0)))
