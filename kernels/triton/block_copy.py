"""Triton block gather/scatter between the paged cache and a [n, L, 2, ...] tensor.

One kernel serves both directions: program (i, layer*2 + kv) copies one
contiguous ``block_size * Hkv * D`` slice, reading or writing the cache at
``block_ids[i]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 1024  # elements per inner step; power of two for the interpreter too


@triton.jit
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    ids_ptr,
    src_stride_blk,
    src_stride_lk,
    dst_stride_blk,
    dst_stride_lk,
    numel,
    GATHER: tl.constexpr,
    CHUNK: tl.constexpr,
):
    i = tl.program_id(0)
    lk = tl.program_id(1)
    bid = tl.load(ids_ptr + i).to(tl.int64)
    src_blk = bid if GATHER else i
    dst_blk = i if GATHER else bid
    src = src_ptr + src_blk * src_stride_blk + lk * src_stride_lk
    dst = dst_ptr + dst_blk * dst_stride_blk + lk * dst_stride_lk
    for start in range(0, numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        m = offs < numel
        x = tl.load(src + offs, mask=m)
        tl.store(dst + offs, x.to(dst_ptr.dtype.element_ty), mask=m)


def _launch(src: torch.Tensor, dst: torch.Tensor, ids: torch.Tensor, kv_cache: torch.Tensor, gather: bool) -> None:
    layers, _, _, bs, h, d = kv_cache.shape
    n = ids.shape[0]
    if n == 0:
        return
    # cache: [L, 2, nb, E] -> (layer, kv) stride is stride(1); blocks: [n, L, 2, E].
    cache_strides = (kv_cache.stride(2), kv_cache.stride(1))
    blocks_strides = (layers * 2 * bs * h * d, bs * h * d)
    src_strides = cache_strides if gather else blocks_strides
    dst_strides = blocks_strides if gather else cache_strides
    _copy_blocks_kernel[(n, layers * 2)](
        src, dst, ids, *src_strides, *dst_strides, bs * h * d, GATHER=gather, CHUNK=_CHUNK
    )


def gather_blocks_triton(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Contiguous copy [n, L, 2, bs, Hkv, D] of the cache's blocks at block_ids."""
    assert kv_cache.is_contiguous(), "the paged pool is one contiguous tensor"
    ids = block_ids.to(device=kv_cache.device).contiguous()
    layers, two, _, bs, h, d = kv_cache.shape
    out = torch.empty((ids.shape[0], layers, two, bs, h, d), dtype=kv_cache.dtype, device=kv_cache.device)
    _launch(kv_cache, out, ids, kv_cache, gather=True)
    return out


def scatter_blocks_triton(kv_cache: torch.Tensor, block_ids: torch.Tensor, blocks: torch.Tensor) -> None:
    """Write blocks [n, L, 2, bs, Hkv, D] into the cache at block_ids, in place."""
    assert kv_cache.is_contiguous(), "the paged pool is one contiguous tensor"
    ids = block_ids.to(device=kv_cache.device).contiguous()
    src = blocks.to(device=kv_cache.device).contiguous()
    _launch(src, kv_cache, ids, kv_cache, gather=False)
