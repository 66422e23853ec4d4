"""A request's KV blocks out of one engine and into another: the engine's half of prefill/decode
disaggregation (docs/PD.md). The network half is ``server/kv_transfer.py``.

*Export* (prefill side): a request marked with :meth:`KVHandoff.hold` keeps its prompt's blocks when it
finishes (its first token sampled): :meth:`KVHandoff.on_finish` takes one more reference on them and
*parks* them under the request's id until :meth:`KVHandoff.release` (pulled) or
:meth:`KVHandoff.expire` (the pull never came). A parked block is full or the prompt's last, private
block; nobody writes it, so :meth:`KVHandoff.read_layer` may copy it from any thread.

*Import* (decode side): :meth:`KVHandoff.reserve` takes the prompt's leading blocks the prefix cache
holds (the same chained block keys as :mod:`plaserve.kv_blocks`) and fresh blocks for the rest; only
those are pulled, written layer by layer with :meth:`KVHandoff.write_layer` (any thread: the blocks
belong to the reservation alone). :meth:`KVHandoff.admit` then turns the reservation into running
requests that already have their prompt computed and their first token (sampled by the prefill
worker): the next decode step goes on from there, as the colocated engine would after its prefill.

Everything but ``read_layer``/``write_layer`` runs on the engine's thread.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from plaserve.engine.sampler import skip_draw
from plaserve.request import Request, RequestStatus, SamplingParams

if TYPE_CHECKING:
    from plaserve.engine.engine import LLMEngine


class KVTransferError(Exception):
    """A request's KV cannot be exported or imported (unknown, expired, out of blocks, mismatched)."""


class KVNoRoomError(KVTransferError):
    """An import for which this engine has not the blocks or the sequences free now: its running
    requests will free some (a request that could never fit gets a plain KVTransferError)."""


@dataclass(frozen=True)
class KVLayout:
    """The shape of one layer's blocks; both sides of a transfer must agree on it."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K (or V) in one layer."""
        itemsize = torch.finfo(getattr(torch, self.dtype)).bits // 8
        return self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class Parked:
    """A finished prefill's prompt blocks, waiting to be pulled."""

    block_ids: list[int]
    num_prompt_tokens: int
    expires: float  # on the engine's clock


@dataclass
class Reservation:
    """Blocks a decode-side import holds: ``cached`` from the prefix cache (not pulled), ``fresh`` to
    be pulled from the prefill side's block ``len(cached)`` on, and ``copies``: the partial last
    block's copy for each choice after the first (held from the start: taken by running requests
    while the KV arrived, they would leave the choices nowhere to go)."""

    token_ids: list[int]
    cached: list[int]
    fresh: list[int]
    allocator: object  # the books the blocks belong to (an engine reset makes new ones)
    copies: list[int] = field(default_factory=list)
    released: bool = field(default=False)

    @property
    def block_table(self) -> list[int]:
        return self.cached + self.fresh


class KVHandoff:
    """The parked exports and the import reservations of one engine (``engine.kv_handoff``)."""

    def __init__(self, engine: LLMEngine, ttl: float = 30.0) -> None:
        self.engine = engine
        self.ttl = ttl  # seconds a parked export waits for its pull
        self._held: set[str] = set()  # request ids to park when they finish
        self.parked: dict[str, Parked] = {}
        self.num_expired = 0  # parked exports freed unpulled, ever

    # --- the tensors (any thread) -----------------------------------------------------------------
    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        caches = getattr(self.engine.runner, "kv_caches", None)
        if caches is None:
            raise KVTransferError("this engine has no KV tensors (a model-free runner)")
        return caches

    def layout(self) -> KVLayout:
        k = self.kv_caches[0][0]
        return KVLayout(
            num_layers=len(self.kv_caches),
            block_size=k.shape[1],
            num_kv_heads=k.shape[2],
            head_dim=k.shape[3],
            dtype=str(k.dtype).removeprefix("torch."),
        )

    def read_layer(self, layer: int, block_ids: list[int]) -> tuple[memoryview, memoryview]:
        """One layer's K and V of ``block_ids``, as raw bytes (whole blocks, in table order; copies,
        so the blocks may change afterwards)."""
        k, v = self.kv_caches[layer]
        idx = torch.tensor(block_ids, dtype=torch.long, device=k.device)
        return _raw(k.index_select(0, idx)), _raw(v.index_select(0, idx))

    def write_layer(self, layer: int, block_ids: list[int], k_raw: bytes, v_raw: bytes) -> None:
        """Write one layer's K and V of ``block_ids`` from raw bytes (as :meth:`read_layer` made)."""
        k, v = self.kv_caches[layer]
        idx = torch.tensor(block_ids, dtype=torch.long, device=k.device)
        shape = (len(block_ids), *k.shape[1:])
        for cache, raw in ((k, k_raw), (v, v_raw)):
            with warnings.catch_warnings():  # read-only bytes: index_copy_ only reads them
                warnings.simplefilter("ignore", UserWarning)
                data = torch.frombuffer(raw, dtype=torch.uint8)
            cache.index_copy_(0, idx, data.view(cache.dtype).view(shape).to(cache.device))

    # --- export (engine thread) -----------------------------------------------------------------
    def hold(self, request_id: str) -> None:
        """Park ``request_id``'s prompt blocks when it finishes normally (not when it is aborted)."""
        self._held.add(request_id)

    def on_finish(self, req: Request) -> None:
        """Called by the engine as ``req`` finishes with a token, before its blocks are freed."""
        if req.request_id not in self._held:
            return
        self._held.discard(req.request_id)
        bs = self.engine.allocator.block_size
        ids = req.block_table[: -(-req.num_prompt_tokens // bs)]
        self.engine.allocator.fork(ids)
        self.parked[req.request_id] = Parked(
            ids, req.num_prompt_tokens, self.engine.clock() + self.ttl
        )

    def forget(self, request_id: str) -> None:
        """Drop a hold that will not be needed (the request was aborted or failed)."""
        self._held.discard(request_id)

    def parked_blocks(self, request_id: str, start: int) -> list[int]:
        """The parked blocks of ``request_id`` from index ``start`` on (KVTransferError: none parked)."""
        parked = self.parked.get(request_id)
        if parked is None:
            raise KVTransferError(
                f"no KV is parked for request {request_id!r} (never held, pulled already, or expired)"
            )
        if not 0 <= start <= len(parked.block_ids):
            raise KVTransferError(
                f"block {start} is outside request {request_id!r}'s {len(parked.block_ids)} blocks"
            )
        # Not freed under a pull that is under way: a pull gets a whole expiry period of its own.
        parked.expires = max(parked.expires, self.engine.clock() + self.ttl)
        return parked.block_ids[start:]

    def release(self, request_id: str) -> bool:
        """Free a parked export (it was pulled). False when none was parked."""
        parked = self.parked.pop(request_id, None)
        if parked is None:
            return False
        self.engine.allocator.release(parked.block_ids)
        return True

    def expire(self) -> int:
        """Free the parked exports whose pull did not come in time; returns how many."""
        now = self.engine.clock()
        late = [rid for rid, p in self.parked.items() if p.expires <= now]
        for rid in late:
            self.release(rid)
        self.num_expired += len(late)
        return len(late)

    @property
    def num_parked_blocks(self) -> int:
        return sum(len(p.block_ids) for p in self.parked.values())

    # --- import (engine thread) -----------------------------------------------------------------
    def max_choices(self, num_prompt_tokens: int) -> int:
        """The most choices of a ``num_prompt_tokens``-token prompt this engine can ever hold at once
        (its sequences, and its blocks for the prompt, each other choice's copy of a partial last
        block and each choice's next one); 0: not even one. A fixed property of the engine: any
        thread may ask."""
        bs, blocks = self.engine.allocator.block_size, self.engine.allocator.num_blocks
        room = blocks - -(-num_prompt_tokens // bs)  # after the shared prompt blocks
        per_choice = 2 if num_prompt_tokens % bs else 1  # its next block (+ its partial copy)
        by_blocks = (room + (1 if num_prompt_tokens % bs else 0)) // per_choice  # first: no copy
        return max(0, min(self.engine.scheduler.max_num_seqs, by_blocks))

    def reserve(self, token_ids: list[int], num_choices: int) -> Reservation:
        """Blocks for a prompt whose KV comes from elsewhere: its cached leading blocks (forked) and
        fresh ones for the rest, plus room for each choice's own copy of a partial last block and for
        its next token. KVTransferError when the engine has not the room or the sequences."""
        eng = self.engine
        eng.validate_prompt(token_ids)
        sched, kv = eng.scheduler, eng.allocator
        bs, n = kv.block_size, len(token_ids)
        num_blocks = -(-n // bs)
        extra = (num_choices - 1) * (1 if n % bs else 0)  # the other choices' partial blocks
        if num_choices > self.max_choices(n):
            raise KVTransferError(
                f"this decode worker can never hold {num_choices} choices of a {n}-token prompt "
                f"(at most {sched.max_num_seqs} sequences, {kv.num_blocks} KV blocks); try another"
            )
        if len(sched.running) + num_choices > sched.max_num_seqs:
            raise KVNoRoomError(
                f"this decode worker runs {len(sched.running)} requests, at most "
                f"{sched.max_num_seqs}; try another"
            )
        cached = kv.match_prefix(token_ids[: (n // bs) * bs])
        need = num_blocks - len(cached)
        if not kv.can_allocate(need + extra + num_choices):  # + one block each may need next
            kv.release(cached)
            raise KVNoRoomError(
                f"this decode worker has {kv.num_free_blocks} free KV blocks, the request needs "
                f"{need + extra + num_choices}; try another"
            )
        return Reservation(list(token_ids), cached, kv.allocate(need), kv, kv.allocate(extra))

    def cancel(self, res: Reservation) -> None:
        """Give back a reservation's blocks (the pull failed or the client left)."""
        if not res.released:
            res.released = True
            if res.allocator is self.engine.allocator:  # else an engine reset freed them all
                self.engine.allocator.release(res.block_table + res.copies)

    def admit(
        self,
        res: Reservation,
        choices: list[tuple[str, SamplingParams, int]],
        arrival_time: float,
    ) -> list[Request]:
        """Running requests ``(request_id, params, first_token)`` over a filled reservation's blocks;
        each has its first token appended (and may finish on it). The reservation's references pass
        to the first choice; the others share its full blocks and copy its partial last one."""
        eng, kv = self.engine, self.engine.allocator
        if res.released or res.allocator is not kv:
            raise KVTransferError("the engine restarted while the KV was arriving; retry")
        n, bs = len(res.token_ids), kv.block_size
        if len(res.copies) != (len(choices) - 1) * (1 if n % bs else 0):
            raise KVTransferError(
                f"{len(choices)} choices on a reservation made for another number"
            )
        taken = {rid for rid, _, _ in choices if rid in eng.requests}
        if taken:
            raise KVTransferError(f"request id {sorted(taken)[0]!r} is already in use")
        res.released = True
        table = res.block_table
        num_full = n // bs
        # Index the pulled full blocks, so that later prompts with this prefix find them.
        kv.commit(table, res.token_ids, n, len(res.cached))
        reqs = []
        now = eng.clock()
        for i, (rid, params, first) in enumerate(choices):
            if i == 0:
                blocks = table
            else:
                blocks = table[:num_full]
                kv.fork(blocks)
                if n % bs:
                    copy = res.copies[i - 1]
                    for k, v in self.kv_caches:
                        k[copy].copy_(k[table[-1]])
                        v[copy].copy_(v[table[-1]])
                    blocks = blocks + [copy]
            # With its grammar matcher, which the first token below advances as any sampled token.
            req = eng.new_request(list(res.token_ids), params, rid, arrival_time)
            if params.seed is not None and req.generator is not None:
                skip_draw(req.generator, eng.model_config.vocab_size)  # the first token's draw
            req.block_table = list(blocks)
            req.num_computed_tokens = n
            req.num_committed_blocks = num_full
            req.metrics.num_cached_tokens = n
            req.metrics.first_scheduled_time = now
            # Classed and given its SLO as the prompt it was on the prefill worker: preempted here,
            # it waits in the queues like any request (pla orders them by deadline). Nothing of it
            # is left to compute.
            eng.scheduler.classify(req, n)
            req.uncached_estimate = 0
            req.status = RequestStatus.RUNNING
            eng.scheduler.running.append(req)
            eng.requests[rid] = req
            eng._append_token(req, first, now)
            if req.finished:
                eng.requests.pop(rid, None)
            reqs.append(req)
        return reqs


def _raw(t: torch.Tensor) -> memoryview:
    """A tensor's bytes (bfloat16 too, which numpy lacks), moved to the host, without a copy on the
    host (the memoryview keeps the tensor's storage alive)."""
    return memoryview(t.contiguous().view(torch.uint8).cpu().numpy()).cast("B")
