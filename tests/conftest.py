"""Session fixtures: the real servers kvmesh talks to (free loopback ports) and the tiny checkpoints.

Each server runs from a temporary directory and is stopped by PID at the
end. Session-scoped instances are shared for speed; tests that kill or
restart a server take a function-scoped one of their own.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvmesh.engine.presets import write_preset
from kvmesh.stack.servers import NatsServer, S3Server

MANY_BUCKETS_VOLUMES = 1000  # a test session creates a bucket per test: see S3Server.max_volumes

# The suite's stacks and services run kvmesh's own engine unless a test names vLLM (tests/connectors: the
# default `kvmesh up`, which serves through vLLM where it is installed, as it is in CI's venv).
os.environ.setdefault("KVMESH_ENGINE__BACKEND", "native")

pytest_plugins = ("guards",)  # hung tests fail with a stack trace instead of stalling the run


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama preset (Llama-3 rope scaling, untied lm_head, fp32), written once; tests must not modify it."""
    return write_preset(tmp_path_factory.mktemp("tiny-llama"), "tiny", "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 preset (q/k/v bias, tied embeddings, fp32)."""
    return write_preset(tmp_path_factory.mktemp("tiny-qwen2"), "tiny", "qwen2", seed=0)


@pytest.fixture(scope="session")
def llama3_8b_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Llama-3-8B KV-geometry preset (32 layers x 8 KV heads x 128, bf16 KV, fp32 compute), written once."""
    return write_preset(tmp_path_factory.mktemp("llama3-8b"), "llama3-8b", "llama", seed=0)


@pytest.fixture(scope="session")
def tiny_loaded(tiny_model_dir: Path):
    """The tiny Llama preset, loaded once per session."""
    from kvmesh.engine.loader import load_model

    return load_model(tiny_model_dir)


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(data_dir=tmp_path_factory.mktemp("nats"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def auth_nats_server(tmp_path_factory: pytest.TempPathFactory):
    """A NATS server with users, as `kvmesh up` starts it: (server, credentials).

    Per-id users ingress-0, prefill-0, prefill-1, decode-0, cache_index-0, eviction-0, vllm-0 and admin
    (shared/credentials/nats.py), plus per-role users `prefill` and `decode` (any id of
    their role: the fallback where ids are unknown). Credentials hold all of them.
    """
    from dataclasses import replace

    from kvmesh.bus.auth_config import NatsUser
    from kvmesh.bus.permissions import permissions
    from kvmesh.credentials.nats import load_or_create_nats_credentials

    root = tmp_path_factory.mktemp("nats-auth")
    wanted = {"ingress-0": "ingress", "prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode",
              "cache_index-0": "cache-index", "eviction-0": "eviction", "vllm-0": "vllm", "prefill": "prefill",
              "decode": "decode"}
    creds = load_or_create_nats_credentials(root, wanted)
    auth = creds.server_auth()
    per_role = {"prefill", "decode"}  # these two get the per-role permissions (worker_id None)
    users = tuple(NatsUser(u.name, u.password, permissions(u.name)) if u.name in per_role else u for u in auth.users)
    server = NatsServer(data_dir=root / "nats", auth=replace(auth, users=users))
    server.start()
    yield server, creds
    server.stop()


@pytest.fixture
def fresh_nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A NATS server of the test's own, free to kill or restart."""
    server = NatsServer(data_dir=tmp_path / "nats")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(data_dir=tmp_path_factory.mktemp("s3"), max_volumes=MANY_BUCKETS_VOLUMES)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def fresh_s3_server(tmp_path: Path) -> Iterator[S3Server]:
    """An S3 server of the test's own, free to stop and restart (same port, same data)."""
    server = S3Server(data_dir=tmp_path / "s3", max_volumes=MANY_BUCKETS_VOLUMES)
    server.start()
    yield server
    server.stop()
