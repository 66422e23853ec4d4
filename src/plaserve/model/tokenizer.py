"""Tokenizers: Hugging Face ``tokenizer.json`` checkpoints and a built-in byte-level one.

The serving stack talks to one small interface, :class:`Tokenizer`. Two implementations:

* :class:`HFTokenizer` reads a Hugging Face checkpoint directory with the ``tokenizers``
  library only (no ``transformers`` at serve time) and renders chat templates with a
  sandboxed jinja2 environment configured like ``transformers`` does.
* :class:`ByteTokenizer` needs no files; it backs the embedded default model.

Convention for chat: a rendered chat template already contains whatever special tokens the
model expects (e.g. ``{{ bos_token }}``), so chat prompts are encoded with
``add_special_tokens=False``; plain completion prompts use ``add_special_tokens=True``.

:class:`IncrementalDetokenizer` turns a stream of generated ids into text deltas that never
end inside a multi-byte UTF-8 character, for streaming responses and stop strings.
"""

from __future__ import annotations

import json
import os
import re
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

REPLACEMENT_CHAR = "\ufffd"


class Tokenizer:
    """Interface every tokenizer in plaserve implements.

    Subclasses set :attr:`vocab_size`, :attr:`bos_token_id`, :attr:`eos_token_ids`,
    :attr:`bos_token`, :attr:`eos_token` and :attr:`chat_template`, and implement
    :meth:`encode` and :meth:`decode`.
    """

    #: Number of ids the tokenizer can produce (including added/special tokens). The model's
    #: embedding table may be larger (padded); it is never smaller.
    vocab_size: int
    bos_token_id: int | None
    #: Every id that ends generation (tokenizer eos plus generation/model config eos ids).
    eos_token_ids: list[int]
    bos_token: str | None = None
    eos_token: str | None = None
    chat_template: str | None = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; ``add_special_tokens`` adds e.g. the leading BOS."""
        raise NotImplementedError

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text for ``ids``; ``skip_special_tokens`` drops BOS/EOS/chat markers."""
        raise NotImplementedError

    @property
    def has_chat_template(self) -> bool:
        """Whether :meth:`apply_chat_template` can be used."""
        return bool(self.chat_template)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template_vars: Any,
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}, ...]) with the chat template.

        Extra keyword arguments (e.g. ``tools``) are passed to the template as variables,
        as ``transformers`` does. Raises ``ValueError`` if there is no chat template and
        ``jinja2.TemplateError`` if the template rejects the conversation.
        """
        if not self.chat_template:
            raise ValueError(
                f"{type(self).__name__} has no chat template; use a plain completion prompt "
                "or a checkpoint whose tokenizer_config.json / chat_template.jinja defines one"
            )
        template = _compile_chat_template(self.chat_template)
        # Same variables transformers provides: special-token strings, then tools/documents
        # always defined (None when unused), then caller overrides.
        context: dict[str, Any] = dict(self.special_token_strings())
        context.update(tools=None, documents=None)
        context.update(template_vars)
        # transformers drops None-valued message fields, so `message.x is defined` agrees.
        context["messages"] = [{k: v for k, v in m.items() if v is not None} for m in messages]
        context["add_generation_prompt"] = add_generation_prompt
        return template.render(**context)

    def special_token_strings(self) -> dict[str, str]:
        """Special-token strings exposed to chat templates (``bos_token``, ``eos_token``, ...)."""
        out = {"bos_token": self.bos_token, "eos_token": self.eos_token}
        return {k: v for k, v in out.items() if v is not None}


# --------------------------------------------------------------------------------------
# Chat template rendering
# --------------------------------------------------------------------------------------


def _raise_exception(message: str) -> None:
    # Hugging Face templates call this to reject conversations they cannot format.
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's built-in tojson HTML-escapes '<', '>' and '&'; templates expect plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_TEMPLATE_CACHE: dict[str, jinja2.Template] = {}


def _compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template the way ``transformers`` does, so output matches byte for byte.

    Templates come from downloaded checkpoints and are untrusted, hence the immutable sandbox.
    ``trim_blocks``/``lstrip_blocks`` and ``loopcontrols`` are what Hub templates are written
    against.
    """
    template = _TEMPLATE_CACHE.get(source)
    if template is None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        template = env.from_string(source)
        _TEMPLATE_CACHE[source] = template
    return template


# --------------------------------------------------------------------------------------
# Hugging Face tokenizer.json
# --------------------------------------------------------------------------------------


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _token_content(token: Any) -> str | None:
    """Special tokens in tokenizer_config.json are strings or AddedToken dicts."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if v is not None]


def _select_chat_template(value: Any) -> str | None:
    """``chat_template`` is a string, or a list of {"name", "template"} (take "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        default = named.get("default")
        return default if isinstance(default, str) else None
    return None


# Named special tokens that transformers passes to chat templates.
_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class HFTokenizer(Tokenizer):
    """A Hugging Face fast tokenizer read from a checkpoint directory.

    Files used (all in ``path``):

    * ``tokenizer.json`` (required): vocabulary, normalizer, pre-tokenizer, post-processor.
    * ``tokenizer_config.json``: bos/eos tokens, ``add_bos_token``/``add_eos_token``,
      ``chat_template`` (string or list of named templates).
    * ``chat_template.jinja``: the chat template as saved by current ``transformers``;
      preferred over the one in ``tokenizer_config.json`` when both exist, as
      ``transformers`` does.
    * ``generation_config.json`` and ``config.json``: extra eos ids (instruct models often
      list several, e.g. end-of-turn and end-of-text).

    Special tokens: as in ``transformers``, the post-processor in ``tokenizer.json`` decides
    what ``add_special_tokens=True`` adds. ``add_bos_token``/``add_eos_token`` are only
    consulted when ``tokenizer.json`` has no post-processor. There we deliberately differ
    from ``transformers`` 5.x, which then ignores the flags and adds nothing; 4.x honoured
    them, and an explicit flag says how the model was trained.
    """

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        tokenizer_file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tokenizer_file):
            raise FileNotFoundError(f"no tokenizer.json in {path!r}")
        self.path = path
        self._tok = _RustTokenizer.from_file(tokenizer_file)
        config = _read_json(os.path.join(path, "tokenizer_config.json"))

        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self._special_strings = {
            name: content
            for name in _SPECIAL_TOKEN_NAMES
            if (content := _token_content(config.get(name))) is not None
        }
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None

        eos_ids = _as_id_list(eos_id)
        for extra in ("generation_config.json", "config.json"):
            eos_ids += _as_id_list(_read_json(os.path.join(path, extra)).get("eos_token_id"))
        # Order-preserving dedupe: the tokenizer's own eos first.
        self.eos_token_ids = list(dict.fromkeys(eos_ids))

        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

        # Only without a post-processor do the add_*_token flags matter (see class docstring).
        self._manual_bos = False
        self._manual_eos = False
        if self._tok.post_processor is None:
            self._manual_bos = (
                bool(config.get("add_bos_token", False)) and self.bos_token_id is not None
            )
            self._manual_eos = bool(config.get("add_eos_token", False)) and eos_id is not None
        self._eos_id = eos_id

        # transformers skips this cleanup for BPE because it corrupts spacing; mirror that.
        model_type = type(self._tok.model).__name__
        self._clean_up_spaces = (
            bool(config.get("clean_up_tokenization_spaces", False)) and model_type != "BPE"
        )

        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                self.chat_template = f.read()
        else:
            self.chat_template = _select_chat_template(config.get("chat_template"))

    def special_token_strings(self) -> dict[str, str]:
        """All named special tokens from tokenizer_config.json, as transformers exposes them."""
        return dict(self._special_strings)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; matches ``AutoTokenizer(path)(text)["input_ids"]``."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self._manual_bos:
                ids = [self.bos_token_id, *ids]  # type: ignore[list-item]
            if self._manual_eos:
                ids = [*ids, self._eos_id]  # type: ignore[list-item]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text for ``ids``; matches ``AutoTokenizer.decode`` with the same flag."""
        text = self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up_spaces:
            text = _clean_up_tokenization(text)
        return text

    def to_json_str(self) -> str:
        """The ``tokenizer.json`` this tokenizer was read from, serialised (the grammar engine builds
        its token index from it)."""
        return self._tok.to_str()

    def token_to_id(self, token: str) -> int | None:
        """Id of a token string (e.g. ``"<|im_end|>"``), or None if unknown."""
        return self._tok.token_to_id(token)


def _clean_up_tokenization(text: str) -> str:
    # Same replacements as transformers' clean_up_tokenization (WordPiece-era spacing fixes).
    for before, after in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(before, after)
    return text


# --------------------------------------------------------------------------------------
# Byte-level tokenizer for the embedded default model
# --------------------------------------------------------------------------------------

# ChatML as Qwen2.5 writes it, tools included (Hermes-style: the functions listed in the system turn,
# calls as <tool_call>{"name": ..., "arguments": ...}</tool_call>, results as <tool_response> in a user
# turn), so `--tool-call-parser hermes` reads the embedded model's calls; without Qwen's default
# system prompt, and after the byte model's bos.
_BYTE_CHAT_TEMPLATE = """{{- bos_token }}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" + tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and " }}
    {{- "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n" }}
    {{- '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == 'system' and loop.first %}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '<|im_start|>assistant' }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for call in message.tool_calls %}
            {%- set call = call.function if call.function is defined else call %}
            {{- '\n<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
            {{- call.arguments | tojson + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + message.content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens, plus a few ChatML-style special tokens. Needs no files.

    Ids 0..255 are raw bytes; 256..260 are the special tokens below; 261..511 are reserved
    (so the embedded model's vocabulary has room to grow) and decode to nothing.
    """

    BOS, EOS, PAD, IM_START, IM_END = 256, 257, 258, 259, 260
    SPECIAL_TOKENS: dict[str, int] = {
        "<|bos|>": BOS,
        "<|eos|>": EOS,
        "<|pad|>": PAD,
        "<|im_start|>": IM_START,
        "<|im_end|>": IM_END,
    }
    _ID_TO_SPECIAL: dict[int, str] = {v: k for k, v in SPECIAL_TOKENS.items()}
    _SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")

    def __init__(self) -> None:
        self.vocab_size = 512
        self.bos_token = "<|bos|>"
        self.eos_token = "<|eos|>"
        self.bos_token_id = self.BOS
        # End of a chat turn also ends generation, so chat works with the default model.
        self.eos_token_ids = [self.EOS, self.IM_END]
        self.chat_template = _BYTE_CHAT_TEMPLATE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """UTF-8 bytes of ``text``; special-token strings in the text become their ids."""
        ids: list[int] = [self.BOS] if add_special_tokens else []
        # Splitting on the special strings lets a rendered chat template round-trip.
        for piece in self._SPECIAL_SPLIT.split(text):
            special = self.SPECIAL_TOKENS.get(piece)
            if special is not None:
                ids.append(special)
            elif piece:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text for ``ids``; invalid UTF-8 becomes U+FFFD, reserved ids are dropped."""
        out = bytearray()
        for i in ids:
            if 0 <= i < 256:
                out.append(i)
            elif not skip_special_tokens and i in self._ID_TO_SPECIAL:
                out.extend(self._ID_TO_SPECIAL[i].encode("utf-8"))
        return bytes(out).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------------------
# Streaming detokenization
# --------------------------------------------------------------------------------------


class IncrementalDetokenizer:
    """Turns generated ids, one at a time, into text deltas.

    Decoding ids one by one is wrong for byte-level vocabularies (a character may span
    several tokens) and for SentencePiece (a token's leading space depends on context). So
    each step decodes a short window of recent ids twice, with and without the new ones, and
    emits the difference. The window only moves past text that is complete: while the
    decoded text ends in U+FFFD (an unfinished UTF-8 sequence) nothing is emitted.

    ``prompt_ids`` optionally seeds the window with the end of the prompt so the first
    generated token decodes with its real left context (e.g. keeps its leading space).
    """

    # How many prompt tokens give enough left context for any tokenizer's decoder.
    _PROMPT_CONTEXT = 6

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        prompt_ids: list[int] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-self._PROMPT_CONTEXT :]) if prompt_ids else []
        # ids[_prefix:_read] is already-emitted text used as context; ids[_read:] is pending.
        self._prefix = 0
        self._read = len(self._ids)
        self._text = ""

    @property
    def text(self) -> str:
        """All text emitted so far (excluding anything still held back)."""
        return self._text

    def add(self, token_id: int) -> str:
        """Append one generated id; return the newly completed text (may be empty)."""
        self._ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self._ids[self._prefix : self._read], self.skip_special_tokens)
        full_text = decode(self._ids[self._prefix :], self.skip_special_tokens)
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            # Nothing visible yet, or the last character is still incomplete: hold back.
            return ""
        delta = full_text[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(self._ids)
        self._text += delta
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (at the end of generation), U+FFFD included."""
        decode = self.tokenizer.decode
        prefix_text = decode(self._ids[self._prefix : self._read], self.skip_special_tokens)
        full_text = decode(self._ids[self._prefix :], self.skip_special_tokens)
        delta = full_text[len(prefix_text) :] if len(full_text) > len(prefix_text) else ""
        self._prefix = self._read
        self._read = len(self._ids)
        self._text += delta
        return delta


def load_tokenizer(path: str | None) -> Tokenizer:
    """The checkpoint's tokenizer, or the built-in :class:`ByteTokenizer` when ``path`` is None."""
    if path is None:
        return ByteTokenizer()
    return HFTokenizer(path)
