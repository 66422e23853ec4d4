"""Tool calling on the request side: ``tools`` and ``tool_choice`` checked, what the chat template is
given, and the grammar that enforces ``tool_choice: "required"`` or a named function.

* ``none``: the model answers in text (the tools are still rendered, as vLLM does);
* ``auto``: the model decides; the server's ``--tool-call-parser`` reads calls out of its text (vLLM
  requires ``--enable-auto-tool-choice`` for this, and so does plaserve);
* ``required``: the grammar makes the answer a JSON array of ``{"name", "parameters"}`` objects, one
  per call, each function's parameters its own schema (vLLM's form; any parser, or none);
* a named function: the grammar makes the answer that function's arguments.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from plaserve.grammar import GrammarError, check
from plaserve.request import StructuredOutputs
from plaserve.server.errors import ApiError
from plaserve.server.tool_parsers import (
    CallDelta,
    NamedParser,
    RequiredParser,
    ToolCall,
    ToolParser,
)

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class Tools:
    """A chat request's tools: the functions as the chat template gets them, and the choice."""

    tools: tuple[dict[str, Any], ...]  # [{"type": "function", "function": {...}}, ...]
    choice: str  # "none", "auto", "required", or "function" (named: see ``name``)
    name: str | None = None  # the named function
    parallel: bool = True  # OpenAI's parallel_tool_calls: false allows one call at most

    def function(self, name: str) -> dict[str, Any] | None:
        return next((t["function"] for t in self.tools if t["function"]["name"] == name), None)

    def structured(self) -> StructuredOutputs | None:
        """The grammar of ``required`` or a named function; None for ``none`` and ``auto``."""
        if self.choice == "function":
            fn = self.function(self.name or "")
            assert fn is not None
            return StructuredOutputs(json=json.dumps(fn.get("parameters") or ANY_OBJECT))
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "parameters": t["function"].get("parameters") or ANY_OBJECT,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputs(json=json.dumps(array))


def _bad(param: str, message: str, status: int = 400) -> ApiError:
    return ApiError(status, message, param=param)


def _function(value: Any, param: str) -> dict[str, Any]:
    """One function definition, checked: a name, an optional description, parameters that compile."""
    if not isinstance(value, dict):
        raise _bad(param, f"{param} must be an object", 422)
    name = value.get("name")
    if not isinstance(name, str) or not name:
        raise _bad(f"{param}.name", f"{param}.name must be a non-empty string")
    if "description" in value and not isinstance(value["description"], (str, type(None))):
        raise _bad(f"{param}.description", f"{param}.description must be a string", 422)
    params = value.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise _bad(
                f"{param}.parameters", f"{param}.parameters must be a JSON schema object", 422
            )
        try:
            check(StructuredOutputs(json=json.dumps(params)), param=f"{param}.parameters")
        except GrammarError as e:
            raise _bad(e.param, f"function '{name}': {e}") from None
    return {k: v for k, v in value.items() if k in ("name", "description", "parameters", "strict")}


def _parse_tool_list(body: dict) -> tuple[dict[str, Any], ...]:
    tools: list[dict[str, Any]] = []
    value = body.get("tools")
    if value is not None:
        if not isinstance(value, list):
            raise _bad("tools", "tools must be an array", 422)
        for i, tool in enumerate(value):
            if not isinstance(tool, dict) or tool.get("type", "function") != "function":
                raise _bad(f"tools[{i}]", f"tools[{i}] must be an object of type 'function'")
            tools.append(
                {
                    "type": "function",
                    "function": _function(tool.get("function"), f"tools[{i}].function"),
                }
            )
    legacy = body.get("functions")  # OpenAI's older form: the function objects themselves
    if legacy is not None:
        if not isinstance(legacy, list):
            raise _bad("functions", "functions must be an array", 422)
        for i, fn in enumerate(legacy):
            tools.append({"type": "function", "function": _function(fn, f"functions[{i}]")})
    names = [t["function"]["name"] for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise _bad("tools", f"two tools are named '{dup}'")
    return tuple(tools)


def parse_tools(body: dict) -> Tools | None:
    """The request's tools and tool choice (None: no tools and no choice but ``none``). A choice
    without tools, a named function that is not among them, or a bad definition is a 400 naming the
    field."""
    tools = _parse_tool_list(body)
    names = [t["function"]["name"] for t in tools]
    param = "tool_choice" if body.get("tool_choice") is not None else "function_call"
    choice = body.get("tool_choice", body.get("function_call"))
    if choice is None:
        choice = "auto" if tools else "none"
    name = None
    if isinstance(choice, dict):
        fn = choice.get("function") if param == "tool_choice" else choice
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise _bad(param, f'{param} must be "none", "auto", "required" or a function by name')
        choice = "function"
    elif choice not in ("none", "auto", "required"):
        raise _bad(param, f'{param} must be "none", "auto", "required" or a function by name')
    if not tools:
        if choice == "none":
            return None
        raise _bad(param, f"{param} {choice!r} needs tools: the request has none")
    if name is not None and name not in names:
        raise _bad(
            param,
            f"{param} names the function '{name}', which is not among the tools "
            f"({', '.join(names)})",
        )
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise _bad("parallel_tool_calls", "parallel_tool_calls must be a boolean", 422)
    return Tools(tools, choice, name, parallel is not False)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history as chat templates read it: an assistant's tool-call ``arguments`` as objects (the
    API sends JSON text; Hermes, Llama 3 and Mistral templates print them with ``tojson``), as vLLM
    passes them."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for c in calls:
                fn = dict(c.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"])
                    except json.JSONDecodeError:
                        pass  # the template gets the text as it came
                fixed.append({**c, "function": fn})
            m = {**m, "tool_calls": fixed}
        out.append(m)
    return out


def output_parser(tools: Tools | None, auto: ToolParser | None) -> ToolParser | None:
    """What reads a choice's tool calls: the grammar's form for ``required`` and named functions, the
    server's ``--tool-call-parser`` for ``auto``; None when the answer is text only."""
    if tools is None or tools.choice == "none":
        return None
    if tools.choice == "required":
        return RequiredParser()
    if tools.choice == "function":
        return NamedParser(tools.name or "")
    return auto


def call_json(parser: ToolParser, calls: list[ToolCall]) -> list[dict]:
    """A finished answer's calls in OpenAI's shape."""
    return [
        {
            "id": parser.new_id(),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments},
        }
        for c in calls
    ]


def delta_json(parser: ToolParser, delta: CallDelta) -> dict[str, Any]:
    """A stream's ``delta`` of one call piece, in OpenAI's shape: the call's first carries its
    ``id``, ``type`` and name (and ``arguments`` ""), the next ones the arguments' next fragment."""
    if delta.name is not None:
        return {
            "tool_calls": [
                {
                    "index": delta.index,
                    "id": parser.new_id(),
                    "type": "function",
                    "function": {"name": delta.name, "arguments": ""},
                }
            ]
        }
    return {"tool_calls": [{"index": delta.index, "function": {"arguments": delta.arguments}}]}


def finish_reason(parser: ToolParser, called: bool, reason: str | None) -> str | None:
    """OpenAI's: ``tool_calls`` when the model chose to call (``auto``, ``required``); a named
    function's call ends with ``stop``, as OpenAI's forced calls do."""
    if called and reason == "stop" and not isinstance(parser, NamedParser):
        return "tool_calls"
    return reason


def tool_message(parser: ToolParser, text: str, reason: str | None) -> tuple[dict, str | None]:
    """A finished choice's assistant message (content and tool calls) and its finish reason."""
    parsed = parser.parse(text)
    if not parsed.calls:
        return {"role": "assistant", "content": text}, reason
    message = {
        "role": "assistant",
        "content": parsed.content,
        "tool_calls": call_json(parser, parsed.calls),
    }
    return message, finish_reason(parser, True, reason)
