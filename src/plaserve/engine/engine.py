"""LLMEngine: requests in, tokens out, one scheduled step at a time."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Protocol

import torch

from plaserve.config import EngineConfig
from plaserve.cost import (
    CostModel,
    OnlineCostModel,
    StepTimeRatio,
    measure_peak_flops,
    with_step_cost,
)
from plaserve.engine.graphs import decode_grid_shapes
from plaserve.engine.host_memory import keep_freed_memory
from plaserve.engine.kv_cache import allocate_kv_tensors, available_memory, parse_memory
from plaserve.engine.kv_transfer import KVHandoff
from plaserve.engine.omp_spin import throttle_spin_waits
from plaserve.engine.runner import ModelRunner
from plaserve.grammar.compile import GrammarError
from plaserve.grammar.matcher import Grammars
from plaserve.kv_blocks import BlockAllocator
from plaserve.model.attention import skip_cudnn_attention
from plaserve.model.default import DEFAULT_CONFIG
from plaserve.model.fused import compiled_min_tokens
from plaserve.model.loader import LoadedModel, load_model, resolve_device, resolve_dtype
from plaserve.model.tokenizer import IncrementalDetokenizer, load_tokenizer
from plaserve.profile import Profile, fingerprint
from plaserve.request import Request, RequestOutput, SamplingParams
from plaserve.scheduler.base import ScheduledBatch
from plaserve.scheduler.policy import POLICIES

log = logging.getLogger(__name__)


def batch_work(batch: ScheduledBatch) -> list[tuple[int, int]]:
    """``(n, h)`` of each item as the cost model sees it (padded rows cost their bucket)."""
    return [
        (
            batch.bucket if batch.bucket is not None and it.num_tokens > 1 else it.num_tokens,
            it.request.num_computed_tokens,
        )
        for it in batch.items
    ]


def prefill_left(cost: CostModel, num_prompt_tokens: int, num_computed: int) -> float:
    """Predicted seconds of a request's prefill still to do once ``num_computed`` tokens are in the KV
    cache: the backlog a load report counts for it."""
    pending = num_prompt_tokens - num_computed
    return cost.prefill_time(pending, num_computed) if pending > 0 else 0.0


class BatchRunner(Protocol):
    """Executes one scheduled batch; returns the sampled token of each sampling item by index (None:
    the model's logits for it were unusable, and that request fails)."""

    def execute(self, batch: ScheduledBatch) -> dict[int, int | None]: ...


DEFAULT_MAX_MODEL_LEN = 16384


class LLMEngine:
    """Continuous-batching engine: ``add_request``, then ``step`` until nothing is unfinished.

    Requests join and leave between steps; a step runs whatever the scheduling policy picks (prefill
    chunks and decodes). All times are read from ``clock`` so tests can inject their own.
    """

    def __init__(
        self,
        config: EngineConfig = EngineConfig(),
        *,
        loaded: LoadedModel | None = None,
        runner: BatchRunner | None = None,
        cost: CostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Build the engine. With ``runner`` given, no model or KV tensors are created: the scheduler
        drives ``runner.execute`` (a test double or the simulator's cost-model runner) instead."""
        # A profile is read first so that a bad path fails before the model loads.
        self.profile = Profile.load(config.profile) if config.profile is not None else None
        if self.profile is not None:
            config = dataclasses.replace(
                config,
                scheduler=dataclasses.replace(
                    config.scheduler, **self.profile.scheduler_overrides()
                ),
            )
        self.clock = clock
        self.device = resolve_device(config.device)
        for name in ("pad_short_batches", "pad_decode_batches"):
            if getattr(config, name) not in ("auto", "always", "never"):
                raise ValueError(
                    f"{name} must be auto, always or never, not {getattr(config, name)!r}"
                )
        graphs = config.use_cuda_graphs and self.device.type == "cuda"
        static = config.pad_short_batches == "always" or (
            config.pad_short_batches == "auto" and graphs
        )
        self.static_decode = config.pad_decode_batches == "always" or (
            config.pad_decode_batches == "auto" and graphs
        )
        config = dataclasses.replace(
            config, scheduler=dataclasses.replace(config.scheduler, static_short_batches=static)
        )
        self.config = config
        self.dtype = resolve_dtype(config.dtype, self.device)
        torch.manual_seed(config.seed)
        if runner is None and loaded is None:
            loaded = load_model(
                config.model, self.dtype, self.device, seed=config.seed, revision=config.revision
            )
        if runner is None and loaded is not None and self.device.type == "cpu":
            loaded.model.compile_kernels(compiled_min_tokens(config.compile_min_tokens))
        self.loaded = loaded
        self.model_config = loaded.config if loaded else DEFAULT_CONFIG
        self.tokenizer = loaded.tokenizer if loaded else load_tokenizer(None)
        # Structured outputs: llguidance's index of the tokenizer is built on the first such request.
        self.grammars = Grammars(
            self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids
        )
        self.max_model_len = config.max_model_len or min(
            self.model_config.max_position_embeddings, DEFAULT_MAX_MODEL_LEN
        )
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {self.model_config.max_position_embeddings}"
            )
        num_blocks = self._num_kv_blocks()
        self.allocator = BlockAllocator(num_blocks, config.block_size, config.enable_prefix_caching)
        if self.profile is not None:
            self.profile.check(fingerprint(self.model_config, self.dtype, self.device))
            cost = cost or self.profile.cost_model
        self.cost = cost or CostModel.from_flops(
            self.model_config, measure_peak_flops(self.device, self.dtype)
        )
        self.online = OnlineCostModel(self.cost) if config.online_refit else None
        self.step_time = StepTimeRatio()
        sched = config.scheduler
        if sched.policy not in POLICIES:
            raise ValueError(
                f"unknown policy {sched.policy!r}; choose one of {', '.join(POLICIES)}"
            )
        if sched.static_short_batches and sched.max_static_batch_tokens is None:
            sched = dataclasses.replace(sched, max_static_batch_tokens=self._static_token_budget())
            self.config = config = dataclasses.replace(config, scheduler=sched)
        self.scheduler = POLICIES[sched.policy](sched, self.allocator, self.cost)
        if runner is None:
            assert loaded is not None
            if self.device.type == "cpu":
                keep_freed_memory()  # activations reuse freed memory instead of page-faulting in anew
                throttle_spin_waits()  # where torch was loaded before plaserve set a spin bound
            elif self.device.type == "cuda":
                skip_cudnn_attention()
            cfg = self.model_config
            kv_caches = allocate_kv_tensors(
                cfg.num_hidden_layers,
                num_blocks,
                config.block_size,
                cfg.num_key_value_heads,
                cfg.head_dim,
                self.dtype,
                self.device,
            )
            runner = ModelRunner(loaded.model, kv_caches, config.block_size, self.device)
            shapes = self.scheduler.static_shapes()
            if shapes:
                runner.build_grid(shapes, capture=config.use_cuda_graphs)
            if self.static_decode:
                runner.build_decode_grid(self._decode_grid_shapes(), capture=config.use_cuda_graphs)
        self.runner = runner
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        self.requests: dict[str, Request] = {}
        # Later choices of a prompt waiting for its first choice's first token, by the first's id.
        self._held: dict[str, list[Request]] = {}
        self.last_batch: ScheduledBatch | None = None
        self.num_steps = 0
        self.num_preemptions = 0
        # Prefill/decode disaggregation: parked exports and imports of KV blocks (docs/PD.md).
        self.kv_handoff = KVHandoff(self)

    # Prompt lengths whose forward passes warm_up times for the start-up cost model (with_step_cost).
    WARM_UP_TIMED = (16, 512)

    def warm_up(self) -> None:
        """Run one throwaway step of a full token budget (and a decode) before serving, so that the
        first requests do not pay for first-call costs, and build the grammar engine's tokenizer
        index (~0.3 s for 32k ids), which the first request with structured outputs would otherwise
        wait for. Where the cost model is the FLOP count's and refits online, also time forward
        passes of ``WARM_UP_TIMED`` tokens (best of 3) and schedule by their per-step and per-token
        costs (:func:`~plaserve.cost.with_step_cost`) until the online refit takes over. Touches no
        request, block or counter; does nothing with a model-free runner."""
        if not isinstance(self.runner, ModelRunner):
            return
        try:
            self.grammars.index  # noqa: B018 - built on first access
        except GrammarError as e:  # the model serves; its structured-output requests get 400s
            log.warning("structured outputs unavailable: %s", e)
        budget = max(1, min(self.config.scheduler.max_num_batched_tokens, self.max_model_len - 1))
        self.runner.warm_up(budget)
        if self.cost.source != "flops" or self.online is None:
            return
        best: dict[int, float] = {}
        for _ in range(3):  # alternating, best of each: the others' work only adds time
            for n in {min(n, budget) for n in self.WARM_UP_TIMED}:
                start = time.perf_counter()
                self.runner.warm_up(n)
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                best[n] = min(best.get(n, float("inf")), time.perf_counter() - start)
        if len(best) < 2:
            return
        self.set_cost_model(with_step_cost(self.cost, best))
        log.info("start-up cost model: %s", self.cost.as_dict())

    def set_cost_model(self, cost: CostModel) -> None:
        """Schedule by ``cost`` from now on; the online refit (where on) starts from it."""
        self.cost = cost
        self.scheduler.set_cost_model(cost)
        if self.online is not None:
            self.online.model = cost

    def _static_token_budget(self) -> int:
        """Tokens one padded static batch may hold so that its activations fit ``cuda_graph_memory``
        (a captured graph keeps its shape's activation memory reserved)."""
        budget = parse_memory(self.config.cuda_graph_memory, available_memory(self.device))
        per_token = self.model_config.activation_bytes_per_token(torch.finfo(self.dtype).bits // 8)
        tokens = max(1, budget // per_token)
        log.info(
            "static short batches: at most %d tokens each (%s of activations at %d bytes a token)",
            tokens,
            self.config.cuda_graph_memory,
            per_token,
        )
        return tokens

    def _decode_grid_shapes(self) -> list[tuple[int, int]]:
        """The decode grid's ``(batch, blocks)`` shapes: up to ``max_num_seqs`` rows and the blocks of
        ``max_model_len``, within ``cuda_graph_memory`` (each shape's gathered K/V of one layer)."""
        cfg, bs = self.model_config, self.config.block_size
        bytes_per_block = (
            2 * bs * cfg.num_key_value_heads * cfg.head_dim * torch.finfo(self.dtype).bits // 8
        )
        budget = parse_memory(self.config.cuda_graph_memory, available_memory(self.device))
        return decode_grid_shapes(
            self.scheduler.max_num_seqs, -(-self.max_model_len // bs), bytes_per_block, budget
        )

    def _num_kv_blocks(self) -> int:
        cfg, c = self.config, self.model_config
        spec = cfg.kv_cache_memory
        if spec == "auto":
            spec = "0.8" if self.device.type == "cuda" else "2GiB"
        budget = parse_memory(spec, available_memory(self.device))
        block_bytes = c.kv_bytes_per_token * cfg.block_size * torch.finfo(self.dtype).bits // 8
        num_blocks = budget // block_bytes + 1  # +1: the null block
        needed = -(-self.max_model_len // cfg.block_size) + 1
        if num_blocks < needed:
            raise ValueError(
                f"KV cache of {budget / 2**20:.1f} MiB holds {(num_blocks - 1) * cfg.block_size} "
                f"tokens, fewer than max_model_len={self.max_model_len}; raise --kv-cache-memory "
                f"or lower --max-model-len"
            )
        log.info(
            "KV cache: %d blocks of %d tokens (%.1f MiB)",
            num_blocks - 1,
            cfg.block_size,
            num_blocks * block_bytes / 2**20,
        )
        return num_blocks

    # --- requests ------------------------------------------------------------------------------
    def new_request(
        self,
        token_ids: list[int],
        params: SamplingParams,
        request_id: str | None,
        arrival_time: float,
        prompt: str | None = None,
    ) -> Request:
        """A request of this engine, not yet queued: its detokenizer, stop tokens, grammar matcher
        (a GrammarError, a ValueError, refuses it) and random generator. For :meth:`add_request` and
        for requests whose prompt's KV came from elsewhere (engine/kv_transfer.py)."""
        req = Request(
            token_ids,
            params,
            request_id=request_id,
            prompt=prompt,
            arrival_time=arrival_time,
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            eos_token_ids=tuple(self.model_config.eos_token_ids),
        )
        if params.structured is not None:
            req.grammar = self.grammars.matcher(params.structured)
        if not params.greedy:
            req.generator = (
                torch.Generator(self.device).manual_seed(params.seed)
                if params.seed is not None
                else self.generator
            )
        return req

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        arrival_time: float | None = None,
        after: str | None = None,
    ) -> Request:
        """Validate and queue a request (a text prompt or token ids). Raises ValueError on bad input.

        ``after``: the id of a request with the same prompt (an earlier choice of it). Where that pays
        (:meth:`shares_prefill`) this one waits until that one has its first token, and then finds the
        prompt's blocks in the prefix cache: ``n`` choices cost one prefill, not ``n``. Its TTFT still
        counts from its own arrival."""
        params = params or SamplingParams()
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, [int(t) for t in prompt]
        self.validate_prompt(token_ids)
        if request_id is not None and request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = self.new_request(
            token_ids,
            params,
            request_id,
            self.clock() if arrival_time is None else arrival_time,
            text,
        )
        self.requests[req.request_id] = req
        leader = self.requests.get(after) if after is not None else None
        if (
            leader is not None
            and not leader.output_token_ids
            and self.shares_prefill(len(token_ids), params)
        ):
            self._held.setdefault(leader.request_id, []).append(req)
        else:
            self.scheduler.add(req)
        return req

    def _release(self, request_id: str) -> None:
        """Queue the choices held for ``request_id``: it has its first token, or it is gone."""
        for req in self._held.pop(request_id, []):
            if not req.finished:
                self.scheduler.add(req)

    @property
    def num_waiting(self) -> int:
        """Requests not started yet: the scheduler's waiting queue and the held choices."""
        return len(self.scheduler.waiting) + sum(map(len, self._held.values()))

    def shares_prefill(self, num_prompt_tokens: int, params: SamplingParams) -> bool:
        """Whether a prompt's later choices gain by waiting for its first choice's first token: then its
        prompt blocks are in the prefix cache (on, and a full block before the last token) and they
        compute only the rest. Not with prompt logprobs, which reuse no cached blocks."""
        return (
            self.config.enable_prefix_caching
            and params.prompt_logprobs is None
            and num_prompt_tokens > self.config.block_size
        )

    def validate_prompt(self, token_ids: list[int]) -> None:
        """Raise ValueError when a prompt cannot be served."""
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens; this model's maximum context length is "
                f"{self.max_model_len} (prompt plus at least one generated token)"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks. False when it was unknown or already finished."""
        req = self.requests.pop(request_id, None)
        if req is None or req.finished:
            return False
        # a held request holds no blocks: it is only marked finished
        self.scheduler.finish(req, "abort")
        self.kv_handoff.forget(request_id)
        self._release(request_id)
        req.metrics.finish_time = self.clock()
        return True

    def reset(self) -> None:
        """Forget every request and every cached block, keeping the model, its KV tensors and the cost
        model: how to carry on after a step failed half-way, when neither the scheduler's state nor the
        content of the blocks that step wrote can be trusted. All KV blocks are free afterwards."""
        sched = self.config.scheduler
        self.requests.clear()
        self._held.clear()
        old = self.allocator
        self.allocator = BlockAllocator(len(old.blocks), old.block_size, old.enable_prefix_caching)
        # Counters the metrics export: they never go back.
        self.allocator.num_cache_hits, self.allocator.num_cache_queries = (
            old.num_cache_hits,
            old.num_cache_queries,
        )
        self.scheduler = POLICIES[sched.policy](sched, self.allocator, self.cost)
        self.last_batch = None
        self.kv_handoff = KVHandoff(self, self.kv_handoff.ttl)  # parked blocks went with the books

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._held)

    def next_wakeup(self) -> float | None:
        """Clock time at which :meth:`step` will next have work (None: nothing is unfinished)."""
        return self.scheduler.next_wakeup(self.clock())

    def wait_for_work(self, max_wait: float = 0.05) -> None:
        """Sleep (on the wall clock) until the scheduler has work, at most ``max_wait`` seconds."""
        wake = self.next_wakeup()
        if wake is not None:
            time.sleep(min(max_wait, max(0.0, wake - self.clock())))

    def length_class(self, req: Request) -> str:
        """``"short"`` or ``"long"``: the tokens left to prefill after the prefix-cache lookup on arrival,
        against the scheduler's ``short_threshold``."""
        return req.length_class

    @property
    def stats(self) -> dict[str, int]:
        """Monotonic counters for metrics: steps run, prompt tokens served from the prefix cache."""
        return {
            "num_steps": self.num_steps,
            "prefix_cache_hit_tokens": self.allocator.num_cache_hits,
            "prefix_cache_query_tokens": self.allocator.num_cache_queries,
            "num_preemptions": self.num_preemptions,
            **getattr(self.runner, "stats", {}),
        }

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing changed) while a request holds KV blocks."""
        return self.allocator.reset_prefix_cache()

    def load_report(self) -> dict:
        """The engine's load as a router reads it: predicted prefill backlog (seconds) by length class
        and in tokens per request, queued and running counts, KV usage, the cost coefficients in use
        and the model's dtype."""
        backlog = {"short": 0.0, "long": 0.0}
        backlog_tokens: list[tuple[int, int]] = []  # (to prefill, in the cache) per request
        queued = {"short": 0, "long": 0}
        running = {"short": 0, "long": 0}
        for req in list(self.scheduler.waiting) + list(self.scheduler.running):
            cls = self.length_class(req)
            # A queued request holds no blocks yet, but its prefix-cache lookup on arrival says how
            # much of its prompt it will find cached: a router pricing it whole would steer the next
            # turn of a conversation away from the cache that holds its history.
            computed = max(req.num_computed_tokens, req.num_prompt_tokens - req.uncached_estimate)
            backlog[cls] += prefill_left(self.cost, req.num_prompt_tokens, computed)
            if req.num_prompt_tokens > computed:
                backlog_tokens.append((req.num_prompt_tokens - computed, computed))
            (running if req.block_table else queued)[cls] += 1
        for (
            held
        ) in self._held.values():  # no backlog of their own: they will find their prompt cached
            for req in held:
                queued[self.length_class(req)] += 1
        kv = self.allocator
        return {
            "backlog_s": backlog,
            # the same work in tokens, for a router that prices it by a cost model of its own
            "backlog_tokens": backlog_tokens,
            "queued": queued,
            "running": running,
            "num_requests": sum(queued.values()) + sum(running.values()),
            "kv": {
                "used_blocks": kv.num_used_blocks,
                "free_blocks": kv.num_free_blocks,
                "utilization": kv.num_used_blocks / kv.num_blocks,
                "block_size": kv.block_size,
                "prefix_caching": kv.enable_prefix_caching,
                "cache_hit_tokens": kv.num_cache_hits,  # prompt tokens served from it, ever
            },
            "cost_model": self.cost.as_dict(),
            "step_time_over_predicted": self.step_time.ratio,
            "short_threshold": self.config.scheduler.short_threshold,
            "long_chunk_size": self.scheduler.long_chunk_size(),
            "policy": self.config.scheduler.policy,
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    # --- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; returns the outputs of requests that got a token or finished."""
        return [RequestOutput.of(req) for req in self.step_requests()]

    def step_requests(self) -> list[Request]:
        """:meth:`step`, returning the requests that got a token instead of building an output for each
        (the simulator looks only at first tokens and finishes)."""
        start = self.clock()
        batch = self.scheduler.schedule(start)
        if not batch:
            self.last_batch = None
            return []
        self.last_batch = batch
        work = batch_work(batch)  # before on_batch_done advances the computed counts
        sampled = self.runner.execute(batch)
        end = self.clock()
        self.scheduler.on_batch_done(batch, start, end)
        self.step_time.observe(self.cost.batch_time(work), end - start)
        if self.online is not None and batch.kind != "decode" and all(n > 1 for n, _ in work):
            # Prefill-only steps: decode steps follow other costs (memory traffic, per-step overhead).
            self.online.observe(work, end - start)
            if self.online.model is not self.cost:
                self.set_cost_model(self.online.model)
        self.num_steps += 1
        self.num_preemptions += len(batch.preempted)
        if log.isEnabledFor(logging.DEBUG):  # `plaserve serve --log-level debug`: every step
            log.debug(
                "step %d, %s: %.1f ms, prompt tokens %s, %d decode rows, cost model %s",
                self.num_steps,
                batch.kind,
                (end - start) * 1e3,
                [n for n, _ in work if n > 1],
                sum(1 for n, _ in work if n == 1),
                self.cost.source,
            )
        return self._process_samples(batch, sampled, end)

    def _process_samples(
        self, batch: ScheduledBatch, sampled: dict[int, int | None], now: float
    ) -> list[Request]:
        sampled_reqs = []
        for i, token in sampled.items():
            req = batch.items[i].request
            if req.finished:
                continue
            if token is None:  # no token could be drawn: this request fails, the batch goes on
                grammar_error = req.grammar.error if req.grammar is not None else ""
                log.error(
                    "request %s: %s; finishing it with an error",
                    req.request_id,
                    f"its grammar allows no token ({grammar_error})"
                    if grammar_error
                    else "the model's logits are not finite",
                )
                self.scheduler.finish(req, "error")
                self.kv_handoff.forget(req.request_id)
                req.metrics.finish_time = now
            else:
                self._append_token(req, token, now)
            sampled_reqs.append(req)
            self._release(req.request_id)  # its prompt's blocks are in the prefix cache now
            if req.finished:
                self.requests.pop(req.request_id, None)
        return sampled_reqs

    def _append_token(self, req: Request, token: int, now: float) -> None:
        req.output_token_ids.append(token)
        req.token_ids.append(token)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.token_times.append(now)
        checked = len(req.output_text)
        if req.detokenizer is not None:
            req.output_text += req.detokenizer.add(token)
        reason = self._stop_reason(req, token, checked)
        if req.grammar is not None and reason is None:
            reason = self._grammar_stop(req, token)
        if reason is not None:
            self.kv_handoff.on_finish(req)  # a prefill for a remote decode keeps its blocks
            self.scheduler.finish(req, reason)
            req.metrics.finish_time = now

    @staticmethod
    def _grammar_stop(req: Request, token: int) -> str | None:
        """Advance a constrained request's matcher past ``token``: a complete grammar ends the request
        (``stop``; only an end-of-sequence token could follow). A token the grammar refuses can only
        come from a mask not applied, a bug: the request fails rather than break its promise."""
        if not req.grammar.accept(token):
            log.error(
                "request %s: token %d outside its grammar (%s)",
                req.request_id,
                token,
                req.grammar.error,
            )
            return "error"
        return "stop" if req.grammar.stopped else None

    def _stop_reason(self, req: Request, token: int, checked: int) -> str | None:
        """Why ``req`` stops after ``token`` (None: it goes on). ``checked``: text length already
        searched for stop strings on earlier tokens."""
        p = req.params
        if len(req.output_token_ids) < p.min_tokens:  # nothing but the length limit ends it yet
            return "length" if req.num_tokens >= self.max_model_len else None
        if token in req.eos_token_ids:
            return "stop"
        if token in p.stop_token_ids:
            req.stop_reason = token
            return "stop"
        for stop in p.stop:
            at = req.output_text.find(stop, max(0, checked - len(stop) + 1))
            if at >= 0:
                req.output_text = req.output_text[
                    : at + (len(stop) if p.include_stop_str_in_output else 0)
                ]
                req.stop_reason = stop
                return "stop"
        if (
            p.max_tokens is not None and len(req.output_token_ids) >= p.max_tokens
        ) or req.num_tokens >= self.max_model_len:
            return "length"
        return None
