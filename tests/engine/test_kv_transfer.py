"""KV export and import between two engines in one process (engine/kv_transfer.py): the bytes
``read_layer`` gives go into ``write_layer`` the way the transfer service carries them."""

from __future__ import annotations

import torch

from plaserve import EngineConfig, LLMEngine, SamplingParams
from plaserve.engine.kv_transfer import KVTransferError

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
FIRST = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def make_engine(path: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig.from_kwargs(
            model=path, dtype="float32", kv_cache_memory="8MiB", max_model_len=1024
        )
    )


def finish(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def handoff(src: LLMEngine, dst: LLMEngine, ids: list[int], rid: str, n: int = 1):
    """Prefill ``ids`` on ``src`` (parked), move its KV to ``dst``, decode ``n`` choices there."""
    src.kv_handoff.hold(rid)
    first = src.add_request(ids, FIRST, request_id=rid)
    finish(src)
    res = dst.kv_handoff.reserve(ids, n)
    blocks = src.kv_handoff.parked_blocks(rid, len(res.cached))
    assert len(blocks) == len(res.fresh)
    for layer in range(len(src.kv_handoff.kv_caches)):
        k, v = src.kv_handoff.read_layer(layer, blocks) if blocks else (b"", b"")
        if blocks:
            dst.kv_handoff.write_layer(layer, res.fresh, k, v)
    assert src.kv_handoff.release(rid)
    token = first.output_token_ids[0]
    reqs = dst.kv_handoff.admit(
        res, [(f"{rid}-{i}", GREEDY, token) for i in range(n)], arrival_time=dst.clock()
    )
    finish(dst)
    return res, reqs


def test_imported_kv_decodes_as_the_colocated_engine(llama_ckpt) -> None:
    src, dst, ref = make_engine(llama_ckpt), make_engine(llama_ckpt), make_engine(llama_ckpt)
    for i, n in enumerate([5, 16, 100, 333]):  # partial, exact and many blocks
        ids = prompt(n, i)
        want = ref.add_request(ids, GREEDY)
        finish(ref)
        res, (got, twin) = handoff(src, dst, ids, f"r{i}", n=2)
        assert got.output_token_ids == want.output_token_ids == twin.output_token_ids
    for engine in (src, dst):
        assert engine.allocator.num_used_blocks == 0 and not engine.kv_handoff.parked


def test_a_cached_prefix_is_not_pulled_again(llama_ckpt) -> None:
    src, dst = make_engine(llama_ckpt), make_engine(llama_ckpt)
    head = prompt(160, 7)  # 10 full blocks
    handoff(src, dst, head + prompt(20, 8), "a")
    res, (req,) = handoff(src, dst, head + prompt(30, 9), "b")
    assert len(res.cached) == 10 and len(res.fresh) == 2
    assert len(req.output_token_ids) == GREEDY.max_tokens
    assert dst.allocator.num_used_blocks == 0


def test_parked_blocks_expire_and_unknown_pulls_are_refused(llama_ckpt) -> None:
    now = [0.0]
    src = LLMEngine(
        EngineConfig.from_kwargs(
            model=llama_ckpt, dtype="float32", kv_cache_memory="8MiB", max_model_len=1024
        ),
        clock=lambda: now[0],
    )
    src.kv_handoff.ttl = 5.0
    src.kv_handoff.hold("x")
    src.add_request(prompt(50, 1), FIRST, request_id="x")
    finish(src)
    assert src.allocator.num_used_blocks == 4
    now[0] = 4.0
    assert src.kv_handoff.expire() == 0
    now[0] = 5.0
    assert src.kv_handoff.expire() == 1 and src.allocator.num_used_blocks == 0
    try:
        src.kv_handoff.parked_blocks("x", 0)
    except KVTransferError as e:
        assert "no KV is parked" in str(e)
    else:
        raise AssertionError("an expired export was still served")
    # An aborted prefill parks nothing.
    src.kv_handoff.hold("y")
    src.add_request(prompt(50, 2), FIRST, request_id="y")
    src.abort("y")
    finish(src)
    assert not src.kv_handoff.parked and src.allocator.num_used_blocks == 0


def test_a_reservation_without_room_is_refused_and_cancel_frees(llama_ckpt) -> None:
    dst = make_engine(llama_ckpt)
    held = []
    for i in range(dst.allocator.num_blocks // 32 + 2):
        try:
            held.append(dst.kv_handoff.reserve(prompt(500, 10 + i), 1))  # 32 blocks each
        except KVTransferError as e:
            assert "free KV blocks" in str(e)
            break
    else:
        raise AssertionError("reservations beyond the cache's size were granted")
    assert dst.allocator.num_used_blocks == 32 * len(held)
    for res in held:
        dst.kv_handoff.cancel(res)
        dst.kv_handoff.cancel(res)  # idempotent
    assert dst.allocator.num_used_blocks == 0


def test_max_choices_is_what_a_reservation_can_ever_hold(llama_ckpt) -> None:
    """`max_choices` is the largest number of choices `reserve` grants on an idle engine: one more
    is refused as never possible (the decode worker then queues the rest as ordinary requests)."""
    dst = LLMEngine(  # 40 blocks of 16 tokens
        EngineConfig.from_kwargs(
            model=llama_ckpt, dtype="float32", kv_cache_memory="320KiB", max_model_len=640
        )
    )
    blocks, bs = dst.allocator.num_blocks, dst.allocator.block_size
    assert blocks == 40
    for length in (bs * (blocks - 8), bs * (blocks - 8) - 3, bs * (blocks - 1) - 1):
        ids = prompt(length, length)
        most = dst.kv_handoff.max_choices(length)
        assert 1 <= most < dst.scheduler.max_num_seqs
        dst.kv_handoff.cancel(dst.kv_handoff.reserve(ids, most))
        try:
            dst.kv_handoff.reserve(ids, most + 1)
        except KVTransferError as e:
            assert "can never hold" in str(e)
        else:
            raise AssertionError(f"{most + 1} choices of {length} tokens granted")
    assert dst.kv_handoff.max_choices(bs * (blocks - 8)) == 8  # full blocks: one new block each
    assert dst.kv_handoff.max_choices(bs * (blocks - 8) - 3) == 4  # and a copy of the partial one
    assert dst.allocator.num_used_blocks == 0


def test_imported_requests_preempted_for_room_are_recomputed(llama_ckpt) -> None:
    """A decode engine short of blocks preempts requests whose prefill ran elsewhere; pla queues them
    by their deadlines, so they must carry a TTFT SLO as requests that arrived here do (they had none,
    and the engine failed on its next decision)."""
    src, ref = make_engine(llama_ckpt), make_engine(llama_ckpt)
    dst = LLMEngine(
        EngineConfig.from_kwargs(
            model=llama_ckpt, dtype="float32", kv_cache_memory="96KiB", max_model_len=128
        )
    )
    assert dst.config.scheduler.policy == "pla" and dst.allocator.num_free_blocks == 12
    # 3 blocks each to begin with; at 68 tokens each needs 5, and the cache holds 12 in all
    prompts = [prompt(44, 20 + i) for i in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    wants = []
    for ids in prompts:
        wants.append(ref.add_request(ids, params))
    finish(ref)
    got = []
    for i, ids in enumerate(prompts):
        src.kv_handoff.hold(f"p{i}")
        first = src.add_request(ids, FIRST, request_id=f"p{i}")
        finish(src)
        res = dst.kv_handoff.reserve(ids, 1)
        blocks = src.kv_handoff.parked_blocks(f"p{i}", len(res.cached))
        for layer in range(len(src.kv_handoff.kv_caches)):
            dst.kv_handoff.write_layer(layer, res.fresh, *src.kv_handoff.read_layer(layer, blocks))
        src.kv_handoff.release(f"p{i}")
        (req,) = dst.kv_handoff.admit(
            res, [(f"d{i}", params, first.output_token_ids[0])], arrival_time=dst.clock()
        )
        got.append(req)
    finish(dst)
    assert sum(r.metrics.num_preemptions for r in got) > 0
    assert [r.output_token_ids for r in got] == [w.output_token_ids for w in wants]
    assert dst.allocator.num_used_blocks == 0


def test_the_choices_copies_are_reserved_before_the_pull(llama_ckpt) -> None:
    """The blocks for the other choices' copies of a partial last block are held from the
    reservation on: running requests that take every free block while the KV arrives leave the
    admission its room (it failed with 'the choices' copies need 1' before)."""
    src, dst, ref = make_engine(llama_ckpt), make_engine(llama_ckpt), make_engine(llama_ckpt)
    ids = prompt(20, 30)  # one full block and a partial one
    want = ref.add_request(ids, GREEDY)
    finish(ref)
    src.kv_handoff.hold("c")
    first = src.add_request(ids, FIRST, request_id="c")
    finish(src)
    res = dst.kv_handoff.reserve(ids, 2)
    assert len(res.fresh) == 2 and len(res.copies) == 1
    taken = dst.allocator.allocate(dst.allocator.num_free_blocks)  # by others, meanwhile
    blocks = src.kv_handoff.parked_blocks("c", len(res.cached))
    for layer in range(len(src.kv_handoff.kv_caches)):
        dst.kv_handoff.write_layer(layer, res.fresh, *src.kv_handoff.read_layer(layer, blocks))
    src.kv_handoff.release("c")
    token = first.output_token_ids[0]
    reqs = dst.kv_handoff.admit(res, [("c-0", GREEDY, token), ("c-1", GREEDY, token)], dst.clock())
    dst.allocator.release(taken)
    finish(dst)
    assert [r.output_token_ids for r in reqs] == [want.output_token_ids] * 2
    assert dst.allocator.num_used_blocks == 0
    # A cancelled reservation gives its copies back too.
    dst.kv_handoff.cancel(dst.kv_handoff.reserve(ids + [1], 3))
    assert dst.allocator.num_used_blocks == 0
