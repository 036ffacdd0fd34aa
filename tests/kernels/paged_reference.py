"""Naive dense references and a paged-batch builder for the kernel tests.

The references loop over tokens in float64 with no paging at all, so they
share no code (and no bug) with the kernels they judge.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class PagedCase:
    """A varlen batch whose full per-sequence K/V already sit in a paged cache."""

    q: torch.Tensor  # [T, Hq, D]
    kv_layer: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor  # [S, max_blocks] int32
    query_lens: torch.Tensor  # [S] int32
    context_lens: torch.Tensor  # [S] int32
    keys: list[torch.Tensor]  # per sequence [ctx, Hkv, D], dense
    values: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [T] int64, slots of the new tokens


def make_case(
    seqs: list[tuple[int, int]],  # (query_len, context_len) per sequence
    hq: int,
    hkv: int,
    d: int,
    block_size: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    consecutive: bool = False,
) -> PagedCase:
    """Random q/K/V; blocks from a shuffled pool, or runs of consecutive ids.

    Shuffled tables are fragmented; ``consecutive`` gives each sequence one
    run of consecutive block ids at a random place in the pool.
    """
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(c / block_size) for _, c in seqs]
    num_blocks = sum(need) + 3  # spare blocks the kernels must not read
    perm = torch.randperm(num_blocks, generator=g).tolist()
    if consecutive:  # runs in order, from an offset so block 0 is not the first
        perm = list(range(num_blocks - 1, 2, -1)) + [0, 1, 2]
    # Every slot outside a sequence's context holds NaN: reading one poisons the output.
    kv_layer = torch.full((2, num_blocks, block_size, hkv, d), float("nan"), dtype=dtype)
    max_blocks = max(need) + 1
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    keys, values, slots, qs = [], [], [], []
    for i, ((qlen, ctx), nb) in enumerate(zip(seqs, need, strict=True)):
        ids = [perm.pop() for _ in range(nb)]
        tables[i, :nb] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(ctx, hkv, d, generator=g, dtype=dtype)
        v = torch.randn(ctx, hkv, d, generator=g, dtype=dtype)
        seq_slots = torch.tensor([ids[p // block_size] * block_size + p % block_size for p in range(ctx)])
        flat = kv_layer.view(2, -1, hkv, d)
        flat[0, seq_slots] = k
        flat[1, seq_slots] = v
        keys.append(k)
        values.append(v)
        slots.append(seq_slots[ctx - qlen :])
        qs.append(torch.randn(qlen, hq, d, generator=g, dtype=dtype))
    return PagedCase(
        q=torch.cat(qs),
        kv_layer=kv_layer,
        block_tables=tables,
        query_lens=torch.tensor([s[0] for s in seqs], dtype=torch.int32),
        context_lens=torch.tensor([s[1] for s in seqs], dtype=torch.int32),
        keys=keys,
        values=values,
        slot_mapping=torch.cat(slots).long(),
    )


def dense_attention(case: PagedCase, scale: float) -> torch.Tensor:
    """Per-token causal attention over the dense K/V, float64, returned in q's dtype."""
    hq = case.q.shape[1]
    out = torch.empty_like(case.q, dtype=torch.float64)
    row = 0
    lens = zip(case.query_lens.tolist(), case.context_lens.tolist(), strict=True)
    for (qlen, ctx), k, v in zip(lens, case.keys, case.values, strict=True):
        group = hq // k.shape[1]
        kd = k.double().repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        vd = v.double().repeat_interleave(group, dim=1)
        for j in range(qlen):
            pos = ctx - qlen + j
            qt = case.q[row].double()  # [Hq, D]
            scores = torch.einsum("hd,khd->hk", qt, kd[: pos + 1]) * scale
            out[row] = torch.einsum("hk,khd->hd", scores.softmax(-1), vd[: pos + 1])
            row += 1
    return out.to(case.q.dtype)


def dense_rope(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF Llama apply_rotary_pos_emb, written out as HF does (rotate_half, cat)."""
    c = torch.cat((cos[positions], cos[positions]), dim=-1).unsqueeze(1).to(x.dtype)
    s = torch.cat((sin[positions], sin[positions]), dim=-1).unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * c + rotated * s


def rope_tables(max_pos: int, d: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [max_pos, d // 2] as HF computes them (inv_freq outer positions, fp32)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return freqs.cos(), freqs.sin()
