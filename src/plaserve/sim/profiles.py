"""Simulation profiles: what one simulated instance is, calibrated on this machine or analytic for a GPU.

A :class:`SimProfile` is a :class:`~plaserve.profile.Profile` (cost model and scheduler settings) plus
what the simulator needs beyond it: how many tokens the KV cache holds, whether short batches are
right-padded to static shapes, the per-step token budget, and a label that every report prints.

``--profile`` takes either

* a path to a calibrated profile (``plaserve calibrate``): the cost model and settings measured for a
  model on a device; the engine settings are those ``plaserve serve`` uses on that device (for a CPU
  profile: a 2 GiB KV cache of the embedded model, varlen short batches); or
* ``analytic:MODEL@GPU`` (e.g. ``analytic:qwen2.5-32b@H100``): the cost model from FLOP and byte counts
  (:func:`plaserve.cost.analytic_cost`) with settings chosen by the same rules that
  calibration applies (:mod:`plaserve.profile`). Where calibration measures something the analytic
  model cannot predict, a stated assumption stands in (:data:`GPU_ASSUMPTIONS`). Reports built on an
  analytic profile say ``analytic`` wherever the profile is named.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from plaserve.config import EngineConfig, SchedulerConfig
from plaserve.cost import HARDWARE, MODELS, analytic_cost
from plaserve.model.default import DEFAULT_CONFIG
from plaserve.profile import Profile, choose_long_chunk_size, choose_short_threshold, choose_window
from plaserve.scheduler.buckets import MIN_BUCKET

ANALYTIC_PREFIX = "analytic:"

#: Device memory (bytes) of the GPUs in :data:`plaserve.cost.HARDWARE`.
GPU_MEMORY = {"H100": 80 * 2**30, "H200": 141 * 10**9, "A100": 80 * 2**30}


@dataclass(frozen=True)
class GpuAssumptions:
    """Settings an analytic profile cannot derive from FLOP counts; each is a documented choice.

    * ``max_short_batch = 16``: calibration picks the deepest batch that still pays; on a GPU, batching
      small prefills pays until the weights stop dominating, well past 16 rows of 16-256 tokens.
    * ``max_num_batched_tokens = 8192`` and ``max_num_seqs = 256``: vLLM's online-serving defaults on
      80 GB-class GPUs, so the fcfs baseline is vLLM as deployed.
    * ``memory_utilization = 0.9``: vLLM's ``gpu_memory_utilization``; the KV cache gets what the
      weights leave of it.
    * short batches right-padded to static shapes: on a GPU plaserve captures them as CUDA graphs.
    """

    max_short_batch: int = 16
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    memory_utilization: float = 0.9
    pad_short_batches: str = "always"


GPU_ASSUMPTIONS = GpuAssumptions()


@dataclass(frozen=True)
class SimProfile:
    """One simulated instance: the profile, the engine settings around it, and its label."""

    profile: Profile
    label: str  # e.g. "calibrated:docs/profile_default_cpu.json" or "analytic:qwen2.5-32b@H100"
    kv_tokens: int  # tokens the KV cache holds
    pad_short_batches: str = "auto"  # the engine's setting (see EngineConfig)
    max_num_batched_tokens: int | None = None  # None: the engine's default
    max_num_seqs: int | None = None

    @property
    def analytic(self) -> bool:
        return self.label.startswith(ANALYTIC_PREFIX)

    @property
    def cost(self):
        return self.profile.cost_model

    def engine_config(self, policy: str, **overrides: Any) -> EngineConfig:
        """The engine settings of one simulated instance running scheduling ``policy``.

        The engine is model-free (the simulator supplies the runner), so the KV cache is sized in tokens
        of the embedded model's float32 layout; only the token count matters to the scheduler.
        ``online_refit`` is off: simulated steps take exactly the cost model's time, there is nothing
        to refit. The prefix cache is off: simulated prompts are random token ids (as ``plaserve bench``
        sends), so no two share a block and the cache would change no decision, only cost time (its
        hashing is a tenth of a simulated step; tests/sim checks the results are identical).
        """
        sched = self.profile.scheduler_overrides()
        if self.max_num_batched_tokens is not None:
            sched["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.max_num_seqs is not None:
            sched["max_num_seqs"] = self.max_num_seqs
        # float32 on the simulator's CPU
        kv_bytes = self.kv_tokens * DEFAULT_CONFIG.kv_bytes_per_token * 4
        kwargs: dict[str, Any] = dict(
            policy=policy,
            kv_cache_memory=kv_bytes,
            device="cpu",
            dtype="float32",
            pad_short_batches=self.pad_short_batches,
            online_refit=False,
            enable_prefix_caching=False,
            **sched,
        )
        kwargs.update(overrides)
        return EngineConfig.from_kwargs(**kwargs)

    def with_short_threshold(self, threshold: int) -> "SimProfile":
        """The same profile with another short threshold (and a long chunk at least as large)."""
        p = self.profile
        chunk = max(p.long_chunk_size, threshold)
        return dataclasses.replace(
            self,
            profile=dataclasses.replace(p, short_threshold=threshold, long_chunk_size=chunk),
            label=f"{self.label} (short threshold {threshold})",
        )

    def describe(self) -> dict[str, Any]:
        """The profile as JSON for run reports."""
        return {
            "label": self.label,
            "analytic": self.analytic,
            "cost_model": self.cost.as_dict(),
            "scheduler": self.profile.scheduler_overrides(),
            "kv_tokens": self.kv_tokens,
            "pad_short_batches": self.pad_short_batches,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
        }


def kv_capacity_tokens(
    model: str,
    gpu: str,
    memory_utilization: float = GPU_ASSUMPTIONS.memory_utilization,
    dtype_bytes: int = 2,
) -> int:
    """Tokens of KV cache that fit beside ``model``'s weights on one ``gpu``."""
    cfg = MODELS[model]
    free = memory_utilization * GPU_MEMORY[gpu] - cfg.num_params * dtype_bytes
    per_token = cfg.kv_bytes_per_token * dtype_bytes
    if free < per_token * 16384:
        raise ValueError(
            f"{model} leaves {max(free, 0) / 2**30:.1f} GiB on one {gpu}: not enough KV cache "
            f"for a 16k-token context"
        )
    return int(free // per_token)


def analytic_profile(
    model: str, gpu: str, assumptions: GpuAssumptions = GPU_ASSUMPTIONS
) -> SimProfile:
    """``model`` on one ``gpu`` from FLOP and byte counts, settings by the calibration rules."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    if gpu not in HARDWARE:
        raise ValueError(f"unknown GPU {gpu!r}; choose from {', '.join(HARDWARE)}")
    cost = analytic_cost(model, gpu)
    threshold = choose_short_threshold(cost)
    # The full smallest-bucket batch the window rule needs is predicted rather than measured.
    full_batch = cost.batch_time([(MIN_BUCKET, 0)] * assumptions.max_short_batch)
    w_min, w_max = choose_window(cost, full_batch)
    profile = Profile(
        cost_model=cost,
        short_threshold=threshold,
        max_short_batch=assumptions.max_short_batch,
        long_chunk_size=choose_long_chunk_size(cost, threshold, SchedulerConfig().slo.floor),
        w_min=w_min,
        w_max=w_max,
        fingerprint={"model": model, "device": HARDWARE[gpu].name, "dtype": "bfloat16"},
        fit={"analytic": dataclasses.asdict(HARDWARE[gpu])},
    )
    return SimProfile(
        profile,
        label=f"{ANALYTIC_PREFIX}{model}@{gpu}",
        kv_tokens=kv_capacity_tokens(model, gpu),
        pad_short_batches=assumptions.pad_short_batches,
        max_num_batched_tokens=assumptions.max_num_batched_tokens,
        max_num_seqs=assumptions.max_num_seqs,
    )


def calibrated_profile(path: str, kv_tokens: int | None = None) -> SimProfile:
    """A profile written by ``plaserve calibrate``, as ``plaserve serve --profile`` runs it on a CPU
    (2 GiB KV cache of the embedded float32 model unless ``kv_tokens`` says otherwise)."""
    profile = Profile.load(path)
    if kv_tokens is None:
        kv_tokens = 2 * 2**30 // (DEFAULT_CONFIG.kv_bytes_per_token * 4)
    return SimProfile(profile, label=f"calibrated:{path}", kv_tokens=kv_tokens)


def load_sim_profile(spec: str) -> SimProfile:
    """``analytic:MODEL@GPU`` or the path of a calibrated profile."""
    if spec.startswith(ANALYTIC_PREFIX):
        model, sep, gpu = spec[len(ANALYTIC_PREFIX) :].partition("@")
        if not sep:
            raise ValueError(
                f"analytic profiles are named analytic:MODEL@GPU, e.g. analytic:qwen2.5-32b@H100; "
                f"got {spec!r}"
            )
        return analytic_profile(model, gpu)
    try:
        return calibrated_profile(spec)
    except FileNotFoundError:
        raise ValueError(f"{spec}: no such profile file (or use analytic:MODEL@GPU)") from None
    except (KeyError, TypeError) as e:
        raise ValueError(f"{spec}: not a plaserve profile ({e})") from None
