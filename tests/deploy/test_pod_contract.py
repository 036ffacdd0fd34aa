"""A cache-index container as the chart and as compose.yaml run it really comes up, then drains.

Commands and environment are taken from the rendered Deployment + ConfigMap
and from compose.yaml + deploy/compose.env; only the addresses are pointed at
the test's own NATS and S3 servers (single node: one stream replica), the
side port at a free one and the state dir at a temp dir. The init step must
exit 0, the readiness probe's path must answer 200, the heartbeat must carry
the worker id the deployment gives (pod name / `cache-index-<hostname>`),
and SIGTERM must drain to exit 0 (a rollout, `docker compose down`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import nats
import pytest
import yaml

from shared.protocol import subjects
from shared.stack.servers import free_port

from .chart import by_kind, merged, name, render

ROOT = Path(__file__).resolve().parents[2]
POD = f"{name('cache-index')}-7d9c8-x2kq4"


@dataclass(frozen=True, slots=True)
class Container:
    init: list[str]
    command: list[str]
    env: dict[str, str]
    probe: str
    worker_id: str


def _from_chart(chart) -> Container:
    docs = render(chart, merged())
    env = dict(by_kind(docs, "ConfigMap")[name("config")]["data"])
    pod = by_kind(docs, "Deployment")[name("cache-index")]["spec"]["template"]["spec"]
    main = pod["containers"][0]
    for e in main["env"]:
        if "value" in e:
            env[e["name"]] = e["value"]
        elif e["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.name":
            env[e["name"]] = POD
    return Container(pod["initContainers"][0]["command"], main["command"], env,
                     main["readinessProbe"]["httpGet"]["path"], POD)


def _from_compose() -> Container:
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    env = dict(line.split("=", 1) for line in (ROOT / "deploy" / "compose.env").read_text().splitlines()
               if line and not line.startswith("#"))
    svc = services["cache-index"]
    probe = svc["healthcheck"]["test"][-1].split("9090", 1)[1].split("'", 1)[0]
    unescape = [arg.replace("$$", "$") for arg in svc["command"]]  # compose's own $$ -> $ step
    return Container(services["declare"]["command"], unescape, env, probe, f"cache-index-{socket.gethostname()}")


def _argv(command: list[str]) -> list[str]:
    return [sys.executable, *command[1:]] if command[0] == "python" else command


@pytest.mark.parametrize("source", ["chart", "compose"])
async def test_cache_index_container_starts_ready_and_drains(source: str, chart, fresh_nats_server, s3_server,
                                                             tmp_path: Path) -> None:
    c = _from_chart(chart) if source == "chart" else _from_compose()
    side_port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env.update(c.env)
    env.update(KVMESH_NATS_URL=fresh_nats_server.url, KVMESH_NATS__REPLICAS="1", KVMESH_S3_ENDPOINT=s3_server.endpoint,
               KVMESH_S3_ACCESS_KEY=s3_server.access_key, KVMESH_S3_SECRET_KEY=s3_server.secret_key,
               KVMESH_STATE_DIR=str(tmp_path / "state"), KVMESH_SERVICE__HTTP_PORT=str(side_port),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    done = subprocess.run(_argv(c.init), env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    with open(tmp_path / "service.log", "wb") as log:
        proc = subprocess.Popen(_argv(c.command), env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline and proc.poll() is None and status != 200:
            try:
                status = httpx.get(f"http://127.0.0.1:{side_port}{c.probe}", timeout=2).status_code
            except httpx.TransportError:
                status = None
            if status != 200:
                time.sleep(0.2)
        assert status == 200, (tmp_path / "service.log").read_text()[-3000:]
        assert "kvmesh_service_info" in httpx.get(f"http://127.0.0.1:{side_port}/metrics", timeout=2).text
        nc = await nats.connect(fresh_nats_server.url)
        try:
            kv = await nc.jetstream().key_value(subjects.WORKERS_BUCKET)
            assert (await kv.get(c.worker_id)).value
        finally:
            await nc.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
