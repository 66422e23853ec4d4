"""The Kubernetes manifests (deploy/kubernetes), checked offline: every overlay renders, every object
validates against the Kubernetes schemas (kubernetes-validate, strict: unknown fields fail) and the
InferencePool against its API's schema, and the pieces agree with each other and with plaserve
(every container's flags parse with plaserve's own parsers, the router lists every worker, the
pool selects the worker pods, the endpoint picker reads metrics plaserve exports).

The overlays use only kustomize's ``resources`` lists, so rendering is reading the listed files in
order (:func:`render`); where ``kubectl`` is installed its ``kubectl kustomize`` output must be the
same objects. No cluster runs here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from plaserve.router.cli import add_route_arguments
from plaserve.server.cli import add_serve_arguments

ROOT = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
OVERLAYS = ("router", "pd", "gateway")
K8S_VERSION = "1.33.0"
POOL_SCHEMA = json.loads((ROOT / "schemas" / "inferencepool-v1.schema.json").read_text())
# Flags of PD (being built: `serve --pd-role`, `route --prefill-urls/--decode-urls`) that this
# checkout's parsers may not know yet; every other flag must parse.
PD_FLAGS = {"--pd-role", "--prefill-urls", "--decode-urls"}


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects of a kustomization that lists only ``resources`` (files or directories)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(kustomization) <= {"apiVersion", "kind", "resources"}, (
        f"{directory}: only resources lists are used (the test renders them itself)"
    )
    objects: list[dict[str, Any]] = []
    for entry in kustomization["resources"]:
        path = (directory / entry).resolve()
        if path.is_dir():
            objects += render(path)
        else:
            objects += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return objects


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def container_args(workload: dict) -> list[str]:
    return workload["spec"]["template"]["spec"]["containers"][0]["args"]


def parse(add_arguments, args: list[str]) -> argparse.Namespace:
    """Parse with plaserve's parser; flags of PD are the only ones allowed to be unknown."""
    p = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(p)
    known, unknown = p.parse_known_args(args)
    flags = {a for a in unknown if a.startswith("--")}
    assert flags <= PD_FLAGS, f"unknown flags {flags - PD_FLAGS} in {args}"
    return known


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    return request.param, render(ROOT / "overlays" / request.param)


def test_every_object_validates_against_the_kubernetes_schemas(overlay) -> None:
    name, objects = overlay
    assert objects, name
    for obj in objects:
        if obj["kind"] == "InferencePool":
            jsonschema.validate(obj, POOL_SCHEMA)
            ports = [p["number"] for p in obj["spec"]["targetPorts"]]
            assert len(ports) == len(set(ports)), "target port numbers are unique (the CRD's rule)"
            continue
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_inferencepool_schema_rejects_what_the_crd_rejects() -> None:
    pool = by_kind(render(ROOT / "overlays" / "gateway"), "InferencePool")["plaserve"]
    jsonschema.validate(pool, POOL_SCHEMA)
    for broken in (
        {"targetPorts": []},
        {"targetPorts": [{"number": 70000}]},
        {"endpointPickerRef": {"name": "epp"}},  # a Service picker needs its port
        {"endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": "Open"}},
        {"selector": {"matchLabels": {}}},
        {"extensionRef": {"name": "epp"}},  # the pre-v1 field name
    ):
        bad = {**pool, "spec": {**pool["spec"], **broken}}
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, POOL_SCHEMA)


@pytest.mark.skipif(
    not os.environ.get("PLASERVE_INFERENCEPOOL_CRD"),
    reason="set PLASERVE_INFERENCEPOOL_CRD to the InferencePool CRD's YAML to check against it too",
)
def test_the_inferencepool_validates_against_the_upstream_crd() -> None:
    crd = yaml.safe_load(Path(os.environ["PLASERVE_INFERENCEPOOL_CRD"]).read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = version["schema"]["openAPIV3Schema"]
    pool = by_kind(render(ROOT / "overlays" / "gateway"), "InferencePool")["plaserve"]
    jsonschema.validate(pool, schema)


def test_kubectl_kustomize_renders_the_same_objects(overlay) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed (the test's own rendering was checked above)")
    name, objects = overlay
    out = subprocess.run(
        ["kubectl", "kustomize", str(ROOT / "overlays" / name)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout

    def key(o: dict) -> str:
        return json.dumps(o, sort_keys=True)

    assert sorted(map(key, yaml.safe_load_all(out))) == sorted(map(key, objects))


def _workers_of(statefulset: dict) -> list[str]:
    name, service = statefulset["metadata"]["name"], statefulset["spec"]["serviceName"]
    port = statefulset["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    return [f"http://{name}-{i}.{service}:{port}" for i in range(statefulset["spec"]["replicas"])]


def test_the_router_lists_every_worker_and_the_flags_parse() -> None:
    objects = render(ROOT / "overlays" / "router")
    worker = by_kind(objects, "StatefulSet")["plaserve-worker"]
    router = by_kind(objects, "Deployment")["plaserve-router"]
    serve_args = container_args(worker)
    assert serve_args[0] == "serve"
    served = parse(add_serve_arguments, serve_args[1:])
    route_args = container_args(router)
    assert route_args[0] == "route"
    routed = parse(add_route_arguments, route_args[1:])
    assert routed.worker_urls == _workers_of(worker)
    assert by_kind(objects, "Service")["plaserve-worker"]["spec"]["clusterIP"] == "None"
    # The router reads the tokenizer of the model the workers serve, from the same volume.
    assert routed.tokenizer == served.model
    for workload in (worker, router):
        claims = {
            v["persistentVolumeClaim"]["claimName"]
            for v in workload["spec"]["template"]["spec"]["volumes"]
            if "persistentVolumeClaim" in v
        }
        assert claims == set(by_kind(objects, "PersistentVolumeClaim")), workload["metadata"]
    probes = worker["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert probes[probe]["httpGet"]["path"] == "/health", probe


def test_the_pd_variant_pairs_prefill_and_decode_workers() -> None:
    objects = render(ROOT / "overlays" / "pd")
    sets = by_kind(objects, "StatefulSet")
    assert set(sets) == {"plaserve-prefill", "plaserve-decode"}
    for role, sts in (("prefill", sets["plaserve-prefill"]), ("decode", sets["plaserve-decode"])):
        args = container_args(sts)
        parse(add_serve_arguments, args[1:])
        assert args[args.index("--pd-role") + 1] == role
    route_args = container_args(by_kind(objects, "Deployment")["plaserve-router"])
    parse(add_route_arguments, route_args[1:])

    def urls(flag: str) -> list[str]:
        i = route_args.index(flag) + 1
        out = []
        while i < len(route_args) and not route_args[i].startswith("--"):
            out.append(route_args[i])
            i += 1
        return out

    assert urls("--prefill-urls") == _workers_of(sets["plaserve-prefill"])
    assert urls("--decode-urls") == _workers_of(sets["plaserve-decode"])
    assert "--worker-urls" not in route_args


def test_the_inferencepool_selects_the_workers_and_its_picker_reads_plaserve_metrics() -> None:
    objects = render(ROOT / "overlays" / "gateway")
    pool = by_kind(objects, "InferencePool")["plaserve"]
    worker = by_kind(objects, "StatefulSet")["plaserve-worker"]
    labels = worker["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    port = worker["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
    assert pool["spec"]["targetPorts"] == [{"number": port}]
    epp_service = by_kind(objects, "Service")[pool["spec"]["endpointPickerRef"]["name"]]
    assert pool["spec"]["endpointPickerRef"]["port"]["number"] in {
        p["port"] for p in epp_service["spec"]["ports"]
    }
    epp = by_kind(objects, "Deployment")["plaserve-epp"]
    args = container_args(epp)
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    config_path = args[args.index("--config-file") + 1]
    config_map = by_kind(objects, "ConfigMap")["plaserve-epp"]
    config = yaml.safe_load(config_map["data"][Path(config_path).name])
    defined = {p.get("name", p["type"]) for p in config["plugins"]}
    for profile in config["schedulingProfiles"]:
        assert {p["pluginRef"] for p in profile["plugins"]} <= defined
    # What the picker reads from the workers: every name must be one plaserve exports (the metrics
    # test scrapes a live server for the same list, tests/deploy/test_metrics_names.py).
    from .test_metrics_names import EPP_METRICS

    named = {args[i + 1] for i, a in enumerate(args) if a.endswith("-metric") and args[i + 1]}
    assert named <= set(EPP_METRICS), named - set(EPP_METRICS)
