"""L2 host tier: bit-exact round trips (heap and the shared-memory slab), eviction by policy, corruption."""

from __future__ import annotations

import os
import subprocess
import sys

import torch
from kvmesh.cache_policy.base import LRUPolicy
from kvmesh.protocol.blocks import Tier
from kvmesh.tiers.block_format import decode_block, encode_kv_block
from kvmesh.tiers.l2_host import HostTier
from kvmesh.tiers.miss import Miss, MissReason
from kvmesh.tiers.shm_slab import SlabArena, SlabReader, slab_name


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def test_round_trip_and_handle(make_chain, fp) -> None:
    tier = HostTier(1 << 30, LRUPolicy(), fp, worker_id="w1")
    blocks = make_chain(4)
    for b in blocks:
        res = tier.put_block(b)
        assert res.stored and res.handle.tier is Tier.L2 and res.handle.worker_id == "w1"
    for b in blocks:
        got = tier.get(b.block_hash)
        assert not isinstance(got, Miss) and _same(got.to_kv_block().data, b.data)
        assert got.header.token_ids == b.token_ids
    assert tier.get(bytes(32)) == Miss(Tier.L2, MissReason.NOT_FOUND)
    assert tier.counters.get(Tier.L2, MissReason.NOT_FOUND) == 1


def test_capacity_evicts_lowest_priority_and_respects_pins(make_chain, fp) -> None:
    blocks = make_chain(4)
    size = len(encode_kv_block(blocks[0], fp))
    tier = HostTier(3 * size, LRUPolicy(), fp, clock=_Clock())
    for b in blocks[:3]:
        tier.put_block(b)
    tier.get(blocks[0].block_hash)  # block 1 is now least recently used
    tier.pin(blocks[1].block_hash, until=1e9)  # ...but pinned, so block 2 goes
    res = tier.put_block(blocks[3])
    assert res.stored and res.evicted == [blocks[2].block_hash]
    assert tier.used_bytes == 3 * size and len(tier) == 3
    for b in blocks[:2]:
        tier.pin(b.block_hash, until=1e9)
    tier.pin(blocks[3].block_hash, until=1e9)
    assert not tier.put_block(blocks[2]).stored  # everything pinned: refuse, evict nothing
    assert len(tier) == 3


def test_corrupted_bytes_are_dropped_not_served(make_chain, fp) -> None:
    tier = HostTier(1 << 30, LRUPolicy(), fp)
    block = make_chain(1)[0]
    tier.put_block(block)
    stored = tier.arena._bufs[block.block_hash]  # the bytes in host memory
    stored[len(stored) // 2] ^= 0xFF  # a bit flip in RAM
    assert tier.get(block.block_hash) == Miss(Tier.L2, MissReason.CHECKSUM)
    assert block.block_hash not in tier and tier.used_bytes == 0


_READER = """
import sys, torch
from kvmesh.tiers.shm_slab import SlabReader
from kvmesh.tiers.block_format import decode_block
buf = SlabReader().read(sys.argv[1], bytes.fromhex(sys.argv[2]))
block = decode_block(buf, sys.argv[3], bytes.fromhex(sys.argv[2]))
print(float(block.data.double().sum()), block.header.token_ids[0])
"""


def test_shared_memory_round_trip_across_processes(make_chain, fp) -> None:
    worker = f"w-shm-test-{os.getpid()}"  # slab names are machine-wide
    tier = HostTier(1 << 30, LRUPolicy(), fp, worker_id=worker, arena=SlabArena(worker, 1 << 30))
    reader = SlabReader()
    try:
        block = make_chain(1, seed=3)[0]
        tier.put_block(block)
        same_proc = tier.get(block.block_hash)
        assert _same(same_proc.to_kv_block().data, block.data)
        out = subprocess.run([sys.executable, "-c", _READER, worker, block.block_hash.hex(), fp],
                             capture_output=True, text=True, timeout=60, check=True).stdout.split()
        assert float(out[0]) == float(block.data.double().sum()) and int(out[1]) == block.token_ids[0]
        # A reader gets a copy: its writes do not reach the owner's bytes.
        view = decode_block(reader.read(worker, block.block_hash), fp)
        view.data.zero_()
        assert _same(tier.get(block.block_hash).to_kv_block().data, block.data)
        tier.remove(block.block_hash)
        assert reader.read(worker, block.block_hash) is None  # gone from the directory on eviction
    finally:
        reader.close()
        tier.close()
    assert slab_name(worker) not in os.listdir("/dev/shm")  # the slab is unlinked with its owner


def test_a_full_slab_evicts_by_policy_until_the_block_fits(make_chain, fp) -> None:
    """The slab's own limit (here its directory, at half load) evicts like a full tier does."""
    worker = f"w-slab-full-{os.getpid()}"
    blocks = make_chain(80)
    size = len(encode_kv_block(blocks[0], fp))
    arena = SlabArena(worker, len(blocks) * size)
    assert arena.max_blocks < len(blocks)  # small blocks: the directory fills before the bytes do
    tier = HostTier(1 << 30, LRUPolicy(), fp, worker_id=worker, arena=arena, clock=_Clock())
    try:
        results = [tier.put_block(b) for b in blocks]
        assert all(r.stored for r in results) and len(tier) == len(arena) == arena.max_blocks
        gone = len(blocks) - arena.max_blocks
        assert [h for r in results for h in r.evicted] == [b.block_hash for b in blocks[:gone]]  # LRU order
        assert all(not isinstance(tier.get(b.block_hash), Miss) for b in blocks[gone:])
    finally:
        tier.close()


def test_history_policies_hear_every_access_and_admission_is_respected(make_chain, fp) -> None:
    from kvmesh.cache_policy.registry import get_policy

    tier = HostTier(1 << 30, get_policy("tinylfu"), fp, clock=_Clock())
    block = make_chain(1, seed=11)[0]
    first = tier.put_block(block)  # TinyLFU admits only what it has seen before
    second = tier.put_block(block)
    assert not first.stored and second.stored and block.block_hash in tier
