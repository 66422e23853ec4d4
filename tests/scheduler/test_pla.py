"""The pla policy's guarantees, checked deterministically: real scheduler, simulated clock and runner."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from plaserve import EngineConfig, LLMEngine
from plaserve.cost import CostModel
from plaserve.scheduler.busy import HORIZON_S, BusyMeter
from plaserve.scheduler.deadlines import deadline
from plaserve.sim.replay import replay
from plaserve.sim.runner import CostRunner, SimClock

COST = CostModel(g1=1e-4, g2=2e-8, c0=2e-3)


@dataclass(frozen=True)
class A:
    arrival: float
    prompt_tokens: int
    output_tokens: int = 4


def sim_engine(**kw) -> tuple[LLMEngine, SimClock, CostRunner]:
    clock = SimClock()
    runner = CostRunner(COST, clock)
    cfg = EngineConfig.from_kwargs(
        **({"kv_cache_memory": "2GiB", "enable_prefix_caching": False} | kw)
    )
    return LLMEngine(cfg, runner=runner, cost=COST, clock=clock), clock, runner


def steps_between(runner: CostRunner, t0: float, t1: float, kind: str) -> int:
    """Batches of ``kind`` that started in ``[t0, t1)``."""
    return sum(1 for start, _, b in runner.batches if t0 <= start < t1 and b.kind == kind)


def dispatch_time(runner: CostRunner, req) -> float:
    return next(start for start, _, b in runner.batches if any(it.request is req for it in b.items))


def busy_share(runner: CostRunner, t0: float, t1: float) -> float:
    """The share of ``[t0, t1]`` that steps ran: what the busy meter reads at ``t1``."""
    return sum(min(e, t1) - max(s, t0) for s, e, _ in runner.batches if s < t1 and e > t0) / (
        t1 - t0
    )


def record_ready(engine: LLMEngine) -> dict:
    """Wrap the scheduler's step to log, for every short request it dispatches, when it became ready
    (its batch's window closed, or it rode along a long chunk): the head-of-line guarantee's start."""
    sched, ready = engine.scheduler, {}
    inner = sched.schedule

    def logged(now):
        batch = inner(now)
        for it in batch.items:
            if it.request in sched.shorts.ready:
                ready.setdefault(it.request, sched.shorts.ready[it.request])
        return batch

    sched.schedule = logged
    return ready


def mixed_arrivals(longs: tuple[int, int] = (8000, 6000)) -> list[A]:
    arrivals = [A(0.0, longs[0], 4), A(0.3, longs[1], 4)]
    arrivals += [A(0.01 + 0.037 * i, 40 + (i * 97) % 460, 6) for i in range(60)]
    return sorted(arrivals, key=lambda a: a.arrival)


@pytest.mark.parametrize("pad", ["always", "never"])
# the second pair ends in stretched chunks
@pytest.mark.parametrize("longs", [(8000, 6000), (7900, 5800)])
def test_short_waits_for_at_most_one_long_chunk_after_its_window(pad, longs):
    engine, clock, runner = sim_engine(policy="pla", pad_short_batches=pad)
    readiness = record_ready(engine)
    reqs = replay(engine, clock, mixed_arrivals(longs))
    if longs == (7900, 5800):
        last_chunks = {
            r.num_prompt_tokens: r.metrics.prefill_chunks[-1][2]
            for r in reqs
            if r.length_class == "long"
        }
        assert last_chunks == {7900: 732, 5800: 680}
    shorts = [r for r in reqs if r.length_class == "short"]
    assert len(shorts) == 60 and all(r.finished for r in reqs)
    assert steps_between(runner, 0, clock.now, "long") > 10  # longs really were interleaved
    for r in shorts:
        ready, start = readiness.get(r), dispatch_time(runner, r)
        assert ready is not None and ready <= start
        assert steps_between(runner, ready, start, "long") <= 1


def record_windows(engine: LLMEngine) -> list[float]:
    """Wrap the scheduler's window rule to log every window it opens (close time - oldest arrival)."""
    sched, widths = engine.scheduler, []
    inner = sched.shorts.ready_at

    def logged(batch):
        at = inner(batch)
        # from its oldest member
        widths.append(at - min(r.metrics.arrival_time for r in batch.reqs))
        return at

    sched.shorts.ready_at = logged
    return widths


def test_window_never_exceeds_w_max():
    engine, clock, runner = sim_engine(policy="pla", w_max=0.02)
    # Sparse shorts on an idle engine: each waits at most W_max before it runs.
    reqs = replay(engine, clock, [A(0.5 * i, 100) for i in range(10)])
    for r in reqs:
        assert dispatch_time(runner, r) - r.metrics.arrival_time <= 0.02 + 1e-9
    # Dense shorts: the window waits to fill batches, still never past W_max.
    engine, clock, runner = sim_engine(policy="pla", w_max=0.02)
    widths = record_windows(engine)
    replay(engine, clock, [A(0.001 * i, 100, 1) for i in range(64)])
    sizes = [len(b.items) for _, _, b in runner.batches if b.kind == "short"]
    assert max(sizes) > 4
    # it did wait, within bounds
    assert widths and max(widths) <= 0.02 + 1e-9 and max(widths) > 0.001


def test_long_request_progresses_within_the_bound_under_a_stream_of_shorts():
    # Shorts arrive faster than they can be served (about 1.6x overload), forever.
    stream = [A(0.012 * i, 200, 1) for i in range(800)]
    long_req = A(1.0, 4096, 1)  # arrives once the short backlog has built up
    k, chunk = 2, 1024
    engine, clock, runner = sim_engine(
        policy="pla", max_consecutive_short=k, long_chunk_size=chunk, pad_short_batches="always"
    )
    reqs = replay(engine, clock, sorted(stream + [long_req], key=lambda a: a.arrival), horizon=6.0)
    (long,) = [r for r in reqs if r.num_prompt_tokens == 4096]
    assert long.metrics.first_token_time is not None
    prefill_steps = sum(
        1
        for start, _, b in runner.batches
        if long.metrics.arrival_time <= start < long.metrics.first_token_time and b.kind != "decode"
    )
    chunks = -(-4096 // chunk)
    assert prefill_steps <= chunks * (k + 1) + 1  # +1: the step running when it arrived

    # spf under the same stream never starts the long prompt: the shorts always come first.
    engine, clock, runner = sim_engine(policy="spf")
    reqs = replay(engine, clock, sorted(stream + [long_req], key=lambda a: a.arrival), horizon=6.0)
    (long,) = [r for r in reqs if r.num_prompt_tokens == 4096]
    assert long.metrics.first_scheduled_time is None


@pytest.mark.parametrize("pad", ["always", "never"])
def test_decode_gaps_are_bounded(pad):
    engine, clock, runner = sim_engine(
        policy="pla", max_prefill_steps_between_decodes=2, pad_short_batches=pad
    )
    arrivals = [A(0.0, 100, 200)] + [A(0.02 * i, 200 + (i * 53) % 300, 2) for i in range(1, 80)]
    arrivals.append(A(0.1, 7000, 2))
    reqs = replay(engine, clock, arrivals)
    assert all(r.finished for r in reqs)
    kinds = [b.kind for _, _, b in runner.batches]
    decoding_until = reqs[0].metrics.finish_time
    run = 0
    for start, _, b in runner.batches:
        if start >= decoding_until:
            break
        has_decode = any(it.num_tokens == 1 and it.request.output_token_ids for it in b.items)
        run = 0 if has_decode else run + 1
        assert run <= 2
    assert "long" in kinds and "short" in kinds


@pytest.mark.parametrize(
    "tokens, chunks", [(700, [700]), (800, [512, 288]), (1200, [512, 688]), (1300, [512, 512, 276])]
)
def test_a_long_prefill_leaves_no_stub_of_under_half_a_chunk(tokens, chunks):
    engine, clock, runner = sim_engine(policy="pla", long_chunk_size=512, short_threshold=512)
    (req,) = replay(engine, clock, [A(0.0, tokens, 1)])
    assert [n for _, _, n in req.metrics.prefill_chunks] == chunks


def test_long_chunk_stretch_counts_uncached_tokens_and_keeps_to_the_step_budget():
    engine, _, _ = sim_engine(policy="pla", long_chunk_size=512)
    (req,) = queue(engine, [A(0.0, 1000)])
    longs = engine.scheduler.longs
    assert longs.chunk_budget([req]) == 512  # 1000 to go: more than 1.5 chunks
    req.uncached_estimate = 600  # as if its first 400 tokens were in the prefix cache
    assert longs.chunk_budget([req]) == 600
    engine, _, _ = sim_engine(policy="pla", long_chunk_size=512, max_num_batched_tokens=580)
    (req,) = queue(engine, [A(0.0, 600)])
    assert engine.scheduler.longs.chunk_budget([req]) == 512  # 600 would exceed the step budget


@pytest.mark.parametrize("shorts_keep_coming", [False, True])
def test_long_requests_fill_a_chunk_once_shorts_stop_coming(shorts_keep_coming):
    # Two long prompts of 600 and 700 tokens, chunks of 1,024. After a burst of shorts, served, the
    # second fills what the first leaves of the chunk (as fcfs fills its step); while shorts keep
    # arriving every 20 ms each chunk holds one request, so the shorts never wait behind the second
    # started early, nor the long requests arriving later behind it under way.
    engine, clock, runner = sim_engine(policy="pla", long_chunk_size=1024, short_threshold=512)
    shorts = [A(0.02 * i, 100, 1) for i in range(150 if shorts_keep_coming else 8)]
    arrivals = sorted(shorts + [A(1.0, 600, 1), A(1.0, 700, 1)], key=lambda a: a.arrival)
    reqs = replay(engine, clock, arrivals)
    first, second = [r for r in reqs if r.num_prompt_tokens >= 600]
    chunks = [n for _, _, n in second.metrics.prefill_chunks]
    longs = [b for _, _, b in runner.batches if b.kind == "long"]
    if shorts_keep_coming:
        assert all(sum(it.num_tokens > 1 for it in b.items) == 1 for b in longs)
        assert chunks == [700]
    else:
        assert [n for _, _, n in first.metrics.prefill_chunks] == [600]
        assert chunks == [424, 276]
        assert first.metrics.prefill_chunks[0][0] == second.metrics.prefill_chunks[0][0]


def carries_decodes(batch) -> bool:
    return any(it.num_tokens == 1 and it.request.output_token_ids for it in batch.items)


@pytest.mark.parametrize("backlog", [False, True])
def test_decodes_ride_every_varlen_step_unless_shorts_back_up(backlog):
    # One request decodes throughout while 19 shorts arrive, one at a time or all together.
    gap = 0.0 if backlog else 0.05
    arrivals = [A(0.0, 50, 300)] + [A(0.05 + gap * i, 200, 2) for i in range(19)]
    # two shorts a batch
    engine, clock, runner = sim_engine(
        policy="pla",
        pad_short_batches="never",
        max_prefill_steps_between_decodes=1,
        max_num_batched_tokens=400,
    )
    reqs = replay(engine, clock, arrivals)
    assert all(r.finished for r in reqs)
    decoding = (reqs[0].metrics.first_token_time, reqs[0].metrics.finish_time)
    rides = [
        carries_decodes(b)
        for start, _, b in runner.batches
        if decoding[0] <= start < decoding[1] and b.kind != "decode"
    ]
    assert len(rides) >= 4
    if not backlog:
        assert all(rides)
        return
    # A backlog: prefill goes first, and decodes ride every other step (D = 1).
    assert not all(rides)
    assert all(a or b for a, b in zip(rides, rides[1:]))


def test_classification_uses_the_prefix_cache():
    engine, clock, runner = sim_engine(
        policy="pla", enable_prefix_caching=True, short_threshold=512
    )
    prompt = [(i * 7) % 500 for i in range(2000)]
    first = engine.add_request(prompt, arrival_time=0.0)
    while engine.has_unfinished():
        engine.step()
        if engine.last_batch is None:
            clock.advance_to(engine.next_wakeup())
    assert first.length_class == "long"
    follow_up = engine.add_request(prompt + [5] * 30, arrival_time=clock.now)
    assert follow_up.length_class == "short" and follow_up.uncached_estimate < 512


def queue(engine: LLMEngine, arrivals: list[A]) -> list:
    """Add ``arrivals`` to the engine without stepping it."""
    return [
        engine.add_request(
            [(7 * i + a.prompt_tokens) % 500 for i in range(a.prompt_tokens)],
            arrival_time=a.arrival,
        )
        for a in arrivals
    ]


@pytest.mark.parametrize("aging", [0.0, 0.03])
@pytest.mark.parametrize("arrived_before", [5.0, 20.0])
def test_long_queue_is_shortest_first_aged_by_waiting(aging, arrived_before):
    """Waiting long prompts advance shortest predicted prefill first, each second waited counting as
    ``long_aging`` seconds less work: a longer prompt that arrived earlier goes first once the gap in
    waiting outweighs the gap in work (the starvation guard); with no aging it never does."""
    engine, _, _ = sim_engine(policy="pla", long_aging=aging, late_yield=0)
    longer, shorter = queue(engine, [A(0.0, 3000), A(arrived_before, 1000)])
    sched = engine.scheduler
    work_gap = COST.prefill_time(3000) - COST.prefill_time(1000)
    assert 5.0 * 0.03 < work_gap < 20.0 * 0.03  # the two cases fall on either side
    order = sched.longs.order(sched.running, sched.waiting, sched.plan(arrived_before + 1.0))
    longer_first = aging * arrived_before > work_gap
    assert order == ([longer, shorter] if longer_first else [shorter, longer])


@pytest.mark.parametrize("pad", ["always", "never"])
def test_short_batch_keeps_its_on_time_members_on_time(pad):
    # Six shorts at once, all due in 0.1 s: three long-ish ones, three small ones. One batch of all of
    # them (~0.14 s predicted) would make every member late.
    engine, _, _ = sim_engine(
        policy="pla", pad_short_batches=pad, ttft_slo_floor=0.1, ttft_slo_factor=1.0
    )
    reqs = queue(engine, [A(0.0, 400)] * 3 + [A(0.0, 50)] * 3)
    sched = engine.scheduler
    formed = sched.short_batch_plan(0.0)
    batch, bucket = formed.reqs, formed.bucket

    def predicted(members):
        return COST.batch_time([(bucket or m.num_prompt_tokens, 0) for m in members])

    assert batch[0] is reqs[0]  # the most urgent (ties: the oldest) always goes
    assert predicted(batch) <= 0.1
    for r in reqs:  # nothing left out would have fit
        if r not in batch and (bucket is None or r.num_prompt_tokens <= bucket):
            assert predicted(batch + [r]) > 0.1
    if pad == "never":  # varlen: four of the six can be on time (two long-ish ones cannot)
        assert len(batch) == 4


@pytest.mark.parametrize("pad", ["always", "never"])
def test_a_short_batch_of_late_requests_fills_its_budget(pad):
    # Deep in a burst every deadline has passed (and 2 SLOs gone, so none yields): a smaller batch
    # cannot bring any member back on time, so the batch fills the budget as fcfs fills a step. It
    # used to take the head alone, as every member's past deadline failed the check.
    engine, _, _ = sim_engine(
        policy="pla", pad_short_batches=pad, ttft_slo_floor=0.1, ttft_slo_factor=1.0
    )
    queue(engine, [A(0.0, 100)] * 30)
    sched = engine.scheduler
    formed = sched.short_batch_plan(0.25)
    assert len(formed.reqs) > 1 and len(formed.reqs) == formed.target  # full
    # One on time among late ones that still yield: it goes first and bounds the batch, and the late
    # ones fill it only as far as it stays on time.
    engine, _, _ = sim_engine(
        policy="pla", pad_short_batches=pad, ttft_slo_floor=0.1, ttft_slo_factor=1.0
    )
    late = queue(engine, [A(0.0, 100)] * 30)
    (fresh,) = queue(engine, [A(0.18, 100)])
    formed = engine.scheduler.short_batch_plan(0.18)
    assert formed.reqs[0] is fresh and 1 < len(formed.reqs) < formed.target
    work = COST.batch_time([(formed.bucket or r.num_prompt_tokens, 0) for r in formed.reqs])
    assert 0.18 + work <= deadline(fresh) < 0.18 + work + COST.prefill_time(100) - COST.c0
    assert set(formed.reqs) <= {fresh, *late}


def test_short_batch_deadline_check_counts_the_decodes_riding_along():
    engine, _, _ = sim_engine(
        policy="pla", pad_short_batches="never", ttft_slo_floor=0.1, ttft_slo_factor=1.0
    )
    queue(engine, [A(0.0, 400)] * 2 + [A(0.0, 50)] * 2)
    sched = engine.scheduler
    alone = sched.short_batch_plan(0.0).reqs  # 400, 400, 50, 50: 95 ms predicted
    # ~8.5 ms of decode tokens in every varlen step
    decoders = queue(sim_engine()[0], [A(0.0, 300)] * 80)
    sched.decoding = lambda: decoders
    plan = sched.plan(0.0)  # a new decision: riders and the late set computed afresh
    riding = plan.rider_time
    assert riding == pytest.approx(COST.batch_time([(1, 300)] * 80) - COST.c0)
    batch = sched.short_batch(plan).reqs
    assert len(alone) == 4 and len(batch) < len(alone)
    assert COST.batch_time([(m.num_prompt_tokens, 0) for m in batch]) + riding <= 0.1


def test_late_requests_yield_to_on_time_ones_for_a_bounded_time():
    engine, _, _ = sim_engine(policy="pla", ttft_slo_floor=0.1, ttft_slo_factor=1.0, late_yield=2.0)
    early, later = queue(engine, [A(0.0, 100), A(0.14, 100)])
    sched = engine.scheduler
    plan = sched.plan(0.15)  # `early` can no longer make its 0.1 s deadline; `later` can
    assert plan.yields(early) and not plan.yields(later)
    assert sched.shorts.candidates(sched.waiting, plan) == [later, early]
    plan = sched.plan(0.2)  # waited 2 SLOs: it takes its place by deadline again
    assert not plan.yields(early)
    assert sched.shorts.candidates(sched.waiting, plan) == [early, later]


@pytest.mark.parametrize("pad", ["always", "never"])
def test_head_of_line_bound_holds_in_an_overload(pad):
    # Shorts arrive faster than they can be served while two long prompts are pending, with SLOs tight
    # enough that many are given up: being given up must not push a ready request back in the queue.
    arrivals = [A(0.0, 6000, 2), A(0.2, 5000, 2)] + [
        A(0.005 * i, 60 + (i * 53) % 400, 2) for i in range(200)
    ]
    engine, clock, runner = sim_engine(
        policy="pla", pad_short_batches=pad, ttft_slo_floor=0.1, ttft_slo_factor=2.0
    )
    readiness = record_ready(engine)
    reqs = replay(engine, clock, sorted(arrivals, key=lambda a: a.arrival))
    shorts = [r for r in reqs if r.length_class == "short"]
    assert sum(r.metrics.ttft > r.ttft_slo for r in shorts) > 50  # a real overload
    for r in shorts:
        ready, start = readiness.get(r), dispatch_time(runner, r)
        assert ready is not None and ready <= start
        assert steps_between(runner, ready, start, "long") <= 1


def test_a_request_yields_when_serving_it_would_make_several_others_late():
    # All due at 0.3 s. The long prompt (0.24 s of work) could make its deadline alone, but then at most
    # one of the three shorts (0.05 s each) would make theirs: the fewest-late order gives it up.
    engine, _, _ = sim_engine(policy="pla", ttft_slo_floor=0.3, ttft_slo_factor=1.0, late_yield=2.0)
    long, *shorts = queue(engine, [A(0.0, 2000)] + [A(0.001, 480)] * 3)
    plan = engine.scheduler.plan(0.001)
    assert plan.now + COST.prefill_time(2000) < deadline(long)  # on time if it ran alone
    assert plan.late == {long}
    assert plan.yields(long) and not any(plan.yields(r) for r in shorts)
    plan = engine.scheduler.plan(0.6)  # waited 2 SLOs: it no longer yields
    assert not plan.yields(long)


def test_yielding_cuts_slo_violations_in_a_burst():
    # 30 shorts at once (most must miss 0.25 s), then a trickle the engine could serve in time. In
    # plain deadline order (late_yield=0) the trickle waits behind the burst's late requests, whose
    # deadlines are earlier; yielding serves it first.
    arrivals = [A(0.001 * i, 100 + (i * 37) % 300, 1) for i in range(30)] + [
        A(0.3 + 0.05 * i, 100, 1) for i in range(10)
    ]
    late = {}
    for late_yield in (0.0, 2.0):
        engine, clock, _ = sim_engine(policy="pla", late_yield=late_yield)
        reqs = replay(engine, clock, arrivals)
        late[late_yield] = [
            sum(r.metrics.ttft > r.ttft_slo for r in part) for part in (reqs, reqs[30:])
        ]
    assert late[2.0][1] <= late[0.0][1] - 4  # the trickle: 8 late without yielding, 2 with
    assert late[2.0][0] < late[0.0][0]


def test_a_request_arriving_at_the_same_time_joins_the_late_set():
    engine, _, _ = sim_engine(policy="pla", ttft_slo_floor=0.3, ttft_slo_factor=1.0, late_yield=2.0)
    shorts = queue(engine, [A(0.001, 480)] * 3)
    sched = engine.scheduler
    assert sched.plan(0.001).late == set()
    # same scheduling time, a new request: the next decision's plan has it
    (long,) = queue(engine, [A(0.0, 2000)])
    plan = sched.plan(0.001)
    assert plan.late == {long} and not any(plan.yields(r) for r in shorts)


def test_no_harm_at_light_load():
    # Sparse requests, shorts and longs in turn, on a machine busy a few percent of the time: there is
    # nothing to reorder, so once the busy meter has watched a whole horizon pla serves every request
    # exactly as fcfs does (a short at once, a long prompt in one step).
    arrivals = [A(0.7 * i, 1800 if i % 3 == 0 else 40 + 30 * i, 4) for i in range(40)]
    ttft = {}
    for policy in ("fcfs", "pla"):
        engine, clock, runner = sim_engine(policy=policy, pad_short_batches="never")
        reqs = replay(engine, clock, arrivals)
        ttft[policy] = [r.metrics.ttft for r in reqs]
        if policy == "pla":
            warm = [
                r for r in reqs if r.metrics.arrival_time >= HORIZON_S and r.length_class == "long"
            ]
            assert warm and all(len(r.metrics.prefill_chunks) == 1 for r in warm)
            cold = [
                r for r in reqs if r.metrics.arrival_time < HORIZON_S and r.length_class == "long"
            ]
            # no evidence of light load yet
            assert all(len(r.metrics.prefill_chunks) > 1 for r in cold)
    for a, f, p in zip(arrivals, ttft["fcfs"], ttft["pla"]):
        if a.arrival >= HORIZON_S:
            assert p == pytest.approx(f)


@pytest.mark.parametrize("light_load", [0.3, 1.0])
def test_long_prefills_stay_chunked_while_the_machine_is_busy(light_load):
    # Shorts keep the machine about half busy; a long prompt arriving in a gap between them, with no
    # short waiting, is still cut into chunks, so the shorts that follow pass it (with light_load 1.0
    # every machine counts as lightly loaded: the prompt runs whole).
    shorts = [A(0.045 * i, 200, 1) for i in range(400)]
    engine, clock, runner = sim_engine(
        policy="pla", pad_short_batches="never", light_load=light_load
    )
    reqs = replay(engine, clock, sorted(shorts + [A(15.01, 1800, 1)], key=lambda a: a.arrival))
    (long,) = [r for r in reqs if r.num_prompt_tokens == 1800]
    if light_load == 1.0:
        assert len(long.metrics.prefill_chunks) == 1
        return
    assert (
        busy_share(runner, 5.0, 15.0) > 0.3
    )  # the busy share pla reads when the long prompt arrives
    assert len(long.metrics.prefill_chunks) > 1


@pytest.mark.parametrize(
    ("gap", "share", "whole"), [(0.06, (0.3, 0.5), True), (0.035, (0.5, 1), False)]
)
def test_the_default_light_load_threshold_is_half_busy(gap, share, whole):
    # Shorts every ``gap`` seconds keep the machine busy ``share`` of the 10 s before a long prompt
    # arrives with no short waiting. Under half busy (the default threshold; the light loads
    # reach 40 %) it runs whole, as fcfs runs it; over half busy it is cut into chunks.
    shorts = [A(gap * i, 200, 1) for i in range(int(18 / gap))]
    engine, clock, runner = sim_engine(policy="pla", pad_short_batches="never")
    assert engine.scheduler.config.light_load == 0.5
    reqs = replay(engine, clock, sorted(shorts + [A(15.01, 1800, 1)], key=lambda a: a.arrival))
    (long,) = [r for r in reqs if r.num_prompt_tokens == 1800]
    assert share[0] < busy_share(runner, 5.0, 15.0) < share[1]
    assert (len(long.metrics.prefill_chunks) == 1) is whole


def test_busy_meter_reads_the_share_of_its_horizon_after_watching_one():
    meter = BusyMeter(horizon=10.0)
    meter.record(0.0, 1.0)
    assert meter.share(5.0) is None  # not a whole horizon watched yet
    meter.record(10.0, 12.0)
    assert meter.share(10.5) == pytest.approx((0.5 + 0.5) / 10)  # [0.5, 1] and [10, 10.5]
    assert meter.share(20.0) == pytest.approx(2.0 / 10)
    assert meter.share(30.0) == 0.0


@pytest.mark.parametrize("pad", ["always", "never"])
def test_a_short_arriving_during_a_whole_long_prefill_goes_next(pad):
    # Light load: a long prompt runs whole; shorts that arrive meanwhile wait for that step only (the
    # step already running), then go before the second long prompt's chunks.
    warm = [A(0.5 * i, 100, 1) for i in range(25)]
    rest = [A(13.0, 2000, 1), A(13.05, 100, 1), A(13.1, 300, 1), A(13.12, 6000, 1)]
    engine, clock, runner = sim_engine(policy="pla", pad_short_batches=pad)
    readiness = record_ready(engine)
    reqs = replay(engine, clock, warm + rest)
    first, *shorts, second = reqs[-4:]
    assert len(first.metrics.prefill_chunks) == 1  # whole: no short waited when it started
    assert len(second.metrics.prefill_chunks) > 1  # chunked: shorts were waiting
    whole_end = first.metrics.prefill_chunks[0][1]
    for r in shorts:
        assert r.metrics.arrival_time < whole_end
        assert steps_between(runner, readiness[r], dispatch_time(runner, r), "long") <= 1
        assert dispatch_time(runner, r) < second.metrics.prefill_chunks[-1][0]


def test_the_chunk_size_follows_the_cost_model_unless_set():
    """Unset, a long chunk is the smallest power of two from the short threshold whose step cost c0
    is under 5 % of it, within the step budget and none predicted past the TTFT SLO floor, and
    follows the model as the engine refits it; set, it stays."""
    engine, _, _ = sim_engine(policy="pla", short_threshold=512)
    sched = engine.scheduler
    assert sched.longs.chunk_size == 512  # COST: c0 is 3.5 % of a 512-token chunk's time
    costly = CostModel(
        g1=5e-5, g2=2e-8, c0=10e-3
    )  # 28 % of 512 tokens (36 ms), 15 % of 1,024 (71 ms), 7.5 % of 2,048 (0.13 s)
    sched.set_cost_model(costly)
    assert sched.longs.chunk_size == 2048 == sched.max_num_batched_tokens  # 4,096 is over budget
    assert engine.load_report()["long_chunk_size"] == 2048  # what /load shows
    # Twice as slow a token: a 2,048-token chunk would take 0.26 s, past the 0.25 s SLO floor.
    sched.set_cost_model(CostModel(g1=1e-4, g2=4e-8, c0=20e-3))
    assert sched.longs.chunk_size == 1024
    sched.set_cost_model(CostModel(g1=1e-4, g2=2e-8, c0=0.0))  # no per-step cost: the threshold
    assert sched.longs.chunk_size == 512
    fixed, _, _ = sim_engine(policy="pla", short_threshold=512, long_chunk_size=768)
    fixed.scheduler.set_cost_model(costly)
    assert fixed.scheduler.longs.chunk_size == 768
