"""What passes between client and worker: forwarded headers, error bodies, and the first-token scan.

A streamed response is held back until its first token: everything a worker sends before that (a
chat stream's opening ``role`` chunk, say) is buffered, so that a worker failing before its first
token leaves the client with nothing sent yet, and the request can be retried elsewhere unseen.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

# Not forwarded: they describe one connection, not the request (RFC 9110 7.6.1), or are recomputed.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
        "accept-encoding",
    }
)
RESPONSE_HEADERS = ("Content-Type", "Retry-After", "X-Request-Id")

_ERROR_TYPES = {
    400: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout",
}


def request_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The client's headers to send on to a worker (its ``Authorization`` included)."""
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}


def response_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The worker's headers to pass back to the client."""
    return {k: headers[k] for k in RESPONSE_HEADERS if k in headers}


def error_json(status: int, message: str, code: str | None = None) -> bytes:
    """An OpenAI-style error body (``code`` a string or null, as in OpenAI's API)."""
    return json.dumps(
        {
            "error": {
                "message": message,
                "type": _ERROR_TYPES.get(status, "server_error"),
                "param": None,
                "code": code,
            }
        }
    ).encode()


def sse_error(message: str) -> bytes:
    """An error event and the end of the stream, for a worker that failed mid-stream."""
    return b"data: " + error_json(502, message) + b"\n\ndata: [DONE]\n\n"


# The typed stream events (OpenAI's Responses API, Anthropic's Messages API) that carry a token, or
# end an answer that had none to send.
TOKEN_EVENTS = frozenset(
    {
        "response.output_text.delta",
        "response.function_call_arguments.delta",
        "response.completed",
        "response.incomplete",
        "content_block_delta",
        "message_delta",
    }
)


def _has_token(event: dict[str, Any]) -> bool:
    """Whether a streamed event carries a token.

    A token's text may be empty: a byte-level tokenizer's token can be the first part of a multi-byte
    character, which the server holds back until the character is complete. Such a chunk is still the
    first token (a client counts it as one), so a completion chunk always counts, and a chat chunk
    counts unless it is the stream's opening ``role`` chunk.
    """
    if event.get("type") in TOKEN_EVENTS:
        return True
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        if isinstance(choice.get("text"), str) or choice.get("finish_reason"):
            return True
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            continue
        if delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content"):
            return True
        if "role" not in delta and isinstance(delta.get("content"), str):
            return True
    return False


class FirstTokenScanner:
    """Reads server-sent events until one carries a token (text, content, tool call or finish reason).

    ``buffer`` holds every byte fed so far, to be sent on once the token is there. ``error`` is set
    when an error event or the end of the stream comes first.
    """

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.token = False
        self.error: str | None = None
        self._scanned = 0  # bytes of buffer already split into events

    def feed(self, chunk: bytes) -> None:
        self.buffer += chunk
        while not self.token and self.error is None:
            end, sep = self._next_boundary()
            if end < 0:
                return
            event = bytes(self.buffer[self._scanned : end])
            self._scanned = end + sep
            self._scan_event(event)

    def _next_boundary(self) -> tuple[int, int]:
        a = self.buffer.find(b"\n\n", self._scanned)
        b = self.buffer.find(b"\r\n\r\n", self._scanned)
        if b >= 0 and (a < 0 or b < a):
            return b, 4
        return a, 2

    def _scan_event(self, event: bytes) -> None:
        for line in event.splitlines():
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                self.error = "the stream ended before the first token"
                return
            try:
                obj = json.loads(data)
            except ValueError:
                continue
            if not isinstance(obj, dict):
                continue
            if "error" in obj:
                err = obj["error"]
                self.error = str(err.get("message") if isinstance(err, dict) else err)
                return
            if obj.get("type") in ("error", "response.failed"):  # the Responses API's
                self.error = str(obj.get("message") or "the response failed")
                return
            if _has_token(obj):
                self.token = True
                return

    def eof(self) -> None:
        """The worker closed the stream."""
        if not self.token and self.error is None:
            self.error = "the stream ended before the first token"
