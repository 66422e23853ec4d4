"""Length hints (``x-prompt-tokens``) from a trusted gateway: who is trusted, what a hint looks like,
and, through a real ``plaserve route`` process in front of a real ``plaserve serve`` worker, that a
trusted hint prices the request, an untrusted one is ignored, and a wrong one shows in the error
histogram once the worker's ``usage.prompt_tokens`` is in."""

from __future__ import annotations

import argparse
import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from plaserve.launcher import RouterProcess, ServerProcess
from plaserve.router.cli import add_route_arguments, router_config_from_args
from plaserve.router.hints import (
    HEADER,
    HintCheck,
    HintError,
    LengthHints,
    forwarded,
    usage_prompt_tokens,
)

from .test_proxy import metric

WORKER_ARGS = ["--kv-cache-memory", "16MiB", "--max-model-len", "512", "--policy", "fcfs"]
PROMPT = [3 + i for i in range(20)]  # 20 token ids inside the tiny checkpoint's vocabulary
GATEWAY = "127.0.0.2"  # the trusted source; the test's other client connects from 127.0.0.1


def test_only_listed_networks_are_trusted() -> None:
    hints = LengthHints.from_spec("10.0.0.0/8, 2001:db8::/32,192.168.1.7")
    assert hints.trusts("10.1.2.3") and hints.trusts("192.168.1.7") and hints.trusts("2001:db8::1")
    assert hints.trusts("::ffff:10.0.0.1")  # an IPv4 peer on a dual-stack socket
    assert not hints.trusts("192.168.1.8") and not hints.trusts(None) and not hints.trusts("x")
    assert not LengthHints().trusts("127.0.0.1")  # the default trusts no one
    with pytest.raises(ValueError, match="'10.0.0.300/8' is not a CIDR"):
        LengthHints.from_spec("10.0.0.300/8")
    # The flag of plaserve route (and cluster): off by default; a bad network stops it at parse.
    p = argparse.ArgumentParser()
    add_route_arguments(p)
    assert router_config_from_args(p.parse_args([])).length_hints == LengthHints()
    flagged = router_config_from_args(p.parse_args(["--trust-length-hints-from", "10.0.0.0/8"]))
    assert flagged.length_hints.trusts("10.9.9.9")
    with pytest.raises(SystemExit):
        p.parse_args(["--trust-length-hints-from", "10.0.0.0/33"])


def test_a_hint_is_one_count_per_prompt() -> None:
    hints, peer = LengthHints.from_spec("10.0.0.0/8"), "10.0.0.1"
    one = {"prompt": "hello"}
    assert hints.read({}, peer, one, chat=False) == ("absent", None)
    assert hints.read({HEADER: "12"}, "11.0.0.1", one, chat=False) == ("untrusted", None)
    assert hints.read({HEADER: "12"}, peer, one, chat=False) == ("used", (12,))
    two = {"prompt": ["a", [1, 2]]}
    assert hints.read({HEADER: "7, 2"}, peer, two, chat=False) == ("used", (7, 2))
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert hints.read({HEADER: "9"}, peer, chat, chat=True) == ("used", (9,))
    for bad, why in (("-3", "not a token count"), ("1e3", "not a token count"), ("7", "1 count")):
        with pytest.raises(HintError, match=f"header {HEADER}: .*{why}"):
            hints.read({HEADER: bad}, peer, two if bad == "7" else one, chat=False)
    # An untrusted peer's garbage is ignored, not refused: it is not the router's to judge.
    assert hints.read({HEADER: "garbage"}, "11.0.0.1", one, chat=False) == ("untrusted", None)
    # ... and not passed on, where a router behind this one may trust this one's address.
    sent = {"X-Prompt-Tokens": "12", "Authorization": "Bearer k"}
    assert forwarded(sent, used=False) == {"Authorization": "Bearer k"}
    assert forwarded(sent, used=True) == sent


def test_the_check_measures_against_the_answers_usage() -> None:
    seen: list[float] = []
    check = HintCheck((30, 10), seen.append)
    check.feed(b'data: {"choices": [{"text": "a"}]}\n\n')
    check.feed(b'data: {"choices": [], "usage": {"prompt_tokens": 5')  # split across chunks
    check.feed(b'0, "completion_tokens": 1}}\n\ndata: [DO')
    assert seen == []
    check.feed(b"NE]\n\n")  # measured at the end of the stream, before it is passed on
    assert seen == [pytest.approx(-0.2)]  # 40 stated, 50 prefilled
    check.done()  # once only
    assert len(seen) == 1
    assert usage_prompt_tokens(b'{"usage": {"prompt_tokens": 4}}') == 4
    # the Responses API's: in the Response, and in its stream's last event
    assert usage_prompt_tokens(b'{"object": "response", "usage": {"input_tokens": 6}}') == 6
    completed = b'data: {"type": "response.completed", "response": {"usage": {"input_tokens": 7}}}'
    created = b'data: {"type": "response.created", "response": {"usage": null}}'
    assert usage_prompt_tokens(created + b"\n\n" + completed + b"\n\n") == 7
    assert usage_prompt_tokens(b"data: [DONE]\n\n") is None  # a stream without include_usage


def test_router_prices_by_a_trusted_hint_and_measures_its_error(qwen2_ckpt: str) -> None:
    worker = ServerProcess([qwen2_ckpt, *WORKER_ARGS])
    router = RouterProcess(
        [worker.url],
        ["--trust-length-hints-from", f"{GATEWAY}/32", "--health-check-interval-secs", "0.2"],
    )
    with contextlib.ExitStack() as stack:
        # Both start at once: the router's start-up overlaps the worker's model load.
        stack.callback(worker.stop)
        stack.callback(router.stop)
        with ThreadPoolExecutor(2) as pool:
            for started in [pool.submit(worker.start), pool.submit(router.start)]:
                started.result()
        via_gateway = stack.enter_context(
            httpx.Client(transport=httpx.HTTPTransport(local_address=GATEWAY))
        )
        gateway = openai.OpenAI(
            base_url=router.url + "/v1", api_key="x", http_client=via_gateway, max_retries=0
        )
        direct = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)

        model = os.path.basename(qwen2_ckpt)  # the name plaserve serve gives the model

        def metrics() -> str:
            return httpx.get(router.url + "/metrics").text

        # A trusted hint that overstates the prompt 250 times: priced and classed by the hint.
        out = gateway.completions.create(
            model=model, prompt=PROMPT, max_tokens=2, extra_headers={HEADER: "5000"}
        )
        assert out.usage.prompt_tokens == 20
        text = metrics()
        assert metric(text, 'plaserve_router_length_estimates_total{method="hint"}') == 1
        assert metric(text, 'plaserve_router_priced_prompt_tokens_total{method="hint"}') == 5000
        assert metric(
            text, 'plaserve_router_e2e_request_latency_seconds_count{length_class="long"}'
        )
        # 249 (5000 stated, 20 prefilled): above the last bucket. (A histogram with negative
        # buckets has no _sum in prometheus_client.)
        assert metric(text, "plaserve_router_length_hint_relative_error_count") == 1
        assert metric(text, 'plaserve_router_length_hint_relative_error_bucket{le="10.0"}') == 0

        # The same header from an untrusted peer: ignored (the ids price it), and counted.
        direct.completions.create(
            model=model, prompt=PROMPT, max_tokens=2, extra_headers={HEADER: "5000"}
        )
        text = metrics()
        assert metric(text, 'plaserve_router_length_hints_total{outcome="untrusted"}') == 1
        assert metric(text, 'plaserve_router_priced_prompt_tokens_total{method="token_ids"}') == 20
        assert metric(text, 'plaserve_router_priced_prompt_tokens_total{method="hint"}') == 5000

        # A right hint on a stream with usage: measured at the stream's end, error 0.
        stream = gateway.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers={HEADER: "20"},
        )
        assert [c.usage.prompt_tokens for c in stream if c.usage] == [20]
        text = metrics()
        assert metric(text, "plaserve_router_length_hint_relative_error_count") == 2
        assert metric(text, 'plaserve_router_length_hint_relative_error_bucket{le="0.01"}') == 1
        assert metric(text, 'plaserve_router_length_hints_total{outcome="used"}') == 2

        # A trusted gateway's malformed hint: a 400 that names the header.
        with pytest.raises(openai.BadRequestError, match=HEADER):
            gateway.completions.create(
                model=model, prompt=PROMPT, max_tokens=2, extra_headers={HEADER: "twenty"}
            )
        assert metric(metrics(), 'plaserve_router_length_hints_total{outcome="malformed"}') == 1
