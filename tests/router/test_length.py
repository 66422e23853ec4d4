"""Prompt length estimates: ids, the model's tokenizer, a worker's /tokenize, characters."""

from __future__ import annotations

import asyncio

from plaserve.model.tokenizer import load_tokenizer
from plaserve.router.length import (
    CHAT_TOKENS_PER_MESSAGE,
    CHAT_TOKENS_REPLY,
    Estimate,
    LengthEstimator,
    chat_chars_estimate,
)
from plaserve.server.prompts import encode_chat

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {
        "role": "user",
        "content": [
            {"type": "text", "text": "Hello world! "},
            {"type": "text", "text": "How are you?"},
        ],
    },
]


def run(coro):
    return asyncio.run(coro)


def test_token_ids_are_exact_and_need_nothing_else():
    est = LengthEstimator()
    assert run(est.completion({"prompt": [1, 2, 3]})).tokens == (3,)
    e = run(est.completion({"prompt": [[1, 2], [3, 4, 5, 6]]}))
    assert (e.tokens, e.method) == ((2, 4), "token_ids")


def test_the_models_tokenizer_counts_text_and_the_chat_template(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    est = LengthEstimator(tok)
    text = "The quick brown fox jumps over the lazy dog."
    e = run(est.completion({"prompt": [text, [7, 8]]}))
    assert (e.tokens, e.method) == ((len(tok.encode(text)), 2), "tokenizer")
    e = run(est.chat({"messages": MESSAGES}))
    plain = [
        {
            "role": m["role"],
            "content": c if isinstance(c := m["content"], str) else "".join(p["text"] for p in c),
        }
        for m in MESSAGES
    ]
    # exactly what the server counts
    assert (e.tokens, e.method) == (
        (len(encode_chat(tok, plain)),),
        "tokenizer",
    )


def test_a_workers_tokenize_is_asked_with_the_prompt_or_the_messages():
    asked = []

    async def remote(payload):
        asked.append(payload)
        return 42

    est = LengthEstimator()
    e = run(est.completion({"model": "m", "prompt": ["abc", [1, 2]]}, remote))
    assert (e.tokens, e.method) == ((42, 2), "worker")
    e = run(est.chat({"messages": MESSAGES}, remote))
    assert (e.tokens, e.method) == ((42,), "worker")
    assert asked == [{"prompt": "abc", "model": "m"}, {"messages": MESSAGES}]


def test_characters_when_nothing_else_answers():
    async def nobody(payload):
        return None

    est = LengthEstimator()
    e = run(est.completion({"prompt": "x" * 400}, nobody))
    assert (e.tokens, e.method) == ((100,), "chars")
    e = run(est.chat({"messages": MESSAGES}))
    expected = (
        CHAT_TOKENS_REPLY + 2 * CHAT_TOKENS_PER_MESSAGE + round((6 + 14) / 4) + round((4 + 25) / 4)
    )
    assert e.tokens == (expected,) == (chat_chars_estimate(MESSAGES),)


def test_unreadable_bodies_are_left_to_the_worker():
    est = LengthEstimator()
    for body in ({}, {"prompt": 5}, {"prompt": []}, {"prompt": [[1], "a", 3]}):
        assert run(est.completion(body)).method == "unknown"
    for body in ({}, {"messages": []}, {"messages": [{"role": "user", "content": 5}]}):
        assert run(est.chat(body)).method == "unknown"


def test_a_responses_request_is_priced_as_its_conversation(tokenizer_dir):
    """``instructions`` and ``input`` read as the chat messages the server templates (a developer
    message as a system one); items that are not messages are left to the worker."""
    est = LengthEstimator(load_tokenizer(tokenizer_dir))
    body = {
        "instructions": "You are terse.",
        "input": [{"role": "developer", "content": "Be kind."}, MESSAGES[1]],
    }
    conversation = [MESSAGES[0], {"role": "system", "content": "Be kind."}, MESSAGES[1]]
    assert run(est.request("/v1/responses", body)) == run(est.chat({"messages": conversation}))
    text = {"input": "Hello world! How are you?"}
    assert run(est.request("/v1/responses", text)) == run(
        est.chat({"messages": [{"role": "user", "content": text["input"]}]})
    )
    assert run(est.request("/v1/chat/completions", {"messages": MESSAGES})).method == "tokenizer"
    assert run(est.request("/v1/completions", {"prompt": [1, 2]})).tokens == (2,)
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    result = {"type": "function_call_output", "call_id": "c1", "output": "It is 3 pm."}
    # function calls and their outputs count as chat's assistant and tool turns (by characters here:
    # this test tokenizer's template has no tool role)
    with_calls = run(
        LengthEstimator().request("/v1/responses", {"input": [MESSAGES[1], call, result]})
    )
    turns = [
        MESSAGES[1],
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "It is 3 pm."},
    ]
    assert with_calls == Estimate((chat_chars_estimate(turns),), "chars")
    for bad in ({}, {"input": []}, {"input": [{"type": "reasoning", "summary": []}]}):
        assert run(est.request("/v1/responses", bad)).method == "unknown"
