"""The torch paths (what runs on CPU) against dense references and HF's RoPE."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.kernels.block_copy import gather_blocks, scatter_blocks
from kvmesh.kernels.kv_write import write_kv
from kvmesh.kernels.paged_attention import paged_attention
from kvmesh.kernels.rope import apply_rope
from paged_reference import dense_attention, dense_rope, make_case, rope_tables


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_KERNELS", "torch")


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), [(4, 1, 32, 16), (8, 2, 64, 32), (4, 4, 32, 16), (12, 4, 16, 16)])
def test_paged_attention_matches_dense_mixed_batch(hq: int, hkv: int, d: int, bs: int, consecutive: bool) -> None:
    seqs = [(1, 1), (5, 5), (1, bs), (1, bs + 1), (7, 2 * bs + 3), (bs, 3 * bs), (1, 37), (3, bs + 1)]
    case = make_case(seqs, hq, hkv, d, bs, seed=hq + d, consecutive=consecutive)
    runs = [_is_one_run(case.block_tables[i], c, bs) for i, (_, c) in enumerate(seqs) if c > bs]
    assert all(runs) if consecutive else not any(runs)  # both torch branches: views and gathers
    scale = d**-0.5
    got = paged_attention(case.q, case.kv_layer, case.block_tables, case.query_lens, case.context_lens, scale)
    torch.testing.assert_close(got, dense_attention(case, scale), atol=1e-5, rtol=1e-5)


def _is_one_run(table: torch.Tensor, ctx: int, bs: int) -> bool:
    ids = table[: -(-ctx // bs)].tolist()
    return ids == list(range(ids[0], ids[0] + len(ids)))


def test_rope_matches_hf_formula_bitwise() -> None:
    cos, sin = rope_tables(512, 64)
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(9, 8, 64, generator=g), torch.randn(9, 2, 64, generator=g)
    pos = torch.tensor([0, 1, 2, 100, 511, 7, 7, 3, 250])
    rq, rk = apply_rope(q, k, pos, cos, sin)
    assert torch.equal(rq, dense_rope(q, pos, cos, sin))
    assert torch.equal(rk, dense_rope(k, pos, cos, sin))


def test_write_kv_then_gather_scatter_roundtrip() -> None:
    g = torch.Generator().manual_seed(2)
    kv_cache = torch.zeros(3, 2, 6, 16, 2, 32)
    k, v = torch.randn(5, 2, 32, generator=g), torch.randn(5, 2, 32, generator=g)
    slots = torch.tensor([16 * 4 + 3, 0, 16 * 5 + 15, 17, 16 * 4 + 4])
    write_kv(kv_cache[1], k, v, slots)
    flat = kv_cache[1].view(2, -1, 2, 32)
    assert torch.equal(flat[0, slots], k) and torch.equal(flat[1, slots], v)
    ids = torch.tensor([4, 0, 5])
    blocks = gather_blocks(kv_cache, ids)
    assert blocks.shape == (3, 3, 2, 16, 2, 32) and blocks.is_contiguous()
    assert torch.equal(blocks[1], kv_cache[:, :, 0])
    other = torch.zeros_like(kv_cache)
    scatter_blocks(other, torch.tensor([1, 2, 3]), blocks)
    assert torch.equal(other[:, :, 3], kv_cache[:, :, 5]) and torch.equal(other[:, :, 1], kv_cache[:, :, 4])
    assert other[:, :, [0, 4, 5]].abs().sum() == 0


@pytest.mark.parametrize("prefix", [0, 1, 15, 16, 17, 40])
def test_output_does_not_depend_on_cached_prefix(prefix: int) -> None:
    """Tokens after the prefix get the same output cached, recomputed or decoded one by one."""
    ctx, hq, hkv, d, bs = 48, 8, 2, 32, 16
    full = make_case([(ctx, ctx)], hq, hkv, d, bs, seed=7)
    scale = d**-0.5
    args = (full.kv_layer, full.block_tables)
    ref = paged_attention(full.q, *args, full.query_lens, full.context_lens, scale)[prefix:]
    ctx_t = torch.tensor([ctx], dtype=torch.int32)
    split = paged_attention(full.q[prefix:], *args, torch.tensor([ctx - prefix], dtype=torch.int32), ctx_t, scale)
    torch.testing.assert_close(split, ref, atol=2e-6, rtol=0)
    last = paged_attention(full.q[-1:], *args, torch.tensor([1], dtype=torch.int32), ctx_t, scale)
    torch.testing.assert_close(last, ref[-1:], atol=2e-6, rtol=0)


def test_rope_matches_hf_llama3_scaled_bitwise() -> None:
    """Tables built by HF's own LlamaRotaryEmbedding (llama3 scaling) and its apply_rotary_pos_emb."""
    from transformers import LlamaConfig
    from transformers.models.llama import modeling_llama as hf

    d, hq, hkv, max_pos = 64, 4, 2, 2048
    config = LlamaConfig(
        hidden_size=d * hq,
        num_attention_heads=hq,
        num_key_value_heads=hkv,
        max_position_embeddings=max_pos,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
    )
    all_pos = torch.arange(max_pos)[None]
    cos_full, sin_full = hf.LlamaRotaryEmbedding(config)(torch.zeros(1, 1, d), all_pos)
    cos, sin = cos_full[0, :, : d // 2], sin_full[0, :, : d // 2]
    g = torch.Generator().manual_seed(3)
    t = 11
    q, k = torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g)
    pos = torch.randint(0, max_pos, (t,), generator=g)
    hq_out, hk_out = hf.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_full[:, pos], sin_full[:, pos]
    )
    rq, rk = apply_rope(q, k, pos, cos, sin)
    assert torch.equal(rq, hq_out[0].transpose(0, 1))
    assert torch.equal(rk, hk_out[0].transpose(0, 1))


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    heads=st.sampled_from([(4, 1, 32), (8, 2, 64), (4, 4, 32), (6, 2, 16)]),
    bs=st.sampled_from([16, 32]),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_random_batches(data: st.DataObject, heads: tuple[int, int, int], bs: int, seed: int) -> None:
    hq, hkv, d = heads
    ctxs = data.draw(st.lists(st.integers(1, 4 * bs + 1), min_size=1, max_size=6))
    seqs = [(data.draw(st.integers(1, c)), c) for c in ctxs]
    case = make_case(seqs, hq, hkv, d, bs, seed=seed)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVMESH_KERNELS", "torch")
        got = paged_attention(case.q, case.kv_layer, case.block_tables, case.query_lens, case.context_lens, 0.3)
    torch.testing.assert_close(got, dense_attention(case, 0.3), atol=1e-5, rtol=1e-5)


def test_paged_attention_strided_q_and_write_kv_path() -> None:
    """q as a view of a fused qkv projection; K/V written by write_kv before attending."""
    hq, hkv, d, bs = 8, 2, 32, 16
    case = make_case([(1, 30), (12, 12), (5, 21)], hq, hkv, d, bs, seed=11)
    t = case.q.shape[0]
    g = torch.Generator().manual_seed(12)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    write_kv(case.kv_layer, k, v, case.slot_mapping)
    row = 0
    for i, (qlen, ctx) in enumerate(zip(case.query_lens.tolist(), case.context_lens.tolist(), strict=True)):
        case.keys[i][ctx - qlen :] = k[row : row + qlen]
        case.values[i][ctx - qlen :] = v[row : row + qlen]
        row += qlen
    case.q = q
    got = paged_attention(q, case.kv_layer, case.block_tables, case.query_lens, case.context_lens, 0.2)
    torch.testing.assert_close(got, dense_attention(case, 0.2), atol=1e-5, rtol=1e-5)


def test_paged_attention_rejects_query_lens_that_do_not_cover_q() -> None:
    case = make_case([(3, 20), (1, 5)], 4, 2, 16, 16)
    with pytest.raises(ValueError, match="sum to 3"):
        paged_attention(
            case.q, case.kv_layer, case.block_tables, torch.tensor([2, 1], dtype=torch.int32), case.context_lens, 0.25
        )


@pytest.mark.parametrize(("budget", "masks"), [(1, 10 + 1 + 6), (5000, 2 + 1 + 1), (1 << 25, 3)])
def test_suffix_over_a_prefix_in_row_slices_matches_dense(monkeypatch: pytest.MonkeyPatch, budget: int,
                                                          masks: int) -> None:
    """A suffix over a cached prefix attends in slices of query rows, so its score matrix stays within a
    budget: slices of the 3-row floor, two slices (the last ragged) and one slice all match the dense
    reference."""
    import kvmesh.kernels.paged_attention as pa

    monkeypatch.setattr(pa, "_SCORE_BUDGET", budget)
    monkeypatch.setattr(pa, "_MIN_ROWS", 3)
    hq, hkv, d, bs = 4, 2, 32, 16
    seqs = [(29, 61), (1, 40), (10, 10), (17, 33)]
    case = make_case(seqs, hq, hkv, d, bs, seed=11)
    scale = d**-0.5
    mask, scores = pa.causal_lower_right, []

    def counting(rows: int, keys: int):  # each mask stands for a [heads, rows, keys] score matrix
        scores.append(hq * rows * keys)
        return mask(rows, keys)

    monkeypatch.setattr(pa, "causal_lower_right", counting)
    got = paged_attention(case.q, case.kv_layer, case.block_tables, case.query_lens, case.context_lens, scale)
    torch.testing.assert_close(got, dense_attention(case, scale), atol=1e-5, rtol=1e-5)
    assert max(scores) <= max(budget, hq * 3 * 61)  # no call past the budget (or the row floor's)
    assert len(scores) == masks  # (29, 61) and (17, 33) in ceil(rows / slice) calls; (10, 10) one; decode none
