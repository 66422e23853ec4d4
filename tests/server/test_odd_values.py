"""Every field of a few rich requests, one at a time, given each odd value of
:mod:`plaserve.testing.odd_values` (null, NaN, 2**64, float32's overflow and its smallest subnormal,
"", [], {}, ...): the server answers 200 or a 4xx, never a 5xx, and no 200 stream carries an error
event.

The hypothesis search in test_faults.py draws whole bodies at random; the two 500s this sweep found
needed one odd value beside a grammar (a temperature of 1e308 over masked logits; an empty regex with
``min_tokens``), which random bodies almost never combine."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from plaserve.testing.odd_values import variants

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
        },
    },
}
BASES: list[tuple[str, dict[str, Any]]] = [
    (
        "/v1/completions",
        {
            "prompt": "Hello there",
            "max_tokens": 5,
            "min_tokens": 2,
            "n": 2,
            "temperature": 0.7,
            "logprobs": 1,
            "presence_penalty": 0.5,
            "logit_bias": {"5": 3},
            "stop": ["x"],
            "structured_outputs": {"choice": ["yes", "no", "maybe so"]},
        },
    ),
    (
        "/v1/completions",
        {
            "prompt": [5, 6, 7, 8],
            "max_tokens": 5,
            "echo": True,
            "logprobs": 2,
            "stream": True,
            "stream_interval": 2,
            "repetition_penalty": 1.2,
            "structured_outputs": {"regex": "[a-c]{1,4}"},
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
            ],
            "max_tokens": 12,
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "top_p": 0.9,
            "top_k": 5,
            "min_p": 0.05,
            "seed": 7,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Name and age?"}],
            "max_tokens": 12,
            "frequency_penalty": 0.3,
            "logprobs": True,
            "top_logprobs": 2,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": {"type": "object"}},
            },
        },
    ),
    (
        "/v1/responses",
        {
            "input": "Hi",
            "instructions": "Be brief.",
            "max_output_tokens": 5,
            "temperature": 0.5,
            "top_p": 0.9,
            "stream": True,
        },
    ),
    (
        "/v1/messages",
        {
            "system": "Be brief.",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 5,
            "stop_sequences": ["x"],
            "top_k": 3,
            "stream": True,
        },
    ),
]


def broken(status: int, raw: bytes) -> bool:
    """A 5xx, or a 200 stream that carries an error event (OpenAI's, the Responses', Anthropic's)."""
    if status >= 500:
        return True
    events = (b'data: {"error"', b"event: error", b'"type":"error"')
    return status == 200 and any(e in raw for e in events)


async def sweep(url: str) -> tuple[int, list[tuple[int, str, bytes]]]:
    failures: list[tuple[int, str, bytes]] = []
    sent = 0
    gate = asyncio.Semaphore(8)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(path: str, body: dict[str, Any]) -> None:
            nonlocal sent
            data = json.dumps(body)  # NaN and Infinity as Python writes them
            async with gate:
                headers = {"content-type": "application/json"}
                async with session.post(url + path, data=data, headers=headers) as r:
                    raw = await r.read()
            sent += 1
            if broken(r.status, raw):
                failures.append((r.status, f"{path} {data[-300:]}", raw[:300]))

        await asyncio.gather(*(one(path, v) for path, base in BASES for v in variants(base)))
    return sent, failures


def test_no_odd_value_in_any_field_earns_a_5xx(server) -> None:
    sent, failures = asyncio.run(sweep(server.url))
    assert sent > 1000
    assert not failures, failures[:5]
