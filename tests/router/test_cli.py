"""Flags of ``plaserve route`` and ``plaserve cluster`` to settings."""

from __future__ import annotations

import argparse
import math

import pytest

from plaserve.router.cli import add_route_arguments, router_config_from_args
from plaserve.router.cluster import add_cluster_arguments, worker_args, worker_env


def parse(add, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add(p)
    return p.parse_args(argv)


def test_route_flags_become_the_router_config():
    args = parse(
        add_route_arguments,
        [
            "--worker-urls",
            "http://a:1",
            "http://b:2",
            "--policy",
            "least_tokens",
            "--long-hold-horizon-ms",
            "inf",
            "--short-spill-budget-ms",
            "150",
            "--cb-failure-threshold",
            "5",
            "--load-interval-ms",
            "200",
            "--health-check-interval-secs",
            "0.5",
            "--max-attempts",
            "2",
        ],
    )
    c = router_config_from_args(args)
    assert args.worker_urls == ["http://a:1", "http://b:2"]
    assert (c.policy, c.max_attempts, c.breaker.failure_threshold) == ("least_tokens", 2, 5)
    assert math.isinf(
        c.pools.long_hold_horizon_s
    ) and c.pools.short_spill_budget_s == pytest.approx(0.15)
    assert c.health.load_interval_s == pytest.approx(0.2) and c.health.interval_s == 0.5
    with pytest.raises(SystemExit):
        parse(add_route_arguments, ["--policy", "random"])


def test_cluster_splits_threads_and_gpus_and_passes_worker_flags():
    env = worker_env(1, 2, ["0", "1", "2"], cpus=16)
    assert env["OMP_NUM_THREADS"] == "8" and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert worker_env(3, 2, None, cpus=1)["OMP_NUM_THREADS"] == "1"
    args = parse(
        add_cluster_arguments,
        [
            "/models/m",
            "--workers",
            "2",
            "--worker-policy",
            "fcfs",
            "--kv-cache-memory",
            "1GiB",
            "--worker-args",
            "--max-num-seqs 8",
            "--policy",
            "round_robin",
        ],
    )
    assert worker_args(args) == [
        "/models/m",
        "--policy",
        "fcfs",
        "--kv-cache-memory",
        "1GiB",
        "--max-num-seqs",
        "8",
    ]
    assert router_config_from_args(args).policy == "round_robin"


def test_pd_flags_must_come_in_pairs():
    from plaserve.router.cli import run_route
    from plaserve.router.cluster import run_cluster

    for argv in (
        ["--prefill", "1"],
        ["--decode", "1"],
        ["--workers", "2", "--prefill", "1", "--decode", "1"],
    ):
        assert run_cluster(parse(add_cluster_arguments, argv)) == 2
    assert run_route(parse(add_route_arguments, ["--prefill-urls", "http://127.0.0.1:1"])) == 2
    both = [
        "--worker-urls",
        "http://127.0.0.1:1",
        "--prefill-urls",
        "http://127.0.0.1:2",
        "--decode-urls",
        "http://127.0.0.1:3",
    ]
    assert run_route(parse(add_route_arguments, both)) == 2
