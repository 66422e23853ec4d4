"""Calibrated profiles: the cost model and scheduling settings measured for one model on one device.

A profile is a versioned JSON file written by ``plaserve calibrate`` and read with ``--profile`` by the
engine, the server and the router. Its fingerprint names what it was measured on; loading it for a
different model, dtype, device or torch version warns (the numbers may not transfer).

The settings are chosen from the measurements by the rules below (each tested in tests/test_profile.py):

* ``short_threshold`` — the prompt length where attention (the quadratic term) reaches
  ``QUADRATIC_SHARE`` of the marginal cost of a token: ``g2*L/2 = f/(1-f) * g1``, rounded to the nearest
  power of two and clamped to ``[64, 4096]``. Below it a prompt costs about ``g1`` per token whatever its
  length, so padding it into a bucket batch wastes little and its cost is predictable; above it the cost
  per token keeps rising, and one such prompt is the head-of-line blocker the long path exists for.
* ``max_short_batch`` — the largest power-of-two batch size that still cut the measured time per request
  by at least ``BATCH_GAIN`` relative to half that batch, at the smallest bucket (where batching pays
  most); the grid holds the batch sizes up to it whose padded tokens fit the per-batch token cap.
* ``long_chunk_size`` — the smallest power of two, at least the short threshold, whose per-call overhead
  ``c0`` is under ``CHUNK_OVERHEAD`` of the chunk's time: smaller chunks give a waiting short request a
  shorter wait, but each chunk pays ``c0`` again.
* ``w_min = max(c0, 1 ms)`` — waiting less than one call's overhead can never pay back;
  ``w_max`` = the measured time of a full batch at the smallest bucket — waiting longer than the batch
  takes to run is never repaid by batching it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import platform
from dataclasses import dataclass, field
from typing import Any

import torch

from plaserve.cost import CostModel, chunk_size_for
from plaserve.model.config import ModelConfig

log = logging.getLogger(__name__)

PROFILE_VERSION = 1
QUADRATIC_SHARE = 0.2
BATCH_GAIN = 0.05


def fingerprint(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> dict[str, str]:
    """What a profile's numbers depend on."""
    shape = json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"cpu:{platform.machine()}:{platform.processor() or 'unknown'}:{torch.get_num_threads()} threads"
    return {
        "model": hashlib.sha256(shape.encode()).hexdigest()[:16],
        "dtype": str(dtype).removeprefix("torch."),
        "device": name,
        "torch": torch.__version__.split("+")[0],
    }


@dataclass(frozen=True)
class Profile:
    """A calibrated cost model and the scheduling settings chosen from it."""

    cost_model: CostModel
    short_threshold: int
    max_short_batch: int
    long_chunk_size: int
    w_min: float
    w_max: float
    fingerprint: dict[str, str] = field(default_factory=dict)
    fit: dict[str, Any] = field(default_factory=dict)  # held-out quality, sample counts
    measurements: dict[str, Any] = field(default_factory=dict)  # raw timings, for plots and audits
    version: int = PROFILE_VERSION

    def scheduler_overrides(self) -> dict[str, Any]:
        """The :class:`~plaserve.config.SchedulerConfig` fields this profile sets."""
        return {
            "short_threshold": self.short_threshold,
            "max_short_batch": self.max_short_batch,
            "long_chunk_size": self.long_chunk_size,
            "w_min": self.w_min,
            "w_max": self.w_max,
        }

    def save(self, path: str) -> None:
        data = dataclasses.asdict(self)
        data["cost_model"] = self.cost_model.as_dict()
        with open(path, "w") as f:
            json.dump(data, f, indent=1)

    @classmethod
    def load(cls, path: str) -> "Profile":
        with open(path) as f:
            data = json.load(f)
        version = data.get("version")
        if version != PROFILE_VERSION:
            raise ValueError(
                f"{path}: profile version {version!r}, this plaserve reads version {PROFILE_VERSION}"
            )
        data["cost_model"] = CostModel(**data["cost_model"])
        return cls(**data)

    def check(self, expected: dict[str, str]) -> list[str]:
        """Fingerprint fields that differ from ``expected`` (and warn about them)."""
        diffs = [
            f"{k}: profile {self.fingerprint.get(k)!r}, here {v!r}"
            for k, v in expected.items()
            if self.fingerprint.get(k) != v
        ]
        if diffs:
            log.warning(
                "profile was measured elsewhere (%s); its numbers may not hold here",
                "; ".join(diffs),
            )
        return diffs


def _pow2_round(x: float) -> int:
    return 2 ** round(math.log2(max(x, 1.0)))


def choose_short_threshold(
    cost: CostModel, share: float = QUADRATIC_SHARE, lo: int = 64, hi: int = 4096
) -> int:
    """Length where the quadratic term reaches ``share`` of a token's marginal cost (see module doc)."""
    if cost.g2 <= 0:
        return hi
    length = 2 * share / (1 - share) * cost.g1 / cost.g2
    return min(hi, max(lo, _pow2_round(length)))


def choose_max_short_batch(batch_times: dict[int, float], gain: float = BATCH_GAIN) -> int:
    """Largest batch size whose per-request time beat half its size by ``gain`` (sizes: powers of two,
    ``batch_times`` maps size -> measured seconds for one batch at the smallest bucket)."""
    best = 1
    for b in sorted(batch_times):
        half = b // 2
        if half in batch_times and batch_times[b] / b <= (1 - gain) * batch_times[half] / half:
            best = b
        elif half in batch_times:
            break
    return best


def choose_long_chunk_size(
    cost: CostModel, short_threshold: int, max_seconds: float, hi: int = 8192
) -> int:
    """The long chunk pla would take under ``cost`` (:func:`plaserve.cost.chunk_size_for`): the
    smallest power of two >= the short threshold whose ``c0`` is under ``CHUNK_OVERHEAD`` of its
    time, none predicted past ``max_seconds`` (the TTFT SLO floor), at most ``hi``."""
    return chunk_size_for(cost, short_threshold, hi, max_seconds)


def choose_window(cost: CostModel, full_batch_time: float) -> tuple[float, float]:
    """``(w_min, w_max)`` from the per-call overhead and a full smallest-bucket batch's time."""
    w_min = max(cost.c0, 1e-3)
    return w_min, max(w_min, full_batch_time)
