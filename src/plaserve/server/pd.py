"""Prefill/decode disaggregation on the HTTP side: ``kv_transfer_params`` in, parked KV out, pulled KV
in (docs/PD.md).

The fields follow vLLM's disaggregated-serving proxy (``toy_proxy_server.py``, ``KVConnectorBase_V1``):

* a request with ``"kv_transfer_params": {"do_remote_decode": true}`` (the proxy also sends
  ``max_tokens: 1``, ``stream: false``) is a *prefill*: it runs as usual, and its prompt's blocks are
  parked instead of freed. The response carries ``kv_transfer_params`` naming what to pull:
  ``do_remote_prefill: true``, ``remote_engine_id``, ``remote_request_id``, ``remote_block_ids``,
  ``remote_host``, ``remote_port``, ``expires_at`` (Unix time), and plaserve's ``num_prompt_tokens`` and
  ``first_token_ids`` (the token each choice sampled);
* a request with those ``kv_transfer_params`` (``do_remote_prefill: true``) is a *decode*: the worker
  reserves blocks (its prefix cache's first), pulls the rest from ``remote_host:remote_port``, and
  admits the request with its prompt computed and its first token known, then streams as usual.

A pull that fails is a 503 with code ``kv_pull_failed`` (the router re-runs the prefill elsewhere); a
decode worker without room waits for some while the KV stays parked, then answers 503 ``kv_no_room``
(the router tries another decode worker). A decode leg whose client leaves before the pull tells
the prefill worker to free the parked KV.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from plaserve.engine.kv_transfer import KVNoRoomError, KVTransferError, Reservation
from plaserve.request import RequestOutput, SamplingParams
from plaserve.server.engine_loop import EngineLoop, EngineStoppedError, OutputSink, Submission
from plaserve.server.errors import ApiError
from plaserve.server.generation import Generation, queue_submissions
from plaserve.server.kv_transfer import KVTransferMetrics, KVTransferService, pull, release

log = logging.getLogger(__name__)

T = TypeVar("T")

PD_ROLES = ("both", "prefill", "decode")
# A decode worker without room for an import tries again after ROOM_POLL_S, doubling up to
# ROOM_POLL_MAX_S (a decode step's time or so), and gives up ROOM_MARGIN_S before the parked KV
# expires: the pull must start before then, and the two workers' clocks may differ a little.
ROOM_POLL_S = 0.01
ROOM_POLL_MAX_S = 0.1
ROOM_MARGIN_S = 1.0


@dataclass(frozen=True)
class KVTransferParams:
    """A request's ``kv_transfer_params``, checked."""

    do_remote_decode: bool
    do_remote_prefill: bool
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    num_prompt_tokens: int | None = None
    first_token_ids: tuple[int, ...] = ()
    expires_at: float | None = None  # Unix time the prefill worker frees the parked KV


def _field(params: dict, name: str, kind: type | tuple[type, ...], required: bool) -> Any:
    value = params.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, kind) or isinstance(value, bool) and kind is not bool:
        kinds = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise ApiError(
            400,
            f"'kv_transfer_params.{name}' must be {kinds}, not {type(value).__name__}",
            param=f"kv_transfer_params.{name}",
        )
    return value


def parse_kv_transfer_params(body: dict[str, Any]) -> KVTransferParams | None:
    """The checked ``kv_transfer_params`` of a request body (None: absent, or neither flag set)."""
    raw = body.get("kv_transfer_params")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ApiError(400, "'kv_transfer_params' must be an object", param="kv_transfer_params")
    decode = bool(_field(raw, "do_remote_decode", bool, False))
    prefill = bool(_field(raw, "do_remote_prefill", bool, False))
    if decode and prefill:
        raise ApiError(
            400,
            "'kv_transfer_params' cannot set both do_remote_decode and do_remote_prefill",
            param="kv_transfer_params",
        )
    if not decode and not prefill:
        return None
    if decode:
        return KVTransferParams(True, False)
    port = _field(raw, "remote_port", int, True)
    if not 0 < port < 65536:
        raise ApiError(
            400,
            f"'kv_transfer_params.remote_port' {port} is not a port",
            param="kv_transfer_params",
        )
    expires_at = _field(raw, "expires_at", (int, float), False)
    first = _field(raw, "first_token_ids", list, True)
    if not first or not all(isinstance(t, int) and not isinstance(t, bool) for t in first):
        raise ApiError(
            400,
            "'kv_transfer_params.first_token_ids' must be a non-empty list of token ids",
            param="kv_transfer_params.first_token_ids",
        )
    return KVTransferParams(
        False,
        True,
        remote_host=_field(raw, "remote_host", str, True),
        remote_port=port,
        remote_request_id=_field(raw, "remote_request_id", str, True),
        num_prompt_tokens=_field(raw, "num_prompt_tokens", int, True),
        first_token_ids=tuple(first),
        expires_at=None if expires_at is None else float(expires_at),
    )


def check_pd_request(
    params: KVTransferParams, num_prompts: int, sampling: SamplingParams, stream: bool
) -> None:
    """What a request carrying ``kv_transfer_params`` may not ask for: 400 naming it."""
    if num_prompts != 1:
        raise ApiError(
            400,
            "a request with kv_transfer_params takes exactly one prompt",
            param="prompt",
        )
    if sampling.logprobs is not None or sampling.prompt_logprobs is not None:
        raise ApiError(
            400,
            "logprobs are not carried through prefill/decode disaggregation; send the request "
            "without kv_transfer_params",
            param="logprobs",
        )
    if params.do_remote_decode and stream:
        raise ApiError(
            400, "a prefill for a remote decode (do_remote_decode) cannot stream", param="stream"
        )


class PDWorker:
    """One worker's part in prefill/decode disaggregation: its role, its transfer service and the
    two request paths (``role``: ``prefill``, ``decode`` or ``both``)."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        role: str = "both",
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        advertise_host: str | None = None,
        ttl: float = 30.0,
        pull_timeout: float = 30.0,
    ) -> None:
        if role not in PD_ROLES:
            raise ValueError(f"pd role must be one of {', '.join(PD_ROLES)}, not {role!r}")
        self.loop = engine_loop
        self.role = role
        self.engine_id = uuid.uuid4().hex
        self.advertise_host = advertise_host or host
        self.pull_timeout = pull_timeout
        engine_loop.engine.kv_handoff.ttl = ttl
        self.waiting_for_room = 0  # decode legs waiting for blocks or sequences (_reserve)
        self._releases: set[asyncio.Task] = set()  # _release_remote's, until done
        self.metrics = KVTransferMetrics(engine_loop.metrics.registry)
        self.service = KVTransferService(engine_loop, self.metrics, host, port)

    async def start(self) -> None:
        await self.service.start()

    async def stop(self) -> None:
        for task in list(self._releases):
            task.cancel()
        await asyncio.gather(*self._releases, return_exceptions=True)
        await self.service.stop()

    def describe(self) -> dict[str, Any]:
        """What ``/load`` reports of the role (the router reads it)."""
        return {
            "role": self.role,
            "transfer_port": self.service.port,
            "waiting_for_room": self.waiting_for_room,
        }

    # --- prefill side --------------------------------------------------------------------------
    def check_role(self, params: KVTransferParams) -> None:
        if params.do_remote_decode and self.role == "decode":
            raise ApiError(400, "this is a decode worker; it does not prefill for others")
        if params.do_remote_prefill and self.role == "prefill":
            raise ApiError(400, "this is a prefill worker; it does not take remote prefills")

    def hold(self, request_id: str) -> None:
        """Park ``request_id``'s prompt blocks when it finishes (a set add: safe from any thread, and
        done before the request is submitted, so it cannot finish first)."""
        self.loop.engine.kv_handoff.hold(request_id)

    def forget(self, request_id: str) -> None:
        """Undo :meth:`hold` for a request that was never submitted."""
        self.loop.engine.kv_handoff.forget(request_id)

    def export_params(self, request_id: str, outputs: list[RequestOutput]) -> dict[str, Any]:
        """The ``kv_transfer_params`` of a finished prefill's response."""
        handoff = self.loop.engine.kv_handoff
        parked = handoff.parked.get(request_id)
        ttl_left = parked.expires - self.loop.clock() if parked is not None else 0.0
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request_id,
            "remote_block_ids": list(parked.block_ids) if parked is not None else [],
            "remote_host": self.advertise_host,
            "remote_port": self.service.port,
            "expires_at": time.time() + ttl_left,
            "num_prompt_tokens": len(outputs[0].prompt_token_ids),
            "first_token_ids": [o.outputs[0].token_ids[0] for o in outputs],
        }

    # --- decode side ---------------------------------------------------------------------------
    async def import_generation(
        self,
        request_id: str,
        prompt: list[int],
        params: list[SamplingParams],
        kvp: KVTransferParams,
        stream_interval: int = 1,
    ) -> Generation:
        """Pull a remote prefill's KV and start its choices here (one per entry of ``params``);
        ``stream_interval`` as :attr:`~plaserve.server.engine_loop.Submission.stream_interval`.

        The choices with a first token in ``kvp`` are imported, as many as this worker can ever
        hold at once (its ``--max-num-seqs``, its blocks:
        :meth:`~plaserve.engine.kv_transfer.KVHandoff.max_choices`); the others (the router's
        prefill leg samples one) queue as ordinary requests behind the first, as a colocated server
        runs them: the pulled prompt blocks are in the prefix cache by then, so they compute only a
        partial last block and sample their own first token (with a seed, the one a colocated
        server samples)."""
        if kvp.num_prompt_tokens != len(prompt):
            raise ApiError(
                400,
                f"kv_transfer_params name a prefill of {kvp.num_prompt_tokens} prompt tokens; this "
                f"request's prompt has {len(prompt)} here (the workers must share a tokenizer)",
                param="kv_transfer_params.num_prompt_tokens",
            )
        if len(kvp.first_token_ids) > len(params):
            raise ApiError(
                400,
                f"kv_transfer_params carry {len(kvp.first_token_ids)} first tokens for "
                f"{len(params)} choices",
                param="kv_transfer_params.first_token_ids",
            )
        vocab = self.loop.engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in kvp.first_token_ids):
            raise ApiError(
                400,
                f"a first token id is outside the vocabulary [0, {vocab})",
                param="kv_transfer_params.first_token_ids",
            )
        arrival = self.loop.clock()
        most = self.loop.engine.kv_handoff.max_choices(len(prompt))
        imported = max(1, min(len(kvp.first_token_ids), most))
        admitted, held = False, None  # held: the reservation to give back unless admitted
        try:
            res = held = await self._reserve(prompt, imported, kvp.expires_at)
            assert kvp.remote_host is not None and kvp.remote_port is not None
            assert kvp.remote_request_id is not None
            try:
                await pull(
                    self.loop,
                    self.metrics,
                    kvp.remote_host,
                    kvp.remote_port,
                    kvp.remote_request_id,
                    res,
                    self.pull_timeout,
                )
            except KVTransferError as e:
                log.warning("request %s: %s", request_id, e)
                raise ApiError(503, str(e), code="kv_pull_failed") from None
            aloop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()
            subs = [
                Submission(
                    f"{request_id}-{i}",
                    prompt,
                    p,
                    arrival,
                    OutputSink(aloop, queue, i),
                    after=f"{request_id}-0" if i >= imported else None,
                    stream_interval=stream_interval,
                )
                for i, p in enumerate(params)
            ]
            first, rest = subs[:imported], subs[imported:]

            def admit(loop: EngineLoop) -> None:
                reqs = loop.engine.kv_handoff.admit(
                    res,
                    [(s.request_id, s.params, t) for s, t in zip(first, kvp.first_token_ids)],
                    arrival,
                )
                for req, sub in zip(reqs, first):
                    loop.adopt(req, sub.sink, sub.stream_interval)

            def abort(subs: list[Submission]) -> None:
                for sub in subs:
                    self.loop.abort(sub.request_id)

            try:
                await self._call(admit, lambda _: abort(first))
            except KVTransferError as e:
                raise ApiError(503, str(e)) from None
            except EngineStoppedError as e:
                raise ApiError(503, str(e)) from None
            admitted = True
            if rest:
                try:
                    queue_submissions(self.loop, rest)
                except ApiError:
                    abort(first)
                    raise
            return Generation(self.loop, subs, queue)
        except asyncio.CancelledError:  # the client left: nobody will pull the parked KV
            if not admitted:
                self._release_remote(kvp)
            raise
        finally:
            if not admitted and held is not None:
                await self._cancel(held)

    def _release_remote(self, kvp: KVTransferParams) -> None:
        """Tell the prefill worker to free the KV it parked for ``kvp``: this decode leg's client
        left before the pull, and no other leg will pull it. Runs on its own; the parked KV
        expires all the same if it cannot."""
        assert kvp.remote_host is not None and kvp.remote_port is not None
        assert kvp.remote_request_id is not None
        task = asyncio.ensure_future(
            release(kvp.remote_host, kvp.remote_port, kvp.remote_request_id, self.pull_timeout)
        )
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _reserve(self, prompt: list[int], n: int, expires_at: float | None) -> Reservation:
        """The blocks for ``n`` choices of ``prompt``, whose KV is pulled next. While this worker has
        not the blocks or the sequences free, wait for its running requests to free some (as vLLM's
        decode instance queues such a request), as long as the prefill worker keeps the KV parked:
        until ``ROOM_MARGIN_S`` before ``expires_at`` (none given: no wait). Then 503 ``kv_no_room``,
        which the router takes to another decode worker."""
        delay, waiting = ROOM_POLL_S, False
        try:
            while True:
                try:
                    return await self._call(
                        lambda loop: loop.engine.kv_handoff.reserve(prompt, n), self._give_back
                    )
                except KVNoRoomError as e:
                    if expires_at is None or time.time() + delay > expires_at - ROOM_MARGIN_S:
                        raise ApiError(
                            503, str(e), code="kv_no_room", headers={"Retry-After": "1"}
                        ) from None
                except KVTransferError as e:
                    raise ApiError(
                        503, str(e), code="kv_no_room", headers={"Retry-After": "1"}
                    ) from None
                except ValueError as e:
                    raise ApiError(400, str(e)) from None
                except EngineStoppedError as e:
                    raise ApiError(503, str(e)) from None
                if not waiting:  # /load tells the router (DecodeTier.pressure)
                    waiting, self.waiting_for_room = True, self.waiting_for_room + 1
                await asyncio.sleep(delay)
                delay = min(2 * delay, ROOM_POLL_MAX_S)
        finally:
            if waiting:
                self.waiting_for_room -= 1

    async def _call(self, fn: Callable[[EngineLoop], T], undo: Callable[[T], object]) -> T:
        """``self.loop.call(fn)``; a caller cancelled first (its client gone) has ``undo`` applied to
        what ``fn`` returns, since the engine thread runs ``fn`` all the same."""
        call = asyncio.ensure_future(self.loop.call(fn))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            call.add_done_callback(
                lambda done: done.cancelled() or done.exception() is not None or undo(done.result())
            )
            raise

    def _give_back(self, res: Reservation) -> None:
        """Return a reservation's blocks (from the event loop, without waiting)."""
        try:
            self.loop.post(lambda loop: loop.engine.kv_handoff.cancel(res), lambda ok, _: None)
        except EngineStoppedError:
            pass  # the engine's books went with it

    async def _cancel(self, res: Reservation) -> None:
        try:
            await asyncio.shield(self.loop.call(lambda loop: loop.engine.kv_handoff.cancel(res)))
        except EngineStoppedError:
            pass  # the engine's books went with it
