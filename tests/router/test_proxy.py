"""The router over HTTP, in front of fake GPUs: streaming, retries, errors, workers at run time."""

from __future__ import annotations

import asyncio
import json
import time

from plaserve.cost import CostModel
from plaserve.launcher import free_port
from plaserve.router.config import BreakerConfig, RouterConfig

from .conftest import FAST_HEALTH, cluster, gpu


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


async def stream_events(session, url: str, body: dict) -> list[tuple[float, dict | str]]:
    """(arrival time, event) for every server-sent event of a streamed request."""
    out = []
    async with session.post(url, json={**body, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        async for line in resp.content:
            line = line.strip()
            if line.startswith(b"data:"):
                data = line[5:].strip()
                out.append(
                    (time.perf_counter(), "[DONE]" if data == b"[DONE]" else json.loads(data))
                )
    return out


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples in Prometheus text (0 when absent)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name) and not line.startswith("#")
    )


def test_streams_pass_through_chunk_by_chunk():
    async def main():
        async with cluster([gpu(tbt_s=0.2, max_output_tokens=4)]) as c:
            events = await stream_events(
                c.session,
                c.url + "/v1/completions",
                {
                    "prompt": list(range(100)),
                    "max_tokens": 4,
                    "stream_options": {"include_usage": True},
                },
            )
            tokens = [(t, e) for t, e in events if isinstance(e, dict) and e.get("choices")]
            assert [e["choices"][0]["text"] for _, e in tokens] == ["tok "] * 4
            # Each token reached the client when the worker sent it, not all at the end.
            assert tokens[-1][0] - tokens[0][0] > 0.45
            assert events[-1][1] == "[DONE]"
            assert events[-2][1]["usage"]["prompt_tokens"] == 100
            # Chat: the opening role chunk is held back with the first token, then sent in order.
            events = await stream_events(
                c.session,
                c.url + "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            )
            deltas = [e["choices"][0]["delta"] for _, e in events if isinstance(e, dict)]
            assert deltas == [
                {"role": "assistant", "content": ""},
                {"content": "tok "},
                {"content": "tok "},
            ]

    run(main())


def test_whole_responses_and_models():
    async def main():
        async with cluster([gpu()]) as c:
            async with c.session.post(
                c.url + "/v1/completions", json={"prompt": list(range(100)), "max_tokens": 3}
            ) as r:
                body = await r.json()
                assert r.status == 200 and body["usage"]["prompt_tokens"] == 100
                assert body["choices"][0]["text"] == "tok tok tok "
            async with c.session.post(
                c.url + "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hello"}]},
            ) as r:
                assert r.status == 200 and (await r.json())["object"] == "chat.completion"
            async with c.session.get(c.url + "/v1/models") as r:
                assert (await r.json())["data"][0]["id"] == "fake-gpu"
            async with c.session.post(c.url + "/v1/completions", data=b"{not json") as r:
                assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]

    run(main())


def test_backends_with_only_the_openai_endpoints():
    async def main():
        async with cluster([gpu(openai_only=True), gpu(openai_only=True)]) as c:
            for w in c.router.workers.values():
                assert w.healthy and w.health_path == "/v1/models" and w.supports_load is False
            results = await asyncio.gather(
                *(
                    stream_events(
                        c.session,
                        c.url + "/v1/completions",
                        {"prompt": "word " * 50, "max_tokens": 2},
                    )
                    for _ in range(4)
                )
            )
            assert all(evts[-1][1] == "[DONE]" for evts in results)
            async with c.session.get(c.url + "/metrics") as r:
                text = await r.text()
            # No /tokenize anywhere: prompts were counted by characters.
            assert metric(text, 'plaserve_router_length_estimates_total{method="chars"}') == 4
            assert all(w.supports_tokenize is False for w in c.router.workers.values())

    run(main())


def test_plaserve_shaped_backends_report_load_and_tokenize():
    async def main():
        async with cluster([gpu(), gpu()]) as c:
            for w in c.router.workers.values():
                assert w.supports_load is True and w.cost_model.source == "worker"
            async with c.session.post(
                c.url + "/v1/completions", json={"prompt": "word " * 50}
            ) as r:
                assert r.status == 200
            async with c.session.get(c.url + "/metrics") as r:
                assert (
                    metric(
                        await r.text(), 'plaserve_router_length_estimates_total{method="worker"}'
                    )
                    == 1
                )

    run(main())


def test_failing_worker_is_retried_elsewhere_and_its_circuit_opens():
    async def main():
        config = RouterConfig(
            policy="round_robin",
            health=FAST_HEALTH,
            breaker=BreakerConfig(failure_threshold=2, open_s=60.0),
        )
        async with cluster([gpu(fail_status=500), gpu()], config) as c:
            for _ in range(6):
                async with c.session.post(
                    c.url + "/v1/completions", json={"prompt": [1, 2, 3]}
                ) as r:
                    assert r.status == 200
            bad = c.router.workers[c.gpus[0].url]
            assert bad.breaker.state(time.monotonic()) == "open" and bad.failures_total == 2
            async with c.session.get(c.url + "/metrics") as r:
                assert metric(await r.text(), "plaserve_router_retries_total") == 2

    run(main())


def test_client_errors_pass_through_and_overload_is_retried():
    async def main():
        config = RouterConfig(policy="round_robin", health=FAST_HEALTH)
        async with cluster([gpu(fail_status=400)], config) as c:
            async with c.session.post(c.url + "/v1/completions", json={"prompt": [1]}) as r:
                assert r.status == 400 and "set to fail" in (await r.json())["error"]["message"]
            assert c.router.workers[c.gpus[0].url].breaker.failures == 0  # not the worker's fault
        async with cluster([gpu(fail_status=429), gpu(fail_status=429)], config) as c:
            async with c.session.post(c.url + "/v1/completions", json={"prompt": [1]}) as r:
                assert r.status == 429  # every worker refused: the last refusal is the answer
        async with cluster([gpu(fail_status=429), gpu()], config) as c:
            for _ in range(2):
                async with c.session.post(c.url + "/v1/completions", json={"prompt": [1]}) as r:
                    assert r.status == 200

    run(main())


def test_no_worker_left_is_a_clean_503():
    async def main():
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        async with cluster([], extra_urls=(dead,)) as c:
            async with c.session.post(c.url + "/v1/completions", json={"prompt": [1]}) as r:
                assert r.status == 503
                assert (await r.json())["error"]["message"] == "no worker available"
            async with c.session.get(c.url + "/health") as r:
                assert r.status == 503

    run(main())


def test_workers_added_and_removed_at_run_time():
    async def main():
        config = RouterConfig(policy="round_robin", health=FAST_HEALTH)
        async with cluster([gpu(), gpu(tbt_s=0.3)], config) as c:
            first, second = (g.url for g in c.gpus)
            async with c.session.delete(c.url + "/workers", json={"url": second}) as r:
                assert r.status == 200
            async with c.session.get(c.url + "/workers") as r:
                assert [w["url"] for w in (await r.json())["workers"]] == [first]
            for _ in range(2):
                async with c.session.post(c.url + "/v1/completions", json={"prompt": [1]}) as r:
                    assert r.status == 200
            assert c.gpus[1].gpu.stats.requests == 0
            async with c.session.post(c.url + "/workers", json={"url": second}) as r:
                assert r.status == 200 and (await r.json())["healthy"] is True
            # A request in flight on a worker being removed finishes there.
            slow = [
                asyncio.ensure_future(
                    stream_events(
                        c.session, c.url + "/v1/completions", {"prompt": [1], "max_tokens": 3}
                    )
                )
                for _ in range(2)
            ]
            await asyncio.sleep(0.2)
            async with c.session.delete(c.url + f"/workers?url={second}") as r:
                assert r.status == 200
            assert all(evts[-1][1] == "[DONE]" for evts in await asyncio.gather(*slow))
            assert c.gpus[1].gpu.stats.requests == 1
            async with c.session.delete(c.url + "/workers", json={"url": second}) as r:
                assert r.status == 404
            async with c.session.post(c.url + "/workers", json={"address": "nowhere"}) as r:
                assert r.status == 400

    run(main())


def test_a_client_that_leaves_frees_its_place_on_the_worker():
    async def main():
        slow = gpu(cost_model=CostModel(g1=1e-3, g2=0.0))  # 1 ms per token
        async with cluster([slow]) as c:
            body = {
                "prompt": list(range(500)),
                "max_tokens": 1,
                "stream": True,
            }  # 0.5 s of prefill each
            first = asyncio.ensure_future(stream_events(c.session, c.url + "/v1/completions", body))
            await asyncio.sleep(0.1)
            second = asyncio.ensure_future(
                stream_events(c.session, c.url + "/v1/completions", body)
            )
            await asyncio.sleep(0.1)
            second.cancel()  # the client goes away while its request queues on the worker
            await first
            await asyncio.sleep(0.2)
            worker = c.router.workers[c.gpus[0].url]
            assert worker.num_inflight == 0 and worker.backlog(time.monotonic()) == 0.0
            assert c.gpus[0].gpu.stats.aborted == 1 and c.gpus[0].gpu.stats.requests == 1

    run(main())


def test_a_prompt_counts_once_whatever_its_n():
    async def main():
        async with cluster([gpu()]) as c:
            body = {"prompt": [[1, 2, 3], [4, 5]]}
            one = await c.router.estimate("/v1/completions", body)
            three = await c.router.estimate("/v1/completions", {**body, "n": 3})
            # the worker prefills each prompt once for its choices
            assert one.tokens == three.tokens == (3, 2)

    run(main())
