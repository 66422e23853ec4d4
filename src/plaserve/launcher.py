"""Run ``plaserve serve``, ``plaserve route`` (or another long-running subcommand) as a child process:
start it, wait until it is healthy, stop it. A layer of its own, so that the router's ``plaserve
cluster`` starts workers without importing the server.

For tests and benchmark scripts that need a real server on a real port (e.g. one per policy, to compare
them with ``plaserve bench``).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

import plaserve

PR_SET_PDEATHSIG = 1  # prctl(2) option: the signal a child gets when its parent dies


def die_with_parent() -> None:
    """In a forked child before exec: ask Linux to SIGKILL this process when its parent dies.

    A parent that is itself SIGKILLed (a Ray replica killed by its controller, a pod's container
    killed) cannot stop its children; without this the child server would keep its port and memory
    forever. Elsewhere than Linux nothing is done.
    """
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out by itself (to outgoing connections, and to binds of port 0)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now, chosen below the kernel's ephemeral range: the
    child that will bind it does so seconds later, and meanwhile every outgoing connection and every
    bind of port 0 (a KV transfer service) takes an ephemeral port, which could be this one."""
    low, _ = _ephemeral_range()
    start = max(1024, low - 12000)
    for _ in range(100 if start < low else 0):
        port = random.randrange(start, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range below is taken: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PlaserveProcess:
    """``python -m plaserve.cli SUBCOMMAND ARGS --host HOST --port PORT`` in a child process (use as a
    context manager), ready once its ``/health`` answers 200.

    The child's output goes to a temporary log file (a pipe nobody reads could fill and block it);
    :meth:`log` returns it, and a failed start raises with its tail. The child leads its own process
    group and :meth:`stop` signals the whole group, so servers that fork workers (vLLM's engine core,
    for one) leave nothing behind. Subclasses run other servers by overriding :meth:`command`,
    :meth:`child_env` and :attr:`label`.
    """

    subcommand = "serve"

    def __init__(
        self,
        args: list[str],
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = 120.0,
        kill_with_parent: bool = False,
    ) -> None:
        self.args = list(args)
        # The child is SIGKILLed when the thread that started it dies (see die_with_parent).
        self.kill_with_parent = kill_with_parent
        self.host = host
        self.port = port or free_port()
        self.env = env
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self._log = tempfile.NamedTemporaryFile(
            prefix=f"plaserve-{self.subcommand}-", suffix=".log", delete=False
        )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def label(self) -> str:
        """What the server is called in error messages."""
        return f"plaserve {self.subcommand}"

    def command(self) -> list[str]:
        """The child's argv."""
        return [
            sys.executable,
            "-m",
            "plaserve.cli",
            self.subcommand,
            *self.args,
            "--host",
            self.host,
            "--port",
            str(self.port),
        ]

    def child_env(self) -> dict[str, str]:
        """The child's environment."""
        env = dict(os.environ if self.env is None else self.env)
        # The child must import this same plaserve, installed or not.
        src = str(Path(plaserve.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        return env

    def start(self) -> "PlaserveProcess":
        """Launch the server and block until ``/health`` answers 200. Once only: a second child on the
        same port would fail to bind while the first answered its health checks, and ``stop`` would
        then stop the second and leave the first running."""
        if self.proc is not None:
            raise RuntimeError(f"{self.label} was started already")
        self.proc = subprocess.Popen(
            self.command(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.child_env(),
            start_new_session=True,
            preexec_fn=die_with_parent if self.kill_with_parent else None,
        )
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._kill_group(signal.SIGKILL)  # workers it forked before dying
                raise RuntimeError(
                    f"{self.label} exited with {self.proc.returncode}:\n{self.log()[-4000:]}"
                )
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        tail = self.log()[-4000:]
        self.stop()
        raise RuntimeError(
            f"{self.label} did not become healthy in {self.startup_timeout:.0f} s:\n{tail}"
        )

    def _kill_group(self, sig: signal.Signals) -> None:
        if self.proc is not None:
            try:
                # the child's pid is its group's id (start_new_session)
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass  # the group is gone already

    def stop(self, timeout: float = 15.0) -> None:
        """Stop the server (SIGTERM, then after ``timeout`` SIGKILL to its whole process group) and remove its log."""
        if self.proc is not None:
            if self.proc.poll() is None:
                # SIGTERM to the leader alone: a server that forked workers shuts them down itself, more
                # cleanly than if each got the signal at once.
                self.proc.terminate()
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
            # SIGKILL whatever is left of the group: a leader that exited may have left workers running.
            self._kill_group(signal.SIGKILL)
            if self.proc.poll() is None:
                self.proc.wait()
        self._log.close()
        if os.path.exists(self._log.name):
            os.unlink(self._log.name)

    def log(self) -> str:
        """What the server printed so far."""
        self._log.flush()
        with open(self._log.name, errors="replace") as f:
            return f.read()

    def __enter__(self) -> "PlaserveProcess":
        """Starts the server unless :meth:`start` did already (``with ServerProcess(...).start() as p``
        works as well as ``with ServerProcess(...) as p``)."""
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServerProcess(PlaserveProcess):
    """``plaserve serve ARGS`` as a child process."""

    subcommand = "serve"


class RouterProcess(PlaserveProcess):
    """``plaserve route --worker-urls URLS ARGS`` as a child process (a context manager). It is ready
    when ``/health`` answers, i.e. at least one worker is in rotation."""

    subcommand = "route"

    def __init__(
        self,
        worker_urls: list[str],
        args: list[str] | None = None,
        *,
        port: int | None = None,
        startup_timeout: float = 60.0,
    ) -> None:
        super().__init__(
            ["--worker-urls", *worker_urls, *(args or [])],
            port=port,
            startup_timeout=startup_timeout,
        )


def start_together(procs: Sequence[PlaserveProcess]) -> None:
    """Start ``procs`` at once, each waiting for its own health check on a thread of its own, so that N
    servers are up in about the time of the slowest rather than of all of them. If any fails to start,
    every one is stopped and the first failure raised."""
    with ThreadPoolExecutor(max(1, len(procs))) as pool:
        futures = [pool.submit(p.start) for p in procs]
    errors = [e for e in (f.exception() for f in futures) if e is not None]
    if errors:
        for p in procs:
            p.stop()
        raise errors[0]


@contextlib.contextmanager
def running(*procs: PlaserveProcess) -> Iterator[tuple[PlaserveProcess, ...]]:
    """``with running(a, b) as (a, b):`` both started together (:func:`start_together`), both stopped
    on leaving."""
    start_together(procs)
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()
