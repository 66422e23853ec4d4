"""Run ``plaserve route`` as a child process: start it, wait until it answers, stop it.

For benchmark scripts that want the router as users run it, in its own process.
"""

from __future__ import annotations

from plaserve.server.launcher import PlaserveProcess


class RouterProcess(PlaserveProcess):
    """``plaserve route --worker-urls URLS ARGS`` as a child process (a context manager). It is ready
    when ``/health`` answers, i.e. at least one worker is in rotation."""

    subcommand = "route"

    def __init__(self, worker_urls: list[str], args: list[str] | None = None, *, port: int | None = None,
                 startup_timeout: float = 60.0) -> None:
        super().__init__(["--worker-urls", *worker_urls, *(args or [])], port=port, startup_timeout=startup_timeout)
