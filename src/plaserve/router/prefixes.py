"""What each worker's prefix cache likely holds, so that a request is priced by what it would prefill
there: ``n`` new tokens after ``h`` cached ones (the cost model's cached-history term), not its whole
prompt.

A conversation sent again with one more turn, or many requests over one long document, prefills only
their new part on the worker that served the earlier ones, and all of it anywhere else: priced by the
whole prompt, the router would spread such requests evenly and lose the cache; priced this way, a
worker that holds the prefix is cheaper by what it holds, and the policy weighs that against its
backlog like any other cost.

The router sees every prompt it sends. It cuts the prompt's text (:func:`prompt_text`, UTF-8) into
:data:`CHUNK_BYTES`-byte chunks and hashes all the text up to each chunk's end (:class:`PromptKey`;
a hash that is the same in every process, so that the Ray ingress's keys mean the same in the
request router); per worker it remembers the chunks it sent there, least recently used forgotten
first, as many as the worker's KV cache holds (its ``/load`` reports the blocks; a worker that does
not say is taken to hold ``prefix_cache_tokens``). A request's cached part on a worker is the run of
its leading chunks remembered there. It is an estimate: the router does not read the caches, which
may have evicted what it remembers or hold what other clients sent.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from plaserve.conversations import InputError
from plaserve.router.length import (
    CHARS_PER_TOKEN,
    CONVERSATIONS,
    completion_prompts,
    message_text,
)

# Bytes of a chunk: about 32 tokens of English text, finer than a turn, few enough to hash per request
CHUNK_BYTES = 128
CHUNK_TOKENS = CHUNK_BYTES / CHARS_PER_TOKEN  # what a remembered chunk takes of a worker's cache


@dataclass(frozen=True)
class PromptKey:
    """A prompt's text as the hashes of its text up to the end of each whole chunk, and its size."""

    chunks: tuple[int, ...]
    size: int  # bytes

    @classmethod
    def of(cls, text: str) -> "PromptKey":
        data = text.encode()
        running, chunks = hashlib.blake2b(digest_size=8), []
        for end in range(CHUNK_BYTES, len(data) + 1, CHUNK_BYTES):
            running.update(data[end - CHUNK_BYTES : end])
            chunks.append(int.from_bytes(running.copy().digest(), "little"))
        return cls(tuple(chunks), len(data))


def _conversation_text(messages: list[Any], tools: Any) -> str | None:
    """A conversation in the order its template lays it out (tools first, as most put them in the
    system turn): each message's role, text and tool calls; None where a message is not text."""
    parts = [json.dumps(tools, sort_keys=True)] if tools else []
    for m in messages:
        text = message_text(m)
        if text is None:
            return None
        calls = m.get("tool_calls")
        parts.append(f"{m.get('role')}\x1f{text}{json.dumps(calls) if calls else ''}\x1e")
    return "".join(parts)


def prompt_text(path: str, body: dict[str, Any]) -> str | None:
    """The text a request's one prompt is made of, or None (several prompts, none readable): a
    completion's prompt (token ids as their numbers), a chat, Responses or Messages conversation."""
    reader = CONVERSATIONS.get(path)
    if reader is not None:
        try:
            return _conversation_text(reader(body), body.get("tools"))
        except InputError:
            return None
    if path == "/v1/chat/completions":
        messages = body.get("messages")
        return (
            _conversation_text(messages, body.get("tools")) if isinstance(messages, list) else None
        )
    prompts = completion_prompts(body)
    if prompts is None or len(prompts) != 1:
        return None
    prompt = prompts[0]
    return prompt if isinstance(prompt, str) else " ".join(map(str, prompt))


def prompt_key(path: str, body: dict[str, Any]) -> PromptKey | None:
    """The key of a request's prompt (:func:`prompt_text`), or None."""
    text = prompt_text(path, body)
    return PromptKey.of(text) if text is not None else None


class PrefixIndex:
    """The chunks sent to one worker, at most ``capacity_tokens`` of them by :data:`CHUNK_TOKENS`,
    the least recently used forgotten first."""

    def __init__(self, capacity_tokens: int) -> None:
        self._chunks: OrderedDict[int, None] = OrderedDict()
        self.capacity = 0
        self.resize(capacity_tokens)

    def __len__(self) -> int:
        return len(self._chunks)

    def resize(self, capacity_tokens: int) -> None:
        """Hold at most ``capacity_tokens`` (a worker's cache as its ``/load`` reports it; 0: none)."""
        self.capacity = max(0, int(capacity_tokens / CHUNK_TOKENS))
        self._evict()

    def _evict(self) -> None:
        while len(self._chunks) > self.capacity:
            self._chunks.popitem(last=False)

    def matched_chunks(self, key: PromptKey) -> int:
        """How many of ``key``'s leading chunks are remembered here."""
        n = 0
        for chunk in key.chunks:
            if chunk not in self._chunks:
                break
            n += 1
        return n

    def cached_tokens(self, key: PromptKey | None, tokens: int) -> int:
        """Of a ``tokens``-token prompt with ``key``, the tokens likely cached here (at most all but
        one: the last is always computed, for its logits)."""
        if key is None or not key.size:
            return 0
        matched = self.matched_chunks(key) * CHUNK_BYTES
        return max(0, min(tokens - 1, round(tokens * matched / key.size)))

    def add(self, key: PromptKey | None) -> None:
        """Remember ``key``'s chunks, its first the most recently used: a shared head (a system
        prompt, a document) outlives the tails that follow it."""
        if key is None:
            return
        for chunk in reversed(key.chunks):
            self._chunks[chunk] = None
            self._chunks.move_to_end(chunk)
        self._evict()


def cache_hit_tokens(load: dict[str, Any]) -> int | None:
    """The prompt tokens a worker served from its prefix cache, ever, by its ``/load`` (to set
    against those the router priced as cached there), or None where the report does not say."""
    kv = load.get("kv")
    hits = kv.get("cache_hit_tokens") if isinstance(kv, dict) else None
    return hits if isinstance(hits, int) and not isinstance(hits, bool) else None


def cache_tokens(load: dict[str, Any]) -> int | None:
    """The tokens a worker's prefix cache can hold by its ``/load`` (its KV blocks; 0 where prefix
    caching is off), or None where the report does not say."""
    kv = load.get("kv")
    if not isinstance(kv, dict):
        return None
    if kv.get("prefix_caching") is False:
        return 0
    blocks = [kv.get(k) for k in ("used_blocks", "free_blocks", "block_size")]
    if not all(isinstance(b, int) and b >= 0 for b in blocks):
        return None
    return (blocks[0] + blocks[1]) * blocks[2]
