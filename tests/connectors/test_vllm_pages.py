"""vLLM CPU page packing <-> kvmesh NHD blocks, and the connector's names for a tenant and a model (no vLLM here)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.kvconvert.errors import IncompatibleKV
from kvmesh.kvconvert.vllm_cpu import blocks_to_pages, check_packing, pages_to_blocks
from kvmesh.protocol.block_hash import HashKeys, hash_blocks
from kvmesh.protocol.vllm_identity import chain_hashes, model_fingerprint, tenant_salt_hex


def test_a_page_holds_k_transposed_then_v_row_major() -> None:
    """One layer, one block, one head, 2 tokens of dim 3, written out by hand in the "vec" packing."""
    k = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])  # [N=2, D=3]
    v = torch.tensor([[7.0, 8.0, 9.0], [10.0, 11.0, 12.0]])
    page = torch.tensor([1.0, 4.0, 2.0, 5.0, 3.0, 6.0,  # K as [D, N]
                         7.0, 8.0, 9.0, 10.0, 11.0, 12.0]).view(1, 1, 2, 6)  # V as [N, D]; the page [1, H, N, 2D]
    blocks = pages_to_blocks([page])
    assert blocks.shape == (1, 1, 2, 2, 1, 3)  # [n, L, 2, N, H, D]
    assert torch.equal(blocks[0, 0, 0, :, 0], k) and torch.equal(blocks[0, 0, 1, :, 0], v)
    assert torch.equal(blocks_to_pages(blocks)[0], page)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 3), layers=st.integers(1, 3), heads=st.integers(1, 3), size=st.sampled_from([1, 4, 8]),
       dim=st.sampled_from([2, 4]), dtype=st.sampled_from([torch.float32, torch.bfloat16]))
def test_round_trip_is_exact(n: int, layers: int, heads: int, size: int, dim: int, dtype: torch.dtype) -> None:
    pages = [torch.randn(n, heads, size, 2 * dim).to(dtype) for _ in range(layers)]
    back = blocks_to_pages(pages_to_blocks(pages))
    assert all(torch.equal(a, b) for a, b in zip(pages, back, strict=True))


def test_unchecked_packings_are_refused() -> None:
    check_packing("vec")
    for isa in ("vec16", "amx", "neon"):
        with pytest.raises(IncompatibleKV, match=isa):
            check_packing(isa)


def test_tenant_salts() -> None:
    assert tenant_salt_hex(None) == tenant_salt_hex("") == ""
    assert tenant_salt_hex("ABCDEF0123") == "abcdef0123"  # kvmesh's own salts (hex) pass as they are
    a, b = tenant_salt_hex("tenant-a"), tenant_salt_hex("tenant-b")
    assert a != b and len(a) == 32 and a == tenant_salt_hex("tenant-a")
    tokens = list(range(64))
    assert chain_hashes(tokens, 16, "fp", a) != chain_hashes(tokens, 16, "fp", b)
    assert chain_hashes(tokens, 16, "fp", a) == hash_blocks(tokens, 16, HashKeys("fp", bytes.fromhex(a)))
    whole = chain_hashes(tokens, 16, "fp", a)
    assert whole[:2] + chain_hashes(tokens[32:], 16, "fp", a, parent=whole[1]) == whole


def test_fingerprint_covers_weights_dtype_and_config(tmp_path) -> None:
    with pytest.raises(ValueError, match="local checkpoint dir"):
        model_fingerprint(tmp_path / "HuggingFaceTB/SmolLM2-135M-Instruct", "float32")  # a hub id, not a dir
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    base = model_fingerprint(tmp_path, "float32")
    assert model_fingerprint(tmp_path, "bfloat16") != base
    (tmp_path / "model.safetensors").write_bytes(b"weightz")
    changed = model_fingerprint(tmp_path, "float32")
    (tmp_path / "config.json").write_text('{"hidden_size": 9}')
    assert len({base, changed, model_fingerprint(tmp_path, "float32")}) == 3
