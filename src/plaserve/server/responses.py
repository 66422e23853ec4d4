"""OpenAI response objects (completions, chat, their stream chunks, usage) and server-sent events."""

from __future__ import annotations

import json
from typing import Any, Sequence

from plaserve.engine.request import RequestOutput

DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event carrying ``payload`` as JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def usage(outputs: Sequence[RequestOutput], n: int = 1) -> dict[str, Any]:
    """Token counts over a request's choices, ``n`` consecutive ones per prompt: each prompt counts once
    (as OpenAI and vLLM count it), every choice's output counts. ``cached_tokens`` came from the prefix
    cache, counted on each prompt's first choice."""
    firsts = outputs[::n]
    prompt = sum(len(o.prompt_token_ids) for o in firsts)
    completion = sum(len(o.outputs[0].token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in firsts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _stop_reason(out: RequestOutput) -> str | int | None:
    return out.outputs[0].stop_reason


def completion_response(rid: str, created: int, model: str, outputs: Sequence[RequestOutput], n: int = 1) -> dict[str, Any]:
    """The body of a finished ``/v1/completions`` request."""
    choices = [{"index": i, "text": o.outputs[0].text, "logprobs": None, "finish_reason": o.outputs[0].finish_reason,
                "stop_reason": _stop_reason(o)} for i, o in enumerate(outputs)]
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices,
            "usage": usage(outputs, n)}


def chat_response(rid: str, created: int, model: str, outputs: Sequence[RequestOutput], n: int = 1) -> dict[str, Any]:
    """The body of a finished ``/v1/chat/completions`` request."""
    choices = [{"index": i, "message": {"role": "assistant", "content": o.outputs[0].text}, "logprobs": None,
                "finish_reason": o.outputs[0].finish_reason, "stop_reason": _stop_reason(o)}
               for i, o in enumerate(outputs)]
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage(outputs, n)}


def completion_chunk(rid: str, created: int, model: str, index: int, text: str, finish_reason: str | None,
                     with_usage_field: bool) -> dict[str, Any]:
    """One streamed piece of a completion. With ``include_usage`` every chunk carries ``usage: null``."""
    chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}]}
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def chat_chunk(rid: str, created: int, model: str, index: int, delta: dict[str, str], finish_reason: str | None,
               with_usage_field: bool) -> dict[str, Any]:
    """One streamed piece of a chat completion."""
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}
    if with_usage_field:
        chunk["usage"] = None
    return chunk


def usage_chunk(rid: str, created: int, model: str, obj: str, outputs: Sequence[RequestOutput],
                n: int = 1) -> dict[str, Any]:
    """The last chunk of a stream with ``include_usage``: no choices, the usage of the whole request."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(outputs, n)}
