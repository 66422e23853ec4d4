"""Prometheus metrics of one server, in a registry of its own (several apps can live in one process).

Request latencies are observed by the engine thread as tokens appear (prometheus_client is thread-safe);
gauges and engine counters are read at scrape time from the engine loop's latest published snapshot,
so a scrape never touches the engine itself.

Two sets of names: ``plaserve_*``, by length class, and vLLM's ``vllm:*`` with a ``model_name`` label,
the names that gateways (the Gateway API Inference Extension's model-server protocol), autoscalers and
vLLM's Grafana dashboard read, so they work with plaserve unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from plaserve.request import RequestMetrics

LENGTH_CLASSES = ("short", "long")
FINISH_REASONS = (
    "stop",
    "length",
    "abort",
    "error",
)  # error: no token could be sampled, or the engine failed

_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TBT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class VllmMetrics:
    """vLLM's request metrics (the names of its v1 engine), all labelled ``model_name``."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        m = ["model_name"]

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=registry)

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token", _TTFT_BUCKETS)
        self.itl = hist(
            "vllm:inter_token_latency_seconds", "Time between output tokens", _TBT_BUCKETS
        )
        self.tpot = hist(
            "vllm:time_per_output_token_seconds",
            "Time per output token (older name of the inter-token latency)",
            _TBT_BUCKETS,
        )
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to last token", _E2E_BUCKETS)
        self.queue = hist(
            "vllm:request_queue_time_seconds", "Arrival to first scheduled", _E2E_BUCKETS
        )
        self.prefill = hist(
            "vllm:request_prefill_time_seconds", "First scheduled to first token", _E2E_BUCKETS
        )
        self.decode = hist(
            "vllm:request_decode_time_seconds", "First token to last token", _E2E_BUCKETS
        )
        self.prompt_hist = hist(
            "vllm:request_prompt_tokens", "Prompt tokens per request", _TOKEN_BUCKETS
        )
        self.generation_hist = hist(
            "vllm:request_generation_tokens", "Generated tokens per request", _TOKEN_BUCKETS
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of finished requests", m, registry=registry
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generated tokens of finished requests", m, registry=registry
        )
        self.success = Counter(
            "vllm:request_success",
            "Finished requests by reason",
            m + ["finished_reason"],
            registry=registry,
        )
        for family in (
            self.ttft,
            self.itl,
            self.tpot,
            self.e2e,
            self.queue,
            self.prefill,
            self.decode,
            self.prompt_hist,
            self.generation_hist,
            self.prompt_tokens,
            self.generation_tokens,
        ):
            family.labels(model_name)
        for reason in ("stop", "length", "abort", "error"):
            self.success.labels(model_name, reason)


class ServerMetrics:
    """The server's metrics. ``snapshot`` returns the engine loop's latest load snapshot (or None)."""

    def __init__(
        self, snapshot: Callable[[], "object | None"] | None = None, model_name: str = "plaserve"
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.vllm = VllmMetrics(r, model_name)
        self.requests = Counter(
            "plaserve_requests",
            "Finished requests by length class and finish reason",
            ["length_class", "finish_reason"],
            registry=r,
        )
        self.http_errors = Counter(
            "plaserve_http_errors",
            "Requests answered with an error, by HTTP status",
            ["status"],
            registry=r,
        )
        self.ttft = Histogram(
            "plaserve_time_to_first_token_seconds",
            "Time to first token (from arrival)",
            ["length_class"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tbt = Histogram(
            "plaserve_time_between_tokens_seconds",
            "Time between consecutive output tokens",
            ["length_class"],
            buckets=_TBT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "plaserve_e2e_request_latency_seconds",
            "Arrival to last token",
            ["length_class"],
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "plaserve_prompt_tokens",
            "Prompt tokens of finished requests",
            ["length_class"],
            registry=r,
        )
        self.generation_tokens = Counter(
            "plaserve_generation_tokens",
            "Generated tokens of finished requests",
            ["length_class"],
            registry=r,
        )
        self.engine_restarts = Counter(
            "plaserve_engine_restarts",
            "Times the engine loop recovered from a "
            "failed step (requests in flight failed, KV cache reset)",
            registry=r,
        )
        # Create every labelled child up front, so each series exists (at 0) from the first scrape.
        for cls in LENGTH_CLASSES:
            for reason in FINISH_REASONS:
                self.requests.labels(cls, reason)
            for family in (
                self.ttft,
                self.tbt,
                self.e2e,
                self.prompt_tokens,
                self.generation_tokens,
            ):
                family.labels(cls)
        if snapshot is not None:
            r.register(EngineCollector(snapshot, model_name))

    def observe_first_token(self, length_class: str, ttft: float) -> None:
        self.ttft.labels(length_class).observe(max(ttft, 0.0))
        self.vllm.ttft.labels(self.vllm.model_name).observe(max(ttft, 0.0))

    def observe_token_gap(self, length_class: str, gap: float) -> None:
        self.tbt.labels(length_class).observe(max(gap, 0.0))
        for family in (self.vllm.itl, self.vllm.tpot):
            family.labels(self.vllm.model_name).observe(max(gap, 0.0))

    def observe_finish(
        self,
        length_class: str,
        reason: str,
        e2e: float | None,
        prompt_tokens: int,
        output_tokens: int,
        times: RequestMetrics | None = None,
    ) -> None:
        """A finished request; ``times`` (its engine timestamps) for the queue, prefill and decode times."""
        v, name = self.vllm, self.vllm.model_name
        self.requests.labels(length_class, reason).inc()
        v.success.labels(name, reason).inc()
        if e2e is not None and reason not in ("abort", "error"):
            self.e2e.labels(length_class).observe(max(e2e, 0.0))
            v.e2e.labels(name).observe(max(e2e, 0.0))
            if (
                times is not None
                and times.first_scheduled_time is not None
                and times.first_token_time is not None
            ):
                v.queue.labels(name).observe(
                    max(times.first_scheduled_time - times.arrival_time, 0.0)
                )
                v.prefill.labels(name).observe(
                    max(times.first_token_time - times.first_scheduled_time, 0.0)
                )
                if times.finish_time is not None:
                    v.decode.labels(name).observe(
                        max(times.finish_time - times.first_token_time, 0.0)
                    )
        self.prompt_tokens.labels(length_class).inc(prompt_tokens)
        self.generation_tokens.labels(length_class).inc(output_tokens)
        v.prompt_tokens.labels(name).inc(prompt_tokens)
        v.generation_tokens.labels(name).inc(output_tokens)
        v.prompt_hist.labels(name).observe(prompt_tokens)
        v.generation_hist.labels(name).observe(output_tokens)

    def count_error(self, status: int) -> None:
        self.http_errors.labels(str(status)).inc()

    def count_restart(self) -> None:
        """The engine loop recovered from a failed step (see ``EngineLoop``)."""
        self.engine_restarts.inc()

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """Gauges and engine counters from the latest snapshot (see :class:`~plaserve.server.engine_loop.EngineSnapshot`)."""

    def __init__(self, snapshot: Callable[[], "object | None"], model_name: str) -> None:
        self.snapshot = snapshot
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        if snap is None:
            return
        load, stats = snap.load, snap.stats
        for name, key, doc in (
            ("plaserve_queued_requests", "queued", "Requests waiting for KV blocks"),
            ("plaserve_running_requests", "running", "Requests holding KV blocks"),
            ("plaserve_backlog_seconds", "backlog_s", "Predicted prefill work queued and running"),
        ):
            g = GaugeMetricFamily(name, doc, labels=["length_class"])
            for cls in LENGTH_CLASSES:
                g.add_metric([cls], float(load[key].get(cls, 0)))
            yield g
        kv = load["kv"]
        yield GaugeMetricFamily(
            "plaserve_kv_blocks_used", "KV cache blocks in use", value=kv["used_blocks"]
        )
        yield GaugeMetricFamily(
            "plaserve_kv_blocks_free", "KV cache blocks free", value=kv["free_blocks"]
        )
        yield GaugeMetricFamily(
            "plaserve_kv_utilization", "Fraction of KV blocks in use", value=kv["utilization"]
        )
        yield GaugeMetricFamily(
            "plaserve_pending_submissions",
            "Requests accepted by HTTP, not yet in the engine",
            value=snap.pending,
        )
        for name, key, doc in (
            (
                "plaserve_prefix_cache_hit_tokens",
                "prefix_cache_hit_tokens",
                "Prompt tokens served from the prefix cache",
            ),
            (
                "plaserve_grid_hits",
                "grid_hits",
                "Short batches run on a pre-built (batch, bucket) runner",
            ),
            (
                "plaserve_grid_fallbacks",
                "grid_fallbacks",
                "Short batches that fell back to the eager path",
            ),
            (
                "plaserve_decode_grid_hits",
                "decode_grid_hits",
                "Decode steps run on a pre-built (batch, blocks) runner",
            ),
            (
                "plaserve_decode_grid_fallbacks",
                "decode_grid_fallbacks",
                "Decode steps that fell back to the eager path (the decode grid had no room)",
            ),
            ("plaserve_engine_steps", "num_steps", "Engine steps run"),
            ("plaserve_preemptions", "num_preemptions", "Requests preempted for KV memory"),
        ):
            yield CounterMetricFamily(name, doc, value=float(stats.get(key, 0)))
        yield from self._vllm(snap)

    def _vllm(self, snap: Any) -> Iterator[Metric]:
        """vLLM's engine gauges and counters, from the same snapshot."""
        load, stats, m = snap.load, snap.stats, [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(m, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(m, value)
            return c

        yield gauge(
            "vllm:num_requests_running", "Requests holding KV blocks", sum(load["running"].values())
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Requests waiting to start (in the engine or its inbox)",
            sum(load["queued"].values()) + snap.pending,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV blocks in use (1 = full)",
            load["kv"]["utilization"],
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            float(stats.get("prefix_cache_query_tokens", 0)),
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache",
            float(stats.get("prefix_cache_hit_tokens", 0)),
        )
        yield counter(
            "vllm:num_preemptions",
            "Requests preempted for KV memory",
            float(stats.get("num_preemptions", 0)),
        )
        kv = load["kv"]
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "The KV cache's configuration",
            labels=[
                "model_name",
                "block_size",
                "num_gpu_blocks",
                "cache_dtype",
                "enable_prefix_caching",
            ],
        )
        info.add_metric(
            [
                self.model_name,
                str(kv["block_size"]),
                str(kv["used_blocks"] + kv["free_blocks"]),
                str(load.get("dtype", "auto")),
                str(kv.get("prefix_caching", True)),
            ],
            1.0,
        )
        yield info
