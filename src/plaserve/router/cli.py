"""``plaserve route --worker-urls URL [URL ...] --policy pla``: the router as a command.

Flag names follow sglang-router where it has the same setting (``--worker-urls``, ``--policy``,
``--health-check-interval-secs``, ``--cb-failure-threshold``, ...).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from plaserve.router.config import (
    POLICIES,
    BreakerConfig,
    HealthConfig,
    PoolConfig,
    RouterConfig,
    SloConfig,
)
from plaserve.router.hints import HEADER as HINT_HEADER
from plaserve.router.hints import LengthHints


def add_route_arguments(p: argparse.ArgumentParser) -> None:
    """The ``route`` subcommand's flags."""
    p.add_argument(
        "--worker-urls",
        nargs="*",
        default=[],
        metavar="URL",
        help="workers' base URLs, e.g. http://127.0.0.1:8001 (more can be added at run time: POST /workers)",
    )
    p.add_argument(
        "--prefill-urls",
        nargs="*",
        default=None,
        metavar="URL",
        help="prefill/decode mode (docs/PD.md): the prefill workers (plaserve serve --pd-role "
        "prefill), chosen by --policy; give --decode-urls too",
    )
    p.add_argument(
        "--decode-urls",
        nargs="*",
        default=None,
        metavar="URL",
        help="prefill/decode mode: the decode workers (--pd-role decode), chosen by KV utilisation "
        "and running decodes",
    )
    p.add_argument("--policy", default="pla", choices=POLICIES, help="routing policy (default pla)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="port to listen on (default 30000)")
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="the served model's directory, to count prompt tokens (default: the workers' /tokenize)",
    )
    p.add_argument(
        "--trust-length-hints-from",
        type=_length_hints,
        default=LengthHints(),
        metavar="CIDR[,CIDR...]",
        help=f"price requests by their {HINT_HEADER} header when the TCP peer (the gateway, not "
        "X-Forwarded-For) is in one of these networks (default: trust no one)",
    )
    p.add_argument(
        "--profile",
        default=None,
        metavar="PATH",
        help='cost profile JSON: {"cost_model": {"g1", "g2", "g3", "c0"}, "short_threshold": N}',
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="key for the router's own calls to workers (/load, /tokenize); "
        "clients' Authorization headers are passed on as they are",
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        default=RouterConfig.max_attempts,
        help="workers tried per request before it fails (default %(default)s)",
    )
    p.add_argument(
        "--request-timeout-secs",
        type=float,
        default=RouterConfig.request_timeout_s,
        help="a worker silent this long fails the request (default %(default)s)",
    )
    p.add_argument(
        "--no-prefix-aware",
        dest="prefix_aware",
        action="store_false",
        help="price every request by its whole prompt, not after what each worker's prefix cache "
        "likely holds of it",
    )
    p.add_argument(
        "--prefix-cache-tokens",
        type=int,
        default=RouterConfig.prefix_cache_tokens,
        help="KV cache tokens assumed of a worker whose /load does not report its cache, as vLLM's "
        "and SGLang's do not (default %(default)s)",
    )
    p.add_argument("--health-check-interval-secs", type=float, default=HealthConfig.interval_s)
    p.add_argument("--health-check-timeout-secs", type=float, default=HealthConfig.timeout_s)
    p.add_argument("--health-failure-threshold", type=int, default=HealthConfig.failure_threshold)
    p.add_argument("--health-success-threshold", type=int, default=HealthConfig.success_threshold)
    p.add_argument(
        "--load-interval-ms",
        type=float,
        default=HealthConfig.load_interval_s * 1000,
        help="/load poll period (default %(default)s)",
    )
    p.add_argument(
        "--cb-failure-threshold",
        type=int,
        default=BreakerConfig.failure_threshold,
        help="failed requests in a row that open a worker's circuit (default %(default)s)",
    )
    p.add_argument(
        "--cb-timeout-duration-secs",
        type=float,
        default=BreakerConfig.open_s,
        help="how long an open circuit stays open before a probe (default %(default)s)",
    )
    p.add_argument(
        "--slo-factor",
        type=float,
        default=SloConfig.factor,
        help="TTFT SLO = max(floor, factor x prefill)",
    )
    p.add_argument("--slo-floor-ms", type=float, default=SloConfig.floor_s * 1000)
    p.add_argument(
        "--short-spill-budget-ms",
        type=float,
        default=PoolConfig.short_spill_budget_s * 1000,
        help="pla: most long work a short-pool worker may have queued (default %(default)s)",
    )
    p.add_argument(
        "--long-hold-horizon-ms",
        type=float,
        default=PoolConfig.long_hold_horizon_s * 1000,
        help="pla: hold long requests while every worker has this much work (default %(default)s; "
        "'inf' never holds)",
    )
    p.add_argument("--pool-period-secs", type=float, default=PoolConfig.period_s)
    p.add_argument("--pool-cooldown-secs", type=float, default=PoolConfig.cooldown_s)
    p.add_argument("--pool-min-size", type=int, default=PoolConfig.min_size)
    p.add_argument("--seed", type=int, default=0, help="power_of_two's random draws")


def _length_hints(spec: str) -> LengthHints:
    try:
        return LengthHints.from_spec(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def router_config_from_args(args: argparse.Namespace) -> RouterConfig:
    """The :class:`RouterConfig` the flags describe."""
    return RouterConfig(
        policy=args.policy,
        max_attempts=args.max_attempts,
        request_timeout_s=args.request_timeout_secs,
        worker_api_key=args.api_key,
        seed=args.seed,
        prefix_aware=args.prefix_aware,
        prefix_cache_tokens=args.prefix_cache_tokens,
        length_hints=args.trust_length_hints_from,
        health=HealthConfig(
            interval_s=args.health_check_interval_secs,
            timeout_s=args.health_check_timeout_secs,
            failure_threshold=args.health_failure_threshold,
            success_threshold=args.health_success_threshold,
            load_interval_s=args.load_interval_ms / 1000,
        ),
        breaker=BreakerConfig(
            failure_threshold=args.cb_failure_threshold, open_s=args.cb_timeout_duration_secs
        ),
        slo=SloConfig(factor=args.slo_factor, floor_s=args.slo_floor_ms / 1000),
        pools=PoolConfig(
            period_s=args.pool_period_secs,
            cooldown_s=args.pool_cooldown_secs,
            min_size=args.pool_min_size,
            short_spill_budget_s=args.short_spill_budget_ms / 1000,
            long_hold_horizon_s=args.long_hold_horizon_ms / 1000,
        ),
    )


async def serve_router(args: argparse.Namespace, config: RouterConfig) -> None:
    """Run the router the flags describe until SIGINT or SIGTERM (``plaserve route`` and ``cluster``)."""
    from plaserve.router.proxy import Router, serve

    tokenizer = None
    if args.tokenizer:
        from plaserve.model.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    profile = None
    if args.profile:
        from plaserve.router.costs import load_cost_profile

        profile = load_cost_profile(args.profile)
    prefill, decode = getattr(args, "prefill_urls", None), getattr(args, "decode_urls", None)
    if bool(prefill) != bool(decode):
        raise ValueError("prefill/decode mode needs both --prefill-urls and --decode-urls")
    if prefill and args.worker_urls:
        raise ValueError("give either --worker-urls or --prefill-urls with --decode-urls")
    router = Router(
        list(prefill or args.worker_urls),
        config,
        tokenizer=tokenizer,
        profile=profile,
        decode_urls=list(decode) if decode else None,
    )
    runner = await serve(router, args.host, args.port)
    healthy = sum(w.healthy for w in router.workers.values())
    if router.decode_tier is not None:
        d = router.decode_tier
        print(
            f"plaserve route: prefill/decode mode, {len(d.available())}/{len(d.workers)} healthy "
            f"decode worker(s)",
            file=sys.stderr,
        )
    print(
        f"plaserve route: http://{args.host}:{args.port} -> {healthy}/{len(router.workers)} healthy worker(s), "
        f"policy {config.policy}, short threshold {router.short_threshold} ({router.threshold_source})",
        file=sys.stderr,
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def run_route(args: argparse.Namespace) -> int:
    """Serve until interrupted. Returns the exit status."""
    try:
        config = router_config_from_args(args)
        asyncio.run(serve_router(args, config))
    except (ValueError, OSError) as e:
        print(f"plaserve route: {e}", file=sys.stderr)
        return 2
    return 0
