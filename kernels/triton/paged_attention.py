"""Triton paged attention: one varlen kernel for prefill, chunked prefill and decode.

Program (seq, query tile, kv head) owns ``BLOCK_Q`` new tokens of one
sequence times the ``G = Hq // Hkv`` query heads that share the kv head,
packed as rows, so decode (BLOCK_Q = 1) still fills a tile with GQA heads.
It walks the sequence's keys in tiles of ``BLOCK_N`` (each key's cache block
looked up in the block table, so a tile spans several blocks of any
block_size), with online softmax, up to the last key its latest token may
see; the mask is causal across the cached prefix and the new tokens.
Contract: kernels/paged_attention.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_PREFILL_ROWS = 64  # rows per tile (tokens x group heads) when any sequence is multi-token
_KEY_TILE = 64  # keys per step, across cache blocks (any block_size works)
_MIN_DOT = 16  # tl.dot wants every dimension at least 16 on GPU


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    bt_ptr,
    qstart_ptr,
    qlen_ptr,
    ctx_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_bt,
    head_dim,
    G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    tile_start = tl.program_id(1) * BLOCK_Q
    kvh = tl.program_id(2)
    qlen = tl.load(qlen_ptr + seq)
    if tile_start < qlen:
        ctx = tl.load(ctx_ptr + seq)
        q0 = tl.load(qstart_ptr + seq).to(tl.int64)
        r = tl.arange(0, BLOCK_M)
        tok = tile_start + r // G
        head = kvh * G + r % G
        row_ok = (r < BLOCK_Q * G) & (tok < qlen)
        qpos = ctx - qlen + tok  # absolute position of each row's token
        d = tl.arange(0, BLOCK_D)
        dm = d < head_dim
        q_rows = (q0 + tok)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + q_rows, mask=row_ok[:, None] & dm[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        last_tok = tl.minimum(tile_start + BLOCK_Q, qlen) - 1
        num_tiles = tl.cdiv(ctx - qlen + last_tok + 1, BLOCK_N)
        n = tl.arange(0, BLOCK_N)
        for b in range(0, num_tiles):
            kpos = b * BLOCK_N + n
            in_ctx = kpos < ctx
            # A key tile spans BLOCK_N / BLOCK_SIZE cache blocks: look each key's block up.
            bid = tl.load(bt_ptr + seq * stride_bt + kpos // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
            slot = bid * stride_kb + (kpos % BLOCK_SIZE) * stride_ks
            kv_off = slot[:, None] + kvh * stride_kh + d[None, :]
            # Slots past the context may hold anything (NaN included): never load them,
            # since a masked score still multiplies its V row by zero.
            kv_mask = in_ctx[:, None] & dm[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)  # the pool may store a narrower KV dtype
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
            # Key 0 is visible to every row, so each row's running max is finite
            # after tile 0 and fully masked later tiles add exact zeros.
            visible = (kpos[None, :] <= qpos[:, None]) & in_ctx[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        acc = acc / l_i[:, None]
        o_rows = (q0 + tok)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_rows, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dm[None, :])


def paged_attention_triton(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    query_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention output [T, Hq, D]; arguments as in kernels.paged_attention."""
    t, hq, d = q.shape
    _, _, bs, hkv, _ = kv_layer.shape
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t == 0:
        return out
    assert hq % hkv == 0, "Hq must be a multiple of Hkv"
    assert kv_layer.stride(-1) == 1, "head_dim must be the innermost, contiguous axis"
    group = hq // hkv
    max_qlen = int(query_lens.max())
    # Decode packs only the group's heads into a tile; prefill adds tokens up to ~64 rows.
    block_q = 1 if max_qlen == 1 else max(1, _PREFILL_ROWS // group)
    block_m = max(_MIN_DOT, triton.next_power_of_2(block_q * group))
    qstart = (torch.cumsum(query_lens, 0) - query_lens).to(torch.int32)
    block_tables = block_tables.contiguous()
    grid = (query_lens.shape[0], triton.cdiv(max_qlen, block_q), hkv)
    _paged_attention_kernel[grid](
        q,
        kv_layer[0],
        kv_layer[1],
        out,
        block_tables,
        qstart,
        query_lens.contiguous(),
        context_lens.contiguous(),
        scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        block_tables.stride(0),
        d,
        G=group,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=_KEY_TILE,
        BLOCK_D=max(_MIN_DOT, triton.next_power_of_2(d)),
        BLOCK_SIZE=bs,
        # fp32 must stay fp32 (no TF32) to match the torch path; others use the default.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
    )
    return out
