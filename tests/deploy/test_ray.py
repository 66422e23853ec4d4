"""plaserve as a Ray Serve application on a local Ray instance: 2 CPU replicas of the embedded model
behind the OpenAI ingress, routed by the pla request router.

One Ray instance and one application serve every test of the module (Ray takes ~15 s to start and
stop on the 2-core development machine); the replica kill runs last. Skipped only when Ray is not
installed (``pip install 'plaserve[ray]'``; the test extra installs it).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray Serve is not installed: pip install 'plaserve[ray]'")

import aiohttp  # noqa: E402
import anthropic  # noqa: E402
import httpx  # noqa: E402
import openai  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from ray import serve  # noqa: E402

from plaserve.deploy.app import RayServeOptions, build_app  # noqa: E402
from plaserve.launcher import free_port  # noqa: E402
from plaserve.router.hints import HEADER  # noqa: E402

from ..router.test_failover import outcome  # noqa: E402

# Small KV cache and context: two engines share the machine with Ray.
SERVE_ARGS = ["--kv-cache-memory", "48MiB", "--max-model-len", "2048", "--no-compile"]
# One fixed cost model for both replicas (a worker measures its own at start, and two measured at
# once on two busy cores can differ several times over, which the router would rightly act on).
PROFILE = {
    "version": 1,
    "cost_model": {"g1": 2.0e-4, "g2": 1.0e-7, "g3": 0.0, "c0": 0.015, "source": "profile"},
    "short_threshold": 512,
    "max_short_batch": 16,
    "long_chunk_size": 512,
    "w_min": 0.015,
    "w_max": 0.06,
    "fingerprint": {},
}
LONG_PROMPT = [3 + i % 200 for i in range(1200)]  # token ids: a long request (>= 512 tokens)
SHORT_PROMPT = "Hello there, Ray."


@pytest.fixture(scope="module")
def app_url(tmp_path_factory: pytest.TempPathFactory):
    profile = tmp_path_factory.mktemp("ray") / "profile.json"
    profile.write_text(json.dumps(PROFILE))
    args = [*SERVE_ARGS, "--profile", str(profile), "--no-online-refit"]
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = RayServeOptions(
            replicas=2,
            serve_args=args,
            routing_stats_period_s=0.25,
            trust_length_hints_from="127.0.0.1/32",  # the tests' clients are the gateway
        )
        serve.run(build_app(options), name="plaserve", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        # ray.shutdown() ends every process of the local instance at once; serve.shutdown() first
        # would stop the replicas gracefully, 6 s more. Each replica's plaserve server dies with its
        # replica (die_with_parent), as the kill test checks.
        ray.shutdown()


@pytest.fixture
def client(app_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app_url}/v1", api_key="none", max_retries=0, timeout=60)


def families(url: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)}


def samples(fams: dict, name: str) -> list:
    return [s for s in fams[name].samples if s.name in (name, name + "_total")]


def test_completions_and_chat_through_the_ingress(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    out = client.completions.create(
        model=model, prompt=SHORT_PROMPT, max_tokens=6, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=5,
        extra_body={"ignore_eos": True},
    )
    assert chat.usage.completion_tokens == 5 and chat.choices[0].message.role == "assistant"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):  # the worker's 400, passed on
        client.completions.create(model=model, prompt=SHORT_PROMPT, max_tokens=0)
    bad = httpx.post(f"{client.base_url}completions", content=b"{not json", timeout=30)
    assert bad.status_code == 400 and "not valid JSON" in bad.json()["error"]["message"]
    # NaN parses (the field must refuse it by name): it reaches the worker, which answers a 400,
    # whole or streamed (the replica failed to write it on: a 500)
    for stream in ("false", "true"):
        nan = (
            b'{"prompt": "Hi", "max_tokens": 4, "temperature": NaN, "stream": %s}' % stream.encode()
        )
        r = httpx.post(f"{client.base_url}completions", content=nan, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text


def test_streaming_completion_and_chat(client: openai.OpenAI) -> None:
    model = client.models.list().data[0].id
    stream = client.completions.create(
        model=model,
        prompt=SHORT_PROMPT,
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 8
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason == "length") == 1
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Stream, please."}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(chat)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    # A sampled token that ends inside a UTF-8 character streams with the next: fewer text chunks
    # than tokens is right, so the tokens are counted by the usage.
    assert deltas[0].role == "assistant" and len(deltas) >= 2
    assert chunks[-1].usage.completion_tokens == 4
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_responses_api_through_the_ingress(client: openai.OpenAI) -> None:
    """OpenAI's Responses API: priced by its conversation, passed to a replica's server and back,
    whole and streamed (the stream goes on at its first text delta)."""
    model = client.models.list().data[0].id
    kw = {"input": "Say something.", "max_output_tokens": 5, "extra_body": {"ignore_eos": True}}
    whole = client.responses.create(model=model, **kw)
    assert whole.status == "incomplete" and whole.usage.output_tokens == 5
    with client.responses.stream(model=model, **kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.usage.output_tokens == 5


def test_anthropic_messages_through_the_ingress(app_url: str) -> None:
    claude = anthropic.Anthropic(base_url=app_url, api_key="none", max_retries=0, timeout=60)
    model = httpx.get(f"{app_url}/v1/models").json()["data"][0]["id"]
    kw = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 5,
        "extra_body": {"ignore_eos": True},
    }
    whole = claude.messages.create(**kw)
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 5
    with claude.messages.stream(**kw) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert final.usage.output_tokens == 5
    count = claude.messages.count_tokens(model=model, messages=kw["messages"])
    assert count.input_tokens == whole.usage.input_tokens


def test_kept_responses_are_continued_on_the_replica_that_keeps_them(client: openai.OpenAI) -> None:
    """Conversations begun at once land on both replicas; each follow-up (``previous_response_id``)
    and each read of a kept Response reaches the replica that keeps it (else: a 400 or 404)."""
    from concurrent.futures import ThreadPoolExecutor

    model = client.models.list().data[0].id
    kw = {"model": model, "max_output_tokens": 3, "extra_body": {"ignore_eos": True}}
    with ThreadPoolExecutor(6) as pool:
        first = list(pool.map(lambda i: client.responses.create(input=f"chat {i}", **kw), range(6)))
    assert len({r.id[:17] for r in first}) == 2  # resp_ and a 12-digit store tag: both replicas
    for resp in first:
        for turn in range(2):
            resp = client.responses.create(previous_response_id=resp.id, input=f"t{turn}", **kw)
        assert client.responses.retrieve(resp.id).output_text == resp.output_text
        assert len(client.responses.input_items.list(resp.id).data) == 5
        client.responses.delete(resp.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(resp.id)
    base = str(client.base_url).rstrip("/")
    assert httpx.post(f"{base}/responses/{first[0].id}/input_items").status_code == 405
    assert httpx.get(f"{base}/responses/{first[0].id}/other").status_code == 404
    # a background Response, cancelled on the replica that generates it
    long = client.responses.create(
        input="long", background=True, **(kw | {"max_output_tokens": 900})
    )
    assert client.responses.cancel(long.id).status == "cancelled"
    # a streamed one, left after three events and resumed on that replica
    with client.responses.create(
        input="story", background=True, stream=True, **(kw | {"max_output_tokens": 60})
    ) as stream:
        first = [e for _, e in zip(range(3), stream)]
    rest = list(client.responses.retrieve(first[0].response.id, stream=True, starting_after=2))
    assert [e.sequence_number for e in first + rest] == list(range(len(first + rest)))
    assert rest[-1].type == "response.completed" and rest[-1].response.usage.output_tokens == 60


def test_a_gateways_length_hint_prices_the_request_through_ray(
    app_url: str, client: openai.OpenAI
) -> None:
    def value(fams: dict, name: str, **labels: str) -> float:
        return sum(
            s.value
            for s in fams[name].samples
            if s.name in (name, name + "_total", name + "_count")
            and all(s.labels.get(k) == v for k, v in labels.items())
        )

    model = client.models.list().data[0].id
    before = families(app_url)
    stream = client.completions.create(
        model=model,
        prompt=SHORT_PROMPT,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers={HEADER: "1200"},
    )
    assert [c.usage.prompt_tokens for c in stream if c.usage][0] < 30
    after = families(app_url)
    grew = {
        (name, *labels.values()): value(after, name, **labels) - value(before, name, **labels)
        for name, labels in [
            ("plaserve_ray_priced_prompt_tokens", {"method": "hint"}),
            ("plaserve_ray_routed_requests", {"length_class": "long"}),  # the hint made it long
            ("plaserve_ray_length_hint_relative_error", {}),  # measured from the stream's usage
        ]
    }
    assert list(grew.values()) == [1200, 1, 1], grew
    with pytest.raises(openai.BadRequestError, match=HEADER):
        client.completions.create(
            model=model, prompt=SHORT_PROMPT, max_tokens=2, extra_headers={HEADER: "many"}
        )


def test_routing_decisions_are_in_the_metrics(app_url: str) -> None:
    before = families(app_url)
    routed_before = sum(s.value for s in samples(before, "plaserve_ray_routed_requests"))

    async def send() -> None:
        async with aiohttp.ClientSession() as s:

            async def one(prompt: object) -> int:
                body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
                async with s.post(f"{app_url}/v1/completions", json=body) as r:
                    await r.read()
                    return r.status

            statuses = await asyncio.gather(
                *(one(LONG_PROMPT) for _ in range(2)), *(one(SHORT_PROMPT) for _ in range(4))
            )
            assert statuses == [200] * 6

    asyncio.run(asyncio.wait_for(send(), 60))
    after = families(app_url)
    routed = samples(after, "plaserve_ray_routed_requests")
    assert sum(s.value for s in routed) - routed_before == 6
    by_class = {
        cls: sum(s.value for s in routed if s.labels["length_class"] == cls)
        for cls in ("short", "long")
    }
    assert by_class["long"] >= 2 and by_class["short"] >= 4, by_class
    replicas = {s.labels["replica"] for s in samples(after, "plaserve_ray_replica_backlog_seconds")}
    assert len(replicas) == 2, replicas  # the router priced both replicas
    assert samples(after, "plaserve_ray_replicas")[0].value == 2
    # Two long prompts at once on two idle replicas: the router ranks a different replica first for
    # each (the first one's cost is on its replica's backlog when the second is priced).
    first = samples(after, "plaserve_ray_first_choice")
    long_first = [s.value for s in first if s.labels["length_class"] == "long"]
    assert len([v for v in long_first if v > 0]) == 2, long_first


async def _outcome(session: aiohttp.ClientSession, url: str, stream: bool) -> str:
    """A streamed request's outcome (``outcome``: 'ok', 'stream_error' or 'http_<status>'), or a
    whole one's: 'ok' (10 tokens) or 'http_<status>'."""
    if stream:
        return await outcome(session, url, LONG_PROMPT)
    body = {"prompt": LONG_PROMPT, "max_tokens": 10, "ignore_eos": True}
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return f"http_{resp.status}"
        return "ok" if (await resp.json())["usage"]["completion_tokens"] == 10 else "short"


def _worker_actors() -> list[str]:
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if "PlaserveWorker" in a["name"]
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_replica_killed_under_load_loses_no_request(app_url: str) -> None:
    names = _worker_actors()
    assert len(names) == 2, names
    victim = ray.get_actor(names[0], namespace="serve")
    child_pid = ray.get(victim.record_routing_stats.remote())["pid"]

    async def main() -> list[str]:
        async with aiohttp.ClientSession() as s:
            tasks = [
                asyncio.ensure_future(_outcome(s, app_url, stream=i % 2 == 0)) for i in range(10)
            ]
            await asyncio.sleep(1.0)  # requests queued, prefilling and decoding on both replicas
            ray.kill(victim, no_restart=True)  # the replica's process dies at once (SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*tasks), 90)  # none hangs

    results = asyncio.run(main())
    assert set(results) <= {"ok", "stream_error"}, results
    assert results.count("ok") >= 5, results
    deadline = time.monotonic() + 10
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child_pid), "the killed replica's plaserve server outlived it"
    # Ray replaces the dead replica; the application serves on.
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        names_now = _worker_actors()
        if len(names_now) == 2 and names[0] not in names_now:
            status = serve.status().applications["plaserve"].status
            if status == "RUNNING":
                break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the replica was not replaced: {_worker_actors()}")
    fams = families(app_url)
    retried = samples(fams, "plaserve_ray_retries")[0].value
    errors = samples(fams, "plaserve_ray_stream_errors")[0].value
    print(f"outcomes: {results}; {retried:.0f} retried, {errors:.0f} stream errors")

    async def after() -> list[str]:
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*(_outcome(s, app_url, stream=True) for _ in range(2)))

    assert asyncio.run(asyncio.wait_for(after(), 60)) == ["ok", "ok"]


def test_the_serve_config_file_builds_the_application() -> None:
    """deploy/ray/serve_config.yaml is a config `serve run` accepts, and its args build the app."""
    import yaml
    from ray.serve.schema import ServeDeploySchema

    from plaserve.deploy.app import app_builder

    path = Path(__file__).resolve().parents[2] / "deploy" / "ray" / "serve_config.yaml"
    config = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    (application,) = config.applications
    assert application.import_path == "plaserve.deploy.app:app_builder"
    assert isinstance(app_builder(application.args), serve.Application)
    with pytest.raises(ValueError, match="unknown option.*replica_count"):
        app_builder({"replica_count": 2})


def test_the_command_line_refuses_bad_options_before_starting_ray() -> None:
    cmd = [sys.executable, "-m", "plaserve.cli", "ray-serve", "--replicas", "0"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2 and "replicas must be at least 1" in out.stderr, out.stderr
