"""The Ray Serve path against ``plaserve route``: the same 2 workers' configuration, the same trace slice.

* **route**: 2 ``plaserve serve`` processes (the embedded model, one CPU thread each) behind
  ``plaserve route --policy pla`` (child processes);
* **ray**: ``plaserve.deploy`` on a local Ray instance: 2 replicas, each a ``plaserve serve`` child
  with the same flags and one thread, behind the OpenAI ingress and the pla request router.

``plaserve bench`` replays the same trace slice against each (``--num-requests`` rows from
``--start``, prompts clamped to ``--max-prompt-tokens``, outputs to ``--max-output-tokens``, arrival
gaps times ``--time-scale``), one setup after the other; the table gives requests per second (finished
requests over the span from the first arrival to the last answer), TTFT by class, and errors. The
1-minute load average is printed before and after: the machine is shared.

    python benchmarks/ray_vs_route.py --trace ../shared/traces/azure_code_2023.csv [--out docs/ray_vs_route.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from plaserve.launcher import RouterProcess, ServerProcess, free_port  # noqa: E402

WORKER_ARGS = ["--kv-cache-memory", "64MiB", "--max-model-len", "2048", "--no-compile"]


def bench(url: str, args: argparse.Namespace, out: str) -> dict:
    """Run ``plaserve bench`` against ``url``; the summary plus requests per second."""
    cmd = [
        sys.executable,
        "-m",
        "plaserve.cli",
        "bench",
        "--url",
        url,
        "--trace",
        args.trace,
        "--start",
        str(args.start),
        "--num-requests",
        str(args.num_requests),
        "--max-prompt-tokens",
        str(args.max_prompt_tokens),
        "--max-output-tokens",
        str(args.max_output_tokens),
        "--time-scale",
        str(args.time_scale),
        "--out",
        out,
        "--no-plots",
    ]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "requests.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    done = [r for r in records if r.get("e2e") is not None and not r.get("error")]
    span = max(r["arrival"] + r["e2e"] for r in done) - min(r["arrival"] for r in records)
    return {"summary": summary, "requests_per_s": len(done) / span, "span_s": span}


def one_thread_env() -> dict[str, str]:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"
    return env


def run_route(args: argparse.Namespace, out: str) -> dict:
    with (
        ServerProcess(WORKER_ARGS, env=one_thread_env()) as a,
        ServerProcess(WORKER_ARGS, env=one_thread_env()) as b,
        RouterProcess([a.url, b.url], ["--policy", "pla"]) as router,
    ):
        return bench(router.url, args, out)


def run_ray(args: argparse.Namespace, out: str) -> dict:
    import ray
    from ray import serve

    from plaserve.deploy.app import RayServeOptions, build_app

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(
            build_app(RayServeOptions(replicas=2, serve_args=WORKER_ARGS)),
            name="plaserve",
            route_prefix="/",
        )
        return bench(f"http://127.0.0.1:{port}", args, out)
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", required=True)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--max-prompt-tokens", type=int, default=1500)
    p.add_argument("--max-output-tokens", type=int, default=16)
    p.add_argument("--time-scale", type=float, default=2.0)
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="runs of each setup, in the order route, ray, ray, route...",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    load_before = os.getloadavg()[0]
    results: list[dict] = []
    setups = {"route": run_route, "ray": run_ray}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            # ABBA: the machine's load drifts; each setup sees the early and the late part alike.
            for name in ("route", "ray") if i % 2 == 0 else ("ray", "route"):
                t = time.time()
                r = setups[name](args, os.path.join(tmp, f"{name}{i}"))
                results.append({"setup": name, "round": i, **r, "wall_s": time.time() - t})
    load_after = os.getloadavg()[0]
    print(f"load average (1 min): {load_before:.2f} before, {load_after:.2f} after")
    print(
        f"{'setup':<6} {'req/s':>6} {'err':>4} {'TTFT p50 short':>15} {'p90':>6} "
        f"{'TTFT p50 long':>14} {'p90':>6}  (ms)"
    )
    for r in results:
        s = r["summary"]
        print(
            f"{r['setup']:<6} {r['requests_per_s']:>6.2f} {s['all']['errors']:>4} "
            f"{s['short']['ttft_ms']['p50'] or 0:>15.0f} {s['short']['ttft_ms']['p90'] or 0:>6.0f} "
            f"{s['long']['ttft_ms']['p50'] or 0:>14.0f} {s['long']['ttft_ms']['p90'] or 0:>6.0f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "load_before": load_before,
                    "load_after": load_after,
                    "results": results,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
