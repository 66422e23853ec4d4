"""Placing requests on workers: the policy's choice, the requests it holds back, the accounting.

:meth:`Dispatcher.acquire` returns a worker for a request with the request already counted in that
worker's backlog (the accounting happens in the same step as the decision, so the next decision sees
it). When the policy holds a request (``pla``, long requests while every worker is busy enough), the
request waits in a FIFO until :meth:`Dispatcher.release` places it; release runs when anything that
frees capacity happens (a first token, a finished request, a ``/load`` report, a worker coming or
going, a pool resize) and when the policy predicts a backlog will have drained far enough.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Callable

from plaserve.router.policies import Job, Policy
from plaserve.router.pools import LONG
from plaserve.router.workers import Worker

log = logging.getLogger(__name__)


class NoWorkerError(Exception):
    """No worker in rotation can take the request."""


@dataclass
class _Held:
    job: Job
    rid: int
    future: asyncio.Future


class Dispatcher:
    """Chooses workers through ``policy`` and keeps the held requests (module docstring)."""

    def __init__(self, policy: Policy, workers: Callable[[], list[Worker]], *, fallback_wakeup_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self._workers = workers
        self._clock = clock
        self._fallback = fallback_wakeup_s  # re-check held requests at least this often (breakers reopen by time)
        self._held: list[_Held] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def num_held(self) -> int:
        return sum(not h.future.done() for h in self._held)

    def available(self, now: float) -> list[Worker]:
        """Workers that may take new requests now, in registration order."""
        return [w for w in self._workers() if w.available(now)]

    def commit(self, job: Job, worker: Worker, rid: int, now: float) -> float:
        """Count ``job`` in ``worker``'s backlog; returns its predicted cost there."""
        cost = worker.cost(job.tokens)
        self.policy.on_dispatch(job, worker, cost, now)
        worker.start(rid, cost, job.total_tokens, job.length_class, now)
        return cost

    async def acquire(self, job: Job, rid: int, exclude: frozenset[str] = frozenset()) -> tuple[Worker, float]:
        """A worker for ``job`` (not one of ``exclude``) and the job's cost there; may wait.

        Raises :class:`NoWorkerError` when no worker can take it. A retry (``exclude`` non-empty) is
        never held: it has waited once already.
        """
        now = self._clock()
        workers = [w for w in self.available(now) if w.url not in exclude]
        if not workers:
            raise NoWorkerError("no worker available")
        if exclude:
            worker = self.policy.choose_now(job, workers, now)
            return worker, self.commit(job, worker, rid, now)
        # A long request does not overtake the ones already waiting.
        worker = None if (job.length_class == LONG and self.num_held) else self.policy.choose(job, workers, now)
        if worker is not None:
            return worker, self.commit(job, worker, rid, now)
        held = _Held(job, rid, asyncio.get_running_loop().create_future())
        self._held.append(held)
        self.wake()
        try:
            return await held.future  # cancelled with the request if the client goes away
        except asyncio.CancelledError:
            f = held.future
            if f.done() and not f.cancelled() and f.exception() is None:  # placed just as the client left
                f.result()[0].finish(rid, ok=False, now=self._clock(), worker_fault=False)
                self.wake()
            raise

    def wake(self) -> None:
        """Something changed that may let a held request go (nothing to do while none is held)."""
        if self._held:
            self._wake.set()

    def release(self) -> float | None:
        """Place every held request that may go now; returns seconds until it is worth looking again."""
        self._held = [h for h in self._held if not h.future.done()]
        if not self._held:
            return None
        now = self._clock()
        workers = self.available(now)
        if not workers:
            for h in self._held:
                h.future.set_exception(NoWorkerError("no worker available"))
            self._held = []
            return None
        while self._held:
            placed = self.policy.next_held([h.job for h in self._held], workers, now)
            if placed is None:
                break
            i, worker = placed
            h = self._held.pop(i)
            h.future.set_result((worker, self.commit(h.job, worker, h.rid, now)))
        if not self._held:
            return None
        eta = self.policy.next_wakeup(workers, now)
        return self._fallback if eta is None else min(eta, self._fallback)

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                timeout = self.release()
            except Exception:  # never let the release loop die: held requests would hang
                log.exception("releasing held requests failed")
                timeout = self._fallback
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except asyncio.TimeoutError:
                pass

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        """Stop the release loop; requests still held fail with :class:`NoWorkerError`."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        for h in self._held:
            if not h.future.done():
                h.future.set_exception(NoWorkerError("the router is shutting down"))
        self._held = []
