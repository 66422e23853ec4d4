"""Prompts against the model: text or chat to token ids, and the checks that need the model.

Every check runs on the HTTP side before a request reaches the engine thread, so a bad prompt gets its
own status code at once and never occupies the engine. The engine repeats the basic checks
(:meth:`plaserve.LLMEngine.validate_prompt`) as a safety net.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import jinja2

from plaserve.model.tokenizer import Tokenizer
from plaserve.server.errors import ApiError
from plaserve.server.protocol import Prompt


@dataclass(frozen=True)
class ModelLimits:
    """What a prompt is checked against."""

    max_model_len: int
    vocab_size: int  # the model's embedding rows: ids at or above are rejected


def encode_prompt(tokenizer: Tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of a completion prompt (text gets the tokenizer's special tokens, e.g. BOS)."""
    if isinstance(prompt, str):
        if not prompt:  # checked before encoding: BOS alone would make "" look non-empty
            raise ApiError(400, "prompt is empty", param="prompt")
        return tokenizer.encode(prompt)
    return list(prompt)


def render_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    **template_vars: Any,
) -> str:
    """The chat template applied to ``messages`` (``template_vars``: ``tools`` and the request's
    ``chat_template_kwargs``); a missing template or a rejected conversation is a 400."""
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, **template_vars
        )
    except (ValueError, jinja2.TemplateError) as e:
        raise ApiError(400, f"cannot apply the chat template: {e}", param="messages") from None


def encode_chat(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    **template_vars: Any,
) -> list[int]:
    """Token ids of a chat prompt. The rendered template already holds the special tokens it wants."""
    return tokenizer.encode(
        render_chat(tokenizer, messages, add_generation_prompt, **template_vars),
        add_special_tokens=False,
    )


def check_prompt(token_ids: list[int], limits: ModelLimits, max_tokens: int | None) -> int:
    """Validate a tokenized prompt; returns the ``max_tokens`` to use (None: all the room left).

    Empty prompts and unknown token ids are 400; a prompt that alone fills the context is 413; a
    prompt that fits but leaves less room than ``max_tokens`` asks is 400, as vLLM answers.
    """
    if not token_ids:
        raise ApiError(400, "prompt is empty", param="prompt")
    check_token_ids(token_ids, limits, "prompt")
    n, limit = len(token_ids), limits.max_model_len
    if n >= limit:
        raise ApiError(
            413,
            f"This model's maximum context length is {limit} tokens; the prompt has {n} tokens "
            f"(prompt plus at least one generated token must fit)",
            param="prompt",
            code="context_length_exceeded",
        )
    if max_tokens is None:
        return limit - n
    if n + max_tokens > limit:
        raise ApiError(
            400,
            f"This model's maximum context length is {limit} tokens; you requested {n + max_tokens} "
            f"tokens ({n} in the prompt, {max_tokens} for the completion). Reduce the prompt or "
            f"max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return max_tokens


def check_logit_bias(bias: dict[int, float] | None, limits: ModelLimits) -> None:
    """A logit bias on a token the model does not have is a 400 (as vLLM answers)."""
    check_token_ids(bias or {}, limits, "logit_bias", "logit_bias token id")


def check_token_ids(
    ids: Iterable[int], limits: ModelLimits, param: str, what: str = "token id"
) -> None:
    """An id outside the model's vocabulary is a 400 that names it and the field ``param``."""
    bad = next((t for t in ids if not 0 <= t < limits.vocab_size), None)
    if bad is not None:
        raise ApiError(
            400, f"{what} {bad} is outside the vocabulary [0, {limits.vocab_size})", param=param
        )
