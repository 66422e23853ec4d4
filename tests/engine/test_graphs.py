"""Static (batch, bucket) runners: padded batches equal unpadded single runs; fallbacks are counted."""

from __future__ import annotations

import pytest
import torch

from plaserve import EngineConfig, LLMEngine, SamplingParams
from plaserve.scheduler.base import BatchItem, ScheduledBatch


def make_engine(path: str, **kw) -> LLMEngine:
    """An engine on CPU (the GPU tests pass ``device="cuda"``): "auto" would pick a GPU where there is one,
    and the CPU tests check the uncaptured path."""
    return LLMEngine(
        EngineConfig.from_kwargs(
            **(
                {
                    "model": path,
                    "device": "cpu",
                    "dtype": "float32",
                    "kv_cache_memory": "16MiB",
                    "max_model_len": 1024,
                    "policy": "pla",
                    "pad_short_batches": "always",
                }
                | kw
            )
        )
    )


def start(engine: LLMEngine, ids: list[int]) -> BatchItem:
    req = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
    n = engine.scheduler.try_start(req, 1024)
    assert n == len(ids)
    return BatchItem(req, n)


def kv_of(engine: LLMEngine, item: BatchItem) -> torch.Tensor:
    """The K and V of every layer for the request's tokens, ``[layers, 2, tokens, heads, dim]``."""
    bs = engine.config.block_size
    slots = torch.tensor(
        [item.request.block_table[p // bs] * bs + p % bs for p in range(item.num_tokens)]
    )
    return torch.stack(
        [
            torch.stack([k.flatten(0, 1)[slots], v.flatten(0, 1)[slots]])
            for k, v in engine.runner.kv_caches
        ]
    )


def test_padded_bucket_batch_equals_each_request_alone(llama_ckpt):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (20, 25, 32, 17)]
    engine = make_engine(llama_ckpt)
    assert (4, 32) in engine.runner.grid.runners
    items = [start(engine, p) for p in prompts]
    batched = engine.runner.logits(ScheduledBatch(items, kind="short", bucket=32))
    assert batched.shape[0] == 4 * 32 and engine.runner.grid.hits == 1
    for i, item in enumerate(items):
        alone_engine = make_engine(llama_ckpt, policy="fcfs")
        alone_item = start(alone_engine, item.request.prompt_token_ids)
        alone = alone_engine.runner.logits(ScheduledBatch([alone_item]))
        n = item.num_tokens
        torch.testing.assert_close(batched[i * 32 : i * 32 + n], alone, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            kv_of(engine, item), kv_of(alone_engine, alone_item), atol=1e-5, rtol=1e-5
        )


def test_batch_without_grid_entry_falls_back_to_varlen(llama_ckpt):
    engine = make_engine(llama_ckpt)
    engine.runner.build_grid([(1, 32)], capture=False)  # a grid that lacks (2, 32)
    items = [start(engine, list(range(1, 21))), start(engine, list(range(5, 30)))]
    logits = engine.runner.logits(ScheduledBatch(items, kind="short", bucket=32))
    assert logits.shape[0] == 20 + 25  # varlen: no padding
    assert engine.stats["grid_fallbacks"] == 1 and engine.stats["grid_hits"] == 0


@pytest.mark.parametrize("policy", ["pla", "fcfs"])
def test_generation_through_the_grid_equals_fcfs(llama_ckpt, policy):
    gen = torch.Generator().manual_seed(4)
    prompts = [
        torch.randint(0, 300, (n,), generator=gen).tolist() for n in (5, 20, 60, 100, 300, 700)
    ]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ref = [o.token_ids for o in make_engine_llm(llama_ckpt, "fcfs").generate(prompts, params)]
    # pla without padding (the CPU default): varlen short batches with decodes riding along.
    unpadded = make_engine_llm(llama_ckpt, "pla", pad="auto")
    assert [o.token_ids for o in unpadded.generate(prompts, params)] == ref
    assert unpadded.engine.runner.grid is None
    llm = make_engine_llm(llama_ckpt, policy)
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    if policy == "pla":
        assert llm.engine.stats["grid_hits"] > 0
        # Same prompts again: prefix-cache hits cannot run padded from position 0 -> counted fallbacks.
        assert [o.token_ids for o in llm.generate(prompts, params)] == ref
        assert llm.engine.stats["grid_fallbacks"] > 0


def make_engine_llm(path: str, policy: str, pad: str = "always", **kw):
    from plaserve import LLM

    return LLM(
        path,
        device="cpu",  # pad="auto" pads only where graphs are captured: the assertions are CPU's
        dtype="float32",
        kv_cache_memory="16MiB",
        max_model_len=1024,
        policy=policy,
        pad_short_batches=pad,
        **kw,
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_equals_eager(llama_ckpt):  # pragma: no cover - runs on GPU machines only
    engine = make_engine(llama_ckpt, device="cuda", dtype="float32")
    assert engine.runner.grid.captured
    items = [start(engine, list(range(1, 21))), start(engine, list(range(5, 30)))]
    graph = engine.runner.logits(ScheduledBatch(items, kind="short", bucket=32))
    eager_engine = make_engine(llama_ckpt, device="cuda", dtype="float32", use_cuda_graphs=False)
    eager_items = [start(eager_engine, it.request.prompt_token_ids) for it in items]
    eager = eager_engine.runner.logits(ScheduledBatch(eager_items, kind="short", bucket=32))
    torch.testing.assert_close(graph, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_decode_graph_replay_equals_eager(
    llama_ckpt,
):  # pragma: no cover - runs on GPU machines only
    engine = make_engine(llama_ckpt, device="cuda", policy="fcfs", pad_decode_batches="always")
    assert engine.runner.decode_grid.captured
    batch = prefilled_decode_batch(engine, (20, 300, 45))
    graph = engine.runner.logits(
        batch
    )  # 3 rows replayed in the 4-row graph, a null-block row beside them
    assert engine.stats["decode_grid_hits"] == 1
    engine.runner.decode_grid = None
    torch.testing.assert_close(graph, engine.runner.logits(batch), atol=1e-4, rtol=1e-4)


def test_graph_memory_budget_bounds_the_grid(llama_ckpt):
    """The grid holds no shape whose activations exceed ``cuda_graph_memory``; a short batch that would
    is planned smaller, and a bucket beyond the budget takes the varlen fallback."""
    full = make_engine(llama_ckpt)
    per_token = full.model_config.activation_bytes_per_token(4)  # float32, as make_engine pins it
    assert (
        per_token > 0 and max(b * k for b, k in full.runner.grid.runners) == 2048
    )  # 1 GiB: the step cap binds
    engine = make_engine(llama_ckpt, cuda_graph_memory=str(100 * per_token))  # room for 100 tokens
    assert engine.scheduler.composer.token_cap == 100
    shapes = set(engine.runner.grid.runners)
    assert (
        shapes
        and all(b * k <= 100 for b, k in shapes)
        and (2, 32) in shapes
        and (4, 32) not in shapes
    )
    assert not any(k == 128 for _, k in shapes)  # a 128-token bucket alone is over the budget
    for n in (20, 25, 30, 18):  # four prompts of the 32-token bucket: batches of two
        engine.add_request(list(range(1, n + 1)), SamplingParams(max_tokens=1, temperature=0))
    plan = engine.scheduler.short_batch_plan(engine.clock())
    assert plan is not None and plan.bucket == 32 and len(plan.reqs) == 2


def prefilled_decode_batch(
    engine: LLMEngine, lengths: tuple[int, ...], seed: int = 5
) -> ScheduledBatch:
    """Requests of ``lengths`` prompt tokens run until each has its first token; then their next step,
    a batch of decodes, scheduled (not run)."""
    gen = torch.Generator().manual_seed(seed)
    reqs = [
        engine.add_request(
            torch.randint(0, 300, (n,), generator=gen).tolist(),
            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
        )
        for n in lengths
    ]
    while not all(r.output_token_ids for r in reqs):
        engine.step()
    batch = engine.scheduler.schedule(engine.clock())
    assert len(batch.items) == len(lengths) and all(it.num_tokens == 1 for it in batch.items)
    return batch


def test_decode_grid_shapes_and_lookup():
    from plaserve.engine.graphs import decode_grid_shapes

    shapes = decode_grid_shapes(max_batch=48, max_blocks=100, bytes_per_block=1, budget=32 * 64)
    assert {b for b, _ in shapes} == {1, 2, 4, 8, 16, 32} and {w for _, w in shapes} == {
        16,
        32,
        64,
        100,
    }
    assert (32, 64) in shapes and (
        32,
        100,
    ) not in shapes  # 3,200 block rows of K/V are over the budget
    assert decode_grid_shapes(4, 5, 1, 10**6) == [
        (1, 5),
        (2, 5),
        (4, 5),
    ]  # one width: the whole context


def test_decode_through_the_static_grid_equals_varlen(llama_ckpt):
    engine = make_engine(llama_ckpt, policy="fcfs", pad_decode_batches="always")
    grid = engine.runner.decode_grid
    assert (
        grid is not None and not grid.captured and (64, 64) in grid.runners
    )  # 1024 tokens: 64 blocks
    assert grid.lookup(3, 5) is grid.runners[(4, 16)] and grid.lookup(65, 1) is None
    batch = prefilled_decode_batch(
        engine, (20, 300, 45)
    )  # tables of 2 to 19 blocks: one 32-block runner
    static = engine.runner.logits(batch)
    assert engine.stats["decode_grid_hits"] == 1 and static.shape[0] == 3
    engine.runner.decode_grid = None
    torch.testing.assert_close(static, engine.runner.logits(batch), atol=1e-5, rtol=1e-5)


def test_generation_through_the_decode_grid_equals_eager(llama_ckpt):
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (5, 20, 60, 100, 300)]
    # Outputs of different lengths: the decode batch shrinks from 5 rows to 1 (4-, 2- and 1-row runners).
    params = [
        SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (12, 4, 9, 6, 2)
    ]
    ref = [
        o.token_ids
        for o in make_engine_llm(llama_ckpt, "fcfs", pad="never").generate(prompts, params)
    ]
    for policy in ("fcfs", "pla"):
        llm = make_engine_llm(llama_ckpt, policy, pad="never", pad_decode_batches="always")
        assert [o.token_ids for o in llm.generate(prompts, params)] == ref
        assert llm.engine.stats["decode_grid_hits"] > 0
    # A grid without room for 5 rows: those decode steps run eagerly, counted as fallbacks, the others not.
    llm.engine.runner.build_decode_grid([(2, 64), (4, 64)], capture=False)
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    assert (
        llm.engine.stats["decode_grid_fallbacks"] > 0 and llm.engine.stats["decode_grid_hits"] > 0
    )


def test_cuda_engines_keep_sdpa_off_cudnn():
    """cuDNN's attention plans a kernel per new length: the varlen path would pay one per prompt."""
    from plaserve.model.attention import skip_cudnn_attention

    was = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        skip_cudnn_attention()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(was)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_cuda_engine_turns_cudnn_attention_off(
    llama_ckpt,
):  # pragma: no cover - GPU machines only
    torch.backends.cuda.enable_cudnn_sdp(True)
    make_engine(llama_ckpt, device="cuda")
    assert not torch.backends.cuda.cudnn_sdp_enabled()
