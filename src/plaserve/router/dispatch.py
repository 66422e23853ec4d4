"""Placing requests on workers: the policy's choice, the requests it holds back, the accounting.

:class:`DispatchCore` holds the rules and the books, shared with the cluster simulator;
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
from typing import Callable, Generic, Protocol, TypeVar

from plaserve.router.policies import Job, Policy
from plaserve.router.pools import LONG
from plaserve.router.workers import Worker

log = logging.getLogger(__name__)


class NoWorkerError(Exception):
    """No worker in rotation can take the request."""


class Holdable(Protocol):
    """A request the policy may hold: its job and its id in the workers' books."""

    job: Job
    rid: int


H = TypeVar("H", bound=Holdable)


class DispatchCore(Generic[H]):
    """The decisions and the accounting of dispatching, with no clock and no event loop of its own:
    :class:`Dispatcher` runs it for the router on asyncio, the cluster simulator on its simulated
    clock, so both place requests by the same rules. ``held`` is the FIFO of requests the policy holds.
    """

    def __init__(self, policy: Policy, workers: Callable[[], list[Worker]]) -> None:
        self.policy = policy
        self._workers = workers
        self.held: list[H] = []

    def available(self, now: float) -> list[Worker]:
        """Workers that may take new requests now, in registration order."""
        return [w for w in self._workers() if w.available(now)]

    def commit(self, job: Job, worker: Worker, rid: int, now: float) -> float:
        """Count ``job`` in ``worker``'s backlog; returns its predicted cost there."""
        cost = worker.cost(job.tokens, job.prompt)
        self.policy.on_dispatch(job, worker, cost, now)
        worker.start(rid, cost, job.total_tokens, job.length_class, now, job.prompt)
        return cost

    def place(
        self, item: H, now: float, exclude: frozenset[str] = frozenset()
    ) -> tuple[Worker, float] | None:
        """Place ``item`` (committed: the worker and its cost there), or hold it (None: appended to
        :attr:`held`). Raises :class:`NoWorkerError` when no worker but those in ``exclude`` is up. A
        retry (``exclude`` non-empty) is never held: it has waited once already."""
        workers = [w for w in self.available(now) if w.url not in exclude]
        if not workers:
            raise NoWorkerError("no worker available")
        if exclude:
            worker = self.policy.choose_now(item.job, workers, now)
        # a long request does not overtake held ones
        elif item.job.length_class == LONG and self.held:
            worker = None
        else:
            worker = self.policy.choose(item.job, workers, now)
        if worker is None:
            self.held.append(item)
            return None
        return worker, self.commit(item.job, worker, item.rid, now)

    def release(self, now: float) -> tuple[list[tuple[H, Worker, float]], float | None]:
        """Place every held request that may go now: returns the placements (committed) and the
        seconds until the policy expects the next one may go (None: it cannot tell, or none is held).
        Raises :class:`NoWorkerError` (the held requests dropped) when no worker is up."""
        if not self.held:
            return [], None
        workers = self.available(now)
        if not workers:
            self.held = []
            raise NoWorkerError("no worker available")
        placed = []
        while self.held:
            choice = self.policy.next_held([h.job for h in self.held], workers, now)
            if choice is None:
                break
            i, worker = choice
            item = self.held.pop(i)
            placed.append((item, worker, self.commit(item.job, worker, item.rid, now)))
        return placed, (self.policy.next_wakeup(workers, now) if self.held else None)


@dataclass
class _Held:
    job: Job
    rid: int
    future: asyncio.Future


class Dispatcher:
    """The router's dispatcher: :class:`DispatchCore` with held requests waiting on futures, and a
    task that releases them (module docstring)."""

    def __init__(
        self,
        policy: Policy,
        workers: Callable[[], list[Worker]],
        *,
        fallback_wakeup_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.core: DispatchCore[_Held] = DispatchCore(policy, workers)
        self.policy = policy
        self._clock = clock
        self._fallback = fallback_wakeup_s  # re-check held requests at least this often (breakers reopen by time)
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def num_held(self) -> int:
        return sum(not h.future.done() for h in self.core.held)

    def available(self, now: float) -> list[Worker]:
        return self.core.available(now)

    async def acquire(
        self, job: Job, rid: int, exclude: frozenset[str] = frozenset()
    ) -> tuple[Worker, float]:
        """A worker for ``job`` (not one of ``exclude``) and the job's cost there; may wait while the
        policy holds it. Raises :class:`NoWorkerError` when no worker can take it."""
        held = _Held(job, rid, asyncio.get_running_loop().create_future())
        placed = self.core.place(held, self._clock(), exclude)
        if placed is not None:
            return placed
        self.wake()
        try:
            return await held.future  # cancelled with the request if the client goes away
        except asyncio.CancelledError:
            f = held.future
            # placed just as the client left
            if f.done() and not f.cancelled() and f.exception() is None:
                f.result()[0].finish(rid, ok=False, now=self._clock(), worker_fault=False)
                self.wake()
            raise

    def wake(self) -> None:
        """Something changed that may let a held request go (nothing to do while none is held)."""
        if self.core.held:
            self._wake.set()

    def release(self) -> float | None:
        """Place every held request that may go now; returns seconds until it is worth looking again."""
        self.core.held = [h for h in self.core.held if not h.future.done()]  # their clients left
        held = self.core.held
        try:
            placed, eta = self.core.release(self._clock())
        except NoWorkerError as e:
            for h in held:
                h.future.set_exception(e)
            return None
        for h, worker, cost in placed:
            h.future.set_result((worker, cost))
        if not self.core.held:
            return None
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
        for h in self.core.held:
            if not h.future.done():
                h.future.set_exception(NoWorkerError("the router is shutting down"))
        self.core.held = []
