"""Streaming every n tokens (``--stream-interval``, a request's ``stream_interval``), and answers sent
whole getting only their final output from the engine loop."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from plaserve import EngineConfig, LLMEngine
from plaserve.cost import CostModel
from plaserve.launcher import ServerProcess
from plaserve.request import RequestOutput, SamplingParams
from plaserve.server.engine_loop import EngineLoop, OutputSink, Submission

from .conftest import BASE_ARGS
from .test_engine_loop import TokenRunner


class ListOutbox:
    """An :class:`~plaserve.server.engine_loop.Outbox` into one list per key, from any thread."""

    def __init__(self) -> None:
        self.items: dict[str, list[RequestOutput | BaseException]] = {}
        self.lock = threading.Lock()

    def send(self, puts: list[tuple[Any, tuple[int, RequestOutput | BaseException]]]) -> None:
        with self.lock:
            for key, (_, item) in puts:
                self.items.setdefault(key, []).append(item)

    def finished(self, key: str) -> bool:
        with self.lock:
            got = self.items.get(key, [])
            return bool(got) and isinstance(got[-1], RequestOutput) and got[-1].finished


def test_the_loop_hands_over_the_first_token_every_nth_and_the_end() -> None:
    config = EngineConfig.from_kwargs(kv_cache_memory="64MiB", max_model_len=1024, policy="fcfs")
    engine = LLMEngine(config, runner=TokenRunner(), cost=CostModel(g1=1e-4, g2=0.0))
    loop = EngineLoop(engine)
    outbox = ListOutbox()
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    intervals = {"every": 1, "third": 3, "end": 0, "past_the_end": 50}
    loop.start()
    try:
        loop.submit(
            [
                Submission(
                    key,
                    [5, 6, 7],
                    params,
                    engine.clock(),
                    OutputSink.into(outbox, key),
                    stream_interval=interval,
                )
                for key, interval in intervals.items()
            ]
        )
        deadline = time.monotonic() + 30
        while not all(outbox.finished(k) for k in intervals):
            assert time.monotonic() < deadline, outbox.items
            time.sleep(0.01)
    finally:
        loop.stop()
    counts = {
        k: [len(out.outputs[0].token_ids) for out in outbox.items[k]]  # type: ignore[union-attr]
        for k in intervals
    }
    assert counts == {
        "every": list(range(1, 11)),
        "third": [1, 4, 7, 10],
        "end": [10],
        "past_the_end": [1, 10],
    }
    # every output holds everything so far: the last one is the whole answer either way
    assert len({tuple(outbox.items[k][-1].outputs[0].token_ids) for k in intervals}) == 1  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def server(qwen2_ckpt: str) -> Iterator[ServerProcess]:
    """The engine in a process of its own (the interval crosses the pipe), streaming every 3 tokens."""
    args = [qwen2_ckpt, *BASE_ARGS, "--engine-mode", "process", "--stream-interval", "3"]
    with ServerProcess(args) as proc:
        yield proc


def streamed_token_counts(url: str, body: dict) -> tuple[list[int], str]:
    """The tokens each chunk of a streamed completion carries (by its logprobs), and its text."""
    counts, text = [], ""
    body = {**body, "stream": True, "logprobs": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                (choice,) = json.loads(line[6:])["choices"]
                counts.append(len(choice["logprobs"]["tokens"]))
                text += choice["text"]
    return counts, text


def running_totals(counts: list[int]) -> list[int]:
    return [sum(counts[: i + 1]) for i in range(len(counts))]


@pytest.mark.parametrize(
    "asked,ends",
    [
        (None, {1, 4, 7, 10}),  # the server's 3
        (2, {1, 4, 7, 10}),  # below the server's: raised to it
        (5, {1, 6, 10}),
    ],
)
def test_chunks_end_where_the_interval_says(server: ServerProcess, asked, ends) -> None:
    """A chunk ends at the first token, every interval after it, or the end; where the handler was
    slower than the engine, two outputs' tokens go in one chunk, so each chunk ends at one of those
    points and the last at the end."""
    body: dict[str, Any] = {
        "prompt": [5, 6, 7],
        "max_tokens": 10,
        "ignore_eos": True,
        "temperature": 0,
    }
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
    if asked is not None:
        body["stream_interval"] = asked
    counts, text = streamed_token_counts(server.url, body)
    totals = running_totals(counts)
    assert set(totals) <= ends and totals[-1] == 10, counts
    assert text == whole["choices"][0]["text"]


def test_chat_streams_by_the_interval_too(server: ServerProcess) -> None:
    body = {
        "messages": [{"role": "user", "content": "Count"}],
        "max_tokens": 9,
        "ignore_eos": True,
        "stream": True,
        "stream_interval": 4,
        "logprobs": True,
    }
    counts = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                (choice,) = json.loads(line[6:])["choices"]
                if choice.get("logprobs"):
                    counts.append(len(choice["logprobs"]["content"]))
    totals = running_totals(counts)
    assert set(totals) <= {1, 5, 9} and totals[-1] == 9, counts


@pytest.mark.parametrize("value,status", [(0, 400), (-2, 400), ("3", 422), (2.5, 422)], ids=str)
def test_a_bad_stream_interval_is_refused(server: ServerProcess, value, status) -> None:
    body = {"prompt": [5, 6], "max_tokens": 2, "stream": True, "stream_interval": value}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == status and "stream_interval" in resp.text
    # not streamed, a good one is ignored (as vLLM ignores it)
    body = {"prompt": [5, 6], "max_tokens": 2, "stream_interval": 7}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 2
