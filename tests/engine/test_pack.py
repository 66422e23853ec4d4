"""runner.pack's row padding: a varlen step of more than ``pad_above`` rows (ROW_GRANULE_FROM, or what
the packed linear takes whole) is padded to a multiple of its granule by a dummy prompt after the
varlen items (K/V to the null block, never sampled), so oneDNN on CPU sees a few step sizes again and
again; smaller steps, bucketed (static) batches and a granule of 1 are left alone."""

from __future__ import annotations

import torch

from plaserve.engine.runner import ROW_GRANULE_FROM, pack, padded_rows
from plaserve.kv_blocks import NULL_BLOCK
from plaserve.request import Request, SamplingParams
from plaserve.scheduler.base import BatchItem, ScheduledBatch

BLOCK = 16


def _item(n_prompt: int, computed: int, n: int, first_block: int) -> BatchItem:
    req = Request(list(range(1, n_prompt + 1)), SamplingParams(max_tokens=4))
    req.num_computed_tokens = computed
    req.block_table = list(range(first_block, first_block + (n_prompt + BLOCK) // BLOCK + 1))
    return BatchItem(req, n)


def test_padded_rows():
    assert padded_rows(ROW_GRANULE_FROM, 32) == ROW_GRANULE_FROM  # small steps as they are
    assert padded_rows(65, 32) == 96
    assert padded_rows(2048, 32) == 2048
    assert padded_rows(2049, 32) == 2080
    assert padded_rows(2049, 1) == 2049
    assert padded_rows(98, 32, above=512) == 98  # the packed linear takes it whole
    assert padded_rows(513, 32, above=512) == 544


def test_a_varlen_step_is_padded_by_a_dummy_prompt_after_its_prompts():
    prompt = _item(70, 0, 70, first_block=1)
    decode = _item(20, 20, 1, first_block=40)
    decode.request.token_ids.append(5)
    batch = ScheduledBatch([prompt, decode])
    plain = pack(batch, BLOCK, torch.device("cpu"))
    padded = pack(batch, BLOCK, torch.device("cpu"), row_granule=32)
    assert plain.input_ids.shape[0] == 71 and padded.input_ids.shape[0] == 96
    # the prompt and the decode keep their rows' contents; the decode moves past the dummy prompt
    assert padded.meta.prefill[0] == plain.meta.prefill[0]
    dummy = padded.meta.prefill[1]
    assert (dummy.start, dummy.q_len, dummy.num_cached, dummy.block_table) == (70, 25, 0, None)
    assert padded.meta.num_prefill_tokens == 95
    assert torch.equal(padded.input_ids[:70], plain.input_ids[:70])
    assert padded.input_ids[95] == plain.input_ids[70]
    assert torch.equal(padded.positions[70:95], torch.arange(25))
    null = padded.meta.slot_mapping[70:95]
    assert bool(((null // BLOCK) == NULL_BLOCK).all())  # its K/V go to the null block
    assert padded.sample_rows == [69, 95] and plain.sample_rows == [69, 70]


def test_small_and_bucketed_steps_are_not_padded():
    small = ScheduledBatch([_item(40, 0, 40, first_block=1)])
    assert pack(small, BLOCK, torch.device("cpu"), row_granule=32).input_ids.shape[0] == 40
    bucketed = ScheduledBatch([_item(70, 0, 70, first_block=1)], kind="short", bucket=128)
    assert pack(bucketed, BLOCK, torch.device("cpu"), row_granule=32).input_ids.shape[0] == 128
    mid = ScheduledBatch([_item(70, 0, 70, first_block=1)])
    assert pack(mid, BLOCK, torch.device("cpu"), 32, pad_above=512).input_ids.shape[0] == 70
