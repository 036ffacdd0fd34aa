"""Quick checks of the torch paths against the dense references."""

from __future__ import annotations

import pytest
import torch
from paged_reference import dense_attention, dense_rope, make_case, rope_tables

from kernels.block_copy import gather_blocks, scatter_blocks
from kernels.kv_write import write_kv
from kernels.paged_attention import paged_attention
from kernels.rope import apply_rope


@pytest.fixture(autouse=True)
def _torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_KERNELS", "torch")


@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), [(4, 1, 32, 16), (8, 2, 64, 32), (4, 4, 32, 16)])
def test_paged_attention_matches_dense_mixed_batch(hq: int, hkv: int, d: int, bs: int) -> None:
    seqs = [(1, 1), (5, 5), (1, bs), (1, bs + 1), (7, 2 * bs + 3), (bs, 3 * bs), (1, 37), (3, bs + 1)]
    case = make_case(seqs, hq, hkv, d, bs, seed=hq + d)
    scale = d**-0.5
    got = paged_attention(case.q, case.kv_layer, case.block_tables, case.query_lens, case.context_lens, scale)
    torch.testing.assert_close(got, dense_attention(case, scale), atol=1e-5, rtol=1e-5)


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
