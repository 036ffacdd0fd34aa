"""Synthetic KV chains for the tier tests: random tensors, made-up chained hashes."""

from __future__ import annotations

import hashlib

import pytest
import torch
from kvmesh.engine.kv_block import KVBlock

FINGERPRINT = "fp-test-0123456789abcdef"
SHAPE = (2, 2, 16, 2, 8)  # layers, K/V, block size, kv heads, head dim


def make_chain(n: int, seed: int = 0, shape: tuple[int, ...] = SHAPE, dtype: torch.dtype = torch.float32) -> list[KVBlock]:
    gen = torch.Generator().manual_seed(seed)
    parent: bytes | None = None
    out: list[KVBlock] = []
    for i in range(n):
        tokens = tuple(int(t) for t in torch.randint(0, 32000, (shape[2],), generator=gen))
        block_hash = hashlib.sha256((parent or b"") + repr((seed, i, tokens)).encode()).digest()
        out.append(KVBlock(block_hash, parent, tokens, torch.randn(shape, generator=gen).to(dtype)))
        parent = block_hash
    return out


@pytest.fixture(name="make_chain")
def make_chain_fixture():
    """The chain factory: make_chain(n, seed=0, shape=SHAPE, dtype=torch.float32)."""
    return make_chain


@pytest.fixture
def fp() -> str:
    return FINGERPRINT

