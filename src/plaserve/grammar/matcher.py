"""The tokenizer index llguidance computes masks over, and one matcher per constrained request."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import llguidance

from plaserve.grammar.compile import GrammarError, check
from plaserve.model.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from plaserve.request import StructuredOutputs

log = logging.getLogger(__name__)


class _ByteVocab:
    """:class:`ByteTokenizer` in the shape ``llguidance.TokenizerWrapper`` reads: each id's bytes
    (specials and reserved ids marked special, so no text can produce them)."""

    def __init__(self, tokenizer: ByteTokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        specials = {i: s.encode() for s, i in tokenizer.SPECIAL_TOKENS.items()}
        self.tokens = [bytes([i]) if i < 256 else specials.get(i, b"") for i in range(vocab_size)]
        self.special_token_ids = list(range(256, vocab_size))
        self.eos_token_id = tokenizer.EOS
        self.bos_token_id = tokenizer.BOS

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode(text, add_special_tokens=False)


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte-to-character map, by which byte-level BPE vocabularies spell bytes."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return {b: chr(b if b in printable else next(extra)) for b in range(256)}


def _uses_byte_level(node: Any) -> bool:
    if not isinstance(node, dict):
        return False
    if node.get("type") == "ByteLevel":
        return True
    return any(_uses_byte_level(n) for n in node.get("decoders", []) or [])


def llguidance_json(tokenizer_json: str) -> str:
    """``tokenizer.json`` as llguidance should read it. llguidance takes every added token for a
    special one (text can never produce it), but models mark some as plain text, such as Qwen2.5's
    ``<tool_call>`` tags, which a grammar must be able to produce; those move into the model's
    vocabulary, spelled as the vocabulary spells text."""
    data = json.loads(tokenizer_json)
    vocab = data.get("model", {}).get("vocab")
    if not isinstance(vocab, dict):
        return tokenizer_json
    alphabet = _byte_level_alphabet() if _uses_byte_level(data.get("decoder")) else None
    kept = []
    for token in data.get("added_tokens", []):
        if token.get("special", True):
            kept.append(token)
            continue
        text = token["content"]
        if alphabet is not None:
            text = "".join(alphabet[b] for b in text.encode("utf-8"))
        vocab[text] = token["id"]
    data["added_tokens"] = kept
    return json.dumps(data)


def ll_tokenizer(
    tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]
) -> llguidance.LLTokenizer:
    """llguidance's index of ``tokenizer`` over the model's ``vocab_size`` logits (ids past the
    tokenizer's are never allowed). Building it walks the whole vocabulary: ~0.3 s for 32k ids."""
    eos = [t for t in eos_token_ids if 0 <= t < vocab_size]
    if isinstance(tokenizer, HFTokenizer):
        source: str | llguidance.TokenizerWrapper = llguidance_json(tokenizer.to_json_str())
    elif isinstance(tokenizer, ByteTokenizer):
        source = llguidance.TokenizerWrapper(_ByteVocab(tokenizer, vocab_size))
    else:
        raise GrammarError(f"structured outputs do not support {type(tokenizer).__name__}")
    return llguidance.LLTokenizer(source, n_vocab=vocab_size, eos_token=eos or None)


class Matcher:
    """One request's place in its grammar: the mask of the tokens allowed next, advanced with each
    sampled token. Only the engine thread and the mask worker it waits for touch it."""

    def __init__(self, inner: llguidance.LLMatcher, vocab_size: int) -> None:
        self.inner = inner
        self.vocab_size = vocab_size  # the model's logits: one mask bit each

    def accept(self, token: int) -> bool:
        """Advance past ``token``; False when the grammar does not allow it (then the matcher is in
        an error state for good)."""
        return self.inner.consume_token(token)

    @property
    def stopped(self) -> bool:
        """Whether the grammar is complete: nothing but an end-of-sequence token may follow."""
        return self.inner.is_stopped()

    @property
    def error(self) -> str:
        return self.inner.get_error()


class Grammars:
    """The engine's grammar engine: the tokenizer index, built on first use (under a lock: the HTTP
    threads may ask to check a grammar while the engine thread builds matchers), and a matcher per
    constrained request."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._index: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()

    @property
    def index(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer index (built once)."""
        with self._lock:
            if self._index is None:
                start = time.perf_counter()
                try:
                    self._index = ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
                except GrammarError:
                    raise
                except Exception as e:  # noqa: BLE001 - llguidance refusing this tokenizer
                    raise GrammarError(f"the grammar engine cannot read this tokenizer: {e}") from e
                log.info(
                    "grammar engine: tokenizer index of %d ids built in %.2f s",
                    self.vocab_size,
                    time.perf_counter() - start,
                )
            return self._index

    def special_id(self, text: str) -> int | None:
        """The id of ``text`` if it is one special token (text can never produce it: a structural
        tag's trigger such as ``<|python_tag|>`` is referenced by id), else None."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and 0 <= ids[0] < self.vocab_size and self.index.is_special_token(ids[0]):
            return ids[0]
        return None

    def matcher(self, spec: StructuredOutputs) -> Matcher:
        """A fresh matcher at the start of ``spec``'s grammar; :class:`GrammarError` for a spec that
        does not compile."""
        inner = llguidance.LLMatcher(self.index, check(spec, special=self.special_id), log_level=0)
        if inner.is_error():
            raise GrammarError(f"cannot compile the grammar: {inner.get_error()}")
        return Matcher(inner, self.vocab_size)
