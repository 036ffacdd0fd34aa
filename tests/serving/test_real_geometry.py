"""End to end at Llama-3-8B KV geometry (128 KiB of bf16 KV per token), at a short context.

Real prefill and decode processes: prefill -> handoff -> decode, the next
turn hits the first turn's blocks, and a worker started after them, with
nothing in memory, restores the chain from L3. Every turn's tokens equal an
in-process engine's with the cache off.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import torch
from bus.helpers import connected
from kvmesh.config import EngineSettings
from minio import Minio

from .harness import (
    BLOCK_SIZE,
    WorkerProcs,
    prefill_job,
    send_prefill,
    unique,
    worker_stack,
)

pytestmark = pytest.mark.timeout(400)

BUCKET = "kvmesh-real-geometry"
KV_BYTES_PER_TOKEN = 131072


@pytest.fixture(scope="module")
def loaded_8b(llama3_8b_model_dir):
    from kvmesh.engine.loader import load_model

    loaded = load_model(llama3_8b_model_dir)
    assert loaded.config.kv_bytes_per_token() == KV_BYTES_PER_TOKEN
    return loaded


def _reference(loaded, prompt: list[int], max_tokens: int) -> list[int]:
    from kvmesh.engine.engine import Engine
    from kvmesh.engine.sampling import SamplingParams

    engine = Engine(loaded, EngineSettings(block_size=BLOCK_SIZE, num_blocks=96, enable_prefix_caching=False))
    return engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0].token_ids


@pytest.fixture(scope="module")
def stack(nats_server, s3_server, llama3_8b_model_dir, tmp_path_factory) -> Iterator[WorkerProcs]:
    with worker_stack(nats_server, s3_server, BUCKET, llama3_8b_model_dir, tmp_path_factory.mktemp("real-geometry"),
                      (("prefill", "pf-8b-"), ("decode", "dc-8b-")),
                      KVMESH_ENGINE__NUM_BLOCKS="96",  # 192 MiB of bf16 KV at this geometry
                      KVMESH_TIERS__L2_CAPACITY_BYTES=str(256 * 2**20),
                      KVMESH_TIERS__L3_TAIL_DELAY_S="0.2") as procs:
        yield procs



def _chunks_in_l3(s3_server) -> int:
    client = Minio(s3_server.endpoint, s3_server.access_key, s3_server.secret_key, secure=False)
    return sum(1 for _ in client.list_objects(BUCKET, recursive=True))


async def test_two_turns_and_an_l3_restore_at_8b_geometry(stack, nats_server, s3_server, loaded_8b):
    pf, dc = list(stack.procs)[:2]
    salt = "e5" * 32
    p1 = torch.randint(0, 1000, (300,), generator=torch.Generator().manual_seed(8)).tolist()
    async with connected(nats_server.url) as nc:
        c1 = await send_prefill(nc, pf, prefill_job(unique(), p1, dc, max_tokens=12, salt=salt))
        f1 = await c1.wait_final(240)
        out1 = c1.ordered
        assert f1.error is None and out1 == _reference(loaded_8b, p1, 12)

        p2 = p1 + out1 + list(range(40, 80))
        c2 = await send_prefill(nc, pf, prefill_job(unique(), p2, dc, max_tokens=8, salt=salt))
        f2 = await c2.wait_final(240)
        assert c2.ordered == _reference(loaded_8b, p2, 8)
        assert f2.cached_tokens >= len(p1) // BLOCK_SIZE * BLOCK_SIZE

        # Both turns' chains reach L3 (full chunks at once, the tail after its short delay).
        end = time.monotonic() + 120
        while _chunks_in_l3(s3_server) < 2 and time.monotonic() < end:
            await asyncio.sleep(0.2)
        assert _chunks_in_l3(s3_server) >= 2

        fresh = stack.start("prefill", unique("pf-8b-fresh-"), KVMESH_WORKERS__PROBE_PEERS="false")
        stack.wait_ready([fresh])
        p3 = p2 + list(range(90, 110))
        c3 = await send_prefill(nc, fresh.worker_id, prefill_job(unique(), p3, dc, max_tokens=6, salt=salt))
        f3 = await c3.wait_final(240)
        for c in (c1, c2, c3):
            await c.close()
    assert c3.events[0].worker_id == fresh.worker_id
    assert f3.cached_tokens >= 256  # at least one whole 256-token chunk came back from L3
    assert c3.ordered == _reference(loaded_8b, p3, 6)
