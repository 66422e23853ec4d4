"""Keeping HTTP connections healthy: a header-read timeout, and no connection reset after an error.

uvicorn closes a connection when an exception leaves the ASGI app, even after a complete 500 response
went out (Starlette's error middleware answers and then re-raises), so a pooled client's next request on
that connection fails. :class:`ErrorGuard` stops the exception there. uvicorn's keep-alive timeout ends
idle connections between requests, but nothing bounds how long a client may take to send a request's
headers (a new connection that sends nothing, or a slow trickle): :func:`http_protocol` adds that bound.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import h11
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from plaserve.server.errors import error_body

log = logging.getLogger(__name__)


class ErrorGuard:
    """The outermost ASGI wrapper: no exception reaches the server.

    If the app answered already (a complete error response), the exception is dropped and the
    connection stays open for the next request; if it had not started answering, a 500 in OpenAI's
    error shape goes out instead. A response broken off half-way still ends its connection: there is
    no other way to tell the client.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as e:  # noqa: BLE001 - the app logged it (or it is a disconnect): only answer
            if started:
                return
            log.error("unanswered error in %s %s: %r", scope.get("method"), scope.get("path"), e)
            body = json.dumps(error_body(500, "internal server error")).encode()
            try:
                await send(
                    {
                        "type": "http.response.start",
                        "status": 500,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body})
            except Exception:  # noqa: BLE001 - the client is gone
                pass


class _HeaderTimeoutProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request headers take longer than
    ``header_timeout`` seconds to arrive: counted from the connection opening (for its first request)
    or from the first byte of a later one. The wait between requests is uvicorn's keep-alive timeout's."""

    header_timeout: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        # the request being served when the timer was armed: its successor's headers stop the timer
        self._waiting_after: RequestResponseCycle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        if (
            cycle is not None
            and cycle.response_complete
            and (self._header_timer is None or self._waiting_after is not cycle)
        ):
            # The first bytes of the next request on a kept-alive connection. A timer still armed
            # from before the last request (its headers came in time) no longer counts for this one.
            self._arm_header_timer()
        super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self.transport.is_closing():
            return
        if self._header_timer is not None:
            self._header_timer.cancel()
        # The cycle now current: the request whose headers complete replaces it.
        self._waiting_after = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout, self._on_header_timeout)

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        if self.cycle is not self._waiting_after:  # the request's headers arrived in time
            return
        if not self.transport.is_closing():
            try:
                self.conn.send(h11.ConnectionClosed())
            except h11.LocalProtocolError:  # mid-request: close anyway
                pass
            self.transport.close()


def http_protocol(header_timeout: float) -> type[H11Protocol]:
    """The protocol class to give ``uvicorn.Config(http=...)``: h11 with a header-read timeout."""
    return type(
        "HeaderTimeoutH11Protocol", (_HeaderTimeoutProtocol,), {"header_timeout": header_timeout}
    )
