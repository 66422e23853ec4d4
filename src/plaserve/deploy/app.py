"""The Ray Serve application: an OpenAI ingress in front of N plaserve worker replicas, routed by pla.

``build_app(RayServeOptions(...))`` returns the :class:`ray.serve.Application` (``serve.run`` it);
``app_builder`` is the same for a Serve config file (``serve run deploy/ray/serve_config.yaml``,
whose ``args`` are :class:`RayServeOptions`'s fields). ``plaserve ray-serve`` (:mod:`plaserve.deploy.cli`)
starts Ray, runs the application and serves until interrupted.

* ``PlaserveWorker``: :class:`~plaserve.deploy.replica.PlaserveReplica` (a ``plaserve serve``
  child per replica), ``num_cpus`` = its threads, health-checked every 2 s, reporting its load to
  the request router every ``routing_stats_period_s``; the request router is
  :class:`~plaserve.deploy.request_router.PlaRequestRouter`;
* ``OpenAIIngress``: :class:`~plaserve.deploy.ingress.OpenAIIngress`, the HTTP entry, no CPU
  reserved (it only forwards);
* **autoscaling** (``max_replicas`` above ``min_replicas``): :class:`BacklogAutoscalingPolicy`, on
  the replicas' predicted prefill backlog in seconds rather than on requests in flight: ten short
  requests and one long one are not the same load.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingContext, RequestRouterConfig

from plaserve.deploy.ingress import OpenAIIngress
from plaserve.deploy.replica import PlaserveReplica
from plaserve.router.costs import DEFAULT_SHORT_THRESHOLD
from plaserve.router.hints import LengthHints


@dataclass
class RayServeOptions:
    """What the application is made of. ``model`` None serves the embedded random-weight model."""

    model: str | None = None
    replicas: int = 2
    threads_per_replica: int = 1  # CPU threads of each replica's engine (its Ray num_cpus)
    num_gpus_per_replica: float = 0.0
    serve_args: list[str] = field(default_factory=list)  # more `plaserve serve` flags
    max_ongoing_requests: int = 64  # per replica: Ray queues beyond this in the router
    routing_stats_period_s: float = 0.5
    max_hold_s: float = 5.0
    short_threshold: int = DEFAULT_SHORT_THRESHOLD
    max_attempts: int = 3
    # "CIDR[,CIDR...]" whose x-prompt-tokens headers price requests (router/hints.py); None: no one.
    trust_length_hints_from: str | None = None
    # Autoscaling: off unless max_replicas > min_replicas (then `replicas` is the initial count).
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_backlog_s: float = 2.0  # predicted prefill seconds queued per replica to aim at
    startup_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be at least 1")
        if self.threads_per_replica < 1:
            raise ValueError("threads_per_replica must be at least 1")
        if self.autoscaling and not (
            0 <= (self.min_replicas or 0) <= self.replicas <= (self.max_replicas or 0)
        ):
            raise ValueError("need min_replicas <= replicas <= max_replicas")
        if self.target_backlog_s <= 0:
            raise ValueError("target_backlog_s must be positive")
        LengthHints.from_spec(self.trust_length_hints_from)  # a bad CIDR fails here, not in Ray

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None and self.max_replicas > (self.min_replicas or 0)

    def worker_args(self) -> list[str]:
        """The flags of each replica's ``plaserve serve``."""
        return ([self.model] if self.model else []) + list(self.serve_args)


class BacklogAutoscalingPolicy:
    """Replicas for a target backlog: ``ceil(sum of the replicas' backlog seconds / target)``.

    Scaling up follows the backlog at once (a burst of long prompts is seconds of work per replica);
    scaling down waits until the backlog would fit in one replica fewer with a quarter to spare, so
    the count does not flap around a boundary. Ray clamps the answer to ``[min, max]`` replicas.
    """

    def __init__(self, target_backlog_s: float = 2.0) -> None:
        self.target = target_backlog_s

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        per_replica = (ctx.aggregated_metrics or {}).get("backlog_s") or {}
        current = ctx.current_num_replicas
        if not per_replica:
            return ctx.target_num_replicas, ctx.policy_state or {}
        total = float(sum(per_replica.values()))
        desired = max(1, math.ceil(total / self.target))
        if desired < current and total > (current - 1) * self.target * 0.75:
            desired = current
        desired = min(
            max(desired, ctx.capacity_adjusted_min_replicas), ctx.capacity_adjusted_max_replicas
        )
        return desired, {"backlog_s": total}


def build_app(options: RayServeOptions) -> serve.Application:
    """The application (module docstring)."""
    scaling: dict[str, Any]
    if options.autoscaling:
        scaling = {
            "autoscaling_config": {
                "min_replicas": options.min_replicas or 0,
                "initial_replicas": options.replicas,
                "max_replicas": options.max_replicas,
                "metrics_interval_s": 1.0,
                "look_back_period_s": 5.0,
                "upscale_delay_s": 2.0,
                "downscale_delay_s": 30.0,
                "policy": {
                    "policy_function": "plaserve.deploy.app:BacklogAutoscalingPolicy",
                    "policy_kwargs": {"target_backlog_s": options.target_backlog_s},
                },
            }
        }
    else:
        scaling = {"num_replicas": options.replicas}
    worker = serve.deployment(
        PlaserveReplica,
        name="PlaserveWorker",
        max_ongoing_requests=options.max_ongoing_requests,
        health_check_period_s=2.0,
        health_check_timeout_s=10.0,
        graceful_shutdown_timeout_s=10.0,
        ray_actor_options={
            "num_cpus": options.threads_per_replica,
            "num_gpus": options.num_gpus_per_replica,
        },
        request_router_config=RequestRouterConfig(
            request_router_class="plaserve.deploy.request_router:PlaRequestRouter",
            request_router_kwargs={
                "max_hold_s": options.max_hold_s,
                "load_stale_s": max(3.0, 4 * options.routing_stats_period_s),
                "short_threshold": options.short_threshold,
            },
            request_routing_stats_period_s=options.routing_stats_period_s,
            request_routing_stats_timeout_s=5.0,
        ),
        **scaling,
    )
    ingress = serve.deployment(
        OpenAIIngress,
        name="OpenAIIngress",
        num_replicas=1,
        max_ongoing_requests=1024,
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(
        worker.bind(
            options.worker_args(),
            threads=options.threads_per_replica,
            startup_timeout=options.startup_timeout_s,
        ),
        tokenizer=options.model,
        short_threshold=options.short_threshold,
        max_attempts=options.max_attempts,
        trust_length_hints_from=options.trust_length_hints_from,
    )


def app_builder(args: dict[str, Any]) -> serve.Application:
    """For a Serve config file's ``import_path: plaserve.deploy.app:app_builder``; ``args`` are
    :class:`RayServeOptions`'s fields."""
    known = set(asdict(RayServeOptions()))
    unknown = sorted(set(args) - known)
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return build_app(RayServeOptions(**args))
