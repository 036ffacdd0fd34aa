"""compose.yaml is a valid Compose file whose stack starts in the right order and checks readiness."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from .compose_file import USER_ENV, load
from .settings_env import assert_settings_apply

ROOT = Path(__file__).resolve().parents[2]
KVMESH = {"ingress": "ingress", "prefill": "prefill", "decode": "decode",
          "cache-index": "cache_index", "eviction": "eviction"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return load(USER_ENV)


@pytest.fixture(scope="module")
def raw() -> dict:
    """compose.yaml before interpolation: the `${...}` expressions as written."""
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_services_present(compose) -> None:
    assert set(compose["services"]) == {"secrets", "nats", "minio", "minio-init", "declare", *KVMESH}


def test_nats_runs_jetstream_with_fsync_always(compose) -> None:
    nats = compose["services"]["nats"]
    assert nats["image"].startswith("nats:")
    mounts = {v.split(":")[1]: v.split(":")[0] for v in nats["volumes"]}
    conf = (ROOT / mounts[nats["command"][1]]).read_text()
    assert re.search(r"jetstream\s*\{[^}]*sync_interval:\s*always", conf)
    assert "nats-data" in mounts.values()
    assert "js-enabled-only=true" in " ".join(nats["healthcheck"]["test"])


def test_bucket_init_is_a_one_shot_after_minio(compose) -> None:
    init = compose["services"]["minio-init"]
    assert init["image"].startswith("minio/mc:")
    assert init["depends_on"] == {"minio": {"condition": "service_healthy"},
                                  "secrets": {"condition": "service_completed_successfully"}}
    assert "mc mb --ignore-existing kvmesh/kvmesh-kv" in init["command"][0]
    assert compose["services"]["minio"]["image"].startswith("minio/minio:")
    assert compose["services"]["minio"]["healthcheck"]["test"] == ["CMD", "mc", "ready", "local"]


@pytest.mark.parametrize("service", list(KVMESH))
def test_kvmesh_service_shape(compose, service: str) -> None:
    svc = compose["services"][service]
    assert svc["image"] == "kvmesh:latest" and svc["build"]["context"] == "."
    assert svc["command"][-1].endswith(f"exec python -m kvmesh.services.{KVMESH[service]}")
    assert svc["command"][-1].startswith(f"set -a && . /etc/kvmesh/secrets/{service}.env && set +a && ")
    assert f"KVMESH_SERVICE__WORKER_ID={service}-$$(hostname)" in svc["command"][-1]
    assert "/readyz" in " ".join(svc["healthcheck"]["test"]) and "9090" in " ".join(svc["healthcheck"]["test"])
    assert svc["depends_on"] == {
        "nats": {"condition": "service_healthy"},
        "minio": {"condition": "service_healthy"},
        "minio-init": {"condition": "service_completed_successfully"},
        "secrets": {"condition": "service_completed_successfully"},
        "declare": {"condition": "service_completed_successfully"},
    }
    assert svc["env_file"] == ["deploy/compose.env"]
    # Only the ingress takes anything from the user's environment (its API keys); no service sees MinIO's root key.
    assert set(svc.get("environment", {})) == ({"KVMESH_API_KEYS", "KVMESH_INGRESS__SECRET_FILE"}
                                               if service == "ingress" else set())
    assert svc["volumes"] == ["model:/models", "kvmesh-secrets:/etc/kvmesh/secrets:ro"]


def test_secrets_come_from_the_environment_only(raw) -> None:
    env_file = (ROOT / "deploy" / "compose.env").read_text()
    assert not re.search(r"(SECRET|API_KEYS|ACCESS_KEY|PASSWORD)", env_file)
    for service in ("minio", "minio-init"):  # MinIO's root key: these two only
        secret = raw["services"][service]["environment"]["MINIO_ROOT_PASSWORD"]
        assert secret.startswith("${KVMESH_S3_SECRET_KEY:?")  # compose refuses to start without it
    assert raw["services"]["ingress"]["environment"]["KVMESH_API_KEYS"].startswith("${KVMESH_API_KEYS:?")
    with pytest.raises(ValueError, match="KVMESH_S3_SECRET_KEY"):
        load({"KVMESH_API_KEYS": "sk-dev:dev"})


def test_env_file_settings_parse_into_settings(monkeypatch) -> None:
    from kvmesh.config import load_settings

    pairs = dict(line.split("=", 1) for line in (ROOT / "deploy" / "compose.env").read_text().splitlines()
                 if line and not line.startswith("#"))
    assert_settings_apply(monkeypatch, pairs)
    s = load_settings()
    assert s.nats_url == "nats://nats:4222" and s.nats.replicas == 1
    assert s.s3_endpoint == "minio:9000" and s.s3.bucket == "kvmesh-kv"
    assert (s.service.http_host, s.service.http_port, s.ingress.host) == ("0.0.0.0", 9090, "0.0.0.0")


def test_shared_memory_for_the_l2_tier(compose) -> None:
    for service in ("prefill", "decode"):
        assert compose["services"][service]["shm_size"]


def test_named_volumes_declared(compose) -> None:
    assert {"nats-data", "minio-data", "model", "kvmesh-secrets", "nats-auth"} <= set(compose["volumes"])
