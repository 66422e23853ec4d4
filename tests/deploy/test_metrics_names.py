"""Every metric the Grafana dashboard (deploy/grafana/plaserve.json) and the Gateway API Inference
Extension's endpoint picker query exists where it is queried: scraped from a live ``plaserve serve``
worker and a live ``plaserve route`` in front of it after a request through both, and, for the Ray
deployment's names, from the ingress process's registry (:mod:`plaserve.deploy.metrics`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from plaserve.launcher import RouterProcess, ServerProcess

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "plaserve.json"

# What the Inference Extension's endpoint picker (and llm-d's scorers built on it) read from a model
# server: queue length, running requests, KV-cache use (the older name too, for pickers before vLLM
# v1's rename), the KV-cache configuration (block size and blocks, for prefix-cache scoring), and
# the prefix cache's counters.
EPP_METRICS = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)
_SUFFIXES = {
    "_bucket": "histogram",
    "_sum": "histogram",
    "_count": "histogram",
    "_total": "counter",
}


def dashboard_metrics() -> set[str]:
    """The sample names the dashboard's queries select (every selector is written ``name{...}``)."""
    dash = json.loads(DASHBOARD.read_text())
    names: set[str] = set()
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            names |= set(re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\{", target["expr"]))
    return names - {"sum", "rate", "histogram_quantile"}


def exported(text: str) -> dict[str, str]:
    """Sample name -> metric type, for every sample a scrape could carry (labelled families with no
    child yet included, from their TYPE line)."""
    out: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        names = {fam.name, *(s.name for s in fam.samples)}
        if fam.type == "histogram":
            names |= {fam.name + x for x in ("_bucket", "_sum", "_count")}
        elif fam.type == "counter":
            names.add(fam.name + "_total")
        out.update(dict.fromkeys(names, fam.type))
    return out


@pytest.fixture(scope="module")
def scrapes() -> dict[str, dict[str, str]]:
    args = ["--kv-cache-memory", "32MiB", "--max-model-len", "1024", "--no-compile"]
    with ServerProcess(args) as worker, RouterProcess([worker.url]) as router:
        body = {"prompt": "Hello, metrics.", "max_tokens": 3, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            r.read()
        from plaserve.deploy.metrics import DeployMetrics

        return {
            "worker": exported(httpx.get(f"{worker.url}/metrics").text),
            "router": exported(httpx.get(f"{router.url}/metrics").text),
            "ray": exported(DeployMetrics().render().decode()),
        }


def _component(name: str) -> str:
    if name.startswith("plaserve_router_"):
        return "router"
    return "ray" if name.startswith("plaserve_ray_") else "worker"


def test_every_name_the_dashboard_queries_is_exported(scrapes) -> None:
    names = dashboard_metrics()
    assert len(names) >= 20, names  # the regex found the queries
    missing = [n for n in sorted(names) if n not in scrapes[_component(n)]]
    assert not missing, missing
    for name in names:  # a histogram's buckets are queried as _bucket, a counter as _total
        kind = scrapes[_component(name)][name]
        for suffix in ("_bucket", "_total"):
            if name.endswith(suffix):
                assert kind == _SUFFIXES[suffix], (name, kind)


def test_the_endpoint_pickers_metrics_are_exported(scrapes) -> None:
    worker = scrapes["worker"]
    missing = [n for n in EPP_METRICS if n not in worker]
    assert not missing, missing
    assert worker["vllm:num_requests_waiting"] == "gauge"
    assert worker["vllm:kv_cache_usage_perc"] == "gauge"


def test_the_dashboard_is_well_formed() -> None:
    dash = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dash["templating"]["list"]}
    for panel in dash["panels"]:
        if panel["type"] == "row":
            continue
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)) and refs, panel["title"]
        for t in panel["targets"]:
            used = set(re.findall(r"\$(\w+)", t["expr"])) - {"__rate_interval"}
            assert used <= variables, (panel["title"], used)
    titles = " ".join(p["title"] for p in dash["panels"])
    for topic in ("TTFT by length class", "backlog", "Pools"):
        assert topic in titles, topic
