"""A cache-index container as the chart and as compose.yaml run it really comes up, then drains.

Commands and environment are taken from the rendered Deployment + ConfigMap
+ Secrets and from compose.yaml + deploy/compose.env + the files compose's
`secrets` one-shot writes (run here for real). NATS is a real nats-server on
the config each ships, with its users and permissions: the init step
declares streams as `admin`, the service runs as the `cache-index` user.
Only the addresses are pointed at the test's servers (single node: one
stream replica), S3 at the test's server with its key, the side port at a
free one and the state dir at a temp dir. The init step must exit 0, the
readiness probe's path must answer 200, the heartbeat must carry the worker
id the deployment gives (pod name / `cache-index-<hostname>`), and SIGTERM
must drain to exit 0 (a rollout, `docker compose down`).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import nats
import pytest
import yaml
from kvmesh.net import free_port
from kvmesh.protocol import subjects

from .chart import by_kind, merged, name, render
from .nats_config import chart_nats_env, container_env, local_copy, secret_data, serve

ROOT = Path(__file__).resolve().parents[2]
POD = f"{name('cache-index')}-7d9c8-x2kq4"


@dataclass(frozen=True, slots=True)
class Container:
    init: list[str]
    init_env: dict[str, str]
    command: list[str]
    env: dict[str, str]
    probe: str
    worker_id: str
    admin: tuple[str, str]  # NATS user and password that may read the heartbeat bucket


@contextmanager
def _from_chart(chart, tmp_path: Path) -> Iterator[tuple[Container, str]]:
    docs = render(chart, merged({"nats": {"replicas": 1, "streamReplicas": 1}}))
    config = dict(by_kind(docs, "ConfigMap")[name("config")]["data"])
    pod = by_kind(docs, "Deployment")[name("cache-index")]["spec"]["template"]["spec"]
    main, init = pod["containers"][0], pod["initContainers"][0]
    conf = by_kind(docs, "ConfigMap")[name("nats-config")]["data"]["nats.conf"]
    with serve(local_copy(conf, tmp_path / "nats" / "nats.conf"), chart_nats_env(docs)) as (url, _):
        yield Container(init["command"], {**config, **container_env(docs, init, POD)}, main["command"],
                        {**config, **container_env(docs, main, POD)}, main["readinessProbe"]["httpGet"]["path"],
                        POD, ("admin", secret_data(docs, name("nats-auth"))["admin"])), url


@contextmanager
def _from_compose(tmp_path: Path, s3_server) -> Iterator[tuple[Container, str]]:
    services = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    env = dict(line.split("=", 1) for line in (ROOT / "deploy" / "compose.env").read_text().splitlines()
               if line and not line.startswith("#"))
    secrets, nats_dir = tmp_path / "secrets", tmp_path / "nats"
    secrets.mkdir()
    (nats_dir / "auth").mkdir(parents=True)
    made = subprocess.run([sys.executable, *services["secrets"]["command"][1:], "--secrets-dir", str(secrets),
                           "--nats-dir", str(nats_dir / "auth")], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert made.returncode == 0, made.stderr
    # the bucket-scoped MinIO user does not exist on the test's S3 server: its own key instead
    sourced = secrets / "cache-index.env"
    sourced.write_text("".join(line + "\n" for line in sourced.read_text().splitlines() if "_S3_" not in line)
                       + f"KVMESH_S3_ACCESS_KEY={s3_server.access_key}\nKVMESH_S3_SECRET_KEY={s3_server.secret_key}\n")
    admin = dict(line.split("=", 1) for line in (secrets / "declare.env").read_text().splitlines())

    def local(command: list[str]) -> list[str]:  # compose's own $$ -> $ step, and the volume's path here
        return [arg.replace("$$", "$").replace("/etc/kvmesh/secrets", str(secrets)) for arg in command]

    svc = services["cache-index"]
    probe = svc["healthcheck"]["test"][-1].split("9090", 1)[1].split("'", 1)[0]
    conf = local_copy((ROOT / "deploy" / "nats" / "nats.conf").read_text(), nats_dir / "nats.conf")
    with serve(conf, {}) as (url, _):
        yield Container(local(services["declare"]["command"]), env, local(svc["command"]), env, probe,
                        f"cache-index-{socket.gethostname()}",
                        (admin["KVMESH_NATS_USER"], admin["KVMESH_NATS_PASSWORD"])), url


def _argv(command: list[str]) -> list[str]:
    return [sys.executable, *command[1:]] if command[0] == "python" else command


def _process_env(base: dict[str, str], **over: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")}
    env.update(base)
    env.update(over, PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    return env


@pytest.mark.parametrize("source", ["chart", "compose"])
async def test_cache_index_container_starts_ready_and_drains(source: str, chart, s3_server, tmp_path: Path) -> None:
    ctx = _from_chart(chart, tmp_path) if source == "chart" else _from_compose(tmp_path, s3_server)
    with ctx as (c, nats_url):
        await _run(c, nats_url, s3_server, tmp_path)


async def _run(c: Container, nats_url: str, s3_server, tmp_path: Path) -> None:
    side_port = free_port()
    over = dict(KVMESH_NATS_URL=nats_url, KVMESH_NATS__REPLICAS="1", KVMESH_S3_ENDPOINT=s3_server.endpoint,
                KVMESH_STATE_DIR=str(tmp_path / "state"), KVMESH_SERVICE__HTTP_PORT=str(side_port))
    s3 = dict(KVMESH_S3_ACCESS_KEY=s3_server.access_key, KVMESH_S3_SECRET_KEY=s3_server.secret_key)
    done = subprocess.run(_argv(c.init), env=_process_env(c.init_env, **over), capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    env = _process_env(c.env, **over, **s3)
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
        user, password = c.admin
        nc = await nats.connect(nats_url, user=user, password=password)
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
