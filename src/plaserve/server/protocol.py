"""Request bodies of the OpenAI-compatible endpoints, parsed and checked into frozen dataclasses.

Parsing here is about the *shape* of a request: JSON types and required fields. The ranges of sampling
fields are :class:`plaserve.SamplingParams`' to check (its errors name the field, and the endpoint's
alias of it: ``max_completion_tokens``, ``top_logprobs``); a few are API limits only the HTTP layer has
(``n`` up to 128, ``best_of`` equal to ``n``). Checks that need the model (prompt length, vocabulary)
live in :mod:`plaserve.server.prompts`.

Type errors (a missing required field, a string where a number belongs) are 422, as FastAPI/pydantic
report them; values of the right type but out of range are 400, as OpenAI and vLLM report them.
Unknown fields are ignored, as OpenAI clients send extras (``user``, ``metadata``, ...); known fields that
ask for what plaserve does not do (``suffix``) are refused with a 400 instead, since
ignoring them would answer a different question than the one asked. Structured outputs
(``response_format``, ``structured_outputs``, ``guided_*``) are compiled here, so a bad schema, regex or
grammar is a 400 naming its field before the engine sees the request; tools are
:mod:`plaserve.server.tools`' to check.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from plaserve import json_body
from plaserve.grammar import GrammarError, check
from plaserve.request import ParamError, SamplingParams, StructuredOutputs
from plaserve.server.errors import ApiError
from plaserve.server.tools import Tools, parse_tools

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
    # vLLM's top-level ``stream_interval``: tokens per chunk, raising the server's (None: the server's)
    interval: int | None = None


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
    messages: tuple[dict[str, Any], ...]  # role, content; tool_calls, tool_call_id where given
    stream: bool
    stream_options: StreamOptions
    add_generation_prompt: bool
    sampling: SamplingParams  # max_tokens None: the endpoint's default
    tools: Tools | None = None  # the tools and tool_choice (None: neither)
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (vLLM's)


@dataclass(frozen=True)
class TokenizeRequest:
    """``POST /tokenize`` (vLLM's shape): either ``prompt`` or chat ``messages``."""

    model: str | None
    prompt: str | None
    messages: tuple[dict[str, Any], ...] | None
    add_special_tokens: bool
    add_generation_prompt: bool


@dataclass(frozen=True)
class DetokenizeRequest:
    """``POST /detokenize`` (vLLM's shape): token ids back to text, the inverse of ``/tokenize``."""

    model: str | None
    tokens: tuple[int, ...]


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
            raise _type_error(f"logit_bias.{key}", "a number", b)
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
    structured: StructuredOutputs | None = None,
    defaults: dict[str, Any] | None = None,
) -> SamplingParams:
    """The sampling fields of a body as :class:`SamplingParams` (``max_tokens`` None where the body sets
    none: the endpoint decides). Only JSON types are checked here (422); every range is checked by
    ``SamplingParams`` itself (400 naming the field). ``logprobs``, ``prompt_logprobs``: the endpoint's
    own reading of its logprobs fields. ``defaults``: the served model's defaults for the fields a
    body leaves out (``--generation-config``: temperature, top_p, top_k, min_p, repetition_penalty)."""
    max_tokens, aliases, defaults = None, dict(aliases or {}), defaults or {}
    for name in max_tokens_names:
        max_tokens = _opt_int(body, name)
        if max_tokens is not None:
            aliases["max_tokens"] = name
            break
    n = _opt_int(body, "n", 1)
    if not 1 <= n <= MAX_N:  # an API limit, like --max-queue: the engine takes any n
        raise ApiError(400, f"'n' must be in [1, {MAX_N}], got {n}", param="n")
    best_of = _opt_int(body, "best_of", n)
    # best_of > n would rank by cumulative logprob, which plaserve does not compute
    if best_of != n:
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
        name: _opt_float(body, name, defaults.get(name, default))
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
        top_k=_opt_int(body, "top_k", defaults.get("top_k", -1)),
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
        structured=structured,
        **floats,
    )


def _parse_stream(body: dict) -> tuple[bool, StreamOptions]:
    """``stream``, its ``stream_options`` and ``stream_interval`` (ignored when not streaming, as
    vLLM ignores it)."""
    stream = _opt_bool(body, "stream", False)
    interval = _opt_int(body, "stream_interval")
    if interval is not None and interval < 1:
        raise ApiError(
            400, f"stream_interval must be at least 1, got {interval}", param="stream_interval"
        )
    options = body.get("stream_options")
    if options is None:
        return stream, StreamOptions(interval=interval if stream else None)
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    if not stream:
        raise ApiError(
            400, "'stream_options' is only allowed when 'stream' is true", param="stream_options"
        )
    return stream, StreamOptions(
        include_usage=_opt_bool(options, "include_usage", False),
        continuous_usage_stats=_opt_bool(options, "continuous_usage_stats", False),
        interval=interval,
    )


# vLLM's older names of structured outputs (each a top-level field) and the StructuredOutputs field each
# sets; `structured_outputs` replaced them.
_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


def _structured_value(name: str, kind: str, value: Any) -> dict[str, Any]:
    """One kind of structured output, its JSON type checked (422 naming ``name``)."""
    if kind == "json":
        if isinstance(value, dict):
            return {"json": json.dumps(value)}
        if isinstance(value, str):
            return {"json": value}
        raise _type_error(name, "a JSON schema (an object or its JSON text)", value)
    if kind == "json_object":
        if not isinstance(value, bool):
            raise _type_error(name, "a boolean", value)
        return {"json_object": value}
    if kind == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise _type_error(name, "an array of strings", value)
        return {"choice": tuple(value)}
    if kind == "structural_tag":  # vLLM takes its JSON text; its object is taken too
        if isinstance(value, dict):
            return {"structural_tag": json.dumps(value)}
    if not isinstance(value, str):
        raise _type_error(name, "a string", value)
    return {kind: value}


def _parse_response_format(value: Any) -> tuple[dict[str, Any], str] | None:
    """OpenAI's ``response_format``: ``text`` (nothing), ``json_object``, or ``json_schema`` with its
    ``schema`` and ``strict``."""
    if value is None:
        return None
    name = "response_format"
    if not isinstance(value, dict):
        raise _type_error(name, "an object", value)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}, name
    if kind == "structural_tag":  # vLLM's: the structures and triggers sit in response_format
        if "format" in value and "structures" not in value:
            raise ApiError(
                400,
                "response_format structural_tag takes vLLM's 'structures' and 'triggers' form "
                "(not 'format')",
                param=name,
            )
        tag = {k: value.get(k) for k in ("structures", "triggers")}
        return {"structural_tag": json.dumps(tag)}, name
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise _type_error(f"{name}.json_schema", "an object", spec)
        schema = spec.get("schema", _MISSING)
        if schema is _MISSING:
            raise ApiError(400, f"{name}.json_schema needs a 'schema'", param=name)
        strict = _opt_bool(spec, "strict", False)
        return {
            **_structured_value(f"{name}.json_schema.schema", "json", schema),
            "strict": strict,
        }, name
    raise ApiError(
        400,
        "response_format type must be 'text', 'json_object', 'json_schema' or 'structural_tag', "
        f"got {kind!r}",
        param=name,
    )


def parse_structured(body: dict) -> tuple[StructuredOutputs, str] | None:
    """The request's structured outputs and the field that asked for them (its errors name it), from
    ``response_format``, vLLM's ``structured_outputs`` or its older ``guided_*`` fields; None when the
    body asks for none. Two of them at once is a 400. The grammar itself is compiled (and a bad one
    refused) by :func:`plaserve.grammar.check`."""
    found: list[tuple[dict[str, Any], str]] = []
    response_format = _parse_response_format(body.get("response_format"))
    if response_format is not None:
        found.append(response_format)
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict):
            raise _type_error("structured_outputs", "an object", outputs)
        fields: dict[str, Any] = {}
        for key in _STRUCTURED_KEYS:
            if outputs.get(key) not in (None, False):
                fields.update(_structured_value(f"structured_outputs.{key}", key, outputs[key]))
        # a structural tag's errors name the field inside it
        where = "structured_outputs.structural_tag" if "structural_tag" in fields else None
        found.append((fields, where if where and len(fields) == 1 else "structured_outputs"))
    for name, kind in _GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append((_structured_value(name, kind, body[name]), name))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for _, name in found)
        raise ApiError(
            400, f"ask for one kind of structured output at a time, got {names}", param=found[1][1]
        )
    fields, name = found[0]
    try:
        return StructuredOutputs(**fields), name
    except ParamError as e:
        raise ApiError(400, f"{name}: {e}", param=name) from None


def _parse_messages(body: dict) -> tuple[dict[str, Any], ...]:
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
        entry: dict[str, Any] = {"role": role, "content": content}
        for key in ("tool_call_id", "name"):  # a tool result's call id; a participant's name
            if message.get(key) is not None:
                if not isinstance(message[key], str):
                    raise _type_error(f"{name}.{key}", "a string", message[key])
                entry[key] = message[key]
        if message.get("tool_calls"):
            entry["tool_calls"] = _parse_tool_calls(message["tool_calls"], f"{name}.tool_calls")
        out.append(entry)
    return tuple(out)


def _parse_tool_calls(value: Any, name: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls``: ``[{"id", "type", "function": {"name", "arguments"}}]``."""
    if not isinstance(value, list):
        raise _type_error(name, "an array of tool calls", value)
    calls = []
    for i, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _type_error(f"{name}[{i}]", "a tool call with a function name", call)
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise _type_error(f"{name}[{i}].function.arguments", "a JSON string", args)
        calls.append(
            {
                "id": call.get("id") if isinstance(call.get("id"), str) else f"call_{i}",
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return calls


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


def parse_completion_request(
    body: dict, defaults: dict[str, Any] | None = None
) -> CompletionRequest:
    """Parse a ``/v1/completions`` body (``defaults``: see :func:`parse_sampling`)."""
    if "prompt" not in body:
        raise ApiError(422, "field 'prompt' is required", param="prompt")
    stream, stream_options = _parse_stream(body)
    echo, logprobs = _opt_bool(body, "echo", False), _opt_int(body, "logprobs")
    if _opt_str(body, "suffix"):
        raise ApiError(400, "suffix is not supported", param="suffix")
    structured = _checked_structured(body)
    return CompletionRequest(
        model=_opt_str(body, "model"),
        prompts=parse_prompts(body["prompt"]),
        stream=stream,
        stream_options=stream_options,
        echo=echo,
        sampling=parse_sampling(
            body,
            logprobs=logprobs,
            prompt_logprobs=logprobs if echo else None,
            structured=structured,
            defaults=defaults,
        ),
    )


def parse_chat_request(body: dict, defaults: dict[str, Any] | None = None) -> ChatRequest:
    """Parse a ``/v1/chat/completions`` body (``max_completion_tokens`` is the newer name of ``max_tokens``)."""
    stream, stream_options = _parse_stream(body)
    structured = _checked_structured(body)
    tools = parse_tools(body)
    if tools is not None and (forced := tools.structured()) is not None:
        if structured is not None:
            raise ApiError(
                400,
                f"tool_choice {tools.choice!r} is enforced with a grammar; it cannot be combined "
                "with structured outputs",
                param="tool_choice",
            )
        structured = forced
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise _type_error("chat_template_kwargs", "an object", kwargs)
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
            structured=structured,
            defaults=defaults,
        ),
        tools=tools,
        chat_template_kwargs=kwargs,
    )


def _checked_structured(body: dict) -> StructuredOutputs | None:
    """The body's structured outputs, compiled once here so that a bad schema, regex or grammar is a
    400 naming its field before the request reaches the engine."""
    found = parse_structured(body)
    if found is None:
        return None
    spec, name = found
    try:
        check(spec, param=name)
    except GrammarError as e:
        raise ApiError(400, f"{name}: {e}", param=e.param) from None
    return spec


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


def parse_detokenize_request(body: dict) -> DetokenizeRequest:
    """Parse a ``/detokenize`` body: ``{"tokens": [int, ...]}``."""
    if "tokens" not in body:
        raise ApiError(422, "field 'tokens' is required", param="tokens")
    return DetokenizeRequest(
        model=_opt_str(body, "model"), tokens=tuple(_int_list(body["tokens"], "tokens"))
    )


# generation_config.json's names of the sampling fields a served model may set defaults for
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def generation_config_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """The request defaults a ``generation_config.json`` sets (vLLM's ``--generation-config auto``);
    ValueError naming the field for a value no request could take."""
    defaults = {
        ours: config[theirs]
        for theirs, ours in GENERATION_CONFIG_FIELDS.items()
        if config.get(theirs) is not None
    }
    try:
        SamplingParams(**defaults)
    except (ParamError, TypeError) as e:
        raise ValueError(f"generation config: {e}") from None
    return defaults
