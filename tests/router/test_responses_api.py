"""OpenAI's Responses API through the router: priced by its conversation, streamed on at the first
text, the worker's answer passed on unchanged."""

from __future__ import annotations

import httpx
import openai
import pytest

from plaserve.launcher import RouterProcess, ServerProcess

KW = {
    "instructions": "Answer briefly.",
    "input": "Hello world! How are you today?",
    "max_output_tokens": 8,
    "temperature": 1.0,
    "extra_body": {"seed": 11, "ignore_eos": True},
}


@pytest.fixture(scope="module")
def worker_and_router(qwen2_ckpt: str):
    with (
        ServerProcess([qwen2_ckpt, "--kv-cache-memory", "16MiB", "--no-compile"]) as worker,
        RouterProcess([worker.url]) as router,
    ):
        yield worker, router


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_responses_through_the_router_are_the_worker_answers(worker_and_router) -> None:
    worker, router = worker_and_router
    direct, routed = _client(worker.url), _client(router.url)
    model = direct.models.list().data[0].id
    want = direct.responses.create(model=model, **KW)
    got = routed.responses.create(model=model, **KW)
    assert got.output_text == want.output_text and got.status == want.status == "incomplete"
    assert got.usage.input_tokens == want.usage.input_tokens
    with routed.responses.stream(model=model, **KW) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert final.output_text == want.output_text and kinds[-1] == "response.completed"
    # priced by the worker's /tokenize of the conversation (the router has no tokenizer here)
    metrics = httpx.get(f"{router.url}/metrics").text
    assert 'plaserve_router_requests_total{route="/v1/responses",status="200"} 2.0' in metrics
    assert 'method="worker"' in metrics
