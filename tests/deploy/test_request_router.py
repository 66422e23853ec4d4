"""The pla request router's decisions, on replicas described as Ray describes them (replica ids and
routing stats), without a Ray instance: Ray's own tests cover how it calls a router; these cover what
this one answers."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("ray", reason="Ray Serve is not installed: pip install 'plaserve[ray]'")

from ray.serve._private.common import DeploymentHandleSource, DeploymentID  # noqa: E402
from ray.serve.request_router import PendingRequest, ReplicaID  # noqa: E402

from plaserve.deploy import notices  # noqa: E402
from plaserve.deploy.app import RayServeOptions  # noqa: E402
from plaserve.deploy.ingress import OpenAIIngress  # noqa: E402
from plaserve.deploy.metrics import deploy_metrics  # noqa: E402
from plaserve.deploy.request_router import PlaRequestRouter  # noqa: E402
from plaserve.router.hints import HEADER, HintError  # noqa: E402

DEPLOYMENT = DeploymentID(name="PlaserveWorker", app_name="test")
COST = {"g1": 2e-4, "g2": 1e-7, "g3": 0.0, "c0": 0.015}  # 1,200 tokens: 0.33 s; 20 tokens: 0.019 s
LONG, SHORT = [1200], [20]


def replica(name: str, backlog: float = 0.0, age: float = 0.0) -> SimpleNamespace:
    stats = {"backlog_s": backlog, "as_of": time.time() - age, "cost_model": COST}
    return SimpleNamespace(
        replica_id=ReplicaID(unique_id=name, deployment_id=DEPLOYMENT),
        routing_stats={**stats, "short_threshold": 512},
        max_ongoing_requests=8,
    )


_ids = iter(range(10**6))


def pending(
    tokens: list[int] | None = None, cls: str = "", waited: float = 0.0, kwargs: dict | None = None
) -> PendingRequest:
    """A call as Ray hands it to the router: the ingress's ``kwargs``, or just lengths and class."""
    return PendingRequest(
        args=[],
        kwargs=kwargs if kwargs is not None else {"tokens": tokens, "length_class": cls},
        metadata=SimpleNamespace(internal_request_id=f"req-{next(_ids)}"),
        created_at=time.time() - waited,
    )


def router(**kw) -> PlaRequestRouter:
    r = PlaRequestRouter(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(**kw)
    return r


def first(ranks: list) -> str:
    return ranks[0][0].replica_id.unique_id


def metric(name: str, **labels: str) -> float:
    return deploy_metrics().registry.get_sample_value(name, labels) or 0.0


def test_a_chosen_request_counts_before_ray_has_sent_it() -> None:
    async def main() -> None:
        r, reps = router(), [replica("a"), replica("b")]
        one, two = pending(LONG, "long"), pending(LONG, "long")
        ranks_one = await r.choose_replicas(reps, one)
        ranks_two = await r.choose_replicas(reps, two)  # before the first is routed
        assert {first(ranks_one), first(ranks_two)} == {"a", "b"}
        assert all(len(rank) == 1 for rank in ranks_one)  # one replica a rank
        assert one.routing_context.should_backoff  # a held or failed round backs off

    asyncio.run(main())


def test_a_request_sent_to_its_second_choice_moves_its_cost_there() -> None:
    async def main() -> None:
        r, reps = router(), [replica("a"), replica("b")]
        req = pending(LONG, "long")
        ranks = await r.choose_replicas(reps, req)
        chosen, other = ranks[0][0], ranks[1][0]
        before = metric(
            "plaserve_ray_first_choice_total",
            replica=chosen.replica_id.unique_id,
            length_class="long",
        )
        r.on_request_routed(req, other.replica_id, None)  # the first had no room
        now = time.monotonic()
        assert r.policy.backlog(r.workers[chosen.replica_id], now) == 0
        assert r.policy.backlog(r.workers[other.replica_id], now) == pytest.approx(0.33, abs=0.01)
        assert (
            metric(
                "plaserve_ray_first_choice_total",
                replica=chosen.replica_id.unique_id,
                length_class="long",
            )
            == before + 1
        )
        r.on_request_completed(other.replica_id, req.metadata.internal_request_id)
        assert r.policy.backlog(r.workers[other.replica_id], time.monotonic()) == 0

    asyncio.run(main())


def test_reported_backlog_ranks_a_busy_replica_last_until_the_report_is_stale() -> None:
    async def main() -> None:
        r = router(load_stale_s=3.0)
        busy = await r.choose_replicas(
            [replica("a", backlog=2.0), replica("b")], pending(SHORT, "short")
        )
        assert first(busy) == "b"
        stale = router(load_stale_s=3.0)
        ranks = await stale.choose_replicas(
            [replica("a", backlog=2.0, age=10.0), replica("b", backlog=0.5)],
            pending(SHORT, "short"),
        )
        # A report ten seconds old says nothing of now: a's drained to zero; b's is fresh.
        assert first(ranks) == "a"

    asyncio.run(main())


def test_a_long_request_is_held_while_the_short_pool_would_be_lost_then_sent() -> None:
    async def main() -> None:
        r, reps = router(max_hold_s=1.0), [replica("a"), replica("b")]
        short = pending(SHORT, "short")
        r.on_request_routed(short, (await r.choose_replicas(reps, short))[0][0].replica_id, None)
        r.on_request_completed(reps[0].replica_id, short.metadata.internal_request_id)
        r.on_request_completed(reps[1].replica_id, short.metadata.internal_request_id)
        r.policy.tick(list(r.workers.values()), time.monotonic())
        assert r.policy.pools.reserved(time.monotonic()) == 1  # short traffic: one kept clear
        one = pending(LONG, "long")
        r.on_request_routed(one, (await r.choose_replicas(reps, one))[0][0].replica_id, None)
        held_before = metric("plaserve_ray_held_decisions_total")
        two = pending(LONG, "long")
        assert await r.choose_replicas(reps, two) == []  # the other replica is the short pool
        assert metric("plaserve_ray_held_decisions_total") == held_before + 1
        expired_before = metric("plaserve_ray_hold_expired_total")
        late = pending(LONG, "long", waited=2.0)  # held past max_hold_s: sent regardless
        ranks = await r.choose_replicas(reps, late)
        assert len(ranks) == 2
        assert metric("plaserve_ray_hold_expired_total") == expired_before + 1

    asyncio.run(main())


def test_the_ingress_first_token_notice_takes_the_prefill_off_the_backlog() -> None:
    async def main() -> None:
        r, reps = router(), [replica("a"), replica("b")]
        req = pending(LONG, "long")
        req.kwargs["job_id"] = "job-1"
        ranks = await r.choose_replicas(reps, req)
        r.on_request_routed(req, ranks[0][0].replica_id, None)
        w = r.workers[ranks[0][0].replica_id]
        assert r.policy.backlog(w, time.monotonic()) == pytest.approx(0.33, abs=0.01)
        notices.first_token("job-1")  # what the ingress sends, from its own thread or loop
        await asyncio.sleep(0)  # the router handles it on its loop
        assert r.policy.backlog(w, time.monotonic()) == 0
        assert w.num_inflight == 1  # still decoding: it leaves at completion
        r.on_request_completed(ranks[0][0].replica_id, req.metadata.internal_request_id)
        assert w.num_inflight == 0 and "job-1" not in r._by_job

    asyncio.run(main())


def test_a_trusted_gateways_hint_prices_the_request_the_router_places() -> None:
    async def main() -> None:
        ingress = OpenAIIngress(None, short_threshold=512, trust_length_hints_from="10.0.0.0/8")
        body, route = {"prompt": "hi there", "max_tokens": 1}, "/v1/completions"
        untrusted = metric("plaserve_ray_length_hints_total", outcome="untrusted")
        errors = metric("plaserve_ray_length_hint_relative_error_count")
        hinted, check = await ingress.price(route, body, {HEADER: "1200"}, "10.0.0.5")
        plain, no_check = await ingress.price(route, body, {HEADER: "1200"}, "192.0.2.1")
        assert (hinted["tokens"], hinted["length_class"]) == ([1200], "long")
        assert plain["length_class"] == "short" and plain["tokens"][0] < 20 and no_check is None
        assert metric("plaserve_ray_length_hints_total", outcome="untrusted") == untrusted + 1
        with pytest.raises(HintError, match=HEADER):
            await ingress.price(route, body, {HEADER: "1200,1"}, "10.0.0.5")
        with pytest.raises(ValueError, match="not a CIDR"):  # refused before Ray starts anything
            RayServeOptions(trust_length_hints_from="10.0.0.0/33")

        # The request router prices the call by the hint's 1,200 tokens, not the body's 8 bytes.
        r, reps = router(), [replica("a"), replica("b")]
        req = pending(kwargs=hinted)
        ranks = await r.choose_replicas(reps, req)
        r.on_request_routed(req, ranks[0][0].replica_id, None)
        w = r.workers[ranks[0][0].replica_id]
        assert r.policy.backlog(w, time.monotonic()) == pytest.approx(0.33, abs=0.01)
        assert metric("plaserve_ray_routed_requests_total", replica=w.url, length_class="long")
        check.actual(1000)  # the replica's usage.prompt_tokens: the hint was 20 % high
        assert metric("plaserve_ray_length_hint_relative_error_count") == errors + 1
        assert metric("plaserve_ray_length_hint_relative_error_bucket", le="0.25") == 1 + metric(
            "plaserve_ray_length_hint_relative_error_bucket", le="0.1"
        )

    asyncio.run(main())


def test_a_conversations_turns_go_to_the_replica_that_caches_its_history() -> None:
    """The ingress sends the prompt's key with its length: the request router prices each replica
    after the part of the prompt it likely caches, so the next turn of a conversation goes where the
    turns before went (the tie-break alone would send it to the other replica), as a short request."""

    async def main() -> None:
        ingress = OpenAIIngress(None, short_threshold=512)
        doc = "".join(f"line {i} of a long document. " for i in range(150))
        messages = [{"role": "user", "content": doc}]
        r, reps = router(), [replica("a"), replica("b")]
        for stats in (reps[0].routing_stats, reps[1].routing_stats):
            stats["cache_tokens"] = 100_000  # as the replicas' /load reports their KV cache
        routed = []
        for turn in range(3):
            job, _ = await ingress.price("/v1/chat/completions", {"messages": messages}, {}, None)
            assert job["prompt_bytes"] > len(doc) and job["prompt_chunks"]
            req = pending(kwargs=job)
            ranks = await r.choose_replicas(reps, req)
            r.on_request_routed(req, ranks[0][0].replica_id, None)
            routed.append((first(ranks), r._jobs[req.metadata.internal_request_id].job))
            r.on_request_completed(ranks[0][0].replica_id, req.metadata.internal_request_id)
            messages += [
                {"role": "assistant", "content": "an answer"},
                {"role": "user", "content": f"and line {turn}?"},
            ]
        assert len({name for name, _ in routed}) == 1
        assert [job.length_class for _, job in routed] == ["long", "short", "short"]
        w = r.workers[reps[0].replica_id if routed[0][0] == "a" else reps[1].replica_id]
        assert w.cached_tokens_total > 2 * 1000 and len(w.prefixes) > 0

    asyncio.run(main())


def test_the_autoscaling_policy_follows_the_backlog_with_hysteresis_down() -> None:
    from plaserve.deploy.app import BacklogAutoscalingPolicy

    policy = BacklogAutoscalingPolicy(target_backlog_s=2.0)

    def decide(backlogs: list[float], current: int, lo: int = 1, hi: int = 8) -> int:
        ctx = SimpleNamespace(
            aggregated_metrics={"backlog_s": {f"r{i}": b for i, b in enumerate(backlogs)}},
            current_num_replicas=current,
            target_num_replicas=current,
            policy_state={},
            capacity_adjusted_min_replicas=lo,
            capacity_adjusted_max_replicas=hi,
        )
        return policy(ctx)[0]

    assert decide([5.0, 4.0], current=2) == 5  # 9 s of prefill queued: ceil(9 / 2)
    assert decide([30.0, 30.0], current=2) == 8  # at most max_replicas
    assert decide([1.8, 1.8], current=3) == 3  # 3.6 s would fit 2 replicas, with no quarter spare
    assert decide([1.0, 1.0], current=3) == 1  # 2 s fits one replica fewer with room: down to 1
    assert decide([0.0, 0.0], current=2, lo=2) == 2  # never below min_replicas
    empty = SimpleNamespace(
        aggregated_metrics={}, current_num_replicas=3, target_num_replicas=3, policy_state={}
    )
    assert policy(empty)[0] == 3  # no reports yet: keep the target
