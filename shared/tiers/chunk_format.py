"""An L3 object: several consecutive encoded blocks and a table of contents.

    magic "KVMC" | version u16 | count u16 | toc: count x (hash 32s, offset u64, size u64)
    | xxh3-128 of everything before it | block 0 | block 1 | ...

Offsets are from the start of the object, so one block is one ranged GET once
its offset is known (from a handle, or from the TOC read first). Each block
keeps its own checksum; the TOC has one too.
"""

from __future__ import annotations

import struct

import xxhash
from kvmesh.tiers.block_format import decode_header
from kvmesh.tiers.miss import BlockMiss, MissReason

CHUNK_MAGIC = b"KVMC"
CHUNK_VERSION = 1
_HEAD = struct.Struct("<4sHH")
_ENTRY = struct.Struct("<32sQQ")
_SUM = 16
Entry = tuple[bytes, int, int]  # block hash, offset in the object, encoded size


def toc_size(count: int) -> int:
    return _HEAD.size + count * _ENTRY.size + _SUM


def chunk_entries(blocks: list) -> list[Entry]:
    """The TOC entries a chunk of these blocks has, each block verified first; no copy."""
    if not 0 < len(blocks) < 2**16:
        raise ValueError(f"a chunk holds 1..65535 blocks, got {len(blocks)}")
    entries: list[Entry] = []
    offset = toc_size(len(blocks))
    for buf in blocks:
        header, _, total = decode_header(buf)
        entries.append((header.block_hash, offset, total))
        offset += total
    return entries


def encode_chunk(blocks: list, entries: list[Entry] | None = None) -> tuple[bytes, list[Entry]]:
    """The object bytes and its TOC entries; `entries` from `chunk_entries` of the same blocks, if known."""
    entries = chunk_entries(blocks) if entries is None else entries
    head = bytearray(_HEAD.pack(CHUNK_MAGIC, CHUNK_VERSION, len(blocks)))
    for entry in entries:
        head += _ENTRY.pack(*entry)
    head += xxhash.xxh3_128_digest(head)
    return b"".join([bytes(head), *(memoryview(b)[:size] for b, (_, _, size) in zip(blocks, entries))]), entries


def decode_toc(buf) -> list[Entry]:
    """Entries of a chunk's TOC; `buf` needs at least the TOC bytes. Raises BlockMiss."""
    mv = memoryview(buf)
    if len(mv) < _HEAD.size or bytes(mv[:4]) != CHUNK_MAGIC:
        raise BlockMiss(MissReason.BAD_MAGIC, "not a kvmesh chunk")
    _, version, count = _HEAD.unpack_from(mv, 0)
    if version != CHUNK_VERSION:
        raise BlockMiss(MissReason.UNKNOWN_VERSION, f"chunk version {version}")
    end = toc_size(count) - _SUM
    if len(mv) < end + _SUM:
        raise BlockMiss(MissReason.TRUNCATED, "chunk table of contents")
    if xxhash.xxh3_128_digest(mv[:end]) != mv[end:end + _SUM]:
        raise BlockMiss(MissReason.CHECKSUM, "chunk table of contents")
    return [_ENTRY.unpack_from(mv, _HEAD.size + i * _ENTRY.size) for i in range(count)]
