"""Triton KV write: one program per token stores its K and V rows at its slot."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_write_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kv,
    stride_slot,
    stride_ch,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    m = (h < num_heads) & (d < head_dim)
    dst = cache_ptr + slot * stride_slot + h * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=m)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=m)
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=m)
    tl.store(dst + stride_kv, v.to(cache_ptr.dtype.element_ty), mask=m)


def write_kv_triton(kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store k/v [T, Hkv, D] into kv_layer [2, nb, bs, Hkv, D] at slot_mapping [T]."""
    t, h, d = k.shape
    if t == 0:
        return
    # view: the slots must be addressable as one flat axis of the real cache.
    flat = kv_layer.view(2, -1, h, d)
    k, v = k.contiguous(), v.contiguous()
    assert flat.stride(3) == 1, "head_dim must be the innermost, contiguous axis"
    _kv_write_kernel[(t,)](
        k,
        v,
        flat,
        slot_mapping.contiguous(),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        flat.stride(0),
        flat.stride(1),
        flat.stride(2),
        h,
        d,
        BLOCK_H=triton.next_power_of_2(h),
        BLOCK_D=triton.next_power_of_2(d),
    )
