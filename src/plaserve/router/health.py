"""Watching workers: periodic health checks and ``/load`` polls.

* **Health**: ``GET /health`` every ``interval_s``; a worker whose health check fails
  ``failure_threshold`` times in a row leaves the rotation, and comes back after
  ``success_threshold`` good checks. A server without ``/health`` (it answers 404: only the OpenAI
  endpoints) is checked with ``GET /v1/models`` instead. A worker back from unhealthy starts with a
  closed circuit breaker.
* **Load**: ``GET /load`` every ``load_interval_s`` on workers in rotation (plaserve workers); the
  report reconciles the router's virtual backlog (:mod:`plaserve.router.workers`), priced by the
  router's cost model where it lists its requests' tokens (``backlog_tokens``), and may carry the
  worker's cost model and short threshold. A worker that answers 404 or 405 has no ``/load`` and is
  not asked again until it is probed again (added anew, or back from unhealthy): the router's own
  accounting alone prices it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable

import aiohttp

from plaserve.router.config import HealthConfig
from plaserve.router.workers import LoadReport, Worker

log = logging.getLogger(__name__)

#: Called with a worker and its parsed ``/load`` JSON after each good poll.
LoadListener = Callable[[Worker, dict[str, Any]], None]


def parse_backlog(load: Any) -> tuple[float, int | None] | None:
    """Total backlog seconds and request count from a ``/load`` JSON, or None if it has no backlog."""
    if not isinstance(load, dict):
        return None
    backlog = load.get("backlog_s")
    try:
        if isinstance(backlog, dict):
            total = sum(float(v) for v in backlog.values())
        elif isinstance(backlog, (int, float)) and not isinstance(backlog, bool):
            total = float(backlog)
        else:
            return None
    except (TypeError, ValueError):
        return None
    n = load.get("num_requests")
    return max(0.0, total), n if isinstance(n, int) and not isinstance(n, bool) else None


def parse_backlog_tokens(load: dict[str, Any]) -> list[tuple[int, int]] | None:
    """``backlog_tokens`` of a ``/load`` JSON: (tokens to prefill, tokens in the cache) per request, or
    None where absent or malformed (other servers do not report it)."""
    items = load.get("backlog_tokens")
    if not isinstance(items, list):
        return None
    pairs = []
    for item in items:
        if not (
            isinstance(item, (list, tuple))
            and len(item) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in item)
        ):
            return None
        pairs.append((item[0], item[1]))
    return pairs


def parse_age(load: dict[str, Any]) -> float:
    """``age_s`` of a ``/load`` JSON: how old the state it describes was when it was sent (0 if absent
    or not a sane number; other servers do not report it)."""
    age = load.get("age_s")
    if isinstance(age, bool) or not isinstance(age, (int, float)) or not 0 <= age < 60:
        return 0.0
    return float(age)


def parse_response_prefix(load: dict[str, Any]) -> str | None:
    """How the ids of the Responses a worker keeps begin (its ``/load``'s ``responses``), or None
    where it keeps none (its store is off, or it is no plaserve worker)."""
    store = load.get("responses")
    if not isinstance(store, dict) or not store.get("max_bytes"):
        return None
    prefix = store.get("id_prefix")
    return prefix if isinstance(prefix, str) and len(prefix) > len("resp_") else None


class WorkerMonitor:
    """Runs the health and load loops over a changing set of workers."""

    def __init__(
        self,
        config: HealthConfig,
        session_factory: Callable[[], aiohttp.ClientSession],
        workers: Callable[[], list[Worker]],
        *,
        on_change: Callable[[], None],
        on_load: LoadListener,
        headers: dict[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self._session = session_factory
        self._workers = workers
        self._on_change = on_change
        self._on_load = on_load
        self._headers = headers or {}
        self._clock = clock
        self._tasks: list[asyncio.Task] = []

    # --- one worker ------------------------------------------------------------------------------
    async def _get(self, worker: Worker, path: str, timeout: float) -> tuple[int, Any]:
        async with self._session().get(
            worker.url + path, headers=self._headers, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            if resp.status != 200:
                await resp.read()
                return resp.status, None
            try:
                return 200, await resp.json(content_type=None)
            except ValueError:
                return 200, None

    async def check(self, worker: Worker) -> bool:
        """One health check (switching to ``/v1/models`` for servers without ``/health``)."""
        try:
            status, _ = await self._get(worker, worker.health_path, self.config.timeout_s)
            if status == 404 and worker.health_path == "/health":
                worker.health_path = "/v1/models"
                status, _ = await self._get(worker, worker.health_path, self.config.timeout_s)
            return status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            return False

    async def probe(self, worker: Worker) -> bool:
        """Check a new or returning worker at once: health, then whether it has ``/load``."""
        ok = await self.check(worker)
        if ok:
            worker.supports_load = None
            await self.poll_load(worker)
        return ok

    async def poll_load(self, worker: Worker) -> None:
        """One ``/load`` poll; updates the worker's report (or learns that it has no ``/load``)."""
        if worker.supports_load is False:
            return
        sent = self._clock()
        try:
            status, body = await self._get(worker, "/load", self.config.timeout_s)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError):
            return  # the health check decides what a dead worker is; this report is just missing
        if status in (404, 405) or (status == 200 and parse_backlog(body) is None):
            worker.supports_load = False
            worker.load = None
            return
        if status != 200:
            return
        backlog, n = parse_backlog(body)  # type: ignore[misc]
        worker.supports_load = True
        received = self._clock()
        self._on_load(worker, body)  # first: it may make the worker's own model the router's
        tokens = parse_backlog_tokens(body)
        if tokens is not None:
            # In the router's units: a profile prices every worker alike, while each worker's
            # backlog_s is in its own model's (fitted at its start, refitted as it runs).
            backlog = sum(worker.cost_model.prefill_time(new, cached) for new, cached in tokens)
        # The report describes the worker as it was ``age_s`` before it answered (plaserve publishes
        # its state as each step starts): date it back, so the backlog drains from then and requests
        # sent since then count as not in it.
        age = parse_age(body)
        worker.load = LoadReport(backlog, sent - age, received - age, n)
        worker.response_prefix = parse_response_prefix(body)

    def record_check(self, worker: Worker, ok: bool) -> bool:
        """Count one check result; returns whether the worker entered or left the rotation."""
        if ok:
            worker.check_failures, worker.check_successes = 0, worker.check_successes + 1
            if not worker.healthy and worker.check_successes >= self.config.success_threshold:
                worker.set_healthy(True)
                # Failed checks mean it went down (and was restarted, most likely): the failures its
                # circuit breaker counted were the old process's.
                worker.breaker.reset()
                log.warning("worker %s is healthy: in rotation", worker.url)
                return True
        else:
            worker.check_successes, worker.check_failures = 0, worker.check_failures + 1
            if worker.healthy and worker.check_failures >= self.config.failure_threshold:
                worker.set_healthy(False)
                worker.load = None
                log.warning(
                    "worker %s failed %d health checks: out of rotation",
                    worker.url,
                    worker.check_failures,
                )
                return True
        return False

    # --- loops -----------------------------------------------------------------------------------
    async def _health_round(self) -> None:
        workers = [w for w in self._workers() if not w.removed]
        results = await asyncio.gather(*(self.check(w) for w in workers))
        changed = False
        for w, ok in zip(workers, results):
            was_healthy = w.healthy
            if self.record_check(w, ok):
                changed = True
                if w.healthy and not was_healthy:
                    w.supports_load = None  # it may have restarted as another server
        if changed:
            self._on_change()

    async def _load_round(self) -> None:
        workers = [
            w
            for w in self._workers()
            if w.healthy and not w.removed and w.supports_load is not False
        ]
        if workers:
            await asyncio.gather(*(self.poll_load(w) for w in workers))
            self._on_change()

    async def _loop(self, interval: float, body: Callable[[], Any]) -> None:
        while True:
            started = self._clock()
            try:
                await body()
            except Exception:  # a bug in one round must not stop the watching
                log.exception("worker monitor round failed")
            await asyncio.sleep(max(0.0, interval - (self._clock() - started)))

    def start(self) -> None:
        """Start the health and load loops on the running event loop."""
        self._tasks = [
            asyncio.create_task(self._loop(self.config.interval_s, self._health_round)),
            asyncio.create_task(self._loop(self.config.load_interval_s, self._load_round)),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
