"""vLLM (CPU build) with kvmesh's connector: same greedy tokens as vLLM alone, prefixes restored from L2 and,
after a restart, from L3; a damaged L3 chunk is recomputed, never served; tenants stay apart; the cache index
sees the vLLM worker's blocks; a second vLLM on the host restores from the first one's L2.

vLLM runs in a process of its own (this venv's python: install.sh installs vLLM beside kvmesh), driven by vllm_driver.py
against the real default model and a real S3 server. Every run starts a fresh vLLM (about a minute here).
"""

from __future__ import annotations

import asyncio
import importlib.util
import io
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats.js.errors
import pytest
import torch
from bus.helpers import connected, eventually
from kvmesh.bus.request import request
from kvmesh.cache_index.messages import LookupReply, LookupRequest
from kvmesh.config import EngineSettings
from kvmesh.engine.engine import Engine
from kvmesh.engine.loader import load_model
from kvmesh.engine.sampling import SamplingParams
from kvmesh.kv_events.events import BlockStored, KVEventBatch
from kvmesh.net import free_port
from kvmesh.protocol import subjects
from kvmesh.protocol.blocks import Tier
from kvmesh.protocol.streams import KV_EVENTS
from kvmesh.protocol.vllm_identity import chain_hashes, model_fingerprint
from kvmesh.stack.model import default_model_dir
from kvmesh.tiers.block_format import decode_block
from kvmesh.tiers.chunk_format import decode_toc
from kvmesh.tiers.namespace import namespace_for

DRIVER = Path(__file__).with_name("vllm_driver.py")
BLOCK = 32


def vllm_python() -> str:
    """This Python, where vLLM is installed (install.sh puts it beside kvmesh); else the test fails under CI."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    if os.environ.get("CI"):
        pytest.fail("vLLM is not installed in this venv: bash install.sh --test installs it")
    pytest.skip("vLLM is not installed in this venv: bash install.sh --test installs it")


pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return default_model_dir(tmp_path_factory.mktemp("state"))


def driver(model: Path, calls: list[dict], tmp: Path, env: dict[str, str], *flags: str) -> tuple[list[str], dict, Path]:
    """The driver's argv, environment and output path for these calls."""
    name = uuid.uuid4().hex[:8]
    calls_path, out = tmp / f"calls-{name}.json", tmp / f"out-{name}.json"
    calls_path.write_text(json.dumps(calls))
    argv = [vllm_python(), str(DRIVER), str(model), str(calls_path), str(out), *flags]
    return argv, {**os.environ, **env, "VLLM_CPU_KVCACHE_SPACE": "1"}, out


def run(model: Path, calls: list[dict], tmp: Path, env: dict[str, str], *flags: str) -> dict:
    argv, full_env, out = driver(model, calls, tmp, env, *flags)
    proc = subprocess.run(argv, env=full_env, cwd=tmp, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-6000:])
    assert proc.returncode == 0, f"vLLM driver failed ({proc.returncode})"
    return json.loads(out.read_text())


@pytest.fixture
def cache_index(nats_server, tmp_path) -> Iterator[str]:
    """A cache-index process on the session's NATS (streams declared first, as `kvmesh up` does)."""
    asyncio.run(_declare(nats_server.url))
    port = free_port()
    env = {**os.environ, "KVMESH_NATS_URL": nats_server.url, "KVMESH_SERVICE__HTTP_PORT": str(port),
           "KVMESH_SERVICE__WORKER_ID": f"idx-{uuid.uuid4().hex[:8]}",
           "KVMESH_INDEX__SNAPSHOT_NAME": f"snap-{uuid.uuid4().hex[:8]}"}
    log = (tmp_path / "index.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "kvmesh.services.cache_index"], env=env, stdout=log, stderr=log)
    try:
        asyncio.run(eventually(lambda: _ready(proc, port), 60, "the cache index's /readyz"))
        yield nats_server.url
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()


async def _declare(url: str) -> None:
    async with connected(url):
        pass


async def _ready(proc: subprocess.Popen, port: int) -> bool:
    assert proc.poll() is None, "the cache index exited"
    try:
        async with httpx.AsyncClient() as http:
            return (await http.get(f"http://127.0.0.1:{port}/readyz")).status_code == 200
    except httpx.TransportError:
        return False


async def _l3_blocks(url: str, hashes: list[bytes]) -> int:
    async with connected(url) as nc:
        reply = await request(nc, subjects.INDEX_LOOKUP, LookupRequest(hashes=[h.hex() for h in hashes]), LookupReply,
                              timeout_s=5.0)
    return reply.l3_blocks


async def _stored_by_vllm(url: str) -> dict[Tier, set[bytes]]:
    """Every block a vLLM worker (worker id `vllm-...`) reported stored, by tier, from the KV_EVENTS stream."""
    found: dict[Tier, set[bytes]] = {}
    async with connected(url) as nc:
        js = nc.jetstream()
        info = await js.stream_info(KV_EVENTS.name)
        vllm_subjects = subjects.kv_events("vllm-")  # the stream holds other tests' workers too
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            try:
                msg = await js.get_msg(KV_EVENTS.name, seq)
            except nats.js.errors.NotFoundError:  # deleted by another test's purge
                continue
            if not msg.subject.startswith(vllm_subjects):
                continue
            for e in KVEventBatch.from_bytes(msg.data).events:
                if isinstance(e, BlockStored):
                    found.setdefault(e.tier, set()).update(bytes.fromhex(h) for h in e.hashes)
    return found


async def _is(value, expected) -> bool:
    return await value == expected


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(200, 40000, (n,), generator=g).tolist()


def test_vllm_with_kvmesh_restores_from_l2_and_l3_and_recomputes_damage(model_dir, s3_server, cache_index,
                                                                        tmp_path) -> None:
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
    first = run(model_dir, [calls[0], calls[0], calls[1], *salted], tmp_path, {**env, "KVMESH_NATS_URL": cache_index},
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

    # The fleet saw it: the vLLM worker's KV events named p's blocks in its L2 and in L3, and the index says L3.
    stored = asyncio.run(_stored_by_vllm(cache_index))
    assert set(hashes) <= stored[Tier.L2] and set(hashes) <= stored[Tier.L3]
    asyncio.run(eventually(lambda: _is(_l3_blocks(cache_index, hashes), 9), 30, "the index to answer with L3"))

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


def test_a_second_vllm_restores_from_its_neighbours_l2(model_dir, tmp_path) -> None:
    """Two vLLM instances on one host, no S3: the second loads what the first computed from the first's slab."""
    env = {"KVMESH_TIERS__L3_ENABLED": "false", "KVMESH_STATE_DIR": str(tmp_path / "kvmesh")}
    first_id, second_id = (f"vllm-{n}-{uuid.uuid4().hex[:8]}" for n in ("one", "two"))
    p = prompt(4, 230)  # 7 loadable blocks of 32
    calls = [{"prompt_token_ids": p, "max_tokens": 8}]
    release = tmp_path / "release"
    argv, full_env, out = driver(model_dir, calls, tmp_path, env, "--connector", "--worker-id", first_id,
                                 "--hold", str(release))
    log = (tmp_path / "first.log").open("w")
    first = subprocess.Popen(argv, env=full_env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        asyncio.run(eventually(lambda: out.exists() or first.poll() is not None, 900, "the first vLLM's answer"))
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-4000:]
        computed = json.loads(out.read_text())["calls"][0]
        second = run(model_dir, calls, tmp_path, env, "--connector", "--worker-id", second_id, "--peers", first_id)
        assert second["calls"][0] == {"tokens": computed["tokens"], "cached": 7 * BLOCK}
    finally:
        release.touch()
        try:
            first.wait(120)
        except subprocess.TimeoutExpired:
            first.kill()
            first.wait()
        log.close()
