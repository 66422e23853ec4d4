"""OpenAI's Responses API (``POST /v1/responses``) over the chat path: text in, one text message out.

A request is read into the ``/v1/chat/completions`` body it means (``instructions`` and ``input`` become
messages, ``max_output_tokens`` the token limit, ``text.format`` the structured output), so it is
checked, templated and sampled exactly as a chat request is; this module then shapes the result as a
Response object, or as the stream of typed events the ``openai`` client reads
(``response.created`` ... ``response.output_text.delta`` ... ``response.completed``).

Served as vLLM serves it with its response store off: nothing is kept after the answer, so
``previous_response_id``, ``background`` and ``GET /v1/responses/{id}`` are not offered, and ``store``
is accepted and ignored. Tools, reasoning items and non-text inputs are a 400 naming the field:
``/v1/chat/completions`` has the tools.
"""

from __future__ import annotations

import json
import math
import uuid
from collections.abc import Sequence
from typing import Any

from plaserve.request import RequestOutput
from plaserve.server.errors import ApiError

# Accepted and passed to the chat request as they are: the sampling fields both APIs share, and
# vLLM's extensions that its /v1/responses takes too.
SAMPLING_FIELDS = (
    "model",
    "temperature",
    "top_p",
    "stream",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "ignore_eos",
)
# Accepted and ignored: bookkeeping that does not change the answer (``store``: nothing is stored).
IGNORED_FIELDS = frozenset(
    {
        "store",
        "metadata",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "service_tier",
        "truncation",
        "parallel_tool_calls",
    }
)
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")


def _unsupported(field: str, why: str) -> ApiError:
    return ApiError(400, f"{field}: {why}", param=field)


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined (other parts are a 400)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(422, f"{where}.content must be a string or an array of parts", param=where)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _unsupported(
                where, f"only text content is supported, got a part of type {kind!r}"
            )
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: dict[str, Any]) -> list[dict[str, str]]:
    """``instructions`` (a system message) and ``input`` (a string: one user message; or message
    items) as chat messages."""
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ApiError(422, "field 'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ApiError(422, "field 'input' must be a string or an array of items", param="input")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(422, f"{where} must be an object", param="input")
        if item.get("type", "message") != "message":
            raise _unsupported(where, f"items of type {item['type']!r} are not supported")
        role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise ApiError(
                400, f"{where}.role must be one of {sorted(ROLES)}, got {item.get('role')!r}"
            )
        messages.append({"role": role, "content": _text_of(item.get("content"), where)})
    return messages


def _response_format(body: dict[str, Any]) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise ApiError(422, "field 'text' must be an object", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ApiError(422, "field 'text.format' must be an object", param="text.format")
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return fmt  # text, json_object; anything else is chat's 400


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body a Responses request means; a 400 for what it cannot serve."""
    for field in body:
        if field in SAMPLING_FIELDS or field in IGNORED_FIELDS:
            continue
        if field in ("input", "instructions", "max_output_tokens", "text"):
            continue
        value = body[field]
        if field in ("tools", "include") and value in (None, []):
            continue
        if field == "tool_choice" and value in (None, "none", "auto"):
            continue
        if field in ("background", "reasoning", "previous_response_id", "conversation"):
            if value in (None, False, {}):
                continue
        raise _unsupported(
            field,
            "not supported on /v1/responses here (nothing is stored; for tools and reasoning, use "
            "/v1/chat/completions)",
        )
    if "input" not in body:
        raise ApiError(422, "field 'input' is required", param="input")
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):  # echoed in the answer, so it must be what the API allows: strings
        raise ApiError(422, "field 'metadata' must be an object of strings", param="metadata")
    chat = {k: body[k] for k in SAMPLING_FIELDS if k in body}
    chat["messages"] = _messages(body)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if (fmt := _response_format(body)) is not None:
        chat["response_format"] = fmt
    return chat


def _json_safe(value: Any) -> Any:
    """``value`` with every float JSON cannot hold (NaN, infinities) as null, as pydantic writes them:
    the Response echoes ``text`` whole, and the request's checks read only its ``format``."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def new_ids() -> tuple[str, str]:
    """A response's id and its message's."""
    return f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"


def _status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """A finished message's status and the Response's ``incomplete_details``."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def message(msg_id: str, text: str, status: str) -> dict[str, Any]:
    """The assistant's output message."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": msg_id,
        "status": status,
        "role": "assistant",
        "content": [part] if status != "in_progress" else [],
    }


def usage(outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """The Responses API's token counts of one answer."""
    out = outputs[0]
    prompt, completion = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def response(
    rid: str,
    created: int,
    model: str,
    request: dict[str, Any],
    *,
    status: str = "in_progress",
    output: list[dict[str, Any]] | None = None,
    incomplete: dict[str, str] | None = None,
    usage_: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A Response object: the request's settings echoed, as OpenAI's are."""
    text = _json_safe(request.get("text") or {"format": {"type": "text"}})
    return {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": status,
        "model": model,
        "output": output or [],
        "error": None,
        "incomplete_details": incomplete,
        "instructions": request.get("instructions"),
        "max_output_tokens": request.get("max_output_tokens"),
        "metadata": request.get("metadata") or {},
        "parallel_tool_calls": True,
        "temperature": request.get("temperature"),  # finite: the sampling checks ask it
        "top_p": request.get("top_p"),
        "tool_choice": "none",
        "tools": [],
        "text": text,
        "store": False,
        "background": False,
        "usage": usage_,
    }


def final_response(
    rid: str, msg_id: str, created: int, model: str, request: dict[str, Any], outputs: list
) -> dict[str, Any]:
    """The finished Response of ``outputs`` (one choice)."""
    status, incomplete = _status(outputs[0].outputs[0].finish_reason)
    return response(
        rid,
        created,
        model,
        request,
        status=status,
        output=[message(msg_id, outputs[0].outputs[0].text, status)],
        incomplete=incomplete,
        usage_=usage(outputs),
    )


class EventStream:
    """The typed events of one streamed Response, numbered in order (``sequence_number``)."""

    def __init__(self, rid: str, msg_id: str) -> None:
        self.rid, self.msg_id = rid, msg_id
        self.sequence = 0

    def event(self, kind: str, **fields: Any) -> str:
        """One server-sent event: its type on the ``event:`` line and in the JSON, as OpenAI sends it."""
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    def opening(self, started: dict[str, Any]) -> list[str]:
        """From ``response.created`` to the empty text part the deltas fill."""
        item = message(self.msg_id, "", "in_progress")
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.event("response.created", response=started),
            self.event("response.in_progress", response=started),
            self.event("response.output_item.added", output_index=0, item=item),
            self.event(
                "response.content_part.added",
                item_id=self.msg_id,
                output_index=0,
                content_index=0,
                part=part,
            ),
        ]

    def delta(self, text: str) -> str:
        return self.event(
            "response.output_text.delta",
            item_id=self.msg_id,
            output_index=0,
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def error(self, e: ApiError) -> str:
        """The error event that ends a stream whose headers went out already."""
        return self.event("error", code=e.code, message=e.message, param=e.param)

    def closing(self, done: dict[str, Any]) -> list[str]:
        """From ``response.output_text.done`` to ``response.completed``, which carries the Response with
        its status (``incomplete`` where the answer hit ``max_output_tokens``): as vLLM ends every
        stream, and what the ``openai`` client's ``responses.stream`` waits for."""
        item = done["output"][0]
        part = item["content"][0]
        where = {"item_id": self.msg_id, "output_index": 0, "content_index": 0}
        return [
            self.event("response.output_text.done", **where, text=part["text"], logprobs=[]),
            self.event("response.content_part.done", **where, part=part),
            self.event("response.output_item.done", output_index=0, item=item),
            self.event("response.completed", response=done),
        ]
