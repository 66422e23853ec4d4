"""The conversations of the two other chat APIs as chat messages: OpenAI's Responses API
(``instructions`` and ``input``) and Anthropic's Messages API (``system`` and ``messages``).

The server reads such a request into the chat request it means (:mod:`plaserve.server.openai_responses`,
:mod:`plaserve.server.anthropic_messages`) and the router prices it as that conversation
(:mod:`plaserve.router.length`): both read it here, the server answering an :class:`InputError` with
its status, the router leaving such a body to the worker.
"""

from __future__ import annotations

import json
from typing import Any

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")


class InputError(ValueError):
    """A conversation that cannot be read: the HTTP ``status`` it is (400 or 422) and the field."""

    def __init__(self, message: str, param: str, status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InputError(f"{where}.{key} must be a string", f"{where}.{key}", 422)
    return value


def _text_of(content: Any, where: str, kinds: tuple[str, ...] = TEXT_PARTS) -> str:
    """Content that is a string, or text parts (of ``kinds``) joined; any other part is a 400."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InputError(f"{where} must be a string or an array of text parts", where, 422)
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise InputError(
                f"{where}[{i}]: only text is supported here, got a part of type {kind!r}",
                f"{where}[{i}]",
            )
        texts.append(_string(part, "text", f"{where}[{i}]"))
    return "".join(texts)


def responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A Responses request's ``instructions`` (a system message) and ``input`` (a string: one user
    message; or message items) as chat messages."""
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InputError("field 'instructions' must be a string", "instructions", 422)
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list):
        raise InputError("field 'input' must be a string or an array of items", "input", 422)
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InputError(f"{where} must be an object", "input", 422)
        kind = item.get("type", "message")
        if kind == "function_call":  # an earlier answer's call: the assistant's tool call
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            last = messages[-1] if messages else {}
            if last.get("role") == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)  # calls made together: one assistant turn
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            continue
        if kind == "function_call_output":  # its result
            output = item.get("output")
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where),
                    "content": _text_of(output, f"{where}.output"),
                }
            )
            continue
        if kind != "message":
            raise InputError(f"{where}: items of type {kind!r} are not supported", where)
        role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise InputError(
                f"{where}.role must be one of {sorted(ROLES)}, got {item.get('role')!r}", where
            )
        messages.append(
            {"role": role, "content": _text_of(item.get("content"), f"{where}.content")}
        )
    return messages


# --- Anthropic's Messages API ------------------------------------------------------------------


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A ``tool_use`` block as chat's tool call (its ``input`` as JSON arguments)."""
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise InputError(f"{where}.input must be an object", f"{where}.input", 422)
    return {
        "id": _string(block, "id", where),
        "type": "function",
        "function": {"name": _string(block, "name", where), "arguments": json.dumps(arguments)},
    }


def _anthropic_message(message: Any, where: str) -> list[dict[str, Any]]:
    """One Messages API message as chat messages: its tool results first (``tool`` messages), then
    its text and calls. An earlier answer's ``thinking`` blocks are left out."""
    if not isinstance(message, dict):
        raise InputError(f"{where} must be an object", where, 422)
    role = message.get("role")
    if role not in ("user", "assistant", "system"):
        raise InputError(f"{where}.role must be 'user' or 'assistant', got {role!r}", where)
    content = message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InputError(f"{where}.content must be a string or an array of blocks", where, 422)
    results, texts, calls = [], [], []
    for i, block in enumerate(content):
        at = f"{where}.content[{i}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_string(block, "text", at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and role == "user":
            output = _text_of(block.get("content", ""), f"{at}.content", ("text",))
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(block, "tool_use_id", at),
                    "content": output,
                }
            )
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # reasoning a model wrote before: plaserve's models neither write nor read it
        else:
            raise InputError(
                f"{at}: blocks of type {kind!r} are not supported in a {role} message", at
            )
    out = list(results)
    if calls:
        # no text: null content, as OpenAI's clients send a call-only turn (and vLLM reads it)
        out.append({"role": role, "content": "".join(texts) or None, "tool_calls": calls})
    elif texts or not results:
        out.append({"role": role, "content": "".join(texts)})
    return out


def anthropic_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A Messages request's ``system`` (a string or text blocks: a system message) and ``messages``
    (content a string or blocks: ``text``, ``tool_use``, ``tool_result``) as chat messages."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InputError("field 'messages' must be a non-empty array", "messages", 422)
    out = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": _text_of(body["system"], "system", ("text",))})
    for i, message in enumerate(messages):
        out += _anthropic_message(message, f"messages[{i}]")
    return out
