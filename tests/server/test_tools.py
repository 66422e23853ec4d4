"""Tool calling against live servers, one per parser family, each on a tiny checkpoint with the
family's special tokens and its published chat template (tests/server/templates, built by
``tests/conftest.py: make_family_checkpoint``).

Random weights never choose to call a tool, so the auto-choice tests make the model write each
family's call format with a grammar (vLLM's ``structured_outputs``) and check that the family's
parser reads the calls back, whole and streamed; ``required`` and named functions are enforced by
the server's own grammar.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from plaserve import EngineConfig, LLMEngine
from plaserve.model.tokenizer import HFTokenizer
from plaserve.server.engine_loop import EngineLoop
from plaserve.server.tools import template_messages

from .test_supervision import live_server

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"tz": {"enum": ["UTC", "CET"]}, "24h": {"type": "boolean"}},
    "required": ["tz", "24h"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
CALL_ID = {"hermes": "call_1", "llama3_json": "call_1", "mistral": "abcDEF123"}  # Mistral: 9 alnum


def history(family: str) -> list[dict]:
    """A conversation with an earlier call and its result, as OpenAI clients send it back."""
    call = {
        "id": CALL_ID[family],
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "oslo"}'},
    }
    return [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": CALL_ID[family], "content": '{"temp": -3}'},
        {"role": "assistant", "content": "It is -3 degrees."},
        {"role": "user", "content": "And now?"},
    ]


def forced_format(family: str, tokenizer: HFTokenizer) -> dict:
    """A grammar that makes the model answer in the family's call format (what a trained model of the
    family writes when it calls ``get_weather``)."""
    city = '"[a-z]{1,6}"'
    if family == "hermes":  # content, then two calls
        one = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": ' + city + r"\}\}"
        two = (
            r'<tool_call>\n\{"name": "get_time", "arguments": \{"tz": "(UTC|CET)", "24h": true\}\}'
        )
        return {"regex": rf"Let me check\.\n{one}\n</tool_call>\n{two}\n</tool_call>"}
    if family == "llama3_json":
        return {"regex": r'\{"name": "get_weather", "parameters": \{"city": ' + city + r"\}\}"}
    marker = tokenizer.token_to_id("[TOOL_CALLS]")  # a control token: the grammar names its id
    body = r'/\[\{"name": "get_weather", "arguments": \{"city": ' + city + r"\}\}\]/"
    return {"grammar": f'start: <[{marker}]> " " {body}'}


@pytest.mark.parametrize("family", ["hermes", "llama3_json", "mistral"])
def test_templates_render_tools_as_transformers_does(family_ckpt, family: str) -> None:
    """Tools, an assistant's call and a tool result go through the family's own template exactly as
    transformers renders them."""
    from transformers import AutoTokenizer

    path = family_ckpt(family)
    ours = HFTokenizer(path).apply_chat_template(
        template_messages([{**m, "content": m["content"] or ""} for m in history(family)]),
        tools=TOOLS,
    )
    ref = AutoTokenizer.from_pretrained(path).apply_chat_template(
        template_messages(history(family)), tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert ours == ref
    assert "get_time" in ours and "-3" in ours


@pytest.fixture(scope="module", params=["hermes", "llama3_json", "mistral"])
def family_server(request: pytest.FixtureRequest, family_ckpt) -> Iterator[tuple]:
    """The family's checkpoint served with its parser for auto tool choice, in this process (three
    server processes would take ~40 s to start on the shared machine; the flags' own path is
    tested in test_structured.py)."""
    family = request.param
    path = family_ckpt(family)
    engine = LLMEngine(
        EngineConfig.from_kwargs(model=path, kv_cache_memory="64MiB", dtype="float32")
    )
    with live_server(EngineLoop(engine), tool_parser=family) as url:
        with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60) as client:
            yield family, client, HFTokenizer(path)


def _chat(client: openai.OpenAI, **kw):
    return client.chat.completions.create(
        **(
            {
                "model": client.models.list().data[0].id,
                "max_tokens": 400,
                "temperature": 1.0,
                "seed": 7,
            }
            | kw
        )
    )


def _streamed_calls(chunks) -> tuple[str, list[dict], str | None]:
    """Content, calls (deltas merged by index, as OpenAI's clients merge them) and finish reason.
    Each call comes in OpenAI's pieces: a first delta with its id, type and name (and arguments
    ""), then argument fragments (counted in ``pieces``) that carry nothing else."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name
                assert d.function.arguments == ""
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": "", "pieces": 0}
                continue
            assert d.id is None and d.function.name is None and d.function.arguments
            calls[d.index]["arguments"] += d.function.arguments
            calls[d.index]["pieces"] += 1
        reason = choice.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


def _check_calls(calls: list[tuple[str, str]], expected_names: list[str]) -> None:
    assert [name for name, _ in calls] == expected_names
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_auto_tool_calls_are_parsed_by_the_family_parser(family_server) -> None:
    family, client, tokenizer = family_server
    kw = dict(
        messages=history(family),
        tools=TOOLS,
        extra_body={"structured_outputs": forced_format(family, tokenizer)},
    )
    r = _chat(client, **kw)
    choice = r.choices[0]
    names = ["get_weather", "get_time"] if family == "hermes" else ["get_weather"]
    assert choice.finish_reason == "tool_calls"
    _check_calls(
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls], names
    )
    assert all(c.type == "function" and c.id for c in choice.message.tool_calls)
    if family == "mistral":
        assert all(len(c.id) == 9 and c.id.isalnum() for c in choice.message.tool_calls)
    assert choice.message.content == ("Let me check.\n" if family == "hermes" else None)

    # streamed: the same content and calls, the arguments in fragments as they were generated
    content, calls, reason = _streamed_calls(_chat(client, stream=True, **kw))
    assert reason == "tool_calls" and content == (choice.message.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    assert all(c["pieces"] > 1 for c in calls)
    assert "<tool_call>" not in content and "[TOOL_CALLS]" not in content

    # The call and its result go back into the history: the template renders them, the model answers.
    follow = history(family) + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": CALL_ID[family],
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in choice.message.tool_calls[:1]
            ],
        },
        {"role": "tool", "tool_call_id": CALL_ID[family], "content": "sunny"},
    ]
    assert (
        _chat(client, messages=follow, tools=TOOLS, tool_choice="none", max_tokens=3)
        .choices[0]
        .message.tool_calls
        is None
    )


def test_the_embedded_models_template_writes_calls_the_hermes_parser_reads() -> None:
    """The default model's template renders tools, calls and results Hermes-style, and what it
    writes for an assistant's calls is what `--tool-call-parser hermes` reads back."""
    from plaserve.model.tokenizer import ByteTokenizer
    from plaserve.server.tool_parsers import HermesParser, ToolCall

    calls = [
        {
            "id": "a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "oslo"}'},
        },
        {
            "id": "b",
            "type": "function",
            "function": {"name": "get_time", "arguments": '{"tz": "UTC", "24h": true}'},
        },
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather and time?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "12:00"},
    ]
    text = ByteTokenizer().apply_chat_template(template_messages(messages), tools=TOOLS)
    assert text.startswith("<|bos|><|im_start|>system\nBe brief.\n\n# Tools")
    assert json.dumps(TOOLS[1]) in text
    assert (
        "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n12:00\n</tool_response>" in text
    )
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = HermesParser().parse(turn)
    assert parsed.content == "Checking.\n"
    assert parsed.calls == [
        ToolCall(c["function"]["name"], json.dumps(json.loads(c["function"]["arguments"])))
        for c in calls
    ]


@pytest.mark.parametrize(
    "parser,text,content,calls",
    [
        ("hermes", 'Hi<tool_call>{"name": "f", "arguments": {"x": 1}}', "Hi", [("f", '{"x": 1}')]),
        ("hermes", "<tool_call>{broken</tool_call>", "<tool_call>{broken</tool_call>", []),
        (
            "hermes",
            'A<tool_call>\n{"arguments": {"q": [1, {"z": "}\\""}]}, "name": "g"}\n</tool_call>',
            "A",
            [("g", '{"q": [1, {"z": "}\\""}]}')],
        ),
        (
            "llama3_json",
            '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"y": "z"}}',
            None,
            [("f", "{}"), ("g", '{"y": "z"}')],
        ),
        ("llama3_json", '{"answer": 42}', '{"answer": 42}', []),
        ("llama3_json", '{"name": "f", "parameters": "{\\"a\\": 1}"}', None, [("f", '{"a": 1}')]),
        (
            "mistral",
            'x[TOOL_CALLS] [{"name": "f", "arguments": {"a": [1]}}, {"name": "g"}]',
            "x",
            [("f", '{"a": [1]}'), ("g", "{}")],
        ),
        (
            "mistral",
            '[TOOL_CALLS]f[ARGS]{"a": 2}[TOOL_CALLS]g[ARGS]{}',
            None,
            [("f", '{"a": 2}'), ("g", "{}")],
        ),
        ("required", '[{"name": "f", "parameters": {"b": true}}]', None, [("f", '{"b": true}')]),
    ],
)
def test_parsers_read_their_formats(parser: str, text: str, content, calls) -> None:
    from plaserve.server.tool_parsers import PARSERS, RequiredParser, ToolStream

    make = RequiredParser if parser == "required" else PARSERS[parser]
    parsed = make().parse(text)
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    # streamed a character at a time: the same content; each call's name once, first, then its
    # arguments in fragments that join to the finished answer's
    stream, streamed, got = ToolStream(make()), "", {}
    for end in range(1, len(text) + 1):
        delta, pieces = stream.feed(text[:end], end == len(text))
        streamed += delta
        for piece in pieces:
            if piece.name is not None:
                assert piece.index == len(got) and piece.arguments == ""
                got[piece.index] = [piece.name, ""]
            else:
                got[piece.index][1] += piece.arguments
    assert streamed == (content or "")
    assert [(got[i][0], got[i][1]) for i in sorted(got)] == calls


def test_structural_tags_write_calls_the_family_parser_reads(family_server) -> None:
    """vLLM's structural tags as tool-calling clients use them: the family's call marker as the
    trigger (a special token in Llama 3 and Mistral, referenced by id; text in Qwen2.5), each
    function's arguments schema between the call's begin and end. The bias makes the model write the
    marker; the family's parser reads the calls, whose arguments validate."""
    family, client, tokenizer = family_server
    trigger, begin, end = {
        "hermes": ("<tool_call>", '<tool_call>\n{"name": "%s", "arguments": ', "}\n</tool_call>"),
        "llama3_json": ("<|python_tag|>", '<|python_tag|>{"name": "%s", "parameters": ', "}"),
        "mistral": ("[TOOL_CALLS]", '[TOOL_CALLS][{"name": "%s", "arguments": ', "}]"),
    }[family]
    structures = [{"begin": begin % n, "schema": s, "end": end} for n, s in SCHEMAS.items()]
    tag = {"type": "structural_tag", "structures": structures, "triggers": [trigger]}
    bias = {str(tokenizer.token_to_id(trigger)): 30}
    r = _chat(client, messages=history(family), tools=TOOLS, response_format=tag, logit_bias=bias)
    calls = r.choices[0].message.tool_calls
    assert calls, r.choices[0].message.content
    _check_calls(
        [(c.function.name, c.function.arguments) for c in calls], [c.function.name for c in calls]
    )
