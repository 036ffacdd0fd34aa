"""The NATS configs we ship load in a real nats-server with their users, and deploy/declare_streams.py sets up JetStream."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import nats
from kvmesh.net import free_port
from kvmesh.protocol.streams import ALL_BUCKETS, ALL_CONSUMERS, ALL_STREAMS
from kvmesh.stack.servers import find_binary, stop_pid, wait_for_port

from .chart import by_kind, merged, name, render
from .nats_config import chart_nats_env, check_config, local_copy

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "declare_streams.py"


def test_chart_cluster_config_is_valid_for_nats_server(chart, tmp_path: Path) -> None:
    docs = render(chart, merged())
    conf = tmp_path / "nats.conf"
    conf.write_text(by_kind(docs, "ConfigMap")[name("nats-config")]["data"]["nats.conf"])
    env = chart_nats_env(docs)  # POD_NAME and one password variable per role, as the pod gets them
    ok = check_config(conf, env)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    for var in ("POD_NAME", "NATS_PASSWORD_ADMIN"):  # without them, refused: no unnamed node, no open user
        missing = check_config(conf, {k: v for k, v in env.items() if k != var})
        assert missing.returncode != 0 and var in missing.stdout + missing.stderr


def _secrets(tmp_path: Path) -> tuple[Path, Path]:
    """Run compose's `secrets` one-shot as compose does: returns (secrets dir, nats.conf beside its auth dir)."""
    secrets, auth = tmp_path / "secrets", tmp_path / "nats" / "auth"
    secrets.mkdir()
    auth.mkdir(parents=True)
    done = subprocess.run([sys.executable, str(ROOT / "deploy" / "compose_secrets.py"), "--secrets-dir", str(secrets),
                           "--nats-dir", str(auth)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    conf = local_copy((ROOT / "deploy" / "nats" / "nats.conf").read_text(), tmp_path / "nats" / "nats.conf")
    return secrets, conf


def _env_file(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


def _declare_env(url: str, user_env: dict[str, str]) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("KVMESH_")},
            "KVMESH_NATS_URL": url, "KVMESH_NATS__REPLICAS": "1", **user_env}


def _declare(url: str, user_env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], env=_declare_env(url, user_env),
                          capture_output=True, text=True, timeout=60)


async def test_compose_config_serves_jetstream_and_declare_sets_it_up(tmp_path: Path) -> None:
    secrets, conf = _secrets(tmp_path)
    admin = _env_file(secrets / "declare.env")
    assert admin["KVMESH_NATS_USER"] == "admin"
    port, http_port = free_port(), free_port()
    argv = [str(find_binary("nats-server")), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port),
            "-m", str(http_port)]
    url = f"nats://127.0.0.1:{port}"
    # Started before NATS, as an init container may be: it keeps trying until the server answers.
    early_log = tmp_path / "early.log"
    with open(early_log, "wb") as err_out:
        early = subprocess.Popen([sys.executable, str(SCRIPT), "--wait", "30"], env=_declare_env(url, admin),
                                 stdout=subprocess.DEVNULL, stderr=err_out)
    deadline = time.monotonic() + 30  # NATS starts once the script has failed to reach it (its first error line)
    while "nats error" not in early_log.read_text() and early.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "nats error" in early_log.read_text(), early_log.read_text()
    with open(tmp_path / "nats.log", "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_for_port(port, "127.0.0.1", 20, proc)
        assert early.wait(timeout=40) == 0 and "streams declared" in early_log.read_text(), early_log.read_text()
        varz = httpx.get(f"http://127.0.0.1:{http_port}/varz", timeout=5).json()
        assert varz["jetstream"]["config"]["sync_always"] is True
        done = _declare(url, admin)  # again: idempotent, every pod's init container runs it
        assert done.returncode == 0, done.stdout + done.stderr
        # a service's user may not declare streams: only admin
        refused = _declare(url, {k: v for k, v in _env_file(secrets / "ingress.env").items() if "NATS" in k},
                           "--wait", "3")
        assert refused.returncode == 1 and "declaring streams failed" in refused.stderr
        nc = await nats.connect(url, user=admin["KVMESH_NATS_USER"], password=admin["KVMESH_NATS_PASSWORD"])
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
    done = _declare(f"nats://127.0.0.1:{free_port()}", {}, "--wait", "1")
    assert done.returncode == 1 and "declaring streams failed" in done.stderr
