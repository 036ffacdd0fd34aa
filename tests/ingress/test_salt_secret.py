"""One salt secret per deployment: where it comes from, and what sharing it buys.

Units: the sources' order, the checks on a secret, the local stack's dev file.
On a real stack (nats + S3 + prefill + decode + ingress subprocesses, the
official openai SDK): two ingress replicas with the same secret, one given
by env and one by file, hit each other's cache; a restarted replica still
hits; a replica with another secret (a rotation) sees a cold cache; an
ingress with no secret at all refuses to start and says why.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from kvmesh.ingress.admission.salt_secret import (
    STATE_FILE,
    SecretError,
    ensure_dev_secret,
    load_secret,
)
from kvmesh.net import free_port
from kvmesh.stack.servers import NatsServer, S3Server

from ingress.serving_stack import ServingStack, make_stack, one_of_each

KEYS = {"sk-salt": "acme"}
PROMPT = "A deployment shares one salt secret so that every replica finds the same blocks. " * 6


def test_sources_in_order(tmp_path: Path) -> None:
    env, file, dev = secrets.token_hex(32), secrets.token_hex(40), secrets.token_hex(32)
    path = tmp_path / "mounted"
    path.write_text(file + "\n")
    (tmp_path / STATE_FILE).write_text(dev)
    assert load_secret(env, path, tmp_path) == bytes.fromhex(env)
    assert load_secret(None, path, tmp_path) == bytes.fromhex(file)
    assert load_secret("", None, tmp_path) == bytes.fromhex(dev)


def test_refuses_missing_or_weak_secrets(tmp_path: Path) -> None:
    with pytest.raises(SecretError, match="no ingress salt secret.*KVMESH_INGRESS_SECRET"):
        load_secret(None, None, tmp_path)
    with pytest.raises(SecretError, match="at least 32"):
        load_secret("ab" * 16 + "cd", None, tmp_path)  # 17 bytes
    with pytest.raises(SecretError, match="not hex"):
        load_secret("not-hex" * 10, None, tmp_path)
    # a configured file that is missing is an error, never a fall-through to the state dir's secret
    (tmp_path / STATE_FILE).write_text(secrets.token_hex(32))
    with pytest.raises(SecretError, match="cannot read"):
        load_secret(None, tmp_path / "absent", tmp_path)


def test_dev_secret_made_once_private(tmp_path: Path) -> None:
    state = tmp_path / "state"
    assert ensure_dev_secret(state)
    first = load_secret(None, None, state)
    assert stat.S_IMODE(os.stat(state / STATE_FILE).st_mode) == 0o600 and len(first) == 32
    assert not ensure_dev_secret(state) and load_secret(None, None, state) == first


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server, tiny_model_dir: Path
          ) -> Iterator[ServingStack]:
    with one_of_each(tmp_path_factory.mktemp("salt-stack"), s3_server, tiny_model_dir, KEYS) as s:
        yield s


def cached(stack: ServingStack, base_url: str) -> int:
    c = openai.OpenAI(base_url=f"{base_url}/v1", api_key="sk-salt", max_retries=0, timeout=60)
    got = c.completions.create(model=stack.model_dir.name, prompt=PROMPT, max_tokens=2, temperature=0)
    return got.usage.prompt_tokens_details.cached_tokens


def start_ingress(stack: ServingStack, worker_id: str, port: int | None = None, **env: str) -> str:
    """An ingress replica on the stack's bus and workers (env overrides apply to it only); its URL."""
    port = port or free_port()
    saved = dict(stack.extra_env)
    stack.extra_env.update(KVMESH_INGRESS__PORT=str(port), **env)
    try:
        stack.start_ready("ingress", worker_id)
    finally:
        stack.extra_env = saved
    return f"http://127.0.0.1:{port}"


def restart(stack: ServingStack, worker_id: str, port: int | None = None, **env: str) -> str:
    stack.procs.pop(worker_id).stop(grace_s=10.0)
    return start_ingress(stack, worker_id, port, **env)


def test_replicas_and_restarts_share_the_cache(stack: ServingStack) -> None:
    mounted = stack.root / "mounted-secret"
    mounted.write_text(stack.secret + "\n")  # the same secret, as a Kubernetes Secret volume gives it
    b_url = start_ingress(stack, "ingress-b", KVMESH_INGRESS_SECRET="", KVMESH_INGRESS__SECRET_FILE=str(mounted))

    cached(stack, stack.base_url)  # computed through replica A
    assert cached(stack, b_url) > 0  # ... found again through replica B
    a_url = restart(stack, "ingress-0", stack.ingress_port)
    assert cached(stack, a_url) > 0  # a restarted replica keeps its tenants' salts

    # rotating the secret is a cold cache for every tenant: the same prompt no longer hits
    rotated = restart(stack, "ingress-b", KVMESH_INGRESS_SECRET=secrets.token_hex(32))
    assert cached(stack, rotated) == 0


def test_no_secret_refuses_to_start(tmp_path: Path, nats_server: NatsServer, tiny_model_dir: Path) -> None:
    stack = make_stack(tmp_path, nats_server, None, tiny_model_dir, KEYS, KVMESH_INGRESS_SECRET="")
    try:
        stack.start("ingress", "ingress-bare")
        assert stack.procs["ingress-bare"].proc.wait(timeout=120) != 0
        log = stack.log("ingress-bare")
        assert "no ingress salt secret" in log and "KVMESH_INGRESS_SECRET" in log
        assert not (tmp_path / "state" / STATE_FILE).exists()  # it made none up
    finally:
        stack.stop()
