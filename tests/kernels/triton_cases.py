"""Every Triton kernel against the torch path and the dense reference, on CPU.

The kernels run in the Triton interpreter. ``TRITON_INTERPRET=1`` must be set
before triton.language is first imported (its own helpers such as tl.zeros
are decorated then), and torch imports triton early (torch.nn.attention.bias
does), so test_triton_kernels.py runs this module in a fresh interpreter with
the variable set; run alone it sets the variable itself. Shapes stay small:
the interpreter is slow.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from kvmesh.engine.forward_batch import ForwardBatch  # noqa: E402
from kvmesh.engine.loader import load_model  # noqa: E402
from kvmesh.engine.presets import write_preset  # noqa: E402
from kvmesh.kernels.block_copy import gather_blocks, scatter_blocks  # noqa: E402
from kvmesh.kernels.dispatch import ENV_VAR, use_triton  # noqa: E402
from kvmesh.kernels.kv_write import write_kv  # noqa: E402
from kvmesh.kernels.paged_attention import paged_attention  # noqa: E402
from kvmesh.kernels.rope import apply_rope  # noqa: E402
from paged_reference import dense_attention, dense_rope, make_case, rope_tables  # noqa: E402

# (Hq, Hkv, D, block_size): GQA 4:1 and 4:2, MHA, a group of 3 with a non power-of-two
# head_dim, and the tiny preset's head_dim 16.
HEADS = [(4, 1, 32, 16), (8, 2, 64, 32), (4, 4, 32, 16), (6, 2, 48, 16), (4, 2, 16, 16)]


def _both(monkeypatch: pytest.MonkeyPatch, fn, *args):
    """(triton result, torch result) of one public op."""
    monkeypatch.setenv(ENV_VAR, "triton")
    tri = fn(*args)
    monkeypatch.setenv(ENV_VAR, "torch")
    return tri, fn(*args)


def _attention(case, scale: float):
    return (paged_attention, case.q, case.kv_layer, case.block_tables, case.query_lens, case.context_lens, scale)


def test_interpreter_is_active(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmesh.kernels.triton import paged_attention as module
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(module._paged_attention_kernel, InterpretedFunction)
    cpu = torch.zeros(1)
    monkeypatch.setenv(ENV_VAR, "triton")
    assert use_triton(cpu)
    monkeypatch.setenv(ENV_VAR, "torch")
    assert not use_triton(cpu)
    monkeypatch.delenv(ENV_VAR)
    assert not use_triton(cpu)  # auto: Triton only for CUDA tensors
    monkeypatch.setenv(ENV_VAR, "tritn")
    with pytest.raises(ValueError, match="KVMESH_KERNELS"):
        use_triton(cpu)


# plus consecutive tables, and block sizes that are not 16/32 (a key tile spans several blocks)
MIXED = [(*h, False) for h in HEADS] + [(*HEADS[1], True), (4, 2, 32, 8, False), (4, 2, 32, 24, False)]


@pytest.mark.parametrize(("hq", "hkv", "d", "bs", "consecutive"), MIXED)
def test_paged_attention_mixed_batch(
    monkeypatch: pytest.MonkeyPatch, hq: int, hkv: int, d: int, bs: int, consecutive: bool
) -> None:
    # decode at 1 / on / just past a block boundary, prefill without and with a prefix, chunked prefill
    seqs = [(1, 1), (5, 5), (1, bs), (1, bs + 1), (7, 2 * bs + 3), (bs, 3 * bs), (bs + 1, bs + 1), (3, bs + 1)]
    case = make_case(seqs, hq, hkv, d, bs, seed=d + hq, consecutive=consecutive)
    scale = d**-0.5
    tri, ref_torch = _both(monkeypatch, *_attention(case, scale))
    torch.testing.assert_close(tri, dense_attention(case, scale), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tri, ref_torch, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("hq", "hkv", "d", "bs"), HEADS[:2])
def test_paged_attention_decode_only(monkeypatch: pytest.MonkeyPatch, hq: int, hkv: int, d: int, bs: int) -> None:
    case = make_case([(1, n) for n in (1, 2, bs - 1, bs, bs + 1, 3 * bs, 50)], hq, hkv, d, bs, seed=3)
    tri, ref_torch = _both(monkeypatch, *_attention(case, 0.1))
    torch.testing.assert_close(tri, dense_attention(case, 0.1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tri, ref_torch, atol=1e-5, rtol=1e-5)


def test_paged_attention_half_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    case = make_case([(9, 40), (1, 17), (20, 20)], 8, 2, 32, 16, seed=5, dtype=torch.float16)
    monkeypatch.setenv(ENV_VAR, "triton")
    tri = paged_attention(*_attention(case, 32**-0.5)[1:])
    assert tri.dtype == torch.float16
    torch.testing.assert_close(tri, dense_attention(case, 32**-0.5), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("prefix", [0, 1, 16, 17, 40])
def test_triton_cache_transparency(monkeypatch: pytest.MonkeyPatch, prefix: int) -> None:
    """A token's output is the same whether its prefix is cached or computed in the call."""
    monkeypatch.setenv(ENV_VAR, "triton")
    ctx = 48
    full = make_case([(ctx, ctx)], 8, 2, 32, 16, seed=7)
    args = (full.kv_layer, full.block_tables)
    ref = paged_attention(full.q, *args, full.query_lens, full.context_lens, 0.2)[prefix:]
    qlen = torch.tensor([ctx - prefix], dtype=torch.int32)
    split = paged_attention(full.q[prefix:], *args, qlen, full.context_lens, 0.2)
    torch.testing.assert_close(split, ref, atol=2e-6, rtol=0)


@settings(max_examples=8, deadline=None)
@given(
    data=st.data(),
    heads=st.sampled_from(HEADS),
    seed=st.integers(0, 2**16),
)
def test_paged_attention_random_batches(data: st.DataObject, heads: tuple[int, int, int, int], seed: int) -> None:
    hq, hkv, d, bs = heads
    ctxs = data.draw(st.lists(st.integers(1, 3 * bs + 2), min_size=1, max_size=4))
    seqs = [(data.draw(st.integers(1, min(c, bs + 3))), c) for c in ctxs]
    case = make_case(seqs, hq, hkv, d, bs, seed=seed)
    with pytest.MonkeyPatch.context() as mp:
        tri, ref_torch = _both(mp, *_attention(case, d**-0.5))
    torch.testing.assert_close(tri, dense_attention(case, d**-0.5), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tri, ref_torch, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("t", "hq", "hkv", "d"), [(7, 4, 1, 32), (5, 8, 2, 64), (1, 2, 2, 32), (3, 3, 1, 48), (4, 4, 2, 16)]
)
def test_rope(monkeypatch: pytest.MonkeyPatch, t: int, hq: int, hkv: int, d: int) -> None:
    cos, sin = rope_tables(300, d)
    g = torch.Generator().manual_seed(t)
    q, k = torch.randn(t, hq, d, generator=g), torch.randn(t, hkv, d, generator=g)
    pos = torch.randint(0, 300, (t,), generator=g)
    (tq, tk), (rq, rk) = _both(monkeypatch, apply_rope, q, k, pos, cos, sin)
    torch.testing.assert_close(tq, dense_rope(q, pos, cos, sin), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(tk, dense_rope(k, pos, cos, sin), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close((tq, tk), (rq, rk), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("hkv", "d", "bs", "dtype"),
    [(1, 32, 16, torch.float32), (2, 64, 32, torch.float32), (3, 48, 16, torch.float32), (2, 16, 16, torch.float16)],
)
def test_write_kv(monkeypatch: pytest.MonkeyPatch, hkv: int, d: int, bs: int, dtype: torch.dtype) -> None:
    """fp32 k/v into the cache's dtype, at shuffled slots, leaving every other slot alone."""
    g = torch.Generator().manual_seed(hkv)
    cache = torch.randn(2, 2, 5, bs, hkv, d, generator=g).to(dtype)
    t = 2 * bs + 1
    k, v = torch.randn(t, hkv, d, generator=g), torch.randn(t, hkv, d, generator=g)
    slots = torch.randperm(5 * bs, generator=g)[:t]
    expected = cache.clone()
    monkeypatch.setenv(ENV_VAR, "torch")
    write_kv(expected[1], k, v, slots)
    monkeypatch.setenv(ENV_VAR, "triton")
    write_kv(cache[1], k, v, slots)
    assert torch.equal(cache, expected)  # layer 0 and untouched slots included
    assert torch.equal(cache[1, 0].view(-1, hkv, d)[slots], k.to(dtype))


@pytest.mark.parametrize(("hkv", "d", "bs"), [(2, 32, 16), (1, 64, 32)])
def test_gather_scatter_blocks(monkeypatch: pytest.MonkeyPatch, hkv: int, d: int, bs: int) -> None:
    g = torch.Generator().manual_seed(d)
    cache = torch.randn(3, 2, 7, bs, hkv, d, generator=g)
    ids = torch.tensor([5, 0, 3], dtype=torch.int32)
    tri, ref_torch = _both(monkeypatch, gather_blocks, cache, ids)
    assert tri.shape == (3, 3, 2, bs, hkv, d) and tri.is_contiguous()
    assert torch.equal(tri, ref_torch) and torch.equal(tri[0], cache[:, :, 5])
    dst_ids = torch.tensor([6, 1, 2])
    expected = torch.randn(3, 2, 7, bs, hkv, d, generator=g)
    target = expected.clone()
    monkeypatch.setenv(ENV_VAR, "torch")
    scatter_blocks(expected, dst_ids, tri)
    monkeypatch.setenv(ENV_VAR, "triton")
    scatter_blocks(target, dst_ids, tri)
    assert torch.equal(target, expected)
    assert torch.equal(target[:, :, 6], cache[:, :, 5])
    monkeypatch.setenv(ENV_VAR, "triton")
    none = gather_blocks(cache, torch.tensor([], dtype=torch.int64))
    assert none.shape == (0, 3, 2, bs, hkv, d)
    scatter_blocks(target, torch.tensor([], dtype=torch.int64), none)
    assert torch.equal(target, expected)


def test_paged_attention_strided_q(monkeypatch: pytest.MonkeyPatch) -> None:
    """q as a view into a fused qkv projection gives the same output as a contiguous q."""
    monkeypatch.setenv(ENV_VAR, "triton")
    case = make_case([(1, 30), (6, 21)], 4, 1, 32, 16, seed=13)
    t = case.q.shape[0]
    fused = torch.cat((case.q.view(t, -1), torch.randn(t, 64)), dim=1)
    strided = fused[:, : 4 * 32].view(t, 4, 32)
    assert not strided.is_contiguous()
    args = (case.kv_layer, case.block_tables, case.query_lens, case.context_lens, 0.2)
    assert torch.equal(paged_attention(strided, *args), paged_attention(case.q, *args))


def _step(seqs: list[tuple[torch.Tensor, int, list[int]]], bs: int) -> ForwardBatch:
    """A varlen ForwardBatch: per sequence (new token ids, tokens already cached, block ids)."""
    ids, pos, slots, qlens, ctxs = [], [], [], [], []
    width = max(len(table) for _, _, table in seqs)
    tables = torch.zeros(len(seqs), width, dtype=torch.int32)
    for i, (new, cached, table) in enumerate(seqs):
        p = torch.arange(cached, cached + new.shape[0])
        tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        ids.append(new)
        pos.append(p)
        slots.append(tables[i].long()[p // bs] * bs + p % bs)
        qlens.append(new.shape[0])
        ctxs.append(cached + new.shape[0])
    qlen_t = torch.tensor(qlens, dtype=torch.int32)
    return ForwardBatch(
        input_ids=torch.cat(ids),
        positions=torch.cat(pos),
        query_lens=qlen_t,
        context_lens=torch.tensor(ctxs, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.cat(slots),
        logits_indices=torch.cumsum(qlen_t, 0).long() - 1,
    )


def test_tiny_model_forward_triton_matches_torch(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    """The whole model chain (rope, kv write, attention) on the tiny preset: two steps, both paths."""
    model = load_model(write_preset(tmp_path / "tiny", "tiny", "llama"))
    cfg, bs = model.config, 16
    g = torch.Generator().manual_seed(0)
    tok = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=g)  # noqa: E731
    a, b, c, d = tok(37), tok(25), tok(17), tok(9)
    tables = {"a": [9, 2, 14], "b": [5, 11], "c": [0, 7], "d": [12]}
    first = _step([(a, 0, tables["a"]), (b[:20], 0, tables["b"]), (c[:16], 0, tables["c"])], bs)
    # prefill over a cached prefix, decode just past a block boundary, and a fresh prefill, in one step
    second = _step([(b[20:], 20, tables["b"]), (c[16:], 16, tables["c"]), (d, 0, tables["d"])], bs)
    results = {}
    for path in ("torch", "triton"):
        monkeypatch.setenv(ENV_VAR, path)
        kv = torch.zeros(cfg.num_layers, 2, 16, bs, cfg.num_kv_heads, cfg.head_dim)
        results[path] = (model.model(first, kv), model.model(second, kv), kv)
    for got, want in zip(results["triton"], results["torch"], strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
