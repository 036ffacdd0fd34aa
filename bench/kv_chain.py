"""A session's KV chain at real geometry, the same in every process of a benchmark.

The token ids are seeded and the hashes are the engine's own (`hash_blocks`
with the model fingerprint and tenant salt), so an engine imports these
blocks as it would a real prefill's. The K/V values are synthetic: a seeded
random block plus the block's index, cheap to regenerate block by block in
another process, so a 2 GiB chain never needs to exist twice in one.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from kvmesh.engine.kv_block import KVBlock
from kvmesh.protocol.block_hash import HashKeys, hash_blocks


@dataclass(frozen=True, slots=True)
class ChainSpec:
    fingerprint: str
    tenant_salt: bytes
    context: int  # tokens; the chain covers its full blocks
    block_shape: tuple[int, ...]  # [layers, 2, block_size, kv heads, head dim]
    seed: int = 0

    @property
    def block_size(self) -> int:
        return self.block_shape[2]

    def token_ids(self, vocab: int = 1000) -> list[int]:
        return torch.randint(0, vocab, (self.context,), generator=torch.Generator().manual_seed(self.seed)).tolist()

    def hashes(self) -> list[bytes]:
        return hash_blocks(self.token_ids(), self.block_size, HashKeys(self.fingerprint, self.tenant_salt))


def chain_blocks(spec: ChainSpec, dtype: torch.dtype = torch.bfloat16) -> Iterator[KVBlock]:
    """The chain's blocks in order, generated one at a time."""
    ids = spec.token_ids()
    base = torch.randn(spec.block_shape, generator=torch.Generator().manual_seed(spec.seed + 1)).to(dtype)
    parent = None
    for i, h in enumerate(spec.hashes()):
        tokens = tuple(ids[i * spec.block_size:(i + 1) * spec.block_size])
        yield KVBlock(h, parent, tokens, base + i)
        parent = h
