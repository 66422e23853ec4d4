"""A live ``plaserve serve`` process per test module, on the tiny Qwen2 checkpoint.

A module sets ``SERVER_ARGS`` (extra flags) to configure its server.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from plaserve.launcher import ServerProcess

# --no-compile: torch.compile's start-up (seconds a process, more on a busy machine) is tested with
# the engine (tests/model, tests/engine); the server's tests need a server, soon.
BASE_ARGS = ["--kv-cache-memory", "64MiB", "--no-compile"]


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, qwen2_ckpt: str) -> Iterator[ServerProcess]:
    extra = list(getattr(request.module, "SERVER_ARGS", []))
    with ServerProcess([qwen2_ckpt, *BASE_ARGS, *extra]) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    """The official OpenAI client pointed at the server (no retries: each status must show as it is)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
