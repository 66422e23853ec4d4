"""API-key check as plain ASGI middleware (it must not buffer streamed responses, so no BaseHTTPMiddleware).

With a key set, every route needs ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``, as
Anthropic's SDK sends it) except ``/health`` and ``/metrics``,
which load balancers and Prometheus poll without credentials. The sglang router sends the key on
``/get_load`` and ``/get_server_info`` when it is configured with one.
"""

from __future__ import annotations

import secrets
from typing import Callable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from plaserve.server.errors import ApiError

OPEN_PATHS = frozenset({"/health", "/metrics"})


class ApiKeyMiddleware:
    """Answers 401 to requests without the right bearer token; ``on_reject`` is told of each one."""

    def __init__(
        self, app: ASGIApp, api_key: str, on_reject: Callable[[int], None] | None = None
    ) -> None:
        self.app = app
        self.expected = api_key.encode()
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if not auth and "x-api-key" in headers:  # Anthropic's SDK sends its key so
            scheme, token = "bearer", headers["x-api-key"]
            auth = token
        # compare_digest: the time taken must not reveal how much of a guessed key was right.
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), self.expected
        ):
            if self.on_reject is not None:
                self.on_reject(401)
            message = "missing API key" if not auth else "invalid API key"
            error = ApiError(
                401,
                f"{message}: send 'Authorization: Bearer <key>'",
                headers={"WWW-Authenticate": "Bearer"},
            )
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)
