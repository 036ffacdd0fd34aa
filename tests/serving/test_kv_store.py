"""Blocks leaving the engine: `store_chain` lands a chain whole in L2 and L3 a window at a time, and a
prompt prefilled in several steps hands over each step's blocks (`RequestSpec.on_cached`)."""

from __future__ import annotations

import uuid

import nats
import pytest
import torch
from kvmesh.config import EngineSettings, Settings
from kvmesh.engine.engine import Engine
from kvmesh.engine.sampling import SamplingParams
from kvmesh.serving.engine_loop import EngineLoop, RequestSpec, cached_lease
from kvmesh.serving.kv_store import store_chain
from kvmesh.serving.worker_tiers import WorkerTiers, namespace_for

from .harness import BLOCK_SIZE, SALT_A

pytestmark = pytest.mark.timeout(120)

TEXT = "A long agent context leaves the pool in windows, never as one second copy of itself. " * 6


async def test_a_chain_exported_in_windows_lands_whole(tiny_loaded, nats_server, s3_server):
    bucket = f"store-{uuid.uuid4().hex[:10]}"
    s3_server.ensure_bucket(bucket)
    settings = Settings(s3_endpoint=s3_server.endpoint, s3_access_key=s3_server.access_key,
                        s3_secret_key=s3_server.secret_key, s3={"bucket": bucket},
                        tiers={"l2_shared_memory": False, "l3_chunk_tokens": 4 * BLOCK_SIZE})
    salt = bytes.fromhex(SALT_A)
    prompt = tiny_loaded.tokenizer.encode(TEXT)
    engine = Engine(tiny_loaded, EngineSettings(block_size=BLOCK_SIZE, num_blocks=256))
    exports: list[int] = []  # how many blocks each window asked for (a host pool: leased views, no copy)
    lease_views = engine.lease_views
    engine.lease_views = lambda hashes, lease: exports.append(len(hashes)) or lease_views(hashes, lease)
    loop = EngineLoop(engine)
    loop.start()
    nc = await nats.connect(nats_server.url)
    tiers = await WorkerTiers.start(settings, nc, "store-worker", tiny_loaded.fingerprint, BLOCK_SIZE)
    try:
        await loop.run_request(RequestSpec("r", prompt, SamplingParams(max_tokens=1), salt), lambda _: None)
        hashes = await loop.call(lambda e: e.block_hashes(prompt, salt))
        assert len(hashes) >= 10
        handles, chain = await store_chain(loop, tiers, hashes, SALT_A, window_blocks=3)
        assert exports and max(exports) == 3 and sum(exports) == len(hashes)
        assert [h.hash_bytes for h in handles] == hashes and len(chain) == len(hashes)
        assert await loop.call(lambda e: e.leases.newest_first()) == []  # every window's lease was let go
        assert await tiers.uploads.join(30)
        stored = tiers.l3.load_prefix(namespace_for(SALT_A), hashes)
        assert [b.header.block_hash for b in stored] == hashes
        # Registered again, nothing leaves the engine and nothing new goes to S3.
        puts = tiers.l3.stats.put_requests
        await store_chain(loop, tiers, hashes, SALT_A, window_blocks=3)
        assert sum(exports) == len(hashes)
        assert await tiers.uploads.join(30) and tiers.l3.stats.put_requests == puts
    finally:
        await tiers.close()
        await nc.drain()
        loop.stop()


async def test_a_prompt_prefilled_in_steps_hands_over_each_steps_blocks_as_leased_views(tiny_loaded):
    """`RequestSpec.on_cached`: after each step, the prompt blocks it cached, in chain order, as views of the
    pool that hold its bytes; the final step's blocks (and the output's) are not handed over."""
    salt = bytes.fromhex(SALT_A)
    prompt = tiny_loaded.tokenizer.encode(TEXT)
    engine = Engine(tiny_loaded, EngineSettings(block_size=BLOCK_SIZE, num_blocks=256,
                                                max_num_batched_tokens=2 * BLOCK_SIZE))
    loop = EngineLoop(engine)
    loop.start()
    seen: list[list] = []
    try:
        spec = RequestSpec("r", prompt, SamplingParams(max_tokens=1), salt, on_cached=seen.append)
        await loop.run_request(spec, lambda _: None)
        hashes = await loop.call(lambda e: e.block_hashes(prompt, salt))
        got = [kb for step in seen for kb in step]
        assert len(seen) >= 3 and all(len(step) == 2 for step in seen)  # two blocks a step, in order
        assert [kb.block_hash for kb in got] == hashes[:len(got)] and len(got) < len(hashes)
        copies = await loop.call(lambda e: e.export_blocks(hashes[:len(got)]))
        assert all(torch.equal(v.data, c.data) for v, c in zip(got, copies, strict=True))
        assert await loop.call(lambda e: e.leases.newest_first()) == [cached_lease("r")]
        loop.release_lease(cached_lease("r"))
        assert await loop.call(lambda e: e.leases.newest_first()) == []
    finally:
        loop.stop()
