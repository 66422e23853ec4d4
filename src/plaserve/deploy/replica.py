"""One Ray Serve replica of a plaserve worker: a ``plaserve serve`` child process and a thin proxy.

**Why a child process and not the engine inside the replica.** The child is the same server as
``plaserve serve`` anywhere else: the same HTTP limits, errors, streaming, ``/load`` report and
``/metrics`` (the ``plaserve_*`` and ``vllm:*`` names a Prometheus scrape of the pod reads), with no
second way into the engine to keep in step. The engine runs in a process of its own, with its own
threads (the Ray worker process keeps the one Ray gives it), and a crash of the engine is the end
of one process that the replica's health check sees, after which Ray replaces the replica. The cost
is one more loopback HTTP hop per request (an aiohttp proxy hop, ``plaserve route``'s, measured 0.7-0.9
ms at p50 on the development machine, docs/ROUTER.md; docs/DEPLOY.md compares the whole Ray path
with ``plaserve route``) and a child to stop: the child is
SIGKILLed by the kernel when the replica's process dies (:func:`plaserve.launcher.die_with_parent`),
so a replica killed with SIGKILL leaves no server behind.

What the replica gives Ray:

* ``generate`` (whole answers) and ``stream`` (server-sent event chunks, as the child writes them);
* ``record_routing_stats``: the child's ``/load`` (predicted prefill backlog by class, queued and
  running requests, KV utilisation, cost model, short threshold), which Ray hands to the request
  router (:mod:`plaserve.deploy.request_router`) with each replica's info;
* ``record_autoscaling_stats``: the backlog seconds the autoscaling policy sums
  (:func:`plaserve.deploy.app.backlog_autoscaling_policy`);
* ``check_health``: the child's ``/health``; a dead or unhealthy child fails it and Ray restarts the
  replica.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, AsyncIterator

import httpx

from plaserve.launcher import ServerProcess
from plaserve.router.health import parse_response_prefix
from plaserve.router.prefixes import cache_tokens


class ReplicaError(RuntimeError):
    """The replica's server could not be reached (it died, or is restarting)."""


def _json(body: dict[str, Any]) -> bytes:
    """The ingress's parsed body as JSON again, ``NaN`` and ``Infinity`` kept: the server names the
    field that has one in a 4xx (httpx's ``json=`` refuses to write them: a 500)."""
    return json.dumps(body).encode()


def _typed(headers: dict[str, str]) -> dict[str, str]:
    """``headers`` with a JSON content type (the client's may be missing or another)."""
    kept = {k: v for k, v in headers.items() if k.lower() != "content-type"}
    return {**kept, "content-type": "application/json"}


def _answer(r: httpx.Response) -> tuple[int, Any]:
    """A whole answer as ``(status, JSON body)`` (a body that is not JSON as a server error's)."""
    try:
        return r.status_code, r.json()
    except ValueError:
        return r.status_code, {"error": {"message": r.text, "type": "server_error"}}


class PlaserveReplica:
    """A plaserve worker in a Ray Serve replica (module docstring). ``serve_args`` are the flags of
    ``plaserve serve`` (the model directory first, if any); ``threads`` the CPU threads it may use."""

    def __init__(
        self,
        serve_args: list[str],
        threads: int | None = None,
        startup_timeout: float = 300.0,
        request_timeout: float = 600.0,
    ) -> None:
        env = dict(os.environ)
        serve_args = list(serve_args)
        if threads is not None:
            for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
                env[var] = str(threads)
            if "--engine-mode" not in serve_args:
                # Ray reserved ``threads`` CPUs for this replica, and the machine's others for other
                # replicas: --engine-mode auto, seeing more CPUs than threads, would pick a process
                # whose HTTP work runs on theirs.
                serve_args += ["--engine-mode", "thread"]
        self.server = ServerProcess(
            serve_args, env=env, startup_timeout=startup_timeout, kill_with_parent=True
        )
        self._start_in_own_thread()
        self.client = httpx.AsyncClient(
            base_url=self.server.url,
            timeout=httpx.Timeout(request_timeout, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    def _start_in_own_thread(self) -> None:
        # Linux signals a child whose parent *thread* exits (PR_SET_PDEATHSIG), so the child is started
        # from a thread that lives as long as the child does: it waits on it after starting it.
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                self.server.start()
            except BaseException as e:  # noqa: BLE001 - handed to the constructor below
                failure.append(e)
                return
            finally:
                started.set()
            self.server.proc.wait()

        threading.Thread(target=run, name="plaserve-serve", daemon=True).start()
        started.wait()
        if failure:
            raise failure[0]

    # --- requests ------------------------------------------------------------------------------
    async def generate(
        self, path: str, body: dict[str, Any], headers: dict[str, str], **job: Any
    ) -> tuple[int, Any]:
        """A whole answer: ``(status, JSON body)`` from the server. ``job`` (prompt lengths, class)
        is for the request router and unused here."""
        try:
            r = await self.client.post(path, content=_json(body), headers=_typed(headers))
        except httpx.TransportError as e:
            raise ReplicaError(f"worker {self.server.url} did not answer: {e!r}") from None
        return _answer(r)

    async def stream(
        self,
        path: str,
        body: dict[str, Any] | None,
        headers: dict[str, str],
        method: str = "POST",
        **job: Any,
    ) -> AsyncIterator[bytes | tuple[int, Any]]:
        """A streamed answer (or with ``GET`` a kept Response's events, ``body`` None): first the
        status (an error answer as ``(status, JSON body)``, which ends the stream), then the event
        stream's bytes as they come."""
        try:
            content = None if body is None else _json(body)
            async with self.client.stream(
                method, path, content=content, headers=_typed(headers)
            ) as r:
                if r.status_code != 200:
                    await r.aread()
                    try:
                        yield r.status_code, r.json()
                    except ValueError:
                        yield r.status_code, {"error": {"message": r.text, "type": "server_error"}}
                    return
                yield 200, None
                async for chunk in r.aiter_raw():
                    yield chunk
        except httpx.TransportError as e:
            raise ReplicaError(f"worker {self.server.url} broke off: {e!r}") from None

    async def stored(
        self, method: str, path: str, headers: dict[str, str], **job: Any
    ) -> tuple[int, Any]:
        """A kept Response's ``GET`` / ``DELETE`` (``path``: ``/v1/responses/{id}[/input_items]``
        with its query) or ``POST .../cancel``: ``(status, JSON body)``. ``job`` is for the request
        router."""
        try:
            r = await self.client.request(method, path, headers=headers)
        except httpx.TransportError as e:
            raise ReplicaError(f"worker {self.server.url} did not answer: {e!r}") from None
        return _answer(r)

    async def models(self) -> tuple[int, Any]:
        """The server's ``/v1/models``."""
        r = await self.client.get("/v1/models")
        return r.status_code, r.json()

    # --- what Ray calls --------------------------------------------------------------------------
    async def _load(self) -> dict[str, Any]:
        r = await self.client.get("/load", timeout=5.0)
        r.raise_for_status()
        return r.json()

    async def record_routing_stats(self) -> dict[str, Any]:
        """The child's load as the request router reads it (see
        :func:`plaserve.deploy.request_router.report_from_stats`)."""
        load = await self._load()
        backlog = load.get("backlog_s", {})
        return {
            "backlog_s": float(sum(backlog.values())),
            "backlog_by_class_s": backlog,
            "queued": int(sum(load.get("queued", {}).values()) + load.get("pending", 0)),
            "running": int(sum(load.get("running", {}).values())),
            "kv_utilization": float(load.get("kv", {}).get("utilization", 0.0)),
            "cost_model": load.get("cost_model"),
            "short_threshold": load.get("short_threshold"),
            "response_prefix": parse_response_prefix(load),
            "cache_tokens": cache_tokens(load),
            # When the state described was current, on this machine's wall clock (the router's
            # clock is the wall clock too: Ray's processes may run on different machines).
            "as_of": time.time() - float(load.get("age_s", 0.0)),
            "url": self.server.url,
            "pid": self.server.proc.pid if self.server.proc else None,
        }

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The predicted prefill backlog in seconds, for the autoscaling policy."""
        load = await self._load()
        return {"backlog_s": float(sum(load.get("backlog_s", {}).values()))}

    async def check_health(self) -> None:
        """Raises when the child is gone or not healthy: Ray then replaces this replica."""
        proc = self.server.proc
        if proc is None or proc.poll() is not None:
            raise ReplicaError(f"the plaserve server exited ({proc and proc.returncode})")
        try:
            r = await self.client.get("/health", timeout=5.0)
        except httpx.HTTPError as e:
            raise ReplicaError(f"the plaserve server does not answer /health: {e!r}") from None
        if r.status_code != 200:
            raise ReplicaError(f"the plaserve server is unhealthy: {r.status_code} {r.text}")

    def __del__(self) -> None:
        # Ray calls __del__ when it stops a replica gracefully (scale-down, redeploy, shutdown).
        server = getattr(self, "server", None)
        if server is not None and server.proc is not None:
            server.stop(timeout=5.0)
