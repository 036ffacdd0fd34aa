"""Copy whole blocks out of and into the paged cache (export / import).

An exported block is ``kv_cache[:, :, block_id]``: ``[num_layers, 2,
block_size, Hkv, D]``; n blocks travel as one contiguous ``[n, ...]`` tensor
(see shared/engine/kv_block.py).
"""

from __future__ import annotations

import torch

from kernels.dispatch import use_triton


def gather_blocks(
    kv_cache: torch.Tensor,  # [L, 2, num_blocks, block_size, Hkv, D]
    block_ids: torch.Tensor,  # [n] int
) -> torch.Tensor:
    """Return a contiguous copy ``[n, L, 2, block_size, Hkv, D]`` of the blocks."""
    if use_triton(kv_cache):
        from kernels.triton.block_copy import gather_blocks_triton

        return gather_blocks_triton(kv_cache, block_ids)
    ids = block_ids.to(device=kv_cache.device, dtype=torch.long)
    return kv_cache.index_select(2, ids).permute(2, 0, 1, 3, 4, 5).contiguous()


def scatter_blocks(
    kv_cache: torch.Tensor,  # [L, 2, num_blocks, block_size, Hkv, D]
    block_ids: torch.Tensor,  # [n] int, distinct
    blocks: torch.Tensor,  # [n, L, 2, block_size, Hkv, D], any device
) -> None:
    """Write blocks into kv_cache in place at block_ids (dtype/device converted)."""
    if use_triton(kv_cache):
        from kernels.triton.block_copy import scatter_blocks_triton

        scatter_blocks_triton(kv_cache, block_ids, blocks)
        return
    ids = block_ids.to(device=kv_cache.device, dtype=torch.long)
    src = blocks.to(device=kv_cache.device, dtype=kv_cache.dtype)
    kv_cache.index_copy_(2, ids, src.permute(1, 2, 0, 3, 4, 5))
