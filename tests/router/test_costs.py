"""Cost profiles and cost models as the router reads them."""

from __future__ import annotations

import json

import pytest

from plaserve.router.costs import cost_model_from_dict, default_cost_model, load_cost_profile


def write(tmp_path, data) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(path)


def test_profile_with_extra_keys(tmp_path):
    path = write(
        tmp_path,
        {
            "cost_model": {"g1": 1e-4, "g2": 2e-8, "g3": 1e-6, "c0": 0.01, "source": "profile"},
            "short_threshold": 1024,
            "max_short_batch": 4,
            "fingerprint": {"model": "x"},
        },
    )
    model, threshold = load_cost_profile(path)
    assert (model.g1, model.g2, model.g3, model.c0, model.source) == (
        1e-4,
        2e-8,
        1e-6,
        0.01,
        "profile",
    )
    assert threshold == 1024
    assert model.prefill_time(1000) == pytest.approx(0.01 + 1e-4 * 1000 + 2e-8 * 1000 * 500)


def test_profile_without_threshold_or_optional_coefficients(tmp_path):
    model, threshold = load_cost_profile(write(tmp_path, {"cost_model": {"g1": 1e-4, "g2": 0}}))
    assert threshold is None and model.g3 == 0 and model.c0 == 0


@pytest.mark.parametrize(
    "data, match",
    [
        ("{not json", "not valid JSON"),
        ({"short_threshold": 512}, "cost_model"),
        ({"cost_model": {"g1": -1, "g2": 1e-9}}, "cost_model"),
        ({"cost_model": {"g1": 0, "g2": 0}}, "cost_model"),
        ({"cost_model": {"g1": "fast", "g2": 1e-9}}, "cost_model"),
        ({"cost_model": {"g1": 1e-4, "g2": 1e-9}, "short_threshold": 0}, "short_threshold"),
        ({"cost_model": {"g1": 1e-4, "g2": 1e-9}, "short_threshold": 51.5}, "short_threshold"),
    ],
)
def test_bad_profiles_name_the_problem(tmp_path, data, match):
    with pytest.raises(ValueError, match=match):
        load_cost_profile(write(tmp_path, data))


def test_cost_model_from_worker_load():
    load = {"g1": 2.1e-06, "g2": 7.1e-09, "g3": 0.0, "c0": 0.0, "source": "flops"}
    model = cost_model_from_dict(load, source="worker")
    assert model is not None and model.g1 == 2.1e-06 and model.source == "worker"
    assert cost_model_from_dict(None, "worker") is None
    assert cost_model_from_dict({"g1": float("nan"), "g2": 1e-9}, "worker") is None


def test_default_cost_model_is_quadratic_and_stated():
    model = default_cost_model()
    assert model.source.startswith("analytic:llama2-7b@H100")
    # Doubling a long prompt more than doubles its cost (the quadratic term), and costs are in the
    # tens-of-milliseconds range the docstring states.
    assert model.prefill_time(8000) > 2 * model.prefill_time(4000)
    assert 0.04 < model.prefill_time(2000) < 0.06
