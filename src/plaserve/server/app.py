"""The HTTP app: OpenAI-compatible generation endpoints, tokenize, health, metrics, load reports.

Routes (docs/SERVER.md has the full list with status codes):

* ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` (each streams with
  ``stream: true``)
* ``GET /v1/models``, ``GET /health``, ``POST /tokenize``, ``POST /detokenize``, ``GET /metrics``,
  ``GET /version``
* ``GET /load``: the engine's load report, the signal plaserve's router balances on
* ``GET /server_info``, ``GET /model_info``, ``GET /get_load`` (and ``/get_server_info``,
  ``/get_model_info``): what sglang-router reads from a worker
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import plaserve
from plaserve.request import ParamError, RequestOutput, SamplingParams
from plaserve.server import responses as R
from plaserve.server.anthropic_messages import MessagesRoutes
from plaserve.server.auth import ApiKeyMiddleware
from plaserve.server.connections import ErrorGuard
from plaserve.server.deltas import DeltaTracker
from plaserve.server.engine_loop import EngineHandle, EngineStoppedError
from plaserve.server.errors import ApiError, error_body
from plaserve.server.generation import (
    ClientDisconnected,
    EventStreamResponse,
    Generation,
    until_disconnect,
)
from plaserve.server.metrics import ResponseStoreCollector, render_collector
from plaserve.server.openai_responses import Background, ResponsesRoutes
from plaserve.server.pd import PDWorker, check_pd_request, parse_kv_transfer_params
from plaserve.server.prompts import (
    ModelLimits,
    check_logit_bias,
    check_prompt,
    check_token_ids,
    encode_chat,
    encode_prompt,
)
from plaserve.server.protocol import (
    ChatRequest,
    StreamOptions,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_json_object,
    parse_tokenize_request,
)
from plaserve.server.response_store import ResponseStore
from plaserve.server.tool_parsers import PARSERS, CallDelta, ToolParser, ToolStream
from plaserve.server.tools import (
    delta_json,
    finish_reason,
    output_parser,
    template_messages,
    tool_message,
)

log = logging.getLogger(__name__)

COMPLETION_DEFAULT_MAX_TOKENS = (
    16  # OpenAI's default for /v1/completions; chat defaults to all the room left
)


@dataclass(frozen=True)
class HttpLimits:
    """What one request may take of the server before its body is parsed."""

    max_body_bytes: int = 32 * 2**20  # a 16k-token prompt as token ids is about 100 KB
    body_timeout: float = 60.0  # seconds to receive the whole body once the headers are in


class _Handlers(ResponsesRoutes, MessagesRoutes):
    """Route handlers bound to one engine loop; everything they read from the engine is fixed at start."""

    def __init__(
        self,
        engine_loop: EngineHandle,
        served_model_name: str,
        http_limits: HttpLimits,
        pd: PDWorker | None = None,
        tool_parser: ToolParser | None = None,
        sampling_defaults: dict[str, Any] | None = None,
        response_store: ResponseStore | None = None,
        stream_interval: int = 1,
    ) -> None:
        facts = engine_loop.facts
        self.pd = pd
        self.store = response_store or ResponseStore(0)  # /v1/responses' kept answers
        self._background: dict[str, Background] = {}  # background Responses still generating
        self._store_metrics = ResponseStoreCollector(self.store.describe)
        # --generation-config: the model's defaults for fields a request leaves out; its
        # max_new_tokens caps the max_tokens an endpoint picks by itself
        self.sampling_defaults = dict(sampling_defaults or {})
        self.default_max_tokens: int | None = self.sampling_defaults.pop("max_tokens", None)
        self.stream_interval = stream_interval
        self.tool_parser = tool_parser  # --tool-call-parser with --enable-auto-tool-choice
        # Text an end-of-sequence token decodes to: cut from answers whose special tokens are kept
        # for their tool-call parser.
        self._eos_texts = tuple(
            t
            for i in facts.eos_token_ids
            if (t := facts.tokenizer.decode([i], skip_special_tokens=False))
        )
        self.http_limits = http_limits
        self.loop = engine_loop
        self.model_name = served_model_name
        self.tokenizer = facts.tokenizer
        self._token_texts: dict[
            int, str
        ] = {}  # logprobs' token texts: at most one per vocabulary id
        self.limits = ModelLimits(max_model_len=facts.max_model_len, vocab_size=facts.vocab_size)
        self.model_path = facts.model_path
        self.created = int(time.time())
        self.server_info = {
            "model_path": facts.model_path or facts.model_name,
            "tokenizer_path": facts.model_path or facts.model_name,
            "served_model_name": served_model_name,
            "random_weights": facts.random_weights,
            "version": plaserve.__version__,
            "dp_size": 1,
            "tp_size": 1,
            "context_length": facts.max_model_len,
            "max_running_requests": facts.max_num_seqs,
            "max_total_tokens": facts.max_total_tokens,
            "max_queue": engine_loop.max_queue,
            "policy": engine_loop.snapshot().load.get("policy"),
            "device": facts.device,
            "dtype": facts.dtype,
        }

    # --- helpers -------------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                param="model",
                code="model_not_found",
            )

    async def _body(self, request: Request) -> dict[str, Any]:
        """The JSON object body, read within the limits: a larger body is a 413, a slower one a 408, a
        client gone while sending it a 499 (logged at debug level: nobody is there to answer)."""
        limit = self.http_limits.max_body_bytes
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise ApiError(
                413, f"the request body has {declared} bytes; this server takes at most {limit}"
            )

        async def read() -> bytes:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(
                        413,
                        f"the request body is larger than {limit} bytes, the most this server takes",
                    )
                chunks.append(chunk)
            return b"".join(chunks)

        try:
            raw = await asyncio.wait_for(read(), self.http_limits.body_timeout)
        except asyncio.TimeoutError:
            raise ApiError(
                408, f"the request body did not arrive within {self.http_limits.body_timeout:g} s"
            ) from None
        except ClientDisconnect:
            raise ApiError(499, "the client disconnected while sending the request") from None
        return parse_json_object(raw)

    def _decode(self, token_id: int) -> str:
        """One token's text, as logprobs report it (special tokens included); cached, since a request
        with logprobs decodes a few tokens per position on the event loop."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self.tokenizer.decode(
                [token_id], skip_special_tokens=False
            )
        return text

    @staticmethod
    def _params(sampling: SamplingParams, max_tokens: int) -> list[SamplingParams]:
        """The engine parameters of the ``n`` choices of one prompt (see ``SamplingParams.choices``)."""
        try:
            return dataclasses.replace(sampling, max_tokens=max_tokens).choices()
        except ParamError as e:  # min_tokens above the max_tokens the endpoint chose
            raise ApiError(400, str(e), param=e.param) from None

    def _kv_params(
        self, body: dict[str, Any], num_prompts: int, sampling: SamplingParams, stream: bool
    ) -> Any:
        """The request's checked ``kv_transfer_params`` (prefill/decode disaggregation), or None."""
        kvp = parse_kv_transfer_params(body)
        if kvp is None:
            return None
        if self.pd is None:
            raise ApiError(
                400,
                "this server takes no kv_transfer_params (start it with --pd-role prefill or "
                "decode, or with --kv-transfer-port)",
                param="kv_transfer_params",
            )
        self.pd.check_role(kvp)
        check_pd_request(kvp, num_prompts, sampling, stream)
        return kvp

    def _interval(self, stream: bool, options: StreamOptions) -> int:
        """Tokens per output the engine loop hands this request's handler: the server's
        ``--stream-interval``, raised to the request's own; 0 (the end only) for an answer sent
        whole."""
        return max(self.stream_interval, options.interval or 1) if stream else 0

    async def _start(
        self,
        request: Request,
        kvp: Any,
        rid: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        n: int,
        interval: int,
    ) -> Generation:
        """Submit the engine requests, or pull a remote prefill's KV and start them from it;
        ``interval``: :attr:`~plaserve.server.engine_loop.Submission.stream_interval`."""
        if kvp is not None and kvp.do_remote_prefill:
            assert self.pd is not None
            # The decode worker may wait for room (PDWorker._reserve): a client gone ends the wait.
            try:
                return await until_disconnect(
                    request, self.pd.import_generation(rid, prompts[0], params, kvp, interval)
                )
            except ClientDisconnected:
                raise ApiError(499, "client disconnected") from None  # for the logs only
        if kvp is None:
            return Generation.submit(self.loop, rid, prompts, params, n, interval)
        # a prefill for a remote decode: its first choice parks its blocks
        assert self.pd is not None
        self.pd.hold(f"{rid}-0")
        try:
            return Generation.submit(self.loop, rid, prompts, params, n, interval)
        except ApiError:
            self.pd.forget(f"{rid}-0")
            raise

    def _kv_export(self, kvp: Any, rid: str, outputs: list, body: dict[str, Any]) -> dict[str, Any]:
        if kvp is not None and kvp.do_remote_decode:
            assert self.pd is not None
            body["kv_transfer_params"] = self.pd.export_params(f"{rid}-0", outputs)
        return body

    # --- generation ----------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        req = parse_completion_request(body, self.sampling_defaults)
        self._check_model(req.model)
        check_logit_bias(req.sampling.logit_bias, self.limits)
        prompts, params = [], []
        for prompt in req.prompts:
            ids = encode_prompt(self.tokenizer, prompt)
            max_tokens = check_prompt(ids, self.limits, req.sampling.max_tokens)
            if req.sampling.max_tokens is None:
                max_tokens = min(
                    max_tokens, self.default_max_tokens or COMPLETION_DEFAULT_MAX_TOKENS
                )
            choices = self._params(req.sampling, max_tokens)  # choice k * n + j: prompt k, sample j
            prompts += [ids] * len(choices)
            params += choices
        rid = f"cmpl-{uuid.uuid4().hex}"
        # Each choice's echo is its prompt as sent (token ids decoded), as vLLM echoes it.
        echo = (
            [
                p
                if isinstance(p, str)
                else self.tokenizer.decode(list(p), skip_special_tokens=False)
                for p in req.prompts
                for _ in range(req.sampling.n)
            ]
            if req.echo
            else None
        )
        kvp = self._kv_params(body, len(req.prompts), req.sampling, req.stream)
        interval = self._interval(req.stream, req.stream_options)
        gen = await self._start(request, kvp, rid, prompts, params, req.sampling.n, interval)
        if req.stream:
            return EventStreamResponse(
                self._stream_completion(gen, rid, req.stream_options, req.sampling, echo)
            )
        outputs = await self._wait(request, gen)
        return JSONResponse(
            self._kv_export(
                kvp,
                rid,
                outputs,
                R.completion_response(
                    rid,
                    int(time.time()),
                    self.model_name,
                    outputs,
                    req.sampling.n,
                    self._decode,
                    echo,
                ),
            )
        )

    def _chat_tools(self, req: ChatRequest) -> tuple[ToolParser | None, SamplingParams]:
        """The parser of the request's tool calls, and its sampling (special tokens kept where the
        parser's marker is one)."""
        tools, sampling = req.tools, req.sampling
        if tools is not None and tools.choice == "auto" and self.tool_parser is None:
            raise ApiError(
                400,
                '"auto" tool choice requires the server to run with --enable-auto-tool-choice and '
                '--tool-call-parser (or send tool_choice "none", "required" or a named function)',
                param="tool_choice",
            )
        parser = output_parser(tools, self.tool_parser)
        if parser is not None and parser.keeps_special_tokens:
            sampling = dataclasses.replace(sampling, skip_special_tokens=False)
        return parser, sampling

    def _answer_text(self, text: str, finished: bool) -> str:
        """A tool-parsed answer's text without the end-of-sequence token's text (present when the
        parser keeps special tokens)."""
        if finished:
            for eos in self._eos_texts:
                text = text.removesuffix(eos)
        return text

    def _chat_ids(self, req: ChatRequest) -> list[int]:
        """A chat request's templated prompt."""
        template_vars = dict(req.chat_template_kwargs or {})
        if req.tools is not None:
            template_vars["tools"] = list(req.tools.tools)
        return encode_chat(
            self.tokenizer,
            template_messages(list(req.messages)),
            req.add_generation_prompt,
            **template_vars,
        )

    def _chat_prompt(
        self, req: ChatRequest, sampling: SamplingParams
    ) -> tuple[list[int], list[SamplingParams]]:
        """A chat request's templated, checked prompt and its choices' parameters (``max_tokens``: the
        request's, else the server's default, else the rest of the context)."""
        ids = self._chat_ids(req)
        max_tokens = check_prompt(ids, self.limits, req.sampling.max_tokens)
        if req.sampling.max_tokens is None and self.default_max_tokens:
            max_tokens = min(max_tokens, self.default_max_tokens)
        return ids, self._params(sampling, max_tokens)

    async def chat(self, request: Request) -> Response:
        body = await self._body(request)
        req = parse_chat_request(body, self.sampling_defaults)
        self._check_model(req.model)
        check_logit_bias(req.sampling.logit_bias, self.limits)
        parser, sampling = self._chat_tools(req)
        ids, params = self._chat_prompt(req, sampling)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        kvp = self._kv_params(body, 1, req.sampling, req.stream)
        interval = self._interval(req.stream, req.stream_options)
        gen = await self._start(
            request, kvp, rid, [ids] * req.sampling.n, params, req.sampling.n, interval
        )
        if req.stream:
            return EventStreamResponse(
                self._stream_chat(gen, rid, req.stream_options, req.sampling, parser)
            )
        outputs = await self._wait(request, gen)
        answer = R.chat_response(
            rid, int(time.time()), self.model_name, outputs, req.sampling.n, self._decode
        )
        if parser is not None:
            for choice, out in zip(answer["choices"], outputs):
                text = self._answer_text(out.outputs[0].text, True)
                choice["message"], choice["finish_reason"] = tool_message(
                    parser, text, choice["finish_reason"]
                )
        return JSONResponse(self._kv_export(kvp, rid, outputs, answer))

    @staticmethod
    def _stream_usage(gen: Generation, options: StreamOptions, n: int) -> R.StreamUsage:
        """The ``usage`` field of the stream of ``gen``'s choices, ``n`` per prompt."""
        return R.StreamUsage(options, [sub.prompt_token_ids for sub in gen.submissions], n)

    async def _wait(self, request: Request, gen: Generation) -> list:
        try:
            return await until_disconnect(request, gen.result())
        except ClientDisconnected:
            raise ApiError(
                499, "client disconnected"
            ) from None  # never seen by the client; for the logs
        finally:
            gen.close()

    async def _stream_completion(
        self,
        gen: Generation,
        rid: str,
        options: StreamOptions,
        sampling: SamplingParams,
        echo: list[str] | None,
    ) -> AsyncIterator[str]:
        created, name = int(time.time()), self.model_name
        trackers = [DeltaTracker(sampling.stop) for _ in gen.submissions]
        usage = self._stream_usage(gen, options, sampling.n)
        echoed: set[int] = set()  # choices whose prompt went out already
        try:
            async for batch in gen.updates():
                for i, out in sorted(batch.items()):
                    usage.count(i, out)
                    tracker = trackers[i]
                    text = tracker.delta(out.outputs[0].text, out.finished)
                    first = i not in echoed
                    echoed.add(i)
                    reason = out.outputs[0].finish_reason if out.finished else None
                    logprobs = None
                    if (new := tracker.new_logprobs(out.outputs[0].logprobs)) is not None:
                        pairs = (R.prompt_pairs(out) if echo and first else []) + R.output_pairs(
                            new
                        )
                        logprobs = R.completion_logprobs(pairs, self._decode, tracker.token_chars)
                        tracker.token_chars += sum(map(len, logprobs["tokens"]))
                    if echo and first:
                        text = echo[i] + text
                    yield R.sse(
                        usage.stamp(
                            R.completion_chunk(rid, created, name, i, text, reason, logprobs)
                        )
                    )
            if options.include_usage:
                yield R.sse(
                    R.usage_chunk(rid, created, name, "text_completion", gen.outputs(), sampling.n)
                )
        except ApiError as e:  # headers are sent already: report the error in the stream
            self.loop.count_error(e.status)
            yield R.sse(e.body())
        finally:
            gen.close()
        yield R.DONE

    async def _stream_chat(
        self,
        gen: Generation,
        rid: str,
        options: StreamOptions,
        sampling: SamplingParams,
        parser: ToolParser | None = None,
    ) -> AsyncIterator[str]:
        created, name = int(time.time()), self.model_name
        trackers = [DeltaTracker(sampling.stop) for _ in gen.submissions]
        # Tool calls: each choice's text so far, read by its parser into content and call pieces.
        tool_streams = [ToolStream(parser) for _ in gen.submissions] if parser else []
        texts = [""] * len(gen.submissions)
        called = [False] * len(gen.submissions)
        usage = self._stream_usage(gen, options, sampling.n)
        try:
            # each choice opens with the role, as OpenAI's streams do
            for i in range(len(trackers)):
                yield R.sse(
                    usage.stamp(
                        R.chat_chunk(
                            rid, created, name, i, {"role": "assistant", "content": ""}, None
                        )
                    )
                )
            async for batch in gen.updates():
                for i, out in sorted(batch.items()):
                    usage.count(i, out)
                    text = trackers[i].delta(out.outputs[0].text, out.finished)
                    reason = out.outputs[0].finish_reason if out.finished else None
                    new = trackers[i].new_logprobs(out.outputs[0].logprobs)
                    logprobs = None if new is None else R.chat_logprobs(new, self._decode)
                    if parser is not None:
                        texts[i] += text
                        answer = self._answer_text(texts[i], out.finished)
                        text, calls = tool_streams[i].feed(answer, out.finished)
                        for call in calls:  # a call's name, then its arguments as they come
                            called[i] = True
                            delta = delta_json(parser, call)
                            yield R.sse(
                                usage.stamp(R.chat_chunk(rid, created, name, i, delta, None))
                            )
                        reason = finish_reason(parser, called[i], reason)
                    yield R.sse(
                        usage.stamp(
                            R.chat_chunk(rid, created, name, i, {"content": text}, reason, logprobs)
                        )
                    )
            if options.include_usage:
                yield R.sse(
                    R.usage_chunk(
                        rid, created, name, "chat.completion.chunk", gen.outputs(), sampling.n
                    )
                )
        except ApiError as e:
            self.loop.count_error(e.status)
            yield R.sse(e.body())
        finally:
            gen.close()
        yield R.DONE

    def _parsed_answer(
        self, parser: ToolParser | None, out: RequestOutput
    ) -> tuple[str, list[dict[str, Any]]]:
        """A finished answer's text and its tool calls, as chat reads them."""
        text = out.outputs[0].text
        if parser is None:
            return text, []
        message, _ = tool_message(parser, self._answer_text(text, True), None)
        return message["content"] or "", message.get("tool_calls", [])

    async def _guarded(
        self, stream: AsyncIterator[str], gen: Generation, error: Callable[[ApiError], str]
    ) -> AsyncIterator[str]:
        """``stream``'s events; an error once the headers are out as ``error``'s event (counted), and
        ``gen`` closed however the stream ends (the client gone included)."""
        try:
            async for event in stream:
                yield event
        except ApiError as e:
            self.loop.count_error(e.status)
            yield error(e)
        finally:
            gen.close()

    async def _pieces(
        self, gen: Generation, sampling: SamplingParams, parser: ToolParser | None
    ) -> AsyncIterator[tuple[str, CallDelta | None, str]]:
        """A one-choice answer as it comes, as chat streams it: ``(text, None, "")`` for text outside
        tool calls, ``("", piece, call_id)`` for a call's pieces (its first, with the name, with a
        new id)."""
        tracker = DeltaTracker(sampling.stop)
        calls_stream = ToolStream(parser) if parser is not None else None
        answer = ""
        async for batch in gen.updates():
            for out in batch.values():
                text = tracker.delta(out.outputs[0].text, out.finished)
                deltas: list[CallDelta] = []
                if calls_stream is not None:
                    answer += text
                    final = self._answer_text(answer, out.finished)
                    text, deltas = calls_stream.feed(final, out.finished)
                if text:
                    yield text, None, ""
                for d in deltas:
                    call_id = parser.new_id() if parser and d.name is not None else ""
                    yield "", d, call_id

    # --- model and tokenizer -------------------------------------------------------------------
    async def models(self, request: Request) -> Response:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "plaserve",
            "root": self.model_path or self.model_name,
            "parent": None,
            "max_model_len": self.limits.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def tokenize(self, request: Request) -> Response:
        req = parse_tokenize_request(await self._body(request))
        self._check_model(req.model)
        if req.messages is not None:
            messages = template_messages(list(req.messages))
            ids = encode_chat(self.tokenizer, messages, req.add_generation_prompt)
        else:
            ids = self.tokenizer.encode(req.prompt or "", add_special_tokens=req.add_special_tokens)
        return JSONResponse(
            {"count": len(ids), "max_model_len": self.limits.max_model_len, "tokens": ids}
        )

    async def detokenize(self, request: Request) -> Response:
        req = parse_detokenize_request(await self._body(request))
        self._check_model(req.model)
        check_token_ids(req.tokens, self.limits, "tokens")
        # Special tokens kept, as vLLM's /detokenize keeps them: the inverse of /tokenize.
        return JSONResponse(
            {"prompt": self.tokenizer.decode(list(req.tokens), skip_special_tokens=False)}
        )

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": plaserve.__version__})

    async def reset_prefix_cache(self, request: Request) -> Response:
        """Forget every cached prefix, as vLLM's ``POST /reset_prefix_cache`` does (benchmarks start
        from a cold cache): ``{"success": false}`` while a request holds KV blocks."""
        try:
            success = await self.loop.reset_prefix_cache()
        except EngineStoppedError:
            raise ApiError(503, "the engine is not running") from None
        return JSONResponse({"success": success})

    # --- health and load -----------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if not self.loop.alive:
            raise ApiError(503, "the engine is not running")
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        try:
            exposition = await self.loop.render_metrics()
        except EngineStoppedError as e:
            raise ApiError(503, str(e)) from None
        exposition += render_collector(self._store_metrics)
        return Response(exposition, media_type=CONTENT_TYPE_LATEST)

    async def load(self, request: Request) -> Response:
        snap = self.loop.snapshot()
        return JSONResponse(
            {
                **snap.load,
                **({"pd": self.pd.describe()} if self.pd is not None else {}),
                "responses": self.store.describe(),
                "pending": snap.pending,
                "num_tokens": snap.num_tokens,
                "timestamp": snap.time,
                "age_s": snap.age,
            }
        )

    async def get_load(self, request: Request) -> Response:
        snap = self.loop.snapshot()
        queued = sum(snap.load["queued"].values())
        running = sum(snap.load["running"].values())
        return JSONResponse(
            [
                {
                    "dp_rank": 0,
                    "num_reqs": queued + running + snap.pending,
                    "num_waiting_reqs": queued + snap.pending,
                    "num_tokens": snap.num_tokens,
                }
            ]
        )

    async def get_server_info(self, request: Request) -> Response:
        snap = self.loop.snapshot()
        queued, running = sum(snap.load["queued"].values()), sum(snap.load["running"].values())
        state = {"waiting_queue_size": queued + snap.pending, "running_queue_size": running}
        return JSONResponse({**self.server_info, **state, "internal_states": [state]})

    async def get_model_info(self, request: Request) -> Response:
        return JSONResponse(
            {
                "model_path": self.server_info["model_path"],
                "tokenizer_path": self.server_info["tokenizer_path"],
                "served_model_name": self.model_name,
                "is_generation": True,
                "max_context_length": self.limits.max_model_len,
                "vocab_size": self.limits.vocab_size,
                "random_weights": self.server_info["random_weights"],
            }
        )


def build_app(
    engine_loop: EngineHandle,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    http_limits: HttpLimits = HttpLimits(),
    pd: PDWorker | None = None,
    tool_parser: str | None = None,
    sampling_defaults: dict[str, Any] | None = None,
    response_store_bytes: int = 0,
    stream_interval: int = 1,
) -> ErrorGuard:
    """The ASGI app around ``engine_loop`` (Starlette inside :class:`ErrorGuard`); it starts the loop
    on startup and stops it on shutdown. ``pd``: this worker's part in prefill/decode disaggregation
    (its KV transfer service runs while the app does; docs/PD.md). ``tool_parser``: the
    ``--tool-call-parser`` that reads ``tool_choice: "auto"`` answers (None: such requests get a 400).
    ``sampling_defaults``: the model's defaults for the sampling fields a request leaves out
    (``--generation-config``). ``response_store_bytes``: how much of its finished Responses
    ``/v1/responses`` keeps for ``GET`` and ``previous_response_id`` (0: none). ``stream_interval``:
    tokens per streamed chunk (``--stream-interval``; a request's own may raise it)."""
    parser = PARSERS[tool_parser]() if tool_parser is not None else None
    name = served_model_name or engine_loop.model_name
    store = ResponseStore(response_store_bytes)
    h = _Handlers(
        engine_loop, name, http_limits, pd, parser, sampling_defaults, store, stream_interval
    )
    count_error: Callable[[int], None] = engine_loop.count_error

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        count_error(exc.status)
        if exc.status == 499:
            log.debug("%s %s: %s", request.method, request.url.path, exc.message)
        return exc.response()

    async def on_http_exception(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        count_error(exc.status_code)
        return JSONResponse(
            error_body(exc.status_code, exc.detail),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    async def on_error(request: Request, exc: Exception) -> Response:
        # the client left: nobody to answer, nothing to report
        if isinstance(exc, ClientDisconnect):
            count_error(499)
            return Response(status_code=499)
        log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        count_error(500)
        return JSONResponse(error_body(500, f"internal server error: {exc!r}"), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine_loop.start()
        if pd is not None:
            await pd.start()
        yield
        if pd is not None:
            await pd.stop()
        await asyncio.to_thread(engine_loop.stop)

    routes = [
        Route("/v1/completions", h.completions, methods=["POST"]),
        Route("/v1/chat/completions", h.chat, methods=["POST"]),
        Route("/v1/responses", h.responses, methods=["POST"]),
        Route("/v1/messages", h.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", h.count_message_tokens, methods=["POST"]),
        Route("/v1/responses/{response_id}", h.get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", h.delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", h.response_input_items, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", h.cancel_response, methods=["POST"]),
        Route("/v1/models", h.models, methods=["GET"]),
        Route("/tokenize", h.tokenize, methods=["POST"]),
        Route("/detokenize", h.detokenize, methods=["POST"]),
        Route("/version", h.version, methods=["GET"]),
        Route("/reset_prefix_cache", h.reset_prefix_cache, methods=["POST"]),
        Route("/health", h.health, methods=["GET"]),
        Route("/metrics", h.metrics, methods=["GET"]),
        Route("/load", h.load, methods=["GET"]),
        Route("/get_load", h.get_load, methods=["GET"]),
        Route("/server_info", h.get_server_info, methods=["GET"]),
        Route("/get_server_info", h.get_server_info, methods=["GET"]),
        Route("/model_info", h.get_model_info, methods=["GET"]),
        Route("/get_model_info", h.get_model_info, methods=["GET"]),
    ]
    middleware = (
        [Middleware(ApiKeyMiddleware, api_key=api_key, on_reject=count_error)] if api_key else []
    )
    return ErrorGuard(
        Starlette(
            routes=routes,
            middleware=middleware,
            lifespan=lifespan,
            exception_handlers={
                ApiError: on_api_error,
                HTTPException: on_http_exception,
                Exception: on_error,
            },
        )
    )
