"""Store the new tokens' K/V into one layer of the paged cache.

``kv_layer`` is ``kv_cache[layer]``, shape ``[2, num_blocks, block_size,
Hkv, D]``; token t goes to slot ``slot_mapping[t]`` (``block_id *
block_size + offset``). Slots are distinct within one call.
"""

from __future__ import annotations

import torch
from kvmesh.kernels.dispatch import use_triton


def write_kv(
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    """Write k/v in place into kv_layer at slot_mapping."""
    if use_triton(kv_layer):
        from kvmesh.kernels.triton.kv_write import write_kv_triton

        write_kv_triton(kv_layer, k, v, slot_mapping)
        return
    _, nb, bs, h, d = kv_layer.shape
    # view (not reshape) so a non-viewable cache fails loudly instead of
    # writing into a silent copy.
    flat = kv_layer.view(2, nb * bs, h, d)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_layer.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_layer.dtype))
