"""The first-token scan that decides when a streamed response may go to the client."""

from __future__ import annotations

import json

from plaserve.router.forward import FirstTokenScanner


def sse(*events: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def scan(data: bytes, piece: int = 7) -> FirstTokenScanner:
    """Feed ``data`` in small pieces, as a socket may deliver it."""
    s = FirstTokenScanner()
    for i in range(0, len(data), piece):
        s.feed(data[i : i + piece])
    return s


def test_a_completion_chunk_with_empty_text_is_a_token():
    # A byte-level token may be half of a multi-byte character: no text yet, but a token all the same.
    s = scan(sse({"choices": [{"index": 0, "text": "", "finish_reason": None}]}))
    assert s.token and s.error is None


def test_the_chat_role_chunk_is_not_a_token_but_an_empty_content_chunk_is():
    role = {
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        ]
    }
    assert not scan(sse(role)).token
    empty = {"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": None}]}
    assert scan(sse(role, empty)).token
    assert scan(
        sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]})
    ).token


def test_errors_and_early_ends_are_reported():
    s = scan(sse({"error": {"message": "boom"}}))
    assert not s.token and s.error == "boom"
    s = scan(b"data: [DONE]\n\n")
    assert not s.token and "ended" in s.error
    s = FirstTokenScanner()
    s.feed(sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}))
    s.eof()
    assert not s.token and "ended" in s.error


def test_the_responses_api_stream_has_its_first_token_at_the_first_text_delta():
    def event(kind: str, **fields) -> bytes:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n".encode()

    opening = event("response.created", response={"id": "resp_1", "usage": None})
    opening += event("response.output_item.added", output_index=0, item={})
    assert not scan(opening).token
    assert scan(opening + event("response.output_text.delta", delta="Hi")).token
    # an answer with no text to send ends with its Response: the client must have it
    assert scan(opening + event("response.completed", response={"id": "resp_1"})).token
    s = scan(opening + event("error", code=None, message="boom", param=None))
    assert not s.token and s.error == "boom"
