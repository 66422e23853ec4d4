"""Prefix-aware pricing (``router/prefixes.py``): prompt keys, what a worker is taken to hold, and the
decisions it changes; then on live servers, a conversation whose every turn finds its history cached."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from plaserve.cost import CostModel
from plaserve.launcher import RouterProcess, ServerProcess, running
from plaserve.router.config import BreakerConfig, RouterConfig
from plaserve.router.dispatch import DispatchCore
from plaserve.router.policies import Job, PlaPolicy
from plaserve.router.pools import LONG, SHORT
from plaserve.router.prefixes import (
    CHUNK_BYTES,
    CHUNK_TOKENS,
    PrefixIndex,
    PromptKey,
    cache_hit_tokens,
    cache_tokens,
    prompt_key,
    prompt_text,
)
from plaserve.router.workers import Worker

DOC = "".join(f"line {i} of a long shared document. " for i in range(200))  # ~6,700 chars


def _chat(*turns: str, tools: list | None = None) -> dict:
    roles = ["user", "assistant"]
    body = {"messages": [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]}
    return body | ({"tools": tools} if tools else {})


def test_a_key_names_the_text_up_to_each_chunk() -> None:
    a = PromptKey.of(DOC + "first question " * 20)
    b = PromptKey.of(DOC + "second question " * 20)
    shared = len(DOC) // CHUNK_BYTES
    assert a.chunks[:shared] == b.chunks[:shared] and a.chunks[shared] != b.chunks[shared]
    assert len(PromptKey.of("x" * (CHUNK_BYTES - 1)).chunks) == 0  # no whole chunk: nothing shared
    # a chunk's hash depends on all the text before it, not on its own text alone
    assert (
        PromptKey.of("a" * 2 * CHUNK_BYTES).chunks[1] != PromptKey.of("a" * CHUNK_BYTES).chunks[0]
    )


def test_a_conversation_grows_by_its_key_and_tools_and_roles_change_it() -> None:
    first = prompt_key("/v1/chat/completions", _chat(DOC))
    later = prompt_key("/v1/chat/completions", _chat(DOC, "an answer", "and now?"))
    assert later.chunks[: len(first.chunks)] == first.chunks
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert prompt_key("/v1/chat/completions", _chat(DOC, tools=tools)).chunks[0] != first.chunks[0]
    system = {"messages": [{"role": "system", "content": DOC}]}
    assert prompt_key("/v1/chat/completions", system).chunks[0] != first.chunks[0]
    # the other APIs read as the chat conversation they mean; a completion by its one prompt
    responses = prompt_text("/v1/responses", {"input": DOC})
    assert responses == prompt_text("/v1/chat/completions", _chat(DOC))
    messages = {"max_tokens": 4, "messages": [{"role": "user", "content": DOC}]}
    assert prompt_text("/v1/messages", messages) == responses
    assert prompt_text("/v1/completions", {"prompt": [1, 2, 3]}) == "1 2 3"
    for unreadable in ({"prompt": ["a", "b"]}, {"prompt": 3}):
        assert prompt_key("/v1/completions", unreadable) is None
    assert prompt_key("/v1/responses", {"input": 3}) is None
    assert (
        prompt_key("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}) is None
    )


def test_the_index_keeps_the_shared_head_longest_and_estimates_cached_tokens() -> None:
    index = PrefixIndex(int(10 * CHUNK_TOKENS))  # ten chunks
    head = "h" * 4 * CHUNK_BYTES
    first = PromptKey.of(head + "a" * 6 * CHUNK_BYTES)
    index.add(first)
    assert index.matched_chunks(first) == 10 and len(index) == 10
    second = PromptKey.of(head + "b" * 6 * CHUNK_BYTES)
    index.add(second)  # the first's tail goes, the head (used again) stays
    assert index.matched_chunks(second) == 10 and index.matched_chunks(first) == 4
    # cached tokens: the matched share of the prompt's tokens, never the last token
    assert index.cached_tokens(first, 1000) == 400
    assert index.cached_tokens(second, 1000) == 999
    assert index.cached_tokens(None, 1000) == 0
    index.resize(0)
    assert len(index) == 0 and index.cached_tokens(second, 1000) == 0


def test_a_workers_cache_size_is_read_from_its_load() -> None:
    kv = {"used_blocks": 10, "free_blocks": 90, "block_size": 16, "prefix_caching": True}
    assert cache_tokens({"kv": kv}) == 1600
    assert cache_tokens({"kv": kv | {"prefix_caching": False}}) == 0
    assert cache_tokens({"kv": {"used_blocks": 1}}) is None and cache_tokens({}) is None
    assert cache_hit_tokens({"kv": kv | {"cache_hit_tokens": 480}}) == 480
    assert cache_hit_tokens({"kv": kv}) is None and cache_hit_tokens({"kv": 3}) is None


QUADRATIC = CostModel(g1=1e-4, g2=1e-7, c0=1e-3)


def _workers() -> list[Worker]:
    return [
        Worker(f"http://w{i}", QUADRATIC, BreakerConfig(), prefix_cache_tokens=1 << 16)
        for i in range(2)
    ]


def test_a_request_goes_where_its_prefix_is_cached_unless_the_backlog_there_costs_more() -> None:
    ws = _workers()
    core = DispatchCore(PlaPolicy(RouterConfig()), lambda: ws)
    key = prompt_key("/v1/chat/completions", _chat(DOC))
    first = Job((1700,), LONG, 0.0, key)
    cost = core.commit(first, ws[1], 1, 0.0)
    assert cost == pytest.approx(QUADRATIC.prefill_time(1700))
    ws[1].first_token(1)
    # the next turn: the whole history is cached on w1 only, so it is short there, long elsewhere
    turn = prompt_key("/v1/chat/completions", _chat(DOC, "answer", "next question"))
    on_w1, on_w0 = ws[1].cost((1720,), turn), ws[0].cost((1720,), turn)
    h = ws[1].prefixes.cached_tokens(turn, 1720)
    assert h > 1600 and on_w1 == pytest.approx(QUADRATIC.prefill_time(1720 - h, h))
    assert on_w1 < on_w0 / 5
    # w0 is idle and has done less work (the tie-break), yet w1 finishes the prefill first
    assert core.policy.choose(Job((1720,), SHORT, 0.0, turn), ws, 0.0) is ws[1]
    assert core.policy.choose(Job((1720,), SHORT, 0.0, None), ws, 0.0) is ws[0]
    # a backlog on w1 longer than what the cache saves sends it to w0 instead
    ws[1].start(2, on_w0, 100, LONG, 0.0)
    assert core.policy.choose(Job((1720,), SHORT, 0.0, turn), ws, 0.0) is ws[0]
    # a commit remembers the prompt there and counts what was priced as cached
    core.commit(Job((1720,), SHORT, 0.0, turn), ws[0], 3, 0.0)
    assert (
        ws[0].prefixes.matched_chunks(turn) == len(turn.chunks) and ws[0].cached_tokens_total == 0
    )
    assert ws[1].cached_tokens_total == 0  # priced at the commit only: 0 for the first turn there


@pytest.fixture(scope="module")
def two_workers_and_router(qwen2_ckpt: str, tmp_path_factory: pytest.TempPathFactory):
    # one cost model for both workers (not each one's own, fitted at its start): equal prices, so
    # that without the prefix nothing but the work given so far tells them apart
    profile = tmp_path_factory.mktemp("router") / "profile.json"
    model = {"g1": 1e-4, "g2": 1e-8, "g3": 0.0, "c0": 1e-3}
    profile.write_text(json.dumps({"cost_model": model, "short_threshold": 512}))
    args = [qwen2_ckpt, "--kv-cache-memory", "16MiB", "--no-compile"]
    with (
        running(ServerProcess(args), ServerProcess(args)) as (a, b),
        RouterProcess([a.url, b.url], ["--profile", str(profile)]) as router,
    ):
        yield [a, b], router


def test_every_turn_of_a_conversation_finds_its_history_cached(two_workers_and_router) -> None:
    """Through the router to two idle workers priced alike, each turn of a conversation over a long
    document goes to the worker that served the turns before, where the history is in its prefix
    cache (by the work given so far, the tie-break, the turns would alternate); a conversation of
    its own goes to the other worker."""
    workers, router = two_workers_and_router
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    kw = {"model": model, "max_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True}}
    for doc in range(2):  # two conversations, each over its own document
        # the tiny model's tokenizer takes ~0.7 tokens a character, and 2,048 of them at most
        messages = [{"role": "user", "content": f"document {doc}: {DOC[:1600]} What is line 3?"}]
        cached = []
        for turn in range(4):
            answer = client.chat.completions.create(messages=messages, **kw)
            cached.append(answer.usage.prompt_tokens_details.cached_tokens)
            messages += [
                {"role": "assistant", "content": answer.choices[0].message.content},
                {"role": "user", "content": f"And line {turn + 4}?"},
            ]
        prompt = answer.usage.prompt_tokens
        assert cached[0] == 0 and all(c > prompt / 2 for c in cached[1:]), cached
    state = httpx.get(f"{router.url}/workers").json()["workers"]
    assert [w["requests_total"] for w in state] == [4, 4]  # a conversation on each
    assert all(w["cached_tokens_total"] > 0 and w["prefix_index"]["chunks"] for w in state)
    # what the router priced as cached, against what each worker says it served from its cache
    # (all their traffic came through the router): close, as a share of bytes is of tokens
    time.sleep(0.6)  # a /load poll or two after the last answer
    state = httpx.get(f"{router.url}/workers").json()["workers"]
    for w in state:
        assert 0.8 < w["cached_tokens_total"] / w["cache_hit_tokens"] < 1.25, state
    metrics = httpx.get(f"{router.url}/metrics").text
    for w in state:
        label = f'{{worker="{w["url"]}"}}'
        assert (
            f"plaserve_router_worker_cached_tokens{label} {float(w['cached_tokens_total'])}"
            in metrics
        )
        chunks = float(w["prefix_index"]["chunks"])
        assert f"plaserve_router_worker_prefix_chunks{label} {chunks}" in metrics
        hits = float(w["cache_hit_tokens"])
        assert f"plaserve_router_worker_cache_hit_tokens{label} {hits}" in metrics
