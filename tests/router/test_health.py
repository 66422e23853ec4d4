"""``/load`` polls: a report is dated back by the age of the state it describes."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from plaserve.cost import CostModel
from plaserve.launcher import free_port
from plaserve.router.config import BreakerConfig, HealthConfig
from plaserve.router.health import (
    WorkerMonitor,
    parse_age,
    parse_backlog_tokens,
    parse_response_prefix,
)
from plaserve.router.workers import Worker


@pytest.mark.parametrize(
    "body, age",
    [
        ({"age_s": 0.25}, 0.25),
        ({"age_s": 0}, 0.0),
        ({}, 0.0),
        ({"age_s": "0.2"}, 0.0),
        ({"age_s": -1.0}, 0.0),
        ({"age_s": True}, 0.0),
        ({"age_s": 1e9}, 0.0),
    ],
)
def test_parse_age_accepts_only_sane_numbers(body, age):
    assert parse_age(body) == age


def poll(body: dict) -> Worker:
    """A worker priced at 1 ms a token, with one request sent at 9.8, after one ``/load`` poll at 10.0
    of a real server answering ``body``."""

    async def main():
        async def load(_: web.Request) -> web.Response:
            return web.json_response(body)

        app = web.Application()
        app.router.add_get("/load", load)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        clock = [10.0]
        worker = Worker(f"http://127.0.0.1:{port}", CostModel(g1=1e-3, g2=0.0), BreakerConfig())
        worker.start(1, 0.2, 200, "short", now=9.8)  # sent after the state the report describes
        async with aiohttp.ClientSession() as session:
            monitor = WorkerMonitor(
                HealthConfig(),
                lambda: session,
                lambda: [worker],
                on_change=lambda: None,
                on_load=lambda w, body: None,
                clock=lambda: clock[0],
            )
            await monitor.poll_load(worker)
        await runner.cleanup()
        return worker

    return asyncio.run(main())


def test_poll_dates_the_report_back_by_its_age():
    w = poll({"backlog_s": {"short": 0.5, "long": 1.0}, "num_requests": 3, "age_s": 0.25})
    assert w.supports_load and w.load.num_requests == 3
    assert (w.load.sent, w.load.received) == (pytest.approx(9.75), pytest.approx(9.75))
    # 1.5 s reported, 0.25 s of it worked off since the state was taken, plus the request it cannot hold.
    assert w.backlog(10.0) == pytest.approx(1.5 - 0.25 + 0.2)


@pytest.mark.parametrize(
    "body, tokens",
    [
        ({"backlog_tokens": [[300, 0], [20, 1000]]}, [(300, 0), (20, 1000)]),
        ({"backlog_tokens": []}, []),
        ({}, None),
        ({"backlog_tokens": [[300, -1]]}, None),
        ({"backlog_tokens": [[300]]}, None),
        ({"backlog_tokens": [[True, 0]]}, None),
        ({"backlog_tokens": [["300", 0]]}, None),
        ({"backlog_tokens": {"a": 1}}, None),
    ],
)
def test_parse_backlog_tokens(body, tokens):
    assert parse_backlog_tokens(body) == tokens


def test_a_report_that_lists_its_tokens_is_priced_by_the_routers_model():
    """Under a profile the router prices every worker by one model, and each worker's backlog_s is in
    its own: the report's tokens, priced as the router prices, keep the two in one unit."""
    body = {"backlog_s": {"short": 1.5, "long": 0.0}, "num_requests": 2}
    w = poll(body | {"backlog_tokens": [[300, 0], [200, 100]]})
    assert w.backlog(10.0) == pytest.approx(0.5)  # 500 tokens at 1 ms (the request sent is in it)
    w = poll(body | {"backlog_tokens": [[300, "x"]]})  # malformed: backlog_s as it is
    assert w.backlog(10.0) == pytest.approx(1.5)


def test_a_workers_response_prefix_is_read_only_where_it_keeps_responses() -> None:
    kept = {"responses": {"id_prefix": "resp_0123456789ab", "max_bytes": 1024}}
    assert parse_response_prefix(kept) == "resp_0123456789ab"
    assert parse_response_prefix({"responses": {**kept["responses"], "max_bytes": 0}}) is None
    for odd in ({}, {"responses": None}, {"responses": {"id_prefix": "resp_", "max_bytes": 9}}):
        assert parse_response_prefix(odd) is None  # vLLM's /load, or a prefix naming no store
