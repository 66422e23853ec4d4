"""KV cache blocks: the allocator with reference counts and a chained-hash prefix cache.

Pure bookkeeping, no tensors: the scheduler and the engine both keep their books with it (the K/V
tensors themselves are the engine's, ``engine/kv_cache.py``).

The cache is ``num_blocks`` blocks of ``block_size`` token slots per layer. A request owns a block
table (list of block ids); slot ``p`` of a request lives at ``table[p // bs] * bs + p % bs``.

Prefix caching: a block that is *full and computed* gets a key hashed over its tokens and the key of
the block before it, so equal keys mean equal prefixes. A new request walks its prompt block by block
and shares every block whose key is known. Freed blocks keep their key and content until the slot is
reused (least recently freed first), so a finished request's prefix stays hittable.

Block 0 is the *null block*: never handed out, it absorbs writes from padding tokens and pads block
tables, so static-shape batches need no special cases.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

NULL_BLOCK = 0


def block_key(prev_key: int | None, tokens: tuple[int, ...]) -> int:
    """Key of a full block: chained over the previous block's key, so it names the whole prefix."""
    return hash((prev_key, tokens))


@dataclass
class Block:
    """One block of token slots. ``key``/``tokens`` are set once it is full and computed."""

    block_id: int
    ref_count: int = 0
    key: int | None = None
    tokens: tuple[int, ...] = field(default=())


class BlockAllocator:
    """Hands out blocks, counts references, and keeps the prefix-cache index."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks (one is the null block)")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in the order they were freed: reuse the oldest so recent prefixes survive longest.
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(1, num_blocks))
        self.cached: dict[int, int] = {}  # key -> block id
        self.num_cache_hits = 0  # tokens served from the prefix cache, ever
        self.num_cache_queries = 0  # tokens looked up in it, ever (vLLM's prefix_cache_queries)

    @property
    def num_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return len(self.blocks) - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's ``/reset_prefix_cache``); only while no block is in use,
        since a running request's blocks keep their keys as it goes: False then, nothing changed."""
        if self.num_used_blocks:
            return False
        self.cached.clear()
        for block in self.blocks:
            block.key, block.tokens = None, ()
        return True

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free)

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` fresh blocks (ref count 1), evicting their old prefix-cache entries."""
        if n > len(self.free):
            raise RuntimeError(f"out of KV blocks: need {n}, have {len(self.free)}")
        ids = []
        for _ in range(n):
            bid, _ = self.free.popitem(last=False)
            block = self.blocks[bid]
            if block.key is not None and self.cached.get(block.key) == bid:
                del self.cached[block.key]
            block.key, block.tokens, block.ref_count = None, (), 1
            ids.append(bid)
        return ids

    def fork(self, ids: list[int]) -> None:
        """Share blocks with one more owner."""
        for bid in ids:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free[bid]
            block.ref_count += 1

    def release(self, ids: list[int]) -> None:
        """Drop one owner of each block; blocks nobody owns go back to the free list (content kept)."""
        for bid in reversed(ids):  # tail blocks first, so prefixes outlive their extensions
            block = self.blocks[bid]
            assert block.ref_count > 0, f"double free of block {bid}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[bid] = None

    def _cached_blocks(self, token_ids: list[int]) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        bs, key, ids = self.block_size, None, []
        for start in range(0, len(token_ids) - bs + 1, bs):
            tokens = tuple(token_ids[start : start + bs])
            key = block_key(key, tokens)
            bid = self.cached.get(key)
            # tokens guard against hash collisions
            if bid is None or self.blocks[bid].tokens != tokens:
                break
            ids.append(bid)
        return ids

    def peek_prefix(self, token_ids: list[int]) -> int:
        """Tokens of ``token_ids`` the prefix cache holds now (whole blocks), without taking them."""
        return len(self._cached_blocks(token_ids)) * self.block_size

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Blocks holding the longest cached prefix of ``token_ids`` (whole blocks); forks them."""
        ids = self._cached_blocks(token_ids)
        self.fork(ids)
        self.num_cache_queries += len(token_ids)
        self.num_cache_hits += len(ids) * self.block_size
        return ids

    def commit(
        self, block_table: list[int], token_ids: list[int], num_computed: int, num_committed: int
    ) -> int:
        """Index the blocks of ``block_table`` that became full and computed; returns the new count of
        committed blocks (the caller keeps it per request)."""
        if not self.enable_prefix_caching:
            return num_committed
        bs = self.block_size
        key = self.blocks[block_table[num_committed - 1]].key if num_committed else None
        for i in range(num_committed, num_computed // bs):
            block = self.blocks[block_table[i]]
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            key = block_key(key, tokens)
            if block.key is None:
                block.key, block.tokens = key, tokens
                # First writer wins; an equal block computed concurrently stays private.
                self.cached.setdefault(key, block.block_id)
        return max(num_committed, num_computed // bs)
