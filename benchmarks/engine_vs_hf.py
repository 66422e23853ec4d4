"""plaserve against Hugging Face ``transformers`` on the embedded default model (the engine-core
acceptance benchmark).

One run measures, with the same weights and the same prompts for both systems:

1. **Prefill throughput** (tokens/s) at several prompt lengths: plaserve's engine path (one
   ``LLM.generate`` with ``max_tokens=1``, timed by the engine's own prefill-chunk timestamps), our
   bare ``model.forward`` without KV cache, and ``transformers``' forward (``logits_to_keep=1``). Best of
   N repetitions, the three systems interleaved inside each repetition.
2. **Prefill FLOP rate** at one length, as a fraction of a matmul peak in the run's dtype measured in
   the same run right before and right after (the max of the two is used).
3. **Decode throughput** (tokens/s) at several batch sizes: requests of one prompt length decoding in
   lockstep through the engine, and ``transformers.generate`` on the same batch.
4. **A mixed workload** (32 requests by default, random prompt and output lengths, greedy,
   ``ignore_eos``): plaserve with the ``pla`` and ``fcfs`` policies against ``transformers.generate``
   one request at a time and in left-padded batches.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/engine_vs_hf.py [--quick] [--dtype bfloat16]
        [--sections prefill,flop,decode,mixed] [--out results.json]

Both systems run in the dtype given (float32 by default; bfloat16 is what ``--dtype auto`` picks on
CPUs with AMX or AVX512-BF16).

Progress goes to stderr; the markdown table goes to stdout.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import gc
import json
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from plaserve import LLM, SamplingParams
from plaserve.model.attention import AttentionMetadata, PrefillSeq
from plaserve.model.config import ModelConfig
from plaserve.model.default import init_random_weights
from plaserve.model.llama import LlamaForCausalLM as OurLlama
from plaserve.model.loader import load_model

# Prompt token ids are drawn uniformly below this bound, inside the default model's 512-id vocabulary.
# Prompts are token ids, never text, so which ids are bytes, specials or reserved does not matter.
MAX_PROMPT_ID = 500
# Targets of the engine-core issue (float32) and of the bfloat16 one.
TARGET_PEAK_FRACTION = {"float32": 0.70, "bfloat16": 0.60}
TARGET_SPEEDUP = 2.0
SECTIONS = ("prefill", "flop", "decode", "mixed")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Largest logit difference, ours against transformers, for the two to count as the same model. bfloat16
# keeps 8 significant bits and the two round at different points.
LOGITS_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.05}


@dataclass(frozen=True)
class Sizes:
    """Everything that sets how big (and how long) a run is, and the dtype it runs in."""

    dtype: str = "float32"
    prefill_lengths: tuple[int, ...] = (128, 1024, 2048, 4096)
    prefill_reps: int = 3
    flop_length: int = 2048
    # As many best-of repetitions as the matmul peak gets: a best-of-3 forward against a best-of-8
    # (twice) peak would put the machine's noise on one side of the ratio only.
    flop_reps: int = 8
    peak_size: int = 2048  # square matmul in the run's dtype for the peak
    peak_reps: int = 8
    decode_batches: tuple[int, ...] = (1, 16, 64)
    decode_prompt: int = 128  # tokens of each decoding request's prompt
    decode_tokens: int = 32  # tokens each generates (the first comes from the prefill)
    decode_reps: int = 3
    logits_check_length: int = 256
    num_requests: int = 32
    prompt_range: tuple[int, int] = (16, 1024)
    output_range: tuple[int, int] = (8, 256)
    hf_batch_size: int = 8
    mixed_rounds: int = 3  # every mixed-workload system runs once per round; the best round counts
    # The machine is shared: before each measurement wait (at most quiet_wait_s, quiet_budget_s in all)
    # until other processes use under 0.15 of a core; redo a prefill timing that others contended.
    quiet_wait_s: float = 30.0
    quiet_budget_s: float = 300.0
    prefill_retries: int = 2
    mixed_retries: int = (
        2  # extra mixed-workload runs (in all) for systems whose every run was contended
    )
    seed: int = 0
    # Engine sizing: the KV cache must hold max_model_len tokens; the default engine settings
    # (max_model_len 16384, 2 GiB of KV on CPU) are what the full run uses.
    max_model_len: int | None = None
    kv_cache_memory: str = "2GiB"


FULL = Sizes()
# A smoke-test run: every row of the full run at toy sizes (seconds, not minutes).
QUICK = Sizes(
    prefill_lengths=(16, 32, 64),
    prefill_reps=1,
    flop_length=64,
    flop_reps=1,
    peak_size=256,
    peak_reps=2,
    decode_batches=(1, 4),
    decode_prompt=8,
    decode_tokens=4,
    decode_reps=1,
    logits_check_length=32,
    num_requests=4,
    prompt_range=(4, 40),
    output_range=(2, 6),
    hf_batch_size=2,
    mixed_rounds=1,
    quiet_wait_s=0.0,
    prefill_retries=0,
    mixed_retries=0,
    max_model_len=256,
    kv_cache_memory="16MiB",
)


def log(msg: str) -> None:
    """Progress line on stderr (stdout is kept for the table)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class CpuMeter:
    """CPU seconds that other processes used while it ran: how contended a measurement was.

    The dev machines are shared, and with one torch thread per core a single busy neighbour stalls every
    parallel region, so a slow run should be read together with this number. Linux only (``/proc/stat``);
    elsewhere it reports None.
    """

    def __init__(self) -> None:
        self.start = self._busy(), time.process_time()
        self.others_s: float | None = None

    @staticmethod
    def _busy() -> float | None:
        try:
            with open("/proc/stat") as f:
                fields = [float(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
        return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> float | None:
        busy0, own0 = self.start
        busy1 = self._busy()
        if busy0 is not None and busy1 is not None:
            self.others_s = max(0.0, (busy1 - busy0) - (time.process_time() - own0))
        return self.others_s


class QuietGate:
    """Waits for the shared machine to go quiet before a measurement; judges whether one was contended."""

    def __init__(self, max_wait_s: float, budget_s: float, threshold_cores: float = 0.15) -> None:
        self.max_wait_s, self.budget_left_s, self.threshold = max_wait_s, budget_s, threshold_cores
        self.waited_s = 0.0

    def wait(self) -> None:
        """Sample other processes' CPU use in 0.5 s windows until it is under the threshold."""
        limit = min(self.max_wait_s, self.budget_left_s)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < limit:
            meter = CpuMeter()
            time.sleep(0.5)
            others = meter.stop()
            if others is None or others / 0.5 <= self.threshold:
                break
        waited = time.perf_counter() - t0
        self.waited_s += waited
        self.budget_left_s -= waited

    @staticmethod
    def contended(others_s: float | None, wall_s: float) -> bool:
        """Whether other processes used over a tenth of a core meanwhile (/proc/stat counts 10 ms ticks,
        hence the floor)."""
        return others_s is not None and others_s > max(0.05, 0.1 * wall_s)


# --- models --------------------------------------------------------------------------------------
def hf_config(cfg: ModelConfig) -> Any:
    """The ``transformers.LlamaConfig`` with our default model's shapes and numerics."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attn_implementation="sdpa",
    )


def default_weights(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The embedded default model's weights as ``load_model(None)`` draws them (the same seed), taken
    before its projections are fused: where their packed copies take every step, the fused model's
    ``nn.Linear`` parameters are meta tensors (docs/ARCHITECTURE.md)."""
    model = OurLlama(cfg)
    init_random_weights(model)
    return model.to(dtype).state_dict()


def build_hf_model(cfg: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
    """A ``transformers.LlamaForCausalLM`` holding exactly our default model's weights (in ``dtype``,
    SDPA attention)."""
    import transformers

    hf = transformers.LlamaForCausalLM(hf_config(cfg)).to(dtype).eval()
    missing, unexpected = hf.load_state_dict(default_weights(cfg, dtype), strict=False)
    # Every HF parameter must come from ours; ours only differs by non-persistent buffers (rope tables),
    # which state_dict() leaves out, so nothing should be unexpected either.
    if missing or unexpected:
        raise RuntimeError(f"weights do not line up: missing {missing}, unexpected {unexpected}")
    assert hf.config._attn_implementation == "sdpa"
    # plaserve runs with ignore_eos; the transformers equivalent is no eos token at all. LlamaConfig's
    # default eos id (2) is an ordinary byte in our vocabulary, and min_new_tokens would mask its logit,
    # so greedy would pick a different token whenever 2 is the argmax.
    hf.generation_config.eos_token_id = None
    hf.generation_config.bos_token_id = cfg.bos_token_id
    hf.generation_config.pad_token_id = 0
    return hf


def prefill_meta(n: int) -> AttentionMetadata:
    """Attention metadata of one prompt of ``n`` tokens, no KV cache."""
    return AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.long),
        prefill=[PrefillSeq(0, n, 0, None)],
        num_prefill_tokens=n,
    )


def our_forward(model: OurLlama, ids: torch.Tensor) -> torch.Tensor:
    """Hidden states of one prompt through our model, without KV cache."""
    n = ids.shape[0]
    return model(ids, torch.arange(n), prefill_meta(n), kv_caches=None)


def logits_max_diff(ours: OurLlama, hf: torch.nn.Module, ids: torch.Tensor) -> float:
    """Max absolute difference of every position's logits, ours against transformers."""
    mine = ours.compute_logits(our_forward(ours, ids))
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0].float()
    return (mine - ref).abs().max().item()


def random_prompt(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, MAX_PROMPT_ID, (n,), generator=gen)


def make_llm(sizes: Sizes, **kwargs: Any) -> LLM:
    """An engine on the embedded default model (same seed, hence same weights, as ``load_model``)."""
    extra = {} if sizes.max_model_len is None else {"max_model_len": sizes.max_model_len}
    return LLM(None, dtype=sizes.dtype, kv_cache_memory=sizes.kv_cache_memory, **extra, **kwargs)


def same_weights(a: OurLlama, b: OurLlama) -> bool:
    """Whether two of our models compute alike: the same logits, bit for bit, on one prompt (their
    parameters may be meta tensors, the weights living in the projections' packed copies)."""
    ids = random_prompt(16, torch.Generator().manual_seed(0))
    return torch.equal(a.compute_logits(our_forward(a, ids)), b.compute_logits(our_forward(b, ids)))


# --- timing primitives ---------------------------------------------------------------------------
def matmul_peak(
    size: int, reps: int, dtype: torch.dtype, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Best FLOP/s of a ``size``-square product in ``dtype`` over ``reps`` runs of each way (after one
    warm-up), timed by ``clock``: the faster of :func:`plaserve.cost.peak_ways` (torch's matmul and
    oneDNN's prepacked linear, as ``measure_peak_flops`` takes the peak; in float32 on an AVX-512 AMD
    EPYC the matmul, MKL's, runs at under half oneDNN's speed). engine_speed.py runs this under older
    trees too: those without ``peak_ways`` time the matmul alone."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    try:
        from plaserve.cost import peak_ways
    except ImportError:  # a tree from before it: the matmul alone
        ways = [lambda: a @ b]
    else:
        ways = peak_ways(a, b)
    best = float("inf")
    for way in ways:
        way()
        for _ in range(reps):
            t0 = clock()
            way()
            best = min(best, clock() - t0)
    return 2 * size**3 / best


def engine_prefill_seconds(llm: LLM, ids: torch.Tensor) -> tuple[float, float]:
    """(prefill seconds, TTFT seconds) of one prompt through the engine, greedy, one output token.

    Prefill seconds sum the engine's own per-chunk timestamps (scheduling, packing, forward, logits and
    sampling of each step); TTFT adds the time from ``add_request`` to the first step."""
    out = llm.generate(
        [ids.tolist()], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    )[0]
    chunks = out.metrics.prefill_chunks
    if sum(c[2] for c in chunks) != ids.shape[0]:
        raise RuntimeError(f"engine prefilled {sum(c[2] for c in chunks)} tokens of {ids.shape[0]}")
    return sum(end - start for start, end, _ in chunks), float(out.metrics.ttft)


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def hf_prefill_seconds(hf: torch.nn.Module, ids: torch.Tensor) -> float:
    """One ``transformers`` forward over the prompt (KV cache built as generate would; one logits row)."""
    with torch.inference_mode():
        return timed(lambda: hf(ids[None], logits_to_keep=1))


def our_forward_seconds(model: OurLlama, ids: torch.Tensor) -> float:
    """Our bare forward (no KV cache, no scheduling), plus the one logits row the engine would compute."""
    return timed(lambda: model.compute_logits(our_forward(model, ids)[-1:]))


def prefill_flops(cfg: ModelConfig, n: int) -> float:
    """FLOPs of a causal prefill of ``n`` tokens: 2 per weight per token outside the embedding and LM
    head, QK^T and PV over the causal half of the score matrix, and the LM head for the sampled row."""
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    linear = 2 * n * (cfg.num_params - embed)
    attn = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers * n * n / 2
    return linear + attn + 2 * cfg.hidden_size * cfg.vocab_size


# --- 1 and 2: prefill ----------------------------------------------------------------------------
PREFILL_SYSTEMS = ("engine", "forward", "hf")


def measure_prefill(
    lengths: tuple[int, ...],
    reps: int,
    llm: LLM,
    ours: OurLlama,
    hf: torch.nn.Module,
    seed: int,
    gate: QuietGate,
    retries: int,
) -> dict[int, dict[str, float]]:
    """Best-of-``reps`` prefill seconds per length and system. Inside each repetition every length and
    system runs once, the systems' order rotating so none always runs first after a different size.
    A timing that other processes contended is redone up to ``retries`` times (the best is kept either
    way); ``contended`` counts the repetitions whose every attempt was contended."""
    gen = torch.Generator().manual_seed(seed)
    prompts = {n: random_prompt(n, gen) for n in lengths}
    best = {
        n: {s: float("inf") for s in PREFILL_SYSTEMS} | {"ttft": float("inf"), "contended": 0}
        for n in lengths
    }

    def once(system: str, ids: torch.Tensor) -> tuple[float, float | None]:
        if system == "engine":
            return engine_prefill_seconds(llm, ids)
        if system == "forward":
            return our_forward_seconds(ours, ids), None
        return hf_prefill_seconds(hf, ids), None

    for rep in range(reps):
        for n in lengths:
            order = PREFILL_SYSTEMS[rep % 3 :] + PREFILL_SYSTEMS[: rep % 3]
            for system in order:
                for _ in range(1 + retries):
                    gate.wait()
                    meter = CpuMeter()
                    secs, ttft = once(system, prompts[n])
                    best[n][system] = min(best[n][system], secs)
                    if ttft is not None:
                        best[n]["ttft"] = min(best[n]["ttft"], ttft)
                    if not gate.contended(meter.stop(), secs):
                        break
                else:
                    best[n]["contended"] += 1
            log(
                f"prefill rep {rep + 1}/{reps} L={n}: "
                + ", ".join(f"{s} {n / best[n][s]:,.0f} tok/s" for s in PREFILL_SYSTEMS)
            )
    return best


def prefill_section(
    sizes: Sizes, llm: LLM, ours: OurLlama, hf: torch.nn.Module, gate: QuietGate
) -> list[dict[str, Any]]:
    """Prefill throughput rows."""
    log("prefill throughput ...")
    meter = CpuMeter()
    best = measure_prefill(
        sizes.prefill_lengths,
        sizes.prefill_reps,
        llm,
        ours,
        hf,
        sizes.seed,
        gate,
        sizes.prefill_retries,
    )
    prefill_others = meter.stop()
    rows = [
        {
            "length": n,
            **{f"{s}_tok_s": n / best[n][s] for s in PREFILL_SYSTEMS},
            "engine_s": best[n]["engine"],
            "engine_ttft_s": best[n]["ttft"],
            "forward_s": best[n]["forward"],
            "hf_s": best[n]["hf"],
            "engine_over_hf": best[n]["hf"] / best[n]["engine"],
            "others_cpu_s_section": prefill_others,
            "contended_reps": best[n]["contended"],
        }
        for n in sizes.prefill_lengths
    ]
    return rows


def flop_section(
    sizes: Sizes, llm: LLM, ours: OurLlama, hf: torch.nn.Module, cfg: ModelConfig, gate: QuietGate
) -> dict[str, Any]:
    """The FLOP-rate row, with its matmul peak bracketing the forwards."""
    n = sizes.flop_length
    log(f"FLOP rate at L={n}: matmul peak, forwards, matmul peak ...")
    meter = CpuMeter()
    gate.wait()
    peak_before = matmul_peak(sizes.peak_size, sizes.peak_reps, DTYPES[sizes.dtype])
    fl = measure_prefill(
        (n,), sizes.flop_reps, llm, ours, hf, sizes.seed + 1, gate, sizes.prefill_retries
    )[n]
    gate.wait()
    peak_after = matmul_peak(sizes.peak_size, sizes.peak_reps, DTYPES[sizes.dtype])
    peak = max(peak_before, peak_after)
    flops = prefill_flops(cfg, n)
    flop = {
        "length": n,
        "flops": flops,
        "peak_before": peak_before,
        "peak_after": peak_after,
        "peak": peak,
        "peak_matmul_size": sizes.peak_size,
        "others_cpu_s": meter.stop(),
        "contended_reps": fl["contended"],
        **{f"{s}_s": fl[s] for s in PREFILL_SYSTEMS},
        **{f"{s}_flop_s": flops / fl[s] for s in PREFILL_SYSTEMS},
        **{f"{s}_fraction": flops / fl[s] / peak for s in PREFILL_SYSTEMS},
    }
    flop["target"] = TARGET_PEAK_FRACTION[sizes.dtype]
    flop["target_met"] = flop["engine_fraction"] >= flop["target"]
    log(
        f"peak {peak / 1e9:.1f} GFLOP/s; engine {flop['engine_fraction']:.1%}, forward "
        f"{flop['forward_fraction']:.1%}, hf {flop['hf_fraction']:.1%}"
    )
    return flop


# --- 3: decode -----------------------------------------------------------------------------------
def engine_decode_tok_s(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s of ``prompts`` generating ``new_tokens`` each in lockstep, from the engine's own
    token timestamps: every token after each request's first, over the time from the first to the last."""
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    )
    first = max(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.token_times[-1] for o in outs)
    if (
        any(len(o.token_ids) != new_tokens for o in outs)
        or min(o.metrics.token_times[-1] for o in outs) <= first
    ):
        raise RuntimeError("the requests did not decode in lockstep")
    return len(prompts) * (new_tokens - 1) / (last - first)


def hf_decode_tok_s(hf: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s of one batch through ``transformers.generate``: the time of ``new_tokens`` less
    that of one (the prefill and its token)."""
    full = timed(lambda: hf_generate(hf, prompts, new_tokens))
    prefill = timed(lambda: hf_generate(hf, prompts, 1))
    return len(prompts) * (new_tokens - 1) / max(1e-9, full - prefill)


def decode_section(sizes: Sizes, hf: torch.nn.Module, gate: QuietGate) -> list[dict[str, Any]]:
    """Decode tokens/s per batch size, plaserve and transformers interleaved, best of ``decode_reps``."""
    gen = torch.Generator().manual_seed(sizes.seed + 3)
    rows = []
    for batch in sizes.decode_batches:
        prompts = [random_prompt(sizes.decode_prompt, gen).tolist() for _ in range(batch)]
        # fcfs with room for every prompt in one step: the first step prefills them all, then every
        # step decodes the whole batch.
        llm = make_llm(
            sizes,
            policy="fcfs",
            enable_prefix_caching=False,
            max_num_seqs=max(64, batch),
            max_num_batched_tokens=max(2048, batch * sizes.decode_prompt),
        )
        engine_decode_tok_s(llm, prompts[:1], 3)  # first-call costs out of the timing
        hf_generate(hf, prompts[:1], 2)
        best = {"engine": 0.0, "hf": 0.0}
        meter = CpuMeter()
        for _ in range(sizes.decode_reps):
            gate.wait()
            best["engine"] = max(
                best["engine"], engine_decode_tok_s(llm, prompts, sizes.decode_tokens)
            )
            gate.wait()
            best["hf"] = max(best["hf"], hf_decode_tok_s(hf, prompts, sizes.decode_tokens))
        rows.append(
            {
                "batch": batch,
                "engine_tok_s": best["engine"],
                "hf_tok_s": best["hf"],
                "engine_over_hf": best["engine"] / best["hf"],
                "others_cpu_s": meter.stop(),
            }
        )
        log(
            f"decode batch {batch}: engine {best['engine']:,.0f} tok/s, transformers {best['hf']:,.0f} tok/s"
        )
        del llm
        gc.collect()
    return rows


# --- 4: mixed workload ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """One request of the mixed workload."""

    prompt: list[int]
    max_tokens: int


def make_workload(sizes: Sizes) -> list[Job]:
    """Seeded prompt lengths, output lengths and prompt ids, identical for every system."""
    rng = random.Random(sizes.seed)
    gen = torch.Generator().manual_seed(sizes.seed)
    jobs = []
    for _ in range(sizes.num_requests):
        n, o = rng.randint(*sizes.prompt_range), rng.randint(*sizes.output_range)
        jobs.append(Job(random_prompt(n, gen).tolist(), o))
    return jobs


@dataclass
class RunResult:
    """One workload run: wall seconds, this process's CPU seconds, other processes' CPU seconds
    meanwhile, and every request's output ids."""

    wall_s: float
    cpu_s: float
    others_cpu_s: float | None
    outputs: list[list[int]]
    tokens_computed: int  # generated tokens including those of padded batch rows past their length


def run_timed(
    fn: Callable[[], tuple[list[list[int]], int]], gate: QuietGate | None = None
) -> RunResult:
    gc.collect()
    if gate is not None:
        gate.wait()
    meter = CpuMeter()
    w0, c0 = time.perf_counter(), time.process_time()
    outputs, computed = fn()
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    return RunResult(wall, cpu, meter.stop(), outputs, computed)


def run_plaserve(llm: LLM, jobs: list[Job], gate: QuietGate | None = None) -> RunResult:
    """All jobs in one ``generate`` call (offline batch: every request arrives at once)."""
    params = [SamplingParams(max_tokens=j.max_tokens, temperature=0, ignore_eos=True) for j in jobs]

    def go() -> tuple[list[list[int]], int]:
        outs = llm.generate([j.prompt for j in jobs], params)
        if any(o.num_cached_tokens for o in outs):
            raise RuntimeError(
                "prompts were served from the prefix cache: use a fresh engine per run"
            )
        return [o.token_ids for o in outs], sum(len(o.token_ids) for o in outs)

    return run_timed(go, gate)


def hf_generate(hf: torch.nn.Module, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
    """Greedy ``generate`` of exactly ``new_tokens`` for left-padded ``prompts``; returns the new ids."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[:, width:]


def run_hf_one_by_one(
    hf: torch.nn.Module, jobs: list[Job], gate: QuietGate | None = None
) -> RunResult:
    def go() -> tuple[list[list[int]], int]:
        outs = []
        for i, j in enumerate(jobs):
            outs.append(hf_generate(hf, [j.prompt], j.max_tokens)[0].tolist())
            if (i + 1) % 4 == 0 or i + 1 == len(jobs):
                log(f"  transformers one by one: {i + 1}/{len(jobs)} requests")
        return outs, sum(j.max_tokens for j in jobs)

    return run_timed(go, gate)


def run_hf_batched(
    hf: torch.nn.Module, jobs: list[Job], batch: int, gate: QuietGate | None = None
) -> RunResult:
    """Batches of ``batch`` jobs in arrival order, left padded; each batch generates the longest output
    of its members for every row (how ``generate`` batches), and each output is cut to its length."""

    def go() -> tuple[list[list[int]], int]:
        outs, computed = [], 0
        for s in range(0, len(jobs), batch):
            group = jobs[s : s + batch]
            longest = max(j.max_tokens for j in group)
            new = hf_generate(hf, [j.prompt for j in group], longest)
            outs += [new[row, : j.max_tokens].tolist() for row, j in enumerate(group)]
            computed += longest * len(group)
            log(f"  transformers batched: {min(s + batch, len(jobs))}/{len(jobs)} requests")
        return outs, computed

    return run_timed(go, gate)


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, float]:
    """(requests with identical outputs, fraction of tokens before each request's first divergence)."""
    same, prefix, total = 0, 0, 0
    for x, y in zip(a, b):
        same += x == y
        k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        prefix, total = prefix + k, total + len(x)
    return same, prefix / max(1, total)


MIXED_SYSTEMS = ("plaserve_pla", "plaserve_fcfs", "hf_batched", "hf_one_by_one")


def run_mixed_system(
    name: str, sizes: Sizes, hf: torch.nn.Module, jobs: list[Job], gate: QuietGate
) -> RunResult:
    """One timed run of the workload on one system. plaserve gets a fresh engine each time: a reused
    one would serve the repeated prompts from its prefix cache."""
    warm = Job(jobs[0].prompt[:8], 2)
    if name.startswith("plaserve_"):
        llm = make_llm(sizes, policy=name.removeprefix("plaserve_"))
        # first-call costs (allocator, kernel selection) out of the timing
        run_plaserve(llm, [warm, warm])
        result = run_plaserve(llm, jobs, gate)
        del llm
        gc.collect()
        return result
    hf_generate(hf, [warm.prompt], 2)
    if name == "hf_batched":
        return run_hf_batched(hf, jobs, sizes.hf_batch_size, gate)
    return run_hf_one_by_one(hf, jobs, gate)


def mixed_section(sizes: Sizes, hf: torch.nn.Module, gate: QuietGate) -> dict[str, Any]:
    """The mixed workload through plaserve (pla, fcfs) and transformers (one by one, batched).

    Each round runs every system once, the order rotating between rounds so that no system always
    follows the same one; each system's best round is compared (contention only ever adds time)."""
    jobs = make_workload(sizes)
    wanted = sum(j.max_tokens for j in jobs)
    log(
        f"mixed workload: {len(jobs)} requests, {sum(len(j.prompt) for j in jobs)} prompt tokens, "
        f"{wanted} output tokens, {sizes.mixed_rounds} round(s)"
    )
    runs: dict[str, list[RunResult]] = {name: [] for name in MIXED_SYSTEMS}

    def run(name: str, label: str) -> None:
        log(f"{label}: {name} ...")
        r = run_mixed_system(name, sizes, hf, jobs, gate)
        lengths = [len(o) for o in r.outputs]
        if lengths != [j.max_tokens for j in jobs]:
            raise RuntimeError(f"{name} produced output lengths {lengths}")
        log(
            f"{label}: {name} {r.wall_s:.1f} s (other processes used {_secs(r.others_cpu_s)} CPU s)"
        )
        runs[name].append(r)

    for rnd in range(sizes.mixed_rounds):
        k = rnd % len(MIXED_SYSTEMS)
        for name in MIXED_SYSTEMS[k:] + MIXED_SYSTEMS[:k]:
            run(name, f"round {rnd + 1}/{sizes.mixed_rounds}")
    # A system none of whose runs was clean gets another chance, cheapest systems first.
    retries = sizes.mixed_retries
    for name in sorted(MIXED_SYSTEMS, key=lambda n: min(r.wall_s for r in runs[n])):
        while retries > 0 and all(
            QuietGate.contended(r.others_cpu_s, r.wall_s) for r in runs[name]
        ):
            retries -= 1
            run(name, "extra run (every run so far was contended)")

    best = {name: min(rs, key=lambda r: r.wall_s) for name, rs in runs.items()}
    best_hf = min(("hf_one_by_one", "hf_batched"), key=lambda k: best[k].wall_s)
    result: dict[str, Any] = {
        "num_requests": len(jobs),
        "prompt_tokens": sum(len(j.prompt) for j in jobs),
        "output_tokens": wanted,
        "prompt_lengths": [len(j.prompt) for j in jobs],
        "output_lengths": [j.max_tokens for j in jobs],
        "hf_batch_size": sizes.hf_batch_size,
        "rounds": sizes.mixed_rounds,
        "best_hf": best_hf,
        "runs": {},
    }
    reference = best["hf_one_by_one"].outputs
    for name in MIXED_SYSTEMS:
        r = best[name]
        same, prefix = agreement(r.outputs, reference)
        result["runs"][name] = {
            "wall_s": r.wall_s,
            "cpu_s": r.cpu_s,
            "others_cpu_s": r.others_cpu_s,
            "wall_s_runs": [x.wall_s for x in runs[name]],
            "others_cpu_s_runs": [x.others_cpu_s for x in runs[name]],
            "contended": QuietGate.contended(r.others_cpu_s, r.wall_s),
            "tokens_computed": r.tokens_computed,
            "output_tok_s": wanted / r.wall_s,
            "identical_to_hf_one_by_one": same,
            "token_agreement_with_hf_one_by_one": prefix,
            "speedup_vs_best_hf": best[best_hf].wall_s / r.wall_s,
        }
    for policy in ("pla", "fcfs"):
        result[f"target_met_{policy}"] = (
            result["runs"][f"plaserve_{policy}"]["speedup_vs_best_hf"] >= TARGET_SPEEDUP
        )
    return result


# --- the whole run -------------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import transformers

    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
    }


def run_benchmark(sizes: Sizes = FULL, sections: tuple[str, ...] = SECTIONS) -> dict[str, Any]:
    """Run ``sections`` (all by default); returns the results as a JSON-ready dict."""
    t_start = time.perf_counter()
    results: dict[str, Any] = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "sizes": dataclasses.asdict(sizes),
        "sections": list(sections),
        "machine": machine_info() | {"dtype": sizes.dtype},
    }
    dtype = DTYPES[sizes.dtype]
    loaded = load_model(None, dtype, torch.device("cpu"))
    ours, cfg = loaded.model, loaded.config
    hf = build_hf_model(cfg, dtype)
    gen = torch.Generator().manual_seed(sizes.seed + 2)
    diff = logits_max_diff(ours, hf, random_prompt(sizes.logits_check_length, gen))
    log(f"logits check (L={sizes.logits_check_length}): max |ours - transformers| = {diff:.2e}")
    if diff >= LOGITS_TOLERANCE[sizes.dtype]:
        raise RuntimeError(
            f"logits differ by {diff:.2e} >= {LOGITS_TOLERANCE[sizes.dtype]}: the comparison would "
            f"not be apples to apples"
        )
    results["model"] = {
        "name": loaded.name,
        "num_params": cfg.num_params,
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_hidden_layers,
        "logits_check_length": sizes.logits_check_length,
        "logits_max_abs_diff": diff,
    }

    # The prefill engine runs one prompt per call, whole (no chunking up to 8192 tokens), with nothing
    # served from the prefix cache: the repetitions all recompute the same prompt.
    llm = make_llm(sizes, policy="fcfs", max_num_batched_tokens=8192, enable_prefix_caching=False)
    if not same_weights(llm.engine.loaded.model, ours):
        raise RuntimeError("the engine's default model differs from load_model(None)'s")
    engine_prefill_seconds(llm, random_prompt(16, gen))  # warm-up
    # One waiting budget for the whole run, so a busy machine cannot stretch it without bound.
    gate = QuietGate(sizes.quiet_wait_s, sizes.quiet_budget_s)
    if "prefill" in sections:
        results["prefill"] = prefill_section(sizes, llm, ours, hf, gate)
    if "flop" in sections:
        results["flop_rate"] = flop_section(sizes, llm, ours, hf, cfg, gate)
    del llm
    gc.collect()

    if "decode" in sections:
        results["decode"] = decode_section(sizes, hf, gate)
    if "mixed" in sections:
        results["mixed"] = mixed_section(sizes, hf, gate)
    results["quiet_wait_s"] = gate.waited_s
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["runtime_s"] = time.perf_counter() - t_start
    return results


def _secs(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def format_table(r: dict[str, Any], command: str = "") -> str:
    """The results as markdown (the text that goes into docs/BENCHMARKS.md)."""
    m = r["machine"]
    out = []
    if command:
        out.append(f"Command: `{command}`  ")
    out.append(
        f"Date: {r['date']}; runtime {r['runtime_s']:.0f} s, of which {r['quiet_wait_s']:.0f} s waiting for "
        f"other processes to go quiet (shared machine)  "
    )
    out.append(
        f"Machine: {m['cpu']}, {m['cpu_count']}-core CPU, {m['torch_threads']} torch threads, "
        f"{m['dtype']}; torch {m['torch']}, transformers {m['transformers']} (SDPA attention); "
        f"load average {m['loadavg_start'][0]:.2f} at start, {m['loadavg_end'][0]:.2f} at end  "
    )
    out.append(
        f"Model: {r['model']['name']} ({r['model']['num_params'] / 1e6:.1f} M parameters, "
        f"{r['model']['num_layers']} layers, hidden {r['model']['hidden_size']}); same weights in both; "
        f"logits max |ours - transformers| = {r['model']['logits_max_abs_diff']:.2e} "
        f"on a {r['model']['logits_check_length']}-token prompt"
    )
    out.append("")
    if "prefill" in r:
        reps = r["sizes"]["prefill_reps"]
        out.append(
            f"**Prefill throughput** (tokens/s, best of {reps}, systems interleaved; same prompt for all)"
        )
        out.append("")
        out.append(
            "| L | plaserve engine | plaserve model.forward | transformers forward | engine / transformers | "
            "contended reps |"
        )
        out.append("|---:|---:|---:|---:|---:|---:|")
        for row in r["prefill"]:
            out.append(
                f"| {row['length']} | {row['engine_tok_s']:,.0f} | {row['forward_tok_s']:,.0f} | "
                f"{row['hf_tok_s']:,.0f} | {row['engine_over_hf']:.2f}x | {row['contended_reps']} |"
            )
        out.append("")
        out.append(
            f"Other processes used {_secs(r['prefill'][0]['others_cpu_s_section'])} CPU s during this "
            f"section. Contended reps: (length, system) timings during which other processes used over a "
            f"tenth of a core even after {r['sizes']['prefill_retries']} retries (the best attempt is kept)."
        )
        out.append("")
        out.append(
            "plaserve engine: `LLM.generate(..., max_tokens=1)` (fcfs, 8192-token steps, prefix cache off), "
            "timed by the engine's prefill-step timestamps (scheduling + forward + logits + sampling). "
            "model.forward: our bare forward, no KV cache. transformers: `model(ids, logits_to_keep=1)` "
            "(builds its KV cache, as `generate` does)."
        )
        out.append("")
    if "flop_rate" in r:
        fr = r["flop_rate"]
        n = fr["length"]
        out.append(
            f"**Prefill FLOP rate at L = {n}** ({fr['flops'] / 1e9:.1f} GFLOP per prefill; best of "
            f"{r['sizes']['flop_reps']}); matmul peak ({fr['peak_matmul_size']}^3 {m['dtype']}, best of "
            f"{r['sizes']['peak_reps']}): {fr['peak_before'] / 1e9:.1f} GFLOP/s before, "
            f"{fr['peak_after'] / 1e9:.1f} after, max {fr['peak'] / 1e9:.1f} used; other processes used "
            f"{_secs(fr['others_cpu_s'])} CPU s meanwhile; contended reps {fr['contended_reps']}"
        )
        out.append("")
        out.append("| system | time s | GFLOP/s | fraction of matmul peak |")
        out.append("|---|---:|---:|---:|")
        names = {
            "engine": "plaserve engine",
            "forward": "plaserve model.forward",
            "hf": "transformers forward",
        }
        for s, label in names.items():
            out.append(
                f"| {label} | {fr[f'{s}_s']:.3f} | {fr[f'{s}_flop_s'] / 1e9:.1f} | {fr[f'{s}_fraction']:.1%} |"
            )
        out.append("")
        out.append(
            f"Target: plaserve engine >= {fr['target']:.0%} of peak: "
            f"**{'met' if fr['target_met'] else 'NOT met'}** ({fr['engine_fraction']:.1%})."
        )
        out.append("")
    if "decode" in r:
        reps = r["sizes"]["decode_reps"]
        out.append(
            f"**Decode throughput** (tokens/s, best of {reps}, systems interleaved): a batch of requests of "
            f"{r['sizes']['decode_prompt']} prompt tokens each generating {r['sizes']['decode_tokens']} "
            f"tokens, greedy; the tokens after each request's first over the time from the first to the last"
        )
        out.append("")
        out.append("| batch | plaserve engine | transformers `generate` | engine / transformers |")
        out.append("|---:|---:|---:|---:|")
        for row in r["decode"]:
            out.append(
                f"| {row['batch']} | {row['engine_tok_s']:,.0f} | {row['hf_tok_s']:,.0f} | "
                f"{row['engine_over_hf']:.2f}x |"
            )
        out.append("")
        out.append(
            "plaserve engine: one `LLM.generate` of the batch (fcfs, every prompt in the first step, prefix "
            "cache off), timed by the engine's token timestamps. transformers: `generate` of the batch, "
            "its time for one token subtracted."
        )
        out.append("")
    if "mixed" in r:
        mx = r["mixed"]
        bs = mx["hf_batch_size"]
        out.append(
            f"**Mixed workload**: {mx['num_requests']} requests, prompts {r['sizes']['prompt_range'][0]}-"
            f"{r['sizes']['prompt_range'][1]} tokens ({mx['prompt_tokens']} in all), outputs "
            f"{r['sizes']['output_range'][0]}-{r['sizes']['output_range'][1]} tokens ({mx['output_tokens']} in "
            f"all), seeded; greedy, `ignore_eos`, every output exactly its length; all requests submitted at "
            f"once; {mx['rounds']} round(s), every system once per round (order rotating), then up to "
            f"{r['sizes']['mixed_retries']} extra runs for systems none of whose runs was clean; best run shown"
        )
        out.append("")
        out.append(
            "| system | wall s (best) | wall s, each run | other processes' CPU s, each run | "
            "tokens generated | output tokens/s | identical outputs vs transformers one by one | "
            "speedup vs best transformers | best run contended |"
        )
        out.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        labels = {
            "plaserve_pla": "plaserve, policy pla (default)",
            "plaserve_fcfs": "plaserve, policy fcfs",
            "hf_one_by_one": "transformers `generate`, one by one",
            "hf_batched": f"transformers `generate`, left-padded batches of {bs}",
        }
        for key, label in labels.items():
            run = mx["runs"][key]
            rounds = ", ".join(f"{w:.1f}" for w in run["wall_s_runs"])
            others = ", ".join(_secs(o) for o in run["others_cpu_s_runs"])
            out.append(
                f"| {label} | {run['wall_s']:.1f} | {rounds} | {others} | {run['tokens_computed']} | "
                f"{run['output_tok_s']:.1f} | {run['identical_to_hf_one_by_one']}/{mx['num_requests']} | "
                f"{run['speedup_vs_best_hf']:.2f}x | {'yes' if run['contended'] else 'no'} |"
            )
        out.append("")
        out.append(
            f"Tokens generated counts padded-batch waste: each batch of {bs} generates its longest output "
            f"for every row. Best transformers run: {labels[mx['best_hf']]}. A run is contended when other "
            f"processes used over a tenth of a core meanwhile."
        )
        out.append(
            f"Target: plaserve >= {TARGET_SPEEDUP:.0f}x faster than the better transformers run: "
            f"pla **{'met' if mx['target_met_pla'] else 'NOT met'}** "
            f"({mx['runs']['plaserve_pla']['speedup_vs_best_hf']:.2f}x), fcfs "
            f"**{'met' if mx['target_met_fcfs'] else 'NOT met'}** "
            f"({mx['runs']['plaserve_fcfs']['speedup_vs_best_hf']:.2f}x)."
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="toy sizes: a smoke test of every row")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="float32", help="both systems' dtype"
    )
    parser.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated sections to run, of {','.join(SECTIONS)} (default: all)",
    )
    parser.add_argument("--out", help="also write the results as JSON to this path")
    args = parser.parse_args(argv)
    sections = tuple(x for x in args.sections.split(",") if x)
    if not sections or set(sections) - set(SECTIONS):
        parser.error(f"--sections takes some of {','.join(SECTIONS)}")
    sizes = dataclasses.replace(QUICK if args.quick else FULL, dtype=args.dtype)
    results = run_benchmark(sizes, sections)
    command = "PYTHONPATH=src .venv/bin/python benchmarks/engine_vs_hf.py" + (
        " --quick" if args.quick else ""
    )
    command += "" if args.dtype == "float32" else f" --dtype {args.dtype}"
    command += "" if sections == SECTIONS else f" --sections {','.join(sections)}"
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    print(format_table(results, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
