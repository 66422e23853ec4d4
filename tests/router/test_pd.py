"""Prefill/decode disaggregation with real ``plaserve serve`` and ``plaserve route`` processes on
127.0.0.1 (docs/PD.md).

First the workers alone, spoken to by hand the way vLLM's disaggregated proxy speaks: the prefill
request with ``kv_transfer_params.do_remote_decode``, then the original request with the prefill's
``kv_transfer_params`` to the decode worker, which pulls the KV over TCP. Then ``plaserve route
--prefill-urls --decode-urls`` with the official OpenAI client, and the failures: a prefill worker
killed after answering, a decode worker killed mid-stream.

A prefill worker also answers plain requests (no ``kv_transfer_params``) as a colocated worker does:
those are the reference the PD answers must equal token for token (greedy)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import openai
import pytest

from plaserve.launcher import PlaserveProcess, RouterProcess, ServerProcess, running
from plaserve.router.config import RouterConfig
from plaserve.router.hints import HEADER
from plaserve.router.pd import DecodeTier

from .test_proxy import metric

ARGS = ["--kv-cache-memory", "16MiB", "--max-model-len", "1024", "--no-compile"]
TTL = 0.8  # seconds a parked prefill waits for its pull


class ClusterProcess(PlaserveProcess):
    """``plaserve cluster ARGS`` (its ``--port`` is the router's); ready once the router is healthy,
    i.e. has a prefill and a decode worker."""

    subcommand = "cluster"


@dataclass(frozen=True)
class Endpoint:
    url: str


ROUTER_ARGS = [
    "--health-check-interval-secs",
    "0.2",
    "--load-interval-ms",
    "100",
    "--trust-length-hints-from",
    "127.0.0.1/32",  # only requests that carry x-prompt-tokens are affected
]


@pytest.fixture(scope="module")
def workers(qwen2_ckpt: str) -> Iterator[dict[str, PlaserveProcess]]:
    """``plaserve cluster --prefill 1 --decode 1`` (the router and its two workers), and a prefill
    and a decode worker of their own that die in the failure tests (which therefore run last); all
    started at once."""
    worker_args = " ".join([*ARGS[2:], "--kv-transfer-ttl", str(TTL)])
    procs: dict[str, PlaserveProcess] = {
        "cluster": ClusterProcess(
            [
                qwen2_ckpt,
                "--prefill",
                "1",
                "--decode",
                "1",
                "--kv-cache-memory",
                ARGS[1],
                "--worker-args",
                worker_args,
                *ROUTER_ARGS,
            ]
        ),
        "doomed_prefill": ServerProcess([qwen2_ckpt, *ARGS, "--pd-role", "prefill"]),
        "doomed_decode": ServerProcess([qwen2_ckpt, *ARGS, "--pd-role", "decode"]),
    }
    with running(*procs.values()):
        yield procs


@pytest.fixture(scope="module")
def router(workers: dict[str, PlaserveProcess]) -> PlaserveProcess:
    return workers["cluster"]


@pytest.fixture(scope="module")
def prefill(router: PlaserveProcess) -> Endpoint:
    """The cluster's prefill worker (the router's ``/workers`` names it)."""
    (worker,) = httpx.get(router.url + "/workers", timeout=10).json()["workers"]
    return Endpoint(worker["url"])


@pytest.fixture(scope="module")
def decode(router: PlaserveProcess) -> Endpoint:
    (worker,) = httpx.get(router.url + "/workers", timeout=10).json()["decode_workers"]
    return Endpoint(worker["url"])


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def prefill_request(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The proxy's first leg: ``max_tokens: 1``, not streamed, ``do_remote_decode``."""
    limit = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    first = {**body, limit: 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    first.pop("stream_options", None)
    r = post(url, path, first)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_port"] > 0
    return params


def texts(path: str, body: dict[str, Any]) -> list[str]:
    """The choices' texts of a finished (non-streamed) response body (a Response's: its one answer,
    the message's text and each function call's name and arguments)."""
    if path == "/v1/responses":
        parts = [
            item["content"][0]["text"]
            if item["type"] == "message"
            else f"{item['name']}({item['arguments']})"
            for item in body["output"]
        ]
        return ["|".join(parts)]
    if path == "/v1/messages":
        return ["".join(b["text"] for b in body["content"] if b["type"] == "text")]
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
            assert "error" not in event and event.get("type") != "error", event
            if path == "/v1/responses":  # the Response its last event carries
                if event["type"] == "response.completed":
                    return texts(path, event["response"])
                continue
            if path == "/v1/messages":  # the text deltas
                if (
                    event["type"] == "content_block_delta"
                    and event["delta"]["type"] == "text_delta"
                ):
                    out[0] = out.get(0, "") + event["delta"]["text"]
                continue
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


def generated(url: str) -> float:
    """The tokens a worker has generated, by its ``/metrics``."""
    return metric(httpx.get(url + "/metrics", timeout=10).text, "vllm:generation_tokens_total")


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

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
}
CASES = [
    # The decode worker's request finishes on the prefill's first token (it has nothing to decode).
    ("/v1/completions", {"prompt": "Just one token", "max_tokens": 1}),
    ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 12}),
    ("/v1/completions", {"prompt": LONG, "max_tokens": 8}),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Say something long"}], "max_tokens": 10},
    ),
    ("/v1/completions", {"prompt": "A prompt with two choices", "max_tokens": 6, "n": 2}),
    (  # seeded sampling: the decode worker goes on from the seed's second draw, as one worker would
        "/v1/completions",
        {"prompt": "Seeded", "max_tokens": 8, "temperature": 1.0, "seed": 9, "n": 2},
    ),
    (
        "/v1/responses",
        {
            "instructions": "Be brief.",
            "input": "Say something",
            "max_output_tokens": 9,
            **{"temperature": 1.0, "seed": 4, "ignore_eos": True},  # as the Messages case below
        },
    ),
    (  # a named function call: the arguments' grammar runs across the two workers
        "/v1/responses",
        {
            "input": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER}],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 30,
        },
    ),
    (  # sampled, with a seed: the tiny model's greedy chat is special tokens only (no text)
        "/v1/messages",
        {
            "messages": [{"role": "user", "content": "Say a thing"}],
            "max_tokens": 9,
            "temperature": 1.0,
            "seed": 3,
            "ignore_eos": True,
        },
    ),
    # The decode worker's grammar matcher must take the prefill's first token as its own.
    (
        "/v1/completions",
        {
            "prompt": "Answer with a number",
            "max_tokens": 24,
            "structured_outputs": {"regex": "(12|345|6789) apples"},
        },
    ),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_pd_outputs_equal_colocated(prefill: Endpoint, decode: Endpoint, stream: bool) -> None:
    for path, body in CASES:
        body = {"temperature": 0, **body}
        ref = texts(path, post(prefill.url, path, body).json())
        got = through_pd(prefill.url, decode.url, path, body, stream)
        assert got == ref, (path, body.get("n"), got, ref)
        assert path == "/v1/completions" or ref[0], ref  # an answer with text to compare
        if "structured_outputs" in body:
            assert got[0] in ("12 apples", "345 apples", "6789 apples"), got
    wait_blocks_zero(prefill.url)
    wait_blocks_zero(decode.url)


def test_prefix_cached_prompt_pulls_only_missing_blocks(
    prefill: Endpoint, decode: Endpoint
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


def test_unpulled_prefill_expires_and_frees_its_blocks(prefill: Endpoint) -> None:
    params = prefill_request(prefill.url, "/v1/completions", {"prompt": LONG, "temperature": 0})
    assert load(prefill.url)["kv"]["used_blocks"] >= len(params["remote_block_ids"]) > 0
    wait_blocks_zero(prefill.url, timeout=TTL + 3)
    metrics = httpx.get(prefill.url + "/metrics", timeout=10).text
    expired = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("plaserve_kv_transfer_expired_total ")
    ]
    assert expired and expired[0] >= 1, metrics


def test_pull_of_an_expired_prefill_is_a_503_and_frees_the_reservation(
    prefill: Endpoint, decode: Endpoint
) -> None:
    body = {"prompt": LONG + " expired", "max_tokens": 4, "temperature": 0}
    params = prefill_request(prefill.url, "/v1/completions", body)
    wait_blocks_zero(prefill.url, timeout=TTL + 3)
    r = post(decode.url, "/v1/completions", {**body, "kv_transfer_params": params})
    assert r.status_code == 503 and r.json()["error"]["code"] == "kv_pull_failed", r.text
    wait_blocks_zero(decode.url)


def test_bad_kv_transfer_params_are_400s(prefill: Endpoint, decode: Endpoint) -> None:
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


def test_a_decode_worker_without_room_waits_while_the_kv_is_parked(qwen2_ckpt: str) -> None:
    """A decode worker at its limit of sequences (one here) holds an import until a running request
    ends, as vLLM's decode instance queues it, instead of refusing it; it answers 503 `kv_no_room` at
    once where the parked KV would expire first (ROOM_MARGIN_S, 1 s, before `expires_at`). More
    choices than it can ever run at once are not refused either. A client that leaves meanwhile ends
    its wait."""
    path = "/v1/completions"
    args = ["--kv-cache-memory", "16MiB", "--max-model-len", "2048", "--no-compile"]
    with running(
        ServerProcess([qwen2_ckpt, *args, "--pd-role", "prefill"]),  # the default TTL, 30 s
        ServerProcess([qwen2_ckpt, *args, "--pd-role", "decode", "--max-num-seqs", "1"]),
    ) as (pre, dec):
        # A holds the decode worker's one sequence until the test lets it go.
        body_a = {"prompt": "The quick brown fox", "max_tokens": 2000, "ignore_eos": True}
        second_a = {**body_a, "kv_transfer_params": prefill_request(pre.url, path, body_a)}
        release, ended = threading.Event(), {}

        def run_a() -> None:
            with httpx.stream("POST", dec.url + path, json={**second_a, "stream": True}) as r:
                assert r.status_code == 200
                for _ in r.iter_lines():
                    if release.is_set():
                        break
            ended["a"] = time.monotonic()

        a = threading.Thread(target=run_a)
        a.start()
        deadline = time.monotonic() + 30
        while sum(load(dec.url)["running"].values()) == 0:
            assert time.monotonic() < deadline and a.is_alive(), "A never ran"
            time.sleep(0.01)
        body_b = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        params_b = prefill_request(pre.url, path, body_b)
        # B's KV about to expire: refused at once.
        soon = {**params_b, "expires_at": time.time() + 0.5}
        r = post(dec.url, path, {**body_b, "kv_transfer_params": soon})
        assert r.status_code == 503 and r.json()["error"]["code"] == "kv_no_room", r.text
        # A client that gives up while its decode leg waits for room ends the wait: nothing pulled,
        # the prefill worker told to free the KV.
        body_c = {"prompt": "A client that leaves", "max_tokens": 8, "temperature": 0}
        params_c = prefill_request(pre.url, path, body_c)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(dec.url + path, json={**body_c, "kv_transfer_params": params_c}, timeout=0.5)
        # B, with 30 s of parked life left, waits until A's client leaves, and is answered.
        answer: dict[str, Any] = {}

        def run_b() -> None:
            answer["r"] = post(dec.url, path, {**body_b, "kv_transfer_params": params_b})
            answer["at"] = time.monotonic()

        b = threading.Thread(target=run_b)
        b.start()
        b.join(0.5)
        assert b.is_alive() and a.is_alive(), "B did not wait for A's sequence"
        assert load(dec.url)["pd"]["waiting_for_room"] == 1  # what the router reads
        release.set()
        a.join(30)
        b.join(30)
        assert answer["r"].status_code == 200, answer["r"].text
        assert ended["a"] <= answer["at"]
        assert load(dec.url)["pd"]["waiting_for_room"] == 0
        assert texts(path, answer["r"].json()) == texts(path, post(pre.url, path, body_b).json())
        # Two choices on a worker of one sequence: the first imported, the second queued behind it
        # as a colocated server runs it (the prompt's blocks found in the prefix cache); both equal
        # the prefill worker's own answer (a seed: the same draws).
        body_n = {**body_b, "n": 2, "temperature": 0.8, "seed": 7}
        params_n = prefill_request(pre.url, path, body_n)
        r = post(dec.url, path, {**body_n, "kv_transfer_params": params_n})
        assert r.status_code == 200, r.text
        assert texts(path, r.json()) == texts(path, post(pre.url, path, body_n).json())
        wait_blocks_zero(dec.url)
        pulls = httpx.get(dec.url + "/metrics", timeout=10).text
        assert metric(pulls, "plaserve_kv_transfer_seconds_count") == 3  # A's, B's and n's
        # The KV never pulled (the client gone) was freed at the decode worker's word, not left
        # parked until it expires.
        wait_blocks_zero(pre.url)
        text = httpx.get(pre.url + "/metrics", timeout=10).text
        assert metric(text, "plaserve_kv_transfer_released_total") == 1
        assert metric(text, "plaserve_kv_transfer_expired_total") == 0


# --- through the router ----------------------------------------------------------------------------


def test_the_router_takes_a_decode_worker_with_legs_waiting_for_room_as_full() -> None:
    """A decode worker whose `/load` reports decode legs waiting for room is full, whatever its KV
    utilisation says: the router sends the next request elsewhere."""
    tier = DecodeTier(["http://a:1", "http://b:1"], RouterConfig(), lambda: None, {}, lambda: 0.0)  # type: ignore[arg-type, return-value]
    for w in tier.workers.values():
        w.healthy = True
    a, b = tier.workers.values()
    tier.loads[a.url] = {
        "kv": {"utilization": 0.2},
        "running": {"short": 1},
        "pd": {"waiting_for_room": 0},
    }
    tier.loads[b.url] = {"kv": {"utilization": 0.7}, "running": {"short": 5}}
    assert tier.choose(set()) is a
    tier.loads[a.url]["pd"]["waiting_for_room"] = 2
    assert tier.pressure(a) == (10, 3)
    assert tier.choose(set()) is b


def pd_router(prefill_urls: list[str], decode_urls: list[str], *extra: str) -> RouterProcess:
    return RouterProcess(
        [],
        ["--prefill-urls", *prefill_urls, "--decode-urls", *decode_urls, *ROUTER_ARGS, *extra],
    )


def test_router_pd_equals_colocated_with_the_openai_client(
    prefill: Endpoint, decode: Endpoint, router: PlaserveProcess
) -> None:
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
    ref_client = openai.OpenAI(base_url=f"{prefill.url}/v1", api_key="x", max_retries=0)
    for prompt, n in [("Once upon a time", 1), (LONG, 1), ("Two ways to say it", 2)]:
        kw = {"model": "qwen20", "prompt": prompt, "max_tokens": 10, "temperature": 0, "n": n}
        ref = [c.text for c in ref_client.completions.create(**kw).choices]
        before = generated(prefill.url)
        assert [c.text for c in client.completions.create(**kw).choices] == ref
        # The prefill leg samples one choice whatever `n`: the decode worker runs the others.
        assert generated(prefill.url) - before == 1
        parts: dict[int, str] = {}
        for chunk in client.completions.create(**kw, stream=True):
            for c in chunk.choices:
                parts[c.index] = parts.get(c.index, "") + c.text
        assert [parts[i] for i in sorted(parts)] == ref
    # one token: the prefill's is the whole answer, and the decode leg must still end
    kw = {"model": "qwen20", "prompt": "Only one", "max_tokens": 1, "temperature": 0}
    ref = [c.text for c in ref_client.completions.create(**kw).choices]
    assert [c.text for c in client.completions.create(**kw).choices] == ref
    assert (
        "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True)) == ref[0]
    )
    messages = [{"role": "user", "content": "Tell me about foxes"}]
    ref = ref_client.chat.completions.create(
        model="qwen20", messages=messages, max_tokens=8, temperature=0
    )
    got = client.chat.completions.create(
        model="qwen20", messages=messages, max_tokens=8, temperature=0
    )
    assert got.choices[0].message.content == ref.choices[0].message.content
    kw = {"model": "qwen20", "instructions": "Be brief.", "input": "Tell me about foxes"}
    ref = ref_client.responses.create(**kw, max_output_tokens=8, temperature=0)
    got = client.responses.create(**kw, max_output_tokens=8, temperature=0)
    assert got.output_text == ref.output_text and got.status == ref.status
    assert got.usage.input_tokens == ref.usage.input_tokens
    with client.responses.stream(**kw, max_output_tokens=8, temperature=0) as events:
        deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
        final = events.get_final_response()
    assert "".join(deltas) == final.output_text == ref.output_text
    # the decode worker keeps the Response: a follow-up runs whole there, as the conversation sent
    # whole runs on any worker
    follow = client.responses.create(
        model="qwen20",
        previous_response_id=got.id,
        input="And wolves?",
        max_output_tokens=8,
        temperature=0,
    )
    history = [{"role": "user", "content": "Tell me about foxes"}]
    history += [item.model_dump(exclude_none=True) for item in got.output]
    whole = ref_client.responses.create(
        model="qwen20",
        input=[*history, {"role": "user", "content": "And wolves?"}],
        max_output_tokens=8,
        temperature=0,
    )
    assert follow.output_text == whole.output_text
    assert follow.usage.input_tokens == whole.usage.input_tokens
    assert client.responses.retrieve(follow.id).output_text == follow.output_text
    # a streamed background Response runs whole on a decode worker; its stream resumes there
    with client.responses.create(
        **kw, max_output_tokens=8, temperature=0, background=True, stream=True
    ) as stream:
        first = [e for _, e in zip(range(3), stream)]
    rest = list(client.responses.retrieve(first[0].response.id, stream=True, starting_after=2))
    assert (
        rest[-1].type == "response.completed" and rest[-1].response.output_text == ref.output_text
    )
    # Logprobs do not travel through PD: the router runs such a request whole on a decode worker.
    with_logprobs = client.completions.create(
        model="qwen20", prompt="Hello", max_tokens=3, temperature=0, logprobs=1
    )
    assert len(with_logprobs.choices[0].logprobs.tokens) == 3
    # `logprobs: 0` too (the sampled tokens' own logprobs): it was sent through PD and refused
    zero = client.completions.create(
        model="qwen20", prompt="Hello", max_tokens=3, temperature=0, logprobs=0
    )
    assert (
        zero.choices[0].logprobs.token_logprobs[:1]
        == with_logprobs.choices[0].logprobs.token_logprobs[:1]
    )
    wait_blocks_zero(prefill.url)
    wait_blocks_zero(decode.url)


def test_a_length_hint_prices_a_pd_request_and_is_measured_on_the_prefill(
    router: PlaserveProcess,
) -> None:
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0)
    hint = 'plaserve_router_priced_prompt_tokens_total{method="hint"}'
    before = httpx.get(router.url + "/metrics", timeout=10).text
    out = client.completions.create(
        model="qwen20", prompt=list(range(3, 23)), max_tokens=2, extra_headers={HEADER: "40"}
    )
    assert out.usage.prompt_tokens == 20
    after = httpx.get(router.url + "/metrics", timeout=10).text
    assert metric(after, hint) == metric(before, hint) + 40
    # The hint said twice the prompt: +1.0, in the le="1.0" bucket and not the le="0.5" one.
    error = "plaserve_router_length_hint_relative_error_bucket"
    grew = {
        le: metric(after, f'{error}{{le="{le}"}}') - metric(before, f'{error}{{le="{le}"}}')
        for le in ("0.5", "1.0")
    }
    assert grew == {"0.5": 0, "1.0": 1}


def test_client_gone_mid_stream_frees_blocks_on_both_sides(
    prefill: Endpoint, decode: Endpoint, router: PlaserveProcess
) -> None:
    body = {"prompt": LONG, "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # the first token: then hang up
    wait_blocks_zero(decode.url)
    wait_blocks_zero(prefill.url)


class KillingTap:
    """A plain HTTP forwarder in front of a worker that kills the worker (SIGKILL) right after
    forwarding its first answer to a prefill (``do_remote_decode``): the router then holds
    ``kv_transfer_params`` naming a worker that is gone."""

    def __init__(self, target: PlaserveProcess) -> None:
        self.target = target
        self.killed = threading.Event()
        tap = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _forward(self, method: str) -> None:
                length = int(self.headers.get("content-length") or 0)
                data = self.rfile.read(length) if length else b""
                try:
                    r = httpx.request(
                        method,
                        target.url + self.path,
                        content=data,
                        timeout=60,
                        headers={"content-type": "application/json"},
                    )
                    status, body = r.status_code, r.content
                except httpx.HTTPError:
                    status, body = 502, b'{"error": {"message": "gone"}}'
                if method == "POST" and b"do_remote_decode" in data and status == 200:
                    target.proc.kill()  # answered: now the KV it parked is gone with it
                    target.proc.wait()
                    tap.killed.set()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                self._forward("GET")

            def do_POST(self) -> None:
                self._forward("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "KillingTap":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_prefill_worker_killed_after_answering_reruns_the_prefill(
    workers: dict[str, PlaserveProcess], prefill: Endpoint, decode: Endpoint
) -> None:
    doomed = workers["doomed_prefill"]
    body = {"prompt": LONG + " once more", "max_tokens": 6, "temperature": 0}
    ref = texts("/v1/completions", post(prefill.url, "/v1/completions", body).json())
    with KillingTap(doomed) as tap:
        # Round robin, the tapped worker first: the first request's prefill runs there.
        with pd_router([tap.url, prefill.url], [decode.url], "--policy", "round_robin") as router:
            r = post(router.url, "/v1/completions", body)
            assert tap.killed.is_set()
            assert r.status_code == 200, r.text
            assert texts("/v1/completions", r.json()) == ref
            metrics = httpx.get(router.url + "/metrics", timeout=10).text
            assert any(
                line.startswith("plaserve_router_retries_total") and float(line.split()[-1]) >= 1
                for line in metrics.splitlines()
            ), metrics
    wait_blocks_zero(prefill.url)
    wait_blocks_zero(decode.url)


def test_decode_worker_killed_mid_stream_ends_with_an_error_event(
    workers: dict[str, PlaserveProcess], prefill: Endpoint
) -> None:
    doomed_decode = workers["doomed_decode"]
    with pd_router([prefill.url], [doomed_decode.url]) as router:
        body = {"prompt": "Tell a very long story", "max_tokens": 900, "temperature": 0}
        events = []
        with httpx.stream(
            "POST", router.url + "/v1/completions", json={**body, "stream": True}, timeout=60
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 3:
                    doomed_decode.proc.kill()
        assert events[-1] == "[DONE]"
        assert "error" in json.loads(events[-2]), events[-3:]
    # The prefill worker's blocks were pulled before the decode worker died.
    wait_blocks_zero(prefill.url)
