"""The load generator: replay requests against any OpenAI-compatible server and time every token.

Each request is its own asyncio task that sleeps until its arrival time, then streams a
``/v1/completions`` request whose prompt is a list of exactly ``prompt_tokens`` token ids, with
``max_tokens`` set to the trace's output length and ``ignore_eos`` (vLLM's extension, which plaserve
and SGLang accept too) so the server generates exactly that many tokens. Prompt ids are random per
request, so no two prompts share a cached prefix. Arrivals are open-loop: a slow server does not slow
the arrivals down.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, replace
from typing import Any

import httpx

from plaserve.workload.report import RequestRecord
from plaserve.workload.slo import TtftSlo, cost_from_load
from plaserve.workload.trace import TraceRequest, fit_to_context


@dataclass(frozen=True)
class ClientConfig:
    """Where and how to send requests."""

    url: str  # server base URL, e.g. http://127.0.0.1:8000
    model: str | None = None  # None: the first model of GET /v1/models
    api_key: str | None = None
    short_threshold: int = 512  # prompts shorter than this are "short"
    request_timeout: float = 600.0
    # ids valid in every tokenizer (and the embedded model)
    token_id_range: tuple[int, int] = (10, 500)
    seed: int = 0
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0


@dataclass
class BenchResult:
    """Everything a run produced."""

    records: list[RequestRecord]
    duration_s: float
    model: str
    slo: TtftSlo
    max_model_len: int | None


def prompt_token_ids(n: int, index: int, cfg: ClientConfig) -> list[int]:
    """``n`` random ids for request ``index``, reproducible from ``cfg.seed``."""
    rng = random.Random(cfg.seed * 1_000_003 + index)
    lo, hi = cfg.token_id_range
    return [rng.randrange(lo, hi) for _ in range(n)]


def _headers(cfg: ClientConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


async def discover(
    client: httpx.AsyncClient, cfg: ClientConfig
) -> tuple[str, int | None, dict | None]:
    """The model to use, the server's context length (if it says) and its cost model (plaserve only)."""
    resp = await client.get(f"{cfg.url}/v1/models", headers=_headers(cfg))
    resp.raise_for_status()
    models = resp.json().get("data") or []
    card = next((m for m in models if cfg.model in (None, m.get("id"))), None)
    if cfg.model is None and card is None:
        raise RuntimeError(f"{cfg.url}/v1/models lists no model")
    model = cfg.model or card["id"]
    max_len = card.get("max_model_len") if card else None
    cost = None
    try:
        load = await client.get(f"{cfg.url}/load", headers=_headers(cfg))
        if load.status_code == 200:
            cost = cost_from_load(load.json())
    except (httpx.HTTPError, json.JSONDecodeError):
        pass  # not a plaserve server: fixed SLOs
    return model, max_len if isinstance(max_len, int) else None, cost


def _error_message(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:200].decode(errors="replace")
    return f"HTTP {status}: {message}"


async def send_one(
    client: httpx.AsyncClient,
    cfg: ClientConfig,
    model: str,
    req: TraceRequest,
    index: int,
    start: float,
    slo: TtftSlo,
) -> RequestRecord:
    """Wait for ``req``'s arrival, stream it, and record its timings."""
    await asyncio.sleep(max(0.0, start + req.arrival - time.perf_counter()))
    record = RequestRecord(
        length_class="short" if req.prompt_tokens < cfg.short_threshold else "long",
        prompt_tokens=req.prompt_tokens,
        output_tokens=0,
        arrival=req.arrival,
        ttft=None,
        e2e=None,
        tbts=[],
        slo_ttft=slo.for_prompt(req.prompt_tokens),
    )
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt_token_ids(req.prompt_tokens, index, cfg),
        "max_tokens": req.output_tokens,
        "temperature": cfg.temperature,
        "top_p": cfg.top_p,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    last, chunks, usage = None, 0, None
    try:
        async with client.stream(
            "POST", f"{cfg.url}/v1/completions", json=body, headers=_headers(cfg)
        ) as resp:
            if resp.status_code != 200:
                record.error = _error_message(resp.status_code, await resp.aread())
                return record
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    record.error = f"stream error: {event['error'].get('message')}"
                    break
                if event.get("usage"):
                    usage = event["usage"]
                if event.get("choices"):
                    now = time.perf_counter()
                    if last is None:
                        record.ttft = now - sent
                    else:
                        record.tbts.append(now - last)
                    last, chunks = now, chunks + 1
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        record.error = f"{type(e).__name__}: {e}"
    if record.error is None:
        record.e2e = time.perf_counter() - sent
        record.output_tokens = int(usage["completion_tokens"]) if usage else chunks
        if record.ttft is None:
            record.error = "no tokens received"
    return record


async def run_requests(
    requests: list[TraceRequest], cfg: ClientConfig, slo: TtftSlo
) -> BenchResult:
    """Replay ``requests`` (fitted to the server's context length) and collect their records.

    ``slo`` gives the factor, floor and fixed fallbacks; the server's cost model is filled in when it
    reports one.
    """
    timeout = httpx.Timeout(cfg.request_timeout, connect=30.0)
    # No connection cap: a capped pool would queue requests in the client and inflate their TTFT.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        model, max_len, cost = await discover(client, cfg)
        slo = replace(slo, cost=cost, short_threshold=cfg.short_threshold)
        fitted = [fit_to_context(r, max_len) for r in requests]
        start = time.perf_counter()
        records = await asyncio.gather(
            *(send_one(client, cfg, model, r, i, start, slo) for i, r in enumerate(fitted))
        )
        duration = time.perf_counter() - start
    return BenchResult(list(records), duration, model, slo, max_len)
