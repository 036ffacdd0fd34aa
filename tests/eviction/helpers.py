"""Shared helpers of the eviction tests: made-up chained hashes and their block stats."""

from __future__ import annotations

import hashlib

from shared.cache_policy.base import BlockInfo


def chain(n: int, salt: str) -> list[bytes]:
    return [hashlib.sha256(f"{salt}/{i}".encode()).digest() for i in range(n)]


def infos(hashes: list[bytes], last_access: float = 0.0, step: float = 1.0) -> dict[bytes, BlockInfo]:
    """Stats of one chain; later blocks were touched later (`step` apart)."""
    out: dict[bytes, BlockInfo] = {}
    parent = None
    for i, h in enumerate(hashes):
        out[h] = BlockInfo(h, parent, i, 16, 1024, 0.0, last_access + i * step)
        parent = h
    return out
