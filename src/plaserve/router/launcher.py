"""Run ``plaserve route`` as a child process: start it, wait until it answers, stop it.

For benchmark scripts that want the router as users run it, in its own process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

import plaserve
from plaserve.server.launcher import free_port


class RouterProcess:
    """``python -m plaserve.cli route --worker-urls URLS ARGS --port PORT`` (a context manager).

    Output goes to a temporary log (:meth:`log`); a failed start raises with its tail. It is ready when
    ``/health`` answers, i.e. at least one worker is in rotation.
    """

    def __init__(self, worker_urls: list[str], args: list[str] | None = None, *, port: int | None = None,
                 startup_timeout: float = 60.0) -> None:
        self.worker_urls = list(worker_urls)
        self.args = list(args or [])
        self.port = port or free_port()
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="plaserve-route-", suffix=".log", delete=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "RouterProcess":
        env = dict(os.environ)
        src = str(Path(plaserve.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "plaserve.cli", "route", "--worker-urls", *self.worker_urls, *self.args,
               "--port", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"plaserve route exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"plaserve route did not become ready in {self.startup_timeout:.0f} s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; removes the log."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        if os.path.exists(self._log.name):
            os.unlink(self._log.name)

    def log(self) -> str:
        self._log.flush()
        with open(self._log.name, errors="replace") as f:
            return f.read()

    def __enter__(self) -> "RouterProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
