"""The launcher starts a child server once: a second start would leave the first one running; several
start together, and one that fails takes the others down with it."""

from __future__ import annotations

import sys

import httpx
import pytest

from plaserve.launcher import PlaserveProcess, running

# A stand-in server: answers 200 to every GET on the port it is given.
HEALTHY = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(str(__import__("os").getpid()).encode())
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


class StandIn(PlaserveProcess):
    def command(self) -> list[str]:
        return [sys.executable, "-c", HEALTHY, str(self.port)]


def test_a_server_starts_once_and_stops_for_good():
    proc = StandIn([], startup_timeout=30)
    with proc.start() as same:  # start() then the with block: one child, not two
        assert same is proc
        pid = proc.proc.pid
        assert httpx.get(f"{proc.url}/health").text == str(pid)
        with pytest.raises(RuntimeError, match="started already"):
            proc.start()
    assert proc.proc.poll() is not None  # the one child, stopped with the block


class Broken(PlaserveProcess):
    def command(self) -> list[str]:
        return [sys.executable, "-c", "raise SystemExit(3)"]


def test_servers_start_together_and_a_failed_start_stops_the_others():
    a, b = StandIn([], startup_timeout=30), StandIn([], startup_timeout=30)
    with running(a, b) as both:
        assert both == (a, b)
        assert all(httpx.get(f"{p.url}/health").status_code == 200 for p in both)
    assert a.proc.poll() is not None and b.proc.poll() is not None
    good, bad = StandIn([], startup_timeout=30), Broken([], startup_timeout=30)
    with pytest.raises(RuntimeError, match="exited with 3"):
        with running(good, bad):
            pass
    assert good.proc is not None and good.proc.poll() is not None  # started, then stopped
