"""Engine and scheduler settings, with every default in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

from plaserve.slo import DEFAULT_FACTOR, DEFAULT_FLOOR_S, SloRule


@dataclass(frozen=True)
class SchedulerConfig:
    """Knobs of the step policies. Times are seconds; lengths are tokens.

    The defaults suit the embedded model on a 2-core CPU; ``plaserve calibrate`` measures them for a
    real model and device.
    """

    policy: str = "pla"  # pla (length-aware), fcfs (vLLM's default), spf (shortest prefill first)
    max_num_seqs: int = 64  # requests holding KV blocks at once
    max_num_batched_tokens: int = 2048  # fcfs/spf: tokens per step; pla: cap on one short batch
    short_threshold: int = 512  # fewer uncached prompt tokens than this: short
    long_chunk_size: int | None = (
        None  # pla: tokens per long-prefill chunk (None: from the cost model)
    )
    max_short_batch: int = 16  # pla: deepest static batch size
    w_min: float = 0.001  # pla: batch window bounds
    w_max: float = 0.02
    max_consecutive_short: int = 6  # pla: short batches in a row while a long prefill waits
    max_prefill_steps_between_decodes: int = (
        2  # pla: steps without decodes in a row (bounds time between tokens)
    )
    long_aging: float = 0.02  # pla: long queue order = predicted prefill time - long_aging * time waited (docs/POLICIES.md)
    light_load: float = 0.5  # pla: below this busy share of the last 10 s (and no short waiting) a long prefill runs whole (0: never)
    late_yield: float = 2.0  # pla: a request given up to keep others on time queues behind them until it has waited this many SLOs (0: never)
    static_short_batches: bool = (
        True  # pla: right-pad short batches to their (batch, bucket) grid shape
    )
    max_static_batch_tokens: int | None = (
        None  # pla: most tokens in one padded batch (the engine sets it from cuda_graph_memory)
    )
    ttft_slo_factor: float = (
        DEFAULT_FACTOR  # TTFT SLO = max(floor, factor * predicted isolated prefill time)
    )
    ttft_slo_floor: float = DEFAULT_FLOOR_S

    @property
    def slo(self) -> SloRule:
        """The TTFT SLO rule these settings give (:mod:`plaserve.slo`)."""
        return SloRule(self.ttft_slo_factor, self.ttft_slo_floor)


@dataclass(frozen=True)
class EngineConfig:
    """How to build and run one engine instance.

    ``model`` is a local Hugging Face model directory, a hub model id (``Qwen/Qwen2.5-0.5B-Instruct``,
    resolved through the hub's cache at ``revision``), or None for the embedded default model (random
    weights, byte-level tokenizer). ``kv_cache_memory`` is bytes, a size string (``"2GiB"``) or a
    fraction of the device's free memory (``"0.5"``).
    """

    model: str | None = None
    revision: str | None = None  # a hub model id's branch, tag or commit (default: main)
    # auto: bfloat16 on CUDA and on CPUs with AMX or AVX512-BF16, else float32; or float32 / bfloat16 / float16
    dtype: str = "auto"
    device: str = "auto"  # auto: cuda when available, else cpu
    max_model_len: int | None = (
        None  # default: the model's max_position_embeddings, capped at 16384
    )
    block_size: int = 16
    kv_cache_memory: str = "auto"  # auto: 2GiB on CPU, 0.8 of free memory on CUDA
    enable_prefix_caching: bool = True
    # CPU, bfloat16 / float16: torch.compile the per-token elementwise work (norms, rotary, SwiGLU) of
    # steps of at least this many tokens (None: all eager). Needs a C++ compiler, else it runs eagerly.
    # Below it dynamo's guards cost what fusing saves (docs/ARCHITECTURE.md, CPU specifics).
    compile_min_tokens: int | None = 512
    use_cuda_graphs: bool = True  # capture the (batch, bucket) grid as CUDA graphs on CUDA
    # Activation memory the static grid may take (captured graphs keep theirs reserved): bytes, a size
    # string or a fraction of free device memory. It caps the tokens of one padded batch, so the grid
    # holds no shape larger than the budget allows.
    cuda_graph_memory: str = "1GiB"
    # Right-pad short batches to static (batch, bucket) shapes: "auto" does so where CUDA graphs are
    # captured (the padding buys a graph replay); elsewhere padding is pure extra compute, so short
    # batches run varlen (and decodes ride along). "always" / "never" force it (tests use "always").
    pad_short_batches: str = "auto"
    # Run decode steps through static (batch, blocks) runners, the batch padded with null-block rows:
    # "auto" where CUDA graphs are captured (a replay per step); elsewhere padding only adds compute.
    # "always" / "never" force it (tests use "always" on CPU).
    pad_decode_batches: str = "auto"
    profile: str | None = (
        None  # calibrated profile (plaserve calibrate): cost model + scheduler settings
    )
    online_refit: bool = True  # refit the cost model on the engine's own prefill timings
    seed: int = 0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> "EngineConfig":
        """Build from flat keyword arguments: engine fields and scheduler fields mixed (``LLM(...)``)."""
        from dataclasses import fields

        engine_names = {f.name for f in fields(cls)}
        sched_names = {f.name for f in fields(SchedulerConfig)}
        unknown = set(kwargs) - engine_names - sched_names
        if unknown:
            raise TypeError(f"unknown engine arguments: {', '.join(sorted(unknown))}")
        sched = SchedulerConfig(**{k: v for k, v in kwargs.items() if k in sched_names})
        return cls(**{k: v for k, v in kwargs.items() if k in engine_names}, scheduler=sched)
