"""OpenAI's Responses API through the router: priced by its conversation, streamed on at the first
text, the worker's answer passed on unchanged; a Response that continues a kept one sent to the worker
that keeps it, and kept ones read and deleted there."""

from __future__ import annotations

import time

import anthropic
import httpx
import openai
import pytest

from plaserve.launcher import RouterProcess, ServerProcess, running

KW = {
    "instructions": "Answer briefly.",
    "input": "Hello world! How are you today?",
    "max_output_tokens": 8,
    "temperature": 1.0,
    "extra_body": {"seed": 11, "ignore_eos": True},
}


WORKER_ARGS = ["--kv-cache-memory", "16MiB", "--no-compile"]


@pytest.fixture(scope="module")
def workers_and_router(qwen2_ckpt: str):
    with (
        running(
            ServerProcess([qwen2_ckpt, *WORKER_ARGS]), ServerProcess([qwen2_ckpt, *WORKER_ARGS])
        ) as (worker, other),
        RouterProcess([worker.url, other.url]) as router,
    ):
        yield [worker, other], router


@pytest.fixture(scope="module")
def worker_and_router(workers_and_router):
    workers, router = workers_and_router
    return workers[0], router


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


def test_kept_responses_are_found_on_the_worker_that_keeps_them(workers_and_router) -> None:
    """Two workers: each follow-up (``previous_response_id``) and each read of a kept Response goes to
    the worker whose store holds it, which the id's prefix names (the workers' ``/load``)."""
    workers, router = workers_and_router
    routed = _client(router.url)
    model = routed.models.list().data[0].id
    kw = {"model": model, "max_output_tokens": 4, "extra_body": {"seed": 3, "ignore_eos": True}}
    prefixes = {httpx.get(f"{w.url}/load").json()["responses"]["id_prefix"] for w in workers}
    assert len(prefixes) == 2
    chains = []
    for i in range(4):  # conversations begun on each worker, continued through the router
        resp = _client(workers[i % 2].url).responses.create(input=f"conversation {i}", **kw)
        for turn in range(3):
            resp = routed.responses.create(previous_response_id=resp.id, input=f"turn {turn}", **kw)
        chains.append(resp)
    holders = {next(p for p in prefixes if r.id.startswith(p)) for r in chains}
    for resp in chains:
        assert routed.responses.retrieve(resp.id).output_text == resp.output_text
        items = routed.responses.input_items.list(resp.id, order="asc").data
        assert len(items) == 7 and items[0].content[0].text.startswith("conversation")
        routed.responses.delete(resp.id)
        with pytest.raises(openai.NotFoundError):
            routed.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):  # an id no worker's prefix names
        routed.responses.retrieve("resp_unknown")
    # a background Response: polled and cancelled through the router, on the worker that has it
    queued = routed.responses.create(input="story", background=True, **kw)
    assert queued.status in ("queued", "in_progress")
    long = routed.responses.create(
        input="long", background=True, **(kw | {"max_output_tokens": 2000})
    )
    assert routed.responses.cancel(long.id).status == "cancelled"
    for _ in range(600):
        polled = routed.responses.retrieve(queued.id)
        if polled.status not in ("queued", "in_progress"):
            break
        time.sleep(0.05)
    assert polled.status == "incomplete" and polled.usage.output_tokens == 4
    # a streamed one: its client goes after a few events, and the rest is resumed through the router
    streamed = routed.responses.create(
        input="streamed", background=True, stream=True, **(kw | {"max_output_tokens": 300})
    )
    with streamed:
        first = [e for _, e in zip(range(4), streamed)]
    rid = first[0].response.id
    rest = list(routed.responses.retrieve(rid, stream=True, starting_after=3))
    assert [e.sequence_number for e in first + rest] == list(range(len(first + rest)))
    assert rest[-1].type == "response.completed" and rest[-1].response.usage.output_tokens == 300
    holder = next(
        w
        for w in workers
        if rid.startswith(httpx.get(f"{w.url}/load").json()["responses"]["id_prefix"])
    )
    again = list(_client(holder.url).responses.retrieve(rid, stream=True, starting_after=3))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in rest]
    assert holders == prefixes


def test_anthropic_messages_through_the_router_are_the_worker_answers(worker_and_router) -> None:
    """Anthropic's Messages API through the router: priced by its conversation, the stream passed on
    from its first ``content_block_delta``, the token count answered by a worker."""
    worker, router = worker_and_router
    model = _client(worker.url).models.list().data[0].id
    direct = anthropic.Anthropic(base_url=worker.url, api_key="x", max_retries=0, timeout=60)
    routed = anthropic.Anthropic(base_url=router.url, api_key="x", max_retries=0, timeout=60)
    kw = {
        "model": model,
        "system": "Answer briefly.",
        "messages": [{"role": "user", "content": "Hello world! How are you today?"}],
        "max_tokens": 8,
        "extra_body": {"temperature": 1.0, "seed": 11, "ignore_eos": True},
    }
    want = direct.messages.create(**kw)
    got = routed.messages.create(**kw)
    assert got.content[0].text == want.content[0].text and got.stop_reason == "max_tokens"
    with routed.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert final.content[0].text == want.content[0].text and kinds[-1] == "message_stop"
    count = routed.messages.count_tokens(model=model, system=kw["system"], messages=kw["messages"])
    assert count.input_tokens == want.usage.input_tokens
    metrics = httpx.get(f"{router.url}/metrics").text
    assert 'plaserve_router_requests_total{route="/v1/messages",status="200"} 2.0' in metrics
