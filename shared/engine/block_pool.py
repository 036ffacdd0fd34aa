"""The fixed set of physical KV blocks and their reference counts.

The pool knows which block ids exist, how many sequences use each, and
which blocks hold nothing worth keeping (the free list). Whether a block's
content is cached under a hash, and when a cached block may be reused, is
the prefix cache's business (shared/engine/prefix_cache.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvmesh.protocol.block_hash import BlockHash


@dataclass(slots=True)
class Block:
    """One physical block; `block_hash` is set while its content is cached."""

    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()


class BlockPool:
    """Block ids 0..num_blocks-1 with reference counts and a free list of uncached blocks."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks that hold nothing: reusable without evicting anything."""
        return len(self._free)

    def take_free(self) -> Block | None:
        """Pop an uncached, unused block (ref_count becomes 1), or None if there is none."""
        if not self._free:
            return None
        block = self.blocks[self._free.popleft()]
        block.ref_count = 1
        return block

    def put_free(self, block: Block) -> None:
        """Return an unused block whose content is not cached to the free list."""
        if block.ref_count != 0 or block.block_hash is not None:
            raise ValueError(f"block {block.block_id} is still in use or cached")
        block.token_ids = ()
        block.parent_hash = None
        self._free.append(block.block_id)

    def incref(self, block: Block) -> None:
        block.ref_count += 1

    def decref(self, block: Block) -> int:
        """Drop one reference; returns the new count (never below zero)."""
        if block.ref_count <= 0:
            raise ValueError(f"block {block.block_id} released more often than acquired")
        block.ref_count -= 1
        return block.ref_count
