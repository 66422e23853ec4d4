"""OpenAI-style API errors: one exception type carrying the HTTP status, and the JSON body it becomes.

Status codes used by the server (see docs/SERVER.md):

* 400 ``invalid_request_error``: malformed JSON or a value out of range (``max_tokens <= 0``, empty prompt,
  token id outside the vocabulary, unsupported ``n``, prompt plus ``max_tokens`` over the context).
* 401 ``authentication_error``: missing or wrong API key.
* 404 ``not_found_error``: unknown model or route.
* 408 ``invalid_request_error``: the request body did not arrive in time.
* 413 ``invalid_request_error``: the body is larger than the server takes, or (``context_length_exceeded``)
  the prompt alone does not fit the model.
* 422 ``invalid_request_error``: a required field is missing or a field has the wrong JSON type.
* 429 ``rate_limit_error``: the request queue is full (with ``Retry-After``).
* 500 ``internal_server_error``: the model's logits for a request were not finite (that request alone fails).
* 503 ``service_unavailable``: the engine is not running, or is restarting after a failure.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An error the client caused (or a server state it should know about), as an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        """The OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    status: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict:
    """OpenAI's error shape; ``type`` follows from the status, ``code`` is a string or null as in
    OpenAI's API (``context_length_exceeded``, ``model_not_found``, ...)."""
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }
