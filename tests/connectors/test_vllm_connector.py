"""vLLM (CPU build) with kvmesh's connector: same greedy tokens as vLLM alone, prefixes restored from L2 and,
after a restart, from L3; a damaged L3 chunk is recomputed, never served; tenants stay apart.

vLLM runs in its own venv (`.vllm-venv`, made by .ci/run; or KVMESH_VLLM_PYTHON), driven by vllm_driver.py
against the real default model and a real S3 server. Every run starts a fresh vLLM (about a minute here).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from kvmesh.config import EngineSettings
from kvmesh.connectors.vllm.identity import chain_hashes, model_fingerprint
from kvmesh.engine.engine import Engine
from kvmesh.engine.loader import load_model
from kvmesh.engine.sampling import SamplingParams
from kvmesh.stack.model import default_model_dir
from kvmesh.tiers.block_format import decode_block
from kvmesh.tiers.chunk_format import decode_toc
from kvmesh.tiers.namespace import namespace_for

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("vllm_driver.py")
BLOCK = 32


def vllm_python() -> str:
    explicit = os.environ.get("KVMESH_VLLM_PYTHON")
    path = Path(explicit) if explicit else ROOT / ".vllm-venv" / "bin" / "python"
    if path.is_file():
        return str(path)
    if os.environ.get("CI"):
        pytest.fail(f"no vLLM venv at {path}: .ci/run makes it (bash bench/make_peer_venv.sh .vllm-venv)")
    pytest.skip("vLLM's venv is not here: bash bench/make_peer_venv.sh .vllm-venv, then pip install -e . in it")


pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return default_model_dir(tmp_path_factory.mktemp("state"))


def run(model: Path, calls: list[dict], tmp: Path, env: dict[str, str], *flags: str) -> dict:
    name = uuid.uuid4().hex[:8]
    calls_path, out = tmp / f"calls-{name}.json", tmp / f"out-{name}.json"
    calls_path.write_text(json.dumps(calls))
    proc = subprocess.run([vllm_python(), str(DRIVER), str(model), str(calls_path), str(out), *flags],
                          env={**os.environ, **env, "VLLM_CPU_KVCACHE_SPACE": "1"}, cwd=tmp,
                          capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
    assert proc.returncode == 0, f"vLLM driver failed ({proc.returncode})"
    return json.loads(out.read_text())


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(200, 40000, (n,), generator=g).tolist()


def test_vllm_with_kvmesh_restores_from_l2_and_l3_and_recomputes_damage(model_dir, s3_server, tmp_path) -> None:
    bucket = f"vllm-{uuid.uuid4().hex[:10]}"
    env = {"KVMESH_S3_ENDPOINT": s3_server.endpoint, "KVMESH_S3_ACCESS_KEY": s3_server.access_key,
           "KVMESH_S3_SECRET_KEY": s3_server.secret_key, "KVMESH_S3__BUCKET": bucket,
           "KVMESH_TIERS__L3_TAIL_DELAY_S": "0", "KVMESH_TIERS__L2_CAPACITY_BYTES": str(256 << 20),
           "KVMESH_STATE_DIR": str(tmp_path / "kvmesh")}
    p, r, q = prompt(1, 300), prompt(2, 200), prompt(3, 170)  # 9, 6 and 5 loadable blocks of 32
    calls = [{"prompt_token_ids": x, "max_tokens": 8} for x in (p, r, q)]
    alone = run(model_dir, calls, tmp_path, env)["calls"]

    # One vLLM with the connector, its own prefix cache off so each repeat must come from kvmesh's L2.
    salted = [{"prompt_token_ids": q, "max_tokens": 8, "cache_salt": s} for s in ("tenant-a", "tenant-a", "tenant-b")]
    first = run(model_dir, [calls[0], calls[0], calls[1], *salted], tmp_path, env,
                "--connector", "--no-prefix-caching", "--wait-s3", "5")
    got = first["calls"]
    assert [c["tokens"] for c in got[:3]] == [alone[0]["tokens"], alone[0]["tokens"], alone[1]["tokens"]]
    assert [c["cached"] for c in got[:3]] == [0, 9 * BLOCK, 0]  # the repeat: every loadable block, from L2
    assert [c["tokens"] for c in got[3:]] == [alone[2]["tokens"]] * 3
    assert [c["cached"] for c in got[3:]] == [0, 5 * BLOCK, 0]  # tenant b gets nothing of tenant a's

    # What vLLM computed is in S3 in kvmesh's block format, and it is the KV kvmesh's own engine computes.
    client = s3_server.client()
    fp = model_fingerprint(model_dir, "float32")
    hashes = chain_hashes(p[:9 * BLOCK], BLOCK, fp, "")
    key = f"{fp}/{namespace_for('')}/{hashes[7].hex()}"  # the first chunk: 256 tokens, 8 blocks
    body = client.get_object(bucket, key).read()
    toc = decode_toc(body)
    vllm_block = decode_block(memoryview(body)[toc[0][1]:toc[0][1] + toc[0][2]], fp, hashes[0])
    engine = Engine(load_model(model_dir), EngineSettings(block_size=BLOCK, num_blocks=32))
    engine.generate([p[:BLOCK + 1]], SamplingParams(max_tokens=1, ignore_eos=True, detokenize=False))
    own = engine.export_blocks(engine.block_hashes(p[:BLOCK]))[0]
    assert vllm_block.data.shape == own.data.shape
    assert torch.allclose(vllm_block.data, own.data, atol=1e-3), (vllm_block.data - own.data).abs().max()

    # Damage r's chunk in S3 (one byte of a payload), then a fresh vLLM: p from L3, r recomputed.
    r_hashes = chain_hashes(r[:6 * BLOCK], BLOCK, fp, "")
    r_key = f"{fp}/{namespace_for('')}/{r_hashes[5].hex()}"
    damaged = bytearray(client.get_object(bucket, r_key).read())
    damaged[-40] ^= 0xFF
    client.put_object(bucket, r_key, io.BytesIO(bytes(damaged)), len(damaged))
    second = run(model_dir, calls[:2], tmp_path, env, "--connector", "--wait-s3", "5")["calls"]
    assert second[0] == {"tokens": alone[0]["tokens"], "cached": 9 * BLOCK}  # a new process: L3 it is
    assert second[1]["tokens"] == alone[1]["tokens"]  # promised from L3, found damaged, recomputed
    healed = client.get_object(bucket, r_key).read()
    assert healed != bytes(damaged)  # the damaged object was removed and the recomputed chain put back
    toc = decode_toc(healed)
    decode_block(memoryview(healed)[toc[-1][1]:toc[-1][1] + toc[-1][2]], fp, r_hashes[5])  # verifies
