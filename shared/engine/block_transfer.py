"""Cached blocks out of and into the pool as `KVBlock`s (tiers, prefill -> decode handoff).

Export takes the leading run of the asked hashes that is cached. Import
verifies before it inserts and stops at the first block that fails: wrong
shape or token count, a parent neither cached nor earlier in the list, or
a hash that is not H(parent, tokens, keys) for this engine's keys. Blocks
already cached are skipped, but held while the new ones are allocated, so
making room for a chain never evicts the chain's own start. The caller gets
one reference on each block of the chain that is cached now (to keep under
a lease, or to release: then they are evictable).
On CUDA the copies go through `SideStreamCopier` (kernels/block_copy.py):
pinned host buffers on a side stream, never blocking the model's stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kvmesh.engine.block_pool import Block
from kvmesh.engine.kv_block import KVBlock
from kvmesh.engine.prefix_cache import PrefixCache
from kvmesh.kernels.block_copy import (
    HostCopy,
    SideStreamCopier,
    gather_blocks,
    scatter_blocks,
)
from kvmesh.protocol.block_hash import BlockHash, HashKeys, hash_block


@dataclass(slots=True)
class PendingExport:
    """Exported blocks whose bytes may still be travelling to the host; `wait()` gives the KVBlocks."""

    meta: list[tuple[bytes, bytes | None, tuple[int, ...]]]  # hash, parent, tokens per block
    copy: HostCopy | None

    def wait(self) -> list[KVBlock]:
        if self.copy is None:
            return []
        data = self.copy.wait()
        return [KVBlock(block_hash=h, parent_hash=p, token_ids=t, data=data[i])
                for i, (h, p, t) in enumerate(self.meta)]


@dataclass(slots=True, frozen=True)
class ImportResult:
    reached: int  # leading blocks of the given chain cached after the import (inserted or already there)
    stored: int  # how many of them the import inserted


@dataclass(slots=True)
class Imported:
    chain: list[Block]  # the leading run of the given blocks cached now, one reference each for the caller
    stored: int  # how many of them this import inserted


def start_export(cache: PrefixCache, kv_cache: torch.Tensor, hashes: Sequence[BlockHash],
                 copier: SideStreamCopier | None = None) -> PendingExport:
    blocks = []
    for h in hashes:
        block = cache.get(h)
        if block is None:
            break
        blocks.append(block)
    if not blocks:
        return PendingExport([], None)
    ids = torch.tensor([b.block_id for b in blocks], dtype=torch.long)
    copy = copier.gather_to_host(kv_cache, ids) if copier is not None else HostCopy(gather_blocks(kv_cache, ids).cpu())
    return PendingExport([(b.block_hash, b.parent_hash, b.token_ids) for b in blocks], copy)


def _verified_prefix(cache: PrefixCache, blocks: Sequence[KVBlock], keys: HashKeys, shape: tuple[int, ...]) -> list[tuple[KVBlock, int]]:
    """(block, depth) for the blocks up to the first that fails, cached ones included."""
    depth_of: dict[bytes, int] = {}
    verified: list[tuple[KVBlock, int]] = []
    for kb in blocks:
        parent = kb.parent_hash
        if tuple(kb.data.shape) != shape or len(kb.token_ids) != cache.block_size:
            break
        if parent is None:
            depth = 0
        elif parent in depth_of:
            depth = depth_of[parent] + 1
        else:
            cached_parent = cache.get(BlockHash(parent))
            info = cache.info(cached_parent) if cached_parent is not None else None
            if info is None:
                break
            depth = info.depth + 1
        if hash_block(BlockHash(parent) if parent is not None else None, kb.token_ids, keys) != kb.block_hash:
            break
        depth_of[kb.block_hash] = depth
        verified.append((kb, depth))
    return verified


def import_chain(cache: PrefixCache, kv_cache: torch.Tensor, blocks: Sequence[KVBlock], keys: HashKeys,
                 copier: SideStreamCopier | None = None) -> Imported:
    shape = (kv_cache.shape[0], 2, kv_cache.shape[3], kv_cache.shape[4], kv_cache.shape[5])
    verified = _verified_prefix(cache, blocks, keys, shape)
    held: dict[bytes, Block] = {}  # hash -> block this import holds one reference on
    for kb, _ in verified:
        block = cache.get(BlockHash(kb.block_hash))
        if block is not None:
            cache.acquire(block)
            held[kb.block_hash] = block
    todo = [(kb, depth) for kb, depth in verified if kb.block_hash not in held]
    fresh = (cache.allocate(min(len(todo), cache.num_allocatable)) or []) if todo else []
    todo = todo[: len(fresh)]
    stored = 0
    if todo:
        ids = torch.tensor([b.block_id for b in fresh], dtype=torch.long)
        if copier is not None:
            copier.scatter_from_host(kv_cache, ids, [kb.data for kb, _ in todo])
        else:
            scatter_blocks(kv_cache, ids, [kb.data for kb, _ in todo])
        for block, (kb, depth) in zip(fresh, todo):
            parent = BlockHash(kb.parent_hash) if kb.parent_hash is not None else None
            if cache.store(block, BlockHash(kb.block_hash), parent, tuple(kb.token_ids), depth):
                stored += 1
                held[kb.block_hash] = block
            else:  # not admitted by the policy: the slot goes back to the free list
                cache.release([block])
    chain: list[Block] = []
    for kb, _ in verified:
        block = held.get(kb.block_hash)
        if block is None:
            break
        chain.append(block)
    in_chain = {b.block_id for b in chain}
    cache.release([b for b in held.values() if b.block_id not in in_chain])
    return Imported(chain, stored)

