"""The launcher starts a child server once: a second start would leave the first one running."""

from __future__ import annotations

import sys

import httpx
import pytest

from plaserve.launcher import PlaserveProcess

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
