"""``plaserve serve`` flag handling that fails before any model loads."""

from __future__ import annotations

import argparse

import pytest

from plaserve.cli import main
from plaserve.server.cli import add_serve_arguments, engine_config_from_args


def test_missing_profile_fails_clearly(tmp_path, capsys: pytest.CaptureFixture) -> None:
    missing = str(tmp_path / "nope.json")
    assert main(["serve", "--profile", missing, "--kv-cache-memory", "256MiB"]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_max_queue_must_be_positive(capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--max-queue", "0"]) == 2
    assert "--max-queue" in capsys.readouterr().err


def serve_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(argv)


def test_scheduler_flags_reach_the_scheduler_config() -> None:
    args = serve_args(
        [
            "--late-yield",
            "5",
            "--max-consecutive-short",
            "3",
            "--ttft-slo-floor",
            "0.5",
            "--ttft-slo-factor",
            "4",
            "--max-num-batched-tokens",
            "4096",
        ]
    )
    sched = engine_config_from_args(args).scheduler
    assert (
        sched.late_yield,
        sched.max_consecutive_short,
        sched.ttft_slo_floor,
        sched.ttft_slo_factor,
        sched.max_num_batched_tokens,
    ) == (5.0, 3, 0.5, 4.0, 4096)
    defaults = engine_config_from_args(serve_args([])).scheduler
    assert defaults.late_yield == 2.0 and defaults.max_num_batched_tokens == 2048


@pytest.mark.parametrize("flag", ["--late-yield", "--max-consecutive-short", "--ttft-slo-floor"])
def test_negative_scheduler_flags_fail_clearly(flag, capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", flag, "-1", "--kv-cache-memory", "256MiB"]) == 2
    assert flag in capsys.readouterr().err
