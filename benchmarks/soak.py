"""Soak: a long mixed replay against one server, a 2-worker router and a prefill/decode pair, watching
for leaks.

The targets (``--targets``) run side by side, each with its own open-loop client: ``plaserve serve``
alone (``one``), ``plaserve route`` in front of two ``plaserve serve`` workers (``router``), and
``plaserve route --prefill-urls --decode-urls`` in front of a prefill and a decode worker (``pd``; all
real processes on 127.0.0.1, the embedded default model). Arrivals follow a Poisson process; prompt and output lengths come from a real
trace (scaled). The mix is what a server meets in a day: streamed and whole completions, chat, ``n`` = 2,
Responses (half of them continuing an earlier one by ``previous_response_id``, against a store small
enough to fill and forget, ``--response-store-mib``; a fifth streamed in the background, left after
three events, then resumed or cancelled) and Anthropic Messages, clients that walk away mid-stream, and bad requests (NaN temperatures, over-deep JSON, lone surrogates)
that must get a 4xx. ``--chaos N`` adds N closed-loop clients a target that send random bodies over
the whole API (``n`` 1-3, logprobs and echo, tools, structured outputs, stop strings, penalties, logit
biases, stream intervals; one in seven with a field given an odd value, dropped or added, which may
earn a 4xx, never a 5xx) and leave streams after 0-6 events or whole answers before they come; with a
KV cache of a few MiB (``--kv-cache-memory``) they preempt all the time. ``--rate 0`` leaves the
Poisson mix out.

Every ``--sample-every`` seconds it records, for each process: resident memory (VmRSS), open file
descriptors, (workers) KV blocks in use and the bytes their Response stores keep. At the end it waits for the servers to go idle and reads
their KV blocks again: any block still held is a leak. The report gives each series' least-squares
slope after ``--warm-up`` seconds (MiB/hour, descriptors/hour), the first and last samples, and the
request outcomes; a 5xx or a failed connection counts as an error.

Usage::

    PYTHONPATH=src .venv/bin/python benchmarks/soak.py --duration 1800 --out out/soak   # 30 minutes
    PYTHONPATH=src .venv/bin/python benchmarks/soak.py --duration 60 --sample-every 10   # a quick look
    PYTHONPATH=src .venv/bin/python benchmarks/soak.py --duration 60 --sample-every 10 --rate 0 \
        --chaos 32 --kv-cache-memory 3MiB --max-model-len 768                                           # chaos only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import aiohttp

from plaserve.launcher import PlaserveProcess, RouterProcess, ServerProcess
from plaserve.testing.odd_values import ODD_VALUES
from plaserve.workload.trace import load_trace

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "azure_conv_2023.csv"
SERVER_ARGS = ["--policy", "pla"]
BAD_BODIES = [  # each must be refused with a 4xx
    b'{"prompt": "Hello", "max_tokens": 8, "temperature": NaN}',
    b'{"prompt": "Hello", "max_tokens": 8, "repetition_penalty": 1e-300}',
    b'{"prompt": "Hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"prompt": "Hi \\ud800", "max_tokens": 4}',
    b'{"prompt": "Hi", "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"prompt": "Hi", "seed": 18446744073709551616}',
]


def read_proc(pid: int) -> tuple[float, int]:
    """(resident MiB, open file descriptors) of process ``pid``."""
    with open(f"/proc/{pid}/status") as f:
        rss_kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(seconds, value)`` points, per hour (0 for fewer than two)."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx, my = sum(t for t, _ in points) / n, sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    return 0.0 if var == 0 else 3600 * sum((t - mx) * (v - my) for t, v in points) / var


@dataclass
class Target:
    """One system under soak: where its clients send requests, and the processes to watch."""

    name: str
    url: str
    processes: dict[str, PlaserveProcess]  # role -> process
    workers: list[str]  # URLs whose /load KV blocks are read
    outcomes: dict[str, int] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)
    response_ids: list[str] = field(default_factory=list)  # Responses to continue, newest last
    refusals: set[str] = field(default_factory=set)  # the chaos clients' 4xx, one line a kind
    error_lines: set[str] = field(default_factory=set)  # their 5xx and error events, with bodies

    def count(self, outcome: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


async def worker_books(session: aiohttp.ClientSession, worker: str) -> tuple[int, int]:
    """(KV blocks in use, bytes of kept Responses) of a worker, from its ``/load``."""
    async with session.get(f"{worker}/load") as r:
        load = await r.json()
        return load["kv"]["used_blocks"], load["responses"]["bytes"]


async def background_stream(
    session: aiohttp.ClientSession, target: Target, rng: random.Random, prompt_len: int, out: int
) -> None:
    """A streamed background Response whose client leaves after three events; then either resumed
    (``GET ...?stream=true&starting_after=2``, which must end with ``response.completed``) or
    cancelled. One that ended meanwhile and that the store forgot since is a 404, counted apart."""
    body = {"input": "x" * prompt_len, "max_output_tokens": out, "ignore_eos": True}
    body |= {"background": True, "stream": True}
    async with session.post(f"{target.url}/v1/responses", json=body) as r:
        if r.status != 200:
            await r.read()
            target.count(f"http_{r.status}")
            return
        events: list[dict] = []
        async for line in r.content:
            if line.startswith(b"data:"):
                events.append(json.loads(line[5:]))
                if len(events) == 3:
                    break  # leaving the block closes the connection mid-stream
    rid = events[0]["response"]["id"]
    if rng.random() < 0.3:
        async with session.post(f"{target.url}/v1/responses/{rid}/cancel") as r:
            await r.read()
            target.count(_background_outcome(r.status, "background_cancelled"))
        return
    query = {"stream": "true", "starting_after": "2"}
    async with session.get(f"{target.url}/v1/responses/{rid}", params=query) as r:
        data = await r.read()
    last = [line for line in data.split(b"\n") if line.startswith(b"data:")][-1:]
    done = r.status == 200 and last and json.loads(last[0][5:])["type"] == "response.completed"
    target.count(_background_outcome(r.status if done else 0, "background_resumed"))


def _background_outcome(status: int, ok: str) -> str:
    return {200: ok, 404: "background_forgotten"}.get(status, f"background_broken_{status}")


async def response_request(
    session: aiohttp.ClientSession, target: Target, rng: random.Random, prompt_len: int, out: int
) -> None:
    """A Responses request (a fifth of them streamed in the background, :func:`background_stream`),
    half of them continuing an earlier one (``previous_response_id``; one the
    store has forgotten since is a 400 ``previous_response_not_found``), half of them streamed."""
    if rng.random() < 0.2:
        await background_stream(session, target, rng, prompt_len, out)
        return
    body: dict[str, Any] = {"input": "x" * prompt_len, "max_output_tokens": out, "ignore_eos": True}
    if target.response_ids and rng.random() < 0.5:
        body["previous_response_id"] = rng.choice(target.response_ids[-50:])
    body["stream"] = rng.random() < 0.5
    async with session.post(f"{target.url}/v1/responses", json=body) as r:
        data = await r.read()
        if r.status == 400 and b"previous_response_not_found" in data:
            target.count("responses_forgotten")
            return
        if r.status != 200:
            target.count(f"http_{r.status}")
            return
    if body["stream"]:  # the id is in the first event, response.created
        first = next(line for line in data.split(b"\n") if line.startswith(b"data:"))
        rid = json.loads(first[5:])["response"]["id"]
        if b'"type":"error"' in data:
            target.count("stream_error")
            return
    else:
        rid = json.loads(data)["id"]
    target.response_ids = target.response_ids[-199:] + [rid]
    target.count("responses_ok")


async def message_request(
    session: aiohttp.ClientSession, target: Target, rng: random.Random, prompt_len: int, out: int
) -> None:
    """An Anthropic Messages request, half of them streamed."""
    body = {
        "messages": [{"role": "user", "content": "x" * prompt_len}],
        "max_tokens": out,
        "ignore_eos": True,
        "stream": rng.random() < 0.5,
    }
    async with session.post(f"{target.url}/v1/messages", json=body) as r:
        data = await r.read()
        broken = body["stream"] and b"event: error" in data
        target.count(
            "stream_error" if broken else "messages_ok" if r.status == 200 else f"http_{r.status}"
        )


async def one_request(
    session: aiohttp.ClientSession,
    target: Target,
    rng: random.Random,
    prompt_len: int,
    output_len: int,
) -> None:
    """Send one request of a randomly chosen kind and count its outcome."""
    kinds = ["stream", "chat", "responses", "messages", "abandon", "n2", "bad"]
    kind = rng.choices(kinds, weights=[40, 10, 15, 10, 10, 5, 10])[0]
    prompt = [rng.randrange(10, 500) for _ in range(prompt_len)]
    try:
        if kind == "responses":
            await response_request(session, target, rng, prompt_len, output_len)
            return
        if kind == "messages":
            await message_request(session, target, rng, prompt_len, output_len)
            return
        if kind == "bad":
            async with session.post(
                f"{target.url}/v1/completions",
                data=rng.choice(BAD_BODIES),
                headers={"Content-Type": "application/json"},
            ) as r:
                await r.read()
                target.count("refused_4xx" if 400 <= r.status < 500 else f"bad_got_{r.status}")
            return
        if kind == "chat":
            body = {
                "messages": [{"role": "user", "content": "x" * prompt_len}],
                "max_tokens": output_len,
            }
            async with session.post(f"{target.url}/v1/chat/completions", json=body) as r:
                await r.read()
                target.count("ok" if r.status == 200 else f"http_{r.status}")
            return
        body = {
            "prompt": prompt,
            "max_tokens": output_len,
            "ignore_eos": True,
            "stream": kind != "n2",
            "n": 2 if kind == "n2" else 1,
            "temperature": 0.8,
        }
        async with session.post(f"{target.url}/v1/completions", json=body) as r:
            if r.status != 200:
                await r.read()
                target.count(f"http_{r.status}")
                return
            if kind == "n2":
                await r.read()
                target.count("ok")
                return
            chunks = 0
            async for line in r.content:
                if line.startswith(b"data:"):
                    chunks += 1
                    if b'"error"' in line:
                        target.count("stream_error")
                        return
                    if kind == "abandon" and chunks >= 3:
                        target.count("abandoned")
                        return  # leaving the block closes the connection mid-stream
            target.count("ok")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        target.count(f"client_error_{type(e).__name__}")


# Chaos clients (--chaos): closed-loop clients sending random bodies over the whole API surface.
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
        },
    },
}


def _chaos_sampling(rng: random.Random, body: dict[str, Any]) -> None:
    """Random sampling fields, each one in range (a body here must not earn a 4xx by them)."""
    optional: dict[str, Callable[[], Any]] = {
        "temperature": lambda: rng.choice([0.0, 0.3, 1.0, 1.7]),
        "top_p": lambda: rng.choice([0.1, 0.9, 1.0]),
        "top_k": lambda: rng.choice([-1, 1, 5, 50]),
        "min_p": lambda: rng.choice([0.0, 0.05, 0.5]),
        "seed": lambda: rng.randrange(2**31),
        "stop": lambda: rng.choice(["x", "\n", ["ab", "c"], []]),
        "stop_token_ids": lambda: [rng.randrange(1, 500) for _ in range(rng.randint(0, 3))],
        "presence_penalty": lambda: rng.uniform(-2, 2),
        "frequency_penalty": lambda: rng.uniform(-2, 2),
        "repetition_penalty": lambda: rng.choice([0.5, 1.0, 1.3]),
        "logit_bias": lambda: {str(rng.randrange(500)): rng.uniform(-100, 100) for _ in range(3)},
        "min_tokens": lambda: rng.randint(0, min(4, body["max_tokens"])),
        "ignore_eos": lambda: rng.random() < 0.5,
        "include_stop_str_in_output": lambda: True,
        "skip_special_tokens": lambda: False,
    }
    for name in rng.sample(sorted(optional), rng.randint(0, 6)):
        body[name] = optional[name]()


def _chaos_structured(rng: random.Random, body: dict[str, Any], chat: bool) -> None:
    """At times, a structured output of a random kind."""
    if rng.random() > 0.25:
        return
    kind = rng.choice(["json_object", "json_schema", "regex", "choice"])
    if kind == "json_object" and chat:
        body["response_format"] = {"type": "json_object"}
    elif kind == "json_schema" and chat:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "p", "schema": SCHEMA},
        }
    elif kind == "regex":
        body["structured_outputs"] = {"regex": "[a-c]{1,5}( [0-9]+)?"}
    else:
        body["structured_outputs"] = {"choice": ["yes", "no", "maybe so"]}


def chaos_request(rng: random.Random) -> tuple[str, dict[str, Any], int | None]:
    """A random valid request: ``(path, body, cut)``, ``cut`` the number of events (streams) after
    which the client leaves, ``-1`` for a whole answer abandoned before it comes, None to read all."""
    text = "".join(rng.choice("abc xyz\n{}\"'é日") for _ in range(1 + int(150 * rng.random() ** 2)))
    stream = rng.random() < 0.6
    path = rng.choices(
        ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"],
        weights=[35, 35, 15, 15],
    )[0]
    body: dict[str, Any] = {"stream": stream}
    if path == "/v1/completions":
        prompt: Any = text if rng.random() < 0.5 else [rng.randrange(1, 500) for _ in text]
        body |= {"prompt": prompt, "max_tokens": rng.randint(1, 24), "n": rng.randint(1, 3)}
        if rng.random() < 0.2:
            body["logprobs"] = rng.randint(0, 3)
            body["echo"] = rng.random() < 0.5
        _chaos_sampling(rng, body)
        _chaos_structured(rng, body, chat=False)
    elif path == "/v1/chat/completions":
        messages = [{"role": "user", "content": text}]
        if rng.random() < 0.3:
            messages = [{"role": "system", "content": "Be brief."}, *messages]
            messages += [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "go"}]
        body |= {"messages": messages, "max_tokens": rng.randint(1, 24), "n": rng.randint(1, 3)}
        if rng.random() < 0.2:
            body |= {"logprobs": True, "top_logprobs": rng.randint(0, 3)}
        if rng.random() < 0.2:
            choice = rng.choice(
                ["none", "required", {"type": "function", "function": {"name": "get_weather"}}]
            )
            body |= {"tools": [TOOL], "tool_choice": choice}
        else:
            _chaos_structured(rng, body, chat=True)
        _chaos_sampling(rng, body)
    elif path == "/v1/responses":
        body |= {
            "input": text,
            "max_output_tokens": rng.randint(1, 24),
            "store": rng.random() < 0.5,
        }
        for name in ("temperature", "top_p"):
            if rng.random() < 0.3:
                body[name] = rng.choice([0.01, 0.5, 1.0])
    else:
        body |= {"messages": [{"role": "user", "content": text}], "max_tokens": rng.randint(1, 24)}
        if rng.random() < 0.3:
            body["stop_sequences"] = ["x"]
    if stream and rng.random() < 0.3:
        if path in ("/v1/completions", "/v1/chat/completions"):
            body["stream_options"] = {"include_usage": True}
        body["stream_interval"] = rng.randint(1, 4)
    roll = rng.random()
    cut = (rng.randint(0, 6) if stream else -1) if roll < 0.3 else None
    return path, body, cut


def mutate(rng: random.Random, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` with one field, top-level or one level down, given an odd value, dropped or joined by
    an unknown one: the server must answer 200 or a 4xx, never a 5xx or an error event."""
    out = json.loads(json.dumps(body))
    holder: dict[str, Any] = out
    nested = [
        v if isinstance(v, dict) else v[0]
        for v in out.values()
        if isinstance(v, dict) and v or isinstance(v, list) and v and isinstance(v[0], dict)
    ]
    if nested and rng.random() < 0.4:
        holder = rng.choice(nested)
    roll = rng.random()
    if roll < 0.1:
        holder[rng.choice(["foo", "type", "role", "model", "n", "tools"])] = rng.choice(ODD_VALUES)
    elif roll < 0.2 and holder:
        holder.pop(rng.choice(sorted(holder)))
    elif holder:
        holder[rng.choice(sorted(holder))] = rng.choice(ODD_VALUES)
    return out


async def chaos_client(
    session: aiohttp.ClientSession, target: Target, rng: random.Random, end: float
) -> None:
    """Random requests back to back until ``end``, one in seven of them :func:`mutate`-d: a 5xx, a
    failed connection or an error event in a stream counts as an error; a 4xx is counted by its
    status and kept by its message, for the report to show."""
    while time.monotonic() < end:
        path, body, cut = chaos_request(rng)
        if rng.random() < 0.15:
            body = mutate(rng, body)
        try:
            if cut == -1:  # the client gives up before the answer: the server must notice
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        _chaos_send(session, target, path, body, None), rng.uniform(0, 0.3)
                    )
                    continue
                target.count("chaos_abandoned")
                continue
            await _chaos_send(session, target, path, body, cut)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            target.count(f"client_error_{type(e).__name__}")


async def _chaos_send(
    session: aiohttp.ClientSession, target: Target, path: str, body: dict, cut: int | None
) -> None:
    async with session.post(f"{target.url}{path}", json=body) as r:
        if r.status != 200:
            data = await r.read()
            target.count(f"chaos_{r.status}" if 400 <= r.status < 500 else f"http_{r.status}")
            line = f"{path} {r.status} {re.sub(rb'[0-9]+', b'#', data[:200])!r}"
            if r.status >= 500:  # with the body, to reproduce it
                target.error_lines.add(f"{line} for {json.dumps(body)[:1000]}")
            else:
                target.refusals.add(line)
            return
        if not body.get("stream"):
            await r.read()
            target.count("chaos_ok")
            return
        events = 0
        async for line in r.content:
            if line.startswith(b"event: error") or (
                line.startswith(b"data:") and b'"error"' in line[:40]
            ):
                target.count("stream_error")
                target.error_lines.add(f"{path} stream {line[:200]!r}")
                return
            if line.startswith(b"data:"):
                events += 1
                if cut is not None and events >= cut:
                    target.count("chaos_cut")
                    return  # leaving the block closes the connection mid-stream
        target.count("chaos_ok")


async def drive(
    target: Target,
    arrivals: list[tuple[int, int]],
    args: argparse.Namespace,
    seed: int,
) -> None:
    """Poisson arrivals at ``args.rate`` per second for ``args.duration`` seconds, lengths cycling over
    ``arrivals``, beside ``args.chaos`` closed-loop chaos clients (:func:`chaos_client`)."""
    rng = random.Random(seed)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        end, i = time.monotonic() + args.duration, 0
        tasks: set[asyncio.Task] = {
            asyncio.ensure_future(
                chaos_client(session, target, random.Random(seed * 1000 + c), end)
            )
            for c in range(args.chaos)
        }
        while args.rate > 0 and time.monotonic() < end:
            prompt_len, output_len = arrivals[i % len(arrivals)]
            i += 1
            task = asyncio.ensure_future(one_request(session, target, rng, prompt_len, output_len))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            await asyncio.sleep(rng.expovariate(args.rate))
        if tasks:
            await asyncio.wait(tasks)


async def sample(targets: list[Target], start: float, every: float, stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        while True:
            t = time.monotonic() - start
            for target in targets:
                row: dict[str, Any] = {"t": t}
                for role, proc in target.processes.items():
                    row[f"{role}_rss_mib"], row[f"{role}_fds"] = read_proc(proc.proc.pid)
                books = [await worker_books(session, w) for w in target.workers]
                row["kv_used"] = sum(kv for kv, _ in books)
                row["store_kib"] = sum(b for _, b in books) / 1024
                target.samples.append(row)
            print(
                f"[{t:7.0f} s] "
                + "; ".join(
                    f"{tg.name}: "
                    + ", ".join(f"{k} {v:.0f}" for k, v in tg.samples[-1].items() if k != "t")
                    for tg in targets
                ),
                file=sys.stderr,
                flush=True,
            )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), every)
            if stop.is_set():
                return


async def idle_kv(target: Target, timeout: float = 120.0) -> int:
    """KV blocks still held once every request has finished and every prefill parked for a pull that
    never came has expired (waits up to ``timeout``)."""
    async with aiohttp.ClientSession() as session:
        deadline = time.monotonic() + timeout
        while True:
            loads = []
            for w in target.workers:
                async with session.get(f"{w}/load") as r:
                    loads.append(await r.json())
            idle = all(x["num_requests"] == 0 and x["kv"]["used_blocks"] == 0 for x in loads)
            if idle or time.monotonic() > deadline:
                return sum(x["kv"]["used_blocks"] for x in loads)
            await asyncio.sleep(0.5)


def report(targets: list[Target], args: argparse.Namespace, wall: float) -> str:
    lines = [
        f"Soak of {wall / 60:.1f} min at {args.rate} requests/s per target (Poisson), warm-up "
        f"{args.warm_up:.0f} s excluded from the slopes; trace {TRACE.name}, lengths x{args.length_scale}.",
        "",
        "| target | process | RSS first / last (MiB) | RSS slope (MiB/h) | fds first / last | fds slope (/h) |",
        "|---|---|---|---|---|---|",
    ]
    for tg in targets:
        warm = [s for s in tg.samples if s["t"] >= args.warm_up] or tg.samples
        for role in tg.processes:
            rss = [(s["t"], s[f"{role}_rss_mib"]) for s in warm]
            fds = [(s["t"], s[f"{role}_fds"]) for s in warm]
            lines.append(
                f"| {tg.name} | {role} | {tg.samples[0][f'{role}_rss_mib']:.0f} / "
                f"{tg.samples[-1][f'{role}_rss_mib']:.0f} | {slope_per_hour(rss):+.1f} | "
                f"{tg.samples[0][f'{role}_fds']} / {tg.samples[-1][f'{role}_fds']} | "
                f"{slope_per_hour(fds):+.1f} |"
            )
    lines += [
        "",
        "| target | requests | outcomes | errors (5xx, failed connections) | KV blocks held when idle | "
        f"Response stores, largest sample (KiB; bound {args.response_store_mib * 1024:,.0f} a worker) |",
        "|---|---|---|---|---|---|",
    ]
    for tg in targets:
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(tg.outcomes.items()))
        store = max(s["store_kib"] for s in tg.samples)
        lines.append(
            f"| {tg.name} | {sum(tg.outcomes.values())} | {outcomes} | {errors(tg)} | "
            f"{tg.samples[-1]['leaked']} | {store:,.0f} |"
        )
    # every error, then the 4xx refusals (many kinds) up to 40
    errs = [f"- {tg.name}: {r}" for tg in targets for r in sorted(tg.error_lines)]
    refusals = [f"- {tg.name}: {r}" for tg in targets for r in sorted(tg.refusals)]
    if errs or refusals:
        lines += ["", "The chaos clients' error events and refusals (one line each kind):", ""]
        lines += errs + refusals[:40]
    return "\n".join(lines)


def errors(target: Target) -> int:
    """The requests that ended in a 5xx, a failed connection, an error event or a wrong answer to a
    bad body."""
    bad = ("http_5", "client_error", "bad_got", "stream", "background_broken")
    return sum(v for k, v in target.outcomes.items() if k.startswith(bad))


async def soak(targets: list[Target], args: argparse.Namespace) -> float:
    # The Poisson mix's lengths (chaos clients alone need no trace: ../shared may be absent)
    trace = load_trace(str(TRACE), limit=2000) if args.rate > 0 else []
    arrivals = [
        (
            max(1, min(1500, int(a.prompt_tokens * args.length_scale))),
            max(1, min(32, a.output_tokens)),
        )
        for a in trace
    ]
    start = time.monotonic()
    stop = asyncio.Event()
    sampler = asyncio.ensure_future(sample(targets, start, args.sample_every, stop))
    await asyncio.gather(
        *(drive(tg, arrivals, args, args.seed + i) for i, tg in enumerate(targets))
    )
    stop.set()
    await sampler
    for tg in targets:
        tg.samples[-1]["leaked"] = await idle_kv(tg)
    return time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for flag, default, what in (
        ("--duration", 1800.0, "seconds of load"),
        ("--rate", 0.8, "requests per second per target (Poisson; 0: none)"),
        ("--sample-every", 60.0, "seconds between samples"),
        ("--warm-up", 300.0, "seconds left out of the slopes"),
        ("--length-scale", 0.25, "trace prompt lengths times this"),
        (
            "--response-store-mib",
            0.01,
            "each server's Response store (small enough to fill and forget within minutes)",
        ),
        (
            "--kv-transfer-ttl",
            30.0,
            "how long the PD target's prefill worker keeps a KV nobody "
            "pulls (the end waits for such KV to expire)",
        ),
    ):
        p.add_argument(flag, type=float, default=default, help=f"{what} (default {default:g})")
    p.add_argument(
        "--targets",
        default="one,router,pd",
        help="comma-separated: one (a server), router (2 workers), pd (a prefill and a decode "
        "worker); default all three",
    )
    p.add_argument(
        "--chaos",
        type=int,
        default=0,
        help="closed-loop chaos clients per target, beside the Poisson mix (random bodies over the "
        "whole API, streams cut after 0-6 events, answers abandoned; default 0)",
    )
    p.add_argument(
        "--kv-cache-memory",
        default="256MiB",
        help="each server's KV cache (default 256MiB; a few MiB make the chaos clients preempt)",
    )
    p.add_argument(
        "--max-model-len", type=int, default=2048, help="each server's context (default 2048)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="directory for soak.json and soak.md")
    args = p.parse_args(argv)
    server_args = [*SERVER_ARGS, "--response-store-mib", str(args.response_store_mib)]
    server_args += [
        "--kv-cache-memory",
        args.kv_cache_memory,
        "--max-model-len",
        str(args.max_model_len),
    ]
    chosen = args.targets.split(",")
    if unknown := set(chosen) - {"one", "router", "pd"}:
        p.error(f"unknown targets {sorted(unknown)}")
    with contextlib.ExitStack() as stack:

        def serve(*extra: str) -> PlaserveProcess:
            return stack.enter_context(ServerProcess([*server_args, *extra]))

        def routed(name: str, workers: dict[str, PlaserveProcess], *extra: str) -> Target:
            """A router started with ``extra`` (by default in front of ``workers``) as a target."""
            urls = [w.url for w in workers.values()]
            router = stack.enter_context(RouterProcess([] if extra else urls, list(extra)))
            return Target(name, router.url, {"router": router, **workers}, urls)

        targets = []
        if "one" in chosen:
            single = serve()
            targets.append(Target("one server", single.url, {"server": single}, [single.url]))
        if "router" in chosen:
            targets.append(routed("router + 2 workers", {"worker 1": serve(), "worker 2": serve()}))
        if "pd" in chosen:
            ttl = ("--kv-transfer-ttl", str(args.kv_transfer_ttl))
            pre, dec = serve("--pd-role", "prefill", *ttl), serve("--pd-role", "decode")
            targets.append(
                routed(
                    "PD router + prefill + decode",
                    {"prefill": pre, "decode": dec},
                    *("--prefill-urls", pre.url, "--decode-urls", dec.url),
                )
            )
        wall = asyncio.run(soak(targets, args))
    table = report(targets, args, wall)
    print(table)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "soak.md").write_text(table + "\n")
        (out / "soak.json").write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "wall_s": wall,
                    "targets": [
                        {"name": tg.name, "outcomes": tg.outcomes, "samples": tg.samples}
                        for tg in targets
                    ],
                },
                indent=1,
            )
        )
    failed = sum(tg.samples[-1]["leaked"] + errors(tg) for tg in targets)
    return 0 if failed == 0 and not math.isnan(wall) else 1


if __name__ == "__main__":
    sys.exit(main())
