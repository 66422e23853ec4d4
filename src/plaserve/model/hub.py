"""Model ids: ``Qwen/Qwen2.5-0.5B-Instruct`` to a local checkpoint directory through ``huggingface_hub``.

A directory that exists is used as it is. Anything else is a Hugging Face repository id, resolved by
``huggingface_hub.snapshot_download`` the way vLLM resolves one: from the local cache (``HF_HOME``,
``HF_HUB_CACHE``) when it holds the revision, downloaded on first use otherwise; with
``HF_HUB_OFFLINE=1`` only the cache is read. Only the files a checkpoint is served from are fetched
(configs, safetensors weights, tokenizer files, chat templates).
"""

from __future__ import annotations

import logging
import os
import re

log = logging.getLogger(__name__)

# What plaserve reads from a checkpoint (model/loader.py, model/tokenizer.py); no .bin or .pth weights.
CHECKPOINT_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def is_repo_id(name: str) -> bool:
    """Whether ``name`` reads as a hub repository id (``org/name`` or ``name``) rather than a path."""
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith((".", "-"))


def resolve_model(name: str, revision: str | None = None) -> str:
    """The local directory of ``name``: itself when it is a directory, else the snapshot of the hub
    repository ``name`` at ``revision`` (a branch, tag or commit; default ``main``).

    FileNotFoundError with the reason (not a directory and not an id; not in the cache while offline;
    no such repository or revision) when there is none."""
    if os.path.isdir(name):
        if revision is not None:
            log.warning("--revision %s ignored: %s is a local directory", revision, name)
        return name
    if not is_repo_id(name):
        raise FileNotFoundError(
            f"model {name!r} is neither a local directory nor a Hugging Face repository id"
        )
    import huggingface_hub
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{name}" + (f" at revision {revision}" if revision else "")
    try:
        path = huggingface_hub.snapshot_download(
            name, revision=revision, allow_patterns=CHECKPOINT_FILES
        )
    except LocalEntryNotFoundError:
        offline = " and HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else ""
        raise FileNotFoundError(
            f"model {where} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}){offline}, "
            "and could not be downloaded"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise FileNotFoundError(f"model {where}: {e}") from None
    log.info("model %s: %s", where, path)
    return str(path)
