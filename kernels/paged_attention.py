"""Attention of a varlen batch of new tokens over the paged KV cache.

Sequence i has ``query_lens[i]`` new tokens (rows of q, in sequence order)
after ``context_lens[i] - query_lens[i]`` cached ones; its blocks are
``block_tables[i, :ceil(context_lens[i] / block_size)]``. New token j sits at
position ``context_lens[i] - query_lens[i] + j`` and attends causally to
every key at or before it. The new tokens' K/V must already be written
(kernels.kv_write). Prefill over a cached prefix, chunked prefill and
decode (query_len 1) mix freely in one call. GQA: q head h reads kv head
``h // (Hq // Hkv)`` (HF ``repeat_kv``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from kernels.dispatch import use_triton


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
        from kernels.triton.paged_attention import paged_attention_triton

        return paged_attention_triton(q, kv_layer, block_tables, query_lens, context_lens, scale)
    out = torch.empty_like(q)
    qlens = query_lens.tolist()
    clens = context_lens.tolist()
    starts = [0] * len(qlens)
    for i in range(1, len(qlens)):
        starts[i] = starts[i - 1] + qlens[i - 1]
    decode = [i for i, n in enumerate(qlens) if n == 1]
    if decode:
        _decode(out, q, kv_layer, block_tables, decode, [starts[i] for i in decode], clens, scale)
    for i, n in enumerate(qlens):
        if n > 1:
            _prefill(out, q, kv_layer, block_tables[i], starts[i], n, clens[i], scale)
    return out


def _decode(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seqs: list[int],
    rows: list[int],
    clens: list[int],
    scale: float,
) -> None:
    """One batched SDPA for all single-token sequences, keys padded and masked."""
    _, _, bs, hkv, d = kv_layer.shape
    n, hq = len(seqs), q.shape[1]
    ctx = [clens[i] for i in seqs]
    nb = -(-max(ctx) // bs)
    dev = q.device
    bt = block_tables[torch.tensor(seqs, device=dev), :nb].long()
    k = kv_layer[0][bt].view(n, nb * bs, hkv, d).transpose(1, 2)  # [n, Hkv, L, D]
    v = kv_layer[1][bt].view(n, nb * bs, hkv, d).transpose(1, 2)
    row_idx = torch.tensor(rows, device=dev)
    # GQA without expanding K/V: the G query heads of a kv head become G query rows.
    qg = q[row_idx].view(n, hkv, hq // hkv, d)
    valid = torch.arange(nb * bs, device=dev) < torch.tensor(ctx, device=dev).unsqueeze(1)
    o = F.scaled_dot_product_attention(qg, k, v, attn_mask=valid[:, None, None, :], scale=scale)
    out[row_idx] = o.reshape(n, hq, d)


def _prefill(
    out: torch.Tensor,
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    table: torch.Tensor,
    start: int,
    qlen: int,
    ctx: int,
    scale: float,
) -> None:
    """SDPA for one multi-token sequence over its gathered, contiguous K/V."""
    _, _, bs, hkv, d = kv_layer.shape
    nb = -(-ctx // bs)
    ids = table[:nb].long()
    k = kv_layer[0][ids].view(nb * bs, hkv, d)[:ctx].transpose(0, 1).unsqueeze(0)
    v = kv_layer[1][ids].view(nb * bs, hkv, d)[:ctx].transpose(0, 1).unsqueeze(0)
    qs = q[start : start + qlen].transpose(0, 1).unsqueeze(0)  # [1, Hq, qlen, D]
    # Causal aligned bottom-right (query j sees keys 0 .. ctx - qlen + j); with no
    # cached prefix this is plain is_causal and takes SDPA's causal fast path.
    mask = causal_lower_right(qlen, ctx)
    o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    out[start : start + qlen] = o[0].transpose(0, 1)
