"""Fake GPUs: OpenAI-compatible servers that emulate one GPU's FCFS prefill queue by sleeping.

Each server runs one prefill at a time, in arrival order, sleeping the cost model's
``prefill_time(n)`` for an ``n``-token prompt, then streams ``max_tokens`` tokens (capped by
``max_output_tokens``) one every ``tbt_s`` seconds; decoding does not occupy the prefill queue. Sleeping
costs no CPU, so many of them can stand in for a cluster of GPUs on a 2-core machine, behind the
router, for tests and benchmarks.

Prompt lengths: a list of token ids counts exactly; text counts one token per four characters; a chat
conversation as :func:`plaserve.router.length.chat_chars_estimate` does (the router's own fallback, so
the two agree when neither has a tokenizer).

Endpoints: ``/v1/completions``, ``/v1/chat/completions`` (streamed or not), ``/v1/models``; unless
``openai_only``: ``/health``, ``/load`` (plaserve's shape: the queue's remaining prefill seconds by
length class, the cost model, the short threshold) and ``/tokenize``; always ``GET /fake/stats``
(busy seconds, requests, prefill tokens; for reports). Streams open at once (headers, and for chat the
``role`` chunk) before the prefill, as plaserve and vLLM do.

Run several in one process: ``python -m plaserve.testing.fake_gpu --ports 8001 8002 --g1 .. --g2 ..``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from plaserve.cost import CostModel
from plaserve.router.length import chars_estimate, chat_chars_estimate, completion_prompts


@dataclass(frozen=True)
class FakeGpuConfig:
    """How one fake GPU behaves."""

    cost_model: CostModel
    short_threshold: int = 512
    tbt_s: float = 0.02  # seconds between streamed tokens after the first
    max_output_tokens: int | None = None  # cap on generated tokens (None: max_tokens as asked)
    openai_only: bool = False  # serve only the OpenAI endpoints (and /fake/stats)
    model_name: str = "fake-gpu"
    max_model_len: int = 1 << 20
    fail_status: int | None = None  # answer every generation request with this status (tests)


@dataclass
class _Job:
    tokens: int
    cost: float
    length_class: str
    done: asyncio.Future
    started: float | None = None


@dataclass
class FakeGpuStats:
    """What one fake GPU did."""

    busy_s: float = 0.0  # seconds spent in prefills (measured)
    requests: int = 0
    prefill_tokens: int = 0
    aborted: int = 0  # requests whose client left before their prefill started


class FakeGpu:
    """The FCFS single-server prefill queue and the HTTP handlers of one fake GPU."""

    def __init__(self, config: FakeGpuConfig) -> None:
        self.config = config
        self.queue: deque[_Job] = deque()
        self.running: _Job | None = None
        self.stats = FakeGpuStats()
        self._wake: asyncio.Event | None = None
        self._server: asyncio.Task | None = None
        self.created = int(time.time())

    # --- the emulated GPU ----------------------------------------------------------------------
    async def _serve(self) -> None:
        assert self._wake is not None
        while True:
            while not self.queue:
                self._wake.clear()
                await self._wake.wait()
            job = self.queue.popleft()
            if job.done.done():  # its client left while it queued
                self.stats.aborted += 1
                continue
            self.running = job
            job.started = time.perf_counter()
            await asyncio.sleep(job.cost)
            self.stats.busy_s += time.perf_counter() - job.started
            self.stats.requests += 1
            self.stats.prefill_tokens += job.tokens
            self.running = None
            if not job.done.done():
                job.done.set_result(None)

    def start(self) -> None:
        self._wake = asyncio.Event()
        self._server = asyncio.create_task(self._serve())

    async def stop(self) -> None:
        if self._server is not None:
            self._server.cancel()
            await asyncio.gather(self._server, return_exceptions=True)

    async def prefill(self, tokens: int) -> None:
        """Wait in the queue, then for the prefill of ``tokens`` tokens."""
        assert self._wake is not None
        cls = "short" if tokens < self.config.short_threshold else "long"
        job = _Job(
            tokens,
            self.config.cost_model.prefill_time(tokens),
            cls,
            asyncio.get_running_loop().create_future(),
        )
        self.queue.append(job)
        self._wake.set()
        try:
            await asyncio.shield(job.done)
        except asyncio.CancelledError:
            if not job.done.done():
                job.done.cancel()  # still queued: the server skips it
            raise

    def load(self) -> dict[str, Any]:
        """``/load`` in plaserve's shape."""
        backlog = {"short": 0.0, "long": 0.0}
        queued = {"short": 0, "long": 0}
        running = {"short": 0, "long": 0}
        for job in self.queue:
            if not job.done.done():
                backlog[job.length_class] += job.cost
                queued[job.length_class] += 1
        if self.running is not None and self.running.started is not None:
            left = self.running.cost - (time.perf_counter() - self.running.started)
            backlog[self.running.length_class] += max(0.0, left)
            running[self.running.length_class] += 1
        return {
            "backlog_s": backlog,
            "queued": queued,
            "running": running,
            "num_requests": sum(queued.values()) + sum(running.values()),
            "cost_model": self.config.cost_model.as_dict(),
            "short_threshold": self.config.short_threshold,
            "policy": "fcfs-fake",
            "timestamp": time.time(),
        }

    # --- HTTP ----------------------------------------------------------------------------------
    @staticmethod
    def _error(status: int, message: str) -> web.Response:
        return web.json_response(
            {
                "error": {
                    "message": message,
                    "type": "invalid_request_error",
                    "param": None,
                    "code": status,
                }
            },
            status=status,
        )

    async def generate(self, request: web.Request) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        try:
            body = json.loads(await request.read())
            assert isinstance(body, dict)
        except (ValueError, AssertionError):
            return self._error(400, "request body is not a JSON object")
        if self.config.fail_status is not None:
            return self._error(self.config.fail_status, "this fake GPU is set to fail")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return self._error(400, "messages must be a non-empty list")
            tokens = chat_chars_estimate(messages)
        else:
            prompts = completion_prompts(body)
            if prompts is None:
                return self._error(
                    400, "prompt must be a string, a list of token ids, or a list of either"
                )
            tokens = sum(len(p) if isinstance(p, list) else chars_estimate(p) for p in prompts)
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return self._error(400, "max_tokens must be a positive integer")
        if tokens + max_tokens > self.config.max_model_len:
            return self._error(400, "prompt plus max_tokens exceed the context")
        n_out = min(max_tokens, self.config.max_output_tokens or max_tokens)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        usage = {
            "prompt_tokens": tokens,
            "completion_tokens": n_out,
            "total_tokens": tokens + n_out,
        }
        if body.get("stream") is True:
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return await self._stream(request, chat, rid, tokens, n_out, usage, include_usage)
        await self.prefill(tokens)
        await asyncio.sleep(self.config.tbt_s * (n_out - 1))
        text = "tok " * n_out
        choice: dict[str, Any] = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
            if chat
            else {"index": 0, "text": text, "finish_reason": "length"}
        )
        return web.json_response(
            {
                "id": rid,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": self.config.model_name,
                "choices": [choice],
                "usage": usage,
            }
        )

    async def _stream(
        self,
        request: web.Request,
        chat: bool,
        rid: str,
        tokens: int,
        n_out: int,
        usage: dict[str, int],
        include_usage: bool,
    ) -> web.StreamResponse:
        out = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await out.prepare(request)
        obj = "chat.completion.chunk" if chat else "text_completion"
        extra = {"usage": None} if include_usage else {}

        def chunk(piece: str | None, finish: str | None) -> bytes:
            if chat:
                delta: dict[str, Any] = (
                    {"role": "assistant", "content": ""} if piece is None else {"content": piece}
                )
                choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": piece or "", "finish_reason": finish}
            event = {
                "id": rid,
                "object": obj,
                "created": int(time.time()),
                "model": self.config.model_name,
                "choices": [choice],
                **extra,
            }
            return b"data: " + json.dumps(event).encode() + b"\n\n"

        if chat:
            await out.write(chunk(None, None))
        await self.prefill(tokens)
        for i in range(n_out):
            if i:
                await asyncio.sleep(self.config.tbt_s)
            await out.write(chunk("tok ", "length" if i == n_out - 1 else None))
        if include_usage:
            event = {
                "id": rid,
                "object": obj,
                "created": int(time.time()),
                "model": self.config.model_name,
                "choices": [],
                "usage": usage,
            }
            await out.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.config.model_name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "fake-gpu",
                        "max_model_len": self.config.max_model_len,
                    }
                ],
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def load_route(self, request: web.Request) -> web.Response:
        return web.json_response(self.load())

    async def tokenize(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        if isinstance(body.get("messages"), list):
            count = chat_chars_estimate(body["messages"])
        elif isinstance(body.get("prompt"), str):
            count = chars_estimate(body["prompt"])
        else:
            return self._error(422, "give exactly one of 'prompt' and 'messages'")
        return web.json_response(
            {"count": count, "max_model_len": self.config.max_model_len, "tokens": []}
        )

    async def stats_route(self, request: web.Request) -> web.Response:
        s = self.stats
        return web.json_response(
            {
                "busy_s": s.busy_s,
                "requests": s.requests,
                "prefill_tokens": s.prefill_tokens,
                "aborted": s.aborted,
            }
        )

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)

        async def lifecycle(app: web.Application):
            self.start()
            yield
            await self.stop()

        app.cleanup_ctx.append(lifecycle)
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/fake/stats", self.stats_route)
        if not self.config.openai_only:
            app.router.add_get("/health", self.health)
            app.router.add_get("/load", self.load_route)
            app.router.add_post("/tokenize", self.tokenize)
        return app


class FakeGpuServer:
    """A fake GPU on ``127.0.0.1:port`` in the running event loop (``async with``)."""

    def __init__(self, config: FakeGpuConfig, port: int = 0) -> None:
        self.gpu = FakeGpu(config)
        self.port = port
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> "FakeGpuServer":
        self._runner = web.AppRunner(self.gpu.app(), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        if not self.port:
            self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> "FakeGpuServer":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def spawn(
    ports: list[int], config: FakeGpuConfig, startup_timeout: float = 30.0
) -> subprocess.Popen:
    """Run fake GPUs on ``ports`` in a child process (``python -m plaserve.testing.fake_gpu``) and wait
    until every one answers ``/v1/models``. Stop it with ``terminate()`` or kill it to emulate a crash."""
    import httpx

    import plaserve

    c = config
    cmd = [
        sys.executable,
        "-m",
        "plaserve.testing.fake_gpu",
        "--ports",
        *map(str, ports),
        "--g1",
        repr(c.cost_model.g1),
        "--g2",
        repr(c.cost_model.g2),
        "--g3",
        repr(c.cost_model.g3),
        "--c0",
        repr(c.cost_model.c0),
        "--short-threshold",
        str(c.short_threshold),
        "--tbt",
        repr(c.tbt_s),
        "--model-name",
        c.model_name,
    ]
    if c.max_output_tokens is not None:
        cmd += ["--max-output-tokens", str(c.max_output_tokens)]
    if c.openai_only:
        cmd.append("--openai-only")
    env = dict(os.environ)
    src = str(Path(plaserve.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + startup_timeout
    pending = list(ports)
    while pending and time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"fake GPUs exited with {proc.returncode}")
        try:
            if (
                httpx.get(f"http://127.0.0.1:{pending[0]}/v1/models", timeout=1.0).status_code
                == 200
            ):
                pending.pop(0)
                continue
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    if pending:
        proc.kill()
        raise RuntimeError(f"fake GPUs on {pending} did not start in {startup_timeout:.0f} s")
    return proc


async def _serve_forever(ports: list[int], config: FakeGpuConfig) -> None:
    servers = [await FakeGpuServer(config, port).start() for port in ports]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for s in servers:
        await s.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m plaserve.testing.fake_gpu", description=__doc__.split("\n")[0]
    )
    p.add_argument("--ports", type=int, nargs="+", required=True)
    p.add_argument("--g1", type=float, required=True, help="seconds per prompt token")
    p.add_argument("--g2", type=float, required=True, help="seconds per causal query-key pair")
    p.add_argument("--g3", type=float, default=0.0)
    p.add_argument("--c0", type=float, default=0.0)
    p.add_argument("--short-threshold", type=int, default=512)
    p.add_argument("--tbt", type=float, default=0.02, help="seconds between streamed tokens")
    p.add_argument("--max-output-tokens", type=int, default=None)
    p.add_argument("--openai-only", action="store_true", help="no /health, /load, /tokenize")
    p.add_argument("--model-name", default="fake-gpu")
    args = p.parse_args(argv)
    config = FakeGpuConfig(
        CostModel(args.g1, args.g2, args.g3, args.c0, source="fake"),
        args.short_threshold,
        args.tbt,
        args.max_output_tokens,
        args.openai_only,
        args.model_name,
    )
    asyncio.run(_serve_forever(args.ports, config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
