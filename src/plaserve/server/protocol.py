"""Request bodies of the OpenAI-compatible endpoints, parsed and checked into frozen dataclasses.

Parsing here is about the *shape* of a request: JSON types and required fields. The ranges of sampling
fields are :class:`plaserve.SamplingParams`' to check (its errors name the field, and the endpoint's
alias of it: ``max_completion_tokens``, ``top_logprobs``); a few are API limits only the HTTP layer has
(``n`` up to 128, ``best_of`` equal to ``n``). Checks that need the model (prompt length, vocabulary)
live in :mod:`plaserve.server.prompts`.

Type errors (a missing required field, a string where a number belongs) are 422, as FastAPI/pydantic
report them; values of the right type but out of range are 400, as OpenAI and vLLM report them.
Unknown fields are ignored, as OpenAI clients send extras (``user``, ``metadata``, ...); known fields that
ask for what plaserve does not do (tool calling, guided decoding) are refused with a 400 instead, since
ignoring them would answer a different question than the one asked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plaserve import json_body
from plaserve.request import ParamError, SamplingParams
from plaserve.server.errors import ApiError

Prompt = str | list[int]
_MISSING = object()
MAX_N = 128  # choices per prompt (OpenAI's limit for chat)


@dataclass(frozen=True)
class StreamOptions:
    """``stream_options`` of a streamed request (all false when not streaming)."""

    include_usage: bool = (
        False  # a last chunk with the request's usage; ``usage: null`` on the others
    )
    continuous_usage_stats: bool = (
        False  # vLLM's: every chunk with choices carries the usage so far
    )


@dataclass(frozen=True)
class CompletionRequest:
    """``POST /v1/completions``: ``n`` choices per prompt (``prompt`` may be a batch)."""

    model: str | None
    prompts: tuple[Prompt, ...]
    stream: bool
    stream_options: StreamOptions
    sampling: SamplingParams  # max_tokens None: the endpoint's default
    echo: bool = False  # the prompt leads each choice's text (and its logprobs, with logprobs)


@dataclass(frozen=True)
class ChatRequest:
    """``POST /v1/chat/completions``: messages with string content (text parts are joined)."""

    model: str | None
    messages: tuple[dict[str, str], ...]
    stream: bool
    stream_options: StreamOptions
    add_generation_prompt: bool
    sampling: SamplingParams  # max_tokens None: the endpoint's default


@dataclass(frozen=True)
class TokenizeRequest:
    """``POST /tokenize`` (vLLM's shape): either ``prompt`` or chat ``messages``."""

    model: str | None
    prompt: str | None
    messages: tuple[dict[str, str], ...] | None
    add_special_tokens: bool
    add_generation_prompt: bool


# --- the JSON body ------------------------------------------------------------------------------
def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; JSON that is malformed or outside the limits of
    :func:`plaserve.json_body.loads` (depth, digits, Unicode), or that is not an object, is a 400."""
    try:
        body = json_body.loads(raw)
    except json_body.JsonBodyError as e:
        raise ApiError(400, str(e)) from None
    if not isinstance(body, dict):
        raise ApiError(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


# --- typed field access -------------------------------------------------------------------------
def _type_error(name: str, expected: str, value: Any) -> ApiError:
    return ApiError(422, f"field '{name}' must be {expected}, got {_json_type(value)}", param=name)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is not a number


def _opt_int(body: dict, name: str, default: int | None = None) -> int | None:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if _is_int(value):
        return value
    if isinstance(value, float) and value.is_integer():  # 16.0 is an integer in JSON's number type
        return int(value)
    raise _type_error(name, "an integer", value)


def _opt_float(body: dict, name: str, default: float) -> float:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    raise _type_error(name, "a number", value)


def _opt_bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    if isinstance(value, bool):
        return value
    raise _type_error(name, "a boolean", value)


def _opt_str(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is None or isinstance(value, str):
        return value
    raise _type_error(name, "a string", value)


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(v) for v in value):
        raise _type_error(name, "an array of integers", value)
    return list(value)


# --- shared fields ------------------------------------------------------------------------------
MAX_ID_DIGITS = (
    18  # a token id in a logit_bias key: more digits cannot be an id (and cost int() time)
)


def _parse_logit_bias(value: Any) -> dict[int, float] | None:
    """OpenAI's ``logit_bias``: token ids (JSON object keys, so strings) to numbers; the ranges are
    :class:`SamplingParams`' to check."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _type_error("logit_bias", "an object of token ids to numbers", value)
    bias = {}
    for key, b in value.items():
        if not (key.isascii() and key.lstrip("-").isdigit() and len(key) <= MAX_ID_DIGITS):
            raise ApiError(
                400, f"logit_bias keys must be token ids, got {key[:40]!r}", param="logit_bias"
            )
        if not isinstance(b, (int, float)) or isinstance(b, bool):
            raise _type_error("logit_bias", "an object of token ids to numbers", value)
        bias[int(key)] = float(b)
    return bias or None


def _chat_logprobs(body: dict) -> int | None:
    """Chat asks with ``logprobs: true`` and, optionally, ``top_logprobs: k`` (which needs the former)."""
    top = _opt_int(body, "top_logprobs")
    if not _opt_bool(body, "logprobs", False):
        if top:
            raise ApiError(400, "'top_logprobs' needs 'logprobs' to be true", param="top_logprobs")
        return None
    return top or 0


def sampling_params(aliases: dict[str, str] | None = None, **fields: Any) -> SamplingParams:
    """``SamplingParams(**fields)``, its range errors as 400s naming the field as the body calls it
    (``aliases``: a ``SamplingParams`` field to the body's name of it)."""
    try:
        return SamplingParams(**fields)
    except ParamError as e:
        name = (aliases or {}).get(e.param, e.param)
        message = str(e) if name == e.param else f"{name}: {e}"
        raise ApiError(400, message, param=name) from None


def parse_sampling(
    body: dict,
    *,
    max_tokens_names: tuple[str, ...] = ("max_tokens",),
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    aliases: dict[str, str] | None = None,
) -> SamplingParams:
    """The sampling fields of a body as :class:`SamplingParams` (``max_tokens`` None where the body sets
    none: the endpoint decides). Only JSON types are checked here (422); every range is checked by
    ``SamplingParams`` itself (400 naming the field). ``logprobs``, ``prompt_logprobs``: the endpoint's
    own reading of its logprobs fields."""
    max_tokens, aliases = None, dict(aliases or {})
    for name in max_tokens_names:
        max_tokens = _opt_int(body, name)
        if max_tokens is not None:
            aliases["max_tokens"] = name
            break
    n = _opt_int(body, "n", 1)
    if not 1 <= n <= MAX_N:  # an API limit, like --max-queue: the engine takes any n
        raise ApiError(400, f"'n' must be in [1, {MAX_N}], got {n}", param="n")
    best_of = _opt_int(body, "best_of", n)
    if (
        best_of != n
    ):  # best_of > n would rank by cumulative logprob, which plaserve does not compute
        raise ApiError(
            400, f"only best_of = n is supported, got best_of = {best_of}, n = {n}", param="best_of"
        )
    stop_value = body.get("stop")
    if stop_value is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_value, str):
        stop = (stop_value,)
    elif isinstance(stop_value, list) and all(isinstance(s, str) for s in stop_value):
        stop = tuple(stop_value)
    else:
        raise _type_error("stop", "a string or an array of strings", stop_value)
    stop_ids = body.get("stop_token_ids")
    floats = {
        name: _opt_float(body, name, default)
        for name, default in (
            ("temperature", 1.0),
            ("top_p", 1.0),
            ("presence_penalty", 0.0),
            ("frequency_penalty", 0.0),
            ("repetition_penalty", 1.0),
            ("min_p", 0.0),
        )
    }
    return sampling_params(
        aliases,
        n=n,
        max_tokens=max_tokens,
        top_k=_opt_int(body, "top_k", -1),
        seed=_opt_int(body, "seed"),
        stop=stop,
        stop_token_ids=tuple(_int_list(stop_ids, "stop_token_ids")) if stop_ids is not None else (),
        ignore_eos=_opt_bool(body, "ignore_eos", False),
        include_stop_str_in_output=_opt_bool(body, "include_stop_str_in_output", False),
        skip_special_tokens=_opt_bool(body, "skip_special_tokens", True),
        min_tokens=_opt_int(body, "min_tokens", 0),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias=_parse_logit_bias(body.get("logit_bias")),
        **floats,
    )


def _parse_stream(body: dict) -> tuple[bool, StreamOptions]:
    """``stream`` and its ``stream_options``."""
    stream = _opt_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, StreamOptions()
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    if not stream:
        raise ApiError(
            400, "'stream_options' is only allowed when 'stream' is true", param="stream_options"
        )
    return stream, StreamOptions(
        include_usage=_opt_bool(options, "include_usage", False),
        continuous_usage_stats=_opt_bool(options, "continuous_usage_stats", False),
    )


# vLLM's: the older guided_* fields and structured_outputs, which replaced them
_GUIDED_DECODING_EXTRAS = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


def _refuse_unsupported(body: dict, *, chat: bool) -> None:
    """400 for fields that ask for a feature plaserve lacks: guided decoding (``response_format`` other than
    text, vLLM's ``guided_*``) and, on ``chat``, tool calling. Values that ask for nothing pass: null,
    ``response_format: {"type": "text"}``, ``tools: []``, ``tool_choice: "none"``."""
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise _type_error("response_format", "an object", response_format)
        kind = response_format.get("type")
        if kind != "text":
            raise ApiError(
                400,
                f"guided decoding (response_format of type {kind!r}) is not supported; "
                "only 'text' is",
                param="response_format",
            )
    for name in _GUIDED_DECODING_EXTRAS:
        if body.get(name) is not None:
            raise ApiError(400, f"guided decoding ({name}) is not supported", param=name)
    if not chat:
        return
    for name in ("tools", "functions"):
        value = body.get(name)
        if value is not None and not isinstance(value, list):
            raise _type_error(name, "an array", value)
        if value:
            raise ApiError(
                400, f"tool calling is not supported ('{name}' must be empty)", param=name
            )
    for name in ("tool_choice", "function_call"):
        if body.get(name) not in (None, "none"):
            raise ApiError(
                400, f"tool calling is not supported ('{name}' may only be \"none\")", param=name
            )


def _parse_messages(body: dict) -> tuple[dict[str, str], ...]:
    """Chat messages as ``{"role": str, "content": str}``; content parts of type text are joined."""
    value = body.get("messages", _MISSING)
    if value is _MISSING:
        raise ApiError(422, "field 'messages' is required", param="messages")
    if not isinstance(value, list):
        raise _type_error("messages", "an array of message objects", value)
    if not value:
        raise ApiError(400, "'messages' must contain at least one message", param="messages")
    out = []
    for i, message in enumerate(value):
        name = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _type_error(name, "an object", message)
        role = message.get("role")
        if not isinstance(role, str):
            raise _type_error(f"{name}.role", "a string", role)
        content = message.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            parts = []
            for part in content:
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise ApiError(
                        400,
                        f"{name}.content: only text parts are supported",
                        param=f"{name}.content",
                    )
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise _type_error(f"{name}.content", "a string or an array of text parts", content)
        out.append({"role": role, "content": content})
    return tuple(out)


# --- endpoints ----------------------------------------------------------------------------------
def parse_prompts(value: Any) -> tuple[Prompt, ...]:
    """``prompt``: a string, an array of token ids, or an array of either (a batch)."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list):
        if not value:
            raise ApiError(400, "prompt is empty", param="prompt")
        if all(_is_int(v) for v in value):
            return (list(value),)
        if all(isinstance(v, str) for v in value):
            return tuple(value)
        if all(isinstance(v, list) for v in value):
            return tuple(_int_list(v, "prompt") for v in value)
    raise _type_error("prompt", "a string, an array of token ids, or an array of either", value)


def parse_completion_request(body: dict) -> CompletionRequest:
    """Parse a ``/v1/completions`` body."""
    if "prompt" not in body:
        raise ApiError(422, "field 'prompt' is required", param="prompt")
    stream, stream_options = _parse_stream(body)
    echo, logprobs = _opt_bool(body, "echo", False), _opt_int(body, "logprobs")
    if _opt_str(body, "suffix"):
        raise ApiError(400, "suffix is not supported", param="suffix")
    _refuse_unsupported(body, chat=False)
    return CompletionRequest(
        model=_opt_str(body, "model"),
        prompts=parse_prompts(body["prompt"]),
        stream=stream,
        stream_options=stream_options,
        echo=echo,
        sampling=parse_sampling(
            body, logprobs=logprobs, prompt_logprobs=logprobs if echo else None
        ),
    )


def parse_chat_request(body: dict) -> ChatRequest:
    """Parse a ``/v1/chat/completions`` body (``max_completion_tokens`` is the newer name of ``max_tokens``)."""
    stream, stream_options = _parse_stream(body)
    _refuse_unsupported(body, chat=True)
    return ChatRequest(
        model=_opt_str(body, "model"),
        messages=_parse_messages(body),
        stream=stream,
        stream_options=stream_options,
        add_generation_prompt=_opt_bool(body, "add_generation_prompt", True),
        sampling=parse_sampling(
            body,
            max_tokens_names=("max_completion_tokens", "max_tokens"),
            logprobs=_chat_logprobs(body),
            aliases={"logprobs": "top_logprobs"},
        ),
    )


def parse_tokenize_request(body: dict) -> TokenizeRequest:
    """Parse a ``/tokenize`` body: ``{"prompt": str}`` or ``{"messages": [...]}``."""
    has_prompt, has_messages = "prompt" in body, "messages" in body
    if has_prompt == has_messages:
        raise ApiError(422, "give exactly one of 'prompt' and 'messages'", param="prompt")
    prompt = _opt_str(body, "prompt") if has_prompt else None
    if has_prompt and prompt is None:
        raise _type_error("prompt", "a string", None)
    return TokenizeRequest(
        model=_opt_str(body, "model"),
        prompt=prompt,
        messages=_parse_messages(body) if has_messages else None,
        add_special_tokens=_opt_bool(body, "add_special_tokens", has_prompt),
        add_generation_prompt=_opt_bool(body, "add_generation_prompt", True),
    )
