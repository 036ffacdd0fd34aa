"""The block format round-trips bit-exactly and turns every corruption into a counted reason."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvmesh.tiers.block_format import (
    DTYPES,
    BlockHeader,
    decode_block,
    encode_block,
    encode_kv_block,
    header_for,
)
from kvmesh.tiers.miss import BlockMiss, MissReason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_bit_exact(dtype: torch.dtype, make_chain, fp) -> None:
    for block in make_chain(3, dtype=dtype):
        enc = encode_kv_block(block, fp)
        got = decode_block(bytes(enc), fp, block.block_hash).to_kv_block()
        assert got.block_hash == block.block_hash and got.parent_hash == block.parent_hash
        assert got.token_ids == block.token_ids
        assert got.data.dtype == dtype and torch.equal(got.data.view(torch.uint8), block.data.view(torch.uint8))


def test_hnd_layout_round_trip(make_chain, fp) -> None:
    block = make_chain(1)[0]
    header = header_for(block, fp, layout="HND")
    enc = encode_block(header, block.data.transpose(2, 3).contiguous())
    stored = decode_block(enc, fp)
    assert stored.header.layout == "HND" and stored.data.shape == header.shape
    assert torch.equal(stored.to_kv_block().data, block.data)


def test_decode_is_zero_copy(make_chain, fp) -> None:
    enc = encode_kv_block(make_chain(1)[0], fp)
    stored = decode_block(enc, fp)
    base = torch.frombuffer(enc, dtype=torch.uint8).data_ptr()
    assert base <= stored.data.data_ptr() < base + len(enc)


def _miss(buf, fingerprint, block_hash=None) -> MissReason:
    with pytest.raises(BlockMiss) as info:
        decode_block(buf, fingerprint, block_hash)
    return info.value.reason


def test_corruptions_are_misses_with_reasons(make_chain, fp) -> None:
    block = make_chain(1)[0]
    enc = encode_kv_block(block, fp)
    for pos in (7, 200, len(enc) // 2, len(enc) - 1):  # header, tokens, payload, checksum
        flipped = bytearray(enc)
        flipped[pos] ^= 0x01
        assert _miss(flipped, fp) in (MissReason.CHECKSUM, MissReason.UNKNOWN_VERSION)
    payload_flip = bytearray(enc)
    payload_flip[len(enc) // 2] ^= 0x80
    assert _miss(payload_flip, fp) is MissReason.CHECKSUM
    assert _miss(enc[: len(enc) - 1], fp) is MissReason.TRUNCATED
    assert _miss(enc[:40], fp) is MissReason.TRUNCATED
    assert _miss(b"XXXX" + bytes(enc[4:]), fp) is MissReason.BAD_MAGIC
    future = bytearray(enc)
    future[4] = 9
    assert _miss(future, fp) is MissReason.UNKNOWN_VERSION
    assert _miss(enc, fingerprint="another-model") is MissReason.FINGERPRINT
    assert _miss(enc, fp, block_hash=bytes(32)) is MissReason.WRONG_BLOCK


def test_header_rejects_mismatched_tensor(make_chain, fp) -> None:
    block = make_chain(1)[0]
    header = header_for(block, fp)
    bad = BlockHeader(**{**{s: getattr(header, s) for s in header.__slots__}, "head_dim": 4})
    with pytest.raises(ValueError, match="does not match header"):
        encode_block(bad, block.data)


@settings(max_examples=60, deadline=None)
@given(layers=st.integers(1, 3), bs=st.sampled_from([1, 4, 16]), heads=st.integers(1, 3), dim=st.sampled_from([2, 8]),
       dtype=st.sampled_from(["float32", "bfloat16", "float16"]), layout=st.sampled_from(["NHD", "HND"]),
       data=st.data())
def test_any_single_byte_flip_is_never_served(layers, bs, heads, dim, dtype, layout, data) -> None:
    header = BlockHeader("fp-prop", bytes(range(32)), None, tuple(range(bs)), layers, heads, dim, bs, dtype, layout)
    tensor = torch.randn(header.shape).to(DTYPES[dtype])
    enc = encode_block(header, tensor)
    assert torch.equal(decode_block(bytes(enc), "fp-prop").data.view(torch.uint8), tensor.view(torch.uint8))
    pos = data.draw(st.integers(0, len(enc) - 1))
    enc[pos] ^= data.draw(st.integers(1, 255))
    with pytest.raises(BlockMiss):
        decode_block(bytes(enc), "fp-prop")
