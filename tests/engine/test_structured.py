"""Structured outputs in the engine: the masks hold on every path a request can take (varlen and
padded static prefill, chunked prefill, preemption and recompute, n > 1), and the unconstrained rows
of a batch sample exactly what they sample alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from plaserve import LLM, EngineConfig, LLMEngine, SamplingParams
from plaserve.grammar import GrammarError
from plaserve.request import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": -5, "maximum": 5000},
        "ok": {"type": "boolean"},
        "word": {"type": "string", "maxLength": 6},
    },
    "required": ["id", "ok", "word"],
    "additionalProperties": False,
}
REGEX = r"[a-f]{2,4}(-[0-9]{2})+"
CHOICES = ("alpha", "beta", "gamma delta")
SPECS = [
    StructuredOutputs(json=json.dumps(SCHEMA)),
    StructuredOutputs(regex=REGEX),
    StructuredOutputs(choice=CHOICES),
]


def valid(spec: StructuredOutputs, text: str) -> bool:
    if spec.json is not None:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if spec.regex is not None:
        return re.fullmatch(REGEX, text) is not None
    return text in CHOICES


def make_engine(path: str, **kw) -> LLMEngine:
    args = dict(model=path, dtype="float32", kv_cache_memory="16MiB", max_model_len=1024) | kw
    return LLMEngine(EngineConfig.from_kwargs(**args))


def run(engine: LLMEngine, work: list[tuple[list[int], SamplingParams]]):
    reqs = [engine.add_request(p, params) for p, params in work]
    while engine.has_unfinished():
        engine.step()
    return reqs


def mixed_batch(lengths: list[int], max_tokens: int = 30) -> list[tuple[list[int], SamplingParams]]:
    """Constrained and unconstrained requests interleaved: sampled constrained ones (seeded) and
    greedy unconstrained ones (the rows the masks must not touch)."""
    work = []
    for i, n in enumerate(lengths):
        prompt = [(7 * i + 3 * j) % 300 + 4 for j in range(n)]
        if i % 2 == 0:
            spec = SPECS[(i // 2) % len(SPECS)]
            params = SamplingParams(max_tokens=200, temperature=1.0, seed=i, structured=spec)
        else:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        work.append((prompt, params))
    return work


VARIANTS = {
    "padded": dict(policy="pla", pad_short_batches="always"),
    "chunked": dict(
        policy="fcfs", max_num_batched_tokens=64, long_chunk_size=64, enable_prefix_caching=False
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_constrained_rows_follow_their_grammar_and_others_are_untouched(qwen2_ckpt, variant):
    engine = make_engine(qwen2_ckpt, **VARIANTS[variant])
    work = mixed_batch([5, 9, 20, 33, 150, 12])
    reqs = run(engine, work)
    # the same unconstrained requests without the constrained company
    plain = [(i, w) for i, w in enumerate(work) if w[1].structured is None]
    without = run(make_engine(qwen2_ckpt, policy="fcfs"), [w for _, w in plain])
    assert [reqs[i].output_token_ids for i, _ in plain] == [r.output_token_ids for r in without]
    for req, (_, params) in zip(reqs, work):
        if params.structured is not None:
            assert req.finish_reason == "stop" and valid(params.structured, req.output_text)
    if variant == "padded":
        assert engine.stats["grid_hits"] > 0
    if variant == "chunked":
        assert len(reqs[4].metrics.prefill_chunks) >= 3
    assert engine.allocator.num_used_blocks == 0


def test_preemption_keeps_the_grammar_state(qwen2_ckpt):
    """A preempted request recomputes its tokens without resampling them, so its matcher stays
    where it was: its answer is the one it gives unpreempted."""
    tight = dict(
        kv_cache_memory=str(14 * 8192),  # 14 blocks of 16 tokens for ~550 tokens of demand
        max_model_len=208,
        max_num_batched_tokens=64,
        long_chunk_size=64,
        enable_prefix_caching=False,
        policy="fcfs",
    )
    # The constrained requests come last: the newest running request is the one preempted.
    numbers = {"type": "array", "items": {"type": "integer", "maximum": 99}, "minItems": 15}
    specs = [StructuredOutputs(json=json.dumps(numbers | {"maxItems": 15}))] * 2 + SPECS[1:2]
    work = [([9] * 40, SamplingParams(max_tokens=120, temperature=0, ignore_eos=True))] * 2 + [
        (
            [(5 * i + j) % 300 + 4 for j in range(60)],
            SamplingParams(max_tokens=140, temperature=0, structured=spec),
        )
        for i, spec in enumerate(specs)
    ]
    engine = make_engine(qwen2_ckpt, **tight)
    reqs = run(engine, work)
    assert sum(r.metrics.num_preemptions for r in reqs[2:]) > 0
    ref = run(make_engine(qwen2_ckpt), work)  # the same requests with room for all of them
    assert sum(r.metrics.num_preemptions for r in ref) == 0
    assert [r.output_token_ids for r in reqs] == [r.output_token_ids for r in ref]
    for req in reqs[2:4]:
        assert req.finish_reason == "stop" and len(json.loads(req.output_text)) == 15
    assert re.fullmatch(REGEX, reqs[4].output_text)
    assert engine.allocator.num_used_blocks == 0


def test_a_grammar_of_the_empty_string_ends_before_min_tokens(qwen2_ckpt):
    """An empty regex allows only end-of-sequence, which `min_tokens` bans: the grammar wins and
    the request stops at once (it failed: every logit -inf, "not finite"), as one whose grammar a
    token completed stops before `min_tokens`. The ban still holds for the rows beside it."""
    engine = make_engine(qwen2_ckpt)
    empty = SamplingParams(max_tokens=6, min_tokens=3, structured=StructuredOutputs(regex=""))
    plain = SamplingParams(max_tokens=6, min_tokens=6, temperature=0)
    reqs = run(engine, [([5, 6, 7], empty), ([5, 6, 7], plain)])
    assert reqs[0].finish_reason == "stop" and reqs[0].output_text == ""
    assert reqs[1].finish_reason == "length" and len(reqs[1].output_token_ids) == 6


def test_n_choices_each_follow_the_grammar(qwen2_ckpt):
    llm = LLM(qwen2_ckpt, dtype="float32", kv_cache_memory="16MiB")
    params = SamplingParams(n=5, max_tokens=200, temperature=1.0, seed=11, structured=SPECS[0])
    (out,) = llm.generate([list(range(4, 40))], params)
    texts = [c.text for c in out.outputs]
    assert len(texts) == 5 and len(set(texts)) > 1  # seeds seed + j: different answers
    assert all(valid(SPECS[0], t) for t in texts)


def test_bad_specs_are_refused_by_name(qwen2_ckpt):
    engine = make_engine(qwen2_ckpt)
    with pytest.raises(GrammarError, match="regex"):
        engine.add_request([5, 6], SamplingParams(structured=StructuredOutputs(regex="(a")))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputs(regex="a", choice=("b",))
    assert not engine.has_unfinished()


def test_the_cpu_and_device_masks_agree() -> None:
    """The CPU's numpy unpacking and the shifts GPUs run make the same additive masks (0 where a
    bit allows a token, -inf where not), and applying a step's masks sets -inf exactly there in the
    constrained rows (mask k on the k-th constrained row), leaving the other rows untouched."""
    import concurrent.futures

    import torch

    from plaserve.grammar.masks import PendingMasks, additive_on_cpu, additive_on_device

    vocab = 500
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 16), dtype=torch.int32)
    mask = additive_on_cpu(bitmask.numpy(), vocab)
    assert mask.shape == (3, vocab) and torch.equal(mask, additive_on_device(bitmask, vocab))
    assert set(mask.unique().tolist()) == {0.0, float("-inf")}
    word, bit = 3, 7  # token 103: bit 7 of word 3
    banned = not (int(bitmask[0, word]) >> bit) & 1
    assert mask[0, 32 * word + bit].item() == (float("-inf") if banned else 0.0)

    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result((mask, 0.0))
    logits = torch.randn(5, vocab)
    masked = logits.clone()
    PendingMasks([1, 2, 4], future).apply(masked)
    for row, k in ((1, 0), (2, 1), (4, 2)):
        expected = logits[row].masked_fill(mask[k] < 0, float("-inf"))
        assert torch.equal(masked[row], expected)
    assert torch.equal(masked[[0, 3]], logits[[0, 3]])


def test_the_native_kernel_applies_the_bitmask_as_the_unpacked_mask_does() -> None:
    """Where the CPU token-mask kernel is built, a step's bitmask stays packed and the kernel writes
    -inf into the constrained rows' banned logits: the same logits as adding the unpacked mask, the
    vocabulary's tail past the last full word included, the other rows untouched."""
    import concurrent.futures

    import torch

    from plaserve.grammar.masks import PendingMasks, additive_on_cpu
    from plaserve.model.kernels import token_mask

    if token_mask() is None:
        pytest.skip("the CPU token-mask kernel is not built here")
    vocab = 1000  # 31.25 words of 32
    gen = torch.Generator().manual_seed(4)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 32), dtype=torch.int32, generator=gen)

    logits = torch.randn(4, vocab, generator=gen)
    results = []
    for mask, native in ((bitmask, True), (additive_on_cpu(bitmask.numpy(), vocab), False)):
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result((mask, 0.0))
        masked = logits.clone()
        PendingMasks([0, 2, 3], future, native).apply(masked)
        results.append(masked)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0][1], logits[1])
    assert results[0].isinf().any(dim=1).tolist() == [True, False, True, True]
