"""OpenAI's Responses API (``POST /v1/responses``) over the chat path: messages and function calls in,
a text message and function calls out.

A request is read into the ``/v1/chat/completions`` body it means (``instructions`` and ``input`` become
messages, ``function_call`` / ``function_call_output`` items the assistant's tool calls and the tool
results, ``tools`` and ``tool_choice`` chat's, ``max_output_tokens`` the token limit, ``text.format``
the structured output), so it is checked, templated, sampled and its calls parsed exactly as a chat
request is; this module then shapes the result as a Response object, or as the stream of typed events
the ``openai`` client reads (``response.created`` ... ``response.output_text.delta`` ...
``response.completed``). Its routes (:class:`ResponsesRoutes`) are mixed into the server's handlers.

Finished Responses are kept (unless ``store: false``) by :mod:`plaserve.server.response_store` for
``GET /v1/responses/{id}`` and ``previous_response_id``, which continues a kept Response's conversation
(its input and output items, not its ``instructions``, as OpenAI's does). ``background: true``
answers at once with the Response ``queued``; it is generated meanwhile, kept ``in_progress`` and
then finished (``GET`` polls it, ``POST /v1/responses/{id}/cancel`` stops it); with ``stream: true``
its events stream as they come and are kept, so that ``GET /v1/responses/{id}?stream=true&
starting_after=N`` resumes the stream (the generation goes on when its client goes). ``conversation``
is not offered; built-in tools (web search, files, computer use, MCP), reasoning
items and non-text inputs are a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from plaserve import conversations
from plaserve.request import RequestOutput, SamplingParams
from plaserve.server.errors import ApiError
from plaserve.server.generation import EventStreamResponse, Generation
from plaserve.server.protocol import parse_chat_request
from plaserve.server.response_store import EventLog, ResponseStore, Stored
from plaserve.server.tool_parsers import ToolParser

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
    "presence_penalty",
    "frequency_penalty",
    "parallel_tool_calls",
)
# Features not offered here: a request that asks for one (any value but null, false or empty) is a
# 400 naming the field. Other fields the chat path does not read (``store``, ``metadata``, ``user``,
# ``truncation``, ...) are accepted and ignored, as the other endpoints ignore unknown fields.
UNSUPPORTED = {
    "conversation": "conversations are not stored; continue a Response by previous_response_id",
    "reasoning": "reasoning is not offered",
    "include": "no extra output is offered",
    "prompt": "stored prompts are not offered",
    "top_logprobs": "log-probabilities are offered on /v1/chat/completions",
}


def _unsupported(field: str, why: str) -> ApiError:
    return ApiError(400, f"{field}: {why}", param=field)


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


def _tools(body: dict[str, Any]) -> dict[str, Any]:
    """``tools`` (function tools: ``{"type": "function", "name", "description", "parameters",
    "strict"}``, flat) and ``tool_choice`` as chat's fields."""
    chat: dict[str, Any] = {}
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list):
            raise ApiError(422, "field 'tools' must be an array", param="tools")
        chat["tools"] = []
        for i, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind != "function":
                raise _unsupported(
                    f"tools[{i}]", f"only function tools are supported, got type {kind!r}"
                )
            spec = {
                k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
            }
            chat["tools"].append({"type": "function", "function": spec})
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise _unsupported("tool_choice", f"only function choices, got {choice.get('type')!r}")
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    return chat


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The ``/v1/chat/completions`` body a Responses request means; a 400 for what it cannot serve."""
    for field, why in UNSUPPORTED.items():
        if body.get(field) not in (None, False, 0, "", [], {}):
            raise _unsupported(field, f"not supported on /v1/responses here: {why}")
    if "input" not in body:
        raise ApiError(422, "field 'input' is required", param="input")
    for flag in ("store", "background"):
        if body.get(flag) not in (None, True, False):
            raise ApiError(422, f"field '{flag}' must be a boolean", param=flag)
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):  # echoed in the answer, so it must be what the API allows: strings
        raise ApiError(422, "field 'metadata' must be an object of strings", param="metadata")
    chat = {k: body[k] for k in SAMPLING_FIELDS if k in body}
    try:
        chat["messages"] = conversations.responses_messages(body)
    except conversations.InputError as e:
        raise ApiError(e.status, str(e), param=e.param) from None
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if (fmt := _response_format(body)) is not None:
        chat["response_format"] = fmt
    return chat | _tools(body)


def items_page(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """One page of ``GET /v1/responses/{id}/input_items``: ``limit`` (1-100, 20), ``order`` (``desc``,
    the default, or ``asc``) and ``after`` (an item id: the items past it in that order)."""
    try:
        limit = int(query.get("limit", "20"))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 100:
        raise ApiError(400, "limit must be an integer from 1 to 100", param="limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, "order must be 'asc' or 'desc'", param="order")
    ordered = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in ordered]
        if after not in ids:
            raise ApiError(400, f"no input item with id '{after}'", param="after")
        ordered = ordered[ids.index(after) + 1 :]
    page = ordered[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": len(ordered) > limit,
    }


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


def message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


ITEM_ID_PREFIXES = {"message": "msg_", "function_call": "fc_", "function_call_output": "fco_"}


def input_items(value: Any) -> Any:
    """``input`` as the items the store keeps and lists, as OpenAI lists them: a string as one user
    message, each item with its ``type`` and an ``id``, a message's text as a list of parts; anything
    else as it is, for :func:`chat_body`'s checks to reject."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list):
        return value
    items = []
    for item in value:
        if isinstance(item, dict):
            kind = item.get("type", "message")
            item = {"id": ITEM_ID_PREFIXES.get(kind, "item_") + uuid.uuid4().hex, **item}
            item["type"] = kind
            if kind == "message" and isinstance(item.get("content"), str):
                part = "output_text" if item.get("role") == "assistant" else "input_text"
                item["content"] = [{"type": part, "text": item["content"]}]
        items.append(item)
    return items


def _status(finish_reason: str | None) -> tuple[str, dict[str, str] | None]:
    """A finished answer's status and the Response's ``incomplete_details``."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def message(msg_id: str, text: str, status: str) -> dict[str, Any]:
    """The assistant's output message (no text part yet while in progress)."""
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {
        "type": "message",
        "id": msg_id,
        "status": status,
        "role": "assistant",
        "content": [part] if status != "in_progress" else [],
    }


def function_call(
    call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    """A function call output item."""
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def function_calls(tool_calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The function call items of chat's parsed ``tool_calls``."""
    return [
        function_call(c["id"], c["function"]["name"], c["function"]["arguments"])
        for c in tool_calls
    ]


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
    stored: bool = False,
) -> dict[str, Any]:
    """A Response object: the request's settings echoed, as OpenAI's are (``text`` and ``tools`` with
    any NaN as null: JSON has none, and the checks read only parts of them)."""
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
        "parallel_tool_calls": request.get("parallel_tool_calls", True),
        "temperature": request.get("temperature"),  # finite: the sampling checks ask it
        "top_p": request.get("top_p"),
        "tool_choice": _json_safe(request.get("tool_choice") or "auto"),
        "tools": _json_safe(request.get("tools") or []),
        "text": _json_safe(request.get("text") or {"format": {"type": "text"}}),
        "previous_response_id": request.get("previous_response_id"),
        "store": stored,
        "background": request.get("background") is True,
        "usage": usage_,
    }


def final_response(
    rid: str,
    msg_id: str,
    created: int,
    model: str,
    request: dict[str, Any],
    outputs: list,
    text: str,
    calls: list[dict[str, Any]],
    stored: bool = False,
) -> dict[str, Any]:
    """The finished Response of ``outputs`` (one choice) whose answer is ``text`` and the function
    call items ``calls``: a message where there is text or no call, then the calls."""
    status, incomplete = _status(None if calls else outputs[0].outputs[0].finish_reason)
    items = [message(msg_id, text, status)] if text or not calls else []
    return response(
        rid,
        created,
        model,
        request,
        status=status,
        output=items + calls,
        incomplete=incomplete,
        usage_=usage(outputs),
        stored=stored,
    )


class EventStream:
    """The typed events of one streamed Response, numbered in order (``sequence_number``). The
    message's item opens at its first text; a function call's item at its name, its arguments
    following in pieces as the model writes them (the calls come after any text: the tool parsers send
    no text once a call has begun)."""

    def __init__(self, rid: str, msg_id: str) -> None:
        self.rid, self.msg_id = rid, msg_id
        self.sequence = 0
        self.text = ""  # the message's text sent so far
        self.opened = False  # the message's item is out
        self.calls: list[dict[str, Any]] = []  # the function call items streamed, in order

    def event(self, kind: str, **fields: Any) -> str:
        """One server-sent event: its type on the ``event:`` line and in the JSON, as OpenAI sends it."""
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        data = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    def opening(self, started: dict[str, Any]) -> list[str]:
        return [self.event("response.created", response=started), self.in_progress(started)]

    def in_progress(self, started: dict[str, Any]) -> str:
        return self.event("response.in_progress", response=started)

    def _open_message(self) -> list[str]:
        self.opened = True
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.event(
                "response.output_item.added",
                output_index=0,
                item=message(self.msg_id, "", "in_progress"),
            ),
            self.event(
                "response.content_part.added",
                item_id=self.msg_id,
                output_index=0,
                content_index=0,
                part=part,
            ),
        ]

    def delta(self, text: str) -> list[str]:
        """A piece of the message's text (its item opened first where this is the first)."""
        events = [] if self.opened else self._open_message()
        self.text += text
        where = {"item_id": self.msg_id, "output_index": 0, "content_index": 0}
        return [*events, self.event("response.output_text.delta", **where, delta=text, logprobs=[])]

    def call(self, index: int, call_id: str, name: str | None, arguments: str) -> list[str]:
        """A piece of call ``index`` (chat's ``CallDelta``): its first, with the name, opens its item;
        the next add to its arguments."""
        if name is not None:
            self.calls.append(function_call(call_id, name, "", status="in_progress"))
            item = self.calls[index]
            return [
                self.event("response.output_item.added", output_index=self._index(index), item=item)
            ]
        item = self.calls[index]
        item["arguments"] += arguments
        where = {"item_id": item["id"], "output_index": self._index(index)}
        return [self.event("response.function_call_arguments.delta", **where, delta=arguments)]

    def _index(self, call: int) -> int:
        return call + (1 if self.opened else 0)

    def streamed_calls(self) -> list[dict[str, Any]]:
        """The streamed calls' items, finished."""
        return [{**item, "status": "completed"} for item in self.calls]

    def error(self, e: ApiError) -> str:
        """The error event that ends a stream whose headers went out already."""
        return self.event("error", code=e.code, message=e.message, param=e.param)

    def closing(self, done: dict[str, Any]) -> list[str]:
        """Each output item's end (a call not streamed, whole: added, its arguments, done), then
        ``response.completed``, which carries the Response with its status (``incomplete`` where the
        answer hit ``max_output_tokens``): as vLLM ends every stream, and what the ``openai``
        client's ``responses.stream`` waits for."""
        events: list[str] = []
        streamed = {item["id"] for item in self.calls}
        for index, item in enumerate(done["output"]):
            if item["type"] == "message":
                events += [] if self.opened else self._open_message()
                part = item["content"][0]
                where = {"item_id": self.msg_id, "output_index": 0, "content_index": 0}
                events += [
                    self.event(
                        "response.output_text.done", **where, text=part["text"], logprobs=[]
                    ),
                    self.event("response.content_part.done", **where, part=part),
                ]
            else:
                where = {"item_id": item["id"], "output_index": index}
                args = item["arguments"]
                if item["id"] not in streamed:
                    events += [
                        self.event(
                            "response.output_item.added",
                            output_index=index,
                            item={**item, "arguments": "", "status": "in_progress"},
                        ),
                        self.event("response.function_call_arguments.delta", **where, delta=args),
                    ]
                events.append(
                    self.event("response.function_call_arguments.done", **where, arguments=args)
                )
            events.append(self.event("response.output_item.done", output_index=index, item=item))
        return [*events, self.event("response.completed", response=done)]


@dataclass
class Background:
    """A background Response still generating: its task, and its events where it streams."""

    task: asyncio.Task
    log: EventLog | None


def _starting_after(query: Mapping[str, str]) -> int:
    """``starting_after`` of ``GET /v1/responses/{id}?stream=true``: a sequence number (-1: all)."""
    value = query.get("starting_after", "-1")
    try:
        after = int(value)
    except ValueError:
        after = -2
    if after < -1:
        raise ApiError(
            400, "starting_after must be an event's sequence number (>= 0)", param="starting_after"
        )
    return after


class ResponsesRoutes:
    """The Responses API's routes: ``POST /v1/responses`` (whole, streamed or in the background) and
    the kept Responses' ``GET``, ``DELETE``, input items and ``cancel``. Mixed into the server's
    handlers (:mod:`plaserve.server.app`), whose chat path runs them (``_chat_tools``,
    ``_chat_prompt``, ``_interval``, ``_start``, ``_wait``, ``_pieces``, ``_guarded``) and whose
    ``store`` keeps them."""

    store: ResponseStore
    _background: dict[str, Background]  # background Responses still generating, by id

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, read as the chat request it means (:mod:`openai_responses`)."""
        body = await self._body(request)
        conversation = self._conversation(body)
        chat = chat_body({**body, "input": conversation} if "input" in body else body)
        req = parse_chat_request(chat, self.sampling_defaults)
        self._check_model(req.model)
        parser, sampling = self._chat_tools(req)
        ids, params = self._chat_prompt(req, sampling)
        rid, msg_id = self.store.new_id(), message_id()
        kvp = self._kv_params(body, 1, req.sampling, req.stream)
        # kept unless the client says not to; a prefill for another worker's decode is not an answer
        keep = self.store.enabled and body.get("store") is not False
        keep = keep and (kvp is None or not kvp.do_remote_decode)

        def done(response: dict[str, Any]) -> None:
            if keep:
                self.store.put(response, conversation)

        background = body.get("background") is True
        if background and not keep:
            raise ApiError(
                400,
                "background: a background Response is kept until it is fetched; send store true "
                "to a server that keeps Responses",
                param="background",
            )
        # a background Response is kept in progress from its first output: it follows the outputs
        interval = self._interval(req.stream or background, req.stream_options)
        gen = await self._start(request, kvp, rid, [ids], params, 1, interval)
        created = int(time.time())
        if background:
            queued = response(rid, created, self.model_name, body, status="queued", stored=True)
            self.store.put(queued, conversation, running=True)
            log = EventLog() if req.stream else None
            events = EventStream(rid, msg_id)
            later = self._run_background(
                gen, events, log, queued, body, req.sampling, parser, conversation
            )
            task = asyncio.ensure_future(later)
            self._background[rid] = Background(task, log)
            task.add_done_callback(lambda _: self._background.pop(rid, None))
            return JSONResponse(queued) if log is None else EventStreamResponse(log.follow())
        if req.stream:
            events = EventStream(rid, msg_id)
            stream = self._stream_response(
                gen, events, created, body, req.sampling, parser, keep, done
            )
            return EventStreamResponse(self._guarded(stream, gen, events.error))
        outputs = await self._wait(request, gen)
        text, calls = self._parsed_answer(parser, outputs[0])
        items = function_calls(calls)
        answer = final_response(
            rid, msg_id, created, self.model_name, body, outputs, text, items, keep
        )
        done(answer)
        return JSONResponse(self._kv_export(kvp, rid, outputs, answer))

    async def _run_background(
        self,
        gen: Generation,
        events: EventStream,
        log: EventLog | None,
        queued: dict[str, Any],
        body: dict[str, Any],
        sampling: SamplingParams,
        parser: ToolParser | None,
        conversation: list[dict[str, Any]],
    ) -> None:
        """A background Response's generation, run as its stream (the events into ``log`` where it
        was asked streamed, else dropped): kept ``in_progress`` from its first output, then as it
        finished (with its events), ``cancelled`` (:meth:`cancel_response`) or ``failed``."""
        latest = queued

        def keep(answer: dict[str, Any]) -> None:  # kept as running until the end, below
            nonlocal latest
            latest = answer
            self.store.put(answer, conversation, running=True)

        def begun() -> None:
            keep({**queued, "status": "in_progress"})

        created = queued["created_at"]
        stream = self._stream_response(
            gen, events, created, body, sampling, parser, True, keep, begun
        )
        try:
            async for event in stream:
                if log is not None:
                    log.append(event)
        except asyncio.CancelledError:
            latest = {**latest, "status": "cancelled"}
        except ApiError as e:
            self.loop.count_error(e.status)
            if log is not None:
                log.append(events.error(e))
            error = {"code": e.code or "server_error", "message": e.message}
            latest = {**latest, "status": "failed", "error": error}
        finally:
            gen.close()
            if log is not None:
                log.close()
        self.store.put(latest, conversation, log.text if log is not None else "")

    async def cancel_response(self, request: Request) -> Response:
        """``POST /v1/responses/{id}/cancel``: stop a background Response; one already finished is
        returned as it is."""
        rid, entry = self._kept(request)
        if not await self._stop(rid) and not entry.response.get("background"):
            raise ApiError(400, "Only background responses can be cancelled.", param="response_id")
        kept = self.store.get(rid)
        return JSONResponse(kept.response if kept is not None else entry.response)

    async def _stop(self, rid: str) -> bool:
        """Stop the background Response ``rid`` if it is running (it keeps itself ``cancelled``);
        whether it was."""
        running = self._background.get(rid)
        if running is None:
            return False
        running.task.cancel()
        await asyncio.wait([running.task])
        return True

    def _conversation(self, body: dict[str, Any]) -> Any:
        """The request's input items after the conversation of the Response it continues
        (``previous_response_id``); a 400 where that is not kept."""
        items = input_items(body.get("input"))
        prev_id = body.get("previous_response_id")
        if prev_id is None:
            return items
        if not isinstance(prev_id, str):
            raise ApiError(
                422, "field 'previous_response_id' must be a string", param="previous_response_id"
            )
        if not self.store.enabled:
            raise ApiError(
                400,
                "previous_response_id: this server keeps no Responses (--response-store-mib 0)",
                param="previous_response_id",
            )
        prev = self.store.get(prev_id)
        if prev is None:
            raise ApiError(
                400,
                f"Previous response with id '{prev_id}' not found.",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return prev.conversation() + items if isinstance(items, list) else items

    def _kept(self, request: Request) -> tuple[str, Stored]:
        """The kept Response the path names, or a 404."""
        rid = request.path_params["response_id"]
        entry = self.store.get(rid)
        if entry is None:
            raise ApiError(404, f"Response with id '{rid}' not found.", param="response_id")
        return rid, entry

    async def get_response(self, request: Request) -> Response:
        """A kept Response whole, or with ``stream=true`` a streamed background Response's events
        after ``starting_after``, following it while it runs."""
        rid, entry = self._kept(request)
        if request.query_params.get("stream") not in ("true", "1"):
            return JSONResponse(entry.response)
        after = _starting_after(request.query_params)
        running = self._background.get(rid)
        log = running.log if running is not None else None
        if log is None and entry.events:
            log = EventLog.replay(entry.events)
        if log is None:
            raise ApiError(
                400,
                "stream: only a background Response created with stream: true can be streamed",
                param="stream",
            )
        return EventStreamResponse(log.follow(after))

    async def delete_response(self, request: Request) -> Response:
        rid, _ = self._kept(request)
        await self._stop(rid)  # first: it would keep itself again when it ends
        self.store.delete(rid)
        return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})

    async def response_input_items(self, request: Request) -> Response:
        _, entry = self._kept(request)
        return JSONResponse(items_page(entry.input_items, request.query_params))

    async def _stream_response(
        self,
        gen: Generation,
        events: EventStream,
        created: int,
        body: dict[str, Any],
        sampling: SamplingParams,
        parser: ToolParser | None,
        keep: bool,
        done: Callable[[dict[str, Any]], None],
        begun: Callable[[], None] | None = None,
    ) -> AsyncIterator[str]:
        """The events of a streamed Response; ``keep``: it will be stored, by ``done`` at its end.
        ``begun``, a background Response's: its ``response.created`` says ``queued``, and its
        ``response.in_progress`` waits for the first output, when ``begun`` is called."""
        rid, msg_id = events.rid, events.msg_id
        started = response(rid, created, self.model_name, body, stored=keep)
        if begun is None:
            for event in events.opening(started):
                yield event
        else:
            yield events.event("response.created", response={**started, "status": "queued"})
        async for text, call, call_id in self._pieces(gen, sampling, parser):
            if begun is not None:
                begun()
                begun = None
                yield events.in_progress(started)
            piece = events.delta(text) if call is None else []
            if call is not None:
                piece = events.call(call.index, call_id, call.name, call.arguments)
            for event in piece:
                yield event
        outputs = gen.outputs()
        text, calls = self._parsed_answer(parser, outputs[0])
        if events.opened:  # the message is what went out
            text = events.text
        # the calls as they went out (none streamed: the answer's, parsed whole)
        items = events.streamed_calls() or function_calls(calls)
        final = final_response(
            rid, msg_id, created, self.model_name, body, outputs, text, items, keep
        )
        done(final)
        for event in events.closing(final):
            yield event
