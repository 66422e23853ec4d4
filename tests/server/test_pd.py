"""Prefill/decode disaggregation between two real ``plaserve serve`` processes on 127.0.0.1, spoken
by hand the way vLLM's disaggregated proxy speaks it: the prefill request with
``kv_transfer_params.do_remote_decode``, then the original request with the prefill's
``kv_transfer_params`` to the decode worker, which pulls the KV over TCP.

The prefill worker also answers plain requests (no ``kv_transfer_params``) as a colocated worker does:
those are the reference the PD answers must equal token for token (greedy)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from plaserve.launcher import ServerProcess

ARGS = ["--kv-cache-memory", "16MiB", "--max-model-len", "1024"]
TTL = 1.5  # seconds a parked prefill waits for its pull


@pytest.fixture(scope="module")
def prefill(qwen2_ckpt: str) -> Iterator[ServerProcess]:
    with ServerProcess(
        [qwen2_ckpt, *ARGS, "--pd-role", "prefill", "--kv-transfer-ttl", str(TTL)]
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def decode(qwen2_ckpt: str) -> Iterator[ServerProcess]:
    with ServerProcess([qwen2_ckpt, *ARGS, "--pd-role", "decode"]) as proc:
        yield proc


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def prefill_request(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The proxy's first leg: ``max_tokens: 1``, not streamed, ``do_remote_decode``."""
    first = {
        **body,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    first.pop("stream_options", None)
    r = post(url, path, first)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_port"] > 0
    return params


def texts(path: str, body: dict[str, Any]) -> list[str]:
    """The choices' texts of a finished (non-streamed) response body."""
    if path == "/v1/chat/completions":
        return [c["message"]["content"] for c in body["choices"]]
    return [c["text"] for c in body["choices"]]


def stream_texts(url: str, path: str, body: dict[str, Any]) -> list[str]:
    out: dict[int, str] = {}
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for c in event["choices"]:
                piece = c.get("text") if "text" in c else c.get("delta", {}).get("content")
                out[c["index"]] = out.get(c["index"], "") + (piece or "")
    return [out[i] for i in sorted(out)]


def through_pd(
    prefill: str, decode: str, path: str, body: dict[str, Any], stream: bool
) -> list[str]:
    params = prefill_request(prefill, path, body)
    second = {**body, "kv_transfer_params": params}
    if stream:
        return stream_texts(decode, path, second)
    r = post(decode, path, second)
    assert r.status_code == 200, r.text
    return texts(path, r.json())


def load(url: str) -> dict[str, Any]:
    return httpx.get(url + "/load", timeout=10).json()


def wait_blocks_zero(url: str, timeout: float = 10.0) -> None:
    """Every KV block of the worker is free again (the prefix cache keeps content, not references)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if load(url)["kv"]["used_blocks"] == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"{url} still holds {load(url)['kv']['used_blocks']} KV blocks")


LONG = " ".join(f"word{i % 37} thing{i % 11}" for i in range(75))  # ~650 tokens: 40 blocks

CASES = [
    ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 12}),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 8}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Say something long"}], "max_tokens": 10},
    ),
    ("/v1/completions", {"prompt": "A prompt with two choices", "max_tokens": 6, "n": 2}),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_pd_outputs_equal_colocated(
    prefill: ServerProcess, decode: ServerProcess, stream: bool
) -> None:
    for path, body in CASES:
        body = {**body, "temperature": 0}
        ref = texts(path, post(prefill.url, path, body).json())
        got = through_pd(prefill.url, decode.url, path, body, stream)
        assert got == ref, (path, body.get("n"), got, ref)
    wait_blocks_zero(prefill.url)
    wait_blocks_zero(decode.url)


def test_prefix_cached_prompt_pulls_only_missing_blocks(
    prefill: ServerProcess, decode: ServerProcess
) -> None:
    path = "/v1/completions"
    head = " ".join(f"shared{i % 13}" for i in range(120))
    first = {"prompt": head + " first question", "max_tokens": 5, "temperature": 0}
    second = {"prompt": head + " another question", "max_tokens": 5, "temperature": 0}
    through_pd(prefill.url, decode.url, path, first, stream=False)

    def received_blocks() -> float:
        text = httpx.get(decode.url + "/metrics", timeout=10).text
        return sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith('plaserve_kv_transfer_blocks_total{direction="received"}')
        )

    before = received_blocks()
    params = prefill_request(prefill.url, path, second)
    r = post(decode.url, path, {**second, "kv_transfer_params": params})
    pulled = received_blocks() - before
    assert texts(path, r.json()) == texts(path, post(prefill.url, path, second).json())
    # The shared head's blocks were in the decode worker's prefix cache: only the tail came over.
    assert 0 < pulled < len(params["remote_block_ids"]) / 2, (pulled, params["remote_block_ids"])
    wait_blocks_zero(prefill.url)
    wait_blocks_zero(decode.url)


def test_unpulled_prefill_expires_and_frees_its_blocks(prefill: ServerProcess) -> None:
    params = prefill_request(prefill.url, "/v1/completions", {"prompt": LONG, "temperature": 0})
    assert load(prefill.url)["kv"]["used_blocks"] >= len(params["remote_block_ids"]) > 0
    wait_blocks_zero(prefill.url, timeout=TTL + 3)
    metrics = httpx.get(prefill.url + "/metrics", timeout=10).text
    assert "plaserve_kv_transfer_expired_total 1.0" in metrics or (
        "plaserve_kv_transfer_expired_total" in metrics
    )


def test_pull_of_an_expired_prefill_is_a_503_and_frees_the_reservation(
    prefill: ServerProcess, decode: ServerProcess
) -> None:
    body = {"prompt": LONG + " expired", "max_tokens": 4, "temperature": 0}
    params = prefill_request(prefill.url, "/v1/completions", body)
    wait_blocks_zero(prefill.url, timeout=TTL + 3)
    r = post(decode.url, "/v1/completions", {**body, "kv_transfer_params": params})
    assert r.status_code == 503 and r.json()["error"]["code"] == "kv_pull_failed", r.text
    wait_blocks_zero(decode.url)


def test_bad_kv_transfer_params_are_400s(prefill: ServerProcess, decode: ServerProcess) -> None:
    path = "/v1/completions"
    bad = [
        (decode.url, {"kv_transfer_params": "yes"}, "must be an object"),
        (decode.url, {"kv_transfer_params": {"do_remote_decode": True}}, "decode worker"),
        (prefill.url, {"kv_transfer_params": {"do_remote_decode": True}, "stream": True}, "stream"),
        (
            decode.url,
            {"kv_transfer_params": {"do_remote_prefill": True, "remote_port": 1}},
            "first_token_ids",
        ),
        (
            decode.url,
            {
                "kv_transfer_params": {
                    "do_remote_prefill": True,
                    "remote_host": "127.0.0.1",
                    "remote_port": 1,
                    "remote_request_id": "x",
                    "num_prompt_tokens": 999,
                    "first_token_ids": [1],
                }
            },
            "prompt tokens",
        ),
        (
            prefill.url,
            {"kv_transfer_params": {"do_remote_decode": True}, "logprobs": 2},
            "logprobs",
        ),
    ]
    for url, extra, words in bad:
        r = post(url, path, {"prompt": "hello", "max_tokens": 2, **extra})
        assert r.status_code == 400 and words in r.json()["error"]["message"], (extra, r.text)
    wait_blocks_zero(decode.url)
