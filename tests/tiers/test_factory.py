"""Tiers built from settings: the shared-memory L2 and the breaker-guarded L3 a service would get."""

from __future__ import annotations

import os

from kvmesh.config import Settings
from kvmesh.tiers.block_format import encode_kv_block
from kvmesh.tiers.factory import build_host_tier, build_l3_store
from kvmesh.tiers.miss import MissCounters
from kvmesh.tiers.shm_slab import SlabArena


def test_build_from_settings(s3_server, make_chain, fp, tmp_path) -> None:
    settings = Settings(state_dir=tmp_path, s3_endpoint=s3_server.endpoint, s3_access_key=s3_server.access_key,
                        s3_secret_key=s3_server.secret_key, s3={"bucket": "kvmesh-factory"},
                        tiers={"l3_breaker_failures": 5, "l3_chunk_tokens": 64})
    counters = MissCounters()
    l2 = build_host_tier(settings, fp, f"w-factory-{os.getpid()}", counters)
    l3 = build_l3_store(settings, fp, block_size=16, counters=counters)
    try:
        assert isinstance(l2.arena, SlabArena) and l3.chunk_blocks == 4 and l3.breaker.failure_threshold == 5
        blocks = make_chain(4)
        l2.put_block(blocks[0])
        assert l2.get(blocks[0].block_hash).header.block_hash == blocks[0].block_hash
        l3.ensure_bucket()
        l3.put_chain("ns", [encode_kv_block(b, fp) for b in blocks])
        assert len(l3.load_prefix("ns", [b.block_hash for b in blocks])) == 4
    finally:
        l2.close()
    assert build_l3_store(Settings(state_dir=tmp_path, tiers={"l3_enabled": False}), fp, 16, counters) is None
    assert build_l3_store(Settings(state_dir=tmp_path), fp, 16, counters) is None  # no credentials: recompute


def test_the_slab_directory_holds_as_many_blocks_as_l2_bytes_do(tmp_path) -> None:
    """8 KiB blocks (the default preset's) in 2 GiB: the directory is sized by the block, not a guess."""
    settings = Settings(state_dir=tmp_path, tiers={"l2_capacity_bytes": 2 << 30})
    l2 = build_host_tier(settings, "fp", f"w-factory-dir-{os.getpid()}", MissCounters(), block_bytes=8192)
    try:
        assert l2.arena.max_blocks >= (2 << 30) // 8192
    finally:
        l2.close()
