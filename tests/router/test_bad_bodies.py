"""The router refuses the bodies that once crashed servers with a 4xx in OpenAI's shape, as the worker
behind it does, and keeps routing."""

from __future__ import annotations

import httpx
import pytest

from plaserve.launcher import RouterProcess, ServerProcess

from ..server.test_faults import REGRESSIONS, assert_openai_error


@pytest.fixture(scope="module")
def router(qwen2_ckpt: str):
    with (
        ServerProcess(
            [qwen2_ckpt, "--kv-cache-memory", "16MiB", "--max-model-len", "256", "--no-compile"]
        ) as worker,
        RouterProcess([worker.url]) as proc,
    ):
        yield proc


@pytest.mark.parametrize(
    "path,raw,param", REGRESSIONS, ids=[f"{i}" for i in range(len(REGRESSIONS))]
)
def test_the_router_refuses_bad_bodies_with_a_4xx(
    router: RouterProcess, path: str, raw: bytes, param
) -> None:
    resp = httpx.post(
        f"{router.url}{path}", content=raw, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert resp.status_code == 400, resp.text
    assert_openai_error(resp.status_code, resp.json())


def test_the_router_still_routes(router: RouterProcess) -> None:
    resp = httpx.post(
        f"{router.url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3}, timeout=60
    )
    assert resp.status_code == 200
    assert "Traceback" not in router.log()
