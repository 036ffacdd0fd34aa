"""Helpers of the eviction tests: made-up chains (hashes, stats, KV blocks), an L3 store, the engine prompt."""

from __future__ import annotations

import hashlib
import uuid

import torch
from kvmesh.cache_policy.base import BlockInfo
from kvmesh.engine.kv_block import KVBlock
from kvmesh.eviction.occupancy import OccupancyView, WorkerOccupancy
from kvmesh.engine.sampling import SamplingParams
from kvmesh.protocol.blocks import Tier
from kvmesh.tiers.l3_store import L3Store
from kvmesh.tiers.s3_client import fast_fail_client

# The engine tests' prompt: 4 full blocks of 8; 5 greedy tokens never fill a 5th block.
BS = 8
PROMPT = [(7 * i + 3) % 500 + 5 for i in range(4 * BS)]
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


def chain(n: int, salt: str) -> list[bytes]:
    return [hashlib.sha256(f"{salt}/{i}".encode()).digest() for i in range(n)]


def infos(hashes: list[bytes], last_access: float = 0.0, step: float = 1.0) -> dict[bytes, BlockInfo]:
    """Stats of one chain; later blocks were touched later (`step` apart)."""
    out: dict[bytes, BlockInfo] = {}
    parent = None
    for i, h in enumerate(hashes):
        out[h] = BlockInfo(h, parent, i, 16, 1024, 0.0, last_access + i * step)
        parent = h
    return out


def kv_chain(n: int, seed: int = 0):
    """`n` chained KVBlocks with random data (block size 16): what L2 and L3 store."""
    gen = torch.Generator().manual_seed(seed)
    parent, out = None, []
    for i in range(n):
        tokens = tuple(int(t) for t in torch.randint(0, 32000, (16,), generator=gen))
        h = hashlib.sha256((parent or b"") + repr((seed, i, tokens)).encode()).digest()
        out.append(KVBlock(h, parent, tokens, torch.randn((2, 2, 16, 2, 8), generator=gen)))
        parent = h
    return out


def l3_store(s3_server, fingerprint: str, chunk_blocks: int = 2, ttl_s: int = 3600):
    """An L3Store on a bucket of its own."""
    client = fast_fail_client(s3_server.endpoint, s3_server.access_key, s3_server.secret_key)
    store = L3Store(client, f"ev-{uuid.uuid4().hex[:12]}", fingerprint, chunk_blocks=chunk_blocks, ttl_s=ttl_s)
    store.ensure_bucket()
    return store



def named_block(name: str) -> bytes:
    return hashlib.sha256(name.encode()).digest()


RETENTION_T0 = 1_000_000.0  # the session retention tests' clock starts here


def chain_in(view: OccupancyView, worker: str, names: list[str], at: float = RETENTION_T0) -> list[bytes]:
    """Blocks `names` as one chain (root first) that `worker` holds in L1, last accessed `at`."""
    occ = view.workers.setdefault(worker, WorkerOccupancy())
    parent = None
    out = []
    for depth, name in enumerate(names):
        h = named_block(name)
        view.stats.setdefault(h, BlockInfo(h, parent, depth, 16, 1, at, at))
        occ.tiers[Tier.L1].add(h)
        out.append(h)
        parent = h
    return out
