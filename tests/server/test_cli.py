"""``plaserve serve`` flag handling that fails before any model loads."""

from __future__ import annotations

import argparse
import gc

import pytest

from plaserve.cli import main
from plaserve.server.cli import add_serve_arguments, build_engine, engine_config_from_args


def test_missing_profile_fails_clearly(tmp_path, capsys: pytest.CaptureFixture) -> None:
    missing = str(tmp_path / "nope.json")
    assert main(["serve", "--profile", missing, "--kv-cache-memory", "256MiB"]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_max_queue_must_be_positive(capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--max-queue", "0"]) == 2
    assert "--max-queue" in capsys.readouterr().err


def test_stream_interval_must_be_positive(capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--stream-interval", "0"]) == 2
    assert "--stream-interval" in capsys.readouterr().err


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
            "--long-chunk-size",
            "1024",
        ]
    )
    sched = engine_config_from_args(args).scheduler
    assert (
        sched.late_yield,
        sched.max_consecutive_short,
        sched.ttft_slo_floor,
        sched.ttft_slo_factor,
        sched.max_num_batched_tokens,
        sched.long_chunk_size,
    ) == (5.0, 3, 0.5, 4.0, 4096, 1024)
    defaults = engine_config_from_args(serve_args([])).scheduler
    assert defaults.late_yield == 2.0 and defaults.max_num_batched_tokens == 2048
    assert defaults.long_chunk_size is None  # pla takes it from its cost model


def test_prefix_caching_flag_reaches_the_engine() -> None:
    """On by default; ``--no-enable-prefix-caching`` (vLLM's flag) turns it off in the built engine:
    the same prompt twice then finds nothing cached."""
    from plaserve import SamplingParams

    assert engine_config_from_args(serve_args([])).enable_prefix_caching
    assert engine_config_from_args(serve_args(["--enable-prefix-caching"])).enable_prefix_caching
    small = ["--max-model-len", "64", "--kv-cache-memory", "4MiB"]
    for flags, cached in (([], True), (["--no-enable-prefix-caching"], False)):
        engine = build_engine(serve_args([*small, *flags]), None)
        assert engine.load_report()["kv"]["prefix_caching"] is cached
        prompt = list(range(10, 50))  # 40 tokens: two full 16-token blocks to reuse
        for _ in range(2):
            engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0))
            while engine.has_unfinished():
                outputs = engine.step()
        assert (outputs[0].num_cached_tokens > 0) is cached


@pytest.mark.parametrize(
    "flag", ["--late-yield", "--max-consecutive-short", "--ttft-slo-floor", "--long-chunk-size"]
)
def test_negative_scheduler_flags_fail_clearly(flag, capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", flag, "-1", "--kv-cache-memory", "256MiB"]) == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--enable-auto-tool-choice", "--tool-call-parser", "nope"], "unknown --tool-call-parser"),
        (["--enable-auto-tool-choice"], "needs --tool-call-parser"),
        (["--chat-template", "/no/such/template.jinja"], "template.jinja"),
    ],
)
def test_tool_and_template_flags_fail_clearly(argv, message, capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_generation_config_defaults(tmp_path) -> None:
    """``auto`` reads the model directory's generation_config.json, ``vllm`` nothing, a directory
    its own file; values no request could take fail at start-up."""
    from plaserve.server.cli import sampling_defaults_from_args

    (tmp_path / "generation_config.json").write_text(
        '{"temperature": 0.6, "top_p": 0.9, "max_new_tokens": 7, "do_sample": true}'
    )
    expected = {"temperature": 0.6, "top_p": 0.9, "max_tokens": 7}
    assert sampling_defaults_from_args(serve_args([]), str(tmp_path)) == expected
    assert (
        sampling_defaults_from_args(serve_args(["--generation-config", "vllm"]), str(tmp_path))
        == {}
    )
    other = serve_args(["--generation-config", str(tmp_path)])
    assert sampling_defaults_from_args(other, None) == expected
    (tmp_path / "generation_config.json").write_text('{"top_p": 0}')
    with pytest.raises(ValueError, match="top_p"):
        sampling_defaults_from_args(serve_args([]), str(tmp_path))


def test_the_built_engine_is_frozen_out_of_the_collectors_passes() -> None:
    """What start-up built is never garbage: frozen, a full collection does not walk it (it took ~130
    ms with a real tokenizer, a stall between engine steps)."""
    gc.unfreeze()
    try:
        engine = build_engine(
            serve_args(["--max-model-len", "64", "--kv-cache-memory", "4MiB"]), None
        )
        assert gc.get_freeze_count() > 0
        tracked = (o for generation in range(3) for o in gc.get_objects(generation))
        assert not any(o is engine for o in tracked)  # frozen: in no generation a pass walks
    finally:
        gc.unfreeze()
