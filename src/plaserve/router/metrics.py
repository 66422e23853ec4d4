"""The router's Prometheus metrics (``GET /metrics``), in a registry of its own per router."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from plaserve.router.hints import HintMetrics

if TYPE_CHECKING:
    from plaserve.router.policies import Policy
    from plaserve.router.workers import Worker

# TTFT and end-to-end buckets from 10 ms to 10 minutes.
_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    600.0,
)


class RouterMetrics:
    """Counters updated as requests go through; gauges filled from the live state at each scrape."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(
            "plaserve_router_requests_total",
            "requests answered, by route and status",
            ["route", "status"],
            registry=r,
        )
        self._children: dict[tuple[int, tuple[str, ...]], object] = {}
        self.attempts = Counter(
            "plaserve_router_worker_attempts_total",
            "requests sent to a worker, by outcome (ok, failed, client_error, client_gone)",
            ["worker", "outcome"],
            registry=r,
        )
        self.retries = Counter(
            "plaserve_router_retries_total", "requests sent again to another worker", registry=r
        )
        self.stream_errors = Counter(
            "plaserve_router_stream_errors_total",
            "streams cut by a worker failure after the first token",
            registry=r,
        )
        self.no_worker = Counter(
            "plaserve_router_no_worker_total", "requests refused: no worker in rotation", registry=r
        )
        self.estimates = Counter(
            "plaserve_router_length_estimates_total",
            "prompt length estimates, by method",
            ["method"],
            registry=r,
        )
        self.pricing = HintMetrics(r, "plaserve_router")
        self.ttft = Histogram(
            "plaserve_router_time_to_first_token_seconds",
            "from arrival at the router to the first token (streamed requests)",
            ["length_class"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "plaserve_router_e2e_request_latency_seconds",
            "from arrival to the last byte",
            ["length_class"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.held = Gauge(
            "plaserve_router_held_requests", "long requests waiting in the router", registry=r
        )
        self.backlog = Gauge(
            "plaserve_router_worker_backlog_seconds", "virtual backlog B_k", ["worker"], registry=r
        )
        self.inflight = Gauge(
            "plaserve_router_worker_inflight_requests", "requests in flight", ["worker"], registry=r
        )
        self.healthy = Gauge(
            "plaserve_router_worker_healthy", "1 in rotation, 0 out", ["worker"], registry=r
        )
        self.cached_tokens = Gauge(
            "plaserve_router_worker_cached_tokens",
            "prompt tokens priced as cached in the worker's prefix cache, every request so far",
            ["worker"],
            registry=r,
        )
        self.cache_hits = Gauge(
            "plaserve_router_worker_cache_hit_tokens",
            "prompt tokens the worker served from its prefix cache, ever (its /load; plaserve)",
            ["worker"],
            registry=r,
        )
        self.prefix_chunks = Gauge(
            "plaserve_router_worker_prefix_chunks",
            "prompt chunks remembered as in the worker's prefix cache (router/prefixes.py)",
            ["worker"],
            registry=r,
        )
        self.short_pool = Gauge(
            "plaserve_router_short_pool_size", "workers in the short pool (pla)", registry=r
        )
        self.pressure = Gauge(
            "plaserve_router_pool_pressure",
            "pool pressure by length class (pla)",
            ["length_class"],
            registry=r,
        )
        self.resizes = Gauge(
            "plaserve_router_pool_resizes",
            "short pool resizes by the controller so far (pla)",
            registry=r,
        )

    def child(self, metric: Counter | Histogram, *labels: str):
        """``metric.labels(*labels)``, looked up once per label tuple (prometheus_client's lookup takes
        a lock and builds a key on every call; this is on every request's path)."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def render(
        self, workers: list["Worker"], policy: "Policy", held: int, now: float, load_stale_s: float
    ) -> bytes:
        """The text exposition, after refreshing the gauges from the live state."""
        self.held.set(held)
        for w in workers:
            self.backlog.labels(w.url).set(w.backlog(now, load_stale_s))
            self.inflight.labels(w.url).set(w.num_inflight)
            self.healthy.labels(w.url).set(1 if w.available(now) else 0)
            self.cached_tokens.labels(w.url).set(w.cached_tokens_total)
            if w.cache_hit_tokens is not None:
                self.cache_hits.labels(w.url).set(w.cache_hit_tokens)
            self.prefix_chunks.labels(w.url).set(len(w.prefixes))
        pools = policy.describe(now).get("pools")
        if pools:
            self.short_pool.set(pools["short_size"])
            self.resizes.set(pools["resizes"])
            for cls, value in pools["pressure"].items():
                self.pressure.labels(cls).set(value)
        return generate_latest(self.registry)

    def forget_worker(self, url: str) -> None:
        """Drop a removed worker's labelled series (its attempt counts stay: they are history)."""
        for gauge in (
            self.backlog,
            self.inflight,
            self.healthy,
            self.cached_tokens,
            self.cache_hits,
            self.prefix_chunks,
        ):
            try:
                gauge.remove(url)
            except KeyError:
                pass
