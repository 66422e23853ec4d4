"""The Responses API's conversation (``instructions`` and ``input``) as chat messages.

The server reads a ``/v1/responses`` request into the chat request it means
(:mod:`plaserve.server.openai_responses`) and the router prices it as that conversation
(:mod:`plaserve.router.length`): both read it here, the server answering an :class:`InputError` with
its status, the router leaving such a body to the worker.
"""

from __future__ import annotations

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


def _text_of(content: Any, where: str) -> str:
    """A message's content: a string, or text parts joined (other parts are a 400)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InputError(f"{where}.content must be a string or an array of parts", where, 422)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InputError(
                f"{where}: only text content is supported, got a part of type {kind!r}", where
            )
        texts.append(part["text"])
    return "".join(texts)


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``instructions`` (a system message) and ``input`` (a string: one user message; or message
    items) as chat messages."""
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
        messages.append({"role": role, "content": _text_of(item.get("content"), where)})
    return messages
