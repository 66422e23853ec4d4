"""OpenAI response objects (completions, chat, their stream chunks, usage) and server-sent events."""

from __future__ import annotations

import json
from typing import Any, Callable, Sequence

from plaserve.request import RequestOutput, TokenLogprobs
from plaserve.server.protocol import StreamOptions

DONE = "data: [DONE]\n\n"
Decode = Callable[[int], str]  # one token id to its text
# what a log-probability of -inf is reported as (JSON has no infinities), as vLLM does
_FLOOR = -9999.0


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def token_counts(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """The three counts every ``usage`` object has."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def usage(outputs: Sequence[RequestOutput], n: int = 1) -> dict[str, Any]:
    """Token counts over a request's choices, ``n`` consecutive ones per prompt: each prompt counts once
    (as OpenAI and vLLM count it), every choice's output counts. ``cached_tokens`` came from the prefix
    cache, counted on each prompt's first choice."""
    firsts = outputs[::n]
    prompt = sum(len(o.prompt_token_ids) for o in firsts)
    completion = sum(len(o.outputs[0].token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in firsts)
    return {**token_counts(prompt, completion), "prompt_tokens_details": {"cached_tokens": cached}}


class StreamUsage:
    """The ``usage`` field of a stream's chunks with choices, as ``stream_options`` asks: absent by default,
    null with ``include_usage`` (the counts come in a last chunk, :func:`usage_chunk`), and the counts so
    far with ``continuous_usage_stats``. Those count as :func:`usage` does (each of the ``n`` consecutive
    choices of a prompt counts its tokens, the prompt counts once), so the last running counts equal the
    final ones, less ``prompt_tokens_details``."""

    def __init__(
        self, options: StreamOptions, prompts: Sequence[Sequence[int]], n: int = 1
    ) -> None:
        self.options = options
        self.prompt_tokens = sum(len(p) for p in prompts[::n])
        self.completion_tokens = [0] * len(prompts)  # per choice

    def count(self, index: int, out: RequestOutput) -> None:
        """Take in choice ``index``'s newest output."""
        self.completion_tokens[index] = len(out.outputs[0].token_ids)

    def stamp(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """``chunk`` with its ``usage`` field, if the options give it one."""
        if self.options.continuous_usage_stats:
            chunk["usage"] = token_counts(self.prompt_tokens, sum(self.completion_tokens))
        elif self.options.include_usage:
            chunk["usage"] = None
        return chunk


def completion_logprobs(
    tokens: Sequence[tuple[int, TokenLogprobs | None]], decode: Decode, text_offset: int = 0
) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object of ``(token id, its logprobs)`` pairs (None: the first
    prompt token, which has none); ``top_logprobs`` holds the sampled token besides the most likely ones,
    as OpenAI's does. Offsets count from ``text_offset``."""
    texts, offsets = [], []
    for token_id, _ in tokens:
        texts.append(decode(token_id))
        offsets.append(text_offset)
        text_offset += len(texts[-1])
    return {
        "tokens": texts,
        "token_logprobs": [None if e is None else max(e.logprob, _FLOOR) for _, e in tokens],
        "top_logprobs": [
            None
            if e is None
            else {decode(t): max(lp, _FLOOR) for t, lp in (*e.top, (t0, e.logprob))}
            for t0, e in tokens
        ],
        "text_offset": offsets,
    }


def prompt_pairs(out: RequestOutput) -> list[tuple[int, TokenLogprobs | None]]:
    """The prompt's ``(token id, logprobs)`` pairs of an echoed choice (empty without prompt logprobs)."""
    return (
        [] if out.prompt_logprobs is None else list(zip(out.prompt_token_ids, out.prompt_logprobs))
    )


def output_pairs(entries: Sequence[TokenLogprobs]) -> list[tuple[int, TokenLogprobs | None]]:
    return [(e.token_id, e) for e in entries]


def chat_logprobs(entries: Sequence[TokenLogprobs], decode: Decode) -> dict[str, Any]:
    """The chat ``logprobs`` object of ``entries``: each token with its UTF-8 bytes and its alternatives."""

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = decode(token_id)
        return {"token": text, "logprob": max(logprob, _FLOOR), "bytes": list(text.encode())}

    return {
        "content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
            for e in entries
        ]
    }


def _stop_reason(out: RequestOutput) -> str | int | None:
    return out.outputs[0].stop_reason


def completion_response(
    rid: str,
    created: int,
    model: str,
    outputs: Sequence[RequestOutput],
    n: int = 1,
    decode: Decode | None = None,
    echo: Sequence[str] | None = None,
) -> dict[str, Any]:
    """The body of a finished ``/v1/completions`` request (``decode``: for choices with logprobs;
    ``echo``: each choice's prompt text, to lead its text and logprobs)."""
    choices = []
    for i, o in enumerate(outputs):
        logprobs = None
        if o.outputs[0].logprobs is not None and decode is not None:
            logprobs = completion_logprobs(
                (prompt_pairs(o) if echo else []) + output_pairs(o.outputs[0].logprobs), decode
            )
        choices.append(
            {
                "index": i,
                "text": (echo[i] if echo else "") + o.outputs[0].text,
                "logprobs": logprobs,
                "finish_reason": o.outputs[0].finish_reason,
                "stop_reason": _stop_reason(o),
            }
        )
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(outputs, n),
    }


def chat_response(
    rid: str,
    created: int,
    model: str,
    outputs: Sequence[RequestOutput],
    n: int = 1,
    decode: Decode | None = None,
) -> dict[str, Any]:
    """The body of a finished ``/v1/chat/completions`` request (``decode``: for choices with logprobs)."""
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": o.outputs[0].text},
            "logprobs": None
            if o.outputs[0].logprobs is None or decode is None
            else chat_logprobs(o.outputs[0].logprobs, decode),
            "finish_reason": o.outputs[0].finish_reason,
            "stop_reason": _stop_reason(o),
        }
        for i, o in enumerate(outputs)
    ]
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage(outputs, n),
    }


def _chunk(rid: str, created: int, model: str, obj: str, choice: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    text: str,
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed piece of a completion (its ``usage`` field: :meth:`StreamUsage.stamp`)."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return _chunk(rid, created, model, "text_completion", choice)


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    delta: dict[str, Any],
    finish_reason: str | None,
    logprobs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed piece of a chat completion (its ``usage`` field: :meth:`StreamUsage.stamp`)."""
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _chunk(rid, created, model, "chat.completion.chunk", choice)


def usage_chunk(
    rid: str, created: int, model: str, obj: str, outputs: Sequence[RequestOutput], n: int = 1
) -> dict[str, Any]:
    """The last chunk of a stream with ``include_usage``: no choices, the usage of the whole request."""
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(outputs, n),
    }
