"""Bad input gets an OpenAI-style error with the right status, and never disturbs other requests."""

from __future__ import annotations

import threading

import httpx
import openai
import pytest

MAX_MODEL_LEN = 2048  # the tiny checkpoint's max_position_embeddings
VOCAB = 512

# (name, path, body or raw bytes, expected status)
CASES = [
    ("malformed json", "/v1/completions", b'{"prompt": "hi", "max_tokens": ', 400),
    ("body is not an object", "/v1/completions", b'["hi"]', 400),
    ("missing prompt", "/v1/completions", {"max_tokens": 4}, 422),
    ("prompt wrong type", "/v1/completions", {"prompt": 42}, 422),
    ("prompt mixed list", "/v1/completions", {"prompt": ["a", 1]}, 422),
    ("max_tokens wrong type", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 422),
    ("max_tokens boolean", "/v1/completions", {"prompt": "hi", "max_tokens": True}, 422),
    ("temperature wrong type", "/v1/completions", {"prompt": "hi", "temperature": "hot"}, 422),
    ("stop wrong type", "/v1/completions", {"prompt": "hi", "stop": 3}, 422),
    ("max_tokens zero", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400),
    ("max_tokens negative", "/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400),
    ("negative temperature", "/v1/completions", {"prompt": "hi", "temperature": -1}, 400),
    ("top_p zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400),
    ("empty token list", "/v1/completions", {"prompt": []}, 400),
    ("empty stop string", "/v1/completions", {"prompt": "hi", "stop": [""]}, 400),
    ("token id too large", "/v1/completions", {"prompt": [1, 2, VOCAB]}, 400),
    ("negative token id", "/v1/completions", {"prompt": [1, -1, 2]}, 400),
    ("prompt longer than the model", "/v1/completions", {"prompt": [7] * MAX_MODEL_LEN}, 413),
    (
        "prompt plus max_tokens too long",
        "/v1/completions",
        {"prompt": [7] * 2000, "max_tokens": 100},
        400,
    ),
    ("unknown model", "/v1/completions", {"model": "gpt-7", "prompt": "hi"}, 404),
    (
        "presence_penalty too large",
        "/v1/completions",
        {"prompt": "hi", "presence_penalty": 2.5},
        400,
    ),
    (
        "frequency_penalty too small",
        "/v1/completions",
        {"prompt": "hi", "frequency_penalty": -2.5},
        400,
    ),
    ("repetition_penalty zero", "/v1/completions", {"prompt": "hi", "repetition_penalty": 0}, 400),
    ("min_p above one", "/v1/completions", {"prompt": "hi", "min_p": 1.5}, 400),
    (
        "min_tokens above max_tokens",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 2, "min_tokens": 5},
        400,
    ),
    (
        "logit_bias key not a token id",
        "/v1/completions",
        {"prompt": "hi", "logit_bias": {"a": 1}},
        400,
    ),
    ("logit_bias too large", "/v1/completions", {"prompt": "hi", "logit_bias": {"5": 150}}, 400),
    (
        "logit_bias outside the vocabulary",
        "/v1/completions",
        {"prompt": "hi", "logit_bias": {str(VOCAB): 1}},
        400,
    ),
    ("logit_bias wrong type", "/v1/completions", {"prompt": "hi", "logit_bias": [1, 2]}, 422),
    (
        "presence_penalty wrong type",
        "/v1/completions",
        {"prompt": "hi", "presence_penalty": "high"},
        422,
    ),
    ("n zero", "/v1/completions", {"prompt": "hi", "n": 0}, 400),
    ("n too large", "/v1/completions", {"prompt": "hi", "n": 500}, 400),
    ("best_of above n", "/v1/completions", {"prompt": "hi", "n": 1, "best_of": 3}, 400),
    ("logprobs too many", "/v1/completions", {"prompt": "hi", "logprobs": 21}, 400),
    ("logprobs wrong type", "/v1/completions", {"prompt": "hi", "logprobs": "all"}, 422),
    ("suffix", "/v1/completions", {"prompt": "hi", "suffix": "end"}, 400),
    ("echo wrong type", "/v1/completions", {"prompt": "hi", "echo": "yes"}, 422),
    (
        "chat top_logprobs without logprobs",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
    ),
    (
        "chat top_logprobs too many",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 50},
        400,
    ),
    (
        "stream_options without stream",
        "/v1/completions",
        {"prompt": "hi", "stream_options": {}},
        400,
    ),
    (
        "continuous_usage_stats wrong type",
        "/v1/completions",
        {"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": "yes"}},
        422,
    ),
    (
        "response_format not an object",
        "/v1/completions",
        {"prompt": "hi", "response_format": "json"},
        422,
    ),
    (
        "chat tools not an array",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "tools": {"type": "function"}},
        422,
    ),
    ("missing messages", "/v1/chat/completions", {"max_tokens": 3}, 422),
    ("messages not a list", "/v1/chat/completions", {"messages": "hi"}, 422),
    ("message without role", "/v1/chat/completions", {"messages": [{"content": "hi"}]}, 422),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400),
    (
        "role the template rejects",
        "/v1/chat/completions",
        {"messages": [{"role": "robot", "content": "hi"}]},
        400,
    ),
    (
        "chat unknown model",
        "/v1/chat/completions",
        {"model": "x", "messages": [{"role": "user", "content": "hi"}]},
        404,
    ),
    (
        "chat n negative",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "n": -3},
        400,
    ),
    (
        "chat too long",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hello " * 3000}]},
        413,
    ),
    ("tokenize neither field", "/tokenize", {}, 422),
    ("responses without input", "/v1/responses", {"max_output_tokens": 3}, 422),
    ("responses input not text or items", "/v1/responses", {"input": 5}, 422),
    (
        "responses unknown role",
        "/v1/responses",
        {"input": [{"role": "robot", "content": "hi"}]},
        400,
    ),
    ("responses unknown model", "/v1/responses", {"model": "x", "input": "hi"}, 404),
    ("responses metadata not strings", "/v1/responses", {"input": "hi", "metadata": {"k": 1}}, 422),
    (
        "responses max_output_tokens 0",
        "/v1/responses",
        {"input": "hi", "max_output_tokens": 0},
        400,
    ),
    (
        "responses bad text.format",
        "/v1/responses",
        {"input": "hi", "text": {"format": {"type": "xml"}}},
        400,
    ),
    ("detokenize without tokens", "/detokenize", {}, 422),
    ("detokenize tokens not ids", "/detokenize", {"tokens": ["a"]}, 422),
    ("detokenize id outside the vocabulary", "/detokenize", {"tokens": [1, 10**9]}, 400),
    ("detokenize negative id", "/detokenize", {"tokens": [-1]}, 400),
    ("detokenize unknown model", "/detokenize", {"model": "x", "tokens": [1]}, 404),
    ("unknown route", "/v1/embeddings", {"input": "hi"}, 404),
]


@pytest.mark.parametrize("name,path,body,status", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_an_openai_error(
    server, name: str, path: str, body: object, status: int
) -> None:
    if isinstance(body, bytes):
        resp = httpx.post(
            f"{server.url}{path}", content=body, headers={"content-type": "application/json"}
        )
    else:
        resp = httpx.post(f"{server.url}{path}", json=body)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)


def test_a_logit_bias_that_is_not_a_number_is_named(server) -> None:
    """The message names the entry and its type (it said "got object" of the whole map)."""
    resp = httpx.post(
        f"{server.url}/v1/completions", json={"prompt": "hi", "logit_bias": {"5": []}}
    )
    assert resp.status_code == 422
    error = resp.json()["error"]
    assert error["param"] == "logit_bias.5" and "must be a number, got array" in error["message"]


def test_wrong_method_is_an_error(server) -> None:
    resp = httpx.get(f"{server.url}/v1/completions")
    assert resp.status_code == 405 and "error" in resp.json()


def test_openai_client_sees_typed_errors(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="hi", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model=model, prompt="hi", extra_body={"top_k": "many"})
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=model, prompt=[3] * MAX_MODEL_LEN)
    assert info.value.status_code == 413


TOOL = {
    "type": "function",
    "function": {"name": "now", "parameters": {"type": "object", "properties": {}}},
}


def _tag(*structures: dict, triggers: list[str] | None = None) -> dict:
    """vLLM's structural-tag response format."""
    return {"type": "structural_tag", "structures": list(structures), "triggers": triggers or ["<"]}


# (endpoint, fields of a request that asks for tools or structured outputs wrongly, the param its 400
# names, a piece of the message). This server runs without --enable-auto-tool-choice.
REFUSED = [
    ("chat", {"tools": [TOOL]}, "tool_choice", "--enable-auto-tool-choice"),
    ("chat", {"tools": [TOOL], "tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
    ("chat", {"functions": [TOOL["function"]]}, "tool_choice", "--enable-auto-tool-choice"),
    ("chat", {"tool_choice": "required"}, "tool_choice", "needs tools"),
    (
        "chat",
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "later"}}},
        "tool_choice",
        "'later', which is not among the tools (now)",
    ),
    ("chat", {"function_call": "auto"}, "function_call", "needs tools"),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format", "'yaml'"),
    (
        "chat",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        "response_format",
        "needs a 'schema'",
    ),
    (
        "completions",
        {"extra_body": {"response_format": {"type": "json_object"}, "guided_regex": "a+"}},
        "guided_regex",
        "one kind of structured output at a time",
    ),
    ("completions", {"extra_body": {"guided_regex": "[0-9"}}, "guided_regex", "regex"),
    ("chat", {"extra_body": {"guided_grammar": 'root ::= "a'}}, "guided_grammar", "grammar"),
    (
        "chat",
        {"extra_body": {"structured_outputs": {"structural_tag": "{}"}}},
        "structured_outputs.structural_tag.triggers",
        "non-empty array",
    ),
    (
        "completions",
        {"extra_body": {"structured_outputs": {"structural_tag": "{not json"}}},
        "structured_outputs.structural_tag",
        "not valid JSON",
    ),
    (
        "chat",
        {"response_format": _tag({"begin": "<f>", "schema": {}, "end": ""}, triggers=["<g"])},
        "response_format.structures[0].begin",
        "starts with none of the triggers",
    ),
    (
        "chat",
        {"response_format": _tag({"begin": "<f>", "end": "</f>"}, {"begin": "<f>", "schema": 3})},
        "response_format.structures[0].schema",
        "must be a JSON schema object",
    ),
    (
        "completions",
        {"extra_body": {"response_format": _tag({"begin": "<f>", "schema": {"type": "objekt"}})}},
        "response_format.structures[0].schema",
        "objekt",
    ),
    (
        "chat",
        {"response_format": {"type": "structural_tag", "format": {"type": "triggered_tags"}}},
        "response_format",
        "'structures' and 'triggers'",
    ),
    (
        "chat",
        {"extra_body": {"structured_outputs": {"choice": ["a"], "regex": "a"}}},
        "structured_outputs",
        "exactly one of",
    ),
]
# Fields with values that ask for nothing, so plain generation answers them.
ACCEPTED = [
    ("chat", {"tools": [], "tool_choice": "none"}),
    ("chat", {"tools": [TOOL], "tool_choice": "none"}),
    (
        "chat",
        {
            "response_format": {"type": "text"},
            "extra_body": {"guided_json": None, "function_call": "none"},
        },
    ),
    ("completions", {"extra_body": {"response_format": {"type": "text"}, "guided_choice": None}}),
]


def _create(client: openai.OpenAI, endpoint: str, **fields: object) -> object:
    """A one-token request to ``endpoint`` ("chat" or "completions") with ``fields`` added."""
    model = client.models.list().data[0].id
    if endpoint == "chat":
        return client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=1, **fields
        )
    return client.completions.create(model=model, prompt="hi", max_tokens=1, **fields)


@pytest.mark.parametrize(
    "endpoint,fields,param,message",
    REFUSED,
    ids=[f"{e}-{p}-{i}" for i, (e, _, p, _) in enumerate(REFUSED)],
)
def test_bad_tool_and_structured_requests_are_refused(
    client: openai.OpenAI, endpoint: str, fields: dict, param: str, message: str
) -> None:
    """Tool calling and structured outputs asked for wrongly get a 400 naming the field and the
    problem, not an answer that ignores them."""
    with pytest.raises(openai.BadRequestError) as info:
        _create(client, endpoint, **fields)
    assert info.value.param == param and message in info.value.message, info.value.message
    # and the server goes on serving
    assert _create(client, endpoint).choices[0].finish_reason is not None


@pytest.mark.parametrize(
    "endpoint,fields", ACCEPTED, ids=[f"{e}-{i}" for i, (e, _) in enumerate(ACCEPTED)]
)
def test_fields_that_ask_for_nothing_are_accepted(
    client: openai.OpenAI, endpoint: str, fields: dict
) -> None:
    assert _create(client, endpoint, **fields).choices[0].finish_reason is not None


def test_bad_requests_do_not_disturb_a_running_stream(server, client: openai.OpenAI) -> None:
    """A long streaming request runs while every bad request above arrives; it completes intact."""
    model = client.models.list().data[0].id
    result: dict[str, object] = {}

    def stream() -> None:
        chunks = client.completions.create(
            model=model,
            prompt="Once upon a time",
            max_tokens=400,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        parts = [(c.choices[0].text if c.choices else "", c.usage) for c in chunks]
        result["text"] = "".join(p for p, _ in parts)
        result["usage"] = parts[-1][1]

    thread = threading.Thread(target=stream)
    thread.start()
    for _, path, body, status in CASES:
        kw = (
            {"content": body, "headers": {"content-type": "application/json"}}
            if isinstance(body, bytes)
            else {"json": body}
        )
        assert httpx.post(f"{server.url}{path}", **kw).status_code == status
    thread.join(60)
    assert not thread.is_alive()
    assert result["usage"].completion_tokens == 400
    whole = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=400,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    assert result["text"] == whole.choices[0].text
    assert httpx.get(f"{server.url}/health").status_code == 200
