"""``plaserve serve`` flag handling that fails before any model loads."""

from __future__ import annotations

import pytest

from plaserve.cli import main


def test_profile_is_refused_clearly_until_the_engine_supports_it(capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--profile", "profile.json"]) == 2
    assert "--profile is not supported yet" in capsys.readouterr().err


def test_max_queue_must_be_positive(capsys: pytest.CaptureFixture) -> None:
    assert main(["serve", "--max-queue", "0"]) == 2
    assert "--max-queue" in capsys.readouterr().err
