"""Where the L2 tier keeps encoded block bytes: the process heap or shared memory.

`HeapArena` is a dict of buffers, private to the worker. `SlabArena`
(shared/tiers/shm_slab.py) keeps them in one shared-memory slab, so another
process on the same machine reads them without a socket. `write` says False
when the arena has no room for the block (the tier then evicts more);
`write_into` hands `fill` the block's space to write in place (an encoder
writes its bytes there directly, with no buffer of its own to copy from).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class Arena(Protocol):
    def write(self, key: bytes, data) -> bool: ...
    def write_into(self, key: bytes, nbytes: int, fill: Callable[[memoryview], object]) -> bool: ...
    def read(self, key: bytes) -> memoryview | None: ...
    def free(self, key: bytes) -> None: ...
    def close(self) -> None: ...


class HeapArena:
    """Buffers in this process; reads are read-only views (no copy)."""

    def __init__(self) -> None:
        self._bufs: dict[bytes, bytearray | bytes] = {}

    def write(self, key: bytes, data) -> bool:
        self._bufs[key] = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        return True

    def write_into(self, key: bytes, nbytes: int, fill: Callable[[memoryview], object]) -> bool:
        buf = bytearray(nbytes)
        fill(memoryview(buf))
        self._bufs[key] = buf
        return True

    def read(self, key: bytes) -> memoryview | None:
        buf = self._bufs.get(key)
        return None if buf is None else memoryview(buf).toreadonly()

    def free(self, key: bytes) -> None:
        self._bufs.pop(key, None)

    def close(self) -> None:
        self._bufs.clear()
