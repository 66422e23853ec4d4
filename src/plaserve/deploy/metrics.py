"""The Prometheus metrics of the Ray deployment's ingress process: the request router's decisions
and the ingress's requests, in one registry that the ingress serves on ``/metrics``.

One registry a process (:func:`deploy_metrics`): Ray builds the request router itself, in the
process that holds the worker deployment's handle, so the router finds the registry here rather than
being handed it.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from plaserve.router.hints import HintMetrics
from plaserve.router.pools import LONG, SHORT


class RouterMetrics:
    """What the request routers of this process decided."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.routed = Counter(
            "plaserve_ray_routed_requests",
            "Requests routed, by replica and length class",
            ["replica", "length_class"],
            registry=r,
        )
        self.first_choice = Counter(
            "plaserve_ray_first_choice",
            "Routed requests by the replica ranked first for them (Ray sends a request to the next "
            "rank when the first has no room or does not answer its queue probe in time)",
            ["replica", "length_class"],
            registry=r,
        )
        self.held = Counter(
            "plaserve_ray_held_decisions",
            "Routing rounds that held a long request back (no replica qualified)",
            registry=r,
        )
        self.hold_expired = Counter(
            "plaserve_ray_hold_expired",
            "Long requests sent to their earliest finish after max_hold_s",
            registry=r,
        )
        self.backlog = Gauge(
            "plaserve_ray_replica_backlog_seconds",
            "Predicted prefill seconds queued at each replica, as the router sees it",
            ["replica"],
            registry=r,
        )
        self.report_age = Gauge(
            "plaserve_ray_report_age_seconds",
            "Age of each replica's latest load report when the router last decided",
            ["replica"],
            registry=r,
        )
        self.completed = Counter(
            "plaserve_ray_completed_requests",
            "Requests Ray reported complete to the router (their cost leaves the backlog)",
            registry=r,
        )
        self.short_pool = Gauge(
            "plaserve_ray_short_pool_size",
            "Replicas kept clear of long work (the short pool)",
            registry=r,
        )
        self.replicas = Gauge("plaserve_ray_replicas", "Replicas the router knows of", registry=r)
        self.decision = Histogram(
            "plaserve_ray_decision_seconds",
            "Time choose_replicas takes",
            buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1),
            registry=r,
        )


class IngressMetrics:
    """The ingress's own counters, in the same registry as the request router's."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.requests = Counter(
            "plaserve_ray_requests",
            "Requests answered by the ingress, by route and outcome",
            ["route", "outcome"],
            registry=r,
        )
        self.retries = Counter(
            "plaserve_ray_retries",
            "Requests sent again after their replica failed before the first token",
            registry=r,
        )
        self.stream_errors = Counter(
            "plaserve_ray_stream_errors",
            "Streams ended with an error event after their first token",
            registry=r,
        )
        self.ttft = Histogram(
            "plaserve_ray_time_to_first_token_seconds",
            "Time to first token at the ingress (streamed requests), by length class",
            ["length_class"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0),
            registry=r,
        )
        self.e2e = Histogram(
            "plaserve_ray_e2e_request_latency_seconds",
            "Arrival at the ingress to the answer's end, by length class",
            ["length_class"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0),
            registry=r,
        )
        self.pricing = HintMetrics(r, "plaserve_ray")
        for cls in (SHORT, LONG):
            self.ttft.labels(cls)
            self.e2e.labels(cls)


class DeployMetrics:
    """The process's registry and its two sets of metrics."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.router = RouterMetrics(self.registry)
        self.ingress = IngressMetrics(self.registry)

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)


_METRICS: DeployMetrics | None = None


def deploy_metrics() -> DeployMetrics:
    """This process's metrics, created on first use."""
    global _METRICS
    if _METRICS is None:
        _METRICS = DeployMetrics()
    return _METRICS
