"""Attention of a varlen batch of new tokens over the paged KV cache.

Sequence i has ``query_lens[i]`` new tokens (rows of q, in sequence order)
after ``context_lens[i] - query_lens[i]`` cached ones; its blocks are
``block_tables[i, :ceil(context_lens[i] / block_size)]``. New token j sits at
position ``context_lens[i] - query_lens[i] + j`` and attends causally to
every key at or before it. The new tokens' K/V must already be written
(kernels.kv_write). Prefill over a cached prefix, chunked prefill and
decode (query_len 1) mix freely in one call. GQA: q head h reads kv head
``h // (Hq // Hkv)`` (HF ``repeat_kv``). The pool may hold K/V in a narrower
dtype than q (a model's ``kv_cache_dtype``); they are read in q's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from kvmesh.kernels.dispatch import use_triton
from torch.nn.attention.bias import causal_lower_right


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    kv_layer: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    query_lens: torch.Tensor,  # [S] int32
    context_lens: torch.Tensor,  # [S] int32
    scale: float,
) -> torch.Tensor:
    """Return attention output ``[T, Hq, D]`` in q's dtype."""
    if use_triton(q):
        from kvmesh.kernels.triton.paged_attention import paged_attention_triton

        return paged_attention_triton(q, kv_layer, block_tables, query_lens, context_lens, scale)
    return _paged_attention_torch(q, kv_layer, block_tables, query_lens, context_lens, scale)


def _paged_attention_torch(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One SDPA per sequence over its K/V, read in place where its blocks are consecutive.

    Measured on CPU (bench/kernels.py and micro-benchmarks): per-sequence SDPA
    over zero-copy views beats or matches one padded, gathered, masked batch
    for decode at batch 8-64 (a padded batch must also zero the padding, which
    may hold NaN); fragmented tables gather with index_select, by far the
    fastest gather measured (advanced indexing was ~50x slower). Reading
    exactly ``ctx`` keys means slots past the context are never touched.
    """
    out = torch.empty_like(q)
    bs = kv_layer.shape[2]
    first, consecutive = _block_runs(block_tables, context_lens, bs)
    start = 0
    for i, (qlen, ctx) in enumerate(zip(query_lens.tolist(), context_lens.tolist(), strict=True)):
        if qlen:
            nb = -(-ctx // bs)
            if consecutive[i]:
                kv = kv_layer[:, first[i] : first[i] + nb]
            else:
                kv = kv_layer.index_select(1, block_tables[i, :nb])
            kv = kv.flatten(1, 2)[:, :ctx].transpose(1, 2)  # [2, Hkv, ctx, D]
            if kv.dtype != q.dtype:  # a narrower KV dtype in the pool (kv_cache_dtype): attend in q's
                kv = kv.to(q.dtype)
            out[start : start + qlen] = _attend(q[start : start + qlen], kv[0], kv[1], scale)
        start += qlen
    if start != q.shape[0]:
        raise ValueError(f"query_lens sum to {start} but q has {q.shape[0]} rows")
    return out


def _block_runs(block_tables: torch.Tensor, context_lens: torch.Tensor, bs: int) -> tuple[list[int], list[bool]]:
    """Per sequence: its first block id, and whether all its blocks are consecutive ids."""
    nbs = (context_lens.to(torch.int64) + bs - 1) // bs
    steps = block_tables[:, 1:] - block_tables[:, :-1]
    beyond = torch.arange(1, block_tables.shape[1], device=block_tables.device) >= nbs[:, None]
    consecutive = ((steps == 1) | beyond).all(dim=1)
    return block_tables[:, 0].tolist(), consecutive.tolist()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [qlen, Hq, D] of one sequence over its k/v [Hkv, ctx, D]; returns [qlen, Hq, D]."""
    qlen, hq, d = q.shape
    hkv, ctx = k.shape[0], k.shape[1]
    if qlen == 1:
        # Decode: the group's query heads become query rows of their kv head,
        # so GQA needs neither a mask nor expanded K/V.
        o = F.scaled_dot_product_attention(q.reshape(1, hkv, hq // hkv, d), k[None], v[None], scale=scale)
        return o.reshape(1, hq, d)
    if qlen == ctx:  # no cached prefix: plain is_causal, SDPA's fused path (no mask, no score matrix)
        return _sdpa_causal(q, k, v, scale)
    # Over a cached prefix the causal mask is materialized, and with it a
    # [Hq, rows, keys] score matrix: a 4k-token suffix over 20k keys held
    # ~400 MB for one layer. Query rows go in slices that bound it; slice
    # rows j0..j1 see keys 0 .. past + j1, the same keys as unsliced.
    out = torch.empty_like(q)
    past = ctx - qlen
    rows = max(_MIN_ROWS, _SCORE_BUDGET // (ctx * hq))
    for j0 in range(0, qlen, rows):
        j1 = min(qlen, j0 + rows)
        out[j0:j1] = _sdpa_causal(q[j0:j1], k[:, : past + j1], v[:, : past + j1], scale)
    return out


# Score elements one SDPA call may hold (x4 bytes in float32), and the fewest query rows a slice takes.
_SCORE_BUDGET = 1 << 25
_MIN_ROWS = 64


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows of q are the last ones of k's sequence, causal aligned bottom-right
    (query j of n sees keys 0 .. len(k) - n + j)."""
    mask = causal_lower_right(q.shape[0], k.shape[1])
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, scale=scale, enable_gqa=True
    )
    return o[0].transpose(0, 1)
