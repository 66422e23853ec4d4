"""The router as an HTTP server: an async proxy in front of OpenAI-compatible workers.

Routes:

* ``POST /v1/completions``, ``POST /v1/chat/completions``: routed by the policy, streamed through
  chunk by chunk (``stream: true``), retried on another worker when one fails before its first token;
* ``GET /v1/models``: the first worker in rotation that answers;
* ``GET /health``: 200 while at least one worker is in rotation, else 503;
* ``GET /metrics``: Prometheus text format (:mod:`plaserve.router.metrics`);
* ``GET /workers``: every worker's state and the policy's (pools, pressures);
  ``POST /workers`` and ``DELETE /workers`` with ``{"url": ...}`` (or ``?url=``): add and remove
  workers at run time.

Pricing: each request's prompt lengths come from :mod:`plaserve.router.length`, or from the
``x-prompt-tokens`` header of a gateway named by ``--trust-length-hints-from``
(:mod:`plaserve.router.hints`); a hint's error against the answer's ``usage.prompt_tokens`` is
measured in ``plaserve_router_length_hint_relative_error``.

Failure handling, per request: up to ``max_attempts`` workers, each tried once. A connection error,
a timeout, a 5xx, a 429, an error event or the end of the stream before the first token, or the worker
leaving the rotation (failed health checks) while the request waits for its first byte: the request
goes to another worker, and nothing has reached the client yet. A 4xx other than 429 is the client's
error and is passed back as it is. After the first token a failing worker ends the stream with an
error event (``data: {"error": ...}`` then ``data: [DONE]``). When no worker is left: 503. Every
request ends in a response, an error status or an error event; none is dropped silently.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import aiohttp
from aiohttp import web

from plaserve import json_body
from plaserve.cost import CostModel
from plaserve.model.tokenizer import Tokenizer
from plaserve.router.config import RouterConfig
from plaserve.router.costs import DEFAULT_SHORT_THRESHOLD, cost_model_from_dict, default_cost_model
from plaserve.router.dispatch import Dispatcher, NoWorkerError
from plaserve.router.forward import (
    FirstTokenScanner,
    error_json,
    request_headers,
    response_headers,
    sse_error,
)
from plaserve.router.health import WorkerMonitor
from plaserve.router.hints import HEADER as HINT_HEADER
from plaserve.router.hints import HintCheck, HintError, forwarded, usage_prompt_tokens
from plaserve.router.length import Estimate, LengthEstimator
from plaserve.router.metrics import RouterMetrics
from plaserve.router.pd import DecodeTier, generate_pd
from plaserve.router.policies import Job, make_policy
from plaserve.router.prefixes import cache_hit_tokens, cache_tokens, prompt_key
from plaserve.router.workers import Worker

log = logging.getLogger(__name__)

JSON = "application/json"


@dataclass
class _Failure:
    """Why one attempt failed, and what the client gets if it was the last."""

    status: int
    body: bytes
    headers: dict[str, str]


class Router:
    """The router's state and request handling; :func:`build_app` puts it behind aiohttp."""

    def __init__(
        self,
        worker_urls: list[str],
        config: RouterConfig | None = None,
        *,
        tokenizer: Tokenizer | None = None,
        profile: tuple[CostModel, int | None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        decode_urls: list[str] | None = None,
    ) -> None:
        """``decode_urls``: prefill/decode mode (``router/pd.py``): ``worker_urls`` are then the prefill
        workers, and each request's decode runs on one of these."""
        config = config or RouterConfig()
        self.config = config
        self._clock = clock
        self._profile_cost, profile_threshold = profile if profile is not None else (None, None)
        self.short_threshold = profile_threshold or DEFAULT_SHORT_THRESHOLD
        self.threshold_source = "profile" if profile_threshold else "default"
        self._shared_cost: CostModel | None = None  # the last cost model a worker reported
        self.workers: dict[str, Worker] = {}
        for url in worker_urls:
            self._new_worker(url)
        self.policy = make_policy(config)
        self.dispatcher = Dispatcher(
            self.policy,
            lambda: list(self.workers.values()),
            fallback_wakeup_s=config.health.load_interval_s,
            clock=clock,
        )
        self.estimator = LengthEstimator(tokenizer)
        self.metrics = RouterMetrics()
        auth = {"Authorization": f"Bearer {config.worker_api_key}"} if config.worker_api_key else {}
        self._auth = auth
        self.monitor = WorkerMonitor(
            config.health,
            lambda: self.session,
            lambda: list(self.workers.values()),
            on_change=self.dispatcher.wake,
            on_load=self._on_load,
            headers=auth,
            clock=clock,
        )
        self._rids = itertools.count()
        self._tokenize_turn = itertools.count()
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=config.connect_timeout_s, sock_read=config.request_timeout_s
        )
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self.decode_tier = (
            DecodeTier(decode_urls, config, lambda: self.session, auth, clock)
            if decode_urls
            else None
        )

    # --- lifecycle -------------------------------------------------------------------------------
    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router is not started")
        return self._session

    async def start(self) -> None:
        """Open the connection pool, probe every worker once, start the background loops."""
        # No connection limit: a capped pool would queue requests inside the router, unaccounted.
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0), auto_decompress=False
        )
        await asyncio.gather(*(self._probe(w) for w in self.workers.values()))
        if self.decode_tier is not None:
            await self.decode_tier.start()
        self.monitor.start()
        self.dispatcher.start()
        self._tasks.append(asyncio.create_task(self._controller_loop()))

    async def stop(self) -> None:
        await self.dispatcher.stop()
        await self.monitor.stop()
        if self.decode_tier is not None:
            await self.decode_tier.stop()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _controller_loop(self) -> None:
        period = self.config.pools.period_s
        while True:
            await asyncio.sleep(period)
            now = self._clock()
            try:
                self.policy.tick(self.dispatcher.available(now), now)
            except Exception:
                log.exception("pool controller tick failed")
            self.dispatcher.wake()

    # --- workers ---------------------------------------------------------------------------------
    def _new_worker(self, url: str) -> Worker:
        cost = self._profile_cost or self._shared_cost or default_cost_model()
        worker = Worker(
            url,
            cost,
            self.config.breaker,
            healthy=False,
            prefix_cache_tokens=self.config.prefix_cache_tokens,
        )
        self.workers[worker.url] = worker
        return worker

    async def _probe(self, worker: Worker) -> None:
        ok = await self.monitor.probe(worker)
        self.monitor.record_check(worker, ok)
        if not ok:
            log.warning(
                "worker %s did not answer its first health check; it joins when it does", worker.url
            )
        self.dispatcher.wake()

    def _on_load(self, worker: Worker, load: dict[str, Any]) -> None:
        """Adopt what a worker's ``/load`` says about its cost model and short threshold.

        Without a profile, a worker that reports a cost model is priced by it; workers that report
        none (no ``/load``) are priced by the last model any worker reported, taking the cluster as
        uniform, rather than by the default: mixing the two would make them look several times
        cheaper or dearer than their peers.
        """
        if self._profile_cost is None:
            model = cost_model_from_dict(load.get("cost_model"), source="worker")
            if model is not None:
                worker.cost_model, worker.reports_cost = model, True
                if self._shared_cost != model:
                    self._shared_cost = model
                    for w in self.workers.values():
                        if not w.reports_cost:
                            w.cost_model = model
        cache = cache_tokens(load)
        if cache is not None:
            worker.prefixes.resize(cache)
        worker.cache_hit_tokens = cache_hit_tokens(load)
        threshold = load.get("short_threshold")
        if self.threshold_source == "default" and isinstance(threshold, int) and threshold > 0:
            self.short_threshold, self.threshold_source = threshold, f"worker {worker.url}"

    async def add_worker(self, url: str) -> Worker:
        """Add a worker and probe it; it serves once it is healthy (at once if the probe passed).
        Adding a worker the router has already is a no-op."""
        url = url.rstrip("/")
        worker = self.workers.get(url)
        if worker is None:
            worker = self._new_worker(url)
            await self._probe(worker)
        return worker

    def remove_worker(self, url: str) -> bool:
        """Take a worker out of the router: no new requests; those in flight finish."""
        worker = self.workers.pop(url.rstrip("/"), None)
        if worker is None:
            return False
        worker.remove()
        self.metrics.forget_worker(worker.url)
        self.dispatcher.wake()
        return True

    # --- length estimates ------------------------------------------------------------------------
    async def _remote_tokenize(self, payload: dict[str, Any]) -> int | None:
        """Count tokens with a worker's ``/tokenize``, trying each worker that may have one."""
        candidates = [
            w for w in self.dispatcher.available(self._clock()) if w.supports_tokenize is not False
        ]
        if not candidates:
            return None
        start = next(self._tokenize_turn)
        for i in range(len(candidates)):
            worker = candidates[(start + i) % len(candidates)]
            try:
                async with self.session.post(
                    worker.url + "/tokenize",
                    json=payload,
                    headers=self._auth,
                    timeout=aiohttp.ClientTimeout(total=self.config.health.timeout_s),
                ) as r:
                    if r.status in (404, 405):
                        worker.supports_tokenize = False
                        continue
                    if r.status != 200:
                        return None  # the worker refused this prompt: the estimate falls back
                    body = await r.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
                continue
            count = body.get("count") if isinstance(body, dict) else None
            if count is None and isinstance(body, dict) and isinstance(body.get("tokens"), list):
                count = len(body["tokens"])
            if isinstance(count, int) and not isinstance(count, bool) and count >= 0:
                worker.supports_tokenize = True
                return count
            worker.supports_tokenize = False
        return None

    async def estimate(self, path: str, body: dict[str, Any]) -> Estimate:
        """The prompt lengths of a generation request. Each prompt counts once whatever its ``n``: a
        plaserve worker prefills it once for all its choices (the later ones reuse its cached blocks)."""
        remote = self._remote_tokenize if self.estimator.tokenizer is None else None
        return await self.estimator.request(path, body, remote)

    # --- generation ------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        """Route one ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` or ``/v1/messages``
        request (or a Messages request's ``count_tokens``)."""
        arrival = self._clock()
        path = request.path
        raw = await request.read()
        try:
            body = json_body.loads(raw)
        except json_body.JsonBodyError as e:
            return self._reply(path, 400, error_json(400, str(e)))
        if not isinstance(body, dict):
            return self._reply(path, 400, error_json(400, "request body must be a JSON object"))
        try:
            hint = self._hint(request, path, body)
        except HintError as e:
            return self._reply(path, 400, error_json(400, str(e)))
        est = Estimate(hint, "hint") if hint is not None else await self.estimate(path, body)
        self.metrics.child(self.metrics.estimates, est.method).inc()
        self.metrics.child(self.metrics.pricing.priced_tokens, est.method).inc(sum(est.tokens))
        check = HintCheck(hint, self.metrics.pricing.error.observe) if hint is not None else None
        prompt = prompt_key(path, body) if self.config.prefix_aware else None
        workers = self.dispatcher.available(arrival)
        job = Job.of(est.tokens, prompt, arrival, self.short_threshold, workers)
        headers = forwarded(request_headers(request.headers), used=hint is not None)
        # a Response that continues a kept one runs where that one is kept (plaserve workers)
        owner = self._response_holder(body.get("previous_response_id"))
        if self.decode_tier is not None:
            return await generate_pd(self, request, path, body, job, headers, check, owner)
        stream = body.get("stream") is True
        tried = {url for url in self.workers if url != owner.url} if owner is not None else set()
        failure: _Failure | None = None
        for attempt in range(self.config.max_attempts):
            rid = next(self._rids)
            try:
                worker, cost = await self.dispatcher.acquire(job, rid, frozenset(tried))
            except NoWorkerError:
                break
            tried.add(worker.url)
            if attempt:
                self.metrics.retries.inc()
            result = await self._attempt(
                request, path, raw, headers, stream, job, worker, rid, cost, check
            )
            if isinstance(result, web.StreamResponse):
                return result
            failure = result
        if failure is None:
            self.metrics.no_worker.inc()
            return self._reply(
                path, 503, error_json(503, "no worker available"), {"Retry-After": "1"}
            )
        return self._reply(path, failure.status, failure.body, failure.headers)

    def _response_holder(self, rid: Any) -> Worker | None:
        """The worker that keeps the Response ``rid`` (its id begins with the prefix the worker's
        ``/load`` reports), or None (not a plaserve worker's, or not an id)."""
        if not isinstance(rid, str):
            return None
        tiers = [self.workers, self.decode_tier.workers if self.decode_tier is not None else {}]
        for w in (w for tier in tiers for w in tier.values()):
            if w.response_prefix is not None and rid.startswith(w.response_prefix):
                return w
        return None

    async def stored_response(self, request: web.Request) -> web.Response:
        """``GET`` / ``DELETE /v1/responses/{id}``, ``GET .../input_items`` and ``POST .../cancel``:
        asked of the worker that keeps the Response, else (ids of other servers) of each worker in
        turn until one has it."""
        route = "/v1/responses/{id}"
        rid = request.match_info["response_id"]
        holder = self._response_holder(rid)
        now = self._clock()
        if holder is not None:
            candidates = [holder]
        else:
            candidates = self.dispatcher.available(now)
            if self.decode_tier is not None:
                candidates += self.decode_tier.available()
        headers = request_headers(request.headers)
        timeout = aiohttp.ClientTimeout(total=self.config.health.timeout_s * 4)
        if request.query.get("stream") in ("true", "1"):  # events for as long as the Response runs
            timeout = aiohttp.ClientTimeout(connect=timeout.total)
        for worker in candidates:
            try:
                async with self.session.request(
                    request.method, worker.url + request.path_qs, headers=headers, timeout=timeout
                ) as r:
                    if r.status == 200 and r.content_type == "text/event-stream":
                        return await self._pass_events(request, route, worker, r)
                    data = await r.read()
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                if holder is not None:
                    return self._reply(route, 502, error_json(502, f"{worker.url}: {e!r}"))
                continue
            if r.status != 404 or holder is not None:
                return self._reply(route, r.status, data, response_headers(r.headers))
        return self._reply(route, 404, error_json(404, f"Response with id '{rid}' not found."))

    async def _pass_events(
        self, request: web.Request, route: str, worker: Worker, resp: aiohttp.ClientResponse
    ) -> web.StreamResponse:
        """A kept Response's events (``GET ...?stream=true``) passed on as they come; a worker that
        fails mid-stream ends the stream with an error event, as a generating one does."""
        out = web.StreamResponse(
            status=200, headers={"Content-Type": resp.content_type, "Cache-Control": "no-cache"}
        )
        await out.prepare(request)
        try:
            while chunk := await resp.content.readany():
                await out.write(chunk)
        except (
            aiohttp.ClientPayloadError,
            aiohttp.ServerDisconnectedError,
            aiohttp.ClientOSError,
        ) as e:
            log.warning("worker %s failed mid-stream: %s", worker.url, e)
            self.metrics.stream_errors.inc()
            await out.write(sse_error(f"worker failed mid-stream: {type(e).__name__}"))
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            return out  # the client left; closing the worker's response ends its stream there
        await out.write_eof()
        self.metrics.child(self.metrics.requests, route, "200").inc()
        return out

    def _hint(
        self, request: web.Request, path: str, body: dict[str, Any]
    ) -> tuple[int, ...] | None:
        """The prompt lengths a trusted gateway stated in ``x-prompt-tokens`` (router/hints.py), or
        None; raises :class:`HintError` for a trusted peer's malformed one (counted here)."""
        if HINT_HEADER not in request.headers:
            return None
        try:
            outcome, tokens = self.config.length_hints.read(
                request.headers, request.remote, body, chat=path != "/v1/completions"
            )
        except HintError:
            self.metrics.child(self.metrics.pricing.hints, "malformed").inc()
            raise
        self.metrics.child(self.metrics.pricing.hints, outcome).inc()
        return tokens

    def _reply(
        self, route: str, status: int, body: bytes, headers: dict[str, str] | None = None
    ) -> web.Response:
        self.metrics.child(self.metrics.requests, route, str(status)).inc()
        out = {"Content-Type": JSON, **(headers or {})}
        return web.Response(status=status, body=body, headers=out)

    async def _first_answer(
        self,
        worker: Worker,
        path: str,
        raw: bytes,
        headers: dict[str, str],
        stream: bool,
        finish: Callable[..., None],
    ) -> tuple[aiohttp.ClientResponse, bytes | FirstTokenScanner] | _Failure:
        """:meth:`_until_first_token` on ``worker``, or the failure to retry from (booked with
        ``finish``): the worker left the rotation while the request waited, or the connection failed.
        The caller's own cancellation (the client went away) propagates."""
        task = asyncio.ensure_future(self._until_first_token(worker, path, raw, headers, stream))
        worker.waiting.add(task)
        try:
            return await task
        except asyncio.CancelledError:
            if task not in worker.abandoned:
                raise  # the client went away
            finish(False, "failed", fault=False)  # the health checks have already judged the worker
            return self._failure(worker, "left the rotation before answering")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            finish(False, "failed")
            return self._failure(worker, f"{type(e).__name__}: {e}")
        finally:
            worker.waiting.discard(task)
            worker.abandoned.discard(task)

    async def _until_first_token(
        self, worker: Worker, path: str, raw: bytes, headers: dict[str, str], stream: bool
    ) -> tuple[aiohttp.ClientResponse, bytes | FirstTokenScanner]:
        """Send the request and read up to its first token (the whole body when not streamed or not 200).

        Returns the open response (streams) and what was read; the caller owns the response.
        """
        resp = await self.session.post(
            worker.url + path, data=raw, headers=headers, timeout=self._timeout
        )
        try:
            if resp.status != 200 or not stream:
                data = await resp.read()
                resp.release()
                return resp, data
            scanner = FirstTokenScanner()
            while not scanner.token and scanner.error is None:
                chunk = await resp.content.readany()
                if not chunk:
                    scanner.eof()
                    break
                scanner.feed(chunk)
            return resp, scanner
        except BaseException:
            resp.close()
            raise

    def _finisher(self, worker: Worker, rid: int, wake: bool = True) -> Callable[..., None]:
        """``finish(ok, outcome, fault=None)`` for one attempt on ``worker``: books the attempt's end
        once (the worker's accounts, the attempts metric and, with ``wake``, the dispatcher woken for
        the capacity it freed); later calls do nothing."""
        done = False

        def finish(ok: bool, outcome: str, fault: bool | None = None) -> None:
            nonlocal done
            if not done:
                done = True
                worker.finish(rid, ok, self._clock(), worker_fault=fault)
                self.metrics.child(self.metrics.attempts, worker.url, outcome).inc()
                if wake:
                    self.dispatcher.wake()

        return finish

    async def _attempt(
        self,
        request: web.Request,
        path: str,
        raw: bytes,
        headers: dict[str, str],
        stream: bool,
        job: Job,
        worker: Worker,
        rid: int,
        cost: float,
        check: HintCheck | None = None,
    ) -> web.StreamResponse | _Failure:
        """One try on one worker: the client's response, or the failure to retry from."""
        finish = self._finisher(worker, rid)
        try:
            answer = await self._first_answer(worker, path, raw, headers, stream, finish)
            if isinstance(answer, _Failure):
                return answer
            resp, first = answer
            if resp.status != 200:
                assert isinstance(first, bytes)
                passthrough = resp.status != 429 and resp.status < 500
                finish(
                    passthrough,
                    "client_error" if passthrough else "failed",
                    fault=resp.status >= 500 if not passthrough else False,
                )
                hdrs = response_headers(resp.headers)
                if passthrough:
                    return self._reply(path, resp.status, first, hdrs)
                log.info("worker %s answered %d; trying another", worker.url, resp.status)
                return _Failure(resp.status, first, hdrs)

            now = self._clock()
            worker.first_token(rid)
            if isinstance(first, bytes):  # not streamed: the whole answer is here
                finish(True, "ok")
                if check is not None:
                    check.actual(usage_prompt_tokens(first))
                self.metrics.child(self.metrics.e2e, job.length_class).observe(now - job.arrival)
                return self._reply(path, 200, first, response_headers(resp.headers))

            if first.error is not None:
                resp.close()
                finish(False, "failed")
                return self._failure(worker, first.error)
            self.policy.on_first_token(job, worker, cost, now)
            self.metrics.child(self.metrics.ttft, job.length_class).observe(now - job.arrival)
            self.dispatcher.wake()
            return await self._stream_rest(request, path, resp, first, job, worker, finish, check)
        except asyncio.CancelledError:
            finish(False, "client_gone", fault=False)
            raise

    async def _stream_rest(
        self,
        request: web.Request,
        path: str,
        resp: aiohttp.ClientResponse,
        first: FirstTokenScanner,
        job: Job,
        worker: Worker,
        finish: Callable[..., None],
        check: HintCheck | None = None,
    ) -> web.StreamResponse:
        """Send the buffered start and then every chunk as it comes; the first token is in ``first``."""
        out = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": resp.headers.get("Content-Type", "text/event-stream"),
                "Cache-Control": "no-cache",
            },
        )
        try:
            await out.prepare(request)
            # What has arrived already goes out in one write (with the end of the stream, when that
            # has arrived too): one system call instead of several for a short answer.
            pending = bytes(first.buffer) + resp.content.read_nowait()
            ended = resp.content.at_eof()  # the whole stream is here already
            feed = check.feed if check is not None else None
            try:
                if feed is not None:
                    feed(pending)
                if ended:
                    await out.write_eof(pending)
                else:
                    await out.write(pending)
                    while chunk := await resp.content.readany():
                        if feed is not None:
                            feed(chunk)
                        await out.write(chunk)
            except (
                aiohttp.ClientPayloadError,
                aiohttp.ServerDisconnectedError,
                aiohttp.ClientOSError,
                asyncio.TimeoutError,
            ) as e:
                # The client has had tokens already: end its stream with an error, never silently.
                log.warning("worker %s failed mid-stream: %s", worker.url, e)
                finish(False, "failed")
                self.metrics.stream_errors.inc()
                self.metrics.child(self.metrics.requests, path, "stream_error").inc()
                await out.write(sse_error(f"worker failed mid-stream: {type(e).__name__}"))
                await out.write_eof()
                return out
            if not ended:
                await out.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            # the client left; closing resp aborts the worker's request
            finish(False, "client_gone", fault=False)
            return out
        finally:
            resp.close()
        finish(True, "ok")
        if check is not None:
            check.done()
        self.metrics.child(self.metrics.requests, path, "200").inc()
        self.metrics.child(self.metrics.e2e, job.length_class).observe(self._clock() - job.arrival)
        return out

    @staticmethod
    def _failure(worker: Worker, why: str) -> _Failure:
        log.info("worker %s failed a request (%s); trying another", worker.url, why)
        return _Failure(502, error_json(502, f"worker {worker.url} failed: {why}"), {})

    # --- other routes ----------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        headers = request_headers(request.headers)
        for worker in self.dispatcher.available(self._clock()):
            try:
                async with self.session.get(
                    worker.url + "/v1/models",
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=self.config.health.timeout_s),
                ) as r:
                    data = await r.read()
                    if r.status == 200 or 400 <= r.status < 500:
                        return self._reply(
                            "/v1/models", r.status, data, response_headers(r.headers)
                        )
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                continue
        self.metrics.no_worker.inc()
        return self._reply("/v1/models", 503, error_json(503, "no worker available"))

    async def health(self, request: web.Request) -> web.Response:
        n = len(self.dispatcher.available(self._clock()))
        out: dict[str, Any] = {"workers_available": n, "workers": len(self.workers)}
        ok = n > 0
        if self.decode_tier is not None:  # PD: a prefill worker and a decode worker are needed
            d = len(self.decode_tier.available())
            out.update(decode_workers_available=d, decode_workers=len(self.decode_tier.workers))
            ok = ok and d > 0
        out["status"] = "ok" if ok else "no worker available"
        return web.json_response(out, status=200 if ok else 503)

    async def metrics_route(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        body = self.metrics.render(
            list(self.workers.values()),
            self.policy,
            self.dispatcher.num_held,
            self._clock(),
            self.config.health.load_stale_s,
        )
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def describe(self) -> dict[str, Any]:
        """Workers and policy state as JSON (``GET /workers``)."""
        now = self._clock()
        out = {
            "policy": self.policy.describe(now),
            "short_threshold": self.short_threshold,
            "short_threshold_source": self.threshold_source,
            "held": self.dispatcher.num_held,
            "workers": [
                w.describe(now, self.config.health.load_stale_s) for w in self.workers.values()
            ],
        }
        if self.decode_tier is not None:
            out["decode_workers"] = self.decode_tier.describe()
        short_pool = getattr(self.policy, "short_pool", None)
        if short_pool is not None:
            out["policy"]["short_pool_now"] = [
                w.url for w in short_pool(self.dispatcher.available(now), now)
            ]
        return out

    async def list_workers(self, request: web.Request) -> web.Response:
        return web.json_response(self.describe())

    async def _url_param(self, request: web.Request) -> str | None:
        url = request.query.get("url")
        if url is None and request.can_read_body:
            try:
                body = json_body.loads(await request.read())
            except json_body.JsonBodyError:
                return None
            url = body.get("url") if isinstance(body, dict) else None
        return url if isinstance(url, str) and url.startswith(("http://", "https://")) else None

    async def post_worker(self, request: web.Request) -> web.Response:
        url = await self._url_param(request)
        if url is None:
            return self._reply(
                "/workers", 400, error_json(400, 'give the worker as {"url": "http://host:port"}')
            )
        worker = await self.add_worker(url)
        return web.json_response(worker.describe(self._clock(), self.config.health.load_stale_s))

    async def delete_worker(self, request: web.Request) -> web.Response:
        url = await self._url_param(request)
        if url is None:
            return self._reply(
                "/workers", 400, error_json(400, 'give the worker as {"url": "http://host:port"}')
            )
        if not self.remove_worker(url):
            return self._reply("/workers", 404, error_json(404, f"no worker {url}"))
        return web.json_response({"removed": url.rstrip("/")})


def build_app(router: Router) -> web.Application:
    """The aiohttp application serving ``router``; it starts and stops the router with the app.

    Serve it with ``handler_cancellation=True`` (as :func:`serve` does) so that a client that goes
    away cancels its request, and the worker's request with it.
    """
    # long prompts: the worker enforces its own limits
    app = web.Application(client_max_size=1 << 30)

    async def lifecycle(app: web.Application):
        await router.start()
        yield
        await router.stop()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/completions", router.generate)
    app.router.add_post("/v1/chat/completions", router.generate)
    app.router.add_post("/v1/responses", router.generate)
    # Anthropic's Messages API; its token count goes to a worker as a request that generates nothing
    app.router.add_post("/v1/messages", router.generate)
    app.router.add_post("/v1/messages/count_tokens", router.generate)
    for method in ("GET", "DELETE"):
        app.router.add_route(method, "/v1/responses/{response_id}", router.stored_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", router.stored_response)
    app.router.add_post("/v1/responses/{response_id}/cancel", router.stored_response)
    app.router.add_get("/v1/models", router.models)
    app.router.add_get("/health", router.health)
    app.router.add_get("/metrics", router.metrics_route)
    app.router.add_get("/workers", router.list_workers)
    app.router.add_post("/workers", router.post_worker)
    app.router.add_delete("/workers", router.delete_worker)
    return app


async def serve(router: Router, host: str, port: int) -> web.AppRunner:
    """Start serving ``router`` on ``host:port`` in the running event loop; returns the runner
    (``await runner.cleanup()`` stops it)."""
    runner = web.AppRunner(build_app(router), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
