"""The OpenAI-compatible HTTP entry of the Ray Serve application.

Ray's HTTP proxy hands every request to :meth:`OpenAIIngress.__call__` (a Starlette request). The
ingress reads the body (within :mod:`plaserve.json_body`'s limits), estimates the prompt's length
as ``plaserve route`` does (:class:`~plaserve.router.length.LengthEstimator`: token ids, else the
model's tokenizer, else characters / 4; or a trusted gateway's ``x-prompt-tokens`` header,
:mod:`plaserve.router.hints`), classifies it short or long, and calls the worker deployment through
its handle with ``tokens`` and ``length_class``, which the request router
(:mod:`plaserve.deploy.request_router`) prices.

**Failures.** A replica that dies (killed, its server crashed) or cannot be reached before the
answer's first token is retried on the replica Ray routes to next, up to ``max_attempts`` in all:
a streamed answer is held back until its first token (:class:`~plaserve.router.forward.FirstTokenScanner`),
so nothing has reached the client yet. A stream that breaks after its first token ends with an error
event and ``[DONE]`` (the client sees a clean error, never a hang). With no replica left to try:
503.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses``
(``stream: true`` passed through chunk by chunk; a follow-up's ``previous_response_id`` sent to the
replica that keeps the Response it continues), ``GET`` / ``DELETE /v1/responses/{id}``, ``GET
/v1/responses/{id}/input_items`` and ``POST /v1/responses/{id}/cancel`` (on that replica; a
streamed background Response's events, ``GET ...?stream=true``, passed on as they come), ``POST
/v1/messages`` and ``/v1/messages/count_tokens``, ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (the ingress's and the
request router's counters: routing decisions by replica and class, held requests, the short pool).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from plaserve import json_body
from plaserve.deploy import notices
from plaserve.deploy.metrics import deploy_metrics
from plaserve.deploy.replica import ReplicaError
from plaserve.model.tokenizer import load_tokenizer
from plaserve.router.costs import DEFAULT_SHORT_THRESHOLD
from plaserve.router.forward import FirstTokenScanner, error_json, request_headers, sse_error
from plaserve.router.hints import HintCheck, HintError, LengthHints, forwarded
from plaserve.router.length import Estimate, LengthEstimator
from plaserve.router.pools import LONG, SHORT
from plaserve.router.prefixes import prompt_key

log = logging.getLogger(__name__)

ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",  # sent to a replica as a request that generates nothing
)
STORED = "/v1/responses/"  # kept Responses, by what follows their id:
STORED_METHODS = {"": ("GET", "DELETE"), "input_items": ("GET",), "cancel": ("POST",)}
# The replica is gone or could not take the call: try the next one. ReplicaError comes back from a
# replica whose server stopped answering; Ray wraps it, so it is matched by name as well.
_RETRYABLE = (RayActorError, ActorDiedError, ActorUnavailableError, ReplicaError)


def _retryable(e: BaseException) -> bool:
    return isinstance(e, _RETRYABLE) or "ReplicaError" in type(e).__name__ + str(e)[:200]


class OpenAIIngress:
    """The HTTP entry (module docstring). ``workers`` is the handle of the worker deployment;
    ``tokenizer`` the served model's directory (None: the embedded model's byte tokenizer);
    ``trust_length_hints_from`` the ``CIDR[,CIDR...]`` whose ``x-prompt-tokens`` headers price
    requests (:mod:`plaserve.router.hints`; Ray's proxy hands on the ASGI scope, so the peer is
    the client's TCP peer at the proxy)."""

    def __init__(
        self,
        workers: DeploymentHandle,
        tokenizer: str | None = None,
        short_threshold: int = DEFAULT_SHORT_THRESHOLD,
        max_attempts: int = 3,
        trust_length_hints_from: str | None = None,
    ) -> None:
        self.workers = workers
        self.length_hints = LengthHints.from_spec(trust_length_hints_from)
        self.estimator = LengthEstimator(load_tokenizer(tokenizer))
        self.short_threshold = short_threshold
        self.max_attempts = max_attempts
        self.metrics = deploy_metrics().ingress

    async def __call__(self, request: Request) -> Response:
        path, method = request.url.path.rstrip("/") or "/", request.method
        if method == "GET" and path == "/health":
            return JSONResponse({"status": "ok"})
        if method == "GET" and path == "/metrics":
            return Response(deploy_metrics().render(), media_type=CONTENT_TYPE_LATEST)
        if method == "GET" and path == "/v1/models":
            status, body = await self.workers.models.remote()
            return JSONResponse(body, status_code=status)
        if path.startswith(STORED):
            return await self.stored(request, path, method)
        if path not in ROUTES:
            return _error(404, f"no route {method} {path}")
        if method != "POST":
            return _error(405, f"{path} takes POST, not {method}")
        try:
            body = json_body.loads(await request.body())
        except json_body.JsonBodyError as e:
            return _error(400, f"the request body is not valid JSON: {e}")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        peer = request.client.host if request.client is not None else None
        try:
            job, check = await self.price(path, body, request.headers, peer)
        except HintError as e:
            self.metrics.requests.labels(path, "400").inc()
            return _error(400, str(e))
        headers = forwarded(request_headers(dict(request.headers)), used=check is not None)
        if path == "/v1/responses" and isinstance(body.get("previous_response_id"), str):
            job["response_id"] = body["previous_response_id"]  # to the replica that keeps it
        arrival = time.monotonic()
        attempt_once = self._try_stream if body.get("stream") else self._try_whole
        last: BaseException | None = None
        for attempt in range(self.max_attempts):
            if attempt:
                self.metrics.retries.inc()
            try:
                return await attempt_once(path, body, headers, job, arrival, check)
            except Exception as e:  # noqa: BLE001 - a lost replica is retried, the rest raised
                if not _retryable(e):
                    raise
                last = e
        self.metrics.requests.labels(path, "503").inc()
        return _error(
            503, f"no replica could serve the request ({self.max_attempts} tried): {last}"
        )

    async def stored(self, request: Request, path: str, method: str) -> Response:
        """``GET`` / ``DELETE /v1/responses/{id}``, ``GET .../input_items`` and ``POST .../cancel``,
        asked of the replica that keeps the Response (the request router finds it by the id's prefix)."""
        parts = path[len(STORED) :].split("/")
        if not parts[0] or len(parts) > 2 or parts[1:] and parts[1] not in STORED_METHODS:
            return _error(404, f"no route {method} {path}")
        allowed = STORED_METHODS[parts[1] if len(parts) == 2 else ""]
        if method not in allowed:
            return _error(405, f"{path} takes {' or '.join(allowed)}, not {method}")
        target = path + (f"?{request.url.query}" if request.url.query else "")
        headers = request_headers(dict(request.headers))
        if method == "GET" and request.query_params.get("stream") in ("true", "1"):
            return await self._stored_events(target, headers, parts[0])
        status, body = await self.workers.stored.remote(
            method, target, headers, response_id=parts[0]
        )
        self.metrics.requests.labels(STORED + "{id}", str(status)).inc()
        return JSONResponse(body, status_code=status)

    async def _stored_events(self, target: str, headers: dict, rid: str) -> Response:
        """A streamed background Response's events (``GET ...?stream=true``), passed on as they come
        from the replica that keeps it; one lost mid-stream ends the stream with an error event."""
        gen = self.workers.options(stream=True).stream.remote(
            target, None, headers, method="GET", response_id=rid
        )
        status, error = await gen.__anext__()
        self.metrics.requests.labels(STORED + "{id}", str(status)).inc()
        if status != 200:
            return JSONResponse(error, status_code=status)

        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in gen:
                    yield chunk
            except asyncio.CancelledError:
                gen.cancel()
                raise
            except Exception as e:  # noqa: BLE001 - the stream is under way: end it cleanly
                log.warning("a kept Response's stream broke: %r", e)
                self.metrics.stream_errors.inc()
                yield sse_error(f"the replica failed mid-stream: {type(e).__name__}")

        return StreamingResponse(events(), media_type="text/event-stream")

    async def price(
        self, path: str, body: dict[str, Any], headers: Mapping[str, str], peer: str | None
    ) -> tuple[dict[str, Any], HintCheck | None]:
        """The handle call's pricing keywords (``tokens``, ``length_class``, ``job_id``) for a
        request from ``peer``, from a trusted ``x-prompt-tokens`` header or the estimator; and the
        check that compares a hint with the answer. Raises :class:`HintError` for a trusted peer's
        malformed hint."""
        try:  # chat and Responses requests hold one conversation, so one prompt
            outcome, hint = self.length_hints.read(headers, peer, body, path != ROUTES[0])
        except HintError:
            self.metrics.pricing.hints.labels("malformed").inc()
            raise
        if outcome != "absent":
            self.metrics.pricing.hints.labels(outcome).inc()
        if hint is not None:
            est = Estimate(hint, "hint")
        else:
            est = await self.estimator.request(path, body)
        self.metrics.pricing.priced_tokens.labels(est.method).inc(sum(est.tokens))
        cls = SHORT if sum(est.tokens) < self.short_threshold else LONG
        job = {"tokens": list(est.tokens), "length_class": cls, "job_id": uuid.uuid4().hex}
        prompt = prompt_key(path, body)
        if prompt is not None:  # the request router prices it after each replica's cached part
            job |= {"prompt_chunks": list(prompt.chunks), "prompt_bytes": prompt.size}
        check = HintCheck(hint, self.metrics.pricing.error.observe) if hint is not None else None
        return job, check

    async def _try_whole(
        self,
        path: str,
        body: dict,
        headers: dict,
        job: dict,
        arrival: float,
        check: HintCheck | None = None,
    ) -> Response:
        status, answer = await self.workers.generate.remote(path, body, headers, **job)
        if check is not None and status == 200 and isinstance(answer, dict):
            usage = answer.get("usage")
            check.actual(usage.get("prompt_tokens") if isinstance(usage, dict) else None)
        self.metrics.requests.labels(path, str(status)).inc()
        self.metrics.e2e.labels(job["length_class"]).observe(time.monotonic() - arrival)
        return JSONResponse(answer, status_code=status)

    async def _try_stream(
        self,
        path: str,
        body: dict,
        headers: dict,
        job: dict,
        arrival: float,
        check: HintCheck | None = None,
    ) -> Response:
        """The stream once its first token is in; raises (to be retried) if it fails before."""
        gen = self.workers.options(stream=True).stream.remote(path, body, headers, **job)
        scanner = FirstTokenScanner()
        try:
            status, error = await gen.__anext__()
            if status != 200:
                self.metrics.requests.labels(path, str(status)).inc()
                return JSONResponse(error, status_code=status)
            async for chunk in gen:
                scanner.feed(chunk)
                if scanner.token or scanner.error:
                    break
            else:
                scanner.eof()
        except StopAsyncIteration:
            scanner.eof()
        except BaseException:
            gen.cancel()
            raise
        if scanner.error and not scanner.token:
            gen.cancel()
            raise ReplicaError(scanner.error)
        self.metrics.ttft.labels(job["length_class"]).observe(time.monotonic() - arrival)
        notices.first_token(job["job_id"])
        return StreamingResponse(
            self._rest(gen, bytes(scanner.buffer), path, job, arrival, check),
            media_type="text/event-stream",
        )

    async def _rest(
        self,
        gen: Any,
        head: bytes,
        path: str,
        job: dict,
        arrival: float,
        check: HintCheck | None = None,
    ) -> AsyncIterator[bytes]:
        """The stream from its first token on; a replica lost now ends it with an error event."""
        yield head
        outcome, last = "200", head
        if check is not None:
            check.feed(head)
        try:
            async for chunk in gen:
                last = chunk
                if check is not None:
                    check.feed(chunk)
                yield chunk
            if check is not None:
                check.done()
        except asyncio.CancelledError:
            gen.cancel()
            # A client that read [DONE] may close before the replica's stream has ended: served.
            if not last.rstrip().endswith(b"[DONE]"):
                outcome = "client_gone"
            raise
        except Exception as e:  # noqa: BLE001 - the stream is under way: end it cleanly
            log.warning("stream broke after its first token: %r", e)
            self.metrics.stream_errors.inc()
            outcome = "stream_error"
            yield sse_error(f"the replica failed mid-stream: {type(e).__name__}")
        finally:
            self.metrics.requests.labels(path, outcome).inc()
            self.metrics.e2e.labels(job["length_class"]).observe(time.monotonic() - arrival)


def _error(status: int, message: str) -> Response:
    return Response(error_json(status, message), status_code=status, media_type="application/json")
