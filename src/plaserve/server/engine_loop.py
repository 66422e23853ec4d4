"""The engine on its own thread: a thread-safe inbox in, per-request asyncio queues out.

:class:`plaserve.LLMEngine` is not thread-safe, so exactly one thread (this loop's) ever calls it. HTTP
handlers never touch the engine: they put submissions and aborts in the inbox (a list under a
condition variable) and read the latest published :class:`EngineSnapshot`. The engine thread takes the
whole inbox between steps, steps while there is work, sleeps on the condition when there is none, and
hands each output to its request's asyncio queue with ``loop.call_soon_threadsafe``. So a slow HTTP
client never blocks a step, and a long step never blocks HTTP (torch releases the GIL while it computes).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Union

from plaserve.engine.engine import LLMEngine
from plaserve.request import Request, RequestOutput, SamplingParams
from plaserve.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The engine already has ``max_queue`` requests waiting; ``retry_after`` is a hint in seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class EngineStoppedError(Exception):
    """The engine loop is not running (shut down, restarting after a failure, or given up)."""


class EngineFailedError(EngineStoppedError):
    """A step raised: the requests in flight were dropped and the engine restarted (see the log)."""


class Outbox(Protocol):
    """Carries outputs from the engine's thread to where their requests wait. ``send`` gets
    ``(key, (index, item))`` pairs, all of one step for this outbox; it must not block for long."""

    def send(self, puts: list[tuple[Any, tuple[int, RequestOutput | BaseException]]]) -> None: ...


@dataclass(frozen=True)
class EventLoopOutbox:
    """Into asyncio queues (the keys) on ``loop``: one wake-up of the loop for all of a step's items."""

    loop: asyncio.AbstractEventLoop

    def send(self, puts: list[tuple[Any, tuple[int, RequestOutput | BaseException]]]) -> None:
        try:
            self.loop.call_soon_threadsafe(_put_all, puts)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class OutputSink:
    """Where one request's outputs go: an asyncio queue on the HTTP event loop, items tagged with the
    request's choice ``index`` (one HTTP request may carry several prompts sharing one queue).
    :meth:`into` makes one that goes through another :class:`Outbox` (the engine process's pipe)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, index: int = 0
    ) -> None:
        self.outbox: Outbox = EventLoopOutbox(loop)
        self.key: Any = queue
        self.index = index

    @classmethod
    def into(cls, outbox: Outbox, key: Any, index: int = 0) -> "OutputSink":
        sink = cls.__new__(cls)
        sink.outbox, sink.key, sink.index = outbox, key, index
        return sink

    def put(self, item: RequestOutput | BaseException) -> None:
        """Hand ``item`` over from any thread."""
        deliver([(self, item)])


def deliver(items: list[tuple[OutputSink, RequestOutput | BaseException]]) -> None:
    """Hand each item to its sink from any thread: one :meth:`Outbox.send` per outbox for all of its
    items (every ``call_soon_threadsafe`` writes to the loop's wake-up pipe: a system call a token a
    request, which a decode step of 64 requests would pay 64 times)."""
    by_outbox: dict[Outbox, list[tuple[Any, tuple]]] = {}
    for sink, item in items:
        by_outbox.setdefault(sink.outbox, []).append((sink.key, (sink.index, item)))
    for outbox, puts in by_outbox.items():
        outbox.send(puts)


def _put_all(puts: list[tuple[asyncio.Queue, tuple]]) -> None:
    for q, item in puts:
        q.put_nowait(item)


@dataclass
class Submission:
    """A validated request on its way to the engine. ``arrival_time`` is on the engine's clock.

    ``after``: the id of the first choice of the same prompt, for the engine to hold this one until
    that one's prompt blocks are cached (see ``LLMEngine.add_request``).

    ``stream_interval``: hand an output to the sink every this many new tokens (the first token and
    the end always at once; an output holds everything so far, so skipped ones lose nothing); 0: only
    the final output, for a handler that waits for it.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    sink: OutputSink
    after: str | None = None
    stream_interval: int = 1


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    """Run ``fn(loop)`` on the engine thread between steps; ``settle(ok, result or exception)`` is
    called with the outcome, on the engine thread."""

    fn: Callable[["EngineLoop"], Any]
    settle: Callable[[bool, Any], None]


_Command = Union[Submission, _Abort, _Call]


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's load as last published by its thread (HTTP handlers read only this)."""

    load: dict  # LLMEngine.load_report()
    stats: dict  # LLMEngine.stats
    num_tokens: int  # prompt + generated tokens of every unfinished request
    pending: int  # submissions in the inbox, not yet in the engine
    time: float  # time.time() when taken
    monotonic: float = (
        0.0  # time.monotonic() when taken: what ``GET /load``'s ``age_s`` is measured from
    )

    @property
    def age(self) -> float:
        """Seconds since the snapshot was taken."""
        return max(0.0, time.monotonic() - self.monotonic)


@dataclass(frozen=True)
class EngineFacts:
    """What the HTTP side reads of the engine, fixed once it is built (and picklable: the engine
    process sends it to the server's)."""

    tokenizer: Any  # plaserve.model.tokenizer's tokenizer, with the served chat template
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    max_model_len: int
    model_name: str  # the loaded model's name (the served name unless --served-model-name)
    model_path: str | None  # its directory (None: the embedded default model)
    random_weights: bool
    max_num_seqs: int
    max_total_tokens: int  # KV cache capacity in tokens
    device: str
    dtype: str

    @classmethod
    def of(cls, engine: LLMEngine) -> "EngineFacts":
        loaded = engine.loaded  # None for an engine given its runner (tests)
        return cls(
            tokenizer=engine.tokenizer,
            eos_token_ids=tuple(engine.model_config.eos_token_ids),
            vocab_size=engine.model_config.vocab_size,
            max_model_len=engine.max_model_len,
            model_name=loaded.name if loaded is not None else "plaserve",
            model_path=loaded.path if loaded is not None else None,
            random_weights=loaded.random_weights if loaded is not None else False,
            max_num_seqs=engine.scheduler.max_num_seqs,
            max_total_tokens=engine.allocator.num_blocks * engine.allocator.block_size,
            device=str(engine.device),
            dtype=str(engine.dtype).removeprefix("torch."),
        )


def check_queue(max_queue: int | None, queued: int, adding: int, snapshot: EngineSnapshot) -> None:
    """Refuse ``adding`` more requests where ``queued`` already wait for a place: ValueError for more
    than the queue can ever hold, :class:`QueueFullError` (with the backlog as the retry hint) for more
    than it holds now."""
    if max_queue is None:
        return
    if adding > max_queue:
        raise ValueError(
            f"the request has {adding} prompts and choices; this server queues "
            f"at most {max_queue} requests at once"
        )
    if queued + adding > max_queue:
        backlog = sum(snapshot.load.get("backlog_s", {}).values())
        raise QueueFullError(
            f"the request queue is full ({queued} waiting, limit {max_queue}); retry later",
            retry_after=backlog,
        )


class EngineHandle(Protocol):
    """What the HTTP handlers use of an engine: :class:`EngineLoop` (a thread of this process) or
    :class:`plaserve.server.engine_process.EngineProcess` (a process of its own)."""

    facts: EngineFacts
    model_name: str  # the served name, as the API and the metrics report it
    max_queue: int | None
    clock: Callable[[], float]  # the engine's clock, which ``Submission.arrival_time`` is on

    @property
    def alive(self) -> bool: ...

    def snapshot(self) -> EngineSnapshot: ...

    def submit(self, submissions: list[Submission]) -> None: ...

    def abort(self, request_id: str) -> None: ...

    def count_error(self, status: int) -> None: ...

    async def render_metrics(self) -> bytes: ...

    async def reset_prefix_cache(self) -> bool: ...

    def start(self) -> None: ...

    def stop(self, timeout: float = 30.0) -> None: ...


@dataclass
class _Tracked:
    """A request the loop is feeding, with what metrics need between its outputs."""

    request: Request
    sink: OutputSink
    stream_interval: int = 1  # Submission.stream_interval
    length_class: str | None = None
    tokens_seen: int = 0
    last_token_time: float = 0.0
    tokens_sent: int = 0  # tokens of the last output handed to the sink

    def due(self, out: RequestOutput, tokens: int) -> bool:
        """Whether ``out`` (of ``tokens`` tokens) goes to the sink now (see ``stream_interval``)."""
        if out.finished or self.stream_interval == 1:
            return True
        if self.stream_interval == 0:
            return False
        return (self.tokens_sent == 0 < tokens) or tokens - self.tokens_sent >= self.stream_interval


class EngineLoop:
    """Runs ``engine`` on a daemon thread; see the module docstring.

    ``max_queue`` bounds the requests waiting to start (in the inbox or the engine's waiting queue);
    :meth:`submit` raises :class:`QueueFullError` beyond it (None: unbounded).

    Supervision: when a step raises, every request in flight (and every submission not yet in the
    engine) gets :class:`EngineFailedError`, the engine is reset (all KV blocks free, see
    :meth:`LLMEngine.reset`) and the loop goes on. While that runs :attr:`alive` is False, so ``/health``
    answers 503 and new requests are refused. More than ``max_restarts`` failures within
    ``restart_window`` seconds (or a reset that fails) mean the fault is not passing: the loop stops for
    good and calls ``on_fatal`` (the server then exits non-zero, for its supervisor to restart it).
    """

    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_queue: int | None = None,
        snapshot_interval: float = 0.01,
        max_idle_wait: float = 0.05,
        max_restarts: int = 3,
        restart_window: float = 60.0,
        on_fatal: Callable[[BaseException], None] | None = None,
        model_name: str | None = None,
        on_change: Callable[["EngineLoop"], None] | None = None,
    ) -> None:
        self.engine = engine
        self.facts = EngineFacts.of(engine)
        self.max_queue = max_queue
        self.snapshot_interval = snapshot_interval
        self.max_idle_wait = max_idle_wait  # longest sleep while the policy holds queued work back
        self.clock = engine.clock
        # The name vLLM's metrics carry (``model_name``): the served name, as the API reports it.
        self.model_name = model_name or self.facts.model_name
        self.metrics = ServerMetrics(snapshot=self.snapshot, model_name=self.model_name)
        self._cond = threading.Condition()
        self._inbox: list[_Command] = []
        self._in_transit = 0  # submissions taken from the inbox, not yet counted in _num_waiting
        self._num_waiting = (
            0  # the engine's waiting requests after the last step (held choices too)
        )
        self._stopping = False
        self._error: BaseException | None = None  # set when the loop gave up (see on_fatal)
        self._recovering = False
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self.on_fatal = on_fatal
        self.restarts = 0  # failures recovered from, ever
        self._restart_times: list[float] = []
        # Called on the engine thread when the snapshot, the waiting count or ``alive`` may have
        # changed (the engine process forwards them to the server's process).
        self.on_change = on_change
        self.num_taken = 0  # submissions taken from the inbox (added or refused), ever
        self._tracked: dict[str, _Tracked] = {}
        self._thread: threading.Thread | None = None
        self._last_publish = 0.0
        self._snapshot = self._take_snapshot(pending=0)

    # --- lifecycle ---------------------------------------------------------------------------
    @classmethod
    def on_own_thread(cls, build: Callable[[], LLMEngine], **kwargs: Any) -> "EngineLoop":
        """Start a thread that builds the engine (``build()``: load, warm up), then runs the loop;
        return the running loop (or raise what ``build`` raised). ``kwargs`` go to the constructor.

        Why one thread for both: libgomp gives each thread that runs a parallel region an OpenMP team
        of its own, and once its teams hold more threads than there are CPUs it throttles every spin
        wait to 100 iterations. An engine built and warmed up on one thread and stepped on another
        made two teams, and every parallel region of a step then waited for its threads to wake
        (decode through the server ran at half the offline speed on 2 CPUs; engine/omp_spin.py)."""
        handoff: queue.Queue[EngineLoop | BaseException] = queue.Queue(maxsize=1)

        def main() -> None:
            try:
                loop = cls(build(), **kwargs)
            except BaseException as e:  # noqa: BLE001 - the caller raises it
                handoff.put(e)
                return
            handoff.put(loop)
            loop.run_here()

        threading.Thread(target=main, name="plaserve-engine", daemon=True).start()
        got = handoff.get()
        if isinstance(got, BaseException):
            raise got
        return got

    def run_here(self) -> None:
        """Run the loop on the calling thread until :meth:`stop` (instead of :meth:`start`)."""
        self._thread = threading.current_thread()
        self._run()

    def start(self) -> None:
        """Start the engine thread (once)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="plaserve-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the current step; unfinished requests get :class:`EngineStoppedError`."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        """True while the engine thread runs and takes requests (not stopping, recovering or given up)."""
        return (
            self._thread is not None
            and self._thread.is_alive()
            and not self._stopping
            and self._error is None
            and not self._recovering
        )

    @property
    def num_waiting(self) -> int:
        """The engine's waiting requests as of the last step (held choices too)."""
        return self._num_waiting

    # --- called from HTTP handlers (any thread) ----------------------------------------------
    def snapshot(self) -> EngineSnapshot:
        """The latest published load (at most ``snapshot_interval`` old while busy, exact when idle)."""
        return self._snapshot

    def submit(self, submissions: list[Submission]) -> None:
        """Queue requests for the engine, all or none. Raises QueueFullError or EngineStoppedError, and
        ValueError for more requests than the queue can ever hold."""
        with self._cond:
            if not self.alive:
                raise EngineStoppedError("the engine is not running")
            if self.max_queue is not None:
                queued = (
                    self._num_waiting
                    + self._in_transit
                    + sum(isinstance(c, Submission) for c in self._inbox)
                )
                check_queue(self.max_queue, queued, len(submissions), self._snapshot)
            self._inbox.extend(submissions)
            self._cond.notify()

    def abort(self, request_id: str) -> None:
        """Ask the engine to drop a request and free its KV blocks (no-op once it finished)."""
        with self._cond:
            self._inbox.append(_Abort(request_id))
            self._cond.notify()

    async def call(self, fn: Callable[["EngineLoop"], Any]) -> Any:
        """Run ``fn(self)`` on the engine thread between steps and return what it returns (or raise
        what it raises): how code outside the engine thread touches the engine's books, e.g. the KV
        transfers of prefill/decode disaggregation. EngineStoppedError when the loop is not running."""
        aloop = asyncio.get_running_loop()
        future = aloop.create_future()

        def settle(ok: bool, value: Any) -> None:  # on the engine thread
            def resolve() -> None:
                if not future.done():
                    (future.set_result if ok else future.set_exception)(value)

            try:
                aloop.call_soon_threadsafe(resolve)
            except RuntimeError:  # the event loop is closed: nobody is waiting
                pass

        self.post(fn, settle)
        return await future

    def post(self, fn: Callable[["EngineLoop"], Any], settle: Callable[[bool, Any], None]) -> None:
        """Queue ``fn(self)`` for the engine thread between steps; ``settle(ok, result or error)``
        gets its outcome there (:meth:`call` for a coroutine to await). EngineStoppedError when the
        loop is not running."""
        with self._cond:
            if not self.alive:
                raise EngineStoppedError("the engine is not running")
            self._inbox.append(_Call(fn, settle))
            self._cond.notify()

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False while a request holds KV blocks."""
        return await self.call(lambda loop: loop.engine.reset_prefix_cache())

    def count_error(self, status: int) -> None:
        """Count an HTTP error answer in the metrics (any thread)."""
        self.metrics.count_error(status)

    async def render_metrics(self) -> bytes:
        """The Prometheus exposition of :attr:`metrics`."""
        return self.metrics.render()

    def adopt(self, req: Request, sink: OutputSink, stream_interval: int = 1) -> None:
        """Engine thread only: follow ``req``, a request put into the engine directly (not through
        :meth:`submit`), and deliver its output so far (it may have its first token already);
        ``stream_interval`` as :attr:`Submission.stream_interval`."""
        self._tracked[req.request_id] = _Tracked(req, sink, stream_interval)
        # It may have finished on that token (``max_tokens`` 1, a stop token): then nothing else will.
        if (item := self._deliver(RequestOutput.of(req), self.clock())) is not None:
            deliver([item])

    # --- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                self._serve()
                break  # asked to stop
            except Exception as e:  # noqa: BLE001 - any failure of a step is survivable once
                log.exception("engine step failed")
                if not self._recover(e):
                    break
        self._fail_all(
            EngineStoppedError(
                "the engine stopped"
                if self._error is None
                else f"the engine failed: {self._error!r}"
            )
        )

    def _serve(self) -> None:
        """Take commands and step until asked to stop; a failing step raises out of here."""
        while True:
            commands = self._next_commands()
            if commands is None:
                return
            self._apply(commands)
            # Published as a step starts, with the inbox applied: a router reading it (``GET /load``
            # gives its age) knows the engine has worked off the backlog since, one second per second.
            busy = self.engine.has_unfinished()
            self._publish(force=not busy)
            if busy:
                self._step()
                if not self.engine.has_unfinished():
                    self._publish(force=True)  # going idle: the last step's results

    def _recover(self, error: Exception) -> bool:
        """After a failed step: fail what is in flight, reset the engine. False: give up (see class doc)."""
        with self._cond:
            self._recovering = True
        self._changed()
        self._fail_all(
            EngineFailedError(
                f"the engine failed ({error!r}) and restarted; this request was aborted, retry it"
            ),
            reason="error",
        )
        now = time.monotonic()
        self._restart_times = [t for t in self._restart_times if now - t < self.restart_window]
        fatal: BaseException | None = None
        if len(self._restart_times) >= self.max_restarts:
            log.critical(
                "engine failed %d times within %.0f s: giving up",
                len(self._restart_times) + 1,
                self.restart_window,
            )
            fatal = error
        else:
            try:
                self.engine.reset()
            except Exception as e:  # noqa: BLE001
                log.critical("engine reset failed: giving up", exc_info=e)
                fatal = e
        if fatal is not None:
            self._error = fatal
            with self._cond:
                self._recovering = False
            if self.on_fatal is not None:
                self.on_fatal(fatal)
            return False
        self._restart_times.append(now)
        self.restarts += 1
        self.metrics.count_restart()
        self._count_waiting()
        self._publish(force=True)
        with self._cond:
            self._recovering = False
        self._changed()
        log.warning(
            "engine restarted after a failure (%d so far); all KV blocks are free", self.restarts
        )
        return True

    def _next_commands(self) -> list[_Command] | None:
        """Take the inbox, sleeping while there is nothing at all to do. None: stop."""
        with self._cond:
            while not self._inbox and not self._stopping and not self.engine.has_unfinished():
                self._cond.wait()
            if self._stopping:
                return None
            commands, self._inbox = self._inbox, []
            self._in_transit = sum(isinstance(c, Submission) for c in commands)
            return commands

    def _apply(self, commands: list[_Command]) -> None:
        for cmd in commands:
            if isinstance(cmd, Submission):
                self._add(cmd)
            elif isinstance(cmd, _Call):
                self._run_call(cmd)
            else:
                self._abort(cmd.request_id)
        self._count_waiting()

    def _add(self, sub: Submission) -> None:
        self.num_taken += 1
        try:
            req = self.engine.add_request(
                sub.prompt_token_ids,
                sub.params,
                request_id=sub.request_id,
                arrival_time=sub.arrival_time,
                after=sub.after,
            )
        except ValueError as e:  # validated on the HTTP side already; this is the safety net
            sub.sink.put(e)
            return
        self._tracked[req.request_id] = _Tracked(req, sub.sink, sub.stream_interval)

    def _run_call(self, call: _Call) -> None:
        try:
            result, ok = call.fn(self), True
        except Exception as e:  # noqa: BLE001 - the caller gets it
            result, ok = e, False
        call.settle(ok, result)

    def _count_waiting(self) -> None:
        with self._cond:
            self._num_waiting = self.engine.num_waiting
            self._in_transit = 0
        self._changed()

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change(self)

    def _abort(self, request_id: str) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None or not self.engine.abort(request_id):
            return
        req = tracked.request
        cls = tracked.length_class or self.engine.length_class(req)
        self.metrics.observe_finish(
            cls, "abort", None, req.num_prompt_tokens, len(req.output_token_ids)
        )

    def _step(self) -> None:
        outputs = self.engine.step()
        now = self.clock()
        deliver([d for out in outputs if (d := self._deliver(out, now)) is not None])
        self._count_waiting()
        with self._cond:
            if self.engine.last_batch is None and not self._inbox and not self._stopping:
                # The policy ran nothing although work is queued (it holds short requests for a batch
                # window): sleep until it will have work instead of spinning; a new command wakes us early.
                wake = self.engine.next_wakeup()
                delay = self.max_idle_wait if wake is None else wake - self.clock()
                if delay > 0:
                    self._cond.wait(min(delay, self.max_idle_wait))

    def _deliver(self, out: RequestOutput, now: float) -> tuple[OutputSink, RequestOutput] | None:
        """Record ``out`` in the metrics; where it goes (None: a request the loop no longer tracks, or
        an output its stream interval skips)."""
        tracked = self._tracked.get(out.request_id)
        if tracked is None:
            return None
        n = len(out.outputs[0].token_ids)
        if n > tracked.tokens_seen:
            if tracked.tokens_seen == 0:
                tracked.length_class = self.engine.length_class(tracked.request)
                ttft = out.metrics.ttft
                self.metrics.observe_first_token(
                    tracked.length_class, ttft if ttft is not None else 0.0
                )
            else:
                self.metrics.observe_token_gap(tracked.length_class, now - tracked.last_token_time)
            tracked.tokens_seen, tracked.last_token_time = n, now
        if out.finished:
            del self._tracked[out.request_id]
            cls = tracked.length_class or self.engine.length_class(tracked.request)
            m = out.metrics
            e2e = None if m.finish_time is None else m.finish_time - m.arrival_time
            self.metrics.observe_finish(
                cls,
                out.outputs[0].finish_reason or "stop",
                e2e,
                len(out.prompt_token_ids),
                n,
                times=m,
                max_tokens=tracked.request.params.max_tokens,
            )
        if not tracked.due(out, n):
            return None
        tracked.tokens_sent = n
        return tracked.sink, out

    def _fail_all(self, error: BaseException, reason: str = "abort") -> None:
        """Hand ``error`` to every request the loop knows of; the finished ones count as ``reason``."""
        with self._cond:
            pending = [c for c in self._inbox if isinstance(c, Submission)]
            calls = [c for c in self._inbox if isinstance(c, _Call)]
            self._inbox = []
            self._in_transit = 0
        for sub in pending:
            sub.sink.put(error)
        for call in calls:
            call.settle(False, error)
        for tracked in self._tracked.values():
            req = tracked.request
            cls = tracked.length_class or req.length_class
            self.metrics.observe_finish(
                cls, reason, None, req.num_prompt_tokens, len(req.output_token_ids)
            )
            tracked.sink.put(error)
        self._tracked.clear()

    def _publish(self, force: bool = False) -> None:
        """Publish a fresh snapshot, at most every ``snapshot_interval`` unless ``force`` (going idle)."""
        now = time.monotonic()
        if not force and now - self._last_publish < self.snapshot_interval:
            return
        with self._cond:
            pending = sum(isinstance(c, Submission) for c in self._inbox)
        self._snapshot = self._take_snapshot(pending)
        self._last_publish = now
        self._changed()

    def _take_snapshot(self, pending: int) -> EngineSnapshot:
        sched = self.engine.scheduler
        num_tokens = sum(r.num_tokens for r in list(sched.waiting) + list(sched.running))
        return EngineSnapshot(
            load=self.engine.load_report(),
            stats=dict(self.engine.stats),
            num_tokens=num_tokens,
            pending=pending,
            time=time.time(),
            monotonic=time.monotonic(),
        )
