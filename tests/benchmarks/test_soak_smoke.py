"""Smoke test of ``benchmarks/soak.py``'s chaos clients at toy sizes: random bodies over the whole API
against one server and a prefill/decode pair with caches small enough to preempt, then every block
back. Timings are not checked; an error (a 5xx, an error event, a failed connection) or a leaked
block fails it."""

from __future__ import annotations

import json
import random
from pathlib import Path


def test_chaos_clients_end_without_errors_or_leaks(load_benchmark, tmp_path: Path) -> None:
    soak = load_benchmark("soak")
    argv = ["--duration", "10", "--sample-every", "5", "--warm-up", "0", "--rate", "0"]
    argv += ["--chaos", "6", "--kv-cache-memory", "6MiB", "--max-model-len", "768"]
    argv += ["--targets", "one,pd", "--kv-transfer-ttl", "10", "--out", str(tmp_path)]
    assert soak.main(argv) == 0, (tmp_path / "soak.md").read_text()
    targets = json.loads((tmp_path / "soak.json").read_text())["targets"]
    assert [t["name"] for t in targets] == ["one server", "PD router + prefill + decode"]
    for t in targets:
        assert t["outcomes"].get("chaos_ok", 0) > 0 and t["samples"][-1]["leaked"] == 0


def test_chaos_bodies_are_valid_and_varied(load_benchmark) -> None:
    """The bodies cover what they claim (every path, streams cut and abandoned, the fields)."""
    soak = load_benchmark("soak")
    rng = random.Random(0)
    requests = [soak.chaos_request(rng) for _ in range(2000)]
    assert {path for path, _, _ in requests} == {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
    }
    cuts = [cut for _, _, cut in requests]
    assert -1 in cuts and any(c is not None and c >= 0 for c in cuts) and None in cuts
    fields = set().union(*(body for _, body, _ in requests))
    for name in ("n", "logprobs", "echo", "tools", "response_format", "structured_outputs", "seed"):
        assert name in fields, name
    for _, body, _ in requests:
        if "min_tokens" in body:
            assert body["min_tokens"] <= body["max_tokens"]
    # a mutant differs from its body in one field (dropped, odd or added), the body left intact
    bodies = [json.dumps(body) for _, body, _ in requests[:500]]
    mutants = [soak.mutate(rng, body) for _, body, _ in requests[:500]]
    assert [json.dumps(body) for _, body, _ in requests[:500]] == bodies
    assert sum(json.dumps(m) != b for m, b in zip(mutants, bodies)) > 450
