"""The versioned binary form of one KV block: what L2, peers and L3 store.

    fixed header (struct _FIXED) | fingerprint utf-8 | token ids u32 | pad to 64
    | payload: raw tensor bytes, C order, in the header's layout | xxh3-128 (16 bytes)

The checksum covers everything before it. `decode_block` verifies magic,
version, length, checksum and the model fingerprint, in that order, and raises
`BlockMiss` with the reason; it never returns data that failed a check. The
decoded tensor is a zero-copy view of the input buffer: treat it as read-only
(importers copy it into their own pool).
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import xxhash
from kvmesh.engine.kv_block import KVBlock
from kvmesh.protocol.blocks import Tier
from kvmesh.tiers.miss import BlockMiss, Miss, MissCounters, MissReason

MAGIC = b"KVMB"
FORMAT_VERSION = 1
CHECKSUM_BYTES = 16
_ALIGN = 64
# magic, version, dtype, layout, layers, kv heads, head dim, block size,
# has parent, fingerprint length, block hash, parent hash, payload length
_FIXED = struct.Struct("<4sHBBHHHIBB32s32sQ")

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DTYPE_CODE = {name: i + 1 for i, name in enumerate(DTYPES)}
_CODE_DTYPE = {code: name for name, code in _DTYPE_CODE.items()}
LAYOUTS = ("NHD", "HND")  # within a block: [L, 2, block_size, heads, dim] vs [L, 2, heads, block_size, dim]


@dataclass(slots=True, frozen=True)
class BlockHeader:
    fingerprint: str
    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # a key of DTYPES
    layout: str  # "NHD" or "HND"

    @property
    def shape(self) -> tuple[int, ...]:
        if self.layout == "NHD":
            return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def payload_bytes(self) -> int:
        n = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        return n * DTYPES[self.dtype].itemsize


@dataclass(slots=True)
class StoredBlock:
    """A verified block: its header and its tensor (in the header's layout and dtype)."""

    header: BlockHeader
    data: torch.Tensor

    def to_kv_block(self) -> KVBlock:
        """The engine's view: NHD. HND data is permuted (a copy); NHD stays a view."""
        data = self.data if self.header.layout == "NHD" else self.data.transpose(2, 3).contiguous()
        return KVBlock(self.header.block_hash, self.header.parent_hash, self.header.token_ids, data)


def header_for(block: KVBlock, fingerprint: str, layout: str = "NHD") -> BlockHeader:
    """The header of an engine block (whose data is NHD) stored in `layout`."""
    num_layers, _, block_size, heads, dim = block.data.shape
    dtype = next((k for k, v in DTYPES.items() if v == block.data.dtype), None)
    if dtype is None:
        raise ValueError(f"unsupported KV dtype {block.data.dtype}; supported: {', '.join(DTYPES)}")
    if len(block.token_ids) != block_size:
        raise ValueError(f"block has {len(block.token_ids)} token ids for block size {block_size}")
    return BlockHeader(fingerprint, block.block_hash, block.parent_hash, tuple(block.token_ids),
                       num_layers, heads, dim, block_size, dtype, layout)


def encode_kv_block(block: KVBlock, fingerprint: str) -> bytearray:
    """Serialize an engine block as stored NHD."""
    return encode_block(header_for(block, fingerprint), block.data)


def encoded_size(header: BlockHeader) -> int:
    """The bytes `header`'s block takes encoded: header, payload, checksum."""
    return _payload_offset(len(header.fingerprint.encode()), header.block_size) + header.payload_bytes + CHECKSUM_BYTES


def encode_block(header: BlockHeader, data: torch.Tensor) -> bytearray:
    """Header + payload + checksum in one buffer; the payload is copied exactly once."""
    out = bytearray(encoded_size(header))
    encode_block_into(header, data, memoryview(out))
    return out


def encode_block_into(header: BlockHeader, data: torch.Tensor, out: memoryview) -> bytes:
    """Write the encoded block into `out` (`encoded_size(header)` bytes, e.g. an L2 arena's space: the
    payload is copied once, straight there); returns its checksum."""
    if tuple(data.shape) != header.shape or data.dtype != DTYPES[header.dtype]:
        raise ValueError(f"tensor {tuple(data.shape)} {data.dtype} does not match header {header.shape} {header.dtype}")
    if len(header.block_hash) != 32 or (header.parent_hash is not None and len(header.parent_hash) != 32):
        raise ValueError("block and parent hashes must be 32 bytes")
    fp = header.fingerprint.encode()
    if len(fp) > 255:
        raise ValueError("fingerprint longer than 255 bytes")
    head_len = _payload_offset(len(fp), header.block_size)
    total = head_len + header.payload_bytes + CHECKSUM_BYTES
    if len(out) != total:
        raise ValueError(f"{len(out)} bytes given for a {total}-byte block")
    _FIXED.pack_into(out, 0, MAGIC, FORMAT_VERSION, _DTYPE_CODE[header.dtype], LAYOUTS.index(header.layout),
                     header.num_layers, header.num_kv_heads, header.head_dim, header.block_size,
                     header.parent_hash is not None, len(fp), header.block_hash,
                     header.parent_hash or bytes(32), header.payload_bytes)
    pos = _FIXED.size
    out[pos:pos + len(fp)] = fp
    pos += len(fp)
    out[pos:head_len] = bytes(head_len - pos)  # token ids, then zero padding (an arena's space is not cleared)
    out[pos:pos + 4 * header.block_size] = np.asarray(header.token_ids, dtype="<u4").tobytes()
    # One copy, straight from `data` (a strided view of a pool is fine) into `out`.
    dst = torch.frombuffer(out, dtype=torch.uint8, count=header.payload_bytes, offset=head_len)
    dst.view(data.dtype).view(data.shape).copy_(data.detach())
    digest = xxhash.xxh3_128_digest(out[:total - CHECKSUM_BYTES])
    out[total - CHECKSUM_BYTES:] = digest
    return digest


def checksum_of(buf) -> bytes:
    """The stored checksum of an encoded block (its last 16 bytes), without verifying."""
    return bytes(memoryview(buf)[-CHECKSUM_BYTES:])


def decode_header(buf) -> tuple[BlockHeader, int, int]:
    """Parse and verify the header and checksum: (header, payload offset, total length)."""
    mv = memoryview(buf)
    if mv.format != "B":
        mv = mv.cast("B")
    if len(mv) < 4 or bytes(mv[:4]) != MAGIC:
        raise BlockMiss(MissReason.BAD_MAGIC)
    if len(mv) < _FIXED.size:
        raise BlockMiss(MissReason.TRUNCATED, f"{len(mv)} bytes, header needs {_FIXED.size}")
    (_, version, dcode, lcode, layers, heads, dim, bsize, has_parent, fp_len,
     bhash, phash, payload_len) = _FIXED.unpack_from(mv, 0)
    if version != FORMAT_VERSION:
        raise BlockMiss(MissReason.UNKNOWN_VERSION, f"version {version}, this build reads {FORMAT_VERSION}")
    offset = _payload_offset(fp_len, bsize)
    total = offset + payload_len + CHECKSUM_BYTES
    if len(mv) < total:
        raise BlockMiss(MissReason.TRUNCATED, f"{len(mv)} of {total} bytes")
    if xxhash.xxh3_128_digest(mv[:total - CHECKSUM_BYTES]) != mv[total - CHECKSUM_BYTES:total]:
        raise BlockMiss(MissReason.CHECKSUM)
    if dcode not in _CODE_DTYPE or lcode >= len(LAYOUTS):
        raise BlockMiss(MissReason.UNKNOWN_VERSION, f"dtype code {dcode}, layout code {lcode}")
    pos = _FIXED.size
    fingerprint = bytes(mv[pos:pos + fp_len]).decode()
    pos += fp_len
    tokens = tuple(np.frombuffer(mv, dtype="<u4", count=bsize, offset=pos).tolist())
    header = BlockHeader(fingerprint, bytes(bhash), bytes(phash) if has_parent else None, tokens,
                         layers, heads, dim, bsize, _CODE_DTYPE[dcode], LAYOUTS[lcode])
    if header.payload_bytes != payload_len:
        raise BlockMiss(MissReason.TRUNCATED, f"payload {payload_len} bytes, shape needs {header.payload_bytes}")
    return header, offset, total


def decode_block(buf, fingerprint: str | None, block_hash: bytes | None = None) -> StoredBlock:
    """Verify and view one encoded block; raises BlockMiss on any failed check.

    `fingerprint` None skips the model check (conversion tools); `block_hash`
    set also checks that the bytes are the block that was asked for.
    """
    header, offset, total = decode_header(buf)
    if fingerprint is not None and header.fingerprint != fingerprint:
        raise BlockMiss(MissReason.FINGERPRINT,
                        f"block {header.fingerprint[:12]}.. vs expected {fingerprint[:12]}..")
    if block_hash is not None and header.block_hash != block_hash:
        raise BlockMiss(MissReason.WRONG_BLOCK, f"got {header.block_hash.hex()[:12]}..")
    dtype = DTYPES[header.dtype]
    count = header.payload_bytes // dtype.itemsize
    mv = memoryview(buf)
    if mv.readonly:  # immutable bytes: the view is read-only by contract (see module doc)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(mv, dtype=dtype, count=count, offset=offset)
    else:
        data = torch.frombuffer(mv, dtype=dtype, count=count, offset=offset)
    return StoredBlock(header, data.view(header.shape))


def decode_or_miss(buf, fingerprint: str, block_hash: bytes, tier: Tier, counters: MissCounters) -> StoredBlock | Miss:
    """`decode_block` for a tier's read path: a failed check becomes a counted miss."""
    try:
        return decode_block(buf, fingerprint, block_hash)
    except BlockMiss as miss:
        return counters.record(Miss(tier, miss.reason, miss.detail))


def _payload_offset(fp_len: int, block_size: int) -> int:
    raw = _FIXED.size + fp_len + 4 * block_size
    return (raw + _ALIGN - 1) // _ALIGN * _ALIGN
