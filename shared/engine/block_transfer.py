"""Cached blocks out of and into the pool as `KVBlock`s (tiers, prefill -> decode handoff).

Export takes the leading run of the asked hashes that is cached. Import
verifies before it inserts and stops at the first block that fails: wrong
shape or token count, a parent neither cached nor earlier in the list, or
a hash that is not H(parent, tokens, keys) for this engine's keys. Blocks
already cached are skipped; imported blocks end unreferenced (evictable).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.block_copy import gather_blocks, scatter_blocks
from shared.engine.block_hash import BlockHash, HashKeys, hash_block
from shared.engine.kv_block import KVBlock
from shared.engine.prefix_cache import PrefixCache


def export_blocks(cache: PrefixCache, kv_cache: torch.Tensor, hashes: Sequence[BlockHash]) -> list[KVBlock]:
    blocks = []
    for h in hashes:
        block = cache.get(h)
        if block is None:
            break
        blocks.append(block)
    if not blocks:
        return []
    data = gather_blocks(kv_cache, torch.tensor([b.block_id for b in blocks], dtype=torch.long)).cpu()
    return [
        KVBlock(block_hash=b.block_hash, parent_hash=b.parent_hash, token_ids=b.token_ids, data=data[i])
        for i, b in enumerate(blocks)
    ]


def _verified_prefix(cache: PrefixCache, blocks: Sequence[KVBlock], keys: HashKeys, shape: tuple[int, ...]) -> list[tuple[KVBlock, int]]:
    """(block, depth) for the blocks up to the first that fails, leaving out those already cached."""
    depth_of: dict[bytes, int] = {}
    todo: list[tuple[KVBlock, int]] = []
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
        if kb.block_hash not in cache:
            todo.append((kb, depth))
    return todo


def import_blocks(cache: PrefixCache, kv_cache: torch.Tensor, blocks: Sequence[KVBlock], keys: HashKeys) -> int:
    shape = (kv_cache.shape[0], 2, kv_cache.shape[3], kv_cache.shape[4], kv_cache.shape[5])
    todo = _verified_prefix(cache, blocks, keys, shape)
    if not todo:
        return 0
    fresh = cache.allocate(min(len(todo), cache.num_allocatable)) or []
    if not fresh:
        return 0
    todo = todo[: len(fresh)]
    ids = torch.tensor([b.block_id for b in fresh], dtype=torch.long)
    scatter_blocks(kv_cache, ids, torch.stack([kb.data for kb, _ in todo]))
    stored = 0
    for block, (kb, depth) in zip(fresh, todo):
        parent = BlockHash(kb.parent_hash) if kb.parent_hash is not None else None
        stored += cache.store(block, BlockHash(kb.block_hash), parent, tuple(kb.token_ids), depth)
    cache.release(fresh)
    return stored
