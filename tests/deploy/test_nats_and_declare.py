"""The NATS configs we ship load in a real nats-server, and deploy/declare_streams.py sets up JetStream on it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import nats
import yaml

from shared.protocol.streams import ALL_BUCKETS, ALL_CONSUMERS, ALL_STREAMS
from shared.stack.servers import find_binary, free_port, stop_pid, wait_for_port

from .chart import merged, name

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "declare_streams.py"


def _check_config(conf: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([str(find_binary("nats-server")), "-c", str(conf), "-t"],
                          env=env, capture_output=True, text=True, timeout=30)


def test_chart_cluster_config_is_valid_for_nats_server(chart, tmp_path: Path) -> None:
    out = chart.render(merged(), name="demo")
    (cm,) = [d for d in yaml.safe_load_all(out["kvmesh/templates/nats-configmap.yaml"]) if d]
    conf = tmp_path / "nats.conf"
    conf.write_text(cm["data"]["nats.conf"])
    ok = _check_config(conf, {"POD_NAME": f"{name('nats')}-0"})
    assert ok.returncode == 0, ok.stdout + ok.stderr
    missing = _check_config(conf, {})  # the server name comes from the pod's env: without it, refused
    assert missing.returncode != 0 and "POD_NAME" in missing.stdout + missing.stderr


def _declare_env(url: str) -> dict[str, str]:
    return {**os.environ, "KVMESH_NATS_URL": url, "KVMESH_NATS__REPLICAS": "1"}


def _declare(url: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=_declare_env(url),
                          capture_output=True, text=True, timeout=60)


async def test_compose_config_serves_jetstream_and_declare_sets_it_up(tmp_path: Path) -> None:
    shipped = (ROOT / "deploy" / "nats" / "nats.conf").read_text()
    # Only the listen addresses and store dir differ from the container; limits and fsync come from the file.
    conf = tmp_path / "nats.conf"
    conf.write_text(shipped.replace("store_dir: /data", f"store_dir: {json.dumps(str(tmp_path / 'js'))}"))
    assert conf.read_text() != shipped and _check_config(conf, {}).returncode == 0
    port, http_port = free_port(), free_port()
    argv = [str(find_binary("nats-server")), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port),
            "-m", str(http_port)]
    url = f"nats://127.0.0.1:{port}"
    # Started before NATS, as an init container may be: it keeps trying until the server answers.
    early = subprocess.Popen([sys.executable, str(SCRIPT), "--wait", "30"], env=_declare_env(url),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    time.sleep(1.0)
    with open(tmp_path / "nats.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_for_port(port, "127.0.0.1", 20, proc)
        _, err = early.communicate(timeout=40)
        assert early.returncode == 0 and "nats error" in err and "streams declared" in err, err
        varz = httpx.get(f"http://127.0.0.1:{http_port}/varz", timeout=5).json()
        assert varz["jetstream"]["config"]["sync_always"] is True
        done = _declare(url)  # again: idempotent, every pod's init container runs it
        assert done.returncode == 0, done.stdout + done.stderr
        nc = await nats.connect(url)
        try:
            assert nc.max_payload == 8 * 1024 * 1024
            js = nc.jetstream()
            for spec in ALL_STREAMS:
                info = await js.stream_info(spec.name)
                assert info.config.num_replicas == 1
            for bucket in ALL_BUCKETS:
                await js.stream_info(bucket.stream_name)
            for consumer in ALL_CONSUMERS:
                await js.consumer_info(consumer.stream, consumer.durable)
        finally:
            await nc.close()
    finally:
        if early.poll() is None:
            early.kill()
            early.wait(timeout=10)
        stop_pid(proc.pid)
        proc.wait(timeout=10)


def test_declare_gives_up_with_exit_1_when_nats_is_unreachable() -> None:
    done = _declare(f"nats://127.0.0.1:{free_port()}", "--wait", "1")
    assert done.returncode == 1 and "declaring streams failed" in done.stderr
