"""The fault suite: no request body can make the server answer 5xx, reset a connection or stop serving.

Every body goes to a live ``plaserve serve`` over one keep-alive connection, which must still be the
same socket afterwards: a reset connection would show as a new one. The bodies are the regressions a
probe found (NaN temperatures, 100,000-deep JSON, 5,000-digit integers, lone surrogates, ...) and
bodies hypothesis makes up from the API's field names and JSON values of every kind.
"""

from __future__ import annotations

import http.client
import json
import math
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from plaserve.launcher import ServerProcess

MAX_MODEL_LEN = 96  # bounds every generation the fuzzer can ask for (n * max_tokens stays small)


class KeepAliveClient:
    """One HTTP/1.1 connection; :meth:`post` fails the test if the server closed it."""

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=60)
        self.conn.connect()
        self.sock = self.conn.sock

    def post(self, path: str, raw: bytes) -> tuple[int, dict[str, Any] | None]:
        self.conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        data = resp.read()
        assert self.conn.sock is self.sock and not resp.will_close, (
            f"the server closed the connection after {path}"
        )
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, None  # a stream

    def close(self) -> None:
        self.conn.close()


@pytest.fixture(scope="module")
def server(qwen2_ckpt: str) -> Iterator[ServerProcess]:
    with ServerProcess(
        [
            qwen2_ckpt,
            "--kv-cache-memory",
            "32MiB",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--no-compile",
        ]
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def conn(server: ServerProcess) -> Iterator[KeepAliveClient]:
    client = KeepAliveClient(server.url)
    yield client
    client.close()


def assert_openai_error(status: int, body: dict[str, Any] | None) -> dict[str, Any]:
    assert body is not None and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    # a string or null, as OpenAI's API
    assert err["code"] is None or isinstance(err["code"], str), err
    assert err["param"] is None or isinstance(err["param"], str)
    return err


def wait_idle(url: str, timeout: float = 30.0) -> dict[str, Any]:
    """The load report once nothing runs and no KV block is held (fails after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while True:
        load = httpx.get(f"{url}/load").json()
        if load["num_requests"] == 0 and load["kv"]["used_blocks"] == 0 and load["pending"] == 0:
            return load
        assert time.monotonic() < deadline, f"the server did not go idle: {load}"
        time.sleep(0.05)


def dumps(body: dict[str, Any]) -> bytes:
    return json.dumps(
        body
    ).encode()  # NaN and Infinity as JavaScript literals, as the probe sent them


COMPLETION = "/v1/completions"
CHAT = "/v1/chat/completions"
# (path, raw body, the field the 400 must name or None)
REGRESSIONS = [
    (
        COMPLETION,
        dumps({"prompt": "Hello there", "max_tokens": 8, "temperature": math.nan}),
        "temperature",
    ),
    (
        COMPLETION,
        dumps({"prompt": "Hello there", "max_tokens": 8, "temperature": math.inf}),
        "temperature",
    ),
    (
        COMPLETION,
        dumps({"prompt": "Hello", "max_tokens": 8, "repetition_penalty": math.nan}),
        "repetition_penalty",
    ),
    (
        COMPLETION,
        dumps({"prompt": "Hello", "max_tokens": 8, "repetition_penalty": 1e-300}),
        "repetition_penalty",
    ),
    (COMPLETION, dumps({"prompt": "Hello", "max_tokens": 8, "top_p": math.nan}), "top_p"),
    (COMPLETION, dumps({"prompt": "Hello", "max_tokens": 8, "min_p": -math.inf}), "min_p"),
    (
        COMPLETION,
        dumps({"prompt": "Hello", "max_tokens": 8, "presence_penalty": math.nan}),
        "presence_penalty",
    ),
    (
        COMPLETION,
        dumps({"prompt": "Hello", "max_tokens": 8, "frequency_penalty": math.inf}),
        "frequency_penalty",
    ),
    (
        COMPLETION,
        dumps({"prompt": "Hello", "max_tokens": 8, "logit_bias": {"5": math.nan}}),
        "logit_bias",
    ),
    (COMPLETION, dumps({"prompt": "Hello", "max_tokens": 8, "seed": 2**64}), "seed"),
    (COMPLETION, dumps({"prompt": "Hello", "max_tokens": 8, "seed": -(2**63) - 1}), "seed"),
    (COMPLETION, b'{"prompt": "Hello", "max_tokens": 8, "temperature": 1e999}', "temperature"),
    (COMPLETION, b"[" * 100_000 + b"]" * 100_000, None),
    (COMPLETION, b'{"prompt": "Hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    (COMPLETION, b'{"prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}", None),
    (COMPLETION, b'{"prompt": "Hi", "max_tokens": 4, "seed": ' + b"1" * 4301 + b"}", None),
    (
        COMPLETION,
        b'{"prompt": "Hi", "max_tokens": 4, "logit_bias": {"' + b"7" * 5000 + b'": 1}}',
        "logit_bias",
    ),
    (COMPLETION, b'{"prompt": "Hi \\ud800 there", "max_tokens": 4}', None),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 4}', None),
    (
        CHAT,
        dumps(
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 4,
                "temperature": math.nan,
            }
        ),
        "temperature",
    ),
]


@pytest.mark.parametrize(
    "path,raw,param", REGRESSIONS, ids=[f"{i}" for i in range(len(REGRESSIONS))]
)
def test_probe_regressions_get_a_400_naming_the_field(
    conn: KeepAliveClient, path: str, raw: bytes, param: str | None
) -> None:
    status, body = conn.post(path, raw)
    assert status == 400, (status, body)
    err = assert_openai_error(status, body)
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-45, 1e-6])
def test_tiny_temperatures_are_greedy(conn: KeepAliveClient, temperature: float) -> None:
    body = {"prompt": "Hello there", "max_tokens": 8, "ignore_eos": True}
    status, greedy = conn.post(COMPLETION, dumps({**body, "temperature": 0}))
    assert status == 200
    status, tiny = conn.post(COMPLETION, dumps({**body, "temperature": temperature}))
    assert status == 200, tiny
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]


@pytest.mark.parametrize("temperature", [1e308, 2.0**64, 1e31])
def test_huge_temperatures_draw_among_the_allowed_tokens(
    conn: KeepAliveClient, temperature: float
) -> None:
    """A huge temperature over logits some of which are -inf (a grammar's mask here) made NaN (the
    temperature is inf in float32): the engine failed and restarted, aborting every request it had.
    Now a uniform draw among the allowed tokens."""
    body = {"prompt": "Hello", "max_tokens": 32, "temperature": temperature}
    body["structured_outputs"] = {"choice": ["yes", "no", "maybe so"]}
    status, out = conn.post(COMPLETION, dumps(body))
    assert status == 200, out
    assert out is not None and out["choices"][0]["text"] in ("yes", "no", "maybe so"), out


def test_oversized_body_is_413_and_the_server_goes_on(server: ServerProcess) -> None:
    big = b'{"prompt": "' + b"a" * (33 * 2**20) + b'"}'
    resp = httpx.post(
        f"{server.url}{COMPLETION}", content=big, headers={"Content-Type": "application/json"}
    )
    assert resp.status_code == 413
    assert_openai_error(413, resp.json())
    assert httpx.get(f"{server.url}/health").status_code == 200


# --- hypothesis -----------------------------------------------------------------------------------
FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "best_of",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "min_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "echo",
    "stream",
    "stream_options",
    "skip_special_tokens",
    "include_stop_str_in_output",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "suffix",
    "add_generation_prompt",
    "user",
]
NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, 2, 4, -1, 0.5, 1e-300, 5e-324, 2**63, 2**64, 1e308]),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    NUMBERS,
    st.text(max_size=20),
    st.sampled_from(["\ud800", "x\udfff", "gpt", "text", "json_object", "none", "auto"]),
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
PROMPTS = st.one_of(
    st.text(max_size=30),
    st.lists(st.integers(-5, 600), max_size=20),
    st.lists(st.text(max_size=10), max_size=3),
    JSON,
)
MESSAGES = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["user", "system", "assistant", "x"]),
                "content": st.one_of(st.text(max_size=30), JSON),
            }
        ),
        max_size=3,
    ),
    JSON,
)
# Generation stays small: a server-side limit would be tested, not the server's speed.
SMALL_COUNTS = st.one_of(st.integers(-3, 8), NUMBERS, JSON)


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, bytes]:
    path = draw(st.sampled_from([COMPLETION, CHAT]))
    body: dict[str, Any] = {}
    if path == COMPLETION and draw(st.booleans()):
        body["prompt"] = draw(PROMPTS)
    if path == CHAT and draw(st.booleans()):
        body["messages"] = draw(MESSAGES)
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True)):
        body[name] = draw(
            SMALL_COUNTS
            if name in ("max_tokens", "max_completion_tokens", "n", "best_of")
            else PROMPTS
            if name == "prompt"
            else MESSAGES
            if name == "messages"
            else JSON
        )
    return path, json.dumps(body).encode()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=bodies())
def test_generated_bodies_never_get_a_5xx(
    conn: KeepAliveClient, server: ServerProcess, case: tuple[str, bytes]
) -> None:
    path, raw = case
    status, body = conn.post(path, raw)
    assert status < 500, (status, body, raw[:300])
    if status >= 400:
        assert_openai_error(status, body)


def test_after_the_fuzzing_the_server_is_healthy_and_holds_no_blocks(server: ServerProcess) -> None:
    # Runs after the tests above in this module (pytest keeps file order).
    assert httpx.get(f"{server.url}/health").status_code == 200
    wait_idle(server.url)
    metrics = httpx.get(f"{server.url}/metrics").text
    assert 'plaserve_http_errors_total{status="500"}' not in metrics
    assert "plaserve_engine_restarts_total 0.0" in metrics
