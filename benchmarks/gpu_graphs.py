"""The static prefill and decode grids on a GPU: capture, replay == eager, launch time, latency.

The GPU check of issues 3 and 17, one command of a few minutes for a session lent a device:

    PYTHONPATH=src python benchmarks/gpu_graphs.py --out /tmp/gpu_graphs

``--e2e-only`` runs the end-to-end burst alone; ``--reverse-e2e`` runs its systems in reverse order (the
first engine of a process can pay one-time costs the others do not).

It builds a ~0.5B-parameter Llama with random weights in bfloat16 on CUDA, captures the pla scheduler's
grid as CUDA graphs (with a progress bar, timed, with the memory the graph pool takes), and then for
every shape of batch 1-16 x bucket 64-512:

* **exactness**: a right-padded batch of prompts (lengths in ``(bucket/2, bucket]``) through the graph
  replay, through the same static buffers run eagerly, and through the varlen eager path (no padding):
  the largest logit difference of the real rows, last-token argmax agreement, and the largest
  difference of the K/V each path wrote;
* **CPU launch time**: host time of one ``StaticRunner.run`` (input copies + ``graph.replay()``) against
  the same call running the eager forward, no synchronisation inside the timed span, median of
  ``--launch-reps``;
* **latency**: one prefill step (``ModelRunner.execute``: pack, forward, logits of the last tokens,
  sampling) timed end to end with synchronisation, median of ``--latency-reps``, for the graph, the
  static eager path and the varlen eager path (what pla runs when padding does not pay);
* **decode graphs**: for every decode batch of 1-64 rows over contexts of ``decode_contexts`` tokens,
  the step through a captured ``(batch, blocks)`` decode graph, through the same static buffers run
  eagerly, and through the varlen eager path: largest logit and K/V differences, argmax agreement,
  host launch time of one decode runner call, and the latency of one whole decode step;
* **end to end**: a burst of short prompts through whole engines on the same weights: pla with padded
  batches (graph replays), pla varlen, fcfs, and fcfs with no CUDA graphs at all: wall time, TTFT
  p50 / p99, grid hits, and how many greedy outputs equal fcfs's.

Every row is also printed to stderr as JSON when it is measured, so a run cut short keeps what it
had. Prints a table and writes ``gpu_graphs.json`` (and the table as ``gpu_graphs.md``) under ``--out``.
``--device cpu`` runs the same code on a small float32 model without capture (the graph columns read
"-"); ``tests/benchmarks/test_gpu_graphs_smoke.py`` runs it that way so the script keeps working.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from plaserve import EngineConfig, LLMEngine, SamplingParams
from plaserve.engine.graphs import DecodeRunner, GraphGrid
from plaserve.engine.runner import ModelRunner, pack
from plaserve.model.config import ModelConfig
from plaserve.model.default import DEFAULT_CONFIG
from plaserve.model.loader import LoadedModel, random_model
from plaserve.scheduler.base import BatchItem, ScheduledBatch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported by path
from engine_speed import QWEN05_SHAPE  # noqa: E402

# Qwen2.5-0.5B's layer shapes as a plain Llama (no q/k/v bias) with a 32k vocabulary and an untied head.
LLAMA_05B = ModelConfig(
    **{
        **QWEN05_SHAPE,
        "architecture": "LlamaForCausalLM",
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
        "qkv_bias": False,
        "tie_word_embeddings": False,
    }
)


@dataclasses.dataclass(frozen=True)
class Setup:
    """What one run measures, and on what."""

    model: ModelConfig
    device: str
    dtype: str
    batches: tuple[int, ...]
    buckets: tuple[int, ...]
    launch_reps: int
    latency_reps: int
    kv_cache_memory: str
    e2e_requests: int  # the end-to-end burst: this many short prompts at once ...
    e2e_output: int  # ... of this many output tokens each
    decode_batches: tuple[int, ...]  # decode steps of this many rows ...
    decode_contexts: tuple[int, ...]  # ... each over this many cached tokens


GPU = Setup(
    LLAMA_05B,
    "cuda",
    "bfloat16",
    (1, 2, 4, 8, 16),
    (64, 128, 256, 512),
    50,
    20,
    "8GiB",
    256,
    16,
    (1, 2, 4, 8, 16, 32, 64),
    (512, 2048),
)
CPU = Setup(
    DEFAULT_CONFIG, "cpu", "float32", (1, 2, 4), (64, 128), 3, 3, "256MiB", 12, 4, (1, 4), (40,)
)

# The end-to-end systems: whole engines on the same weights. "pla padded" replays the captured grid on
# CUDA (static buffers run eagerly on CPU); "pla varlen" is pla without padding; fcfs is vLLM's default.
E2E_SYSTEMS = {
    "pla padded": {"policy": "pla", "pad_short_batches": "always"},
    "pla varlen": {"policy": "pla", "pad_short_batches": "never"},
    "fcfs": {"policy": "fcfs"},
    "fcfs, no graphs": {"policy": "fcfs", "use_cuda_graphs": False},
}


def load(setup: Setup) -> LoadedModel:
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[
        setup.dtype
    ]
    return random_model(setup.model, dtype, torch.device(setup.device), name="random-llama")


def build_engine(setup: Setup, loaded: LoadedModel, **overrides: object) -> LLMEngine:
    """An engine on ``loaded``; by default pla with padded short batches and an uncaptured (eager) grid
    holding every measured shape."""
    args = dict(policy="pla", pad_short_batches="always", use_cuda_graphs=False) | overrides
    config = EngineConfig.from_kwargs(
        device=setup.device,
        dtype=setup.dtype,
        kv_cache_memory=setup.kv_cache_memory,
        max_model_len=max(2048, max(setup.decode_contexts) + 2),
        enable_prefix_caching=False,
        short_threshold=max(setup.buckets),
        max_short_batch=max(setup.batches),
        # The default 2048-token cap on a short batch would leave out 8 x 512 and 16 x 256 and up.
        max_num_batched_tokens=max(setup.batches) * max(setup.buckets),
        **args,
    )
    return LLMEngine(config, loaded=loaded)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def capture_grid(engine: LLMEngine) -> tuple[GraphGrid | None, dict]:
    """Capture the scheduler's whole grid as CUDA graphs (None on CPU), timed, with its memory."""
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    shapes = engine.scheduler.static_shapes()
    # What the engine's cuda_graph_memory budget assumes the largest shape takes, to compare with the pool.
    per_token = engine.model_config.activation_bytes_per_token(torch.finfo(engine.dtype).bits // 8)
    info: dict = {
        "shapes": len(shapes),
        "estimated_mib": per_token * max(b * k for b, k in shapes) / 2**20,
    }
    return capture(runner, shapes, info), info


def capture(
    runner: ModelRunner, shapes: list[tuple[int, int]], info: dict, decode: bool = False
) -> GraphGrid | None:
    """``shapes`` captured as CUDA graphs, the seconds and memory it took added to ``info``; None on CPU,
    or when the capture fails (its error in ``info``: a one-shot device run reports it, goes on eager)."""
    if runner.device.type != "cuda":
        return None
    sync(runner.device)
    torch.cuda.empty_cache()  # cached blocks released during the capture would read as a negative pool
    reserved = torch.cuda.memory_reserved(runner.device)
    start = time.perf_counter()
    try:
        grid = GraphGrid(
            runner.model,
            runner.kv_caches,
            shapes,
            runner.block_size,
            runner.device,
            capture=True,
            decode=decode,
        )
        sync(runner.device)
    except Exception as exc:  # noqa: BLE001
        info["capture_error"] = f"{type(exc).__name__}: {exc}"
        return None
    info.update(
        capture_s=time.perf_counter() - start,
        graph_pool_mib=(torch.cuda.memory_reserved(runner.device) - reserved) / 2**20,
    )
    return grid


def start_batch(engine: LLMEngine, batch: int, bucket: int, gen: torch.Generator) -> ScheduledBatch:
    """``batch`` new prompts of random lengths in ``(bucket/2, bucket]``, admitted, as one short batch."""
    items = []
    for _ in range(batch):
        n = int(torch.randint(bucket // 2 + 1, bucket + 1, (1,), generator=gen))
        ids = torch.randint(0, engine.model_config.vocab_size, (n,), generator=gen).tolist()
        req = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
        assert engine.scheduler.try_start(req, n) == n, "KV cache too small for the batch"
        items.append(BatchItem(req, n))
    return ScheduledBatch(items, kind="short", bucket=bucket)


def release(engine: LLMEngine, batch: ScheduledBatch) -> None:
    for it in batch.items:
        engine.abort(it.request.request_id)


def kv_of(engine: LLMEngine, batch: ScheduledBatch) -> torch.Tensor:
    """K and V of every layer at the batch's real tokens, ``[layers, 2, tokens, heads, dim]``."""
    bs = engine.config.block_size
    slots = torch.tensor(
        [
            it.request.block_table[p // bs] * bs + p % bs
            for it in batch.items
            for p in range(it.num_tokens)
        ],
        device=engine.device,
    )
    return torch.stack(
        [
            torch.stack([k.flatten(0, 1)[slots], v.flatten(0, 1)[slots]])
            for k, v in engine.runner.kv_caches
        ]
    )


def path_outputs(
    engine: LLMEngine, batch: ScheduledBatch, grid: GraphGrid | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the real (unpadded) rows and the K/V written, running ``batch`` through ``grid``
    (padded), or through the varlen eager path when ``batch.bucket`` is None."""
    runner = engine.runner
    runner.grid = grid
    logits = runner.logits(batch).float()
    if batch.bucket is not None:  # drop each prompt's padding rows
        logits = torch.cat(
            [
                logits[i * batch.bucket : i * batch.bucket + it.num_tokens]
                for i, it in enumerate(batch.items)
            ]
        )
    return logits, kv_of(engine, batch).float()


def compare(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    batch: ScheduledBatch,
) -> dict:
    """Largest logit and K/V differences, and how many prompts' last-token argmax agree."""
    last = torch.tensor(
        [sum(it.num_tokens for it in batch.items[: i + 1]) - 1 for i in range(len(batch.items))]
    )
    agree = (a[0][last].argmax(-1) == b[0][last].argmax(-1)).sum().item()
    return {
        "logit_max_diff": (a[0] - b[0]).abs().max().item(),
        "kv_max_diff": (a[1] - b[1]).abs().max().item(),
        "argmax_agree": f"{agree}/{len(batch.items)}",
    }


def median_time(
    fn: Callable[[], object], reps: int, device: torch.device, inner_sync: bool
) -> float:
    """Median seconds of ``fn()``; synchronised before each call, and inside the timed span only when
    ``inner_sync`` (end-to-end latency) rather than host time alone (launch cost)."""
    fn()  # warm-up
    times = []
    for _ in range(reps):
        sync(device)
        start = time.perf_counter()
        fn()
        if inner_sync:
            sync(device)
        times.append(time.perf_counter() - start)
        sync(device)
    return statistics.median(times)


def time_path(
    row: dict,
    name: str,
    launch: Callable[[], object] | None,
    step: Callable[[], object],
    setup: Setup,
    device: torch.device,
) -> None:
    """``row``'s timings of path ``name``: the host time of ``launch`` (one static-runner call; None for
    the varlen path, which has none) and the synchronised latency of ``step`` (one whole engine step)."""
    if launch is not None:
        row[f"launch_us_{name}"] = 1e6 * median_time(
            launch, setup.launch_reps, device, inner_sync=False
        )
    row[f"latency_ms_{name}"] = 1e3 * median_time(step, setup.latency_reps, device, inner_sync=True)


def measure_shape(
    engine: LLMEngine,
    grids: dict[str, GraphGrid | None],
    batch_size: int,
    bucket: int,
    setup: Setup,
    gen: torch.Generator,
) -> dict:
    """Every column of one ``(batch, bucket)`` row."""
    runner, device = engine.runner, engine.device
    batch = start_batch(engine, batch_size, bucket, gen)
    varlen = dataclasses.replace(batch, bucket=None)
    row: dict = {
        "batch": batch_size,
        "bucket": bucket,
        "tokens": sum(it.num_tokens for it in batch.items),
    }
    with torch.inference_mode():
        eager = path_outputs(engine, batch, grids["eager"])
        alone = path_outputs(engine, varlen, None)
        row["eager_vs_varlen"] = compare(eager, alone, batch)
        if grids["graph"] is not None:
            graph = path_outputs(engine, batch, grids["graph"])
            row["graph_vs_eager"] = compare(graph, eager, batch)
            row["graph_vs_varlen"] = compare(graph, alone, batch)

        packed = pack(batch, engine.config.block_size, device)
        for name, grid in grids.items():
            if grid is None:
                continue
            static = grid.lookup(batch_size, bucket)
            assert static is not None and static.batch == batch_size, (
                f"grid lacks ({batch_size}, {bucket})"
            )
            runner.grid = grid
            time_path(
                row,
                name,
                lambda: static.run(
                    packed.input_ids, packed.positions, packed.meta.slot_mapping, batch_size
                ),
                lambda: runner.execute(batch),
                setup,
                device,
            )
        time_path(row, "varlen", None, lambda: runner.execute(varlen), setup, device)
    release(engine, batch)
    return row


def start_decodes(
    engine: LLMEngine, batch: int, context: int, gen: torch.Generator
) -> ScheduledBatch:
    """``batch`` requests with ``context`` random tokens in the KV cache (prefilled on the varlen path)
    and one prompt token to go: their next step, a batch of decodes."""
    runner = engine.runner
    items = []
    for _ in range(batch):
        ids = torch.randint(0, engine.model_config.vocab_size, (context + 1,), generator=gen)
        req = engine.add_request(ids.tolist(), SamplingParams(max_tokens=1, temperature=0))
        assert engine.scheduler.try_start(req, context + 1) == context + 1, "KV cache too small"
        items.append(BatchItem(req, context))
    for i in range(0, batch, 8):  # a few prompts a forward pass keeps the activations small
        runner.execute(ScheduledBatch(items[i : i + 8], kind="long"))
    for it in items:
        it.request.num_computed_tokens = context
    return ScheduledBatch([BatchItem(it.request, 1) for it in items], kind="decode")


def decode_outputs(
    engine: LLMEngine, batch: ScheduledBatch, grid: GraphGrid | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of the decode rows and the K/V they wrote, through decode ``grid`` (None: varlen)."""
    runner = engine.runner
    runner.decode_grid = grid
    # decodes pack last (after any row-padding prompt the varlen path may put first)
    logits = runner.logits(batch)[-len(batch.items) :].float()
    bs = engine.config.block_size
    slots = torch.tensor(
        [
            it.request.block_table[it.request.num_computed_tokens // bs] * bs
            + it.request.num_computed_tokens % bs
            for it in batch.items
        ],
        device=engine.device,
    )
    kv = torch.stack(
        [torch.stack([k.flatten(0, 1)[slots], v.flatten(0, 1)[slots]]) for k, v in runner.kv_caches]
    )
    return logits, kv.float()


def measure_decode(
    engine: LLMEngine,
    grids: dict[str, GraphGrid | None],
    batch_size: int,
    context: int,
    setup: Setup,
    gen: torch.Generator,
) -> dict:
    """Every column of one decode row: ``batch_size`` decodes over ``context`` cached tokens each."""
    runner, device = engine.runner, engine.device
    row: dict = {"batch": batch_size, "context": context}
    with torch.inference_mode():
        batch = start_decodes(engine, batch_size, context, gen)
        # Every path orders the rows alike (pack sorts decodes by context), so rows compare directly.
        varlen = decode_outputs(engine, batch, None)
        eager = decode_outputs(engine, batch, grids["eager"])
        # one token an item: every row is compare()'s "last token"
        row["eager_vs_varlen"] = compare(eager, varlen, batch)
        if grids["graph"] is not None:
            graph = decode_outputs(engine, batch, grids["graph"])
            row["graph_vs_eager"] = compare(graph, eager, batch)
            row["graph_vs_varlen"] = compare(graph, varlen, batch)
        packed = pack(batch, engine.config.block_size, device)
        meta = packed.meta
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        for name, grid in grids.items():
            if grid is None:
                continue
            static = grid.lookup(batch_size, meta.decode_block_tables.shape[1])
            assert isinstance(static, DecodeRunner) and static.batch == batch_size, (
                f"decode grid lacks ({batch_size}, {context})"
            )
            runner.decode_grid = grid
            time_path(
                row,
                name,
                lambda: static.run_decode(
                    packed.input_ids,
                    packed.positions,
                    meta.slot_mapping,
                    meta.decode_block_tables,
                    meta.decode_context_lens,
                ),
                lambda: runner.execute(batch),
                setup,
                device,
            )
        runner.decode_grid = None
        time_path(row, "varlen", None, lambda: runner.execute(batch), setup, device)
    release(engine, batch)
    return row


def decode_graphs(engine: LLMEngine, setup: Setup, progress: Callable[[str], None]) -> dict:
    """Capture a decode grid of every ``(batch, blocks)`` measured, then measure each row."""
    runner = engine.runner
    assert isinstance(runner, ModelRunner)
    bs = engine.config.block_size
    shapes = [(b, -(-(c + 1) // bs)) for c in setup.decode_contexts for b in setup.decode_batches]
    eager = GraphGrid(runner.model, runner.kv_caches, shapes, bs, runner.device, False, decode=True)
    grids: dict[str, GraphGrid | None] = {"eager": eager}
    info: dict = {"shapes": len(shapes)}
    grids["graph"] = capture(runner, shapes, info, decode=True)
    progress(f"decode grid: {info}")
    gen = torch.Generator().manual_seed(2)
    rows = []
    for context in setup.decode_contexts:
        for batch in setup.decode_batches:
            rows.append(measure_decode(engine, grids, batch, context, setup, gen))
            progress(f"decode ({batch}, {context}): {json.dumps(rows[-1])}")
    runner.decode_grid = None
    return {"capture": info, "rows": rows}


def end_to_end(
    setup: Setup, loaded: LoadedModel, progress: Callable[[str], None], reverse: bool = False
) -> dict[str, dict]:
    """A burst of ``e2e_requests`` short prompts (lengths uniform in 16..the largest bucket), all at once,
    through each of :data:`E2E_SYSTEMS`: wall time, TTFT percentiles, and outputs identical to fcfs's
    (greedy; bfloat16 padded and varlen kernels may round differently, so this is counted, not asserted)."""
    gen = torch.Generator().manual_seed(1)
    lengths = torch.randint(
        16, max(setup.buckets) + 1, (setup.e2e_requests,), generator=gen
    ).tolist()
    prompts = [
        torch.randint(0, setup.model.vocab_size, (n,), generator=gen).tolist() for n in lengths
    ]
    params = SamplingParams(max_tokens=setup.e2e_output, temperature=0, ignore_eos=True)
    results: dict[str, dict] = {}
    outputs: dict[str, list[list[int]]] = {}
    systems = list(E2E_SYSTEMS.items())
    # the first engine of a process can pay one-time costs: ``reverse`` shows the order's effect
    for name, overrides in reversed(systems) if reverse else systems:
        engine = build_engine(setup, loaded, **({"use_cuda_graphs": True} | overrides))
        engine.warm_up()
        sync(engine.device)
        start = time.perf_counter()
        reqs = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
            if engine.last_batch is None:
                engine.wait_for_work()
        sync(engine.device)
        wall = time.perf_counter() - start
        ttfts = sorted(r.metrics.ttft for r in reqs)
        outputs[name] = [r.output_token_ids for r in reqs]
        results[name] = {
            "wall_s": wall,
            "ttft_p50_ms": 1e3 * ttfts[len(ttfts) // 2],
            "ttft_p99_ms": 1e3 * ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
            "steps": engine.num_steps,
            **engine.stats,
        }
        progress(f"end to end, {name}: {json.dumps(results[name])}")
        del engine, reqs
        if setup.device == "cuda":
            torch.cuda.empty_cache()
    for name in results:
        results[name]["identical_to_fcfs"] = sum(
            a == b for a, b in zip(outputs[name], outputs["fcfs"])
        )
    return results


def run(
    setup: Setup,
    progress: Callable[[str], None] = lambda s: None,
    e2e_only: bool = False,
    reverse_e2e: bool = False,
) -> dict:
    """Build, capture, measure every shape, then the end-to-end burst; returns everything the tables show.
    ``e2e_only``: the end-to-end burst alone (``reverse_e2e``: its systems in reverse order)."""
    start = time.perf_counter()
    loaded = load(setup)
    device = torch.device(setup.device)
    if e2e_only:
        e2e = end_to_end(setup, loaded, progress, reverse_e2e)
        return {"setup": dataclasses.asdict(setup), **about(setup, device), "end_to_end": e2e}
    engine = build_engine(setup, loaded)
    progress(f"model built in {time.perf_counter() - start:.1f} s")
    grids: dict[str, GraphGrid | None] = {"eager": engine.runner.grid}
    grids["graph"], grid_info = capture_grid(engine)
    progress(f"grid: {grid_info}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for bucket in setup.buckets:
        for batch in setup.batches:
            rows.append(measure_shape(engine, grids, batch, bucket, setup, gen))
            # every row logged as measured: the log keeps what a cut run had
            progress(f"({batch}, {bucket}): {json.dumps(rows[-1])}")
    decode = decode_graphs(engine, setup, progress)
    leaked = engine.allocator.num_used_blocks
    del engine, grids  # free the KV cache and the graphs before the end-to-end engines take theirs
    if device.type == "cuda":
        torch.cuda.empty_cache()
    e2e = end_to_end(setup, loaded, progress, reverse_e2e)
    return {
        "setup": dataclasses.asdict(setup),
        "end_to_end": e2e,
        **about(setup, device),
        "capture": grid_info,
        "rows": rows,
        "decode": decode,
        "kv_blocks_leaked": leaked,
    }


def about(setup: Setup, device: torch.device) -> dict:
    """The model's size, the device's name and torch's version, for the report's header."""
    return {
        "model": {
            "params": setup.model.num_params,
            "layers": setup.model.num_hidden_layers,
            "hidden": setup.model.hidden_size,
            "vocab": setup.model.vocab_size,
        },
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(results: dict) -> str:
    """The markdown report: one header paragraph, one row per shape (unless the run was end to end
    only), then the end-to-end table."""
    m = results["model"]
    head = (
        f"Model: random-weight Llama, {m['params'] / 1e9:.2f} B parameters ({m['layers']} layers, hidden "
        f"{m['hidden']}, vocab {m['vocab']}), {results['setup']['dtype']} on {results['device_name']}, "
        f"torch {results['torch']}. "
    )
    lines = [head] if "rows" not in results else shape_tables(results, head)
    setup = results["setup"]
    lines += [
        "",
        f"End to end: {setup['e2e_requests']} prompts of 16-{max(setup['buckets'])} tokens at once, "
        f"{setup['e2e_output']} output tokens each, greedy.",
        "",
        "| system | wall s | TTFT p50 ms | p99 | steps | grid hits | grid fallbacks | decode grid hits "
        "| outputs identical to fcfs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results["end_to_end"].items():
        lines.append(
            f"| {name} | {r['wall_s']:.2f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['steps']} "
            f"| {r['grid_hits']} | {r['grid_fallbacks']} | {r['decode_grid_hits']} "
            f"| {r['identical_to_fcfs']}/{setup['e2e_requests']} |"
        )
    return "\n".join(lines)


def shape_tables(results: dict, head: str) -> list[str]:
    """The prefill-grid and decode-graph sections of the report, under ``head``."""
    cap = results["capture"]
    head += capture_note(cap, f"{cap['shapes']} grid shapes")
    if "capture_s" in cap:
        head += (
            f" The engine's budget estimate for the largest shape: {cap['estimated_mib']:.0f} MiB."
        )
    lines = [head, "", *path_table(results["rows"], ("batch", "bucket", "tokens"))]
    lines.append("")
    lines.append(
        "dlogit / dKV: largest absolute difference over the real tokens' logits / K and V. Launch: host "
        "time of one static-runner call, not synchronised. Latency: one whole prefill step, synchronised."
    )
    decode = results["decode"]
    shapes = f"{decode['capture']['shapes']} `(batch, blocks)` decode shapes"
    lines += ["", "Decode graphs: " + capture_note(decode["capture"], shapes), ""]
    lines += path_table(decode["rows"], ("batch", "context"))
    lines += [
        "",
        "A decode row: `batch` requests, each one token over `context` cached tokens. dKV: the K/V the "
        "decode token wrote. Launch: host time of one decode-runner call, not synchronised. Latency: one "
        "whole decode step (pack, forward, logits, sampling), synchronised.",
    ]
    return lines


def capture_note(cap: dict, shapes: str) -> str:
    """What capturing ``shapes`` gave: its time and memory, its failure, or no CUDA."""
    if "capture_s" in cap:
        return (
            f"Captured {shapes} in {cap['capture_s']:.1f} s; the graph pool takes "
            f"{cap['graph_pool_mib']:.0f} MiB."
        )
    if "capture_error" in cap:
        return f'Capturing {shapes} FAILED ({cap["capture_error"]}): the graph columns read "-".'
    return f'{shapes}, not captured (no CUDA): the graph columns read "-".'


def path_table(rows: list[dict], keys: tuple[str, ...]) -> list[str]:
    """One markdown row per measured shape (its ``keys`` first): the three paths compared and timed."""
    lines = [
        "| "
        + " | ".join(keys)
        + " | graph vs eager: max dlogit | dKV | graph vs varlen: max dlogit "
        "| argmax | eager vs varlen: max dlogit | launch us graph | eager | latency ms graph | eager "
        "| varlen | eager / graph | varlen / graph |",
        "|---" * (len(keys) + 12) + "|",
    ]
    for r in rows:
        ge, gv, ev = r.get("graph_vs_eager", {}), r.get("graph_vs_varlen", {}), r["eager_vs_varlen"]
        lg = r.get("latency_ms_graph")
        cells = [
            *(str(r[k]) for k in keys),
            fmt(ge.get("logit_max_diff"), ".2e"),
            fmt(ge.get("kv_max_diff"), ".2e"),
            fmt(gv.get("logit_max_diff"), ".2e"),
            gv.get("argmax_agree", "-"),
            fmt(ev["logit_max_diff"], ".2e"),
            fmt(r.get("launch_us_graph"), ".0f"),
            fmt(r["launch_us_eager"], ".0f"),
            fmt(lg, ".2f"),
            fmt(r["latency_ms_eager"], ".2f"),
            fmt(r["latency_ms_varlen"], ".2f"),
            fmt(r["latency_ms_eager"] / lg if lg else None, ".2f"),
            fmt(r["latency_ms_varlen"] / lg if lg else None, ".2f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="folder for gpu_graphs.json and gpu_graphs.md"
    )
    parser.add_argument("--launch-reps", type=int, default=None)
    parser.add_argument("--latency-reps", type=int, default=None)
    parser.add_argument(
        "--e2e-only", action="store_true", help="the end-to-end burst alone, no per-shape tables"
    )
    parser.add_argument(
        "--reverse-e2e", action="store_true", help="run the end-to-end systems in reverse order"
    )
    args = parser.parse_args(argv)
    setup = GPU if args.device == "cuda" else CPU
    setup = dataclasses.replace(
        setup,
        launch_reps=args.launch_reps or setup.launch_reps,
        latency_reps=args.latency_reps or setup.latency_reps,
    )
    results = run(
        setup,
        progress=lambda s: print(s, file=sys.stderr, flush=True),
        e2e_only=args.e2e_only,
        reverse_e2e=args.reverse_e2e,
    )
    report = table(results)
    print(report)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_graphs.json").write_text(json.dumps(results, indent=1))
        (args.out / "gpu_graphs.md").write_text(report + "\n")
    return 1 if results.get("kv_blocks_leaked") else 0


if __name__ == "__main__":
    sys.exit(main())
