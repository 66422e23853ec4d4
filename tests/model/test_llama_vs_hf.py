"""Our Llama-family model against Hugging Face transformers on tiny random-weight checkpoints."""

from __future__ import annotations

import pytest
import torch

from plaserve import LLM, SamplingParams
from plaserve.model.attention import AttentionMetadata, PrefillSeq
from plaserve.model.config import ModelConfig, UnsupportedModelError
from plaserve.model.loader import load_model

transformers = pytest.importorskip("transformers")


def hf_model(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def our_logits(path: str, ids: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    loaded = load_model(path, dtype, torch.device("cpu"))
    n = len(ids)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.long),
        prefill=[PrefillSeq(0, n, 0, None)],
        num_prefill_tokens=n,
    )
    hidden = loaded.model(torch.tensor(ids), torch.arange(n), meta, kv_caches=None)
    return loaded.model.compute_logits(hidden)


@pytest.mark.parametrize("ckpt", ["llama_ckpt", "qwen2_ckpt", "mistral_ckpt"])
def test_logits_match_transformers(ckpt, request):
    path = request.getfixturevalue(ckpt)
    ids = torch.randint(0, 300, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0].float()
    ours = our_logits(path, ids)
    assert (ours - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("ckpt", ["llama_ckpt", "qwen2_ckpt", "mistral_ckpt"])
def test_bfloat16_logits_match_transformers(ckpt, request):
    """In bfloat16 (both sides' weights rounded from the same float32 checkpoint) every logit is within
    0.1 of transformers' (logits of std ~0.8 here; a bfloat16 has 8 significant bits, and the two
    implementations round at different points), and ours are on average as close to the float32 logits
    as transformers' are (within 25 %)."""
    path = request.getfixturevalue(ckpt)
    ids = torch.randint(0, 300, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        exact = hf_model(path)(torch.tensor([ids])).logits[0].float()
        ref = hf_model(path, torch.bfloat16)(torch.tensor([ids])).logits[0].float()
    ours = our_logits(path, ids, torch.bfloat16)
    assert (ours - ref).abs().max().item() <= 0.1
    assert (ours - exact).abs().mean().item() <= 1.25 * (ref - exact).abs().mean().item()


def test_bfloat16_greedy_generation_matches_transformers(qwen2_ckpt, qwen2_bf16_prompts):
    prompts = qwen2_bf16_prompts
    # 512-token steps: the 600-token prompt is prefilled in two chunks, the second over cached K/V.
    llm = LLM(
        qwen2_ckpt,
        dtype="bfloat16",
        kv_cache_memory="32MiB",
        max_model_len=1024,
        max_num_batched_tokens=512,
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    ref = hf_model(qwen2_ckpt, torch.bfloat16)
    for prompt, out in zip(prompts, outs):
        gen = ref.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
        top2 = torch.stack([step[0].float().topk(2).values for step in gen.logits])
        assert (top2[:, 0] - top2[:, 1]).min().item() >= 0.25, (
            "a near-tie: these prompts no longer suit the test"
        )
        assert out.token_ids == gen.sequences[0, len(prompt) :].tolist()


def test_llama3_rope_scaling_and_qwen_bias_are_parsed(llama_ckpt, qwen2_ckpt):
    llama = ModelConfig.from_pretrained(llama_ckpt)
    assert (
        llama.rope_scaling["rope_type"] == "llama3"
        and llama.num_key_value_heads < llama.num_attention_heads
    )
    qwen = ModelConfig.from_pretrained(qwen2_ckpt)
    assert qwen.qkv_bias and not qwen.o_bias and qwen.tie_word_embeddings


def test_unsupported_architecture_is_refused():
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel"):
        ModelConfig.from_dict({"architectures": ["GPT2LMHeadModel"], "vocab_size": 10})


def hf_greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("ckpt", ["llama_ckpt", "qwen2_ckpt"])
def test_batched_greedy_generation_matches_transformers(ckpt, request):
    path = request.getfixturevalue(ckpt)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (3, 17, 200, 700)]
    llm = LLM(
        path,
        dtype="float32",
        kv_cache_memory="32MiB",
        max_model_len=1024,
        max_num_batched_tokens=512,
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    ref = hf_model(path)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(ref, prompt, 32)


def test_penalised_greedy_generation_matches_transformers(llama_ckpt):
    """Repetition penalty and min_tokens against transformers' own logits processors."""
    prompt = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(5)).tolist()
    ref = hf_model(llama_ckpt)
    llm = LLM(llama_ckpt, dtype="float32", kv_cache_memory="16MiB", max_model_len=512)
    out = llm.generate(
        [prompt],
        SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, repetition_penalty=1.8),
    )
    expected = ref.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, 24, dtype=torch.long),
        max_new_tokens=16,
        min_new_tokens=16,
        do_sample=False,
        pad_token_id=0,
        repetition_penalty=1.8,
    )[0, 24:].tolist()
    # the penalty changed the text
    assert out[0].token_ids == expected and expected != hf_greedy(ref, prompt, 16)

    # min_tokens: make the first unpenalised greedy token the eos; it may not end the request before 3 tokens.
    eos = hf_greedy(ref, prompt, 1)[0]
    engine = llm.engine
    req = engine.add_request(prompt, SamplingParams(max_tokens=12, min_tokens=3, temperature=0))
    req.eos_token_ids = (eos,)
    while engine.has_unfinished():
        engine.step()
    expected = ref.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, 24, dtype=torch.long),
        max_new_tokens=12,
        min_new_tokens=3,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=eos,
    )[0, 24:].tolist()
    assert req.output_token_ids == expected and eos not in expected[:3]


def test_presence_and_frequency_penalties_match_a_reference_loop(llama_ckpt):
    """transformers has no presence/frequency penalties: the reference applies OpenAI's formula by hand
    to transformers' logits, one token at a time."""
    prompt = torch.randint(0, 300, (16,), generator=torch.Generator().manual_seed(6)).tolist()
    ref = hf_model(llama_ckpt)
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(16):
            logits = ref(torch.tensor([ids])).logits[0, -1]
            counts = torch.bincount(
                torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]
            ).float()
            token = int((logits - 0.7 * counts - 1.5 * (counts > 0).float()).argmax())
            ids.append(token)
            out.append(token)
    llm = LLM(llama_ckpt, dtype="float32", kv_cache_memory="16MiB", max_model_len=512)
    params = SamplingParams(
        max_tokens=16, temperature=0, ignore_eos=True, frequency_penalty=0.7, presence_penalty=1.5
    )
    assert llm.generate([prompt], params)[0].token_ids == out
    # fewer repeats than without the penalties
    assert len(set(out)) > len(set(hf_greedy(ref, prompt, 16)))


def test_logprobs_match_transformers(llama_ckpt):
    """Each sampled token's log-probability and the top ones, against transformers' raw logits."""
    prompt = torch.randint(0, 300, (20,), generator=torch.Generator().manual_seed(7)).tolist()
    ref = hf_model(llama_ckpt).generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, 20, dtype=torch.long),
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    llm = LLM(llama_ckpt, dtype="float32", kv_cache_memory="16MiB", max_model_len=512)
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    )[0]
    assert out.token_ids == ref.sequences[0, 20:].tolist()
    for entry, logits in zip(out.outputs[0].logprobs, ref.logits):
        logp = logits[0].log_softmax(-1)
        top = torch.topk(logp, 3)
        assert entry.logprob == pytest.approx(logp[entry.token_id].item(), abs=1e-5)
        assert [t for t, _ in entry.top] == top.indices.tolist()
        assert [lp for _, lp in entry.top] == pytest.approx(top.values.tolist(), abs=1e-5)


@pytest.mark.parametrize("policy", ["fcfs", "pla"])
def test_prompt_logprobs_match_transformers_chunked_and_cached(llama_ckpt, policy):
    """Prompt logprobs over a prefill cut into chunks, and again for the same prompt with its blocks in
    the prefix cache (which a request with prompt logprobs must not reuse)."""
    prompt = torch.randint(0, 300, (150,), generator=torch.Generator().manual_seed(8)).tolist()
    with torch.no_grad():
        logp = hf_model(llama_ckpt)(torch.tensor([prompt])).logits[0].log_softmax(-1)
    llm = LLM(
        llama_ckpt,
        dtype="float32",
        kv_cache_memory="16MiB",
        max_model_len=512,
        policy=policy,
        max_num_batched_tokens=64,
        long_chunk_size=64,
        short_threshold=64,
    )
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=2)
    for _ in range(2):  # the second run finds the prompt in the prefix cache
        out = llm.generate([prompt], params)[0]
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 150
        got = torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])
        torch.testing.assert_close(
            got, logp[torch.arange(149), torch.tensor(prompt[1:])], atol=1e-5, rtol=0
        )
        assert [e.top[0][0] for e in out.prompt_logprobs[1:]] == logp[:149].argmax(-1).tolist()
    # nothing reused: every prompt row had to be computed
    assert llm.engine.allocator.num_cache_hits == 0
    plain = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))[0]
    # others still reuse it
    assert plain.prompt_logprobs is None and llm.engine.allocator.num_cache_hits > 0


def test_prompt_logprobs_of_padded_short_batches_and_a_prefill_cut_by_preemption(llama_ckpt):
    """Prompt logprobs read the right rows of a right-padded static batch, and survive a preemption in the
    middle of a chunked prefill (the recompute neither repeats nor skips an entry)."""
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (9, 13, 16, 120)]
    ref = hf_model(llama_ckpt)

    def expected(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logp = ref(torch.tensor([prompt])).logits[0].log_softmax(-1)
        return logp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]

    def got(entries) -> torch.Tensor:
        assert entries[0] is None and len(entries) == len(prompt)
        return torch.tensor([e.logprob for e in entries[1:]])

    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=0)
    llm = LLM(
        llama_ckpt,
        dtype="float32",
        kv_cache_memory="16MiB",
        max_model_len=512,
        policy="pla",
        pad_short_batches="always",
    )
    outs = llm.generate(prompts[:3], params)
    assert llm.engine.stats["grid_hits"] > 0  # the short prompts ran as one padded batch
    for prompt, out in zip(prompts[:3], outs):
        torch.testing.assert_close(got(out.prompt_logprobs), expected(prompt), atol=1e-5, rtol=0)

    prompt = prompts[3]
    engine = LLM(
        llama_ckpt,
        dtype="float32",
        kv_cache_memory="16MiB",
        max_model_len=512,
        policy="pla",
        short_threshold=32,
        long_chunk_size=32,
    ).engine
    req = engine.add_request(prompt, params)
    while len(req.prompt_logprobs) < 50:  # two 32-token chunks: 65 of 120 entries
        engine.step()
    assert len(req.prompt_logprobs) == 65 and req in engine.scheduler.running
    engine.scheduler.preempt(req)
    while engine.has_unfinished():
        engine.step()
    assert req.metrics.num_preemptions == 1
    torch.testing.assert_close(got(req.prompt_logprobs), expected(prompt), atol=1e-5, rtol=0)
