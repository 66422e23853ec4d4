"""One HTTP request's engine requests, seen from the event loop: submit, follow, abort what is left.

A request with several prompts (a completions batch) becomes several engine requests sharing one
asyncio queue. Whatever way the handler ends (finished, client gone, cancelled), :meth:`Generation.close`
aborts the engine requests that are still running, so their KV blocks are freed.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Awaitable, TypeVar

from starlette.requests import Request as HttpRequest
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from plaserve.request import RequestOutput, SamplingParams
from plaserve.server.engine_loop import (
    EngineHandle,
    EngineStoppedError,
    OutputSink,
    QueueFullError,
    Submission,
)
from plaserve.server.errors import ApiError

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


class Generation:
    """The engine requests of one HTTP request; create with :meth:`submit`."""

    def __init__(
        self, engine_loop: EngineHandle, submissions: list[Submission], queue: asyncio.Queue
    ) -> None:
        self.engine_loop = engine_loop
        self.submissions = submissions
        self.queue = queue
        self.final: dict[int, RequestOutput] = {}
        self._aborted: set[int] = set()

    @classmethod
    def submit(
        cls,
        engine_loop: EngineHandle,
        request_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        n: int = 1,
        stream_interval: int = 1,
    ) -> "Generation":
        """Queue one engine request per prompt (ids ``{request_id}-{i}``), where each run of ``n``
        consecutive prompts is one prompt's choices; 429 when the queue is full, 503 when the engine is
        not running, 400 for more requests than the queue can hold. ``stream_interval``: see
        :attr:`~plaserve.server.engine_loop.Submission.stream_interval`.

        A prompt's other choices name its first (``Submission.after``): the engine holds them until
        that one's prompt blocks are cached, where that pays."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        arrival = engine_loop.clock()  # TTFT counts from here, including time in the inbox

        def leader(i: int) -> str | None:
            return f"{request_id}-{i - i % n}" if i % n else None

        subs = [
            Submission(
                f"{request_id}-{i}",
                ids,
                p,
                arrival,
                OutputSink(loop, queue, i),
                leader(i),
                stream_interval,
            )
            for i, (ids, p) in enumerate(zip(prompts, params))
        ]
        queue_submissions(engine_loop, subs)
        return cls(engine_loop, subs, queue)

    @property
    def done(self) -> bool:
        return len(self.final) == len(self.submissions)

    async def updates(self) -> AsyncIterator[dict[int, RequestOutput]]:
        """Batches of the newest output per choice index, until every choice finished.

        Outputs that queued up while the consumer was busy are merged (each output holds the full text
        so far), so a slow client gets fewer, larger deltas instead of falling behind.
        """
        while not self.done:
            batch: dict[int, RequestOutput] = {}
            index, item = await self.queue.get()
            while True:
                if isinstance(item, BaseException):
                    raise _as_api_error(item)
                if item.finished and item.outputs[0].finish_reason == "error":
                    raise ApiError(
                        500,
                        "the model's logits for this request were not finite (NaN or infinity), "
                        "so no token could be sampled; the request failed",
                    )
                batch[index] = item
                if item.finished:
                    self.final[index] = item
                try:
                    index, item = self.queue.get_nowait()
                except asyncio.QueueEmpty:
                    break
            yield batch

    def outputs(self) -> list[RequestOutput]:
        """The final output of every choice, in choice order (once :attr:`done`)."""
        return [self.final[i] for i in range(len(self.submissions))]

    async def result(self) -> list[RequestOutput]:
        """Wait for every choice to finish; outputs in choice order."""
        async for _ in self.updates():
            pass
        return self.outputs()

    def close(self) -> None:
        """Abort every engine request that has not finished (idempotent)."""
        for i, sub in enumerate(self.submissions):
            if i not in self.final and i not in self._aborted:
                self._aborted.add(i)
                self.engine_loop.abort(sub.request_id)


def _as_api_error(error: BaseException) -> ApiError:
    if isinstance(error, ApiError):
        return error
    if isinstance(error, EngineStoppedError):
        return ApiError(503, str(error))
    if isinstance(error, ValueError):
        return ApiError(400, str(error))
    return ApiError(500, f"internal error: {error!r}")


async def until_disconnect(request: HttpRequest, work: Awaitable[T]) -> T:
    """Run ``work`` unless the client disconnects first (then raise :class:`ClientDisconnected`).

    Only for handlers that have read the whole body: the next ASGI message is then the disconnect.
    """

    async def wait_disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientDisconnected()
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response that always closes its generator, however the stream ends.

    Starlette cancels the generator when it notices a disconnect, but depending on the ASGI spec version
    it may instead just stop iterating; closing it here runs the generator's ``finally`` (which aborts
    the engine requests) in every case.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def queue_submissions(engine_loop: EngineHandle, subs: list[Submission]) -> None:
    """``engine_loop.submit(subs)``, its refusals as API errors: 429 when the queue is full, 503 when
    the engine is not running, 400 for more requests than the queue can ever hold."""
    try:
        engine_loop.submit(subs)
    except QueueFullError as e:
        retry = max(1, int(-(-e.retry_after // 1)))
        raise ApiError(
            429, str(e), code="queue_full", headers={"Retry-After": str(retry)}
        ) from None
    except EngineStoppedError as e:
        raise ApiError(503, str(e)) from None
    except ValueError as e:  # larger than the queue: retrying would not help
        raise ApiError(400, str(e)) from None
