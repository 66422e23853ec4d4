"""Hub model ids through a fake Hugging Face cache on disk (no network): ``resolve_model`` offline,
and ``plaserve serve ORG/NAME --revision ... --chat-template ... --generation-config ...`` live."""

from __future__ import annotations

import hashlib
import json
import os

import httpx
import openai
import pytest

from plaserve.launcher import ServerProcess
from plaserve.model.hub import is_repo_id, resolve_model

REPO = "tiny-org/tiny-qwen"
COMMITS = {"main": "a" * 40, "v1": "b" * 40}


def build_hub_cache(hf_home: str, checkpoint: str) -> dict[str, str]:
    """``REPO`` in a hub cache under ``hf_home`` as huggingface_hub lays it out (refs naming commits,
    snapshots of links into content-addressed blobs): ``main`` and the tag ``v1``, whose
    generation_config.json also sets sampling defaults. Returns each revision's snapshot."""
    repo = os.path.join(hf_home, "hub", "models--" + REPO.replace("/", "--"))
    os.makedirs(os.path.join(repo, "blobs"), exist_ok=True)
    os.makedirs(os.path.join(repo, "refs"), exist_ok=True)
    snapshots = {}
    for ref, commit in COMMITS.items():
        snap = os.path.join(repo, "snapshots", commit)
        os.makedirs(snap)
        for name in os.listdir(checkpoint):
            with open(os.path.join(checkpoint, name), "rb") as f:
                data = f.read()
            if name == "generation_config.json" and ref == "v1":
                config = json.loads(data) | {"temperature": 0.0, "max_new_tokens": 3}
                data = json.dumps(config).encode()
            blob = os.path.join(repo, "blobs", hashlib.sha256(data).hexdigest())
            with open(blob, "wb") as f:
                f.write(data)
            os.symlink(os.path.relpath(blob, snap), os.path.join(snap, name))
        with open(os.path.join(repo, "refs", ref), "w") as f:
            f.write(commit)
        snapshots[ref] = snap
    return snapshots


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory, qwen2_ckpt: str) -> tuple[str, dict[str, str]]:
    hf_home = str(tmp_path_factory.mktemp("hf_home"))
    return hf_home, build_hub_cache(hf_home, qwen2_ckpt)


@pytest.fixture
def offline(hub, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """huggingface_hub pointed at the fake cache, offline (it reads these at call time)."""
    from huggingface_hub import constants

    hf_home, snapshots = hub
    monkeypatch.setattr(constants, "HF_HUB_CACHE", os.path.join(hf_home, "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return snapshots


def test_ids_resolve_from_the_cache_by_revision(offline: dict[str, str], qwen2_ckpt: str) -> None:
    assert resolve_model(REPO) == offline["main"]
    assert resolve_model(REPO, "v1") == offline["v1"]
    assert resolve_model(REPO, COMMITS["v1"]) == offline["v1"]
    assert resolve_model(qwen2_ckpt) == qwen2_ckpt  # a directory is used as it is
    with pytest.raises(FileNotFoundError, match="not in the Hugging Face cache .*HF_HUB_OFFLINE"):
        resolve_model("tiny-org/absent")
    with pytest.raises(FileNotFoundError, match="neither a local directory"):
        resolve_model("/no/such/dir")
    assert (
        is_repo_id("Qwen/Qwen2.5-0.5B-Instruct")
        and not is_repo_id("../x")
        and not is_repo_id("a/b/c")
    )


def test_serve_a_hub_id_offline_with_its_flags(hub, tmp_path) -> None:
    """The id is the served name; --revision picks v1, whose generation config makes requests
    without their own settings greedy and 3 tokens long; --chat-template replaces the template."""
    hf_home, _ = hub
    template = tmp_path / "chat.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m['role'] | upper }}] {{ m['content'] }}\n{% endfor %}[ASSISTANT]"
    )
    env = dict(os.environ, HF_HOME=hf_home, HF_HUB_OFFLINE="1")
    env.pop("HF_HUB_CACHE", None)
    args = [
        REPO,
        "--revision",
        "v1",
        "--chat-template",
        str(template),
        "--kv-cache-memory",
        "64MiB",
        "--dtype",
        "float32",  # no torch.compile at start-up
    ]
    with ServerProcess(args, env=env) as proc:
        with openai.OpenAI(base_url=f"{proc.url}/v1", api_key="x", max_retries=0) as client:
            assert client.models.list().data[0].id == REPO
            a, b = (client.completions.create(model=REPO, prompt="Hello") for _ in range(2))
            assert a.usage.completion_tokens == 3 and a.choices[0].text == b.choices[0].text
            explicit = client.completions.create(model=REPO, prompt="Hello", max_tokens=5)
            assert explicit.usage.completion_tokens == 5  # a request's own value wins
        messages = [{"role": "user", "content": "hi"}]
        ids = httpx.post(f"{proc.url}/tokenize", json={"messages": messages}).json()["tokens"]
        text = httpx.post(
            f"{proc.url}/tokenize",
            json={"prompt": "[USER] hi\n[ASSISTANT]", "add_special_tokens": False},
        ).json()["tokens"]
        assert ids == text
