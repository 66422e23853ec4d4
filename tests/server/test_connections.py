"""HTTP hygiene: header-read and idle timeouts close slow or silent connections, an error never resets a
keep-alive connection, and a client that leaves while sending its body is no error in the log."""

from __future__ import annotations

import contextlib
import http.client
import os
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from plaserve.launcher import ServerProcess, free_port
from plaserve.server.connections import ErrorGuard, http_protocol

TIMEOUT = 1.0


@pytest.fixture(scope="module")
def server(qwen2_ckpt: str) -> Iterator[ServerProcess]:
    args = [
        qwen2_ckpt,
        "--kv-cache-memory",
        "16MiB",
        "--max-model-len",
        "256",
        "--header-timeout",
        str(TIMEOUT),
        "--idle-timeout",
        str(TIMEOUT),
        "--body-timeout",
        str(TIMEOUT),
        "--max-body-size",
        "64KiB",
        "--no-compile",
    ]
    with ServerProcess(args) as proc:
        yield proc


def connect(server: ServerProcess) -> socket.socket:
    return socket.create_connection((server.host, server.port), timeout=10)


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """True when the server closes ``sock`` within ``within`` seconds (anything it sends is skipped)."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


@contextlib.contextmanager
def app_server(app, **config) -> Iterator[uvicorn.Server]:
    """``app`` served by uvicorn on a thread of this process, on a free port."""
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="critical", **config)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        yield server
    finally:
        server.should_exit = True
        thread.join(10)


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_silent_connection_is_closed_after_the_header_timeout(server: ServerProcess) -> None:
    with connect(server) as sock:
        start = time.monotonic()
        assert closed_by_server(sock, within=TIMEOUT + 3)
        assert time.monotonic() - start >= TIMEOUT * 0.8


@pytest.mark.parametrize("after_a_response", [False, True])
def test_trickled_headers_are_cut_off(server: ServerProcess, after_a_response: bool) -> None:
    with connect(server) as sock:
        if after_a_response:  # the timer starts again with the next request's first byte
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            time.sleep(TIMEOUT * 0.7)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        closed = False
        # one header byte every 0.2 s: each resets uvicorn's own keep-alive timer
        for _ in range(20):
            try:
                sock.sendall(b"X")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            time.sleep(0.2)
        assert closed or closed_by_server(sock, within=1)
        assert time.monotonic() - start < TIMEOUT + 2


def test_hundreds_of_idle_connections_are_all_closed(server: ServerProcess) -> None:
    before = open_fds(server.proc.pid)
    socks = [connect(server) for _ in range(200)]
    try:
        time.sleep(0.5)
        assert open_fds(server.proc.pid) >= before + 150  # the server holds them now
        deadline = time.monotonic() + TIMEOUT + 5
        while open_fds(server.proc.pid) > before + 2:
            assert time.monotonic() < deadline, (
                f"{open_fds(server.proc.pid) - before} connections left open"
            )
            time.sleep(0.1)
        assert all(closed_by_server(s, within=1) for s in socks)
    finally:
        for s in socks:
            s.close()


def test_a_keep_alive_connection_is_closed_after_the_idle_timeout_and_serves_until_then(
    server: ServerProcess,
) -> None:
    conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
    for _ in range(3):  # requests closer together than the idle timeout share the connection
        conn.request("GET", "/health")
        assert conn.getresponse().read() and conn.sock is not None
        time.sleep(TIMEOUT / 3)
    sock = conn.sock
    assert closed_by_server(sock, within=TIMEOUT + 3)
    conn.close()


def test_a_slow_body_gets_408(server: ServerProcess) -> None:
    with connect(server) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": '
        )
        sock.settimeout(TIMEOUT + 5)
        reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


def test_a_large_body_gets_413_before_it_is_read(server: ServerProcess) -> None:
    resp = httpx.post(
        f"{server.url}/v1/completions",
        content=b"{" + b" " * 100_000 + b"}",
        headers={"Content-Type": "application/json"},
    )
    assert resp.status_code == 413 and resp.json()["error"]["type"] == "invalid_request_error"


def test_a_client_leaving_while_sending_its_body_is_quiet(server: ServerProcess) -> None:
    for _ in range(5):
        with connect(server) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 5000\r\n\r\n{"messages": ['
            )
            time.sleep(0.05)
    time.sleep(0.3)
    assert httpx.get(f"{server.url}/health").status_code == 200
    log = server.log()
    assert "Traceback" not in log and "unhandled error" not in log, log[-3000:]


def test_an_exception_in_a_handler_never_resets_the_connection() -> None:
    """Starlette answers an unhandled exception with a 500 and re-raises it; without ErrorGuard uvicorn
    would then close the connection under the client's next request."""

    def boom(request):
        raise RuntimeError("handler bug")

    app = ErrorGuard(Starlette(routes=[Route("/boom", boom)]))
    with app_server(app, http=http_protocol(10.0)) as server:
        conn = http.client.HTTPConnection(server.config.host, server.config.port, timeout=10)
        conn.request("GET", "/boom")
        first = conn.getresponse()
        first.read()
        sock = conn.sock
        conn.request("GET", "/boom")
        second = conn.getresponse()
        second.read()
        assert first.status == second.status == 500
        assert conn.sock is sock and not second.will_close
        conn.close()


def test_headers_trickled_in_right_after_a_response_are_cut_off() -> None:
    """The next request's first bytes, arriving while the timer armed at the connection's opening is
    still pending (the first request's headers came in time), start a timer of their own: before, they
    found that one armed, and when it fired for the first request, nothing watched the second."""

    async def ok(request):
        return PlainTextResponse("ok")

    with app_server(Starlette(routes=[Route("/ok", ok)]), http=http_protocol(TIMEOUT)) as server:
        address = (server.config.host, server.config.port)
        with socket.create_connection(address, timeout=10) as sock:
            sock.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            sock.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            start = time.monotonic()
            assert closed_by_server(sock, within=TIMEOUT + 3)
            assert time.monotonic() - start >= TIMEOUT * 0.8
