"""Anthropic's Messages API (``POST /v1/messages``, ``/v1/messages/count_tokens``) of a live server,
through the official ``anthropic`` client: the answer is the chat endpoint's for the same
conversation and sampling, whole or streamed; tool use both ways; errors in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from plaserve.config import EngineConfig

from .test_structured import SERVER_ARGS  # noqa: F401 - the same server: a tool template, hermes
from .test_tools import TOOLS

SYSTEM = "Answer briefly."
QUESTION = "Hello world! How are you today?"
SAMPLED = {
    "temperature": 1.0,
    "seed": 7,
    "ignore_eos": True,
}  # the tiny model's greedy chat is empty
ANTHROPIC_TOOLS = [
    {"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
    | ({"description": t["function"]["description"]} if "description" in t["function"] else {})
    for t in TOOLS
]


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _ask(claude: anthropic.Anthropic, model: str, max_tokens: int, **kw: object):
    extra = kw.pop("extra_body", SAMPLED)
    return claude.messages.create(
        model=model,
        system=SYSTEM,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=max_tokens,
        extra_body=extra,
        **kw,
    )


def _chat(client: openai.OpenAI, max_tokens: int, **kw: object):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    return client.chat.completions.create(
        model=_model(client),
        messages=messages,
        max_tokens=max_tokens,
        temperature=1.0,
        extra_body={"seed": 7, "ignore_eos": True},
        **kw,
    )


def test_message_is_the_chat_answer_whole_and_streamed(claude, client) -> None:
    model = _model(client)
    chat = _chat(client, 10)
    msg = _ask(claude, model, 10)
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    (block,) = msg.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.input_tokens == chat.usage.prompt_tokens
    assert msg.usage.output_tokens == chat.usage.completion_tokens == 10
    with claude.messages.stream(
        model=model,
        system=SYSTEM,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=10,
        extra_body=SAMPLED,
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert final.content[0].text == block.text and final.stop_reason == "max_tokens"
    assert final.usage.input_tokens == msg.usage.input_tokens and final.usage.output_tokens == 10
    # count_tokens: the prompt the same request is given
    count = claude.messages.count_tokens(
        model=model, system=SYSTEM, messages=[{"role": "user", "content": QUESTION}]
    )
    assert count.input_tokens == msg.usage.input_tokens


def test_thinking_is_accepted_and_changes_nothing(claude, client) -> None:
    """As on vLLM serving a model without a reasoning parser: ``thinking`` asks for nothing this
    model does; a thinking block an earlier answer carried back is left out of the prompt."""
    model = _model(client)
    plain = _ask(claude, model, 6)
    thinking = {"type": "enabled", "budget_tokens": 1024}
    asked = _ask(claude, model, 6, thinking=thinking)
    assert [b.type for b in asked.content] == ["text"]
    assert asked.content[0].text == plain.content[0].text
    back = [
        {"role": "user", "content": "Hi"},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "hmm", "signature": "x"},
                {"type": "text", "text": "Hello"},
            ],
        },
        {"role": "user", "content": QUESTION},
    ]
    without = [back[0], {"role": "assistant", "content": "Hello"}, back[2]]
    counts = [
        claude.messages.count_tokens(model=model, messages=m).input_tokens for m in (back, without)
    ]
    assert counts[0] == counts[1]


def test_a_stop_sequence_is_named(claude, client) -> None:
    model = _model(client)
    full = _ask(claude, model, 24).content[0].text
    middle = len(full) // 2
    cut = full[middle : middle + 3]  # a piece of the answer: it stops before its first occurrence
    assert cut.strip() and full.index(cut) > 0
    msg = _ask(claude, model, 24, stop_sequences=[cut])
    chat = _chat(client, 24, stop=[cut])
    assert msg.content[0].text == chat.choices[0].message.content == full[: full.index(cut)]
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == cut


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_use_is_chats_call(claude, client, stream: bool) -> None:
    """A named tool (``tool_choice: tool``) and ``any``: the calls chat makes for the same seed, as
    ``tool_use`` blocks; streamed, the input in ``input_json_delta`` pieces."""
    model = _model(client)
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=ANTHROPIC_TOOLS,
        max_tokens=300,
        extra_body={"seed": 1},
    )
    for choice, chat_choice in [
        (
            {"type": "tool", "name": "get_time"},
            {"type": "function", "function": {"name": "get_time"}},
        ),
        ({"type": "any", "disable_parallel_tool_use": True}, "required"),
    ]:
        if stream:
            with claude.messages.stream(tool_choice=choice, **kw) as events:
                seen = list(events)
                msg = events.get_final_message()
            pieces = [
                e.delta.partial_json
                for e in seen
                if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
            ]
            assert len(pieces) > 1 and json.loads("".join(pieces)) == msg.content[-1].input
        else:
            msg = claude.messages.create(tool_choice=choice, **kw)
        chat = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "What time is it?"}],
            tools=TOOLS,
            tool_choice=chat_choice,
            parallel_tool_calls=False,
            max_tokens=300,
            seed=1,
        )
        uses = [b for b in msg.content if b.type == "tool_use"]
        want = chat.choices[0].message.tool_calls
        assert [(u.name, u.input) for u in uses] == [
            (w.function.name, json.loads(w.function.arguments)) for w in want
        ]
        assert msg.stop_reason == "tool_use" and uses[0].id


def test_a_tool_result_continues_as_chats_history(claude, client) -> None:
    """``tool_use`` in the assistant's turn and ``tool_result`` in the next user turn: the prompt is
    chat's for the same history (same answer, same token count)."""
    model = _model(client)
    args = {"city": "oslo"}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": args},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": '{"temp": -3}'},
                {"type": "text", "text": "And now?"},
            ],
        },
    ]
    msg = claude.messages.create(
        model=model,
        messages=messages,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "none"},
        max_tokens=8,
        extra_body={"seed": 2, "ignore_eos": True},
    )
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": json.dumps(args)}
    chat = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": -3}'},
            {"role": "user", "content": "And now?"},
        ],
        tools=TOOLS,
        tool_choice="none",
        max_tokens=8,
        seed=2,
        extra_body={"ignore_eos": True},
    )
    assert msg.content[0].text == chat.choices[0].message.content
    assert msg.usage.input_tokens == chat.usage.prompt_tokens
    # token for token: chat found all of the Messages prompt but its last partial block cached (the
    # tools in another key order were as many tokens, and a different prompt)
    cached = chat.usage.prompt_tokens_details.cached_tokens
    assert cached == chat.usage.prompt_tokens // EngineConfig.block_size * EngineConfig.block_size


@pytest.mark.parametrize(
    "body, status, words",
    [
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            400,
            "image",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": None}, 400, "max_tokens"),
        ({"messages": []}, 400, "messages"),
        (
            {
                "messages": [{"role": "user", "content": "hi"}],
                "tools": [{"type": "web_search_20250305"}],
            },
            400,
            "tools",
        ),
        ({"messages": [{"role": "user", "content": "hi"}], "model": "claude-x"}, 404, "claude-x"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ],
)
def test_errors_are_anthropics(server, body: dict, status: int, words: str) -> None:
    body = {"max_tokens": 4, **body}
    if body["max_tokens"] is None:
        del body["max_tokens"]
    r = httpx.post(f"{server.url}/v1/messages", json=body)
    assert r.status_code == status, r.text
    error = r.json()
    assert error["type"] == "error" and words in error["error"]["message"]
    assert error["error"]["type"] == (
        "not_found_error" if status == 404 else "invalid_request_error"
    )
    bad_json = httpx.post(
        f"{server.url}/v1/messages", content=b"{", headers={"content-type": "application/json"}
    )
    assert bad_json.status_code == 400 and bad_json.json()["type"] == "error"


def test_output_config_format_is_a_json_schema_answer(claude, client) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    msg = claude.messages.create(
        model=_model(client),
        messages=[{"role": "user", "content": "Is it fine?"}],
        max_tokens=40,
        extra_body={"output_config": {"format": {"type": "json_schema", "schema": schema}}},
    )
    assert isinstance(json.loads(msg.content[0].text)["ok"], bool)
