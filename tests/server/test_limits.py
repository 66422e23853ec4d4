"""API keys (401) and a full queue (429 with Retry-After), on a server with both limits set."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

KEY = "sk-test-secret"
# One request at a time holds KV blocks, and one more may wait: a third is turned away.
SERVER_ARGS = ["--api-key", KEY, "--max-queue", "1", "--max-num-seqs", "1"]
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}],
    ids=["missing", "wrong", "not bearer"],
)
def test_requests_without_the_key_get_401(server, headers: dict[str, str]) -> None:
    for method, path in (
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", "/load"),
        ("GET", "/get_load"),
    ):
        resp = httpx.request(
            method, f"{server.url}{path}", json={"prompt": "hi", "max_tokens": 1}, headers=headers
        )
        assert resp.status_code == 401, path
        assert resp.json()["error"]["type"] == "authentication_error"


def test_openai_client_with_the_key(server) -> None:
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    model = good.models.list().data[0].id
    assert (
        good.completions.create(model=model, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
    )


def test_health_and_metrics_need_no_key(server) -> None:
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/metrics").status_code == 200


@pytest.mark.parametrize(
    "body", [{"prompt": ["a", "b"]}, {"prompt": "a", "n": 2}], ids=["prompts", "choices"]
)
def test_request_larger_than_the_queue_gets_400(server, body: dict) -> None:
    # Two engine requests where one may wait: no retry could ever fit it, so it is not a 429.
    resp = httpx.post(f"{server.url}/v1/completions", json={**body, "max_tokens": 1}, headers=AUTH)
    assert resp.status_code == 400
    assert "at most 1" in resp.json()["error"]["message"]


def test_full_queue_gets_429_and_recovers(server) -> None:
    long_body = {
        "prompt": "Once upon a time",
        "max_tokens": 1900,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=30, headers=AUTH) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=long_body) as running:
            # Wait for its first token: it now holds the only sequence slot. (The line iterator is kept:
            # a dropped one closes the stream, and the server would abort the request.)
            lines = running.iter_lines()
            assert next(line for line in lines if line).startswith("data: ")
            with http.stream("POST", f"{server.url}/v1/completions", json=long_body) as waiting:
                assert waiting.status_code == 200  # queued behind the first: the queue is now full
                third = http.post(
                    f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}
                )
                assert third.status_code == 429, third.text
                assert int(third.headers["Retry-After"]) >= 1
        # Both streams are closed, so both requests get aborted (as soon as the server sees the disconnects).
        deadline = time.monotonic() + 20
        while http.get(f"{server.url}/load").json()["num_requests"] and time.monotonic() < deadline:
            time.sleep(0.05)
        resp = http.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert resp.status_code == 200, resp.text


def test_anthropic_client_sends_the_key_as_x_api_key(server) -> None:
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.count_tokens(model="m", messages=[{"role": "user", "content": "hi"}])
    good = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
    model = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["id"]
    count = good.messages.count_tokens(model=model, messages=[{"role": "user", "content": "hi"}])
    assert count.input_tokens > 1
