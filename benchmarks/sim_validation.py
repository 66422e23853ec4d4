"""Validate the cluster simulator against real runs on this machine.

    .venv/bin/python benchmarks/sim_validation.py --out /tmp/simval     # ~17 min: fits, warm-ups, 12 real runs, sims

Run it when no other benchmark runs (``ps aux | grep -E "benchmarks/|calibrate"``): the real runs are
wall-clock measurements on a 2-core machine.

Setup, fixed before looking at results:

* the embedded default model (random weights, float32, CPU). Every engine runs one thread: each of
  the cluster's two workers gets one core (as ``plaserve cluster`` assigns them), and a single
  instance with one thread is far less disturbed by other processes on this shared machine than a
  2-thread one (OpenMP threads wait on each other; docs/POLICIES.md);
* **the profile** (default ``--profile warm-up``): a quick isolated-prefill fit (32..2048 tokens,
  fastest of two repeats, as benchmarks/policies.py) drives a warm-up replay of *other* trace rows
  (from row 1000) under fcfs and pla; every step of it is timed and the cost model refitted on them
  by the engine's own online-refit code (decode and mixed steps included, so ``g3`` and ``c0`` see the
  steps a serving engine runs). That profile, fixed before the validated runs, schedules the real
  engines and times the simulated ones. ``--profile isolated`` validates the isolated fit instead;
* one slice of the Azure code trace, lengths x0.25 (prompts capped at 4000, outputs at 32 tokens),
  arrivals compressed so the predicted prefill work fills ``--load`` (default 60 %) of each instance's
  time over --seconds (the warm-up always at 60 %);
* **one instance**: ``pla`` and ``fcfs`` replayed in-process on the wall clock
  (:func:`policy_study.offline.run_policy`), against ``plaserve simulate``'s loop with one instance
  (router round_robin, which never holds a request, so it is a pass-through);
* **two workers**: ``plaserve cluster --workers 2`` (workers run pla, ``--no-online-refit``: their
  cost model stays the profile's, as the simulator's does) behind the router with policy ``pla`` and
  ``round_robin``, driven by ``plaserve bench`` (HTTP, streaming), against the simulator with 2
  instances and the same router policy. A worker beside the router and the load generator runs
  slower than the in-process engine the profile was fitted on, so the cluster's profile is the
  in-process one scaled by the slowdown measured in a warm-up against the same cluster (other rows,
  from row 1000): each worker's measured / predicted step time (``GET /load``);
* the same requests, profile and policies on both sides; the comparison is TTFT p50 and p90 over all
  requests, target: within 15 %. The real side is noisy on this shared 2-core machine (the same
  cluster run twice gave p50 1,057 and 1,491 ms), so each real run is repeated ``--repeats`` times
  (default 3; the cluster restarted each time) and the simulation is compared with the median of the
  runs' percentiles; the table shows the runs' range beside it.

Diagnostics (where the error comes from; not part of the validation proper):

* every real in-process step is timed against the profile's prediction for its batch, by kind
  (prefill only, decodes only, mixed);
* the same real runs simulated with the other profile (isolated-prefill fit by default): how much of
  the agreement the step fit buys;
* after each cluster run, each worker's measured / predicted step time over its last 256 steps.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from plaserve.config import EngineConfig, SchedulerConfig  # noqa: E402
from plaserve.cost import CostModel, OnlineCostModel, chunk_size_for  # noqa: E402
from plaserve.engine.engine import LLMEngine, batch_work  # noqa: E402
from plaserve.engine.runner import ModelRunner  # noqa: E402
from plaserve.model.loader import load_model, resolve_device, resolve_dtype  # noqa: E402
from plaserve.profile import Profile, fingerprint  # noqa: E402
from plaserve.router.config import RouterConfig  # noqa: E402
from plaserve.sim.cluster import ClusterConfig, simulate  # noqa: E402
from plaserve.sim.profiles import calibrated_profile  # noqa: E402
from plaserve.workload.trace import TraceRequest, load_trace  # noqa: E402
from policy_study.offline import SloRule, fit_cost_model, run_policy, to_record  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PLASERVE = [sys.executable, "-m", "plaserve.cli"]
TRACE = os.path.normpath(os.path.join(ROOT, "..", "shared", "traces", "azure_code_2023.csv"))
LENGTH_SCALE, MAX_PROMPT, MAX_OUTPUT = 0.25, 4000, 32
TARGET = 0.15


def fit_profile(loaded, threads: int, path: str) -> CostModel:
    """Fit the cost model with ``threads`` torch threads and save it as a profile (default settings)."""
    torch.set_num_threads(threads)
    engine = LLMEngine(
        EngineConfig(
            kv_cache_memory="1GiB", max_model_len=4096, scheduler=SchedulerConfig(policy="fcfs")
        ),
        loaded=loaded,
    )
    cost = fit_cost_model(engine, lengths=(32, 128, 512, 1024, 2048), repeats=2)
    s = SchedulerConfig()
    Profile(
        cost,
        s.short_threshold,
        s.max_short_batch,
        s.long_chunk_size
        or chunk_size_for(cost, s.short_threshold, s.max_num_batched_tokens, s.slo.floor),
        s.w_min,
        s.w_max,
        fingerprint=fingerprint(engine.model_config, engine.dtype, engine.device),
        fit={"method": "benchmarks/sim_validation.py quick fit"},
    ).save(path)
    print(
        f"  {threads} thread(s): c0={cost.c0 * 1e3:.2f} ms g1={cost.g1 * 1e6:.1f} us/token "
        f"g2={cost.g2 * 1e9:.2f} ns/pair -> {path}",
        flush=True,
    )
    return CostModel(cost.g1, cost.g2, cost.g3, cost.c0, source="profile")


def trace_slice(
    cost: CostModel, load: float, seconds: float, start: int = 0
) -> tuple[list[TraceRequest], float]:
    """The trace rows from ``start`` whose predicted prefill work is ``load * seconds``, lengths scaled,
    arrivals compressed to span ``seconds``. Returns the requests and the time scale (for ``plaserve bench``)."""
    reqs = load_trace(
        TRACE,
        start=start,
        limit=2000,
        length_scale=LENGTH_SCALE,
        max_prompt_tokens=MAX_PROMPT,
        max_output_tokens=MAX_OUTPUT,
    )
    work, n = 0.0, 0
    while n < len(reqs) and work < load * seconds:
        work += cost.prefill_time(reqs[n].prompt_tokens)
        n += 1
    time_scale = seconds / (reqs[n - 1].arrival or 1.0)
    return [
        TraceRequest(r.arrival * time_scale, r.prompt_tokens, r.output_tokens) for r in reqs[:n]
    ], time_scale


class StepLog:
    """Times every real batch (``ModelRunner.execute``) while active: (work, kind, seconds)."""

    def __init__(self) -> None:
        self.steps: list[tuple[list[tuple[int, int]], str, float]] = []
        self.active = False
        inner = ModelRunner.execute
        log = self

        def timed(runner, batch):
            if not log.active:
                return inner(runner, batch)
            work = batch_work(batch)
            start = time.perf_counter()
            out = inner(runner, batch)
            took = time.perf_counter() - start
            decodes = sum(n == 1 for n, _ in work)
            kind = "decode" if decodes == len(work) else "prefill" if decodes == 0 else "mixed"
            log.steps.append((work, kind, took))
            return out

        ModelRunner.execute = timed

    def take(self) -> list[tuple[list[tuple[int, int]], str, float]]:
        steps, self.steps = self.steps, []
        return steps


def step_errors(steps, cost: CostModel) -> dict[str, dict[str, float]]:
    """Per kind of step: count, measured and predicted seconds in total, and their ratio."""
    out: dict[str, dict[str, float]] = {}
    for work, kind, took in steps:
        d = out.setdefault(kind, {"steps": 0, "real_s": 0.0, "pred_s": 0.0})
        d["steps"] += 1
        d["real_s"] += took
        d["pred_s"] += cost.batch_time(work)
    for d in out.values():
        d["real_over_pred"] = d["real_s"] / d["pred_s"]
    return out


def step_fit(steps, initial: CostModel) -> CostModel:
    """The cost model refitted on these steps by the engine's online-refit code (all kinds)."""
    online = OnlineCostModel(initial, window=len(steps), refit_every=10**9, min_samples=1)
    for work, _, took in steps:
        online.observe(work, took)
    online.refit()
    m = online.model
    return CostModel(m.g1, m.g2, m.g3, m.c0, source="step-fit")


def save_profile(cost: CostModel, like: str, path: str) -> str:
    """``like``'s profile with ``cost`` as its cost model."""
    import dataclasses

    dataclasses.replace(Profile.load(like), cost_model=cost).save(path)
    return path


def ttft_pcts(ttfts_s: list[float]) -> tuple[float, float]:
    ms = np.array(ttfts_s) * 1000
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 90))


def sim_ttfts(
    requests, profile_path: str, instances: int, scheduler: str, router: str
) -> tuple[list[float], dict]:
    profile = calibrated_profile(profile_path)
    result = simulate(
        requests,
        profile,
        ClusterConfig(instances=instances, scheduler=scheduler, router=RouterConfig(policy=router)),
    )
    ttfts = [r.ttft for r in result.records if r.ttft is not None]
    return ttfts, {
        "busy_s": [s.busy_s for s in result.instances],
        "duration_s": result.duration_s,
        "errors": sum(not r.ok for r in result.records),
    }


def warm_up_fit(
    loaded, profile_path: str, cost: CostModel, seconds: float, log: StepLog, out: str
) -> str:
    """Replay other trace rows (from row 1000) with fcfs and pla, time every step, refit; the profile path."""
    requests, _ = trace_slice(cost, 0.6, seconds, start=1000)
    log.active = True
    for policy in ("fcfs", "pla"):
        config = EngineConfig(
            kv_cache_memory="2GiB", profile=profile_path, scheduler=SchedulerConfig(policy=policy)
        )
        run_policy(loaded, config, cost, requests)
    log.active = False
    fitted = step_fit(log.take(), cost)
    print(
        f"  step-fitted on a warm-up replay ({len(requests)} requests x 2 policies): c0={fitted.c0 * 1e3:.2f} ms "
        f"g1={fitted.g1 * 1e6:.1f} us/token g2={fitted.g2 * 1e9:.2f} ns/pair g3={fitted.g3 * 1e6:.2f} us",
        flush=True,
    )
    return save_profile(fitted, profile_path, os.path.join(out, "profile_stepfit.json")), fitted


def single_instance(
    loaded,
    profile_path: str,
    cost: CostModel,
    slice_cost: CostModel,
    load: float,
    seconds: float,
    repeats: int,
    log: StepLog,
    other: tuple[str, str] | None,
) -> tuple[list[dict], list[dict]]:
    requests, time_scale = trace_slice(slice_cost, load, seconds)
    print(
        f"\n== one instance: {len(requests)} requests over {requests[-1].arrival:.0f} s "
        f"(arrivals x{time_scale:.4f}), {repeats} real run(s) per policy",
        flush=True,
    )
    rows, diag = [], []
    for policy in ("pla", "fcfs"):
        config = EngineConfig(
            kv_cache_memory="2GiB", profile=profile_path, scheduler=SchedulerConfig(policy=policy)
        )
        reals, utils = [], []
        log.active = True
        for _ in range(repeats):
            run = run_policy(loaded, config, cost, requests)
            reals.append(
                [
                    r.ttft
                    for r in (to_record(q, SloRule(), cost) for q in run.requests)
                    if r.ttft is not None
                ]
            )
            utils.append(run.busy_s / run.wall_s)
            print(
                f"  {policy} real run: TTFT p50 {ttft_pcts(reals[-1])[0]:.0f} ms, p90 {ttft_pcts(reals[-1])[1]:.0f} ms",
                flush=True,
            )
        log.active = False
        errors = step_errors(log.take(), cost)
        print(
            "  steps, measured / predicted: "
            + ", ".join(
                f"{k} {v['real_over_pred']:.2f} (n={v['steps']})" for k, v in errors.items()
            ),
            flush=True,
        )
        sim, extra = sim_ttfts(requests, profile_path, 1, policy, "round_robin")
        rows.append(
            row(
                "1 instance (in-process)",
                policy,
                "-",
                reals,
                sim,
                float(np.median(utils)),
                extra["busy_s"][0] / extra["duration_s"],
                len(requests),
            )
        )
        rows[-1]["step_errors"] = errors
        if other is not None:
            sim2, extra2 = sim_ttfts(requests, other[1], 1, policy, "round_robin")
            diag.append(
                row(
                    f"1 instance, {other[0]} profile",
                    policy,
                    "-",
                    reals,
                    sim2,
                    None,
                    extra2["busy_s"][0] / extra2["duration_s"],
                    len(requests),
                )
            )
    return rows, diag


def row(
    setup: str,
    scheduler: str,
    router: str,
    reals: list[list[float]],
    sim: list[float],
    real_util: float | None,
    sim_util: float,
    n: int,
) -> dict:
    """Simulated TTFT percentiles against the median over the real repeats (their spread kept)."""
    per_run = [ttft_pcts(r) for r in reals]
    r50, r90 = (float(np.median([p[i] for p in per_run])) for i in (0, 1))
    s50, s90 = ttft_pcts(sim)
    out = {
        "setup": setup,
        "scheduler": scheduler,
        "router": router,
        "n": n,
        "real_n": [len(r) for r in reals],
        "sim_n": len(sim),
        "real_p50": r50,
        "sim_p50": s50,
        "real_p90": r90,
        "sim_p90": s90,
        "real_p50_runs": [p[0] for p in per_run],
        "real_p90_runs": [p[1] for p in per_run],
        "err_p50": (s50 - r50) / r50,
        "err_p90": (s90 - r90) / r90,
        "real_util": real_util,
        "sim_util": sim_util,
    }
    print(
        f"  {scheduler}/{router}: TTFT p50 real {r50:.0f} ms sim {s50:.0f} ms ({out['err_p50'] * 100:+.0f}%), "
        f"p90 real {r90:.0f} ms sim {s90:.0f} ms ({out['err_p90'] * 100:+.0f}%)",
        flush=True,
    )
    return out


def start_cluster(router: str, profile_path: str, port: int, log_path: str) -> subprocess.Popen:
    """``plaserve cluster --workers 2`` in its own process group; returns once the router is up."""
    cmd = PLASERVE + [
        "cluster",
        "--workers",
        "2",
        "--worker-policy",
        "pla",
        "--policy",
        router,
        "--port",
        str(port),
        "--profile",
        profile_path,
        "--worker-args",
        f"--profile {profile_path} --no-online-refit",
    ]
    log = open(log_path, "w")
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        start_new_session=True,
        env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src")),
    )
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"plaserve cluster exited; see {log_path}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/workers", timeout=2).status_code == 200:
                workers = httpx.get(f"http://127.0.0.1:{port}/workers", timeout=2).json()["workers"]
                if workers and all(w["available"] for w in workers):
                    return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"plaserve cluster did not come up; see {log_path}")


def stop_cluster(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def worker_loads(port: int) -> list[dict]:
    """Each worker's ``GET /load`` now (behind the router on ``port``)."""
    import httpx

    return [
        httpx.get(w["url"] + "/load", timeout=5).json()
        for w in httpx.get(f"http://127.0.0.1:{port}/workers", timeout=5).json()["workers"]
    ]


def run_cluster(
    router: str, profile_path: str, port: int, out: str, bench_args: list[str]
) -> tuple[list[dict], list[float]]:
    """A fresh ``plaserve cluster`` (no prefix cache carried over; workers keep the profile's cost model
    fixed, as the simulator does), one ``plaserve bench`` run against it; the per-request records and
    each worker's measured / predicted step time over its last 256 steps."""
    proc = start_cluster(router, profile_path, port, out + ".log")
    try:
        subprocess.run(
            PLASERVE
            + [
                "bench",
                "--url",
                f"http://127.0.0.1:{port}",
                "--trace",
                TRACE,
                "--length-scale",
                str(LENGTH_SCALE),
                "--max-prompt-tokens",
                str(MAX_PROMPT),
                "--max-output-tokens",
                str(MAX_OUTPUT),
                "--out",
                out,
                "--no-plots",
                *bench_args,
            ],
            check=True,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src")),
        )
        ratios = [load.get("step_time_over_predicted") or 1.0 for load in worker_loads(port)]
    finally:
        stop_cluster(proc)
    with open(os.path.join(out, "requests.jsonl")) as f:
        return [json.loads(line) for line in f], ratios


def cluster_profile(
    profile_path: str,
    cost: CostModel,
    slice_cost: CostModel,
    load: float,
    seconds: float,
    out: str,
    port: int,
) -> tuple[str, CostModel]:
    """The profile recalibrated for a worker inside the cluster.

    A worker shares the 2 cores with the other worker, the router and the load generator, and its engine
    thread shares the GIL with its HTTP server: its steps run slower than the in-process ones the profile
    was fitted on. A warm-up against the cluster (other trace rows, from row 1000; router ``pla``)
    measures by how much: each worker reports its steps' measured / predicted time (``GET /load``), and
    the profile's coefficients are scaled by the workers' mean."""
    requests, time_scale = trace_slice(slice_cost, 2 * load, seconds, start=1000)
    _, ratios = run_cluster(
        "pla",
        profile_path,
        port,
        os.path.join(out, "cluster_warm_up"),
        ["--start", "1000", "--num-requests", str(len(requests)), "--time-scale", repr(time_scale)],
    )
    factor = float(np.mean(ratios))
    scaled = CostModel(
        cost.g1 * factor, cost.g2 * factor, cost.g3 * factor, cost.c0 * factor, source="cluster"
    )
    path = save_profile(scaled, profile_path, os.path.join(out, "profile_cluster.json"))
    print(
        f"  cluster warm-up ({len(requests)} requests): workers' steps took {', '.join(f'{r:.2f}x' for r in ratios)} "
        f"the prediction; cluster profile = profile x {factor:.3f} -> {path}",
        flush=True,
    )
    return path, scaled


def two_workers(
    profile_path: str,
    cost: CostModel,
    slice_cost: CostModel,
    load: float,
    seconds: float,
    repeats: int,
    out: str,
    port: int,
    other: tuple[str, str] | None,
) -> tuple[list[dict], list[dict]]:
    # Each worker has one core: two instances take twice one worker's share of predicted prefill work.
    requests, time_scale = trace_slice(slice_cost, 2 * load, seconds)
    n = len(requests)
    print(
        f"\n== two workers behind the router: {n} requests over {requests[-1].arrival:.0f} s "
        f"(arrivals x{time_scale:.4f}), {repeats} real run(s) per router policy",
        flush=True,
    )
    # Exactly the requests `plaserve bench` will send (it reads the same rows with the same scaling).
    same = load_trace(
        TRACE,
        limit=n,
        time_scale=time_scale,
        length_scale=LENGTH_SCALE,
        max_prompt_tokens=MAX_PROMPT,
        max_output_tokens=MAX_OUTPUT,
    )
    assert [(r.prompt_tokens, r.output_tokens) for r in same] == [
        (r.prompt_tokens, r.output_tokens) for r in requests
    ]
    rows, diag = [], []
    for router in ("pla", "round_robin"):
        reals, ratios = [], []
        for rep in range(repeats):
            real, r = run_cluster(
                router,
                profile_path,
                port,
                os.path.join(out, f"cluster_{router}_{rep}"),
                ["--num-requests", str(n), "--time-scale", repr(time_scale)],
            )
            reals.append([x["ttft"] for x in real if x["ttft"] is not None and x["error"] is None])
            ratios.append(r)
            p50, p90 = ttft_pcts(reals[-1])
            print(
                f"  {router} real run: TTFT p50 {p50:.0f} ms, p90 {p90:.0f} ms; workers' steps took "
                f"{', '.join(f'{x:.2f}x' for x in r)} the prediction",
                flush=True,
            )
        sim, extra = sim_ttfts(same, profile_path, 2, "pla", router)
        rows.append(
            row(
                "2 workers + router (HTTP)",
                "pla",
                router,
                reals,
                sim,
                None,
                sum(extra["busy_s"]) / 2 / extra["duration_s"],
                n,
            )
        )
        rows[-1]["worker_step_time_over_predicted"] = ratios
        if other is not None:
            sim2, extra2 = sim_ttfts(same, other[1], 2, "pla", router)
            diag.append(
                row(
                    f"2 workers, {other[0]} profile",
                    "pla",
                    router,
                    reals,
                    sim2,
                    None,
                    sum(extra2["busy_s"]) / 2 / extra2["duration_s"],
                    n,
                )
            )
    return rows, diag


def table(rows: list[dict]) -> str:
    lines = [
        "| setup | scheduler | router | n | TTFT p50 real (runs) | sim | error | TTFT p90 real (runs) | sim | "
        "error | within 15 % |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def real(r: dict, q: str) -> str:
        runs = r[f"real_{q}_runs"]
        spread = f" ({min(runs):.0f}-{max(runs):.0f})" if len(runs) > 1 else ""
        return f"{r[f'real_{q}']:.0f} ms{spread}"

    for r in rows:
        ok = abs(r["err_p50"]) <= TARGET and abs(r["err_p90"]) <= TARGET
        lines.append(
            f"| {r['setup']} | {r['scheduler']} | {r['router']} | {r['n']} | {real(r, 'p50')} | "
            f"{r['sim_p50']:.0f} ms | {r['err_p50'] * 100:+.0f}% | {real(r, 'p90')} | "
            f"{r['sim_p90']:.0f} ms | {r['err_p90'] * 100:+.0f}% | {'yes' if ok else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seconds", type=float, default=45.0, help="length of each real run")
    p.add_argument("--out", default="/tmp/sim_validation")
    p.add_argument("--port", type=int, default=31000)
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="real runs per pair; the simulation is compared with their median percentiles",
    )
    p.add_argument(
        "--load",
        type=float,
        default=0.6,
        help="predicted prefill work per instance as a share of the run (decodes come on top)",
    )
    p.add_argument("--only", choices=("single", "cluster"), default=None)
    p.add_argument(
        "--profile",
        choices=("warm-up", "isolated"),
        default="warm-up",
        help="the profile validated: fitted on a warm-up replay's steps (default) or on isolated "
        "prefills; the other one is simulated too, as a diagnostic",
    )
    args = p.parse_args(argv)
    logging.getLogger("plaserve").setLevel(logging.ERROR)
    os.makedirs(args.out, exist_ok=True)
    device = resolve_device("auto")
    loaded = load_model(None, resolve_dtype("auto", device), device)
    print("model: embedded default (RANDOM WEIGHTS), float32 on", device)
    print("fitting cost models on this machine ...", flush=True)
    rows, diag = [], []
    p1 = os.path.join(args.out, "profile_1thread.json")
    cost1 = fit_profile(loaded, 1, p1)
    log = StepLog()
    p2, cost2 = warm_up_fit(loaded, p1, cost1, args.seconds / 2, log, args.out)
    profiles = {"warm-up": (p2, cost2), "isolated": (p1, cost1)}
    path, cost = profiles[args.profile]
    other_name = "isolated" if args.profile == "warm-up" else "warm-up"
    other = (other_name, profiles[other_name][0])
    print(f"validated profile: {args.profile} ({path})", flush=True)
    # The slices are sized with the isolated fit either way, so both choices replay the same requests.
    if args.only in (None, "single"):
        r, d = single_instance(
            loaded, path, cost, cost1, args.load, args.seconds, args.repeats, log, other
        )
        rows, diag = rows + r, diag + d
    if args.only in (None, "cluster"):
        print("\n== calibrating the profile for a worker inside the cluster", flush=True)
        cpath, ccost = cluster_profile(
            path, cost, cost1, args.load, args.seconds / 2, args.out, args.port
        )
        r, d = two_workers(
            cpath,
            ccost,
            cost1,
            args.load,
            args.seconds,
            args.repeats,
            args.out,
            args.port,
            (f"{args.profile} (in-process)", path),
        )
        rows, diag = rows + r, diag + d
    text = table(rows)
    print(f"\nValidation (the {args.profile} profile on both sides):\n" + text)
    print(
        f"\nDiagnostic (the same real runs, simulated with the {other_name} profile):\n"
        + table(diag)
    )
    with open(os.path.join(args.out, "sim_validation.json"), "w") as f:
        json.dump(
            {
                "profile": args.profile,
                "rows": rows,
                "diagnostic_rows": diag,
                "table": text,
                "diagnostic_table": table(diag),
                "seconds": args.seconds,
                "load": args.load,
                "repeats": args.repeats,
            },
            f,
            indent=1,
        )
    return 0


if __name__ == "__main__":
    t0 = time.time()
    code = main()
    print(f"\n(total {time.time() - t0:.0f} s)")
    sys.exit(code)
