"""Runs one scheduled batch on the model: packs inputs, runs the forward pass, samples."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from plaserve.engine.graphs import DecodeRunner, GraphGrid
from plaserve.engine.sampler import apply_penalties, ban_until_min_tokens, sample, token_logprobs
from plaserve.grammar.masks import start_masks
from plaserve.kv_blocks import NULL_BLOCK
from plaserve.model.attention import AttentionMetadata, PrefillSeq, QueryRows
from plaserve.model.llama import LlamaForCausalLM
from plaserve.scheduler.base import BatchItem, ScheduledBatch


@dataclass
class PackedBatch:
    """Model inputs for one step and where to read each sampled row."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # packed row of the last token of each sampling item
    sample_items: list[int]  # index into batch.items of each sampling item
    # packed row of the first token of each item, by index into batch.items
    first_rows: dict[int, int]
    # The sampling rows as the forward pass's only queries (pack's ``queries``); None: every row.
    queries: QueryRows | None = None

    @property
    def hidden_rows(self) -> list[int]:
        """Each sampling item's row in the forward pass's output: its packed row, or with
        ``queries`` its place among them."""
        if self.queries is None:
            return self.sample_rows
        place = {row: j for j, row in enumerate(self.queries.rows.tolist())}
        return [place[row] for row in self.sample_rows]


def _slots(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def _null_slots(n: int, block_size: int) -> list[int]:
    """Slots for ``n`` tokens whose K/V nobody reads: the null block's, in turn."""
    return [NULL_BLOCK * block_size + j % block_size for j in range(n)]


def _context_tables(
    items: list[BatchItem], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, int, int]]]:
    """Block tables (padded with the null block to the longest), context lengths through each item's
    last new token, and the groups of rows attended together (``AttentionMetadata.decode_groups``)
    of ``items``, which must come longest block table first: the layout of rows that each attend to
    their whole context. Groups are cut where a context falls under half the group's longest, so
    that the padding each group gathers and attends over stays under its real context (one group
    for all would pad every row to the longest)."""
    groups: list[tuple[int, int, int]] = []
    for j, it in enumerate(items):
        n = len(it.request.block_table)
        if groups and 2 * n >= groups[-1][2]:
            groups[-1] = (groups[-1][0], j + 1, groups[-1][2])
        else:
            groups.append((j, j + 1, n))
    width = groups[0][2]
    tables = torch.tensor(
        [
            it.request.block_table + [NULL_BLOCK] * (width - len(it.request.block_table))
            for it in items
        ],
        dtype=torch.long,
        device=device,
    )
    lens = torch.tensor(
        [it.request.num_computed_tokens + it.num_tokens for it in items],
        dtype=torch.long,
        device=device,
    )
    return tables, lens, groups


def _is_decode(item: BatchItem) -> bool:
    """Whether ``item`` is a decode: one new token after a computed context."""
    return item.num_tokens == 1 and item.request.num_computed_tokens > 0


# On CPU in half precision the matmuls are oneDNN's, which builds (JIT-compiles) a kernel for every
# new row count and weight shape: 2-9 ms a projection, so a step of a size not seen before cost 20-40
# ms more than the same step again on the small model (40-140 ms steps; docs/BENCHMARKS.md). Serving
# mixed prompts, most prefill steps have a new size. Steps of more than ROW_GRANULE_FROM rows are
# therefore padded up to a multiple of ROW_GRANULE rows, so that sizes repeat; smaller steps (decode
# batches, whose sizes recur) stay as they are. Steps that plaserve's packed linear takes whole need
# no padding (it builds nothing per size), and there the padding was only work: a 98-token prompt
# computed 128 rows (ModelRunner.pad_rows_above).
ROW_GRANULE = 32
ROW_GRANULE_FROM = 64


def padded_rows(rows: int, granule: int, above: int = ROW_GRANULE_FROM) -> int:
    """``rows`` rounded up to a multiple of ``granule`` where it is over ``above`` (granule 1: never)."""
    if granule <= 1 or rows <= above:
        return rows
    return -(-rows // granule) * granule


def pack(
    batch: ScheduledBatch,
    block_size: int,
    device: torch.device,
    row_granule: int = 1,
    pad_above: int = ROW_GRANULE_FROM,
    queries: bool = False,
) -> PackedBatch:
    """Lay out ``batch`` as varlen prefill items, then the padded bucket block, then decodes.
    ``row_granule`` > 1: a varlen batch (no bucket; bucketed steps have static shapes already) of
    more than ``pad_above`` rows gets a dummy prompt after its varlen items that pads the step to
    :func:`padded_rows` rows; its tokens write their K/V to the null block and nothing samples them.
    ``queries``: where a varlen batch has rows that do not sample, lay out the sampling rows as the
    forward pass's only queries (``PackedBatch.queries``)."""
    items = list(enumerate(batch.items))
    decodes = [(i, it) for i, it in items if _is_decode(it)]
    rest = [(i, it) for i, it in items if not _is_decode(it)]
    padded = rest if batch.bucket is not None else []
    varlen = [] if batch.bucket is not None else rest

    ids: list[int] = []
    pos: list[int] = []
    slots: list[int] = []
    rows: list[int] = []
    row_items: list[int] = []
    first_rows: dict[int, int] = {}
    prefill: list[PrefillSeq] = []

    def add(i: int, it: BatchItem, pad_to: int | None = None) -> None:
        req, start = it.request, it.request.num_computed_tokens
        end = start + it.num_tokens
        base = first_rows[i] = len(ids)
        ids.extend(req.token_ids[start:end])
        pos.extend(range(start, end))
        slots.extend(_slots(req.block_table, start, end, block_size))
        # right padding: token 0 at a harmless position, K/V to the null block
        if pad_to is not None:
            extra = pad_to - it.num_tokens
            ids.extend([0] * extra)
            pos.extend([0] * extra)
            slots.extend(_null_slots(extra, block_size))
        if it.samples:
            rows.append(base + it.num_tokens - 1)
            row_items.append(i)

    for i, it in varlen:
        table = None
        if it.request.num_computed_tokens > 0:
            table = torch.tensor(it.request.block_table, dtype=torch.long, device=device)
        prefill.append(PrefillSeq(len(ids), it.num_tokens, it.request.num_computed_tokens, table))
        add(i, it)
    if batch.bucket is None:
        rows_in_step = len(ids) + len(decodes)
        extra = padded_rows(rows_in_step, row_granule, pad_above) - rows_in_step
        if extra:
            prefill.append(PrefillSeq(len(ids), extra, 0, None))
            ids.extend([0] * extra)
            pos.extend(range(extra))
            slots.extend(_null_slots(extra, block_size))
    num_prefill = len(ids)
    for i, it in padded:
        assert it.request.num_computed_tokens == 0 and it.num_tokens <= batch.bucket
        add(i, it, pad_to=batch.bucket)
    tables = lens = None
    groups: list[tuple[int, int, int]] = []
    if decodes:
        decodes.sort(key=lambda d: len(d[1].request.block_table), reverse=True)
        tables, lens, groups = _context_tables([it for _, it in decodes], device)
        for i, it in decodes:
            add(i, it)

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.long, device=device)

    query_rows = None
    if queries and batch.bucket is None and len(rows) < len(ids):
        # The sampling rows as decode rows over their whole contexts, longest first, as
        # _context_tables groups them.
        order = sorted(
            range(len(rows)),
            key=lambda j: len(batch.items[row_items[j]].request.block_table),
            reverse=True,
        )
        sampled = [batch.items[row_items[j]] for j in order]
        q_tables, q_lens, q_groups = (
            _context_tables(sampled, device) if sampled else (None, None, [])
        )
        query_rows = QueryRows(
            t([rows[j] for j in order]),
            AttentionMetadata(
                slot_mapping=t([]),
                prefill=[],
                decode_block_tables=q_tables,
                decode_context_lens=q_lens,
                decode_groups=q_groups or None,
            ),
        )

    meta = AttentionMetadata(
        slot_mapping=t(slots),
        prefill=prefill,
        num_prefill_tokens=num_prefill,
        padded_shape=(len(padded), batch.bucket) if padded else None,
        decode_block_tables=tables,
        decode_context_lens=lens,
        decode_groups=groups or None,
    )
    return PackedBatch(t(ids), t(pos), meta, rows, row_items, first_rows, query_rows)


class ModelRunner:
    """Executes scheduled batches on a model with its paged KV cache.

    A short batch with a ``bucket`` runs through the static ``(batch, bucket)`` grid when it has an
    entry for it, and a batch of decodes only through the static ``(batch, blocks)`` decode grid when
    one is built and has room for it (CUDA graph replays on GPUs); any other batch, or one the grids
    lack, runs the varlen eager path.
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.grid: GraphGrid | None = None
        self.grid_fallbacks = 0
        self.decode_grid: GraphGrid | None = None
        dtype = next(model.parameters()).dtype
        # varlen steps' rows padded to a multiple of this (pack's ROW_GRANULE note: oneDNN on CPU),
        # those of more rows than the packed linear takes whole
        self.row_granule = (
            ROW_GRANULE if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) else 1
        )
        shape_free = getattr(model, "shape_free_rows", lambda: 0)()
        self.pad_rows_above = max(ROW_GRANULE_FROM, shape_free)

    def build_grid(self, shapes: list[tuple[int, int]], capture: bool = True) -> None:
        """Create (and on CUDA capture) the static runners for ``shapes`` of ``(batch, bucket)``."""
        self.grid = GraphGrid(
            self.model, self.kv_caches, shapes, self.block_size, self.device, capture
        )

    def build_decode_grid(self, shapes: list[tuple[int, int]], capture: bool = True) -> None:
        """Create (and on CUDA capture) the static decode runners for ``shapes`` of ``(batch, blocks)``."""
        self.decode_grid = GraphGrid(
            self.model, self.kv_caches, shapes, self.block_size, self.device, capture, decode=True
        )

    @property
    def stats(self) -> dict[str, int]:
        decode = self.decode_grid
        return {
            "grid_hits": self.grid.hits if self.grid else 0,
            "grid_fallbacks": self.grid_fallbacks,
            "decode_grid_hits": decode.hits if decode else 0,
            "decode_grid_fallbacks": decode.fallbacks if decode else 0,
        }

    def _plan_decode(
        self, batch: ScheduledBatch
    ) -> tuple[PackedBatch, Callable[[], torch.Tensor]] | None:
        """A batch of decodes through the decode grid (None: no grid, or no entry holds it)."""
        if (
            self.decode_grid is None
            or not batch.items
            or not all(_is_decode(it) for it in batch.items)
        ):
            return None
        # pack() pads the block tables to the longest request's
        width = max(len(it.request.block_table) for it in batch.items)
        static = self.decode_grid.lookup(len(batch.items), width)
        if static is None:
            self.decode_grid.fallbacks += 1
            return None
        assert isinstance(static, DecodeRunner)
        self.decode_grid.hits += 1
        packed = pack(batch, self.block_size, self.device)
        meta = packed.meta
        assert meta.decode_block_tables is not None and meta.decode_context_lens is not None
        return packed, lambda: static.run_decode(
            packed.input_ids,
            packed.positions,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_context_lens,
        )

    def _plan(
        self, batch: ScheduledBatch, every_row: bool = False
    ) -> tuple[PackedBatch, Callable[[], torch.Tensor]]:
        """``batch`` packed, and the forward pass over it (which returns the hidden states): through
        a static runner where a grid has one for it, else the varlen eager path, which computes
        the final layer only for the rows that sample (``PackedBatch.queries``) unless ``every_row``
        or an item asked for its prompt's logprobs."""
        decoded = self._plan_decode(batch)
        if decoded is not None:
            return decoded
        static = None
        if batch.bucket is not None:
            static = self.grid.lookup(len(batch.items), batch.bucket) if self.grid else None
            if static is None:  # no grid entry: same batch, varlen eager path
                batch = dataclasses.replace(batch, bucket=None)
        if batch.kind == "short" and static is None and self.grid is not None:
            self.grid_fallbacks += 1
        queries = static is None and not (
            every_row or any(it.request.params.prompt_logprobs is not None for it in batch.items)
        )
        packed = pack(
            batch, self.block_size, self.device, self.row_granule, self.pad_rows_above, queries
        )
        if static is not None:
            assert self.grid is not None
            self.grid.hits += 1
            rows = len(batch.items)
            return packed, lambda: static.run(
                packed.input_ids, packed.positions, packed.meta.slot_mapping, rows
            )
        return packed, lambda: self.model(
            packed.input_ids, packed.positions, packed.meta, self.kv_caches, packed.queries
        )

    @torch.inference_mode()
    def warm_up(self, num_tokens: int) -> None:
        """One throwaway step before serving: a ``num_tokens`` prefill and a decode, with logits.

        The first call of each kernel pays for allocations and algorithm choice (oneDNN primitives on
        CPU, workspaces on CUDA); without this, the first requests served pay it in their latency.
        Every K/V it writes goes to the null block, which no request reads unmasked.
        """

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=t(_null_slots(num_tokens + 1, self.block_size)),
            prefill=[PrefillSeq(0, num_tokens, 0, None)],
            num_prefill_tokens=num_tokens,
            decode_block_tables=t([[NULL_BLOCK]]),
            decode_context_lens=t([1]),
        )
        positions = t([*range(num_tokens), 0])
        hidden = self.model(
            torch.zeros(num_tokens + 1, dtype=torch.long, device=self.device),
            positions,
            meta,
            self.kv_caches,
        )
        self.model.compute_logits(hidden[[num_tokens - 1, num_tokens]])

    def execute(self, batch: ScheduledBatch) -> dict[int, int | None]:
        """Run ``batch``; returns the sampled token of each item that samples, by item index (None where
        the logits were unusable: see ``sampler.unusable_rows``). For each request that asked for
        logprobs, the sampled token's are appended to ``output_logprobs`` too."""
        packed, forward = self._plan(batch)
        reqs = [batch.items[i].request for i in packed.sample_items]
        # Structured outputs: the constrained rows' masks are computed while the forward pass runs.
        masks = start_masks(reqs, self.device)
        hidden = forward()
        for i, it in enumerate(batch.items):
            if it.request.params.prompt_logprobs is not None:
                self._record_prompt_logprobs(it, hidden, packed.first_rows[i])
        if not packed.sample_rows:
            return {}
        logits = self.model.compute_logits(hidden[packed.hidden_rows])
        asked = [j for j, r in enumerate(reqs) if r.params.logprobs is not None]
        # a copy: the penalties change logits in place
        raw = logits[asked].log_softmax(-1) if asked else None
        logits = apply_penalties(logits, reqs)
        if masks is not None:  # after the penalties and the bias: a bias never undoes the mask
            masks.apply(logits)
        logits = ban_until_min_tokens(logits, reqs)  # after the masks: it yields to a grammar
        tokens = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        if raw is not None and (
            rows := [(k, j) for k, j in enumerate(asked) if tokens[j] is not None]
        ):
            entries = token_logprobs(
                raw[[k for k, _ in rows]],
                [tokens[j] for _, j in rows],
                [reqs[j].params.logprobs for _, j in rows],
            )
            for (_, j), entry in zip(rows, entries):
                reqs[j].output_logprobs.append(entry)
        return dict(zip(packed.sample_items, tokens))

    def _record_prompt_logprobs(
        self, item: BatchItem, hidden: torch.Tensor, first_row: int, rows_at_once: int = 256
    ) -> None:
        """Append to ``item.request.prompt_logprobs`` the entries this step's rows give: the row of
        position ``p`` predicts prompt token ``p + 1``. Positions already recorded (a recompute after
        preemption) are skipped; logits are made ``rows_at_once`` rows at a time, since a whole chunk's
        over a large vocabulary would take gigabytes."""
        req = item.request
        start = req.num_computed_tokens
        # position whose successor is the next entry
        first = max(start, len(req.prompt_logprobs) - 1)
        end = min(start + item.num_tokens, req.num_prompt_tokens - 1)
        for lo in range(first, end, rows_at_once):
            hi = min(end, lo + rows_at_once)
            rows = hidden[first_row + lo - start : first_row + hi - start]
            logprobs = self.model.compute_logits(rows).log_softmax(-1)
            req.prompt_logprobs += token_logprobs(
                logprobs,
                req.prompt_token_ids[lo + 1 : hi + 1],
                [req.params.prompt_logprobs] * (hi - lo),
            )

    def logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Logits of every packed token of ``batch``, padding included (for tests and debugging)."""
        _, forward = self._plan(batch, every_row=True)
        return self.model.compute_logits(forward())
