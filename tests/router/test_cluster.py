"""``plaserve cluster``: two real workers on a tiny checkpoint behind the router; Ctrl-C stops all."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

import plaserve
from plaserve.launcher import free_port


def test_cluster_starts_workers_routes_and_stops_everything(qwen2_ckpt):
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p
        for p in (str(Path(plaserve.__file__).resolve().parent.parent), env.get("PYTHONPATH"))
        if p
    )
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "plaserve.cli",
                "cluster",
                "--workers",
                "2",
                qwen2_ckpt,
                "--kv-cache-memory",
                "32MiB",
                "--worker-args=--no-compile",
                "--port",
                str(port),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                assert proc.poll() is None, "plaserve cluster exited early"
                try:
                    if httpx.get(url + "/health", timeout=1).json().get("workers_available") == 2:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            r = httpx.post(
                url + "/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 2}, timeout=60
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
            r = httpx.post(
                url + "/v1/chat/completions",
                timeout=60,
                json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2},
            )
            assert r.status_code == 200
            workers = httpx.get(url + "/workers").json()["workers"]
            assert len(workers) == 2 and all(w["supports_load"] for w in workers)
        finally:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(60) == 0
        log.seek(0)
        output = log.read().decode(errors="replace")
    ports = re.search(r"on ports (\d+), (\d+)", output).groups()
    assert f"router at http://127.0.0.1:{port}" in output and "stopped" in output
    for p in ports:  # the workers are gone with it
        try:
            httpx.get(f"http://127.0.0.1:{p}/health", timeout=1)
            raise AssertionError(f"worker on port {p} still answers")
        except httpx.ConnectError:
            pass
