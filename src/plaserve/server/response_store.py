"""The Responses API's store: finished Responses kept for ``GET /v1/responses/{id}``, their input
items and ``previous_response_id`` (docs/SERVER.md).

Each Response is kept with the whole conversation that went into it (its input items, those of the
responses it continued first), so a follow-up reads one entry however long the chain; the store holds
at most ``max_bytes`` of JSON text (characters) and forgets the least recently used Responses first,
so a server that answers for weeks does not grow without bound (vLLM's store keeps everything until
restart, which is why it is off there by default).

Ids carry the store's ``tag`` (``resp_<tag><random>``), and ``/load`` reports it, so a router finds
the worker that holds a Response from its id alone (plaserve.router.proxy).

A streamed background Response's events are kept too (:class:`EventLog` while it runs, then in its
entry, counted against the bound), so that ``GET /v1/responses/{id}?stream=true&starting_after=N``
resumes a stream whose client went away, while the Response runs or after it ended.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

ID_PREFIX = "resp_"
TAG_CHARS = 12  # hex digits of a store's tag in its ids


@dataclass(frozen=True)
class Stored:
    """One kept Response and the input items it answered (the conversation before its output), kept
    as JSON text: so the store's bound is what it takes (as Python dicts, text-heavy entries took
    1.4x their JSON, more with many small fields), and it is read back rarely."""

    response_json: str
    items_json: str
    events: str = ""  # a streamed background Response's server-sent events, as they went out

    @property
    def size(self) -> int:
        """Characters of JSON (and events), as counted against the store's bound."""
        return len(self.response_json) + len(self.items_json) + len(self.events)

    @property
    def response(self) -> dict[str, Any]:
        return json.loads(self.response_json)

    @property
    def input_items(self) -> list[dict[str, Any]]:
        return json.loads(self.items_json)

    def conversation(self) -> list[dict[str, Any]]:
        """What a follow-up continues: the input items, then the Response's output items."""
        return [*self.input_items, *self.response["output"]]


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class ResponseStore:
    """Finished Responses by id, at most ``max_bytes`` of them (0: keep nothing), least recently used
    forgotten first; background Responses still running are kept whatever the bound (their client
    polls them by id), and join the others when they end. Used from the server's event loop only, so
    it takes no lock."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"the response store's size must be >= 0, not {max_bytes}")
        self.max_bytes = max_bytes
        self.tag = uuid.uuid4().hex[:TAG_CHARS]
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self._running: dict[str, Stored] = {}  # background Responses still generating: not evicted
        self.bytes = 0
        self.evicted = 0  # Responses forgotten to stay within max_bytes

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def id_prefix(self) -> str:
        """How every id this store hands out begins."""
        return ID_PREFIX + self.tag

    def new_id(self) -> str:
        return self.id_prefix + uuid.uuid4().hex

    def put(
        self,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        events: str = "",
        running: bool = False,
    ) -> bool:
        """Keep ``response`` (by its ``id``, replacing what was kept under it) with the items it
        answered (and its stream's ``events``); ``running``: a background Response still generating,
        kept until it is put again finished. False where a finished one alone is larger than the
        whole store (then nothing is kept under its id)."""
        if not self.enabled:
            return False
        rid = response["id"]
        self.delete(rid)
        entry = Stored(_compact(response), _compact(input_items), events)
        if running:
            self._running[rid] = entry
        elif entry.size > self.max_bytes:
            return False
        else:
            self._entries[rid] = entry
        self.bytes += entry.size
        while self.bytes > self.max_bytes and self._entries:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.size
            self.evicted += 1
        return True

    def get(self, rid: str) -> Stored | None:
        """The kept Response ``rid`` (now the most recently used), or None."""
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry if entry is not None else self._running.get(rid)

    def delete(self, rid: str) -> bool:
        """Forget ``rid``; False where it was not kept."""
        entry = self._entries.pop(rid, None) or self._running.pop(rid, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True

    def describe(self) -> dict[str, Any]:
        """What ``/load`` reports: the id prefix (for routers) and the store's size."""
        return {
            "id_prefix": self.id_prefix,
            "stored": len(self._entries) + len(self._running),
            "running": len(self._running),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "evicted": self.evicted,
        }


class EventLog:
    """A streamed background Response's server-sent events in order (an event's index is its
    ``sequence_number``), for any number of readers: the client that asked for it and those that
    resume it. It is written from the server's event loop only."""

    def __init__(self, events: list[str] | None = None, closed: bool = False) -> None:
        self.events = events if events is not None else []
        self.closed = closed
        self._wake = asyncio.Event()  # set (and replaced) at each change, for the readers waiting

    @classmethod
    def replay(cls, text: str) -> "EventLog":
        """The closed log of a finished stream's ``text`` (:attr:`text`). Each event ends with a blank
        line and holds none: its data is one line of JSON, which escapes line breaks."""
        return cls([event + "\n\n" for event in text.split("\n\n")[:-1]], closed=True)

    @property
    def text(self) -> str:
        return "".join(self.events)

    def _changed(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    def append(self, event: str) -> None:
        self.events.append(event)
        self._changed()

    def close(self) -> None:
        """No more events: the readers end once they have the last."""
        self.closed = True
        self._changed()

    async def follow(self, after: int = -1) -> AsyncIterator[str]:
        """The events after sequence number ``after`` (all by default), then each new one as it comes,
        until the log is closed."""
        index = after + 1
        while True:
            wake = self._wake  # taken before looking, so a change after the look wakes this reader
            while index < len(self.events):
                yield self.events[index]
                index += 1
            if self.closed:
                return
            await wake.wait()
