"""The KV transfer service: one TCP port per worker, from which decode workers pull parked KV blocks.

Wire protocol (asyncio streams; one connection per pull, docs/PD.md):

1. the puller sends one JSON line ``{"request_id": ..., "start_block": k, "layout": {...}}``: the
   parked request, the first block it lacks (the blocks before are in its prefix cache) and its own
   :class:`~plaserve.engine.kv_transfer.KVLayout`;
2. the server answers one JSON line, ``{"ok": true, "num_blocks": m}`` or ``{"ok": false, "error":
   ...}`` (unknown or expired request, mismatched layout);
3. then, layer by layer, the K bytes of the ``m`` whole blocks and their V bytes;
4. the puller answers ``ok`` once everything is written; only then does the server free the parked
   blocks. A pull that fails half-way leaves them parked until their expiry, so a retry may pull again.

A decode worker whose client left before the pull sends ``{"request_id": ..., "release": true}``
instead (:func:`release`): the server frees the parked blocks at once (nobody will pull them) and
answers ``{"ok": true, "released": bool}``.

Transfers are counted by direction (``sent``/``received``): seconds, bytes, blocks, failures, and the
blocks a decode worker did not pull because its prefix cache had them (``plaserve_kv_transfer_*``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from plaserve.engine.kv_transfer import KVTransferError, Reservation
from plaserve.server.engine_loop import EngineLoop

log = logging.getLogger(__name__)

_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
MAX_LINE = 64 * 1024  # a request or header line; anything longer is not this protocol
# The puller's read buffer: whole layers arrive in few, large reads instead of 64 KiB pause/resume
# cycles of the transport.
PULL_BUFFER = 8 * 2**20


class KVTransferMetrics:
    """The transfer counters of one worker, in its server's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        d = ["direction"]
        self.seconds = Histogram(
            "plaserve_kv_transfer_seconds",
            "Time of one request's KV transfer (connect to last byte), by direction",
            d,
            buckets=_SECONDS_BUCKETS,
            registry=registry,
        )
        self.bytes = Counter(
            "plaserve_kv_transfer_bytes", "KV bytes moved, by direction", d, registry=registry
        )
        self.blocks = Counter(
            "plaserve_kv_transfer_blocks", "KV blocks moved, by direction", d, registry=registry
        )
        self.failures = Counter(
            "plaserve_kv_transfer_failures", "KV transfers that failed", d, registry=registry
        )
        self.prefix_hits = Counter(
            "plaserve_kv_transfer_prefix_hit_blocks",
            "Prompt blocks a decode worker had in its prefix cache, so did not pull",
            registry=registry,
        )
        self.expired = Counter(
            "plaserve_kv_transfer_expired",
            "Parked prefills freed because their pull did not come in time",
            registry=registry,
        )
        self.released = Counter(
            "plaserve_kv_transfer_released",
            "Parked prefills freed at a decode worker's word: its client left before the pull",
            registry=registry,
        )
        self.parked = Gauge(
            "plaserve_kv_parked_blocks",
            "KV blocks held for decode workers to pull",
            registry=registry,
        )


@dataclass
class PullResult:
    """What one pull moved and how long it took."""

    num_blocks: int
    num_bytes: int
    seconds: float


class KVTransferService:
    """Serves the parked KV of ``engine_loop``'s engine on ``host:port`` (port 0: any free one) and
    frees parked exports at their expiry, checked every ``expiry_interval`` seconds."""

    def __init__(
        self,
        engine_loop: EngineLoop,
        metrics: KVTransferMetrics,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        expiry_interval: float = 0.5,
        ack_timeout: float = 30.0,
    ) -> None:
        self.loop = engine_loop
        self.metrics = metrics
        self.host = host
        self.port = port
        self.expiry_interval = expiry_interval
        self.ack_timeout = ack_timeout
        self._server: asyncio.base_events.Server | None = None
        self._expiry: asyncio.Task | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> None:
        """Listen; :attr:`port` is the bound port afterwards."""
        self._server = await asyncio.start_server(self._serve, self.host, self.port, limit=MAX_LINE)
        self.port = self._server.sockets[0].getsockname()[1]
        self._expiry = asyncio.create_task(self._expire_loop())
        log.info("KV transfer service on %s:%d", self.host, self.port)

    async def stop(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
            await asyncio.gather(self._expiry, return_exceptions=True)
        if self._server is not None:
            self._server.close()
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    async def _expire_loop(self) -> None:
        def tick(loop: EngineLoop) -> tuple[int, int]:
            handoff = loop.engine.kv_handoff
            return handoff.expire(), handoff.num_parked_blocks

        while True:
            await asyncio.sleep(self.expiry_interval)
            try:
                expired, parked = await self.loop.call(tick)
            except Exception:  # noqa: BLE001 - the engine is restarting or stopping; try next tick
                continue
            if expired:
                log.warning("freed %d parked KV export(s) whose pull did not come", expired)
                self.metrics.expired.inc(expired)
            self.metrics.parked.set(parked)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        start = time.monotonic()
        try:
            await self._send(reader, writer, start)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            self.metrics.failures.labels("sent").inc()
            log.warning("KV pull from %s failed: %r", writer.get_extra_info("peername"), e)
        finally:
            self._connections.discard(task)
            writer.close()

    async def _send(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, start: float
    ) -> None:
        try:
            ask = json.loads(await asyncio.wait_for(reader.readline(), self.ack_timeout))
            rid = str(ask["request_id"])
            if ask.get("release") is True:
                freed = await self.loop.call(lambda loop: loop.engine.kv_handoff.release(rid))
                self.metrics.released.inc(freed)
                writer.write(json.dumps({"ok": True, "released": freed}).encode() + b"\n")
                await writer.drain()
                return
            first = int(ask["start_block"])
            handoff = self.loop.engine.kv_handoff
            layout = handoff.layout()
            if ask.get("layout") != layout.as_dict():
                raise KVTransferError(
                    f"KV layouts differ: this worker has {layout.as_dict()}, the puller "
                    f"{ask.get('layout')} (the same model and dtype must run on both)"
                )
            blocks = await self.loop.call(
                lambda loop: loop.engine.kv_handoff.parked_blocks(rid, first)
            )
        except (ValueError, KeyError, TypeError, KVTransferError) as e:
            self.metrics.failures.labels("sent").inc()
            writer.write(json.dumps({"ok": False, "error": str(e)}).encode() + b"\n")
            await writer.drain()
            return
        writer.write(json.dumps({"ok": True, "num_blocks": len(blocks)}).encode() + b"\n")
        sent = 0
        for layer in range(layout.num_layers):
            k, v = (
                handoff.read_layer(layer, blocks) if blocks else (memoryview(b""), memoryview(b""))
            )
            writer.write(k)
            writer.write(v)
            sent += k.nbytes + v.nbytes
            await writer.drain()
        ack = await asyncio.wait_for(reader.readline(), self.ack_timeout)
        if ack.strip() != b"ok":
            raise ConnectionError(f"the puller did not confirm ({ack[:40]!r})")
        await self.loop.call(lambda loop: loop.engine.kv_handoff.release(rid))
        self.metrics.seconds.labels("sent").observe(time.monotonic() - start)
        self.metrics.bytes.labels("sent").inc(sent)
        self.metrics.blocks.labels("sent").inc(len(blocks))


async def pull(
    engine_loop: EngineLoop,
    metrics: KVTransferMetrics,
    host: str,
    port: int,
    request_id: str,
    res: Reservation,
    timeout: float,
) -> PullResult:
    """Pull the blocks ``res`` lacks of the prefill ``request_id`` parked at ``host:port`` into
    ``res``'s fresh blocks, layer by layer. Raises KVTransferError (refused, or the connection failed;
    the caller gives the reservation back) and asyncio.TimeoutError."""
    handoff = engine_loop.engine.kv_handoff
    layout = handoff.layout()
    start = time.monotonic()
    received = 0
    metrics.prefix_hits.inc(len(res.cached))
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, port, limit=PULL_BUFFER), timeout
        )
    except (OSError, asyncio.TimeoutError) as e:
        metrics.failures.labels("received").inc()
        raise KVTransferError(
            f"cannot reach the KV transfer service at {host}:{port}: {e!r}"
        ) from e
    try:
        ask = {"request_id": request_id, "start_block": len(res.cached), "layout": layout.as_dict()}
        writer.write(json.dumps(ask).encode() + b"\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout)
        if len(line) > MAX_LINE:
            raise KVTransferError("the prefill worker's answer is not this protocol")
        head = json.loads(line or b"null")
        if not isinstance(head, dict) or not head.get("ok"):
            error = head.get("error") if isinstance(head, dict) else "the connection closed"
            raise KVTransferError(f"the prefill worker refused the pull: {error}")
        if head.get("num_blocks") != len(res.fresh):
            raise KVTransferError(
                f"the prefill worker has {head.get('num_blocks')} blocks from block "
                f"{len(res.cached)} on, this worker expected {len(res.fresh)} (different prompts?)"
            )
        size = layout.block_bytes * len(res.fresh)
        for layer in range(layout.num_layers):
            if not res.fresh:
                break
            k = await asyncio.wait_for(reader.readexactly(size), timeout)
            v = await asyncio.wait_for(reader.readexactly(size), timeout)
            handoff.write_layer(layer, res.fresh, k, v)
            received += 2 * size
        writer.write(b"ok\n")
        await writer.drain()
    except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError, ValueError) as e:
        metrics.failures.labels("received").inc()
        raise KVTransferError(f"the KV pull from {host}:{port} failed: {e!r}") from e
    except KVTransferError:
        metrics.failures.labels("received").inc()
        raise
    finally:
        writer.close()
    seconds = time.monotonic() - start
    log.debug(
        "pulled %d blocks (%d bytes; %d cached here) of %s from %s:%d in %.1f ms",
        len(res.fresh),
        received,
        len(res.cached),
        request_id,
        host,
        port,
        seconds * 1000,
    )
    metrics.seconds.labels("received").observe(seconds)
    metrics.bytes.labels("received").inc(received)
    metrics.blocks.labels("received").inc(len(res.fresh))
    return PullResult(len(res.fresh), received, seconds)


async def release(host: str, port: int, request_id: str, timeout: float) -> bool:
    """Ask the prefill worker at ``host:port`` to free the KV it parked for ``request_id`` (a pull
    that will never come); whether it had it. Errors are logged, not raised: the parked KV expires
    all the same."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError) as e:
        log.info("could not release %s at %s:%d: %r", request_id, host, port, e)
        return False
    try:
        writer.write(json.dumps({"request_id": request_id, "release": True}).encode() + b"\n")
        await writer.drain()
        answer = json.loads(await asyncio.wait_for(reader.readline(), timeout) or b"null")
        return isinstance(answer, dict) and answer.get("released") is True
    except (OSError, asyncio.TimeoutError, ValueError) as e:
        log.info("could not release %s at %s:%d: %r", request_id, host, port, e)
        return False
    finally:
        writer.close()
