"""The final layer computed only for the rows that sample (``PackedBatch.queries``): every other row's
final hidden state would only make logits nobody reads. Runs that compute it for every row
(``ModelRunner._plan``'s ``every_row``) must give the same logprobs, chunked, cached and with decodes
riding along, in float32 and in bfloat16 (where the native attention kernel takes the rows)."""

from __future__ import annotations

import functools

import pytest
import torch

from plaserve import EngineConfig, LLMEngine, SamplingParams
from plaserve.engine.runner import pack
from plaserve.kv_blocks import NULL_BLOCK
from plaserve.request import Request
from plaserve.scheduler.base import BatchItem, ScheduledBatch

BLOCK = 16


def _item(n_prompt: int, computed: int, n: int, first_block: int) -> BatchItem:
    req = Request(list(range(1, n_prompt + 1)), SamplingParams(max_tokens=4))
    req.num_computed_tokens = computed
    blocks = -(-(computed + n) // BLOCK)
    req.block_table = list(range(first_block, first_block + blocks))
    return BatchItem(req, n)


def test_pack_lays_out_the_sampling_rows_as_decode_rows_longest_context_first():
    short = _item(20, 0, 20, first_block=1)  # a whole prompt: samples
    chunk = _item(300, 0, 64, first_block=10)  # a long prompt's first chunk: does not sample
    tail = _item(200, 160, 40, first_block=20)  # a long prompt's last chunk after its cached start
    decode = _item(30, 30, 1, first_block=40)
    decode.request.token_ids.append(7)
    batch = ScheduledBatch([short, chunk, tail, decode])
    packed = pack(batch, BLOCK, torch.device("cpu"), queries=True)
    assert packed.sample_rows == [19, 123, 124]  # short's last, tail's last, the decode
    q = packed.queries
    assert q is not None
    # longest block table first: tail (200 tokens, 13 blocks), then short (20, 2) and decode (31, 2)
    assert q.rows.tolist() == [123, 19, 124]
    assert q.meta.decode_context_lens.tolist() == [200, 20, 31]
    assert q.meta.decode_block_tables[0].tolist() == list(range(20, 33))
    assert q.meta.decode_block_tables[2].tolist() == [40, 41] + [NULL_BLOCK] * 11
    assert q.meta.decode_groups == [(0, 1, 13), (1, 3, 2)]
    assert packed.hidden_rows == [1, 0, 2]  # where each sampling item's row comes out
    assert q.meta.prefill == [] and q.meta.num_prefill_tokens == 0
    # every row samples (decodes only), or queries not asked for: the forward computes every row
    decodes = ScheduledBatch([decode])
    assert pack(decodes, BLOCK, torch.device("cpu"), queries=True).queries is None
    assert pack(batch, BLOCK, torch.device("cpu")).queries is None


def test_no_row_samples_gives_no_query_rows():
    chunk = _item(300, 0, 64, first_block=10)
    packed = pack(ScheduledBatch([chunk]), BLOCK, torch.device("cpu"), queries=True)
    assert packed.queries is not None and packed.queries.rows.numel() == 0
    assert packed.hidden_rows == []


def _logprobs(ckpt: str, dtype: str, every_row: bool, prompts: list[list[int]]) -> list:
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=ckpt,
            dtype=dtype,
            kv_cache_memory="16MiB",
            max_model_len=1024,
            max_num_batched_tokens=128,
            long_chunk_size=128,
            policy="fcfs",
        )
    )
    runner = engine.runner
    seen = []
    forward = runner.model.forward

    def counting(*args, **kw):
        queries = args[4] if len(args) > 4 else kw.get("queries")
        seen.append(None if queries is None else (queries.rows.numel(), args[0].shape[0]))
        return forward(*args, **kw)

    runner.model.forward = counting
    if every_row:
        runner._plan = functools.partial(runner._plan, every_row=True)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    # The first prompt twice: the second finds its blocks in the prefix cache.
    reqs = [engine.add_request(p, params) for p in prompts + prompts[:1]]
    while engine.has_unfinished():
        engine.step()
    pruned = [s for s in seen if s is not None]
    if every_row:
        assert not pruned
    else:
        # chunks that sample nothing, prompts' last chunks with decodes riding along
        assert any(n == 0 for n, _ in pruned) and any(0 < n < rows for n, rows in pruned)
    return [[(e.token_id, e.logprob, e.top) for e in r.output_logprobs] for r in reqs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_final_layer_for_sampling_rows_only_gives_the_same_logprobs(qwen2_ckpt, dtype):
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (300, 9, 45, 500)]
    every = _logprobs(qwen2_ckpt, dtype, True, prompts)
    some = _logprobs(qwen2_ckpt, dtype, False, prompts)
    tol = 1e-4 if dtype == "float32" else 0.05
    for a, b in zip(every, some):
        assert [t for t, _, _ in a] == [t for t, _, _ in b]
        for (_, la, ta), (_, lb, tb) in zip(a, b):
            assert la == pytest.approx(lb, abs=tol)
            assert [i for i, _ in ta] == [i for i, _ in tb]
