"""Tool-call parsers: a model's text to OpenAI tool calls, one parser per model family's format, chosen
with ``--tool-call-parser`` (vLLM's names):

* ``hermes`` (Qwen2.5, Hermes, the embedded default): ``<tool_call>{"name": ..., "arguments": ...}
  </tool_call>``, any number, after optional content;
* ``llama3_json`` (Llama 3.1-3.3): the whole answer is ``{"name": ..., "parameters": ...}``, several
  joined by ``;``, optionally after ``<|python_tag|>``;
* ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": ...}`` (v3 tokenizers),
  or ``[TOOL_CALLS]name[ARGS]{...}`` (v11 and later).

A parser reads the text generated so far; ``final`` says the text is complete. Before that it returns
only the calls whose text is closed, so a stream sends each call once, whole.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class Parsed:
    """What a parser found: the content before the calls (None if none), the calls, and whether the
    text is in tool-call mode (a call has begun: a stream sends no more content)."""

    content: str | None
    calls: list[ToolCall]
    in_call: bool


def _call(obj: Any, args_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from a decoded ``{"name": ..., <args key>: {...}}``; None for anything else."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


def _json_values(text: str) -> tuple[list[Any], str]:
    """The JSON values at the start of ``text`` (separated by ``;``, ``,`` or whitespace) and what is
    left after the last complete one."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return values, text[pos:]
        values.append(value)


class ToolParser:
    """Base: ``markers`` open a call in the text (a stream holds back text that may be one)."""

    name = ""
    markers: tuple[str, ...] = ()
    keeps_special_tokens = False  # the marker is a special token the text must keep

    def parse(self, text: str, final: bool) -> Parsed:
        raise NotImplementedError

    def new_id(self) -> str:
        return f"chatcmpl-tool-{secrets.token_hex(16)}"

    @staticmethod
    def _content(text: str) -> str | None:
        return text if text.strip() else None


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find("<tool_call>")
        if at < 0:
            return Parsed(text, [], False)
        calls = []
        for body in self._CALL.findall(text):
            calls += [c for v in _json_values(body)[0] if (c := _call(v, ("arguments",)))]
        tail = text[text.rfind("</tool_call>") + 1 :] if "</tool_call>" in text else text[at:]
        if final and "<tool_call>" in tail:  # an unclosed last call: take it if it parses
            body = tail[tail.find("<tool_call>") + len("<tool_call>") :]
            calls += [c for v in _json_values(body)[0] if (c := _call(v, ("arguments",)))]
        return Parsed(self._content(text[:at]), calls, True)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    keeps_special_tokens = False  # <|python_tag|> is optional: the JSON alone says it is a call
    _ARGS = ("parameters", "arguments")

    def parse(self, text: str, final: bool) -> Parsed:
        stripped = text.lstrip()
        body = stripped.removeprefix("<|python_tag|>").lstrip()
        if not body.startswith("{"):
            if body == "" and stripped.startswith("<|python_tag|>") and not final:
                return Parsed(None, [], True)  # the tag opened a call; its JSON is yet to come
            return Parsed(text, [], False)
        values, rest = _json_values(body)
        calls = [c for v in values if (c := _call(v, self._ARGS))]
        if final and (len(calls) != len(values) or not calls):
            return Parsed(text, [], False)  # not tool calls after all: plain JSON content
        return Parsed(None, calls, True)


class MistralParser(ToolParser):
    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    keeps_special_tokens = True  # [TOOL_CALLS] is a control token

    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find("[TOOL_CALLS]")
        if at < 0:
            return Parsed(text, [], False)
        body, calls = text[at + len("[TOOL_CALLS]") :], []
        for part in body.split("[TOOL_CALLS]"):
            if "[ARGS]" in part:  # v11: name[ARGS]{...}
                name, _, args = part.partition("[ARGS]")
                values, _ = _json_values(args)
                if values:
                    calls.append(ToolCall(name.strip(), json.dumps(values[0])))
                continue
            values, _ = _json_values(part)
            for v in values:
                for item in v if isinstance(v, list) else [v]:
                    if call := _call(item, ("arguments", "parameters")):
                        calls.append(call)
        return Parsed(self._content(text[:at]), calls, True)

    def new_id(self) -> str:
        # Mistral's chat templates take only 9-character alphanumeric call ids back in the history.
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))


class RequiredParser(ToolParser):
    """``tool_choice: "required"``: the grammar made the answer a JSON array of
    ``{"name": ..., "parameters": ...}`` (vLLM's form), so every output is a call from its start."""

    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        values, _ = _json_values(text)
        items = values[0] if values and isinstance(values[0], list) else []
        return Parsed(None, [c for v in items if (c := _call(v, ("parameters",)))], True)


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}


def parse_final(parser: ToolParser, text: str) -> Parsed:
    """The calls of a finished answer; an answer whose call does not parse is content after all."""
    parsed = parser.parse(text, final=True)
    return parsed if parsed.calls or not parsed.in_call else Parsed(text, [], False)


class ToolStream:
    """One streamed choice's text turned into content deltas and whole tool calls: content goes out
    as it comes, but for a suffix that may be the start of a call's marker; once a call has begun,
    each call goes out once its text is closed."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.sent = 0  # characters of content sent
        self.calls_sent = 0

    def _held(self, text: str) -> int:
        """How many trailing characters of ``text`` may begin a marker."""
        for n in range(
            min(len(text), max((len(m) for m in self.parser.markers), default=0)), 0, -1
        ):
            if any(m.startswith(text[-n:]) and m != text[-n:] for m in self.parser.markers):
                return n
        return 0

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """The content delta and the newly complete calls, given all the text so far."""
        parsed = parse_final(self.parser, text) if final else self.parser.parse(text, False)
        if not parsed.in_call:
            end = len(text) if final else len(text) - self._held(text)
            delta, self.sent = text[self.sent : end], max(self.sent, end)
            return delta, []
        content = parsed.content or ""
        delta, self.sent = content[self.sent :], max(self.sent, len(content))
        new = parsed.calls[self.calls_sent :]
        self.calls_sent = len(parsed.calls)
        return delta, new
