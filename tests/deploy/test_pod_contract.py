"""A pod as the chart renders it really comes up: init container, then the service, with the chart's env.

The cache-index pod's commands and environment are taken from the rendered
Deployment and ConfigMap; only the addresses are pointed at the test's own
NATS and S3 servers (single node: one stream replica) and the state dir at a
temp dir. The readiness probe's path on the side port must answer 200, the
heartbeat must carry the pod name as worker id, and SIGTERM must drain to
exit 0 (what Kubernetes does on a rollout).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import nats

from shared.protocol import subjects
from shared.stack.servers import free_port

from .chart import by_kind, merged, name, render

POD = f"{name('cache-index')}-7d9c8-x2kq4"


def _pod_env(chart, nats_url: str, s3, tmp_path: Path, side_port: int) -> tuple[dict[str, str], dict]:
    docs = render(chart, merged())
    env = dict(by_kind(docs, "ConfigMap")[name("config")]["data"])
    pod = by_kind(docs, "Deployment")[name("cache-index")]["spec"]["template"]["spec"]
    for e in pod["containers"][0]["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif e["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[e["name"]] = POD
    env.update(KVMESH_NATS_URL=nats_url, KVMESH_NATS__REPLICAS="1", KVMESH_S3_ENDPOINT=s3.endpoint,
               KVMESH_S3_ACCESS_KEY=s3.access_key, KVMESH_S3_SECRET_KEY=s3.secret_key,
               KVMESH_STATE_DIR=str(tmp_path / "state"), KVMESH_SERVICE__HTTP_PORT=str(side_port))
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    return {**base, **env}, pod


def _argv(command: list[str]) -> list[str]:
    assert command[0] == "python"
    return [sys.executable, *command[1:]]


async def test_cache_index_pod_starts_ready_and_drains(chart, fresh_nats_server, s3_server, tmp_path: Path) -> None:
    side_port = free_port()
    env, pod = _pod_env(chart, fresh_nats_server.url, s3_server, tmp_path, side_port)
    init = pod["initContainers"][0]
    done = subprocess.run(_argv(init["command"]), env=env, capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr
    main = pod["containers"][0]
    probe = main["readinessProbe"]["httpGet"]["path"]
    with open(tmp_path / "service.log", "wb") as log:
        proc = subprocess.Popen(_argv(main["command"]), env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = httpx.get(f"http://127.0.0.1:{side_port}{probe}", timeout=2).status_code
            except httpx.TransportError:
                status = None
            if status == 200:
                break
            time.sleep(0.2)
        assert status == 200, (tmp_path / "service.log").read_text()[-3000:]
        assert httpx.get(f"http://127.0.0.1:{side_port}/metrics", timeout=2).text.count("kvmesh_service_info")
        nc = await nats.connect(fresh_nats_server.url)
        try:
            kv = await nc.jetstream().key_value(subjects.WORKERS_BUCKET)
            assert (await kv.get(POD)).value
        finally:
            await nc.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
