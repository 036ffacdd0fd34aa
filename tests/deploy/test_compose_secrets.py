"""compose's `secrets` one-shot (deploy/compose_secrets.py): made once, kept, rotated on request, served by NATS."""

from __future__ import annotations

import asyncio
import json
import stat
import subprocess
import sys
from pathlib import Path

import nats
import nats.errors
import pytest
from kvmesh.bus.permissions import ADMIN, ROLES

from .nats_config import local_copy, serve

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {"ingress": "ingress", "prefill": "prefill", "decode": "decode", "cache-index": "cache-index",
            "eviction": "eviction", "declare": ADMIN}


def _run(secrets: Path, nats_dir: Path, *args: str) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "deploy" / "compose_secrets.py"), "--secrets-dir", str(secrets),
                           "--nats-dir", str(nats_dir), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def _env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


@pytest.fixture
def made(tmp_path: Path) -> tuple[Path, Path]:
    secrets, nats_dir = tmp_path / "secrets", tmp_path / "nats" / "auth"
    secrets.mkdir()
    nats_dir.mkdir(parents=True)
    _run(secrets, nats_dir)
    return secrets, nats_dir


def test_files_are_private_and_say_what_each_service_needs(made) -> None:
    secrets, nats_dir = made
    for path in [*secrets.iterdir(), *nats_dir.iterdir()]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert len(bytes.fromhex((secrets / "ingress-secret").read_text().strip())) == 32
    values = json.loads((secrets / "generated.json").read_text())
    for service, role in SERVICES.items():
        env = _env(secrets / f"{service}.env")
        assert (env["KVMESH_NATS_USER"], env["KVMESH_NATS_PASSWORD"]) == (role, values["nats"][role])
        # the bucket-scoped S3 user for services; the streams' admin needs no S3
        assert ("KVMESH_S3_ACCESS_KEY" in env) == (role != ADMIN)
    assert _env(secrets / "minio-init.env") == {"KVMESH_S3_ACCESS_KEY": "kvmesh-services",
                                                "KVMESH_S3_SECRET_KEY": values["s3_secret_key"]}
    assert len({values["nats"][r] for r in ROLES}) == len(ROLES)  # a password per role


def test_a_rerun_keeps_every_value_and_fills_in_what_is_missing(made) -> None:
    secrets, nats_dir = made
    before = json.loads((secrets / "generated.json").read_text())
    partial = {**before, "nats": {r: p for r, p in before["nats"].items() if r != "eviction"}}
    (secrets / "generated.json").write_text(json.dumps(partial))  # as if a role were added after the first run
    _run(secrets, nats_dir)
    after = json.loads((secrets / "generated.json").read_text())
    assert {k: v for k, v in after.items() if k != "nats"} == {k: v for k, v in before.items() if k != "nats"}
    assert {r: p for r, p in after["nats"].items() if r != "eviction"} == partial["nats"]
    assert after["nats"]["eviction"] and after["nats"]["eviction"] != before["nats"]["eviction"]


def test_rotate_replaces_only_the_named_value(made) -> None:
    secrets, nats_dir = made
    before = json.loads((secrets / "generated.json").read_text())
    _run(secrets, nats_dir, "--rotate", "ingress-secret")
    after = json.loads((secrets / "generated.json").read_text())
    assert after["ingress_secret"] != before["ingress_secret"]
    assert (secrets / "ingress-secret").read_text().strip() == after["ingress_secret"]
    assert {k: v for k, v in after.items() if k != "ingress_secret"} == \
        {k: v for k, v in before.items() if k != "ingress_secret"}


async def test_compose_nats_admits_each_role_with_its_password_only(made) -> None:
    secrets, nats_dir = made
    conf = local_copy((ROOT / "deploy" / "nats" / "nats.conf").read_text(), nats_dir.parent / "nats.conf")
    with serve(conf, {}) as (url, _):
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(url, allow_reconnect=False, connect_timeout=5)
        for service in SERVICES:
            env = _env(secrets / f"{service}.env")
            nc = await nats.connect(url, user=env["KVMESH_NATS_USER"], password=env["KVMESH_NATS_PASSWORD"])
            await nc.close()
        violations: asyncio.Queue = asyncio.Queue()

        async def on_error(exc: Exception) -> None:
            await violations.put(exc)

        env = _env(secrets / "eviction.env")
        nc = await nats.connect(url, user="eviction", password=env["KVMESH_NATS_PASSWORD"], error_cb=on_error)
        try:
            await nc.publish("kvmesh.jobs.decode.any", b"{}")  # only the ingress publishes jobs
            err = await asyncio.wait_for(violations.get(), timeout=10)
            assert "permissions violation" in str(err)
        finally:
            await nc.close()
