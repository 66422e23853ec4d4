"""Requests: sampling parameters, per-request state and timings, and the outputs users see.

The bottom layer: every other part of plaserve may import this module, and it imports none of them
(its detokenizer and the sampler's penalty state are whatever the engine hands it).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

_ids = itertools.count()
MAX_LOGPROBS = 20  # most likely tokens reported per position (vLLM's default cap)


class ParamError(ValueError):
    """A sampling parameter out of its range; ``param`` names the field (the HTTP layer reports it)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# Below this temperature a request is greedy (vLLM's epsilon): dividing logits by a tiny temperature
# would overflow them to inf, and the softmax of inf is NaN.
MIN_TEMPERATURE = 1e-5
# The repetition penalty divides (or multiplies) logits: outside this range float32 logits of a real
# model overflow, and no sensible setting lies there (1 is off; 1.1-1.5 are the usual values).
REPETITION_PENALTY_RANGE = (0.01, 100.0)
SEED_RANGE = (-(2**63), 2**63 - 1)  # what torch.Generator.manual_seed takes without remapping


def _check_number(name: str, value: object, lo: float, hi: float, *, lo_open: bool = False) -> None:
    """``value`` must be a finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ParamError(name, f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ParamError(name, f"{name} must be a finite number, got {value}")
    if value < lo or value > hi or (lo_open and value == lo):
        bounds = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise ParamError(name, f"{name} must be in {bounds}, got {value}")


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    """``value`` must be an integer (not a bool) in ``[lo, hi]``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ParamError(name, f"{name} must be an integer, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        bounds = f"at least {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ParamError(name, f"{name} must be {bounds}, got {value}")


@dataclass(frozen=True)
class StructuredOutputs:
    """What a constrained request's output must match (vLLM's ``StructuredOutputsParams``): exactly one
    of a JSON schema, any JSON object, a regular expression, a list of choices, a grammar (Lark, or
    GBNF as llama.cpp and xgrammar write it) or a structural tag (free text with tagged JSON parts).
    The grammar engine (:mod:`plaserve.grammar`) compiles it; a value it cannot compile is refused
    there, naming the field."""

    json: str | None = None  # a JSON schema, serialised
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    # vLLM's structural tag: the JSON text of {"structures": [{"begin", "schema", "end"}], "triggers"}
    structural_tag: str | None = None
    strict: bool = (
        False  # json: OpenAI's strict mode (no undeclared properties, no ignored keywords)
    )

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json", "regex", "choice", "grammar", "structural_tag")
            if getattr(self, name) is not None
        ] + (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ParamError(
                "structured_outputs",
                "structured outputs take exactly one of json, json_object, regex, choice, grammar,"
                f" structural_tag (got {', '.join(given) or 'none'})",
            )
        if self.choice is not None:
            choice = tuple(self.choice)
            if not choice or not all(isinstance(c, str) for c in choice):
                raise ParamError("structured_outputs", "choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", choice)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop (the fields and defaults of vLLM's ``SamplingParams``).

    This is the one place sampling parameters are validated: construction raises :class:`ParamError`
    (a ``ValueError``) naming the field for anything out of range, NaN and infinities included, so no
    value that gets past it can make the sampler produce NaN probabilities.
    """

    n: int = (
        1  # choices per prompt (the offline LLM and the server fan out; an engine request is one)
    )
    max_tokens: int | None = 16  # None: as many as the context has room for
    temperature: float = 1.0  # below MIN_TEMPERATURE: greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True  # leave special tokens (eos, chat markers) out of the text
    min_tokens: int = (
        0  # no eos, stop token or stop string ends the request before this many tokens
    )
    presence_penalty: float = 0.0  # subtracted from the logit of every token the output already has
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output so far
    repetition_penalty: float = (
        1.0  # divides positive (multiplies negative) logits of prompt and output tokens
    )
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    logit_bias: dict[int, float] | None = (
        None  # added to these tokens' logits (OpenAI's, each in [-100, 100])
    )
    logprobs: int | None = (
        None  # None: none; k: each sampled token's log-probability and the k most likely
    )
    prompt_logprobs: int | None = (
        None  # the same for every prompt token after the first (no prefix-cache reuse)
    )
    structured: StructuredOutputs | None = (
        None  # the output must match this (a token mask per step)
    )

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        _check_number("temperature", self.temperature, 0.0, math.inf)
        _check_number("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_int("top_k", self.top_k, -1)
        _check_number("min_p", self.min_p, 0.0, 1.0)
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), -2.0, 2.0)
        _check_number("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        if self.seed is not None:
            # Choice j samples with seed + j: the last one must be in range too.
            _check_int("seed", self.seed, SEED_RANGE[0], SEED_RANGE[1] - (self.n - 1))
        for token, bias in (self.logit_bias or {}).items():
            _check_int("logit_bias", token, 0)
            _check_number("logit_bias", bias, -100.0, 100.0)
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), 0, MAX_LOGPROBS)
        # Normalise the list-or-scalar fields so the rest of the engine sees tuples.
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if not all(isinstance(s, str) and s for s in stop):
            raise ParamError("stop", "stop strings must be non-empty strings")
        stop_ids = tuple(self.stop_token_ids or ())
        for token in stop_ids:
            _check_int("stop_token_ids", token, 0)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", stop_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def choices(self) -> list[SamplingParams]:
        """One single-choice copy per choice: choice ``j`` of a seeded request samples with ``seed + j``,
        so the choices differ and the request stays reproducible."""
        return [
            dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + j)
            for j in range(self.n)
        ]

    @property
    def penalised(self) -> bool:
        """Whether any penalty, bias or the ``min_tokens`` ban changes this request's logits."""
        return bool(
            self.min_tokens
            or self.repetition_penalty != 1.0
            or self.presence_penalty
            or self.frequency_penalty
            or self.logit_bias
        )


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities at one sampled position, from the model's raw logits (before penalties and
    temperature, as vLLM reports them by default)."""

    token_id: int  # the sampled token
    logprob: float  # its log-probability
    top: tuple[tuple[int, float], ...]  # the most likely tokens and theirs, most likely first


class Detokenizer(Protocol):
    """Turns a request's output tokens into text one token at a time (the tokenizer's incremental
    detokenizer)."""

    def add(self, token_id: int) -> str:
        """The text ``token_id`` completes (may be empty while a multi-byte character is unfinished)."""
        ...


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV blocks
    RUNNING = "running"  # holds KV blocks: prefilling or decoding
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Timestamps (engine clock, seconds) and counters of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    # (start, end, tokens)
    prefill_chunks: list[tuple[float, float, int]] = field(default_factory=list)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token was produced
    finish_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Time to first token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


class Request:
    """One generation request as the engine tracks it.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache. A step computes tokens
    ``[num_computed_tokens, num_tokens)`` (or a chunk of them) and samples once all are computed, so
    prefill, chunked prefill, decode and recompute after preemption are the same loop.
    """

    def __init__(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        arrival_time: float = 0.0,
        prompt: str | None = None,
        detokenizer: Detokenizer | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt must contain at least one token")
        self.request_id = request_id if request_id is not None else f"req-{next(_ids)}"
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[
            TokenLogprobs
        ] = []  # one per output token when params.logprobs is set
        # One per prompt token when params.prompt_logprobs is set (the first has none), filled as the
        # prefill computes them.
        self.prompt_logprobs: list[TokenLogprobs | None] = (
            [None] if params.prompt_logprobs is not None else []
        )
        self.token_ids = list(prompt_token_ids)  # prompt + output, the sequence the cache holds
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.num_computed_tokens = 0
        self.num_committed_blocks = 0  # blocks indexed in the prefix cache
        self.block_table: list[int] = []
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.detokenizer = detokenizer
        self.eos_token_ids = () if params.ignore_eos else eos_token_ids
        self.output_text = ""  # detokenized output, cut at a stop string
        self.generator = None  # a torch.Generator when the request has its own seed
        self.penalty_state: Any = (
            None  # sampler.PenaltyState, from a penalised request's first sample
        )
        self.length_class = "short"  # set by the scheduler on arrival: "short" or "long"
        # prompt tokens not in the prefix cache on arrival
        self.uncached_estimate = len(prompt_token_ids)
        self.ttft_slo: float | None = None  # seconds; set by the scheduler on arrival
        # grammar.Matcher of a request with structured outputs: advanced with each output token
        self.grammar: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to compute before the next sample."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def num_reusable_tokens(self) -> int:
        """How much of the sequence may come from the prefix cache: all but the last token (sampling
        needs its logits), and with prompt logprobs only what their computation has passed already."""
        if (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens
        ):
            return len(self.prompt_logprobs) - 1
        return self.num_tokens - 1

    @property
    def in_prefill(self) -> bool:
        """True until the first output token exists (or while recomputing after preemption)."""
        return self.num_pending_tokens > 1 or not self.output_token_ids

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, prompt={self.num_prompt_tokens}, out={len(self.output_token_ids)}, "
            f"computed={self.num_computed_tokens}, {self.status.value})"
        )


@dataclass
class CompletionOutput:
    """One generated sequence (vLLM's shape)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None  # when asked for: one per token of token_ids


@dataclass
class RequestOutput:
    """What the engine reports for a request: its output so far and whether it finished."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprobs | None] | None = (
        None  # when asked for: one per prompt token
    )

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @classmethod
    def of(cls, req: Request) -> "RequestOutput":
        return cls(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    0,
                    req.output_text,
                    list(req.output_token_ids),
                    req.finish_reason,
                    req.stop_reason,
                    None
                    if req.params.logprobs is None
                    else req.output_logprobs[: len(req.output_token_ids)],
                )
            ],
            finished=req.finished,
            metrics=req.metrics,
            num_cached_tokens=req.metrics.num_cached_tokens,
            # Not copied: complete before the first token, never changed after.
            prompt_logprobs=None if req.params.prompt_logprobs is None else req.prompt_logprobs,
        )
