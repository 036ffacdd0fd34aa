"""The batch peer-fetch wire format: one request names many blocks; replies carry pieces of them.

    request   u16 version | u16 flags (0) | u32 window bytes | n x 32-byte block hash
    reply     one message or more, each a run of pieces:
              u32 index in the request | u32 block bytes (0 = not here) | u32 offset | u32 length | bytes
    credit    u64 bytes of reply received | u8 flags (1 = cancel) | the transfer's reply subject, utf-8

Blocks go out in request order. A block that fits in one message is never
split (the sender starts a new message instead), so the receiver decodes it
from the message's own bytes, no copy; a bigger one is split and assembled
into one buffer allocated at its first piece. `BlockAssembly` checks every
piece against the request (index, bounds, one size per block) and raises
`ValueError` on a piece that does not fit; the block bytes themselves are
verified later by the block format's checksum.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator, Sequence

VERSION = 1
HASH_BYTES = 32
CANCEL = 1
_REQUEST = struct.Struct("<HHI")
_PIECE = struct.Struct("<IIII")
_CREDIT = struct.Struct("<QB")
_MIN_PIECE = 64 * 1024  # a split block's first piece, at most: smaller room starts the next message instead


def max_hashes(max_payload: int) -> int:
    """How many hashes one request may name under the server's `max_payload`."""
    return (max_payload - _REQUEST.size) // HASH_BYTES


def encode_request(hashes: Sequence[bytes], window_bytes: int) -> bytes:
    for h in hashes:
        if len(h) != HASH_BYTES:
            raise ValueError(f"block hashes are {HASH_BYTES} bytes, got {len(h)}")
    return _REQUEST.pack(VERSION, 0, min(window_bytes, 0xFFFFFFFF)) + b"".join(hashes)


def decode_request(data) -> tuple[list[bytes], int]:
    """(hashes, window bytes); ValueError on another version or a ragged hash list."""
    mv = memoryview(data)
    if len(mv) < _REQUEST.size:
        raise ValueError("short request")
    version, _, window = _REQUEST.unpack_from(mv, 0)
    body = mv[_REQUEST.size:]
    if version != VERSION or len(body) % HASH_BYTES:
        raise ValueError(f"request version {version}, {len(body)} hash bytes")
    return [bytes(body[i:i + HASH_BYTES]) for i in range(0, len(body), HASH_BYTES)], window


def encode_credit(received: int, reply_subject: str, cancel: bool = False) -> bytes:
    return _CREDIT.pack(received, CANCEL if cancel else 0) + reply_subject.encode()


def decode_credit(data) -> tuple[int, bool, str]:
    """(bytes received, cancel, reply subject of the transfer); ValueError when malformed."""
    if len(data) <= _CREDIT.size:
        raise ValueError("short credit")
    received, flags = _CREDIT.unpack_from(data, 0)
    return received, bool(flags & CANCEL), bytes(data[_CREDIT.size:]).decode()


def pack_messages(blocks: Iterable[tuple[int, memoryview | None]], limit: int) -> Iterator[list]:
    """Group (index, encoded bytes or None = not here) into messages of at most `limit` bytes.

    Yields each message as a list of parts (piece headers and memoryviews of the
    blocks, not copied) for the caller to join; `blocks` is consumed lazily, one
    message ahead at most.
    """
    if limit < 16 * _PIECE.size:
        raise ValueError(f"message limit {limit} below {16 * _PIECE.size} bytes")
    min_piece = min(_MIN_PIECE, limit // 8)
    parts: list = []
    size = 0
    for index, buf in blocks:
        if buf is None:
            if size + _PIECE.size > limit:
                yield parts
                parts, size = [], 0
            parts.append(_PIECE.pack(index, 0, 0, 0))
            size += _PIECE.size
            continue
        total, offset = len(buf), 0
        if parts and size + _PIECE.size + total > limit and _PIECE.size + total <= limit:
            yield parts  # whole in the next message beats split across two
            parts, size = [], 0
        while offset < total:
            room = limit - size - _PIECE.size
            if room < min(total - offset, min_piece):
                yield parts
                parts, size = [], 0
                continue
            n = min(room, total - offset)
            parts.append(_PIECE.pack(index, total, offset, n))
            parts.append(buf[offset:offset + n])
            size += _PIECE.size + n
            offset += n
    if parts:
        yield parts


class BlockAssembly:
    """The receiving side of one transfer: pieces in, whole blocks (or "not here") out.

    `add(message)` returns the indexes the message completed, each now in
    `blocks[i]` (a memoryview into the message, or an assembled bytearray) or
    marked in `missing`. `settled` counts completed + missing blocks.
    """

    __slots__ = ("blocks", "missing", "settled", "_filled", "_buffers")

    def __init__(self, n: int) -> None:
        self.blocks: list = [None] * n
        self.missing: list[bool] = [False] * n
        self.settled = 0
        self._filled: list[int] = [0] * n
        self._buffers: dict[int, bytearray] = {}

    @property
    def done(self) -> bool:
        return self.settled == len(self.blocks)

    def add(self, message) -> list[int]:
        mv = memoryview(message)
        pos, done = 0, []
        while pos < len(mv):
            if len(mv) - pos < _PIECE.size:
                raise ValueError("truncated piece header")
            index, total, offset, n = _PIECE.unpack_from(mv, pos)
            pos += _PIECE.size
            if index >= len(self.blocks) or self.blocks[index] is not None or self.missing[index]:
                raise ValueError(f"piece for block {index}, which is not open")
            if total == 0:
                self.missing[index] = True
            elif offset + n > total or pos + n > len(mv) or n == 0:
                raise ValueError(f"piece {offset}+{n} of a {total}-byte block, {len(mv) - pos} bytes left")
            elif offset == 0 and n == total:
                self.blocks[index] = mv[pos:pos + n]
            else:
                buf = self._buffers.get(index)
                if buf is None:
                    buf = self._buffers[index] = bytearray(total)
                elif len(buf) != total:
                    raise ValueError(f"block {index} sent as {len(buf)} and {total} bytes")
                buf[offset:offset + n] = mv[pos:pos + n]
                self._filled[index] += n
                if self._filled[index] < total:
                    pos += n
                    continue
                self.blocks[index] = self._buffers.pop(index)
            pos += n
            self.settled += 1
            done.append(index)
        return done
