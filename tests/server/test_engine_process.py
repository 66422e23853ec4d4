"""The engine in its own process (``plaserve serve --engine-mode process``): it serves, it recovers from a failed
step as the in-process loop does, the server exits 1 when it dies, and it dies with the server."""

from __future__ import annotations

import functools
import json
import os
import pickle
import signal
import time
from pathlib import Path

import httpx
import pytest

from plaserve.launcher import ServerProcess
from plaserve.server.cli import engine_mode
from plaserve.server.engine_process import EngineProcess
from plaserve.testing.faults import failing_engine

from .conftest import BASE_ARGS
from .test_supervision import fails_then_recovers, live_server


def children(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``: their command lines."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
                found[int(stat.parent.name)] = cmdline.decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return found


def engine_child(pid: int) -> int:
    """The engine process of the server ``pid`` (multiprocessing's spawned child)."""
    found = [c for c, cmd in children(pid).items() if "spawn_main" in cmd]
    assert len(found) == 1, children(pid)
    return found[0]


def gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited, not yet reaped by its parent
            return True
        time.sleep(0.05)
    return False


def test_a_failed_step_in_the_engine_process_fails_its_requests_and_it_restarts(
    qwen2_ckpt: str,
) -> None:
    build = functools.partial(
        failing_engine,
        {6},  # by step 6 the prompts are part-way through prefill or decoding
        model=qwen2_ckpt,
        kv_cache_memory="16MiB",
        max_model_len=512,
        policy="fcfs",
        max_num_batched_tokens=64,
    )
    loop = EngineProcess(build)
    try:
        assert loop.pid != os.getpid() and loop.facts.max_model_len == 512
        with live_server(loop) as url:
            fails_then_recovers(url)  # /metrics, rendered by the engine process, counts it
    finally:
        loop.stop()
    assert not loop.alive and gone(loop.pid)


def test_an_engine_that_cannot_be_built_raises_in_the_server(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        EngineProcess(
            functools.partial(failing_engine, set(), model=str(tmp_path / "no-such-model"))
        )


PROCESS = [
    *BASE_ARGS,
    "--engine-mode",
    "process",
]  # auto picks a thread where torch takes every CPU


def test_auto_runs_the_engine_in_a_process_only_where_a_cpu_is_left_for_http(monkeypatch) -> None:
    import torch

    cpus = len(os.sched_getaffinity(0))
    assert engine_mode("auto", pd_worker=False) == (
        "process" if cpus > torch.get_num_threads() else "thread"
    )
    monkeypatch.setattr(torch, "get_num_threads", lambda: max(1, cpus - 1))
    assert engine_mode("auto", pd_worker=False) == ("process" if cpus > 1 else "thread")
    assert engine_mode("thread", pd_worker=False) == "thread"
    assert engine_mode("process", pd_worker=True) == "thread"  # PD's KV hand-off is in-process


def test_the_server_exits_1_when_its_engine_process_dies(qwen2_ckpt: str) -> None:
    with ServerProcess([qwen2_ckpt, *PROCESS]) as server:
        assert server.proc is not None
        engine = engine_child(server.proc.pid)
        ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 3})
        assert ok.status_code == 200
        room = httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"] - 2
        body = {"prompt": [5, 6], "max_tokens": room, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # decoding now
            os.kill(engine, signal.SIGKILL)
            rest = list(lines)
        assert any("error" in line for line in rest), rest[-3:]
        assert server.proc.wait(30) == 1
        assert "engine process ended" in server.log()


def test_the_engine_process_dies_with_the_server(qwen2_ckpt: str) -> None:
    with ServerProcess([qwen2_ckpt, *PROCESS]) as server:
        assert server.proc is not None
        kids = children(server.proc.pid)  # the engine and multiprocessing's resource tracker
        engine = engine_child(server.proc.pid)
        server.proc.kill()  # no chance to stop anything itself
        server.proc.wait(10)
        assert gone(engine), "the engine process outlived a SIGKILLed server"
        assert all(gone(pid) for pid in kids)


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_the_prefix_cache_is_reset_on_request(qwen2_ckpt: str, mode: str) -> None:
    """``POST /reset_prefix_cache`` (vLLM's): a prompt sent again finds nothing cached after it (the
    refusal while a request holds blocks is tested on the engine, where it is not a race)."""
    prompt = list(range(5, 69))  # four 16-token blocks
    with ServerProcess([qwen2_ckpt, *BASE_ARGS, "--engine-mode", mode]) as server:

        def cached() -> int:
            body = {"prompt": prompt, "max_tokens": 1}
            answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
            return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached() == 0 and cached() == 48
        reset = httpx.post(f"{server.url}/reset_prefix_cache", timeout=30)
        assert reset.status_code == 200 and reset.json() == {"success": True}
        assert cached() == 0 and cached() == 48


def test_engine_thread_serves_without_a_child(qwen2_ckpt: str) -> None:
    with ServerProcess([qwen2_ckpt, *BASE_ARGS, "--engine-mode", "thread"]) as server:
        assert server.proc is not None
        assert not [c for c in children(server.proc.pid).values() if "spawn_main" in c]
        resp = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 3})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3


def test_outputs_from_the_engine_process_carry_their_prompt(qwen2_ckpt: str) -> None:
    """Outputs cross the pipe without their prompt's token ids and the server puts its own back:
    usage counts the prompt, and echo with logprobs gives each prompt token its entry, streamed or
    not, for several requests at once."""
    prompts = [list(range(5, 5 + n)) for n in (40, 7, 90)]
    with ServerProcess([qwen2_ckpt, *BASE_ARGS, "--engine-mode", "process"]) as server:
        body = {"prompt": prompts, "max_tokens": 3, "echo": True, "logprobs": 1}
        whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert whole["usage"]["prompt_tokens"] == 40 + 7 + 90
        by_index = {c["index"]: c for c in whole["choices"]}
        for i, prompt in enumerate(prompts):
            assert len(by_index[i]["logprobs"]["tokens"]) == len(prompt) + 3
        stream = {**body, "stream": True, "stream_options": {"include_usage": True}}
        tokens: dict[int, int] = {}
        usage = None
        with httpx.stream("POST", f"{server.url}/v1/completions", json=stream, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    tokens[c["index"]] = tokens.get(c["index"], 0) + len(c["logprobs"]["tokens"])
                usage = chunk.get("usage") or usage
        assert tokens == {i: len(p) + 3 for i, p in enumerate(prompts)}
        assert usage is not None and usage["prompt_tokens"] == 40 + 7 + 90


def test_outputs_cross_the_pipe_as_deltas_and_come_out_whole(qwen2_ckpt: str) -> None:
    """Every output a real engine produces, with logprobs and prompt logprobs, and with a stop string
    that cuts the text at the end, crosses as what is new (pickled, as the pipe does) and is rebuilt
    equal on the server's side; a step's delta does not grow with the output."""
    from plaserve import EngineConfig, LLMEngine, SamplingParams
    from plaserve.server.engine_process import _Received, _Sent

    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=qwen2_ckpt, dtype="float32", kv_cache_memory="16MiB", max_model_len=512
        )
    )
    prompt = list(range(5, 45))
    greedy = dict(max_tokens=24, temperature=0, ignore_eos=True)
    full = engine.add_request(prompt, SamplingParams(**greedy))
    texts = []
    while engine.has_unfinished():
        texts += [out.outputs[0].text for out in engine.step()]
    text = full.output_text
    # A stop string that begins in text one step sent and ends in the next: the text it cuts has
    # crossed already, so that delta says the text is whole.
    cut, stop = next(
        (len(a) - 2, text[len(a) - 2 : len(a) + 1])
        for a, b in zip(texts, texts[1:])
        if len(a) >= 2
        and len(b) > len(a)
        and text.index(text[len(a) - 2 : len(a) + 1]) == len(a) - 2
    )
    params = {
        "logprobs": SamplingParams(**greedy, logprobs=2, prompt_logprobs=1),
        "stop": SamplingParams(**greedy, stop=[stop]),
    }
    reqs = {name: engine.add_request(prompt, p) for name, p in params.items()}
    names = {r.request_id: name for name, r in reqs.items()}
    sent = {rid: _Sent(rid) for rid in names}
    received = {rid: _Received(rid, prompt) for rid in names}
    sizes: dict[str, list[int]] = {name: [] for name in params}
    seen = cuts = 0
    while engine.has_unfinished():
        for out in engine.step():
            wire = pickle.dumps(sent[out.request_id].wire(out))
            sizes[names[out.request_id]].append(len(wire))
            delta = pickle.loads(wire)
            cuts += names[out.request_id] == "stop" and delta.text_whole
            rebuilt = received[out.request_id].add(delta)
            assert rebuilt.request_id == out.request_id
            assert rebuilt.outputs == out.outputs
            assert rebuilt.prompt_token_ids == prompt and rebuilt.prompt == out.prompt
            assert rebuilt.prompt_logprobs == out.prompt_logprobs
            assert (rebuilt.finished, rebuilt.num_cached_tokens) == (
                out.finished,
                out.num_cached_tokens,
            )
            assert rebuilt.metrics.ttft == out.metrics.ttft
            seen += 1
    assert reqs["stop"].output_text == text[:cut] and reqs["stop"].finish_reason == "stop"
    assert cuts == 1  # the stop string's first characters had crossed before it was found
    assert len(reqs["logprobs"].output_token_ids) == 24 and seen >= 24 + 7
    later = sizes["logprobs"][1:]  # the first carries the prompt's logprobs
    assert max(later) <= min(later) + 64, later
