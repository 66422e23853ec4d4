"""``plaserve serve`` flag handling that fails before any model loads."""

from __future__ import annotations

import pytest

from plaserve.cli import main


def test_missing_profile_fails_clearly(tmp_path, capsys: pytest.CaptureFixture) -> None:
    missing = str(tmp_path / "nope.json")
    assert main(["serve", "--profile", missing, "--kv-cache-memory", "256MiB"]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_max_queue_must_be_positive(capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--max-queue", "0"]) == 2
    assert "--max-queue" in capsys.readouterr().err
