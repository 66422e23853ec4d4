"""Router settings: frozen dataclasses with every default in one place. Times are seconds."""

from __future__ import annotations

from dataclasses import dataclass, field

from plaserve.router.hints import LengthHints
from plaserve.slo import DEFAULT_FACTOR, DEFAULT_FLOOR_S, SloRule

POLICIES = ("pla", "round_robin", "least_requests", "least_tokens", "power_of_two")


@dataclass(frozen=True)
class HealthConfig:
    """How workers are watched."""

    interval_s: float = 2.0  # between /health checks of one worker
    timeout_s: float = 2.0  # a check slower than this failed
    failure_threshold: int = 2  # consecutive failed checks that take a worker out of rotation
    success_threshold: int = 1  # consecutive good checks that bring it back
    load_interval_s: float = 0.25  # between /load polls (the issue asks for 100-500 ms)
    # A /load report older than this is ignored and the router's own accounting is used alone: a
    # report that stopped coming says nothing about the work sent since.
    load_stale_s: float = 1.0


@dataclass(frozen=True)
class BreakerConfig:
    """The per-worker circuit breaker (see :mod:`plaserve.router.breaker`)."""

    failure_threshold: int = 3  # consecutive failed requests that open the circuit
    open_s: float = 5.0  # first open period; doubles on each failed probe
    max_open_s: float = 60.0


@dataclass(frozen=True)
class SloConfig:
    """The TTFT objective the pool controller steers by: ``max(floor_s, factor * predicted prefill)``,
    the same rule as ``plaserve bench`` and the engine's scheduler use."""

    factor: float = DEFAULT_FACTOR
    floor_s: float = DEFAULT_FLOOR_S

    def for_cost(self, cost_s: float) -> float:
        """The TTFT SLO of a request whose isolated prefill is predicted to take ``cost_s``."""
        return SloRule(self.factor, self.floor_s).for_prefill(cost_s)


@dataclass(frozen=True)
class PoolConfig:
    """The short/long pools and their controller (see :mod:`plaserve.router.pools`)."""

    period_s: float = 1.0  # the controller decides at most once per period
    cooldown_s: float = 5.0  # no move for this long after a move
    window_s: float = 10.0  # pressures are percentiles over the requests of the last window
    percentile: float = 90.0
    min_size: int = 1  # neither pool shrinks below this
    hysteresis: float = 0.25  # move only when one pressure exceeds the other by this factor...
    dead_band: float = 0.1  # ...and by this much in absolute terms (no moves while both are idle)
    min_samples: int = 5  # a pool with fewer requests in the window has pressure 0
    initial_short_fraction: float = 0.25  # share of workers in the short pool at start
    # The short pool is kept clear: a long request may not leave fewer than the pool's size of
    # workers with at most this much work queued. Short requests then queue at most this long behind
    # long work: 0.2 s is the 0.25 s SLO floor less ~50 ms for the short request's own prefill. A
    # smaller budget keeps shorts faster but lets the pool take fewer long requests in bursts
    # (docs/ROUTER.md has the measurements).
    short_spill_budget_s: float = 0.2
    # Long requests wait in the router while no worker has less than this much work queued, so work is
    # not committed early to one queue while another worker frees up first. It only needs to cover
    # the router's reaction time (a first token or a /load report, milliseconds), not a whole request.
    long_hold_horizon_s: float = 0.1


@dataclass(frozen=True)
class RouterConfig:
    """Everything ``plaserve route`` can set."""

    policy: str = "pla"
    max_attempts: int = 3  # tries per request on distinct workers, while nothing reached the client
    connect_timeout_s: float = 5.0
    request_timeout_s: float = (
        600.0  # a worker silent for this long (no first byte) failed the request
    )
    worker_api_key: str | None = (
        None  # sent on the router's own calls (/load, /tokenize); clients' keys pass through
    )
    seed: int = 0  # power_of_two's sampling
    # Price each request after what each worker's prefix cache likely holds of it (router/prefixes.py);
    # a worker whose /load does not report its KV cache (vLLM, SGLang) is taken to hold this many tokens.
    prefix_aware: bool = True
    prefix_cache_tokens: int = 1 << 18
    # Whose x-prompt-tokens headers price requests (router/hints.py); the default trusts no one.
    length_hints: LengthHints = field(default_factory=LengthHints)
    health: HealthConfig = field(default_factory=HealthConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    slo: SloConfig = field(default_factory=SloConfig)
    pools: PoolConfig = field(default_factory=PoolConfig)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {', '.join(POLICIES)}")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
