"""Engine supervision: a step that raises fails the requests in flight cleanly, frees every KV block and
restarts the engine; faults that keep coming make the loop give up and call ``on_fatal``.

The server runs in this process (uvicorn on a thread, real HTTP on 127.0.0.1) so that the test can make
the engine's runner raise at a chosen step.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn

from plaserve import EngineConfig, LLMEngine
from plaserve.launcher import free_port
from plaserve.server.app import build_app
from plaserve.server.connections import http_protocol
from plaserve.server.engine_loop import EngineHandle, EngineLoop
from plaserve.testing.faults import FailingRunner

from .test_faults import wait_idle


@contextmanager
def live_server(loop: EngineHandle, **app_kwargs: Any) -> Iterator[str]:
    """``loop`` served over HTTP on 127.0.0.1 by uvicorn on a thread of this process (``app_kwargs``:
    for ``build_app``); yields the base URL."""
    port = free_port()
    config = uvicorn.Config(
        build_app(loop, **app_kwargs),
        host="127.0.0.1",
        port=port,
        log_level="warning",
        http=http_protocol(10.0),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{url}/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.05)
    try:
        yield url
    finally:
        server.should_exit = True
        thread.join(30)


@pytest.fixture
def engine(qwen2_ckpt: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig.from_kwargs(
            model=qwen2_ckpt,
            kv_cache_memory="16MiB",
            max_model_len=512,
            policy="fcfs",
            max_num_batched_tokens=64,
        )
    )


async def stream(client: httpx.AsyncClient, url: str, prompt_len: int) -> str:
    """'ok' (all 20 tokens, [DONE]), 'error_event' (an error event, [DONE]) or 'http_<status>'."""
    body = {
        "prompt": list(range(3, 3 + prompt_len)),
        "max_tokens": 20,
        "ignore_eos": True,
        "stream": True,
    }
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return f"http_{resp.status_code}"
        tokens, error, done = 0, False, False
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
            else:
                event = json.loads(data)
                error |= "error" in event
                tokens += bool(event.get("choices"))
        assert done, "every stream ends with [DONE]"
        return "error_event" if error else ("ok" if tokens >= 1 else "empty")


def test_a_failed_step_fails_its_requests_cleanly_frees_kv_and_the_engine_restarts(
    engine: LLMEngine,
) -> None:
    # Step 6 raises: by then the prompts (160 tokens in 64-token chunks) are part-way through prefill
    # or decoding, and every request holds KV blocks.
    engine.runner = FailingRunner(engine.runner, fail_at={6})
    loop = EngineLoop(engine)
    with live_server(loop) as url:
        fails_then_recovers(url)
        assert loop.restarts == 1


def fails_then_recovers(url: str) -> None:
    """Six streams against a server whose engine fails one step (part-way through their prefills or
    decodes): some get an error event, none hangs; the engine comes back with every KV block free,
    serves again, and its metrics count the restart and the failed requests."""

    async def burst() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(stream(client, url, 40 + 40 * (i % 3)) for i in range(6)))

    outcomes = asyncio.run(burst())
    assert set(outcomes) <= {"ok", "error_event", "http_503"}, outcomes
    assert "error_event" in outcomes  # the step failed with requests in flight
    # Clients hear of the failure before the reset is done (/health answers 503 meanwhile).
    deadline = time.monotonic() + 30
    while httpx.get(f"{url}/health").status_code != 200:
        assert time.monotonic() < deadline, "the engine did not come back"
        time.sleep(0.05)
    wait_idle(url)  # every block freed
    # The restarted engine serves as before.
    again = httpx.post(
        f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
    )
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4
    metrics = httpx.get(f"{url}/metrics").text
    assert "plaserve_engine_restarts_total 1.0" in metrics
    assert 'finish_reason="error"' in metrics


def test_faults_that_keep_coming_make_the_loop_give_up_and_call_on_fatal(engine: LLMEngine) -> None:
    engine.runner = FailingRunner(engine.runner, fail_at=set(range(1, 100)))  # every step fails
    fatal: list[BaseException] = []
    loop = EngineLoop(engine, max_restarts=2, restart_window=60.0, on_fatal=fatal.append)
    with live_server(loop) as url:
        for _ in range(3):  # two failures are recovered from, the third is fatal
            resp = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
            assert resp.status_code == 503, resp.text
            deadline = time.monotonic() + 10
            while not loop.alive and not fatal and time.monotonic() < deadline:
                time.sleep(0.02)
        assert len(fatal) == 1 and "injected failure" in repr(fatal[0])
        assert loop.restarts == 2
        assert httpx.get(f"{url}/health").status_code == 503  # the truth: it will not serve again
        assert (
            httpx.post(f"{url}/v1/completions", json={"prompt": [5], "max_tokens": 1}).status_code
            == 503
        )


def test_health_is_503_while_the_engine_restarts(engine: LLMEngine) -> None:
    """The reset is held up on purpose: /health must say 503 for as long as it runs."""
    engine.runner = FailingRunner(engine.runner, fail_at={1})
    in_reset, release = threading.Event(), threading.Event()
    real_reset = engine.reset

    def slow_reset() -> None:
        in_reset.set()
        release.wait(10)
        real_reset()

    engine.reset = slow_reset  # type: ignore[method-assign]
    loop = EngineLoop(engine)
    with live_server(loop) as url:
        first = threading.Thread(
            target=httpx.post,
            args=(f"{url}/v1/completions",),
            kwargs={"json": {"prompt": [5, 6], "max_tokens": 2}, "timeout": 30},
        )
        first.start()
        assert in_reset.wait(10)
        assert httpx.get(f"{url}/health").status_code == 503
        assert (
            httpx.post(f"{url}/v1/completions", json={"prompt": [5], "max_tokens": 1}).status_code
            == 503
        )
        release.set()
        first.join(30)
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        wait_idle(url)
