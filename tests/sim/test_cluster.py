"""The cluster simulator: determinism, conservation, equivalence with the single-engine replay, the
router policies really in charge, and speed."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter

import pytest

from plaserve import LLMEngine
from plaserve.router.config import RouterConfig
from plaserve.router.policies import LeastTokens, PlaPolicy
from plaserve.sim.cluster import ClusterConfig, ClusterSim, simulate
from plaserve.sim.profiles import analytic_profile
from plaserve.sim.replay import replay
from plaserve.sim.runner import CostRunner, SimClock
from plaserve.workload.trace import TraceRequest, load_trace, synthetic_bimodal

TRACE = "/work/shared/traces/azure_conv_2023.csv"
# The calibration rule puts a 7B model's threshold at 4096 on an H100 (every prompt here "short");
# 512 gives both classes, so the length-aware paths of engines and router all run.
PROFILE = analytic_profile("qwen2.5-7b", "H100").with_short_threshold(512)


def mix(n: int = 300, rate: float = 40.0, seed: int = 1) -> list[TraceRequest]:
    """Bimodal prompts (a fifth of them 1-4k tokens) with short outputs: many prefills, few decode steps."""
    return synthetic_bimodal(
        n, rate, seed=seed, short=(16, 400), long=(1000, 4000), long_share=0.2, output=(1, 24)
    )


def outcome(result) -> list[tuple]:
    return [
        (r.arrival, r.prompt_tokens, r.output_tokens, r.ttft, r.e2e, r.error)
        for r in result.records
    ]


@pytest.mark.parametrize("router", ["pla", "power_of_two"])
def test_same_inputs_same_result(router):
    config = ClusterConfig(instances=3, scheduler="pla", router=RouterConfig(policy=router, seed=3))
    a, b = simulate(mix(), PROFILE, config), simulate(mix(), PROFILE, config)
    assert outcome(a) == outcome(b)
    assert [s.busy_s for s in a.instances] == [s.busy_s for s in b.instances]


@pytest.mark.parametrize(
    "router,scheduler", [("pla", "pla"), ("least_tokens", "fcfs"), ("round_robin", "spf")]
)
def test_every_request_finishes_exactly_once(router, scheduler):
    requests = mix(400, rate=60.0)
    sim = ClusterSim(
        PROFILE, ClusterConfig(instances=4, scheduler=scheduler, router=RouterConfig(policy=router))
    )
    result = sim.run(requests)
    # The same multiset of (arrival, prompt, output) comes out as went in, every one finished.
    assert Counter(
        (r.arrival, r.prompt_tokens, r.output_tokens) for r in result.records
    ) == Counter((r.arrival, r.prompt_tokens, r.output_tokens) for r in requests)
    assert all(r.ok and r.ttft is not None and r.e2e >= r.ttft >= 0 for r in result.records)
    assert sum(s.requests for s in result.instances) == len(requests)
    # The router's books are closed: nothing in flight, nothing held, no engine work left.
    assert not sim.dispatcher.held and all(not w.inflight for w in sim.workers)
    assert all(not inst.engine.has_unfinished() and not inst.inbox for inst in sim.instances)


@pytest.mark.parametrize("policy", ["pla", "fcfs"])
def test_one_instance_equals_the_single_engine_replay(policy):
    requests = mix(200, rate=25.0, seed=2)
    # round_robin never holds a request, so one instance sees each one at its arrival, as replay feeds it.
    result = simulate(
        requests,
        PROFILE,
        ClusterConfig(instances=1, scheduler=policy, router=RouterConfig(policy="round_robin")),
    )
    clock = SimClock()
    cost = PROFILE.cost
    engine = LLMEngine(
        PROFILE.engine_config(policy), runner=CostRunner(cost, clock), cost=cost, clock=clock
    )
    reqs = replay(engine, clock, requests)
    expected = sorted(
        (
            r.metrics.arrival_time,
            r.num_prompt_tokens,
            r.metrics.ttft,
            r.metrics.finish_time - r.metrics.arrival_time,
        )
        for r in reqs
    )
    got = sorted((r.arrival, r.prompt_tokens, r.ttft, r.e2e) for r in result.records)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g[:2] == e[:2]
        assert g[2] == pytest.approx(e[2], abs=1e-9) and g[3] == pytest.approx(e[3], abs=1e-9)
    assert result.instances[0].busy_s == pytest.approx(
        sum(end - start for start, end, _ in engine.runner.batches)
    )


def test_frontend_delay_shifts_every_request_by_the_delay():
    # A delay before the router is the same simulation with every arrival later by it, and each TTFT
    # (from the client's send) longer by it.
    requests = mix(150, rate=20.0, seed=3)
    d = 0.03
    config = ClusterConfig(instances=2, router=RouterConfig(policy="round_robin"))
    delayed = simulate(requests, PROFILE, dataclasses.replace(config, frontend_delay_s=d))
    shifted = simulate(
        [dataclasses.replace(r, arrival=r.arrival + d) for r in requests], PROFILE, config
    )
    assert [r.arrival for r in delayed.records] == [
        r.arrival for r in sorted(requests, key=lambda r: r.arrival)
    ]
    for a, b in zip(delayed.records, shifted.records):
        assert a.ttft == pytest.approx(b.ttft + d, abs=1e-9) and a.e2e == pytest.approx(
            b.e2e + d, abs=1e-9
        )
    with pytest.raises(ValueError):
        ClusterConfig(frontend_delay_s=-1.0)


def test_router_policy_is_called_and_decides():
    calls = Counter()

    def spy(cls, name):
        inner = getattr(cls, name)

        def wrapped(self, *a, **kw):
            calls[name] += 1
            return inner(self, *a, **kw)

        return wrapped

    mp = pytest.MonkeyPatch()
    for name in ("choose", "next_held", "on_dispatch", "on_first_token", "tick"):
        mp.setattr(PlaPolicy, name, spy(PlaPolicy, name))
    try:
        requests = mix(300, rate=200.0)  # every instance near saturation
        result = simulate(
            requests, PROFILE, ClusterConfig(instances=4, router=RouterConfig(policy="pla"))
        )
    finally:
        mp.undo()
    assert calls["on_dispatch"] == len(requests) and calls["on_first_token"] == len(requests)
    assert calls["choose"] > 0 and calls["tick"] > 0
    # Under this load some long requests wait in the router for a worker to clear.
    assert calls["next_held"] > 0
    assert all(s.requests > 0 for s in result.instances)


def test_routing_follows_the_policy():
    requests = mix(200, rate=30.0)
    rr = simulate(
        requests, PROFILE, ClusterConfig(instances=4, router=RouterConfig(policy="round_robin"))
    )
    assert [s.requests for s in rr.instances] == [50, 50, 50, 50]

    # least_tokens sends each request where the fewest prompt tokens are in flight: a worker it picks
    # never had more than the others at that moment.
    seen = []
    inner = LeastTokens.choose

    def checked(self, job, workers, now):
        w = inner(self, job, workers, now)
        seen.append(w.inflight_tokens == min(x.inflight_tokens for x in workers))
        return w

    mp = pytest.MonkeyPatch()
    mp.setattr(LeastTokens, "choose", checked)
    try:
        lt = simulate(
            requests,
            PROFILE,
            ClusterConfig(instances=4, router=RouterConfig(policy="least_tokens")),
        )
    finally:
        mp.undo()
    assert len(seen) == len(requests) and all(seen)
    assert [s.requests for s in lt.instances] != [50, 50, 50, 50]


def test_drain_limit_counts_unfinished_requests_as_failed():
    # Far more work than one instance can do in the time allowed.
    requests = [TraceRequest(0.01 * i, 3000, 50) for i in range(200)]
    result = simulate(
        requests,
        PROFILE,
        ClusterConfig(
            instances=1, scheduler="fcfs", drain_s=1.0, router=RouterConfig(policy="round_robin")
        ),
    )
    assert len(result.records) == len(requests)
    failed = [r for r in result.records if not r.ok]
    assert failed and all(not r.met_slo for r in failed)
    assert result.duration_s == pytest.approx(requests[-1].arrival + 1.0)


def test_cluster_throughput_scales_with_instances():
    requests = mix(300, rate=200.0)  # an overload for one instance
    one = simulate(
        requests, PROFILE, ClusterConfig(instances=1, router=RouterConfig(policy="least_tokens"))
    )
    four = simulate(
        requests, PROFILE, ClusterConfig(instances=4, router=RouterConfig(policy="least_tokens"))
    )
    assert four.duration_s < one.duration_s / 2
    assert four.summary()["all"]["ttft_ms"]["p50"] < one.summary()["all"]["ttft_ms"]["p50"]


def test_speed_smoke_trace_at_eight_instances():
    """A minute of the conversation trace at 8 instances simulates much faster than real time (the
    issue's target, the whole hour in under 60 s, is measured in benchmarks/seed_reproduction.py)."""
    requests = [r for r in load_trace(TRACE) if r.arrival < 60]
    t0 = time.perf_counter()
    result = simulate(
        requests,
        analytic_profile("qwen2.5-32b", "H100"),
        ClusterConfig(instances=8, router=RouterConfig(policy="pla")),
    )
    wall = time.perf_counter() - t0
    assert len(result.records) == len(requests) and all(r.ok for r in result.records)
    # a generous bound: about 50x faster than real time when idle
    assert wall < result.duration_s / 10


def test_prefix_cache_changes_nothing_for_random_prompts():
    """The simulated engines run without the prefix cache (it only costs time): random prompts never
    share a block, so turning it on gives the same result."""
    requests = mix(200, rate=80.0)
    config = ClusterConfig(instances=2, router=RouterConfig(policy="pla"))
    off = simulate(requests, PROFILE, config)
    on = simulate(
        requests,
        PROFILE,
        dataclasses.replace(config, engine_overrides={"enable_prefix_caching": True}),
    )
    assert outcome(off) == outcome(on)


class RecordingSim(ClusterSim):
    """Records each load poll that lands during a step: the report, and the engine's real backlog as
    that step started (worked out from the step's batch)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.mid_step_polls: list[tuple[float, float, float, float, float, float]] = []

    def _poll(self, t: float) -> None:
        super()._poll(t)
        inst = self.instances[0]
        if inst.busy_until > t:
            (item,) = inst.engine.last_batch.items  # one request, prefilling
            before = item.request.num_computed_tokens - item.num_tokens
            expected = inst.engine.cost.prefill_time(
                item.request.num_prompt_tokens - before, before
            )
            load = inst.worker.load
            self.mid_step_polls.append(
                (t, inst.step_start, load.sent, load.backlog_s, expected, inst.worker.backlog(t))
            )


def test_a_poll_during_a_step_reports_the_state_as_the_step_started():
    """As a plaserve worker publishes it: the backlog before the running step, dated back to its start."""
    profile = analytic_profile("qwen2.5-32b", "H100").with_short_threshold(512)
    sim = RecordingSim(profile, ClusterConfig(instances=1))
    sim.run([TraceRequest(0.0, 16000, 2)])  # one long prompt: chunks, several polls inside them
    assert len(sim.mid_step_polls) >= 3
    for t, start, sent, backlog, expected, router_view in sim.mid_step_polls:
        assert sent == start < t
        assert backlog == pytest.approx(expected)
        if start > 0:  # (the request itself, dispatched at 0, counts as unseen by a report dated 0)
            # drained since then
            assert router_view == pytest.approx(max(0.0, expected - (t - start)))
