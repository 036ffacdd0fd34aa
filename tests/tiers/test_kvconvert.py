"""kvconvert: lossless round trips where the dtype allows, documented tolerance where not, named errors."""

from __future__ import annotations

import pytest
import torch
from kvmesh.kvconvert.errors import IncompatibleKV
from kvmesh.kvconvert.safetensors_io import export_safetensors, import_safetensors
from kvmesh.kvconvert.transform import (
    DTYPE_TOLERANCE,
    convert_dtype,
    convert_layout,
    rechunk,
)
from kvmesh.protocol.block_hash import HashKeys, hash_blocks
from kvmesh.tiers.block_format import (
    StoredBlock,
    decode_block,
    encode_block,
    header_for,
)


def _chain(keys: HashKeys, n_tokens: int, block_size: int, seed: int = 0) -> tuple[list[int], list[StoredBlock]]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1000, (n_tokens,), generator=gen).tolist()
    hashes = hash_blocks(tokens, block_size, keys)
    data = torch.randn(2, 2, len(hashes) * block_size, 2, 8, generator=gen)
    out, parent = [], None
    from kvmesh.engine.kv_block import KVBlock

    for i, h in enumerate(hashes):
        kb = KVBlock(h, parent, tuple(tokens[i * block_size:(i + 1) * block_size]),
                     data[:, :, i * block_size:(i + 1) * block_size].contiguous())
        out.append(StoredBlock(header_for(kb, keys.fingerprint), kb.data))
        parent = h
    return tokens, out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


KEYS = HashKeys("fp-convert", b"tenant-salt")


def test_layout_round_trip_is_lossless_and_survives_the_block_format() -> None:
    _, blocks = _chain(KEYS, 48, 16)
    for b in blocks:
        hnd = convert_layout(b, "HND")
        assert hnd.data.shape == (2, 2, 2, 16, 8) and hnd.header.layout == "HND"
        again = decode_block(encode_block(hnd.header, hnd.data), "fp-convert")
        back = convert_layout(again, "NHD")
        assert torch.equal(_bits(back.data), _bits(b.data)) and back.header == b.header


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dtype_round_trips(dtype: str) -> None:
    _, blocks = _chain(KEYS, 32, 16)
    for b in blocks:
        low = convert_dtype(b, dtype)
        back = convert_dtype(low, "float32")
        err = (back.data - b.data).abs()
        assert float((err - DTYPE_TOLERANCE[dtype] * b.data.abs()).max()) <= 1e-12  # fp32 -> low is lossy
        assert torch.equal(_bits(convert_dtype(back, dtype).data), _bits(low.data))  # low -> fp32 -> low is exact


def test_rechunk_merge_and_split_recompute_chained_hashes() -> None:
    tokens, small = _chain(KEYS, 16 * 40, 16)
    merged = rechunk(small, 256, KEYS)
    assert merged.dropped_tokens == 16 * 40 - 512 and len(merged.blocks) == 2
    assert [b.header.block_hash for b in merged.blocks] == hash_blocks(tokens, 256, KEYS)
    assert merged.blocks[1].header.parent_hash == merged.blocks[0].header.block_hash
    split = rechunk(merged.blocks, 16, KEYS)
    assert [b.header.block_hash for b in split.blocks] == [b.header.block_hash for b in small[:32]]
    for a, b in zip(split.blocks, small):
        assert torch.equal(_bits(a.data), _bits(b.data)) and a.header == b.header
    hnd = [convert_layout(b, "HND") for b in small[:32]]  # re-chunking works in either layout
    assert torch.equal(convert_layout(rechunk(hnd, 256, KEYS).blocks[0], "NHD").data, merged.blocks[0].data)


def test_rechunk_errors_name_the_problem() -> None:
    _, blocks = _chain(KEYS, 64, 16)
    with pytest.raises(IncompatibleKV, match="cannot re-chunk 16 -> 24: not a multiple"):
        rechunk(blocks, 24, KEYS)
    with pytest.raises(IncompatibleKV, match="wrong tenant salt"):
        rechunk(blocks, 32, HashKeys("fp-convert", b"other-tenant"))
    with pytest.raises(IncompatibleKV, match="fingerprint mismatch"):
        rechunk(blocks, 32, HashKeys("fp-other"))
    with pytest.raises(IncompatibleKV, match="starts mid-prompt"):
        rechunk(blocks[1:], 32, KEYS)


def test_safetensors_round_trip_and_fingerprint_check(tmp_path) -> None:
    _, a = _chain(KEYS, 48, 16, seed=1)
    _, b = _chain(KEYS, 32, 16, seed=2)
    blocks = [convert_dtype(x, "bfloat16") for x in a + b]
    path = tmp_path / "kv.safetensors"
    export_safetensors(blocks, path)
    got = import_safetensors(path, fingerprint="fp-convert")
    assert len(got) == 5
    for x, y in zip(got, blocks):
        assert x.header == y.header and torch.equal(_bits(x.data), _bits(y.data))
    with pytest.raises(IncompatibleKV, match=r"fingerprint mismatch: file fp-convert.. vs target c3d4"):
        import_safetensors(path, fingerprint="c3d4e5f6")
    with pytest.raises(IncompatibleKV, match="blocks differ in dtype"):
        export_safetensors([a[0], blocks[1]], tmp_path / "mixed.safetensors")
