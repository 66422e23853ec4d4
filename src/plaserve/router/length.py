"""Prompt length estimates: how many tokens a request will prefill, before it is sent anywhere.

First method that applies, per prompt:

1. **token ids** (a completion prompt given as a list of ids): exact;
2. **tokenizer** (``--tokenizer DIR``, the served model's Hugging Face tokenizer): exact for text, and
   for chat the model's chat template is rendered first, as the server does;
3. **worker**: ``POST /tokenize`` on a worker that has it (plaserve, vLLM), with the prompt or the
   messages, so the worker's own tokenizer and template count;
4. **characters / 4** (English text averages about four characters per token in Llama-family
   tokenizers); for chat, every message adds :data:`CHAT_TOKENS_PER_MESSAGE` tokens and the reply
   header :data:`CHAT_TOKENS_REPLY`, what ChatML-style templates add (``<|im_start|>role\\n ...
   <|im_end|>\\n``).

A body the router cannot read a prompt from is estimated as one token and forwarded: the worker's
answer (a 400 with its own message) is better than the router's guess.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from plaserve.conversations import InputError, anthropic_messages, responses_messages
from plaserve.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4.0
CHAT_TOKENS_PER_MESSAGE = 4
CHAT_TOKENS_REPLY = 3

#: ``(payload) -> token count or None``: asks a worker's ``/tokenize`` (payload: ``{"prompt"}`` or
#: ``{"messages"}``); None when no worker could answer.
RemoteTokenize = Callable[[dict[str, Any]], Awaitable[int | None]]


@dataclass(frozen=True)
class Estimate:
    """Prompt lengths of one request (one entry per prompt) and how they were obtained."""

    tokens: tuple[int, ...]
    method: str  # "token_ids", "tokenizer", "worker", "chars" or "unknown"


def _is_ids(x: Any) -> bool:
    # The first element decides: checking all of a 30,000-id prompt would cost the router more than
    # the rest of its work on the request, and a malformed list is the worker's to refuse.
    return isinstance(x, list) and bool(x) and type(x[0]) is int


def completion_prompts(body: dict[str, Any]) -> list[str | list[int]] | None:
    """The prompts of a ``/v1/completions`` body (a string, ids, or a list of either); None if unreadable."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if _is_ids(prompt):
            return [prompt]
        if all(isinstance(p, str) or _is_ids(p) for p in prompt):
            return list(prompt)
    return None


def message_text(message: Any) -> str | None:
    """The text of a chat message: ``content`` as a string or a list of ``{"type": "text"}`` parts."""
    if not isinstance(message, dict):
        return None
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p.get("text", "")
            for p in content
            if isinstance(p, dict) and isinstance(p.get("text", ""), str)
        )
    return None


def chars_estimate(text: str) -> int:
    """Tokens of ``text`` at :data:`CHARS_PER_TOKEN` characters each (at least 1)."""
    return max(1, round(len(text) / CHARS_PER_TOKEN))


def chat_chars_estimate(messages: list[Any]) -> int:
    """Tokens of a conversation by characters, with the template's per-message overhead."""
    total = CHAT_TOKENS_REPLY
    for m in messages:
        text = message_text(m) or ""
        role = m.get("role", "") if isinstance(m, dict) else ""
        total += CHAT_TOKENS_PER_MESSAGE + round((len(text) + len(str(role))) / CHARS_PER_TOKEN)
    return total


# The other chat APIs' conversations, read as chat messages (plaserve.conversations).
CONVERSATIONS = {"/v1/responses": responses_messages, "/v1/messages": anthropic_messages}


class LengthEstimator:
    """Estimates prompt lengths by the first method that applies (module docstring)."""

    def __init__(self, tokenizer: Tokenizer | None = None) -> None:
        self.tokenizer = tokenizer

    async def completion(
        self, body: dict[str, Any], remote: RemoteTokenize | None = None
    ) -> Estimate:
        """Lengths of a ``/v1/completions`` request's prompts."""
        prompts = completion_prompts(body)
        if prompts is None:
            return Estimate((1,), "unknown")
        if all(isinstance(p, list) for p in prompts):
            return Estimate(tuple(len(p) for p in prompts), "token_ids")
        if self.tokenizer is not None:
            return Estimate(
                tuple(
                    len(p) if isinstance(p, list) else len(self.tokenizer.encode(p))
                    for p in prompts
                ),
                "tokenizer",
            )
        if remote is not None:
            counts = await asyncio.gather(*(self._remote_text(p, body, remote) for p in prompts))
            if all(c is not None for c in counts):
                return Estimate(tuple(int(c) for c in counts), "worker")  # type: ignore[arg-type]
        return Estimate(
            tuple(len(p) if isinstance(p, list) else chars_estimate(p) for p in prompts), "chars"
        )

    @staticmethod
    async def _remote_text(
        prompt: str | list[int], body: dict[str, Any], remote: RemoteTokenize
    ) -> int | None:
        if isinstance(prompt, list):
            return len(prompt)
        payload: dict[str, Any] = {"prompt": prompt}
        if isinstance(body.get("model"), str):
            payload["model"] = body["model"]
        return await remote(payload)

    async def request(
        self, path: str, body: dict[str, Any], remote: RemoteTokenize | None = None
    ) -> Estimate:
        """Lengths of a generation request's prompts on ``path``: a completion's prompts, or the one
        conversation of a chat, or (read as chat messages) a Responses or Messages API request."""
        reader = CONVERSATIONS.get(path)
        if reader is not None:
            try:
                messages = reader(body)
            except InputError:  # the worker will say why
                return Estimate((1,), "unknown")
            return await self.chat({"model": body.get("model"), "messages": messages}, remote)
        if path == "/v1/chat/completions":
            return await self.chat(body, remote)
        return await self.completion(body, remote)

    async def chat(self, body: dict[str, Any], remote: RemoteTokenize | None = None) -> Estimate:
        """Length of a ``/v1/chat/completions`` request's conversation, chat template included."""
        messages = body.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or any(message_text(m) is None for m in messages)
        ):
            return Estimate((1,), "unknown")
        if self.tokenizer is not None and self.tokenizer.has_chat_template:
            try:
                plain = [{**m, "content": message_text(m)} for m in messages]
                text = self.tokenizer.apply_chat_template(plain, add_generation_prompt=True)
                return Estimate(
                    (len(self.tokenizer.encode(text, add_special_tokens=False)),), "tokenizer"
                )
            except (
                Exception
            ) as e:  # a template that rejects the conversation: the worker will say why
                log.debug("chat template failed in the router: %s", e)
        if remote is not None:
            payload: dict[str, Any] = {"messages": messages}
            if isinstance(body.get("model"), str):
                payload["model"] = body["model"]
            count = await remote(payload)
            if count is not None:
                return Estimate((int(count),), "worker")
        return Estimate((chat_chars_estimate(messages),), "chars")
