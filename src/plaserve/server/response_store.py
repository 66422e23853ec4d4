"""The Responses API's store: finished Responses kept for ``GET /v1/responses/{id}``, their input
items and ``previous_response_id`` (docs/SERVER.md).

Each Response is kept with the whole conversation that went into it (its input items, those of the
responses it continued first), so a follow-up reads one entry however long the chain; the store holds
at most ``max_bytes`` of JSON text (characters) and forgets the least recently used Responses first,
so a server that answers for weeks does not grow without bound (vLLM's store keeps everything until
restart, which is why it is off there by default).

Ids carry the store's ``tag`` (``resp_<tag><random>``), and ``/load`` reports it, so a router finds
the worker that holds a Response from its id alone (plaserve.router.proxy).
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
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

    @property
    def size(self) -> int:
        """Characters of JSON, as counted against the store's bound."""
        return len(self.response_json) + len(self.items_json)

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
    forgotten first. Used from the server's event loop only, so it takes no lock."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"the response store's size must be >= 0, not {max_bytes}")
        self.max_bytes = max_bytes
        self.tag = uuid.uuid4().hex[:TAG_CHARS]
        self._entries: OrderedDict[str, Stored] = OrderedDict()
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

    def put(self, response: dict[str, Any], input_items: list[dict[str, Any]]) -> bool:
        """Keep ``response`` (by its ``id``) with the items it answered; False where it alone is larger
        than the whole store (then nothing is kept)."""
        entry = Stored(_compact(response), _compact(input_items))
        if not self.enabled or entry.size > self.max_bytes:
            return False
        self.delete(response["id"])
        self._entries[response["id"]] = entry
        self.bytes += entry.size
        while self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.size
            self.evicted += 1
        return True

    def get(self, rid: str) -> Stored | None:
        """The kept Response ``rid`` (now the most recently used), or None."""
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        """Forget ``rid``; False where it was not kept."""
        entry = self._entries.pop(rid, None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True

    def describe(self) -> dict[str, Any]:
        """What ``/load`` reports: the id prefix (for routers) and the store's size."""
        return {
            "id_prefix": self.id_prefix,
            "stored": len(self._entries),
            "bytes": self.bytes,
            "max_bytes": self.max_bytes,
            "evicted": self.evicted,
        }
