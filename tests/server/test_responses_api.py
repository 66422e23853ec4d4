"""OpenAI's Responses API (``POST /v1/responses``) of a live server, through the official ``openai``
client: the answer is the chat endpoint's for the same messages and sampling, whole or streamed."""

from __future__ import annotations

import httpx
import openai
import pytest

INSTRUCTIONS = "Answer briefly."
QUESTION = "Hello world! How are you today?"
# Sampled with a seed (vLLM's extension, on both endpoints): the tiny random checkpoint's greedy chat
# answer is special tokens only, which leave no text.
SAMPLED = {"temperature": 1.0}
SEED = 7


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _chat(client: openai.OpenAI, max_tokens: int, **extra: object):
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": QUESTION},
    ]
    return client.chat.completions.create(
        model=_model(client),
        messages=messages,
        max_tokens=max_tokens,
        extra_body={"seed": SEED, **extra},
        **SAMPLED,
    )


def _respond(client: openai.OpenAI, max_tokens: int, **extra: object):
    return client.responses.create(
        model=_model(client),
        instructions=INSTRUCTIONS,
        input=QUESTION,
        max_output_tokens=max_tokens,
        extra_body={"seed": SEED, **extra},
        **SAMPLED,
    )


def test_response_is_the_chat_answer_cut_at_max_output_tokens(client: openai.OpenAI) -> None:
    chat = _chat(client, 12, ignore_eos=True)
    # bookkeeping and unknown fields are ignored, as on the other endpoints
    resp = _respond(client, 12, ignore_eos=True, store=True, user="u1", a_future_field=1)
    assert chat.choices[0].finish_reason == "length"
    assert resp.output_text == chat.choices[0].message.content
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    assert resp.id.startswith("resp_") and resp.object == "response"
    (message,) = resp.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "incomplete"
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens == chat.usage.completion_tokens == 12
    assert resp.usage.total_tokens == chat.usage.total_tokens
    assert resp.instructions == INSTRUCTIONS and resp.max_output_tokens == 12


def test_response_stopped_by_a_stop_string_is_completed(client: openai.OpenAI) -> None:
    text = _chat(client, 12, ignore_eos=True).choices[0].message.content
    assert len(text) >= 5
    stop = [text[3:5]]  # the greedy answer holds it: both endpoints stop there
    chat = _chat(client, 12, ignore_eos=True, stop=stop)
    resp = _respond(client, 12, ignore_eos=True, stop=stop)
    assert chat.choices[0].finish_reason == "stop"
    assert resp.status == "completed" and resp.incomplete_details is None
    assert resp.output_text == chat.choices[0].message.content
    assert resp.output[0].status == "completed"


def test_streamed_response_events(client: openai.OpenAI) -> None:
    whole = _respond(client, 12, ignore_eos=True)
    parts = [{"type": "input_text", "text": QUESTION}]
    with client.responses.stream(
        model=_model(client),
        instructions=INSTRUCTIONS,
        input=[{"role": "user", "content": parts}],  # the same question as message parts
        max_output_tokens=12,
        extra_body={"ignore_eos": True, "seed": SEED},
        **SAMPLED,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == whole.output_text
    assert final.status == "incomplete" and final.usage.output_tokens == 12
    assert events[0].response.id == final.id


@pytest.mark.parametrize(
    "field, value",
    [
        ("tools", [{"type": "web_search"}]),
        ("previous_response_id", "resp_0"),
        ("conversation", "conv_1"),
        ("input", [{"type": "reasoning", "summary": []}]),
        ("input", [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]),
    ],
)
def test_what_is_not_served_is_a_400_naming_it(
    client: openai.OpenAI, field: str, value: object
) -> None:
    kw = {"model": _model(client), "input": "hi", field: value}
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(**kw)
    assert info.value.body["param"].startswith(field)


def test_settings_are_echoed_and_nan_in_them_is_null(server) -> None:
    """The Response echoes the request's ``text`` and ``metadata`` (as OpenAI's does); a NaN in a part
    of ``text`` nothing reads comes back null, not as a 500 (JSON has no NaN)."""
    body = (
        '{"input": "hi", "max_output_tokens": 2, "metadata": {"k": "v"},'
        ' "text": {"format": {"type": "text"}, "verbosity": NaN}}'
    )
    resp = httpx.post(
        f"{server.url}/v1/responses", content=body, headers={"content-type": "application/json"}
    )
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["text"] == {"format": {"type": "text"}, "verbosity": None}
    assert answer["metadata"] == {"k": "v"}
