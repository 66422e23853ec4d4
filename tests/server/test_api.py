"""The OpenAI-compatible API of a live server, through the official ``openai`` client.

Greedy outputs are checked against the offline engine on the same checkpoint, so the server must pass
prompts, chat templates and sampling settings through unchanged.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from plaserve import LLM, SamplingParams

PROMPT = "Hello world! How are you today?"


@pytest.fixture(scope="module")
def offline(qwen2_ckpt: str) -> LLM:
    return LLM(qwen2_ckpt, kv_cache_memory="64MiB")


def _offline_text(
    offline: LLM, prompt: str | list[int], max_tokens: int, **kw: object
) -> tuple[str, str, list[int]]:
    out = offline.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw))[0]
    return out.text, out.outputs[0].finish_reason, out.prompt_token_ids


def test_models_lists_the_served_model(client: openai.OpenAI, qwen2_ckpt: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [os.path.basename(qwen2_ckpt)]


def test_completion_matches_offline_engine(client: openai.OpenAI, offline: LLM) -> None:
    model = client.models.list().data[0].id
    text, reason, prompt_ids = _offline_text(offline, PROMPT, 12, ignore_eos=True)
    resp = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True}
    )
    choice = resp.choices[0]
    assert choice.text == text and choice.finish_reason == reason == "length"
    assert resp.model == model
    assert resp.usage.prompt_tokens == len(prompt_ids)
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == len(prompt_ids) + 12
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0


def test_penalties_reach_the_engine(client: openai.OpenAI, offline: LLM) -> None:
    """OpenAI's presence/frequency penalties and vLLM's extras (repetition_penalty, min_p, min_tokens)
    give what the offline engine gives with the same SamplingParams."""
    model = client.models.list().data[0].id
    penalties = dict(presence_penalty=1.2, frequency_penalty=0.6)
    text, _, _ = _offline_text(offline, PROMPT, 12, repetition_penalty=1.3, **penalties)
    plain, _, _ = _offline_text(offline, PROMPT, 12)
    resp = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=12,
        temperature=0.0,
        **penalties,
        extra_body={"repetition_penalty": 1.3},
    )
    assert resp.choices[0].text == text != plain

    # min_p cuts the sampled distribution: same seed, same text as offline, not the uncut one.
    def sampled(**kw: float) -> str:
        params = SamplingParams(max_tokens=12, temperature=1.5, seed=3, ignore_eos=True, **kw)
        return offline.generate(PROMPT, params)[0].text

    resp = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=12,
        temperature=1.5,
        seed=3,
        extra_body={"min_p": 0.5, "ignore_eos": True},
    )
    assert resp.choices[0].text == sampled(min_p=0.5) != sampled()

    # logit_bias (OpenAI's: string keys): +100 on one token makes greedy decoding pick nothing else.
    resp = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=4,
        temperature=0.0,
        logit_bias={"300": 100},
        logprobs=True,
    )
    assert [e.token for e in resp.choices[0].logprobs.content] == [
        offline.get_tokenizer().decode([300])
    ] * 4

    # min_tokens: the greedy first token as a stop token would end the request at once; not before 3.
    first = offline.generate(PROMPT, SamplingParams(max_tokens=1, temperature=0.0))[0].token_ids[0]
    stop = dict(
        max_tokens=8, temperature=0.0, extra_body={"stop_token_ids": [first], "ignore_eos": True}
    )
    assert (
        client.completions.create(model=model, prompt=PROMPT, **stop).usage.completion_tokens == 1
    )
    stop["extra_body"] = {**stop["extra_body"], "min_tokens": 3}
    resp = client.completions.create(model=model, prompt=PROMPT, **stop)
    assert resp.usage.completion_tokens >= 3


def test_stop_string_kept_and_special_tokens_shown_on_request(
    client: openai.OpenAI, offline: LLM
) -> None:
    model = client.models.list().data[0].id
    text, _, _ = _offline_text(offline, PROMPT, 12, ignore_eos=True)
    stop = text[3:5]
    args = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=0.0, stop=[stop])
    cut = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    kept = client.completions.create(
        **args, extra_body={"ignore_eos": True, "include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == cut + stop and text.startswith(kept.choices[0].text)

    # <|im_start|> (id 2) is special but not an end of sequence: forced by a bias, shown only on request.
    forced = dict(model=model, prompt=PROMPT, max_tokens=2, temperature=0.0, logit_bias={"2": 100})
    assert client.completions.create(**forced).choices[0].text == ""
    shown = (
        client.completions.create(**forced, extra_body={"skip_special_tokens": False})
        .choices[0]
        .text
    )
    assert shown == "<|im_start|>" * 2


def test_n_choices_per_prompt(client: openai.OpenAI, offline: LLM) -> None:
    """n choices per prompt, indexed prompt by prompt; seeded choices differ from each other and
    repeat across requests; the prompt counts once in usage."""
    model = client.models.list().data[0].id
    prompts = [[5, 6, 7, 8, 9], [100, 101, 102]]
    resp = client.completions.create(
        model=model,
        prompt=prompts,
        n=2,
        max_tokens=6,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    for k, prompt in enumerate(prompts):
        text, _, _ = _offline_text(offline, prompt, 6, ignore_eos=True)
        # greedy: the same twice
        assert resp.choices[2 * k].text == resp.choices[2 * k + 1].text == text
    assert resp.usage.prompt_tokens == 5 + 3 and resp.usage.completion_tokens == 4 * 6

    sampled = dict(
        model=model,
        prompt=PROMPT,
        n=4,
        max_tokens=8,
        temperature=1.0,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    first, again = client.completions.create(**sampled), client.completions.create(**sampled)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices] and len(set(texts)) > 1
    assert first.usage.completion_tokens == 4 * 8


def test_n_choices_share_one_prefill(client: openai.OpenAI, server, offline: LLM) -> None:
    """The later choices of a prompt wait for the first one's prefill and reuse its cached blocks."""

    def cache_hits() -> float:
        text = httpx.get(f"{server.url}/metrics").text
        return next(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name.startswith("plaserve_prefix_cache_hit_tokens")
        )

    prompt = [(7 * i) % 300 + 1 for i in range(101)]  # 6 full blocks of 16 before its last token
    text, _, _ = _offline_text(offline, prompt, 5, ignore_eos=True)
    before = cache_hits()
    resp = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompt,
        n=3,
        max_tokens=5,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in resp.choices] == [text] * 3
    assert cache_hits() - before == 2 * 96  # choices 1 and 2 computed only the last 5 prompt tokens


def test_streamed_chat_with_n_choices_equals_the_whole_response(client: openai.OpenAI) -> None:
    args = dict(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": PROMPT}],
        n=3,
        max_tokens=8,
        temperature=1.0,
        seed=5,
    )
    whole = client.chat.completions.create(**args)
    streamed = {i: "" for i in range(3)}
    roles, reasons = set(), {}
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.add(c.index)
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    assert roles == {0, 1, 2} and reasons == {c.index: c.finish_reason for c in whole.choices}
    assert streamed == {c.index: c.message.content for c in whole.choices}


def test_completion_logprobs_match_the_offline_engine(client: openai.OpenAI, offline: LLM) -> None:
    model = client.models.list().data[0].id
    ref = offline.generate(
        PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    )[0]
    args = dict(
        model=model,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0.0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    lp = client.completions.create(**args).choices[0].logprobs
    expected = ref.outputs[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for got, want, top in zip(lp.token_logprobs, expected, lp.top_logprobs):
        assert got == pytest.approx(want.logprob, abs=1e-4)
        # greedy: the likeliest
        assert len(top) >= 3 and max(top.values()) == pytest.approx(got, abs=1e-6)
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(8)]

    streamed: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in client.completions.create(stream=True, **args):
        for key in streamed:
            streamed[key] += (
                getattr(chunk.choices[0].logprobs, key) if chunk.choices[0].logprobs else []
            )
    assert streamed == {
        "tokens": lp.tokens,
        "token_logprobs": lp.token_logprobs,
        "text_offset": lp.text_offset,
    }


def test_echo_with_prompt_logprobs(client: openai.OpenAI, offline: LLM) -> None:
    """echo + logprobs (what lm-eval's loglikelihood requests send): the prompt leads the text, and its
    tokens' logprobs (the first has none) lead the completion's, equal to the offline engine's."""
    model = client.models.list().data[0].id
    prompt = [5, 6, 7, 8, 9, 10, 11]
    ref = offline.generate(
        [prompt], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1, logprobs=1)
    )[0]
    args = dict(model=model, prompt=prompt, max_tokens=1, temperature=0.0, logprobs=1, echo=True)
    choice = client.completions.create(**args).choices[0]
    prompt_text = offline.get_tokenizer().decode(prompt, skip_special_tokens=False)
    assert choice.text == prompt_text + ref.text
    lp = choice.logprobs
    assert (
        len(lp.tokens) == len(prompt) + 1
        and lp.token_logprobs[0] is None
        and lp.top_logprobs[0] is None
    )
    expected = [e.logprob for e in ref.prompt_logprobs[1:]] + [ref.outputs[0].logprobs[0].logprob]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)

    streamed_text, streamed_lp = "", []
    for chunk in client.completions.create(stream=True, **args):
        streamed_text += chunk.choices[0].text
        streamed_lp += chunk.choices[0].logprobs.token_logprobs if chunk.choices[0].logprobs else []
    assert streamed_text == choice.text and streamed_lp == lp.token_logprobs

    plain = client.completions.create(
        model=model, prompt="Say", max_tokens=2, temperature=0.0, echo=True
    )
    assert plain.choices[0].text.startswith("Say") and plain.choices[0].logprobs is None


def test_chat_logprobs(client: openai.OpenAI) -> None:
    args = dict(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=6,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
    )
    resp = client.chat.completions.create(**args)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 2
        # greedy: the likeliest
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
    streamed = [
        e
        for chunk in client.chat.completions.create(stream=True, **args)
        for c in chunk.choices
        if c.logprobs
        for e in c.logprobs.content
    ]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = client.chat.completions.create(**{**args, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None


def test_prompt_cache_hits_are_reported_as_cached_tokens(client: openai.OpenAI) -> None:
    prompt = list(range(10, 10 + 40))  # 2 full blocks of 16 the second time
    first = client.completions.create(
        model=client.models.list().data[0].id, prompt=prompt, max_tokens=1
    )
    again = client.completions.create(model=first.model, prompt=prompt, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens == 32


def test_batch_of_token_id_prompts(client: openai.OpenAI, offline: LLM) -> None:
    prompts = [[5, 6, 7, 8, 9], [100, 101, 102]]
    resp = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=prompts,
        max_tokens=5,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in resp.choices] == [0, 1]
    for prompt, choice in zip(prompts, resp.choices):
        assert choice.text == _offline_text(offline, prompt, 5, ignore_eos=True)[0]
    assert resp.usage.prompt_tokens == 8 and resp.usage.completion_tokens == 10


def test_chat_applies_the_template(client: openai.OpenAI, offline: LLM, server) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    expected = offline.chat(
        messages, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )
    resp = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=messages,
        max_tokens=10,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == expected.text
    assert resp.usage.prompt_tokens == len(expected.prompt_token_ids)
    tokenized = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
    assert tokenized["tokens"] == expected.prompt_token_ids


def test_streaming_completion_equals_the_whole_response(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    kw = dict(
        model=model, prompt=PROMPT, max_tokens=20, temperature=0.0, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**kw)
    chunks = list(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_streaming_chat_equals_the_whole_response(client: openai.OpenAI) -> None:
    kw = dict(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=15,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks)
        == whole.choices[0].message.content
    )
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stream_ends_with_done(server) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    assert all(json.loads(e[6:])["object"] == "text_completion" for e in events[:-1])


def _stream_events(server, body: dict) -> list[dict]:
    """The JSON events of a streamed ``/v1/completions`` request, as sent (``[DONE]`` left out)."""
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30
    ) as resp:
        return [
            json.loads(line[6:]) for line in resp.iter_lines() if line and line != "data: [DONE]"
        ]


def test_streamed_chunks_carry_usage_only_when_asked(server) -> None:
    """No ``usage`` field by default; ``usage: null`` on every chunk with choices under ``include_usage``
    alone (the counts come in the last chunk only)."""
    body = {"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True}
    assert all("usage" not in e for e in _stream_events(server, body))
    events = _stream_events(server, {**body, "stream_options": {"include_usage": True}})
    assert all(e["choices"] and e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


def test_continuous_usage_stats_count_up_to_the_final_usage(client: openai.OpenAI) -> None:
    """vLLM's ``continuous_usage_stats``: every chunk with choices carries the usage so far; the counts
    grow token by token to the final usage chunk's."""
    chunks = list(
        client.completions.create(
            model=client.models.list().data[0].id,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True},
        )
    )
    *running, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 12
    assert all(c.choices for c in running)  # (a busy engine may merge tokens into fewer chunks)
    completion = [c.usage.completion_tokens for c in running]
    # strictly growing to the final count
    assert completion == sorted(set(completion)) and completion[-1] == 12
    assert {c.usage.prompt_tokens for c in running} == {last.usage.prompt_tokens}
    assert all(
        c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in running
    )


def test_continuous_usage_stats_with_n_choices(client: openai.OpenAI) -> None:
    """With ``n`` choices the running counts are the request's, as the final usage counts them: the prompt
    once, every choice's tokens. The role chunks that open the choices count no tokens yet."""
    args = dict(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": PROMPT}],
        n=2,
        max_tokens=6,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**args)
    chunks = list(
        client.chat.completions.create(
            stream=True, stream_options={"continuous_usage_stats": True}, **args
        )
    )
    # no include_usage: no last chunk without choices
    assert all(c.choices and c.usage for c in chunks)
    assert [c.usage.completion_tokens for c in chunks[:2]] == [0, 0] and chunks[0].choices[
        0
    ].delta.role
    completion = [c.usage.completion_tokens for c in chunks]
    assert completion == sorted(completion)
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 2 * 6
    assert {c.usage.prompt_tokens for c in chunks} == {whole.usage.prompt_tokens}


def _stop_across_tokens(offline: LLM, prompt: str, max_tokens: int) -> str:
    """A stop string whose first occurrence in the greedy output starts in one token and ends in the next,
    so a server that streamed text before the stop string was complete would send too much."""
    out = offline.generate(
        prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    )[0]
    pieces = [offline.get_tokenizer().decode([t]) for t in out.token_ids]
    assert "".join(pieces) == out.text
    offset = 0
    for prev, piece in zip(pieces, pieces[1:]):
        offset += len(prev)
        if prev and len(piece) >= 2:
            stop = prev[-1] + piece[:2]
            if out.text.find(stop) == offset - 1:
                return stop
    raise AssertionError(f"no stop string spans a token boundary in {out.text!r}")


def test_stop_strings_cut_the_text_streamed_or_not(client: openai.OpenAI, offline: LLM) -> None:
    model = client.models.list().data[0].id
    base = dict(model=model, prompt=PROMPT, temperature=0.0, extra_body={"ignore_eos": True})
    full = client.completions.create(max_tokens=30, **base).choices[0].text
    stop = _stop_across_tokens(offline, PROMPT, 30)
    expected = full[: full.find(stop)]
    resp = client.completions.create(max_tokens=30, stop=[stop, "never-appears"], **base)
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "stop"
    streamed = client.completions.create(max_tokens=30, stop=stop, stream=True, **base)
    # Held-back tails must never be sent and then cut: the joined stream equals the cut text.
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    kw = dict(
        model=client.models.list().data[0].id,
        prompt=PROMPT,
        max_tokens=12,
        temperature=1.0,
        top_p=0.9,
        seed=1234,
        extra_body={"top_k": 50, "ignore_eos": True},
    )
    assert (
        client.completions.create(**kw).choices[0].text
        == client.completions.create(**kw).choices[0].text
    )


def test_tokenize_counts_like_usage(client: openai.OpenAI, server) -> None:
    resp = httpx.post(f"{server.url}/tokenize", json={"prompt": PROMPT}).json()
    usage = client.completions.create(
        model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=1
    ).usage
    assert resp["count"] == len(resp["tokens"]) == usage.prompt_tokens
    assert resp["max_model_len"] == 2048


def test_detokenize_inverts_tokenize(server, offline: LLM) -> None:
    """``/detokenize`` (vLLM's) gives back the text of ``/tokenize``'s ids, special tokens kept (the
    chat template's markers here), as the tokenizer decodes them."""
    messages = [{"role": "user", "content": PROMPT}]
    for body in ({"prompt": PROMPT}, {"messages": messages}):
        ids = httpx.post(f"{server.url}/tokenize", json=body).json()["tokens"]
        resp = httpx.post(f"{server.url}/detokenize", json={"tokens": ids})
        assert resp.status_code == 200, resp.text
        text = resp.json()["prompt"]
        assert text == offline.get_tokenizer().decode(ids, skip_special_tokens=False)
        assert PROMPT in text
    assert "<|im_start|>" in text  # the chat template's markers, not skipped
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_version(server) -> None:
    import plaserve

    assert httpx.get(f"{server.url}/version").json() == {"version": plaserve.__version__}


def test_metrics_parse_and_count_requests(client: openai.OpenAI, server) -> None:
    client.completions.create(model=client.models.list().data[0].id, prompt=PROMPT, max_tokens=4)
    families = {
        f.name: f for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
    }
    for name in (
        "plaserve_requests",
        "plaserve_time_to_first_token_seconds",
        "plaserve_time_between_tokens_seconds",
        "plaserve_e2e_request_latency_seconds",
        "plaserve_queued_requests",
        "plaserve_running_requests",
        "plaserve_kv_blocks_used",
        "plaserve_kv_blocks_free",
        "plaserve_prefix_cache_hit_tokens",
        "plaserve_grid_hits",
        "plaserve_grid_fallbacks",
        "plaserve_backlog_seconds",
    ):
        assert name in families, name
    finished = sum(
        s.value
        for s in families["plaserve_requests"].samples
        if s.name == "plaserve_requests_total"
    )
    assert finished >= 1
    ttft_counts = {
        s.labels["length_class"]: s.value
        for s in families["plaserve_time_to_first_token_seconds"].samples
        if s.name.endswith("_count")
    }
    assert set(ttft_counts) == {"short", "long"} and ttft_counts["short"] >= 1
    free = families["plaserve_kv_blocks_free"].samples[0].value
    used = families["plaserve_kv_blocks_used"].samples[0].value
    # 64 MiB / (K and V x 2 layers x 2 KV heads x head_dim 16 x bytes an element x 16 tokens a block)
    element = {"float32": 4, "bfloat16": 2}[httpx.get(f"{server.url}/load").json()["dtype"]]
    assert free > 0 and used + free == 64 * 2**20 // (2 * 2 * 2 * 16 * element * 16)


def test_load_report(server) -> None:
    load = httpx.get(f"{server.url}/load").json()
    assert set(load["backlog_s"]) == {"short", "long"} and load["backlog_tokens"] == []  # idle
    assert set(load["queued"]) == set(load["running"]) == {"short", "long"}
    assert {"used_blocks", "free_blocks", "utilization"} <= set(load["kv"])
    assert {"g1", "g2", "c0"} <= set(load["cost_model"])
    assert load["short_threshold"] == 512 and isinstance(load["policy"], str)
    # pla's chunk in force (from its cost model: the FLOP count's gives the threshold until a refit)
    assert load["long_chunk_size"] in (None, 512, 1024, 2048)
    # what --dtype auto chose
    assert load["dtype"] == httpx.get(f"{server.url}/server_info").json()["dtype"]


def test_sglang_router_endpoints(server, qwen2_ckpt: str) -> None:
    load = httpx.get(f"{server.url}/get_load").json()
    assert isinstance(load, list) and len(load) == 1
    assert isinstance(load[0]["num_tokens"], int) and load[0]["num_tokens"] >= 0
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(f"{server.url}{path}").json()
        assert info["model_path"] == qwen2_ckpt and info["dp_size"] == 1
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(f"{server.url}{path}").json()
        assert info["model_path"] == qwen2_ckpt and info["is_generation"] is True


def _load(server) -> dict:
    return httpx.get(f"{server.url}/load").json()


def _aborted(server) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "plaserve_requests"
        for s in f.samples
        if s.name == "plaserve_requests_total" and s.labels["finish_reason"] == "abort"
    )


def test_disconnect_mid_stream_aborts_and_frees_kv(server) -> None:
    aborted_before = _aborted(server)
    body = {"prompt": PROMPT, "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            lines = resp.iter_lines()
            assert next(line for line in lines if line).startswith("data: ")
            # The request holds blocks while it streams. /load is a snapshot published as a step
            # starts (at most every 10 ms): the one taken before the first step still shows none.
            deadline = time.monotonic() + 10
            while _load(server)["kv"]["used_blocks"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert _load(server)["kv"]["used_blocks"] > 0
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        load = _load(server)
        if load["kv"]["used_blocks"] == 0 and load["num_requests"] == 0:
            break
        time.sleep(0.05)
    assert load["kv"]["used_blocks"] == 0 and load["num_requests"] == 0
    assert _aborted(server) == aborted_before + 1  # aborted, not run to its 1900 tokens
    resp = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
    assert resp.status_code == 200  # and the server goes on serving


def test_disconnect_while_waiting_for_a_whole_response_aborts(server) -> None:
    aborted_before = _aborted(server)
    body = {"prompt": PROMPT, "max_tokens": 1900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
    deadline = time.monotonic() + 20
    while _aborted(server) == aborted_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _aborted(server) == aborted_before + 1
    while _load(server)["kv"]["used_blocks"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _load(server)["kv"]["used_blocks"] == 0


# What vLLM's Grafana dashboard (examples/online_serving/prometheus_grafana/grafana.json) and the Gateway
# API Inference Extension's model-server protocol read from a vLLM server, by metric family name
# (counters without their _total suffix, as the parser reports them).
VLLM_FAMILIES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:num_requests_swapped",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:cpu_cache_usage_perc",
    "vllm:time_to_first_token_seconds",
    "vllm:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
    "vllm:e2e_request_latency_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:request_inference_time_seconds",
    "vllm:prompt_tokens",
    "vllm:generation_tokens",
    "vllm:request_prompt_tokens",
    "vllm:request_generation_tokens",
    "vllm:request_max_num_generation_tokens",
    "vllm:request_params_max_tokens",
    "vllm:request_success",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions",
    "vllm:cache_config_info",
)


def test_vllm_metric_names_with_the_model_name(client: openai.OpenAI, server) -> None:
    def families() -> dict:
        return {
            f.name: f
            for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
        }

    def total(fams: dict, name: str, sample: str) -> float:
        return sum(s.value for s in fams[name].samples if s.name == sample)

    model = client.models.list().data[0].id
    before = families()
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=5, extra_body={"ignore_eos": True}
    )
    after = families()
    for name in VLLM_FAMILIES:
        assert name in after, name
        assert all(s.labels["model_name"] == model for s in after[name].samples), name
    assert (
        total(after, "vllm:prompt_tokens", "vllm:prompt_tokens_total")
        - total(before, "vllm:prompt_tokens", "vllm:prompt_tokens_total")
        == out.usage.prompt_tokens
    )
    assert (
        total(after, "vllm:generation_tokens", "vllm:generation_tokens_total")
        - total(before, "vllm:generation_tokens", "vllm:generation_tokens_total")
        == 5
    )
    assert (
        total(after, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count")
        >= 1
    )
    for name in ("vllm:request_params_max_tokens", "vllm:request_max_num_generation_tokens"):
        assert total(after, name, name + "_sum") - total(before, name, name + "_sum") == 5, name
    assert (
        after["vllm:gpu_cache_usage_perc"].samples[0].value
        == after["vllm:kv_cache_usage_perc"].samples[0].value
    )
    queries = total(after, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total")
    assert (
        queries >= total(after, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
        and queries > 0
    )
    usage = after["vllm:kv_cache_usage_perc"].samples[0].value
    assert 0 <= usage <= 1
    config = after["vllm:cache_config_info"].samples[0].labels
    assert config["block_size"] == "16" and int(config["num_gpu_blocks"]) > 0
