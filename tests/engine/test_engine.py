"""LLMEngine against plain single-request runs: chunking, prefix caching, preemption, stopping, freeing."""

from __future__ import annotations

import pytest
import torch

from plaserve import EngineConfig, LLMEngine, SamplingParams
from plaserve.engine import runner as runner_module

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def make_engine(path: str, **kw) -> LLMEngine:
    args = dict(model=path, dtype="float32", kv_cache_memory="16MiB", max_model_len=1024) | kw
    return LLMEngine(EngineConfig.from_kwargs(**args))


def run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY):
    reqs = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return reqs


def prompts(*lengths: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (n,), generator=gen).tolist() for n in lengths]


PROMPTS = prompts(5, 40, 300, 600)


@pytest.fixture(scope="module")
def alone(llama_ckpt):
    """Reference outputs: each prompt alone, unchunked, no prefix caching."""
    engine = make_engine(
        llama_ckpt, enable_prefix_caching=False, max_num_batched_tokens=1024, policy="fcfs"
    )
    return {tuple(p): run(engine, [p])[0].output_token_ids for p in PROMPTS}


@pytest.mark.parametrize("policy", ["fcfs", "spf", "pla"])
def test_chunked_prefill_equals_unchunked(llama_ckpt, alone, policy):
    engine = make_engine(
        llama_ckpt,
        max_num_batched_tokens=64,
        long_chunk_size=64,
        short_threshold=64,
        enable_prefix_caching=False,
        policy=policy,
    )
    reqs = run(engine, PROMPTS)
    for r in reqs:
        assert r.output_token_ids == alone[tuple(r.prompt_token_ids)]
    long = reqs[3]
    assert len(long.metrics.prefill_chunks) >= 600 // 64
    assert sum(n for _, _, n in long.metrics.prefill_chunks) == 600


@pytest.mark.parametrize("policy", ["fcfs", "pla"])
def test_prefix_cache_hit_equals_cold_run_and_is_counted(llama_ckpt, alone, policy):
    engine = make_engine(llama_ckpt, policy=policy)
    p600 = PROMPTS[3]
    first = run(engine, [p600])[0]
    assert first.metrics.num_cached_tokens == 0
    second = run(engine, [p600])[0]
    # whole 16-token blocks, the last token recomputed
    assert second.metrics.num_cached_tokens == 592
    assert second.output_token_ids == first.output_token_ids == alone[tuple(p600)]
    # A longer prompt sharing the 300-token prefix reuses its full blocks.
    p300 = PROMPTS[2]
    run(engine, [p300])
    ext = run(engine, [p300 + [7, 8, 9]])[0]
    assert ext.metrics.num_cached_tokens == 288
    assert engine.allocator.num_used_blocks == 0
    # reset: nothing cached any more, the same tokens again; refused while a request holds blocks
    busy = engine.add_request(p600, SamplingParams(max_tokens=5, ignore_eos=True))
    while not busy.block_table:  # pla may first hold a short in its batch window
        engine.step()
        engine.wait_for_work()
    assert not engine.reset_prefix_cache()
    while engine.has_unfinished():
        engine.step()
    assert engine.reset_prefix_cache()
    cold = run(engine, [p600])[0]
    assert cold.metrics.num_cached_tokens == 0 and cold.output_token_ids == first.output_token_ids


def test_load_report_prices_a_queued_request_after_its_cached_prefix(llama_ckpt):
    """A router reads /load's backlog to place the next turn of a conversation: a queued request whose
    history is cached counts only the prefill it has left, not its whole prompt."""
    engine = make_engine(llama_ckpt, policy="fcfs")
    p600 = PROMPTS[3]
    run(engine, [p600])
    engine.add_request(p600, GREEDY)  # queued, no blocks yet: 592 tokens will be found cached
    engine.add_request(PROMPTS[2], GREEDY)  # nothing cached
    report = engine.load_report()
    backlog = sum(report["backlog_s"].values())
    expected = engine.cost.prefill_time(8, 592) + engine.cost.prefill_time(300)
    assert backlog == pytest.approx(expected) and backlog < engine.cost.prefill_time(600)
    assert report["backlog_tokens"] == [(8, 592), (300, 0)]  # the same work, as a router prices it
    while engine.has_unfinished():
        engine.step()


@pytest.mark.parametrize("policy", ["fcfs", "pla"])
def test_preemption_under_memory_pressure_gives_same_tokens(llama_ckpt, alone, policy):
    # 45 blocks of 16 tokens (8 KiB each in this model) for 1,105 tokens of demand: with small chunks
    # every request starts early, they outgrow the cache together and some must be preempted.
    engine = make_engine(
        llama_ckpt,
        kv_cache_memory=str(45 * 8192),
        max_model_len=640,
        max_num_batched_tokens=64,
        long_chunk_size=64,
        enable_prefix_caching=False,
        policy=policy,
    )
    # Logprobs too: a recompute must neither repeat nor skip an entry.
    params = SamplingParams(
        max_tokens=40, temperature=0, ignore_eos=True, logprobs=1, prompt_logprobs=1
    )
    reqs = run(engine, PROMPTS, params)
    ref = make_engine(llama_ckpt, enable_prefix_caching=False)
    for r in reqs:
        alone_req = run(ref, [r.prompt_token_ids], r.params)[0]
        assert r.output_token_ids == alone_req.output_token_ids
        assert _close(r, alone_req)
    assert sum(r.metrics.num_preemptions for r in reqs) > 0
    assert engine.allocator.num_used_blocks == 0


@pytest.mark.parametrize("policy", ["fcfs", "pla"])
def test_abort_and_finish_free_every_block(llama_ckpt, policy):
    engine = make_engine(llama_ckpt, policy=policy)
    reqs = [
        engine.add_request(p, SamplingParams(max_tokens=50, ignore_eos=True))
        for p in prompts(30, 200, 500)
    ]
    while not all(r.block_table for r in reqs):  # pla may first hold shorts in their batch window
        engine.step()
        engine.wait_for_work()
    assert engine.allocator.num_used_blocks > 0
    assert engine.abort(reqs[1].request_id)
    assert not engine.abort(reqs[1].request_id)
    assert reqs[1].finish_reason == "abort"
    while engine.has_unfinished():
        engine.step()
    assert engine.allocator.num_used_blocks == 0
    assert [r.finish_reason for r in reqs] == ["length", "abort", "length"]


def test_abort_waiting_request(llama_ckpt):
    engine = make_engine(llama_ckpt)
    req = engine.add_request([1, 2, 3])
    assert engine.abort(req.request_id)
    assert not engine.has_unfinished() and engine.step() == []


def test_stop_token_ids_eos_and_max_tokens(llama_ckpt, alone):
    p = PROMPTS[1]
    expected = alone[tuple(p)]
    engine = make_engine(llama_ckpt)
    stop_tok = expected[4]
    r = run(engine, [p], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_tok]))[0]
    assert r.output_token_ids == expected[: expected.index(stop_tok) + 1]
    assert r.finish_reason == "stop" and r.stop_reason == stop_tok
    r = run(engine, [p], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert r.output_token_ids == expected[:3] and r.finish_reason == "length"
    # eos ends a request unless ignore_eos; make the first greedy token an eos id to check.
    engine.model_config.eos_token_ids  # noqa: B018 - documented field
    req = engine.add_request(p, SamplingParams(max_tokens=12, temperature=0))
    req.eos_token_ids = (expected[0],)
    while engine.has_unfinished():
        engine.step()
    assert req.output_token_ids == expected[:1] and req.finish_reason == "stop"


def test_stop_strings_cut_the_text(llama_ckpt):
    engine = make_engine(llama_ckpt)
    p = prompts(40)[0]
    full = run(engine, [p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[
        0
    ].output_text
    stop = full[5:8]
    assert stop and full.index(stop) == 5
    r = run(
        engine, [p], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop])
    )[0]
    assert r.output_text == full[:5] and r.finish_reason == "stop" and r.stop_reason == stop
    r = run(
        engine,
        [p],
        SamplingParams(
            max_tokens=12,
            temperature=0,
            ignore_eos=True,
            stop=stop,
            include_stop_str_in_output=True,
        ),
    )[0]
    assert r.output_text == full[:8]


def test_seeded_sampling_is_reproducible_in_any_batch(llama_ckpt):
    engine = make_engine(llama_ckpt)
    p = prompts(30)[0]
    params = SamplingParams(
        max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=42, ignore_eos=True
    )
    a = run(engine, [p], params)[0].output_token_ids
    b = run(engine, [p] + prompts(100, 7, seed=5), params)[0].output_token_ids
    c = run(engine, [p], SamplingParams(max_tokens=10, temperature=1.0, seed=43, ignore_eos=True))[
        0
    ]
    assert a == b and a != c.output_token_ids


def test_timings_are_recorded(llama_ckpt):
    engine = make_engine(llama_ckpt)
    r = run(engine, prompts(100))[0]
    m = r.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time
    assert m.ttft is not None and m.ttft >= 0 and m.prefill_chunks


def test_bad_prompts_are_refused(llama_ckpt):
    engine = make_engine(llama_ckpt)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="maximum context length"):
        engine.add_request([1] * 1024)
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request([1, 10**6])
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    assert not engine.has_unfinished()


def test_warm_up_leaves_no_trace(llama_ckpt, alone):
    engine = make_engine(llama_ckpt, max_num_batched_tokens=512)
    assert engine.cost.source == "flops" and engine.cost.c0 == 0
    engine.warm_up()
    # the start-up model's step cost is timed; the scheduler and the online refit start from it
    assert engine.cost.source == "warm-up" and engine.cost.c0 > 0
    assert engine.scheduler.cost is engine.cost and engine.online.model is engine.cost
    assert (
        engine.num_steps == 0
        and engine.allocator.num_used_blocks == 0
        and not engine.has_unfinished()
    )
    reqs = run(engine, PROMPTS)
    assert [r.output_token_ids for r in reqs] == [alone[tuple(p)] for p in PROMPTS]
    # nothing of the warm-up went into the prefix cache
    assert all(r.metrics.num_cached_tokens == 0 for r in reqs)


def _close(a, b, tol: float = 1e-4) -> bool:
    """Logprobs of two runs of one request agree entry for entry (same tokens, values within ``tol``)."""
    pairs = [
        *zip(a.output_logprobs, b.output_logprobs),
        *zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]),
    ]
    return (
        len(a.output_logprobs) == len(b.output_logprobs) == len(a.output_token_ids)
        and len(a.prompt_logprobs) == len(b.prompt_logprobs) == a.num_prompt_tokens
        and all(x.token_id == y.token_id and abs(x.logprob - y.logprob) < tol for x, y in pairs)
    )


def test_offline_n_choices_share_one_prefill(llama_ckpt):
    """``SamplingParams(n=3)``: one output per prompt with three sequences; choice j is what a single
    request seeded seed + j gives; the later choices reuse the first one's prompt blocks."""
    from plaserve import LLM

    llm = LLM(llama_ckpt, dtype="float32", kv_cache_memory="16MiB", max_model_len=1024)
    prompt = prompts(100, seed=3)[0]
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=7, ignore_eos=True)
    out = llm.generate([prompt, prompt[:10]], params)
    assert [len(o.outputs) for o in out] == [3, 3] and [c.index for c in out[0].outputs] == [
        0,
        1,
        2,
    ]
    # the 10-token prompt has no full block to share
    assert llm.engine.allocator.num_cache_hits == 2 * 96
    alone = make_engine(llama_ckpt, enable_prefix_caching=False)
    for j, choice in enumerate(out[0].outputs):
        single = SamplingParams(max_tokens=6, temperature=1.0, seed=7 + j, ignore_eos=True)
        assert choice.token_ids == run(alone, [prompt], single)[0].output_token_ids
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1
    with pytest.raises(ValueError):
        SamplingParams(n=0)


def test_a_request_with_non_finite_logits_fails_alone(llama_ckpt, alone, monkeypatch):
    """One row of the batch's logits turns NaN (as a half-precision overflow would): that request
    finishes with ``error`` and frees its blocks; the others' tokens are as if it had never been there."""
    engine = make_engine(llama_ckpt, policy="fcfs")
    victim = engine.add_request([7, 8, 9, 10], GREEDY)
    others = [engine.add_request(p, GREEDY) for p in PROMPTS]
    real = runner_module.apply_penalties

    def poisoned(logits, reqs):  # the runner's hook between the logits and the sampler
        logits = real(logits, reqs)
        with torch.inference_mode():
            logits[[i for i, r in enumerate(reqs) if r is victim]] = float("nan")
        return logits

    monkeypatch.setattr(runner_module, "apply_penalties", poisoned)
    while engine.has_unfinished():
        engine.step()
    assert victim.finish_reason == "error" and victim.output_token_ids == []
    for req, p in zip(others, PROMPTS):
        assert req.output_token_ids == alone[tuple(p)]
    assert engine.allocator.num_used_blocks == 0


BF16_GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def alone_bf16(qwen2_ckpt, qwen2_bf16_prompts):
    """bfloat16 reference outputs: each prompt alone, unchunked, no prefix caching. Its top-2 logprobs
    show that no step is a near-tie (a bfloat16 rounding could flip one), so other runs must match
    token for token."""
    engine = make_engine(
        qwen2_ckpt,
        dtype="bfloat16",
        enable_prefix_caching=False,
        max_num_batched_tokens=1024,
        policy="fcfs",
    )
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    outputs = {}
    for p in qwen2_bf16_prompts:
        r = run(engine, [p], params)[0]
        assert min(e.top[0][1] - e.top[1][1] for e in r.output_logprobs) >= 0.2
        outputs[tuple(p)] = r.output_token_ids
    return outputs


def test_steps_the_packed_linear_takes_whole_are_not_padded(qwen2_ckpt) -> None:
    """Row padding serves oneDNN, which builds a kernel per row count; where every projection runs
    in plaserve's packed linear (bfloat16 on AVX512-BF16 CPUs: up to 4,096 rows, 512 on AMX), steps
    of up to that many rows keep their own row count."""
    engine = make_engine(qwen2_ckpt, dtype="bfloat16")
    rows = engine.runner.model.shape_free_rows()
    if rows == 0:
        pytest.skip("plaserve's packed linear does not run on this CPU")
    assert rows >= 512 and engine.runner.pad_rows_above == rows
    f32 = make_engine(qwen2_ckpt, dtype="float32")
    assert f32.runner.model.shape_free_rows() == 0
    assert f32.runner.pad_rows_above == runner_module.ROW_GRANULE_FROM


@pytest.mark.parametrize(
    "variant",
    ["chunked fcfs", "chunked pla", "prefix cached", "padded pla", "rows padded", "rows unpadded"],
)
def test_bfloat16_batched_chunked_cached_and_padded_runs_equal_plain_runs(
    qwen2_ckpt, qwen2_bf16_prompts, alone_bf16, variant
):
    """The bfloat16 counterparts of the float32 tests above, all prompts at once (batched decodes).
    On CPU the runs pad steps of more rows than the packed linear takes whole to a multiple of 32
    (runner.ROW_GRANULE); "rows padded" pads every step of more than ROW_GRANULE_FROM rows, "rows
    unpadded" none: both must give the same tokens."""
    kw: dict = {"dtype": "bfloat16"}
    if variant.startswith("chunked"):
        kw |= dict(
            max_num_batched_tokens=64,
            long_chunk_size=64,
            short_threshold=64,
            enable_prefix_caching=False,
            policy=variant.split()[1],
        )
    elif variant == "padded pla":
        kw |= dict(policy="pla", pad_short_batches="always")
    engine = make_engine(qwen2_ckpt, **kw)
    assert engine.runner.row_granule == runner_module.ROW_GRANULE  # padded by default on CPU
    if variant == "rows unpadded":
        engine.runner.row_granule = 1
    elif variant == "rows padded":
        engine.runner.pad_rows_above = runner_module.ROW_GRANULE_FROM
    runs = 2 if variant == "prefix cached" else 1
    for _ in range(runs):  # the second run finds every prompt's blocks in the prefix cache
        reqs = run(engine, qwen2_bf16_prompts, BF16_GREEDY)
        assert [r.output_token_ids for r in reqs] == [
            alone_bf16[tuple(p)] for p in qwen2_bf16_prompts
        ]
    if variant == "prefix cached":
        # whole blocks, the last token of each prompt recomputed
        assert sum(r.metrics.num_cached_tokens for r in reqs) == 0 + 16 + 32 + 288 + 592
    if variant == "padded pla":
        assert engine.stats["grid_hits"] > 0
    if variant.startswith("chunked"):
        assert len(reqs[-1].metrics.prefill_chunks) >= 600 // 64
