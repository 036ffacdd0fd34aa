"""Synthetic blocks of the `small` preset's shape, shared by the tier benches."""

from __future__ import annotations

import hashlib

import torch
from kvmesh.config import EngineSettings
from kvmesh.engine.kv_block import KVBlock
from kvmesh.engine.presets import PRESETS


def small_block_shape(block_size: int | None = None) -> tuple[int, ...]:
    """[layers, 2, block_size, kv heads, head dim] of the small preset (from its constants)."""
    p = PRESETS["small"]
    return (p.num_layers, 2, block_size or EngineSettings().block_size, p.num_kv_heads, p.head_dim)


def synthetic_chain(n: int, shape: tuple[int, ...], seed: int = 0) -> list[KVBlock]:
    gen = torch.Generator().manual_seed(seed)
    data = torch.randn((n, *shape), generator=gen)
    out, parent = [], None
    for i in range(n):
        tokens = tuple(range(i * shape[2], (i + 1) * shape[2]))
        h = hashlib.sha256((parent or b"") + repr((seed, tokens)).encode()).digest()
        out.append(KVBlock(h, parent, tokens, data[i]))
        parent = h
    return out
