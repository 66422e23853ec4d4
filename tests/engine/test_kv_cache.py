"""Block allocator: reference counts, prefix cache, eviction, and a property test of its invariants."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plaserve.engine.kv_cache import parse_memory
from plaserve.kv_blocks import NULL_BLOCK, BlockAllocator


def check_invariants(alloc: BlockAllocator, owners: list[list[int]]) -> None:
    """Ref counts equal the number of owning tables; free blocks are exactly the unowned ones."""
    counts = [0] * len(alloc.blocks)
    for table in owners:
        for bid in table:
            counts[bid] += 1
    assert counts[NULL_BLOCK] == 0 and NULL_BLOCK not in alloc.free
    for block in alloc.blocks[1:]:
        assert block.ref_count == counts[block.block_id]
        assert (block.block_id in alloc.free) == (block.ref_count == 0)
    assert alloc.num_free_blocks + alloc.num_used_blocks == alloc.num_blocks
    for key, bid in alloc.cached.items():
        assert alloc.blocks[bid].key == key  # the index never points at a reused block


def test_allocate_release_counts():
    alloc = BlockAllocator(9, 4)
    a = alloc.allocate(3)
    b = alloc.allocate(5)
    assert alloc.num_free_blocks == 0 and not alloc.can_allocate(1)
    with pytest.raises(RuntimeError):
        alloc.allocate(1)
    alloc.fork(a)
    alloc.release(a)
    assert alloc.num_free_blocks == 0
    alloc.release(a)
    alloc.release(b)
    assert alloc.num_free_blocks == 8
    with pytest.raises(AssertionError):
        alloc.release(a)


def test_prefix_match_only_after_commit_and_survives_free():
    alloc = BlockAllocator(16, 4)
    tokens = list(range(10))  # two full blocks and a partial one
    table = alloc.allocate(3)
    assert alloc.match_prefix(tokens) == []  # nothing committed yet: KV not computed
    committed = alloc.commit(table, tokens, num_computed=6, num_committed=0)
    assert committed == 1
    committed = alloc.commit(table, tokens, num_computed=10, num_committed=committed)
    assert committed == 2
    alloc.release(table)
    hit = alloc.match_prefix(tokens + [99])
    assert hit == table[:2]
    assert alloc.num_cache_hits == 8
    # A different second block only shares the first.
    alloc.release(hit)
    other = alloc.match_prefix(tokens[:4] + [7, 7, 7, 7])
    assert other == table[:1]


def test_a_prefix_cache_reset_forgets_every_prefix_but_only_while_no_block_is_used():
    alloc = BlockAllocator(16, 4)
    tokens = list(range(8))
    table = alloc.allocate(2)
    alloc.commit(table, tokens, num_computed=8, num_committed=0)
    assert not alloc.reset_prefix_cache()  # a request holds its blocks: nothing changes
    alloc.release(table)
    assert alloc.peek_prefix(tokens + [99]) == 8
    assert alloc.reset_prefix_cache()
    assert alloc.peek_prefix(tokens + [99]) == 0 and alloc.num_free_blocks == 15
    # blocks filled after the reset are cached again
    table = alloc.allocate(2)
    alloc.commit(table, tokens, num_computed=8, num_committed=0)
    alloc.release(table)
    assert alloc.peek_prefix(tokens + [99]) == 8


def test_eviction_reuses_oldest_free_first():
    alloc = BlockAllocator(5, 2)  # 4 usable
    t1, t2 = alloc.allocate(2), alloc.allocate(2)
    alloc.commit(t1, [1, 2, 3, 4], 4, 0)
    alloc.commit(t2, [5, 6, 7, 8], 4, 0)
    alloc.release(t1)
    alloc.release(t2)
    alloc.allocate(2)  # takes t1's blocks (freed first)
    assert alloc.match_prefix([1, 2, 3, 4]) == []
    assert len(alloc.match_prefix([5, 6, 7, 8])) == 2


def test_parse_memory():
    assert parse_memory("2GiB", 0) == 2 * 2**30
    assert parse_memory("512MB", 0) == 512 * 10**6
    assert parse_memory("0.25", 1000) == 250
    assert parse_memory(4096, 0) == 4096
    with pytest.raises(ValueError):
        parse_memory("lots", 0)


ops = st.lists(
    st.tuples(
        st.sampled_from(["new", "append", "fork", "free", "commit"]),
        st.integers(0, 7),
        st.integers(1, 6),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_allocator_invariants_under_random_operations(script):
    bs = 2
    alloc = BlockAllocator(12, bs)
    seqs: list[dict] = []  # each: table, tokens, computed, committed
    for op, which, n in script:
        live = [s for s in seqs if s is not None]
        if op == "new":
            tokens = [which % 3] * (n * 2)  # few distinct prompts, so prefixes repeat
            table = alloc.match_prefix(tokens)
            need = -(-len(tokens) // bs) - len(table)
            if not alloc.can_allocate(need):
                alloc.release(table)
                continue
            table += alloc.allocate(need)
            seqs.append({"table": table, "tokens": tokens, "computed": 0, "committed": 0})
        elif not live:
            continue
        else:
            s = live[which % len(live)]
            if op == "append":
                s["tokens"] += [which] * n
                need = -(-len(s["tokens"]) // bs) - len(s["table"])
                if alloc.can_allocate(need):
                    s["table"] += alloc.allocate(need)
                else:
                    s["tokens"] = s["tokens"][: len(s["table"]) * bs]
            elif op == "fork":
                alloc.fork(s["table"])
                seqs.append(
                    {
                        "table": list(s["table"]),
                        "tokens": list(s["tokens"]),
                        "computed": s["computed"],
                        "committed": s["committed"],
                    }
                )
            elif op == "free":
                alloc.release(s["table"])
                seqs[seqs.index(s)] = None
            elif op == "commit":
                s["computed"] = len(s["tokens"])
                s["committed"] = alloc.commit(
                    s["table"], s["tokens"], s["computed"], s["committed"]
                )
        check_invariants(alloc, [s["table"] for s in seqs if s is not None])
    for s in seqs:
        if s is not None:
            alloc.release(s["table"])
    check_invariants(alloc, [])
    assert alloc.num_free_blocks == alloc.num_blocks
