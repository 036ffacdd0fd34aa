"""Where the L2 tier keeps encoded block bytes: the process heap or shared memory.

`HeapArena` is a dict of buffers, private to the worker. `ShmArena` puts each
block in its own POSIX shared-memory segment named by worker and block hash,
so another process on the same machine maps it (`attach_segment`) without a
copy or a socket. Segments are unlinked on eviction; a reader that already
mapped one keeps its pages until it drops the mapping. The owner's segments
are registered with Python's resource tracker, so they are unlinked even if
the owner dies.
"""

from __future__ import annotations

import mmap
import os
import re
from multiprocessing.shared_memory import SharedMemory
from typing import Protocol

_SHM_DIR = "/dev/shm"  # Linux: where shm_open names live


class Arena(Protocol):
    def write(self, key: bytes, data) -> None: ...
    def read(self, key: bytes) -> memoryview | None: ...
    def free(self, key: bytes) -> None: ...
    def close(self) -> None: ...


class HeapArena:
    """Buffers in this process; reads are read-only views (no copy)."""

    def __init__(self) -> None:
        self._bufs: dict[bytes, bytearray | bytes] = {}

    def write(self, key: bytes, data) -> None:
        self._bufs[key] = data if isinstance(data, (bytes, bytearray)) else bytes(data)

    def read(self, key: bytes) -> memoryview | None:
        buf = self._bufs.get(key)
        return None if buf is None else memoryview(buf).toreadonly()

    def free(self, key: bytes) -> None:
        self._bufs.pop(key, None)

    def close(self) -> None:
        self._bufs.clear()


def segment_name(worker_id: str, block_hash: bytes) -> str:
    """Segment name of a block in a worker's L2: readers derive it from a handle."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", worker_id)[:64]
    return f"kvmesh_{safe}_{block_hash.hex()}"


def attach_segment(worker_id: str, block_hash: bytes) -> memoryview | None:
    """Map another process's segment copy-on-write: zero-copy reads, private writes.

    None when the segment does not exist (evicted, or never there).
    """
    path = os.path.join(_SHM_DIR, segment_name(worker_id, block_hash))
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        mm = mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    return memoryview(mm)


class ShmArena:
    """One shared-memory segment per block, owned (created and unlinked) by this worker."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._segments: dict[bytes, SharedMemory] = {}

    def write(self, key: bytes, data) -> None:
        src = memoryview(data).cast("B")
        name = segment_name(self.worker_id, key)
        try:
            shm = SharedMemory(name=name, create=True, size=len(src))
        except FileExistsError:  # left by a crashed run of the same worker id: replace it
            stale = SharedMemory(name=name)
            stale.close()
            stale.unlink()
            shm = SharedMemory(name=name, create=True, size=len(src))
        shm.buf[:len(src)] = src
        self._segments[key] = shm

    def read(self, key: bytes) -> memoryview | None:
        # Map privately rather than exporting shm.buf: an export would block close() on eviction.
        return attach_segment(self.worker_id, key) if key in self._segments else None

    def free(self, key: bytes) -> None:
        shm = self._segments.pop(key, None)
        if shm is not None:
            shm.close()
            shm.unlink()

    def close(self) -> None:
        for key in list(self._segments):
            self.free(key)

