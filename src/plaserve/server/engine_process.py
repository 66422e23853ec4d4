"""The engine in a process of its own, as vLLM V1 runs its engine core: HTTP never holds its GIL.

In one process the server's event loop (parsing, tokenizing, SSE chunks, socket writes) and the engine
thread share one GIL, and each holds the other up: a burst of 60 requests that the engine alone
finishes in 1.8 s took 2.5 s served (docs/BENCHMARKS.md). :class:`EngineProcess` runs an ordinary
:class:`~plaserve.server.engine_loop.EngineLoop` in a child process (``spawn``: a fresh interpreter,
so no OpenMP or torch state is inherited) and offers the HTTP handlers the same
:class:`~plaserve.server.engine_loop.EngineHandle` as the loop does in-process.

One pipe carries pickled messages both ways:

* server -> engine: ``("submit", [(request_id, prompt_token_ids, params, arrival_time, after,
  stream_interval)])``,
  ``("abort", request_id)``, ``("metrics", n)``, ``("reset_prefix_cache", n)``, ``("count_error",
  status)``, ``("stop",)``;
* engine -> server: ``("ready", facts, snapshot)`` or ``("failed", error)`` once built; then
  ``("out", [(request_id, delta or error)])`` once a step (every output of the step in one message;
  an output crosses as what is new since the request's last one, and the server rebuilds the whole
  output from it and from the prompt, which it has: see :class:`OutputDelta`),
  ``("state", snapshot, num_waiting, num_taken, alive)`` when one of them changed, ``("refused",
  count)`` for submissions it could not take, ``("reply", n, value)`` for question ``n`` (the metrics'
  exposition, whether the prefix cache was reset).

The child's loop keeps its supervision (a failed step fails the requests in flight and resets the
engine) and its metrics (``/metrics`` asks the child for them). The bound on queued requests is kept
here, where ``submit`` must answer at once: the waiting requests the child last reported plus those
sent since. The child dies with the server (``PR_SET_PDEATHSIG``); when it ends on its own, every
request in flight gets :class:`EngineStoppedError` and ``on_fatal`` is called (the server exits 1, as
after an in-process loop gave up).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import pickle
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, Callable

from plaserve.engine.engine import LLMEngine
from plaserve.request import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprobs
from plaserve.server.engine_loop import (
    EngineFacts,
    EngineLoop,
    EngineSnapshot,
    EngineStoppedError,
    OutputSink,
    Submission,
    check_queue,
    deliver,
)

log = logging.getLogger(__name__)

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class EngineProcess:
    """An :class:`EngineLoop` around ``build()`` (a picklable callable returning a warmed-up engine)
    in a child process; see the module docstring. Returns once the engine is ready, raising what
    ``build`` raised. ``max_queue``, ``on_fatal``, ``model_name`` as for :class:`EngineLoop`;
    ``loop_kwargs`` go to the child's loop; ``log_level``: the child's logging level."""

    def __init__(
        self,
        build: Callable[[], LLMEngine],
        *,
        max_queue: int | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
        model_name: str | None = None,
        log_level: int | str = logging.WARNING,
        **loop_kwargs: Any,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe()
        self._proc = ctx.Process(
            target=_engine_main,
            args=(child_conn, build, loop_kwargs, log_level),
            name="plaserve-engine",
            daemon=True,
        )
        self._proc.start()
        child_conn.close()
        try:
            msg = self._conn.recv()
        except (EOFError, OSError):
            self._proc.join(5)
            raise RuntimeError(
                f"the engine process exited while starting (exit code {self._proc.exitcode})"
            ) from None
        if msg[0] == "failed":
            self._proc.join(5)
            raise msg[1]
        _, self.facts, snapshot = msg
        self.facts: EngineFacts
        self.model_name = model_name or self.facts.model_name
        self.max_queue = max_queue
        self.on_fatal = on_fatal
        self.clock: Callable[[], float] = (
            time.monotonic
        )  # system-wide: the child's engine clock too
        self._lock = threading.Lock()  # the counts below, the sinks, sending
        self._snapshot: EngineSnapshot = snapshot
        self._num_waiting = 0  # as the child last reported, with ...
        self._num_taken = 0  # ... the submissions it had taken from its inbox by then
        self._num_sent = 0  # submissions sent, ever
        self._num_refused = 0  # submissions the child refused (stopping or recovering), ever
        self._child_alive = True
        self._stopping = False
        self._ended = False
        # Each request's sink, and what rebuilds its outputs from the deltas that cross the pipe.
        self._sinks: dict[str, tuple[OutputSink, _Received]] = {}
        self._question_ids = itertools.count()
        # questions to the child (metrics, a prefix-cache reset) waiting for its reply, by number
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._reader = threading.Thread(target=self._read, name="plaserve-engine-pipe", daemon=True)
        self._reader.start()

    # --- EngineHandle ------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        """True while the child runs and takes requests (not stopping, recovering or given up)."""
        return self._child_alive and not self._stopping and not self._ended

    @property
    def pid(self) -> int | None:
        """The engine process's id."""
        return self._proc.pid

    def snapshot(self) -> EngineSnapshot:
        """The load the child published last (it sends each new one)."""
        return self._snapshot

    def submit(self, submissions: list[Submission]) -> None:
        """As :meth:`EngineLoop.submit`."""
        with self._lock:
            if not self.alive:
                raise EngineStoppedError("the engine is not running")
            queued = self._num_waiting + self._num_sent - self._num_taken - self._num_refused
            check_queue(self.max_queue, queued, len(submissions), self._snapshot)
            for sub in submissions:
                self._sinks[sub.request_id] = (
                    sub.sink,
                    _Received(sub.request_id, sub.prompt_token_ids),
                )
            self._num_sent += len(submissions)
            wire = [
                (
                    s.request_id,
                    s.prompt_token_ids,
                    s.params,
                    s.arrival_time,
                    s.after,
                    s.stream_interval,
                )
                for s in submissions
            ]
            if not self._send(("submit", wire)):
                raise EngineStoppedError("the engine process is gone")

    def abort(self, request_id: str) -> None:
        """As :meth:`EngineLoop.abort`."""
        with self._lock:
            if self._sinks.pop(request_id, None) is not None:
                self._send(("abort", request_id))

    def count_error(self, status: int) -> None:
        with self._lock:
            self._send(("count_error", status))

    async def render_metrics(self) -> bytes:
        """The child's metrics exposition; EngineStoppedError when the child is gone."""
        return await self._ask("metrics")

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False while a request holds KV blocks."""
        return await self._ask("reset_prefix_cache")

    async def _ask(self, kind: str) -> Any:
        """Question ``kind`` to the child, and its reply; EngineStoppedError when the child is gone."""
        aloop = asyncio.get_running_loop()
        future = aloop.create_future()
        with self._lock:
            n = next(self._question_ids)
            self._waiting[n] = (aloop, future)
            if self._ended or not self._send((kind, n)):
                del self._waiting[n]
                raise EngineStoppedError("the engine process is gone")
        return await future

    def start(self) -> None:
        """Nothing to do: the process runs from construction (the loop's interface has it)."""

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the child after its current step; unfinished requests get EngineStoppedError."""
        with self._lock:
            self._stopping = True
            self._send(("stop",))
        self._proc.join(timeout)
        if self._proc.is_alive():
            log.warning("the engine process did not stop within %.0f s: killing it", timeout)
            self._proc.kill()
            self._proc.join(5)
        self._reader.join(5)
        self._conn.close()

    # --- the pipe ----------------------------------------------------------------------------
    def _send(self, msg: tuple) -> bool:
        """Send under ``_lock``; False when the pipe is closed."""
        try:
            self._conn.send(msg)
            return True
        except (OSError, ValueError):  # BrokenPipeError; ValueError: closed here
            return False

    def _read(self) -> None:
        """The reader thread: hand outputs to their sinks, keep the counts, until the child ends."""
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = msg[0]
            if kind == "out":
                self._dispatch(msg[1])
            elif kind == "state":
                with self._lock:
                    _, self._snapshot, self._num_waiting, self._num_taken, self._child_alive = msg
            elif kind == "refused":
                with self._lock:
                    self._num_refused += msg[1]
            elif kind == "reply":
                with self._lock:
                    waiting = self._waiting.pop(msg[1], None)
                if waiting is not None:
                    _settle(*waiting, msg[2])
        self._ended_now()

    def _dispatch(self, puts: list[tuple[str, OutputDelta | BaseException]]) -> None:
        items: list[tuple[OutputSink, RequestOutput | BaseException]] = []
        with self._lock:
            for request_id, item in puts:
                if request_id not in self._sinks:  # aborted here meanwhile
                    continue
                if isinstance(item, BaseException) or item.finished:
                    sink, received = self._sinks.pop(request_id)
                else:
                    sink, received = self._sinks[request_id]
                items.append(
                    (sink, item if isinstance(item, BaseException) else received.add(item))
                )
        deliver(items)

    def _ended_now(self) -> None:
        self._proc.join(5)
        with self._lock:
            self._ended = True
            sinks, self._sinks = [sink for sink, _ in self._sinks.values()], {}
            waiting, self._waiting = list(self._waiting.values()), {}
            stopping = self._stopping
        code = self._proc.exitcode
        error = EngineStoppedError(
            "the engine stopped" if stopping else f"the engine process ended (exit code {code})"
        )
        deliver([(sink, error) for sink in sinks])
        for aloop, future in waiting:
            _settle(aloop, future, error)
        if not stopping:
            log.critical("the engine process ended (exit code %s)", code)
            if self.on_fatal is not None:
                self.on_fatal(error)


def _settle(aloop: asyncio.AbstractEventLoop, future: asyncio.Future, value: Any) -> None:
    def resolve() -> None:
        if not future.done():
            if isinstance(value, BaseException):
                future.set_exception(value)
            else:
                future.set_result(value)

    try:
        aloop.call_soon_threadsafe(resolve)
    except RuntimeError:  # the event loop is closed: nobody is waiting
        pass


# --- the child -------------------------------------------------------------------------------
class _PipeOutbox:
    """The child's end: outputs, state changes and replies, pickled into the pipe (any thread).

    Outputs go as :class:`OutputDelta`, keyed by each request's :class:`_Sent`: an engine output
    holds the whole output so far, so sent whole, a step's message grew with every token and the
    server, which shares the engine's CPUs, unpickled it all again (docs/SERVER.md has the sizes)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.lock = threading.Lock()
        self._snapshot: EngineSnapshot | None = None  # the last state sent: the snapshot ...
        self._counts: tuple = ()  # ... and (waiting, taken, alive)

    def message(self, msg: tuple) -> None:
        with self.lock:
            try:
                self.conn.send(msg)
            except (OSError, ValueError):  # the server is gone: its reader thread stops the loop
                pass

    def send(self, puts: list[tuple[Any, tuple[int, RequestOutput | BaseException]]]) -> None:
        self.message(("out", [(sent.request_id, sent.wire(item)) for sent, (_, item) in puts]))

    def on_change(self, loop: EngineLoop) -> None:
        snapshot, counts = loop.snapshot(), (loop.num_waiting, loop.num_taken, loop.alive)
        # A snapshot is published anew or not at all: identity tells (the last one sent is held).
        if snapshot is not self._snapshot or counts != self._counts:
            self._snapshot, self._counts = snapshot, counts
            self.message(("state", snapshot, *counts))


@dataclass(frozen=True)
class OutputDelta:
    """One engine output as it crosses the pipe: what is new since the request's last one. The token
    ids, logprobs and text of an output only grow, except that the text is cut where a stop string
    is found: then ``text_whole`` says ``text`` is all of it. The prompt's text and logprobs come
    once, with the first; the metrics' per-token lists not at all (the child's loop observes them)."""

    token_ids: list[int]
    text: str
    text_whole: bool
    logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: str | int | None
    finished: bool
    num_cached_tokens: int
    # arrival, first scheduled, first token and finish times, preemptions
    metrics: tuple[float, float | None, float | None, float | None, int]
    first: tuple[str | None, list[TokenLogprobs | None] | None] | None  # prompt, prompt_logprobs


class _Sent:
    """The child's side of one request's deltas: how much of its output has crossed."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.started = False  # the first delta (with the prompt's text and logprobs) has crossed
        self.tokens = 0
        self.text = ""
        self.logprobs = 0

    def wire(self, item: RequestOutput | BaseException) -> OutputDelta | BaseException:
        """``item`` as it crosses the pipe: an output as its :class:`OutputDelta`, an exception
        :func:`_portable`."""
        if isinstance(item, BaseException):
            return _portable(item)
        (out,) = item.outputs
        extends = out.text.startswith(self.text)
        m = item.metrics
        delta = OutputDelta(
            out.token_ids[self.tokens :],
            out.text[len(self.text) :] if extends else out.text,
            not extends,
            None if out.logprobs is None else out.logprobs[self.logprobs :],
            out.finish_reason,
            out.stop_reason,
            item.finished,
            item.num_cached_tokens,
            (
                m.arrival_time,
                m.first_scheduled_time,
                m.first_token_time,
                m.finish_time,
                m.num_preemptions,
            ),
            None if self.started else (item.prompt, item.prompt_logprobs),
        )
        self.started, self.tokens, self.text = True, len(out.token_ids), out.text
        self.logprobs = 0 if out.logprobs is None else len(out.logprobs)
        return delta


class _Received:
    """The server's side of one request's deltas: the output so far, rebuilt."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.request_id, self.prompt_token_ids = request_id, prompt_token_ids
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list[TokenLogprobs] | None = None
        self.prompt: str | None = None
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None

    def add(self, d: OutputDelta) -> RequestOutput:
        """The whole output ``d`` brings the request to (lists copied: earlier outputs keep theirs)."""
        if d.first is not None:
            self.prompt, self.prompt_logprobs = d.first
        self.token_ids += d.token_ids
        self.text = d.text if d.text_whole else self.text + d.text
        if d.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs += d.logprobs
        arrival, scheduled, first_token, finish, preemptions = d.metrics
        metrics = RequestMetrics(
            arrival,
            scheduled,
            first_token_time=first_token,
            finish_time=finish,
            num_cached_tokens=d.num_cached_tokens,
            num_preemptions=preemptions,
        )
        output = CompletionOutput(
            0,
            self.text,
            list(self.token_ids),
            d.finish_reason,
            d.stop_reason,
            None if self.logprobs is None else list(self.logprobs),
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[output],
            finished=d.finished,
            metrics=metrics,
            num_cached_tokens=d.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs,
        )


def _portable(item: RequestOutput | BaseException) -> RequestOutput | BaseException:
    """``item``, or for an exception that does not survive pickling, an EngineStoppedError naming it."""
    if isinstance(item, BaseException):
        try:
            pickle.loads(pickle.dumps(item))
        except Exception:  # noqa: BLE001 - any exception type may refuse
            return EngineStoppedError(repr(item))
    return item


def _engine_main(
    conn: Connection,
    build: Callable[[], LLMEngine],
    loop_kwargs: dict[str, Any],
    log_level: int | str,
) -> None:
    """The child: build the engine, say so, take commands on a thread, step on the main thread."""
    from plaserve.launcher import die_with_parent

    die_with_parent()
    logging.basicConfig(level=log_level, format=LOG_FORMAT)
    outbox = _PipeOutbox(conn)
    try:
        loop = EngineLoop(build(), on_change=outbox.on_change, **loop_kwargs)
    except BaseException as e:  # noqa: BLE001 - the server raises it
        outbox.message(("failed", _portable(e)))
        return
    outbox.message(("ready", loop.facts, loop.snapshot()))
    threading.Thread(
        target=_take_commands, args=(conn, loop, outbox), name="plaserve-commands", daemon=True
    ).start()
    loop.run_here()


def _reset_prefix_cache(loop: EngineLoop, outbox: _PipeOutbox, n: int) -> None:
    """Question ``n``: reset the prefix cache on the engine thread, and reply whether it was."""

    def settle(ok: bool, value: Any) -> None:
        outbox.message(("reply", n, ok and bool(value)))

    try:
        loop.post(lambda lp: lp.engine.reset_prefix_cache(), settle)
    except EngineStoppedError:
        settle(False, None)


def _take_commands(conn: Connection, loop: EngineLoop, outbox: _PipeOutbox) -> None:
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the server is gone
            loop.stop()
            return
        kind = msg[0]
        if kind == "submit":
            subs = [
                Submission(
                    rid, ids, params, arrival, OutputSink.into(outbox, _Sent(rid)), after, interval
                )
                for rid, ids, params, arrival, after, interval in msg[1]
            ]
            try:
                loop.submit(subs)
            except EngineStoppedError as e:  # stopping or recovering: never in its inbox
                outbox.message(("refused", len(subs)))
                deliver([(sub.sink, e) for sub in subs])
        elif kind == "abort":
            loop.abort(msg[1])
        elif kind == "metrics":
            outbox.message(("reply", msg[1], loop.metrics.render()))
        elif kind == "reset_prefix_cache":
            _reset_prefix_cache(loop, outbox, msg[1])
        elif kind == "count_error":
            loop.count_error(msg[1])
        elif kind == "stop":
            loop.stop()
            return
