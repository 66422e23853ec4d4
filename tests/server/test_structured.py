"""Structured outputs and grammar-enforced tool choices against a live ``plaserve serve`` with the
official ``openai`` client. The tiny checkpoint has random weights: left alone it writes gibberish, so
every answer that parses and validates shows the masks at work.

The server runs with the tool-calling flags (``--enable-auto-tool-choice --tool-call-parser hermes``)
and ``--chat-template`` pointing at Qwen2.5's published template.
"""

from __future__ import annotations

import json
import os
import re

import httpx
import jsonschema
import openai
import pytest

TEMPLATE = os.path.join(os.path.dirname(__file__), "templates", "qwen2_5.jinja")
SERVER_ARGS = [
    "--dtype",
    "float32",  # no torch.compile at start-up: the server starts in seconds
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--chat-template",
    TEMPLATE,
]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "tags"],
}
CLOSED = PERSON | {"additionalProperties": False}  # what strict mode makes of PERSON
MESSAGES = [{"role": "user", "content": "Describe someone."}]


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _token_id(server, text: str) -> int:
    """The id of ``text``, a single token of the model's tokenizer."""
    body = {"prompt": text, "add_special_tokens": False}
    ids = httpx.post(f"{server.url}/tokenize", json=body).json()["tokens"]
    assert len(ids) == 1
    return ids[0]


def _chat(client: openai.OpenAI, stream: bool = False, **kw) -> list[tuple[str, str | None]]:
    """``(text, finish_reason)`` of each choice, streamed or not."""
    kw = {"model": _model(client), "messages": MESSAGES, "max_tokens": 300, "seed": 3} | kw
    if not stream:
        r = client.chat.completions.create(**kw)
        return [(c.message.content, c.finish_reason) for c in r.choices]
    out: dict[int, list] = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            entry = out.setdefault(c.index, ["", None])
            entry[0] += c.delta.content or ""
            entry[1] = c.finish_reason or entry[1]
    return [tuple(out[i]) for i in sorted(out)]


def _complete(client: openai.OpenAI, stream: bool = False, **kw) -> list[tuple[str, str | None]]:
    kw = {"model": _model(client), "prompt": "Hello", "max_tokens": 300, "seed": 5} | kw
    if not stream:
        r = client.completions.create(**kw)
        return [(c.text, c.finish_reason) for c in r.choices]
    out: dict[int, list] = {}
    for chunk in client.completions.create(stream=True, **kw):
        for c in chunk.choices:
            entry = out.setdefault(c.index, ["", None])
            entry[0] += c.text
            entry[1] = c.finish_reason or entry[1]
    return [tuple(out[i]) for i in sorted(out)]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_json_schema_and_json_object_on_chat(server, client: openai.OpenAI, stream: bool) -> None:
    strict = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    answers = _chat(client, stream, response_format=strict, n=2, temperature=1.0)
    answers += _chat(client, stream, extra_body={"guided_json": CLOSED}, temperature=0.8)
    answers += _chat(client, stream, extra_body={"structured_outputs": {"json": CLOSED}})
    assert len(answers) == 4
    for text, reason in answers:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    # strict: no property beyond the declared ones (the schema does not forbid them itself)
    assert all(set(json.loads(t)) == set(PERSON["properties"]) for t, _ in answers[:2])
    # Any object: random weights would write one string forever, so the bias favours the tokens
    # that close strings and objects wherever the grammar allows them (the mask comes after it).
    closing = {str(_token_id(server, c)): 8 for c in '"}'}
    answers = _chat(client, stream, response_format={"type": "json_object"}, logit_bias=closing)
    for text, reason in answers:
        assert reason == "stop" and isinstance(json.loads(text), dict), text


def test_json_schema_on_responses(client: openai.OpenAI) -> None:
    """The Responses API's ``text.format`` is chat's ``response_format``: the same grammar, the same
    answer for the same seed."""
    schema = {"name": "person", "schema": PERSON, "strict": True}
    resp = client.responses.create(
        model=_model(client),
        input=MESSAGES[0]["content"],
        text={"format": {"type": "json_schema", **schema}},
        max_output_tokens=300,
        extra_body={"seed": 3},
    )
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), PERSON)
    ((text, reason),) = _chat(
        client, response_format={"type": "json_schema", "json_schema": schema}
    )
    assert resp.output_text == text and reason == "stop"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_regex_choice_and_grammar_on_completions(client: openai.OpenAI, stream: bool) -> None:
    regex = r"[A-Z][a-z]{2,5}-[0-9]{3}"
    for text, reason in _complete(client, stream, extra_body={"guided_regex": regex}, n=3):
        assert reason == "stop" and re.fullmatch(regex, text), text
    choices = ["red", "green", "blue"]
    answers = _complete(client, stream, extra_body={"guided_choice": choices}, n=4, temperature=1.0)
    assert all(reason == "stop" and text in choices for text, reason in answers)
    gbnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "x" [0-9]'
    lark = 'start: "(" item ("," item)* ")"\nitem: /[a-c]/ | "x" /[0-9]/'
    for grammar in (gbnf, lark):
        for text, reason in _complete(client, stream, extra_body={"guided_grammar": grammar}):
            assert reason == "stop" and re.fullmatch(
                r"\((?:[a-c]|x[0-9])(?:,(?:[a-c]|x[0-9]))*\)", text
            ), text
    # and the chat endpoint takes the same fields
    answers = _chat(client, stream, extra_body={"structured_outputs": {"choice": choices}})
    assert answers[0][0] in choices


def _tagged_parts(text: str, structures: list[dict]) -> tuple[list[tuple[int, object]], bool]:
    """The structures in ``text`` (each trigger ``@`` opens one: its begin, JSON, end), as
    ``(structure, value)`` pairs, and whether the last one is cut short (the answer's end)."""
    decoder, parts, pos = json.JSONDecoder(), [], 0
    while (at := text.find("@", pos)) >= 0:
        k = next((k for k, s in enumerate(structures) if text.startswith(s["begin"], at)), None)
        rest = text[at:]
        if k is None:  # only a cut answer may end inside a begin
            assert any(s["begin"].startswith(rest) for s in structures), text
            return parts, True
        start = at + len(structures[k]["begin"])
        try:
            value, end = decoder.raw_decode(text, start)
        except json.JSONDecodeError:
            return parts, True  # cut inside the JSON (checked by the caller's finish reason)
        if not text.startswith(structures[k]["end"], end):
            assert structures[k]["end"].startswith(text[end:]), text
            return parts, True
        parts.append((k, value))
        pos = end + len(structures[k]["end"])
    return parts, False


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_structural_tags_make_each_tagged_part_match_its_schema(
    server, client: openai.OpenAI, stream: bool
) -> None:
    """Free text in which each trigger must go on as one of the structures: its begin, JSON of its
    schema, its end. The bias makes the random model write the trigger ``@`` wherever text is free."""
    from .test_tools import TIME, WEATHER

    structures = [
        {"begin": "@weather(", "schema": WEATHER, "end": ")"},
        {"begin": "@time[", "schema": TIME, "end": "]"},
    ]
    tag = {"structures": structures, "triggers": ["@"]}
    bias = {str(_token_id(server, "@")): 6}
    answers = _chat(
        client,
        stream,
        response_format={"type": "structural_tag", **tag},
        logit_bias=bias,
        max_tokens=120,
    )
    answers += _complete(
        client,
        stream,
        extra_body={"structured_outputs": {"structural_tag": json.dumps(tag)}},
        logit_bias=bias,
        max_tokens=120,
    )
    found = 0
    for text, reason in answers:
        parts, cut = _tagged_parts(text, structures)
        assert not cut or reason == "length", text
        for k, value in parts:
            jsonschema.validate(value, structures[k]["schema"])
        found += len(parts)
    assert found >= 2


def test_unconstrained_requests_are_untouched(client: openai.OpenAI) -> None:
    """A request without a grammar answers the same with and without constrained company."""
    import concurrent.futures

    plain = dict(prompt="Once", max_tokens=24, temperature=0.0, extra_body={"ignore_eos": True})
    alone = client.completions.create(model=_model(client), **plain).choices[0].text
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        constrained = [
            pool.submit(_complete, client, extra_body={"guided_json": CLOSED}) for _ in range(3)
        ]
        mixed = pool.submit(client.completions.create, model=_model(client), **plain)
        assert mixed.result().choices[0].text == alone
        for f in constrained:
            jsonschema.validate(json.loads(f.result()[0][0]), PERSON)


def test_required_and_named_tool_choice_are_enforced(client: openai.OpenAI) -> None:
    from .test_tools import SCHEMAS, TOOLS, _check_calls, _streamed_calls

    model = _model(client)
    msgs = [{"role": "user", "content": "What time is it?"}]
    kw = dict(model=model, messages=msgs, tools=TOOLS, max_tokens=300, seed=1)
    r = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0].function
    assert call.name in SCHEMAS
    _check_calls([(call.name, call.arguments)], [call.name])
    # streamed: the name first, then the arguments in fragments that join to the same text
    streamed = client.chat.completions.create(
        tool_choice="required", parallel_tool_calls=False, stream=True, **kw
    )
    content, calls, reason = _streamed_calls(streamed)
    assert reason == "tool_calls" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.name, call.arguments)]
    assert calls[0]["pieces"] > 1

    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(tool_choice=named, n=2, **kw)
    for choice in r.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None
        call = choice.message.tool_calls[0].function
        _check_calls([(call.name, call.arguments)], ["get_time"])
    chunks = list(client.chat.completions.create(tool_choice=named, stream=True, **kw))
    content, calls, reason = _streamed_calls(chunks)
    # the arguments stream as they come: several deltas, the first with the id and the name
    deltas = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert len(deltas) > 1 and deltas[0].id and deltas[0].function.name == "get_time"
    assert reason == "stop" and content == ""
    _check_calls([(c["name"], c["arguments"]) for c in calls], ["get_time"])

    # auto (the default with tools) on this server: the parser finds no call in gibberish
    r = client.chat.completions.create(**(kw | {"max_tokens": 8}))
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"


def _flat(tools: list[dict]) -> list[dict]:
    """Chat's tools as the Responses API spells them (the function's fields at the top)."""
    return [{"type": "function", **t["function"]} for t in tools]


def _assert_chat_answers_alike(
    client: openai.OpenAI, resp, messages: list, max_tokens: int
) -> None:
    """``resp`` (a Response sampled with seed 2, tools offered and not called) is what chat answers
    for ``messages``: the same text from the same prompt."""
    from .test_tools import TOOLS

    chat = client.chat.completions.create(
        model=_model(client),
        messages=messages,
        tools=TOOLS,
        tool_choice="none",
        max_tokens=max_tokens,
        seed=2,
        extra_body={"ignore_eos": True},
    )
    assert resp.output_text == chat.choices[0].message.content
    assert resp.usage.input_tokens == chat.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_function_calls_on_responses(client: openai.OpenAI, stream: bool) -> None:
    """Function tools on the Responses API: a named or required choice gives function call items,
    the calls chat gives for the same seed; an earlier call and its output in ``input`` are the
    history chat is sent (same answer)."""
    from .test_tools import TOOLS, _check_calls, history

    model = _model(client)
    question = "What time is it?"
    kw = dict(model=model, tools=_flat(TOOLS), max_output_tokens=300, extra_body={"seed": 1})
    chat_kw = dict(model=model, tools=TOOLS, max_tokens=300, seed=1)
    named = {"type": "function", "name": "get_time"}
    cases = [
        (named, {"type": "function", "function": {"name": "get_time"}}),
        ("required", "required"),
    ]
    for choice, chat_choice in cases:
        if stream:
            with client.responses.stream(
                input=question, tool_choice=choice, parallel_tool_calls=False, **kw
            ) as events:
                seen = list(events)
                resp = events.get_final_response()
            kinds = [e.type for e in seen]
            assert kinds[-1] == "response.completed"
            # the call's item opens at its name, then its arguments come in pieces, as chat's do
            added = kinds.index("response.output_item.added")
            pieces = [e.delta for e in seen if e.type == "response.function_call_arguments.delta"]
            assert seen[added].item.type == "function_call" and len(pieces) > 1
            assert added < kinds.index("response.function_call_arguments.delta")
            (done,) = [e for e in seen if e.type == "response.function_call_arguments.done"]
            assert "".join(pieces) == done.arguments == resp.output[-1].arguments
            assert seen[added].item.id == resp.output[-1].id
        else:
            resp = client.responses.create(
                input=question, tool_choice=choice, parallel_tool_calls=False, **kw
            )
        chat = client.chat.completions.create(
            messages=[{"role": "user", "content": question}],
            tool_choice=chat_choice,
            parallel_tool_calls=False,
            **chat_kw,
        )
        calls = [item for item in resp.output if item.type == "function_call"]
        want = chat.choices[0].message.tool_calls
        assert [(c.name, c.arguments) for c in calls] == [
            (w.function.name, w.function.arguments) for w in want
        ]
        assert len(calls) == 1 and calls[0].call_id and calls[0].id.startswith("fc_")
        _check_calls([(c.name, c.arguments) for c in calls], [w.function.name for w in want])
        assert resp.status == "completed"

    # a call and its output sent back, as an agent loop does: the same prompt as chat's history
    messages = history("hermes")  # user, the assistant's call, its result, an answer, a user turn
    call = messages[1]["tool_calls"][0]
    items = [
        {"role": "user", "content": messages[0]["content"]},
        {
            "type": "function_call",
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
        },
        {"type": "function_call_output", "call_id": call["id"], "output": messages[2]["content"]},
        *(
            {"role": m["role"], "content": [{"type": "input_text", "text": m["content"]}]}
            for m in messages[3:]
        ),
    ]
    resp = client.responses.create(
        model=model,
        input=items,
        tools=_flat(TOOLS),
        tool_choice="none",
        max_output_tokens=12,
        extra_body={"seed": 2, "ignore_eos": True},
    )
    _assert_chat_answers_alike(client, resp, messages, 12)


def test_an_agent_loop_continues_by_previous_response_id(client: openai.OpenAI) -> None:
    """A function call answered by its output in the next request, which names the call's Response:
    the prompt is chat's for the whole history (same answer, same token count)."""
    from .test_tools import TOOLS

    model = _model(client)
    question = "What time is it?"
    call_resp = client.responses.create(
        model=model,
        input=question,
        tools=_flat(TOOLS),
        tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=300,
        extra_body={"seed": 1},
    )
    (call,) = call_resp.output
    assert call.type == "function_call"
    answer = client.responses.create(
        model=model,
        previous_response_id=call_resp.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12:00"}],
        tools=_flat(TOOLS),
        tool_choice="none",
        max_output_tokens=8,
        extra_body={"seed": 2, "ignore_eos": True},
    )
    tool_call = {"id": call.call_id, "type": "function"}
    tool_call["function"] = {"name": call.name, "arguments": call.arguments}
    history = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [tool_call]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "12:00"},
    ]
    _assert_chat_answers_alike(client, answer, history, 8)


def test_bad_schemas_and_tools_are_refused_naming_the_problem(client: openai.OpenAI) -> None:
    from .test_tools import TOOLS

    model = _model(client)
    bad_fn = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]
    bad_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"minimum": "a"}}}
    named = {"type": "function", "function": {"name": "nope"}}
    cases = [
        (dict(messages=MESSAGES, tools=bad_fn), "tools[0].function.parameters", "objekt"),
        (dict(messages=MESSAGES, tools=TOOLS, tool_choice=named), "tool_choice", "'nope'"),
        (dict(messages=MESSAGES, tools=[TOOLS[0], TOOLS[0]]), "tools", "two tools"),
        (dict(messages=MESSAGES, response_format=bad_format), "response_format", "JSON schema"),
        (
            dict(
                messages=MESSAGES,
                tools=TOOLS,
                tool_choice="required",
                response_format={"type": "json_object"},
            ),
            "tool_choice",
            "cannot be combined",
        ),
        (
            dict(messages=MESSAGES, extra_body={"guided_json": "{not json"}),
            "guided_json",
            "not valid JSON",
        ),
    ]
    for kw, param, message in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model=model, max_tokens=4, **kw)
        assert info.value.param == param and message in info.value.message, info.value.message
