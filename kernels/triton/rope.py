"""Triton RoPE: one program per token rotates all of its heads (see kernels/rope.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    x_ptr,
    out_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_cos,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < HALF
    m = (h[:, None] < num_heads) & jm[None, :]
    x_row = x_ptr + t * stride_xt + h[:, None] * stride_xh + j[None, :]
    x1 = tl.load(x_row, mask=m, other=0.0)
    x2 = tl.load(x_row + HALF, mask=m, other=0.0)
    c = tl.load(cos_ptr + pos * stride_cos + j, mask=jm, other=0.0).to(x1.dtype)[None, :]
    s = tl.load(sin_ptr + pos * stride_cos + j, mask=jm, other=0.0).to(x1.dtype)[None, :]
    o_row = out_ptr + t * stride_ot + h[:, None] * stride_oh + j[None, :]
    tl.store(o_row, x1 * c - x2 * s, mask=m)
    tl.store(o_row + HALF, x2 * c + x1 * s, mask=m)


def _rotate(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    t, h, d = x.shape
    if t == 0:
        return out
    _rope_kernel[(t,)](
        x,
        out,
        positions,
        cos,
        sin,
        x.stride(0),
        x.stride(1),
        out.stride(0),
        out.stride(1),
        cos.stride(0),
        h,
        HALF=d // 2,
        BLOCK_H=triton.next_power_of_2(h),
        BLOCK_HALF=triton.next_power_of_2(d // 2),
    )
    return out


def apply_rope_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of q [T, Hq, D] and k [T, Hkv, D]."""
    positions = positions.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    return _rotate(q, positions, cos, sin), _rotate(k, positions, cos, sin)
