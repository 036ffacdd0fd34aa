"""Chained content hashes of full KV blocks.

A block's hash is SHA-256 over (parent hash, token ids, extra keys), so
equal hashes mean equal prefixes (up to a collision, which the prefix cache
catches by comparing stored token ids). The encoding is unambiguous
(domain tag, explicit lengths, fixed-width little-endian token ids) and
uses nothing process-local: the same prompt hashes identically in every
process and after every restart.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

_DOMAIN = b"kvmesh.block.v1"
_NO_PARENT = b"\x00"
_HAS_PARENT = b"\x01"


def _field(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data


@dataclass(frozen=True, slots=True)
class HashKeys:
    """The extra keys every block of a chain is hashed with.

    `fingerprint` identifies the model weights; `tenant_salt` keeps tenants
    apart (it comes from the server's view of the tenant, never a client);
    `adapter` names a LoRA adapter ("" for the base model).
    """

    fingerprint: str = ""
    tenant_salt: bytes = b""
    adapter: str = ""
    encoded: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        enc = _field(self.fingerprint.encode()) + _field(self.tenant_salt) + _field(self.adapter.encode())
        object.__setattr__(self, "encoded", enc)


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], keys: HashKeys) -> BlockHash:
    """The hash of one block given its parent's hash (None for the first block)."""
    h = hashlib.sha256(_DOMAIN)
    h.update(_NO_PARENT if parent is None else _HAS_PARENT + _field(parent))
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(keys.encoded)
    return BlockHash(h.digest())


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    keys: HashKeys,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of the full blocks of `token_ids` (a partial tail is not hashed)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], keys)
        hashes.append(parent)
    return hashes
