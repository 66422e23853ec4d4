"""Tool-call parsers: a model's text to OpenAI tool calls, one parser per model family's format, chosen
with ``--tool-call-parser`` (vLLM's names):

* ``hermes`` (Qwen2.5, Hermes, the embedded default): ``<tool_call>{"name": ..., "arguments": ...}
  </tool_call>``, any number, after optional content;
* ``llama3_json`` (Llama 3.1-3.3): the whole answer is ``{"name": ..., "parameters": ...}``, several
  joined by ``;``, optionally after ``<|python_tag|>``;
* ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name": ..., "arguments": ...}`` (v3 tokenizers),
  or ``[TOOL_CALLS]name[ARGS]{...}`` (v11 and later);
* ``required`` (``tool_choice: "required"``, any family): the grammar's JSON array of
  ``{"name": ..., "parameters": ...}``; ``named`` (a named ``tool_choice``): the whole answer is the
  function's arguments.

One reader serves the stream and the finished answer: :class:`ToolStream` takes the text as it grows
and gives out content and call deltas (a call's name as soon as it is known, then its arguments as
they are generated); a finished answer (:meth:`ToolParser.parse`) is what the stream of its whole text
gives, so a stream's argument fragments always join to the finished answer's ``arguments``. The
arguments are the model's own JSON text of them, as OpenAI's are.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field

_WS = " \t\r\n"


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class CallDelta:
    """A piece of a streamed call: its first carries the name (and ``arguments`` ""), the next ones
    the following fragments of the arguments."""

    index: int
    name: str | None
    arguments: str


@dataclass(frozen=True)
class Parsed:
    """What a finished answer holds: the content before the calls (None if none) and the calls."""

    content: str | None
    calls: list[ToolCall]


class CallJson:
    """One call's JSON read incrementally, a character at a time: an object with a ``name`` and the
    arguments under one of ``args_keys``, or (``name`` given: Mistral's ``name[ARGS]{...}``) the
    arguments object alone. Positions index the whole answer's text. It records where the arguments
    begin and end, so that what of them has been generated can go out before the call is complete."""

    def __init__(self, start: int, args_keys: tuple[str, ...], name: str | None = None) -> None:
        self.start = self.pos = start
        self.args_keys = args_keys
        self.bare = name is not None  # the JSON is the arguments themselves
        self.name = name
        self.top = 0 if self.bare else 1  # the depth of the object's own keys and values
        self.depth = 0
        self.in_str = self.escaped = False
        self.state = "value" if self.bare else "open"  # open, key, colon, value, scalar, after
        self.key: str | None = args_keys[0] if self.bare else None
        self.token = -1  # where the current top-level key or value began
        self.args_start = -1  # where an object or array of arguments began
        self.args: tuple[int, int] | None = None  # the arguments' span, once complete
        self.end = -1  # the position after the JSON, once complete
        self.bad = False  # not a JSON object after all

    def advance(self, text: str) -> None:
        """Read ``text`` (the answer so far) from where the last call stopped."""
        i, n = self.pos, len(text)
        while i < n and self.end < 0 and not self.bad:
            c = text[i]
            if self.in_str:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_str = False
                    if self.depth == self.top:
                        self._token_end(text, i + 1)
            elif self.state == "scalar":  # a number, true, false or null: ends at a delimiter
                if c in _WS or c in ",}]":
                    self._token_end(text, i)
                    continue  # the delimiter is read in the state after the value
            elif self.depth > self.top:  # inside a nested value: only strings and brackets count
                if c == '"':
                    self.in_str = True
                elif c in "{[":
                    self.depth += 1
                elif c in "}]":
                    self.depth -= 1
                    if self.depth == self.top:
                        self._token_end(text, i + 1)
            elif c not in _WS:
                self._top_level(c, i)
            i += 1
        self.pos = i

    def _top_level(self, c: str, i: int) -> None:
        state = self.state
        if state == "open" and c == "{":
            self.depth, self.state = 1, "key"
        elif state == "key" and c == '"':
            self.in_str, self.token = True, i
        elif state in ("key", "after") and c == "}":
            self.depth, self.end = 0, i + 1
        elif state == "colon" and c == ":":
            self.state = "value"
        elif state == "after" and c == ",":
            self.state = "key"
        elif state == "value" and (c == "{" or not self.bare):
            self.token = i
            if c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
                if self.key in self.args_keys and self.args is None and self.args_start < 0:
                    self.args_start = i
            elif c in "}],:":
                self.bad = True
            else:
                self.state = "scalar"
        else:
            self.bad = True

    def _token_end(self, text: str, end: int) -> None:
        raw = text[self.token : end]
        if self.state == "key":
            try:
                self.key = json.loads(raw)
            except json.JSONDecodeError:
                self.bad = True
            self.state = "colon"
            return
        if self.key == "name" and self.name is None:
            try:
                name = json.loads(raw)
            except json.JSONDecodeError:
                name = None
            self.name = name if isinstance(name, str) else None
        elif self.key in self.args_keys and self.args is None:
            self.args = (self.token, end)
        self.state = "after"
        if self.bare:
            self.end = end

    def arguments(self, text: str) -> str:
        """The arguments' text generated so far: an object or array as it grows (each answer's a
        prefix of the next), a string's decoded value once it closes (models that write the
        arguments as a JSON string), ``{}`` for a complete call without arguments."""
        if self.args is not None:
            raw = text[self.args[0] : self.args[1]]
            if raw.startswith('"'):
                try:
                    value = json.loads(raw)
                except json.JSONDecodeError:
                    return ""
                return value if isinstance(value, str) else raw
            return raw
        if self.args_start >= 0:
            return text[self.args_start : self.pos]
        return "{}" if self.end >= 0 and not self.bad else ""

    def complete(self, text: str) -> bool:
        """Whether the call's JSON is closed and valid."""
        if self.end < 0 or self.bad or self.name is None:
            return False
        try:
            json.loads(text[self.start : self.end])
        except json.JSONDecodeError:
            return False
        return True


@dataclass
class ToolStream:
    """One choice's answer read as it grows into content deltas and call deltas (see the module's
    docstring). Content goes out as it comes but for a suffix that may be the start of a call's
    marker; once a call's marker is seen no more content does, unless the answer ends without any
    call (then all of it is content, as :meth:`ToolParser.parse` reads it)."""

    parser: ToolParser
    state: str = "start"  # the parser's place in its format (ToolParser.frame)
    pos: int = 0  # how far the format has been read
    content_end: int = 0  # the text before this is content
    content_sent: int = 0
    marker_seen: bool = False  # a call's marker: no more content
    name: str = ""  # Mistral v11: the name before [ARGS]
    scans: list[CallJson] = field(default_factory=list)
    index: dict[int, int] = field(default_factory=dict)  # scan -> the call's index, once named
    sent: dict[int, int] = field(default_factory=dict)  # scan -> argument characters sent

    def feed(self, text: str, final: bool) -> tuple[str, list[CallDelta]]:
        """The content delta and the call deltas, given all the text so far (``final``: all of it)."""
        if self.scans and self.scans[-1].end < 0 and not self.scans[-1].bad:
            self.scans[-1].advance(text)
        self.parser.frame(self, text, final)
        deltas = []
        for k, scan in enumerate(self.scans):
            if scan.name is None:
                continue
            if k not in self.index:
                self.index[k], self.sent[k] = len(self.index), 0
                deltas.append(CallDelta(self.index[k], scan.name, ""))
            args = scan.arguments(text)
            if len(args) > self.sent[k]:
                deltas.append(CallDelta(self.index[k], None, args[self.sent[k] :]))
                self.sent[k] = len(args)
        end = len(text) if final and not self.index else self.content_end
        content = text[self.content_sent : end] if end > self.content_sent else ""
        self.content_sent = max(self.content_sent, end)
        return content, deltas

    # --- what the parsers' formats are made of ---------------------------------------------------
    def skip(self, text: str, chars: str = _WS) -> bool:
        """Move past ``chars``; whether any text is left."""
        while self.pos < len(text) and text[self.pos] in chars:
            self.pos += 1
        return self.pos < len(text)

    def opened(self, text: str, marker: str, final: bool) -> bool:
        """States ``start`` and ``content`` (before a call): find ``marker``, move past it and on to
        the next non-blank character in state ``open`` (True); until it is there (False), the text
        before it is content, but for a suffix that may be the marker's start. Other states: True."""
        if self.state in ("start", "content"):
            at = text.find(marker, self.pos)
            if at < 0:
                if not self.marker_seen:
                    self.content_end = len(text) if final else len(text) - _held(text, marker)
                # the marker cannot begin before this: the next search starts here
                self.pos = max(self.pos, len(text) - len(marker) + 1)
                return False
            if not self.marker_seen:
                self.content_end, self.marker_seen = at, True
            self.pos, self.state = at + len(marker), "open"
        return self.state != "open" or self.skip(text)

    def call(self, text: str, args_keys: tuple[str, ...], name: str | None = None) -> CallJson:
        """Start reading a call's JSON at the current position."""
        scan = CallJson(self.pos, args_keys, name)
        scan.advance(text)
        self.scans.append(scan)
        return scan

    def call_read(self) -> bool | None:
        """The last call: None while it is being read, False if it is not JSON, True once it is
        complete (then the position is past it)."""
        scan = self.scans[-1]
        if scan.bad:
            return False
        if scan.end < 0:
            return None
        self.pos = scan.end
        return True

    def named(self) -> bool:
        """Whether a call has a name (the stream has committed to calls)."""
        return any(scan.name is not None for scan in self.scans)

    def array(self, text: str, args_keys: tuple[str, ...]) -> bool:
        """Read a JSON array of calls (past its ``[``): whether it has ended."""
        while True:
            if self.state == "item":
                read = self.call_read()
                if read is None:
                    return False
                if not read:
                    return True  # not JSON: the array is over
                self.state = "items"
            if not self.skip(text, _WS + ","):
                return False
            if text[self.pos] != "{":
                self.pos += text[self.pos] == "]"
                return True
            self.call(text, args_keys)
            self.state = "item"


def _held(text: str, marker: str) -> int:
    """How many trailing characters of ``text`` may begin ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ToolParser:
    """Base: a family's format, read by :meth:`frame` into a :class:`ToolStream`."""

    name = ""
    keeps_special_tokens = False  # the marker is a special token the text must keep

    def frame(self, s: ToolStream, text: str, final: bool) -> None:
        """Read ``text`` from ``s.pos`` as far as the format can be read yet: mark content, start
        the calls' JSON (``s.call``), move ``s.state`` along."""
        raise NotImplementedError

    def parse(self, text: str) -> Parsed:
        """A finished answer's content and calls: what the stream of the whole text gives, less
        calls whose JSON did not close or is not valid (a stream cut by ``max_tokens`` may have sent
        their beginning); an answer without a complete call is all content."""
        s = ToolStream(self)
        content, _ = s.feed(text, True)
        calls = [
            ToolCall(scan.name, scan.arguments(text))
            for k, scan in enumerate(s.scans)
            if k in s.index and scan.complete(text) and scan.name is not None
        ]
        if not calls:
            return Parsed(text, [])
        return Parsed(content if content.strip() else None, calls)

    def new_id(self) -> str:
        return f"chatcmpl-tool-{secrets.token_hex(16)}"


class HermesParser(ToolParser):
    name = "hermes"

    def frame(self, s: ToolStream, text: str, final: bool) -> None:
        while True:
            if not s.opened(text, "<tool_call>", final):
                return
            if s.state == "open":
                if text[s.pos] == "{":
                    s.call(text, ("arguments",))
                s.state = "call" if text[s.pos] == "{" else "close"
            if s.state == "call":
                if s.call_read() is None:
                    return
                s.state = "close"
            at = text.find("</tool_call>", s.pos)  # state "close": past the call's end tag
            if at < 0:
                return
            s.pos, s.state = at + len("</tool_call>"), "content"


class Llama3JsonParser(ToolParser):
    """The answer is calls if its first JSON object is one (optionally after ``<|python_tag|>``);
    an answer whose first object has no name is content."""

    name = "llama3_json"
    _TAG = "<|python_tag|>"
    _ARGS = ("parameters", "arguments")

    def frame(self, s: ToolStream, text: str, final: bool) -> None:
        while True:
            if s.state == "start":
                if not s.skip(text):
                    return
                rest = text[s.pos :]
                if rest.startswith(self._TAG):
                    s.pos += len(self._TAG)
                elif self._TAG.startswith(rest) and not final:
                    return  # may be the tag's beginning
                s.state = "next" if rest.startswith((self._TAG, "{")) else "text"
            if s.state == "next":
                if not s.skip(text, _WS + ";"):
                    return
                if text[s.pos] != "{":
                    s.state = "end" if s.named() else "text"
                    continue
                s.call(text, self._ARGS)
                s.state = "call"
            if s.state == "call":
                read = s.call_read()
                if read is None:
                    return
                s.state = "next" if read and s.scans[-1].name is not None else "text"
                if s.state == "text" and s.named():
                    s.state = "end"  # calls went out already: the rest is ignored
                if s.state == "next":
                    continue
            if s.state == "text":
                s.content_end = len(text)
            return


class MistralParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True  # [TOOL_CALLS] is a control token
    _ARGS = ("arguments", "parameters")

    def frame(self, s: ToolStream, text: str, final: bool) -> None:
        while True:
            if not s.opened(text, "[TOOL_CALLS]", final):
                return
            if s.state == "open":
                first = text[s.pos]
                s.pos += first == "["
                s.state = "items" if first in "[{" else "name"
                s.name = ""
            if s.state in ("items", "item"):
                if not s.array(text, self._ARGS):
                    return
                s.state = "content"
                continue
            if s.state == "name":  # v11: name[ARGS]{...}
                at = text.find("[ARGS]", s.pos)
                if at < 0:
                    return
                s.name, s.pos, s.state = text[s.pos : at].strip(), at + len("[ARGS]"), "args"
            if s.state == "args":
                if not s.skip(text):
                    return
                if text[s.pos] == "{":
                    s.call(text, self._ARGS, name=s.name)
                s.state = "call" if text[s.pos] == "{" else "content"
            if s.state == "call":
                if s.call_read() is None:
                    return
                s.state = "content"

    def new_id(self) -> str:
        # Mistral's chat templates take only 9-character alphanumeric call ids back in the history.
        alphabet = string.ascii_letters + string.digits
        return "".join(secrets.choice(alphabet) for _ in range(9))


class RequiredParser(ToolParser):
    """``tool_choice: "required"``: the grammar made the answer a JSON array of
    ``{"name": ..., "parameters": ...}`` (vLLM's form), so every output is a call from its start."""

    name = "required"

    def frame(self, s: ToolStream, text: str, final: bool) -> None:
        if s.state == "start":
            if not s.skip(text):
                return
            if text[s.pos] != "[":
                s.state = "end"
                return
            s.pos, s.state, s.marker_seen = s.pos + 1, "items", True
        if s.state in ("items", "item") and s.array(text, ("parameters",)):
            s.state = "end"


class _WholeAnswer(CallJson):
    """A named function's call: the whole answer is its arguments, as the grammar wrote them."""

    def __init__(self, name: str) -> None:
        super().__init__(0, ("arguments",), name)

    def advance(self, text: str) -> None:
        self.pos = len(text)

    def arguments(self, text: str) -> str:
        return text

    def complete(self, text: str) -> bool:
        return True


class NamedParser(ToolParser):
    """A named ``tool_choice``: the grammar made the whole answer the function's arguments."""

    name = "named"

    def __init__(self, function: str) -> None:
        self.function = function

    def frame(self, s: ToolStream, text: str, final: bool) -> None:
        if not s.scans:
            s.scans.append(_WholeAnswer(self.function))


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)
}
