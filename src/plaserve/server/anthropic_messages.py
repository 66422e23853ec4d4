"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over the chat
path, as vLLM and llama.cpp serve it for clients written against Anthropic's SDK.

A request is read into the ``/v1/chat/completions`` body it means: its conversation as
:func:`plaserve.conversations.anthropic_messages` reads it (``system`` a system message; ``text``,
``tool_use`` and ``tool_result`` blocks the text, the assistant's ``tool_calls`` and ``tool``
messages); ``tools`` (``name``, ``description``, ``input_schema``) and ``tool_choice`` (``auto``, ``any``,
``tool``, ``none``; ``disable_parallel_tool_use``) become chat's; ``max_tokens`` (required),
``stop_sequences``, ``temperature``, ``top_p``, ``top_k`` pass on, and ``output_config.format``
(``json_schema``) is the structured output. The answer is a Message: ``text`` and ``tool_use``
content blocks, ``stop_reason`` (``end_turn``, ``max_tokens``, ``stop_sequence`` with the
``stop_sequence`` met, ``tool_use``) and ``usage``; streamed, the typed events Anthropic's SDK reads
(``message_start``, ``content_block_start`` / ``_delta`` / ``_stop``, ``message_delta``,
``message_stop``). Errors take Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``.
Its routes (:class:`MessagesRoutes`) are mixed into the server's handlers.

Images, documents and server tools (web search, code execution, ...) are a 400 naming the field.
``thinking`` is accepted and has no effect, as on vLLM serving a model without a reasoning parser:
no thinking blocks are written, and those an earlier answer carried back are left out of the prompt.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from plaserve import conversations
from plaserve.request import RequestOutput, SamplingParams
from plaserve.server.errors import ApiError
from plaserve.server.generation import EventStreamResponse, Generation
from plaserve.server.protocol import parse_chat_request
from plaserve.server.tool_parsers import ToolParser

# Passed to the chat request as they are: the Messages API's sampling fields, and plaserve's (vLLM's)
# extensions a client may add.
PASSED = ("model", "temperature", "top_p", "top_k", "stream", "seed", "ignore_eos", "min_p")
TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(e: ApiError) -> dict[str, Any]:
    """Anthropic's error object for ``e``."""
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def _bad(where: str, message: str, status: int = 400) -> ApiError:
    return ApiError(status, f"{where}: {message}", param=where)


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    chat: dict[str, Any] = {}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise _bad("tools", "must be an array", 422)
        chat["tools"] = []
        for i, tool in enumerate(tools):
            if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
                kind = tool.get("type") if isinstance(tool, dict) else None
                raise _bad(f"tools[{i}]", f"only client tools are supported, got type {kind!r}")
            # OpenAI's key order (name, description, parameters): templates write the tools out as
            # JSON, so another order is another prompt than chat's for the same tools.
            spec = {"name": tool.get("name")}
            if "description" in tool:
                spec["description"] = tool["description"]
            spec["parameters"] = tool.get("input_schema")
            chat["tools"].append({"type": "function", "function": spec})
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "tool":
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif kind in TOOL_CHOICES:
            chat["tool_choice"] = TOOL_CHOICES[kind]
        else:
            raise _bad("tool_choice", f"type must be auto, any, tool or none, got {kind!r}")
        if choice.get("disable_parallel_tool_use") is True:
            chat["parallel_tool_calls"] = False
    return chat


def chat_body(body: dict[str, Any], *, counting: bool = False) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body a Messages request means (``counting``: a count_tokens
    request, which has no ``max_tokens``); a 400 for what it cannot serve."""
    for field in ("mcp_servers", "container"):
        if body.get(field):
            raise _bad(field, "not supported on /v1/messages here")
    chat = {k: body[k] for k in PASSED if k in body}
    try:
        chat["messages"] = conversations.anthropic_messages(body)
    except conversations.InputError as e:
        raise ApiError(e.status, str(e), param=e.param) from None
    if not counting:
        if "max_tokens" not in body:
            raise _bad("max_tokens", "field 'max_tokens' is required", 422)
        chat["max_tokens"] = body["max_tokens"]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    config = body.get("output_config")
    fmt = config.get("format") if isinstance(config, dict) else None
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            raise _bad("output_config.format", "only json_schema formats are supported")
        schema = {"name": "output", "schema": fmt.get("schema")}
        chat["response_format"] = {"type": "json_schema", "json_schema": schema}
    return chat | _tools(body)


def new_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _input(arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as a ``tool_use`` block's ``input`` (not an object: under ``_raw``)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"_raw": arguments}


def tool_use(call: dict[str, Any]) -> dict[str, Any]:
    """Chat's parsed tool call as a ``tool_use`` block."""
    fn = call["function"]
    return {
        "type": "tool_use",
        "id": call["id"],
        "name": fn["name"],
        "input": _input(fn["arguments"]),
    }


def stop(out: RequestOutput, called: bool) -> tuple[str, str | None]:
    """The Message's ``stop_reason`` and ``stop_sequence``."""
    first = out.outputs[0]
    if called:
        return "tool_use", None
    if first.finish_reason == "length":
        return "max_tokens", None
    if isinstance(first.stop_reason, str):
        return "stop_sequence", first.stop_reason
    return "end_turn", None


def usage(out: RequestOutput) -> dict[str, int]:
    return {
        "input_tokens": len(out.prompt_token_ids),
        "output_tokens": len(out.outputs[0].token_ids),
    }


def message(
    mid: str, model: str, out: RequestOutput, text: str, calls: list[dict[str, Any]]
) -> dict[str, Any]:
    """The finished Message: a text block where there is text or no call, then a block per call."""
    content = [{"type": "text", "text": text}] if text or not calls else []
    reason, sequence = stop(out, bool(calls))
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content + [tool_use(c) for c in calls],
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(out),
    }


class EventStream:
    """The events of one streamed Message. The text block opens at the first text; a call's
    ``tool_use`` block at its name, its arguments following as ``input_json_delta`` pieces."""

    def __init__(self) -> None:
        self.index = -1  # the open block's
        self.open: str | None = None  # its type
        self.calls = 0  # tool_use blocks sent

    @staticmethod
    def event(kind: str, **fields: Any) -> str:
        data = json.dumps({"type": kind, **fields}, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    def opening(self, mid: str, model: str, input_tokens: int) -> list[str]:
        started = {
            "id": mid,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }
        return [self.event("message_start", message=started), self.event("ping")]

    def _start(self, kind: str, block: dict[str, Any]) -> list[str]:
        events = self._close()
        self.index += 1
        self.open = kind
        return [*events, self.event("content_block_start", index=self.index, content_block=block)]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [self.event("content_block_stop", index=self.index)]

    def text(self, text: str) -> list[str]:
        events = [] if self.open == "text" else self._start("text", {"type": "text", "text": ""})
        delta = {"type": "text_delta", "text": text}
        return [*events, self.event("content_block_delta", index=self.index, delta=delta)]

    def call(self, call_id: str, name: str | None, arguments: str) -> list[str]:
        """A piece of a call: its first, with the name, opens its block."""
        events = []
        if name is not None:
            self.calls += 1
            block = {"type": "tool_use", "id": call_id, "name": name, "input": {}}
            events = self._start("tool_use", block)
        if arguments:
            delta = {"type": "input_json_delta", "partial_json": arguments}
            events.append(self.event("content_block_delta", index=self.index, delta=delta))
        return events

    def closing(self, done: dict[str, Any]) -> list[str]:
        """The blocks of ``done`` not streamed (an empty answer's text block; calls found only in
        the whole answer), the last block's end, the stop reason and the output's count,
        ``message_stop``."""
        events = []
        if self.index < 0 and done["content"] and done["content"][0]["type"] == "text":
            events += self._start("text", {"type": "text", "text": ""})
        for block in [b for b in done["content"] if b["type"] == "tool_use"][self.calls :]:
            events += self.call(block["id"], block["name"], json.dumps(block["input"]))
        events += self._close()
        delta = {"stop_reason": done["stop_reason"], "stop_sequence": done["stop_sequence"]}
        usage_ = done["usage"]  # both counts, cumulative, as Anthropic's API sends them now
        return [
            *events,
            self.event("message_delta", delta=delta, usage=usage_),
            self.event("message_stop"),
        ]

    def error(self, e: ApiError) -> str:
        return self.event("error", error=error_body(e)["error"])


class MessagesRoutes:
    """The Messages API's routes: ``POST /v1/messages`` and ``/v1/messages/count_tokens``. Mixed into
    the server's handlers (:mod:`plaserve.server.app`), whose chat path runs them."""

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API, read as the chat request it means (:mod:`anthropic_messages`);
        its errors in Anthropic's shape."""
        try:
            return await self._messages(request)
        except ApiError as e:
            return self._message_error(e)

    def _message_error(self, e: ApiError) -> Response:
        """An error as Anthropic's API answers it: its shape, and 400 for a malformed request (422
        on the OpenAI endpoints)."""
        status = 400 if e.status == 422 else e.status
        self.loop.count_error(status)
        return JSONResponse(error_body(e), status_code=status, headers=e.headers)

    async def _messages(self, request: Request) -> Response:
        body = await self._body(request)
        req = parse_chat_request(chat_body(body), self.sampling_defaults)
        self._check_model(req.model)
        parser, sampling = self._chat_tools(req)
        ids, params = self._chat_prompt(req, sampling)
        mid = new_id()
        kvp = self._kv_params(body, 1, req.sampling, req.stream)
        gen = await self._start(
            request, kvp, mid, [ids], params, 1, self._interval(req.stream, req.stream_options)
        )
        if req.stream:
            events = EventStream()
            stream = self._stream_message(gen, events, mid, len(ids), sampling, parser)
            return EventStreamResponse(self._guarded(stream, gen, events.error))
        outputs = await self._wait(request, gen)
        text, calls = self._parsed_answer(parser, outputs[0])
        answer = message(mid, self.model_name, outputs[0], text, calls)
        return JSONResponse(self._kv_export(kvp, mid, outputs, answer))

    async def _stream_message(
        self,
        gen: Generation,
        events: EventStream,
        mid: str,
        input_tokens: int,
        sampling: SamplingParams,
        parser: ToolParser | None,
    ) -> AsyncIterator[str]:
        """The events of a streamed Message."""
        for event in events.opening(mid, self.model_name, input_tokens):
            yield event
        async for text, call, call_id in self._pieces(gen, sampling, parser):
            piece = events.text(text) if call is None else []
            if call is not None:
                piece = events.call(call_id, call.name, call.arguments)
            for event in piece:
                yield event
        out = gen.outputs()[0]
        text, calls = self._parsed_answer(parser, out)
        for event in events.closing(message(mid, self.model_name, out, text, calls)):
            yield event

    async def count_message_tokens(self, request: Request) -> Response:
        """``POST /v1/messages/count_tokens``: ``{"input_tokens"}`` of a Messages request's prompt."""
        try:
            body = await self._body(request)
            req = parse_chat_request(chat_body(body, counting=True), self.sampling_defaults)
            self._check_model(req.model)
            return JSONResponse({"input_tokens": len(self._chat_ids(req))})
        except ApiError as e:
            return self._message_error(e)
