"""Kept Responses (``server/response_store.py``) on a live server, through the official ``openai``
client: ``previous_response_id`` continues a conversation exactly as sending it whole does,
``GET``/``DELETE /v1/responses/{id}`` and its input items; and the store's bound (an agent loop
continued by ``previous_response_id`` is in test_structured.py, whose server has a tool template)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from plaserve.launcher import ServerProcess
from plaserve.server.response_store import ResponseStore

from .conftest import BASE_ARGS

SEED = {
    "seed": 5,
    "ignore_eos": True,
}  # sampled: the tiny checkpoint's greedy chat is special tokens


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _ask(client: openai.OpenAI, **kw: object):
    kw = {"max_output_tokens": 6, **kw}
    return client.responses.create(model=_model(client), temperature=1.0, extra_body=SEED, **kw)


def _as_input(items: list) -> list[dict]:
    """Output items as a client sends them back in ``input``."""
    return [item.model_dump(exclude_none=True) for item in items]


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI) -> None:
    first = _ask(client, instructions="Be brief.", input="Tell me about foxes")
    assert first.store is True and first.previous_response_id is None
    second = _ask(client, previous_response_id=first.id, input="And about wolves?")
    assert second.previous_response_id == first.id
    # the same conversation sent whole; the first turn's instructions are not carried (as OpenAI)
    whole = _ask(
        client,
        input=[
            {"role": "user", "content": "Tell me about foxes"},
            *_as_input(first.output),
            {"role": "user", "content": "And about wolves?"},
        ],
    )
    assert second.output_text == whole.output_text
    assert second.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    # a third turn continues the second, which holds the first
    third = _ask(client, previous_response_id=second.id, input="Which is larger?")
    items = client.responses.input_items.list(third.id, order="asc").data
    assert [(i.type, i.role) for i in items] == [
        ("message", r) for r in ["user", "assistant"] * 2
    ] + [("message", "user")]


def test_kept_responses_are_retrieved_listed_and_deleted(client: openai.OpenAI) -> None:
    resp = _ask(client, input=[{"role": "user", "content": f"turn {i}"} for i in range(5)])
    assert client.responses.retrieve(resp.id).model_dump() == resp.model_dump()
    with client.responses.stream(
        model=_model(client), input="streamed", max_output_tokens=4, extra_body=SEED
    ) as events:
        streamed = events.get_final_response()
    assert streamed.store and client.responses.retrieve(streamed.id).output_text == (
        streamed.output_text
    )
    # input items: newest first by default; limit, order and after page through them
    page = client.responses.input_items.list(resp.id, limit=2)
    assert [i.content[0].text for i in page.data] == ["turn 4", "turn 3"] and page.has_more
    rest = client.responses.input_items.list(resp.id, limit=10, after=page.last_id)
    assert [i.content[0].text for i in rest.data] == ["turn 2", "turn 1", "turn 0"]
    assert not rest.has_more
    asc = client.responses.input_items.list(resp.id, order="asc", limit=1)
    assert asc.data[0].content[0].text == "turn 0" and asc.first_id == asc.last_id
    with pytest.raises(openai.BadRequestError):
        client.responses.input_items.list(resp.id, limit=0)
    # deleted: gone for GET and for previous_response_id
    client.responses.delete(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(resp.id)
    with pytest.raises(openai.BadRequestError) as info:
        _ask(client, previous_response_id=resp.id, input="more")
    assert info.value.body["code"] == "previous_response_not_found"
    assert info.value.body["param"] == "previous_response_id"


def test_store_false_keeps_nothing(client: openai.OpenAI, server: ServerProcess) -> None:
    before = httpx.get(f"{server.url}/load").json()["responses"]
    resp = _ask(client, input="not kept", store=False)
    assert resp.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(resp.id)
    after = httpx.get(f"{server.url}/load").json()["responses"]
    assert after["stored"] == before["stored"] and resp.id.startswith(after["id_prefix"])
    metrics = httpx.get(f"{server.url}/metrics").text  # the engine's metrics and the store's
    assert f"plaserve_response_store_responses {float(after['stored'])}" in metrics
    assert f"plaserve_response_store_bytes {float(after['bytes'])}" in metrics
    assert "plaserve_response_store_evictions_total 0.0" in metrics
    assert "plaserve_kv_blocks_used" in metrics
    for bad in ({"store": "yes"}, {"previous_response_id": 3}):
        r = httpx.post(f"{server.url}/v1/responses", json={"input": "x", **bad})
        assert r.status_code == 422 and r.json()["error"]["param"] == next(iter(bad))


def test_a_server_that_keeps_nothing(qwen2_ckpt: str) -> None:
    with ServerProcess([qwen2_ckpt, *BASE_ARGS, "--response-store-mib", "0"]) as proc:
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="x", max_retries=0)
        resp = _ask(client, input="hello")
        assert resp.store is False
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(resp.id)
        with pytest.raises(openai.BadRequestError) as info:
            _ask(client, previous_response_id=resp.id, input="more")
        assert "--response-store-mib 0" in info.value.body["message"]
        assert httpx.get(f"{proc.url}/load").json()["responses"]["max_bytes"] == 0


def _response(rid: str, text: str) -> dict:
    return {"id": rid, "output": [{"type": "message", "role": "assistant", "content": text}]}


def test_the_store_forgets_the_least_recently_used_within_its_bound() -> None:
    one = _response("resp_a", "x" * 100)
    size = ResponseStore(10**6)
    assert size.put(one, [])
    per = size.bytes  # one entry's JSON size
    store = ResponseStore(3 * per)
    for rid in ("resp_a", "resp_b", "resp_c"):
        assert store.put(_response(rid, "x" * 100), [])
    assert store.get("resp_a") is not None  # now the most recently used
    assert store.put(_response("resp_d", "x" * 100), [])
    assert store.get("resp_b") is None and store.get("resp_a") is not None
    assert store.bytes == 3 * per and store.evicted == 1
    assert not store.put(_response("resp_e", "x" * 10 * per), [])  # larger than the whole store
    assert store.describe()["stored"] == 3
    assert store.delete("resp_a") and not store.delete("resp_a") and store.bytes == 2 * per
    # put again under the same id replaces the entry
    assert store.put(_response("resp_c", "x" * 100), []) and store.bytes == 2 * per
    conversation = store.get("resp_c").conversation()
    assert conversation == _response("resp_c", "x" * 100)["output"]
    assert ResponseStore(0).put(one, []) is False
    with pytest.raises(ValueError):
        ResponseStore(-1)


def _poll(client: openai.OpenAI, rid: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while True:
        resp = client.responses.retrieve(rid)
        if resp.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return resp
        time.sleep(0.05)


def test_a_background_response_is_polled_to_the_answer_it_would_have_given(
    client: openai.OpenAI,
) -> None:
    kw = {"input": "Tell me a story", "max_output_tokens": 12}
    want = _ask(client, **kw)
    queued = _ask(client, background=True, **kw)
    assert queued.background is True and queued.status in ("queued", "in_progress")
    assert queued.output == []
    got = _poll(client, queued.id)
    assert got.status == "incomplete" and got.output_text == want.output_text
    assert got.usage.output_tokens == 12 and got.background is True
    # cancelling a finished one gives it back as it is
    assert client.responses.cancel(queued.id).status == "incomplete"
    # it is kept like any other: a follow-up continues it
    follow = _ask(client, previous_response_id=queued.id, input="Go on")
    assert follow.status == "incomplete"


def test_a_background_response_is_cancelled_and_frees_its_blocks(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    long = _ask(client, input="Write for a long time", max_output_tokens=2000, background=True)
    time.sleep(0.3)  # under way
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    deadline = time.monotonic() + 10
    while (
        httpx.get(f"{server.url}/load").json()["kv"]["used_blocks"] and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert httpx.get(f"{server.url}/load").json()["kv"]["used_blocks"] == 0
    # deleted while it runs: stopped, and gone for good
    other = _ask(client, input="Again", max_output_tokens=2000, background=True)
    client.responses.delete(other.id)
    time.sleep(0.2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(other.id)
    with pytest.raises(openai.BadRequestError):  # a synchronous Response cannot be cancelled
        client.responses.cancel(_ask(client, input="now").id)
    r = httpx.post(
        f"{server.url}/v1/responses", json={"input": "x", "background": True, "store": False}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "background"


def test_a_streamed_background_response_is_resumed_after_any_event(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    """``background`` with ``stream``: the events stream as a plain stream's (``response.created``
    saying ``queued``), and ``GET ...?stream=true&starting_after=N`` gives the same events after N,
    once it ended too; only such a Response streams again."""
    kw = {"input": "Tell me a story", "max_output_tokens": 12}
    want = _ask(client, **kw)
    stream = _ask(client, background=True, stream=True, **kw)
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created" and events[0].response.status == "queued"
    assert events[1].type == "response.in_progress" and events[-1].type == "response.completed"
    done = events[-1].response
    assert done.background and done.output_text == want.output_text
    assert done.usage.output_tokens == 12
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == (
        want.output_text
    )
    kept = client.responses.retrieve(done.id)
    assert kept.status == "incomplete" and kept.output_text == want.output_text
    for after in (-1, 0, 5, len(events) - 2, len(events) - 1):
        again = list(client.responses.retrieve(done.id, stream=True, starting_after=after))
        assert [e.model_dump() for e in again] == [e.model_dump() for e in events[after + 1 :]]
    # streamed again only where there is a stream: not a whole or polled background Response
    polled = _ask(client, background=True, **kw)
    for rid in (want.id, polled.id):
        r = httpx.get(f"{server.url}/v1/responses/{rid}", params={"stream": "true"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    for bad in ("x", "-2", "1.5"):
        r = httpx.get(
            f"{server.url}/v1/responses/{done.id}", params={"stream": "true", "starting_after": bad}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "starting_after"


def test_a_streamed_background_response_outlives_its_client(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    """The client that asked goes away mid-stream: the Response goes on, and a reader resuming after
    the last event it had follows it live to its end; a cancel ends every reader's stream."""
    kw = {"input": "Write at length", "max_output_tokens": 400}
    first: list = []
    with _ask(client, background=True, stream=True, **kw) as stream:
        for event in stream:
            first.append(event)
            if len(first) == 6:
                break  # the connection closes here
    rid = first[0].response.id
    assert client.responses.retrieve(rid).status == "in_progress"
    rest = list(client.responses.retrieve(rid, stream=True, starting_after=5))
    assert rest[0].sequence_number == 6 and rest[-1].type == "response.completed"
    deltas = [e.delta for e in first + rest if e.type == "response.output_text.delta"]
    final = rest[-1].response
    assert "".join(deltas) == final.output_text and final.usage.output_tokens == 400
    assert client.responses.retrieve(rid).output_text == final.output_text
    # cancelled while two readers follow it: both streams end, its blocks are freed
    long = _ask(client, background=True, stream=True, **(kw | {"max_output_tokens": 2000}))
    opened = next(iter(long))
    reader = client.responses.retrieve(opened.response.id, stream=True, starting_after=0)
    next(iter(reader))
    assert client.responses.cancel(opened.response.id).status == "cancelled"
    for s in (long, reader):
        assert all(e.type != "response.completed" for e in s)  # ends, without completing
    assert client.responses.retrieve(opened.response.id).status == "cancelled"
    deadline = time.monotonic() + 10
    while (
        httpx.get(f"{server.url}/load").json()["kv"]["used_blocks"] and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    assert httpx.get(f"{server.url}/load").json()["kv"]["used_blocks"] == 0


def test_a_running_background_response_is_kept_whatever_the_bound_until_it_ends() -> None:
    per = len(json.dumps(_response("resp_a", "x" * 100), separators=(",", ":"))) + 2
    store = ResponseStore(2 * per)
    assert store.put(_response("resp_run", "x" * 100), [], running=True)
    for rid in ("resp_a", "resp_b", "resp_c"):  # finished ones push each other out, not it
        store.put(_response(rid, "x" * 100), [])
    assert store.get("resp_run") is not None and store.get("resp_a") is None
    assert store.describe()["running"] == 1 and store.bytes <= 3 * per
    # it ends: now it is one of the others, the least recently used first out
    assert store.put(_response("resp_run", "x" * 100), [])
    store.put(_response("resp_d", "x" * 100), [])
    assert store.get("resp_run") is None and store.describe()["running"] == 0
    # one that ends larger than the whole store is not kept at all, its running entry included
    store.put(_response("resp_big", "x"), [], running=True)
    assert not store.put(_response("resp_big", "x" * 10 * per), [])
    assert store.get("resp_big") is None and store.bytes <= 2 * per


def test_an_event_log_is_followed_by_every_reader_and_replayed_from_its_text() -> None:
    import asyncio

    from plaserve.server.response_store import EventLog

    def event(n: int) -> str:
        return f'event: e\ndata: {{"sequence_number":{n},"text":"a\\nb"}}\n\n'

    async def run() -> tuple[list[str], list[str], list[str]]:
        log = EventLog()
        log.append(event(0))

        async def read(after: int) -> list[str]:
            return [e async for e in log.follow(after)]

        early, late = asyncio.ensure_future(read(-1)), asyncio.ensure_future(read(1))
        for n in range(1, 4):
            await asyncio.sleep(0)  # the readers wait between events
            log.append(event(n))
        log.close()
        return await early, await late, [e async for e in EventLog.replay(log.text).follow(2)]

    early, late, replayed = asyncio.run(run())
    assert early == [event(n) for n in range(4)]
    assert late == [event(2), event(3)] and replayed == [event(3)]
    store = ResponseStore(10**6)
    store.put(_response("resp_a", "x"), [])
    plain = store.bytes
    store.put(_response("resp_a", "x"), [], events=event(0))  # the events count against the bound
    assert store.bytes == plain + len(event(0)) and store.get("resp_a").events == event(0)
