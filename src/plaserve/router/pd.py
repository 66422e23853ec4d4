"""The router's prefill/decode mode: ``plaserve route --prefill-urls ... --decode-urls ...``
(docs/PD.md).

A request runs in two legs, in the wire protocol of vLLM's disaggregated proxy:

1. **prefill**: the request with ``max_tokens: 1``, ``stream: false`` and ``"kv_transfer_params":
   {"do_remote_decode": true}`` goes to a prefill worker chosen by the router's policy (pla: cost-priced
   backlogs, short/long pools; the prefill workers are the router's ordinary workers). Its answer's
   ``kv_transfer_params`` say where the KV is parked;
2. **decode**: the original request with those ``kv_transfer_params`` goes to the decode worker with
   the lowest KV utilisation (in steps of 10 %), then the fewest running decodes (its ``/load``, plus
   what the router sent since), which pulls the KV and answers (streamed or not).

Failures before the first byte reach the client are retried, up to ``max_attempts`` legs in all: a
prefill that fails (connection, 5xx, 429) runs on another prefill worker; a decode worker that fails
or has no room is replaced by another with the same parked KV; a pull that fails (``kv_pull_failed``:
the prefill worker died or the KV expired) re-runs the prefill on another prefill worker. After the
first byte a failing decode worker ends the stream with an error event, as the colocated router does.

Requests PD does not carry (logprobs, several prompts, token counts, background Responses) run whole
on a decode worker; a Response
that continues a kept one (``previous_response_id``) runs whole on the decode worker that keeps it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any, Callable

import aiohttp
from aiohttp import web

from plaserve.router.config import RouterConfig
from plaserve.router.costs import default_cost_model
from plaserve.router.forward import error_json, response_headers
from plaserve.router.health import WorkerMonitor
from plaserve.router.hints import HintCheck, usage_prompt_tokens
from plaserve.router.policies import Job
from plaserve.router.workers import Worker

if TYPE_CHECKING:
    from plaserve.router.proxy import Router, _Failure

log = logging.getLogger(__name__)

KV_UTILISATION_STEP = 0.1  # decode workers within one step of KV utilisation count as equal


def pd_capable(path: str, body: dict[str, Any]) -> bool:
    """Whether a request can run as prefill + decode: a generation of one prompt answered when it
    is done, no logprobs of any kind (``/v1/messages/count_tokens`` generates nothing)."""
    if path.endswith("/count_tokens") or body.get("background") is True:
        return False  # a background Response answers at once, with no KV to hand over
    logprobs = body.get("logprobs")  # `logprobs: 0` asks for them too (`0 in (None, False)`)
    if (logprobs is not None and logprobs is not False) or body.get("prompt_logprobs") is not None:
        return False
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return len(prompt) == 1  # a batch of prompts: only a batch of one
    return True


def prefill_body(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg's body: one choice of one token, not streamed, its KV kept for a remote
    decode. One choice: the decode worker queues the others behind it, over the prompt blocks it
    pulled (``PDWorker.import_generation``); a prefill of ``n`` would hold the first choice's parked
    blocks while the others wait for blocks of their own, and on a full prefill worker they could
    wait until the parked KV expires."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "n", "best_of")}
    if path == "/v1/responses":
        out["max_output_tokens"] = 1
    else:
        out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    for name in ("min_tokens", "min_completion_tokens"):
        if isinstance(out.get(name), int) and out[name] > 1:
            out[name] = 1  # the first token still may not be EOS when the client said so
    out["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return out


class DecodeTier:
    """The decode workers: their health and ``/load``, and the choice of one per request."""

    def __init__(
        self,
        urls: list[str],
        config: RouterConfig,
        session: Callable[[], aiohttp.ClientSession],
        headers: dict[str, str],
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self._clock = clock
        self.workers: dict[str, Worker] = {}
        self.loads: dict[str, dict[str, Any]] = {}
        for url in urls:
            w = Worker(url, default_cost_model(), config.breaker, healthy=False)
            self.workers[w.url] = w
        self.monitor = WorkerMonitor(
            config.health,
            session,
            lambda: list(self.workers.values()),
            on_change=lambda: None,
            on_load=self._on_load,
            headers=headers,
            clock=clock,
        )

    def _on_load(self, worker: Worker, load: dict[str, Any]) -> None:
        self.loads[worker.url] = load

    async def start(self) -> None:
        async def probe(w: Worker) -> None:
            self.monitor.record_check(w, await self.monitor.probe(w))

        await asyncio.gather(*(probe(w) for w in self.workers.values()))
        self.monitor.start()

    async def stop(self) -> None:
        await self.monitor.stop()

    def available(self) -> list[Worker]:
        now = self._clock()
        return [w for w in self.workers.values() if w.available(now)]

    def pressure(self, worker: Worker) -> tuple[float, int]:
        """``(KV utilisation in steps, running decodes)``: lower is better. Requests the router sent
        after the worker's last ``/load`` count as running there; a worker with decode legs waiting
        for room (``pd.waiting_for_room``) is full, and those count as running too."""
        load = self.loads.get(worker.url, {})
        kv = load.get("kv", {}) if isinstance(load.get("kv"), dict) else {}
        util = kv.get("utilization", 0.0)
        running = load.get("running", {})
        count = sum(running.values()) if isinstance(running, dict) else 0
        pd = load.get("pd", {}) if isinstance(load.get("pd"), dict) else {}
        waiting = pd.get("waiting_for_room", 0)
        if isinstance(waiting, int) and waiting > 0:
            util, count = 1.0, count + waiting
        report = worker.load
        unseen = sum(
            1 for r in worker.inflight.values() if report is None or r.dispatched >= report.sent
        )
        step = int(util / KV_UTILISATION_STEP) if isinstance(util, (int, float)) else 0
        return (step, count + unseen)

    def choose(self, exclude: set[str]) -> Worker | None:
        """The least loaded available decode worker not in ``exclude`` (None: none left)."""
        candidates = [w for w in self.available() if w.url not in exclude]
        if not candidates:
            return None
        return min(candidates, key=lambda w: (self.pressure(w), w.num_inflight))

    def describe(self) -> list[dict[str, Any]]:
        now = self._clock()
        return [
            {
                **w.describe(now, self.config.health.load_stale_s),
                "role": "decode",
                "pressure": list(self.pressure(w)),
            }
            for w in self.workers.values()
        ]


class _Retry(Exception):
    """A leg failed before anything reached the client; ``rerun_prefill``: the parked KV is gone."""

    def __init__(self, failure: _Failure, rerun_prefill: bool) -> None:
        super().__init__(failure.status)
        self.failure = failure
        self.rerun_prefill = rerun_prefill


async def generate_pd(
    router: Router,
    request: web.Request,
    path: str,
    body: dict[str, Any],
    job: Job,
    headers: dict[str, str],
    check: HintCheck | None = None,
    holder: Worker | None = None,
) -> web.StreamResponse:
    """Route one generation request through a prefill worker and a decode worker (module doc);
    ``check`` (a length hint's) is measured on the prefill leg's usage. ``holder``: the decode worker
    that keeps the Response this one continues, which then runs it whole."""
    from plaserve.router.proxy import NoWorkerError, _Failure

    tier = router.decode_tier
    assert tier is not None
    stream = body.get("stream") is True
    if holder is not None and holder.url in tier.workers:
        others = {url for url in tier.workers if url != holder.url}
        return await _decode_leg_with_retries(
            router, request, path, json.dumps(body).encode(), headers, stream, job, others
        )
    if not pd_capable(path, body):
        return await _decode_leg_with_retries(
            router, request, path, json.dumps(body).encode(), headers, stream, job
        )
    first_raw = json.dumps(prefill_body(path, body)).encode()
    tried_prefill: set[str] = set()
    tried_decode: set[str] = set()
    failure: _Failure | None = None
    params: dict[str, Any] | None = None
    for attempt in range(router.config.max_attempts):
        if attempt:
            router.metrics.retries.inc()
        if params is None:
            rid = next(router._rids)
            try:
                worker, cost = await router.dispatcher.acquire(job, rid, frozenset(tried_prefill))
            except NoWorkerError:
                break
            tried_prefill.add(worker.url)
            result = await _prefill_leg(router, path, first_raw, headers, job, worker, rid, check)
            if isinstance(result, web.Response):
                return result  # the client's error, as the worker put it
            if isinstance(result, _Failure):
                failure = result
                continue
            params = result
        decode = tier.choose(tried_decode)
        if decode is None:
            failure = failure or _Failure(
                503, error_json(503, "no decode worker available"), {"Retry-After": "1"}
            )
            break
        tried_decode.add(decode.url)
        second = json.dumps({**body, "kv_transfer_params": params}).encode()
        try:
            return await _decode_leg(router, request, path, second, headers, stream, job, decode)
        except _Retry as e:
            failure = e.failure
            if e.rerun_prefill:
                params = None
                tried_decode.discard(decode.url)  # the decode worker was fine; the KV was gone
    if failure is None:
        router.metrics.no_worker.inc()
        return router._reply(
            path, 503, error_json(503, "no prefill worker available"), {"Retry-After": "1"}
        )
    return router._reply(path, failure.status, failure.body, failure.headers)


async def _prefill_leg(
    router: Router,
    path: str,
    raw: bytes,
    headers: dict[str, str],
    job: Job,
    worker: Worker,
    rid: int,
    check: HintCheck | None = None,
) -> dict[str, Any] | web.Response | _Failure:
    """The prefill on ``worker``: its ``kv_transfer_params``, the client's 4xx, or a failure."""
    from plaserve.router.proxy import _Failure

    finish = router._finisher(worker, rid)

    try:
        answer = await router._first_answer(worker, path, raw, headers, False, finish)
        if isinstance(answer, _Failure):
            return answer
        resp, data = answer
        assert isinstance(data, bytes)
        if resp.status != 200:
            passthrough = resp.status != 429 and resp.status < 500
            finish(passthrough, "client_error" if passthrough else "failed", fault=not passthrough)
            if passthrough:
                return router._reply(path, resp.status, data, response_headers(resp.headers))
            return _Failure(resp.status, data, response_headers(resp.headers))
        worker.first_token(rid)
        try:
            params = json.loads(data)["kv_transfer_params"]
            assert isinstance(params, dict) and params.get("do_remote_prefill") is True
        except (ValueError, KeyError, TypeError, AssertionError):
            finish(False, "failed")
            return router._failure(worker, "its answer carried no kv_transfer_params")
        finish(True, "ok")
        if check is not None:  # the prefill's answer counts the whole prompt
            check.actual(usage_prompt_tokens(data))
        return params
    except asyncio.CancelledError:
        finish(False, "client_gone", fault=False)
        raise


async def _decode_leg(
    router: Router,
    request: web.Request,
    path: str,
    raw: bytes,
    headers: dict[str, str],
    stream: bool,
    job: Job,
    worker: Worker,
) -> web.StreamResponse:
    """The decode on ``worker``: the client's response, or :class:`_Retry` before the first byte."""
    from plaserve.router.proxy import _Failure

    rid = next(router._rids)
    worker.start(rid, 0.0, sum(job.tokens), job.length_class, router._clock())
    # Decode workers are picked directly, not dispatched: their attempts wake no dispatcher.
    finish = router._finisher(worker, rid, wake=False)

    try:
        answer = await router._first_answer(worker, path, raw, headers, stream, finish)
        if isinstance(answer, _Failure):
            raise _Retry(answer, False)
        resp, first = answer
        if resp.status != 200:
            assert isinstance(first, bytes)
            code = _error_code(first)
            if code == "kv_pull_failed":
                finish(True, "kv_pull_failed", fault=False)  # the prefill side's fault
                log.info(
                    "decode worker %s could not pull the KV; re-running the prefill", worker.url
                )
                raise _Retry(_Failure(resp.status, first, response_headers(resp.headers)), True)
            passthrough = resp.status != 429 and resp.status < 500
            finish(passthrough, "client_error" if passthrough else "failed", fault=False)
            if passthrough:
                return router._reply(path, resp.status, first, response_headers(resp.headers))
            raise _Retry(_Failure(resp.status, first, response_headers(resp.headers)), False)
        now = router._clock()
        worker.first_token(rid)
        if isinstance(first, bytes):
            finish(True, "ok")
            router.metrics.child(router.metrics.e2e, job.length_class).observe(now - job.arrival)
            return router._reply(path, 200, first, response_headers(resp.headers))
        if first.error is not None:
            resp.close()
            finish(False, "failed")
            raise _Retry(router._failure(worker, first.error), False)
        router.metrics.child(router.metrics.ttft, job.length_class).observe(now - job.arrival)
        return await router._stream_rest(request, path, resp, first, job, worker, finish)
    except asyncio.CancelledError:
        finish(False, "client_gone", fault=False)
        raise


async def _decode_leg_with_retries(
    router: Router,
    request: web.Request,
    path: str,
    raw: bytes,
    headers: dict[str, str],
    stream: bool,
    job: Job,
    exclude: set[str] | None = None,
) -> web.StreamResponse:
    """A request PD does not carry, whole on a decode worker not in ``exclude`` (retried on others
    before its first byte)."""
    tier = router.decode_tier
    assert tier is not None
    tried: set[str] = set(exclude or ())
    failure = None
    for _ in range(router.config.max_attempts):
        worker = tier.choose(tried)
        if worker is None:
            break
        tried.add(worker.url)
        try:
            return await _decode_leg(router, request, path, raw, headers, stream, job, worker)
        except _Retry as e:
            failure = e.failure
    if failure is None:
        return router._reply(
            path, 503, error_json(503, "no decode worker available"), {"Retry-After": "1"}
        )
    return router._reply(path, failure.status, failure.body, failure.headers)


def _error_code(body: bytes) -> str | None:
    try:
        error = json.loads(body).get("error")
        return error.get("code") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        return None
