"""Rotary position embedding, HF "rotate_half" (neox) convention.

``out = x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`` per token, with
cos/sin looked up at the token's absolute position; this equals HF Llama /
Qwen2 ``apply_rotary_pos_emb`` bit for bit in fp32. The tables are the
model's (it owns frequency scaling such as Llama-3's).
"""

from __future__ import annotations

import torch
from kvmesh.kernels.dispatch import use_triton


def apply_rope(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    positions: torch.Tensor,  # [T] int64
    cos: torch.Tensor,  # [max_pos, D // 2]
    sin: torch.Tensor,  # [max_pos, D // 2]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return rotated copies of q and k (inputs are left untouched)."""
    if use_triton(q):
        from kvmesh.kernels.triton.rope import apply_rope_triton

        return apply_rope_triton(q, k, positions, cos, sin)
    c = cos[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D/2]
    s = sin[positions].to(q.dtype).unsqueeze(1)
    return _rotate(q, c, s), _rotate(k, c, s)


def _rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    # Same products and sums as HF's x*cos + rotate_half(x)*sin, half by half:
    # first half x1*c + (-x2)*s, second half x2*c + x1*s (negation is exact).
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
