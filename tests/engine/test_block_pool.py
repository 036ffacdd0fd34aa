"""BlockPool: reference counts and the free list."""

from __future__ import annotations

import pytest
from kvmesh.engine.block_pool import BlockPool
from kvmesh.protocol.block_hash import BlockHash


def test_take_and_put_free() -> None:
    pool = BlockPool(3)
    taken = [pool.take_free() for _ in range(3)]
    assert [b.block_id for b in taken] == [0, 1, 2]
    assert all(b.ref_count == 1 for b in taken)
    assert pool.take_free() is None and pool.num_free == 0
    assert pool.decref(taken[1]) == 0
    pool.put_free(taken[1])
    assert pool.num_free == 1 and pool.take_free() is taken[1]


def test_refcount_never_negative() -> None:
    pool = BlockPool(1)
    block = pool.take_free()
    pool.incref(block)
    assert pool.decref(block) == 1
    assert pool.decref(block) == 0
    with pytest.raises(ValueError):
        pool.decref(block)
    assert block.ref_count == 0


def test_put_free_refuses_used_or_cached_blocks() -> None:
    pool = BlockPool(2)
    block = pool.take_free()
    with pytest.raises(ValueError):
        pool.put_free(block)
    pool.decref(block)
    block.block_hash = BlockHash(b"x" * 32)
    with pytest.raises(ValueError):
        pool.put_free(block)


def test_empty_pool_is_rejected() -> None:
    with pytest.raises(ValueError):
        BlockPool(0)
