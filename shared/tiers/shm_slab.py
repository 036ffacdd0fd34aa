"""L2 in one shared-memory slab per worker: one mapping (and its fd) however many blocks it holds.

The slab is the file `/dev/shm/kvmesh_<worker>_l2`:

    header (64 B): magic | slots u64 | data offset u64 | data bytes u64
    directory: `slots` entries of 48 B (block hash 32 | offset u64 | length u64), linear probing
    data: the encoded blocks, placed by an `ExtentAllocator`

The owner (`SlabArena`) maps it shared once (CPython's mmap keeps one fd per
mapping; a reader's mapping costs one too, none per block). It writes a
block's bytes before its directory entry and removes the entry before the
space is reused. Readers in other processes (`SlabReader`) map each owner's
slab once, find a block through the directory and copy it out. The caller
verifies the copy (checksum and hash, shared/tiers/block_format.py), so a
block overwritten while it was copied is a counted miss, never served. A
restarted owner makes a new file; readers see the inode change and map the
new one. The file is registered with Python's resource tracker, so it is
unlinked even when the owner dies.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import resource_tracker

from kvmesh.background import lower_this_thread
from kvmesh.tiers.extents import ExtentAllocator

SHM_DIR = "/dev/shm"  # Linux: where shm_open names live
MAGIC = b"KVMSLAB1"
_HEADER = struct.Struct("<8sQQQ")
_HEADER_BYTES = 64
_ENTRY = struct.Struct("<32sQQ")
_PAGE = 4096
KEY_BYTES = 32
MIN_BLOCK_BYTES = 16 * 1024  # directory sizing when the block size is not given (48 B per slot, half load)
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, without touching their bytes
_REMAP_CHECK_S = 10.0  # a reader re-checks the slabs it holds this often (owners gone or restarted)


def slab_name(worker_id: str) -> str:
    """The shm name of a worker's slab: readers derive it from a handle's worker id."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", worker_id)[:64]
    return f"kvmesh_{safe}_l2"


def _slab_path(worker_id: str) -> str:
    return os.path.join(SHM_DIR, slab_name(worker_id))


def _directory_slots(capacity_bytes: int, block_bytes: int) -> int:
    want = max(64, 2 * capacity_bytes // max(1, block_bytes))
    return 1 << (want - 1).bit_length()


def _home(key: bytes, slots: int) -> int:
    return int.from_bytes(key[:8], "little") & (slots - 1)


def _find(mm: mmap.mmap, slots: int, key: bytes) -> tuple[int, int] | None:
    """(offset, length) of `key` in a slab's directory, or None at the first empty slot."""
    slot = _home(key, slots)
    for _ in range(slots):
        found, offset, length = _ENTRY.unpack_from(mm, _HEADER_BYTES + slot * _ENTRY.size)
        if length == 0:
            return None
        if found == key:
            return offset, length
        slot = (slot + 1) & (slots - 1)
    return None


def _copy_out(mm: mmap.mmap, start: int, length: int) -> memoryview:
    """A private, writable copy of `length` bytes at `start` (no view of the slab outlives the call)."""
    with memoryview(mm) as whole, whole[start:start + length] as part:
        return memoryview(bytearray(part))


class SlabArena:
    """A worker's L2 bytes in its slab. `write` says False when no room is left (the tier evicts more)."""

    def __init__(self, worker_id: str, capacity_bytes: int, block_bytes: int = MIN_BLOCK_BYTES,
                 align: int = 64) -> None:
        """`block_bytes`: the smallest block expected; the directory holds capacity / block_bytes blocks."""
        self.worker_id = worker_id
        self.slots = _directory_slots(capacity_bytes, block_bytes)
        self.max_blocks = self.slots // 2  # linear probing stays short at half load
        self._data_off = -(-(_HEADER_BYTES + self.slots * _ENTRY.size) // _PAGE) * _PAGE
        data_bytes = capacity_bytes + self.max_blocks * align  # room for each block's rounding
        self._alloc = ExtentAllocator(data_bytes, align)
        self._path = _slab_path(worker_id)
        self._name = "/" + slab_name(worker_id)
        self._mm = self._create(self._data_off + self._alloc.size)
        _HEADER.pack_into(self._mm, 0, MAGIC, self.slots, self._data_off, self._alloc.size)
        self._where: dict[bytes, tuple[int, int, int]] = {}  # key -> (slot, offset, length)
        self._keys: dict[int, bytes] = {}  # occupied slot -> key: the directory, as the owner knows it

    def _create(self, size: int) -> mmap.mmap:
        try:  # left by a crashed run of the same worker id: replace it
            os.unlink(self._path)
        except FileNotFoundError:
            pass
        fd = os.open(self._path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        resource_tracker.register(self._name, "shared_memory")
        return mm

    def __len__(self) -> int:
        return len(self._where)

    def prefault(self, nbytes: int) -> threading.Thread | None:
        """Fault in the first `nbytes` of the data area on a lowest-priority thread (the allocator fills
        the slab from its start): the first blocks written then land on pages that exist, instead of
        paying a page fault per 4 KiB on the handoff's path. Returns the thread (None: nothing to do)."""
        end = min(self._data_off + max(0, nbytes), self._data_off + self._alloc.size)
        end -= end % _PAGE
        if end <= self._data_off or not hasattr(self._mm, "madvise"):
            return None

        def run() -> None:
            lower_this_thread()
            step = 64 * 1024 * 1024
            for at in range(self._data_off, end, step):
                if self._mm.closed:
                    return
                try:
                    self._mm.madvise(_MADV_POPULATE_WRITE, at, min(step, end - at))
                except (OSError, ValueError):  # an older kernel, or the slab closed meanwhile: pages fault lazily
                    return

        thread = threading.Thread(target=run, name="l2-prefault", daemon=True)
        thread.start()
        return thread

    def write(self, key: bytes, data) -> bool:
        src = memoryview(data).cast("B")

        def fill(space: memoryview) -> None:
            space[:] = src

        return self.write_into(key, len(src), fill)

    def write_into(self, key: bytes, nbytes: int, fill: Callable[[memoryview], object]) -> bool:
        """`fill` writes the block into its space in the slab; its directory entry is added after."""
        if len(key) != KEY_BYTES:
            raise ValueError(f"slab keys are {KEY_BYTES}-byte block hashes, got {len(key)} bytes")
        if key in self._where:
            return True  # content-addressed: the bytes are the same
        if len(self._where) >= self.max_blocks:
            return False
        offset = self._alloc.alloc(nbytes)
        if offset is None:
            return False
        start = self._data_off + offset
        with memoryview(self._mm) as whole, whole[start:start + nbytes] as space:
            try:
                fill(space)
            except BaseException:
                self._alloc.free(offset, nbytes)
                raise
        slot = _home(key, self.slots)
        while slot in self._keys:
            slot = (slot + 1) & (self.slots - 1)
        self._set(slot, key, offset, nbytes)
        return True

    def read(self, key: bytes) -> memoryview | None:
        """A copy: the space is reused once the block is freed, so no view of the slab is handed out."""
        where = self._where.get(key)
        return None if where is None else _copy_out(self._mm, self._data_off + where[1], where[2])

    def free(self, key: bytes) -> None:
        where = self._where.pop(key, None)
        if where is None:
            return
        slot, offset, length = where
        self._unset(slot)
        self._alloc.free(offset, length)

    def close(self) -> None:
        self._where.clear()
        if self._mm.closed:
            return
        self._mm.close()
        try:
            os.unlink(self._path)
        except FileNotFoundError:
            pass
        resource_tracker.unregister(self._name, "shared_memory")

    # --- the directory: linear probing, deletion by backward shift (no tombstones) ---

    def _set(self, slot: int, key: bytes, offset: int, length: int) -> None:
        _ENTRY.pack_into(self._mm, _HEADER_BYTES + slot * _ENTRY.size, key, offset, length)
        self._keys[slot] = key
        self._where[key] = (slot, offset, length)

    def _unset(self, slot: int) -> None:
        mask = self.slots - 1
        hole, probe = slot, slot
        while True:
            probe = (probe + 1) & mask
            key = self._keys.get(probe)
            if key is None:
                break
            home = _home(key, self.slots)
            stays = (hole < home <= probe) if hole < probe else (home > hole or home <= probe)
            if stays:
                continue
            _, offset, length = self._where[key]
            self._set(hole, key, offset, length)
            hole = probe
        _ENTRY.pack_into(self._mm, _HEADER_BYTES + hole * _ENTRY.size, bytes(KEY_BYTES), 0, 0)
        del self._keys[hole]


@dataclass(slots=True)
class _Mapped:
    mm: mmap.mmap
    inode: int
    slots: int
    data_off: int
    data_bytes: int


class SlabReader:
    """Reads other workers' slabs on this host: one mapping per owner, dropped when its file goes or changes."""

    def __init__(self) -> None:
        self._maps: dict[str, _Mapped] = {}
        self._checked = time.monotonic()

    def __len__(self) -> int:
        return len(self._maps)

    def read(self, worker_id: str, key: bytes) -> memoryview | None:
        """A private copy of the block's bytes (unverified), or None when the owner has no such block here."""
        found = self._locate(worker_id, key)
        if found is None:
            return None
        mapped, (offset, length) = found
        return _copy_out(mapped.mm, mapped.data_off + offset, length)

    def stat(self, worker_id: str, key: bytes, trailer_bytes: int) -> tuple[int, bytes] | None:
        """The block's stored length and its last `trailer_bytes` at most (an encoded block's checksum), without
        copying the block; None when the owner has no such block here."""
        found = self._locate(worker_id, key)
        if found is None:
            return None
        mapped, (offset, length) = found
        end = mapped.data_off + offset + length
        return length, bytes(mapped.mm[end - min(trailer_bytes, length):end])

    def holds(self, worker_id: str, key: bytes) -> bool:
        """The owner's directory names the block now (a later read may still miss: the owner evicts freely)."""
        return self._locate(worker_id, key) is not None

    def _locate(self, worker_id: str, key: bytes) -> tuple[_Mapped, tuple[int, int]] | None:
        self._recheck()
        mapped = self._mapping(worker_id)
        where = None if mapped is None else _find(mapped.mm, mapped.slots, key)
        if where is None and mapped is not None and self._replaced(worker_id, mapped):
            mapped = self._mapping(worker_id)  # the owner restarted: its blocks are in its new file
            where = None if mapped is None else _find(mapped.mm, mapped.slots, key)
        if mapped is None or where is None or where[0] + where[1] > mapped.data_bytes:
            return None
        return mapped, where

    def close(self) -> None:
        for worker_id in list(self._maps):
            self._drop(worker_id)

    def _mapping(self, worker_id: str) -> _Mapped | None:
        mapped = self._maps.get(worker_id)
        if mapped is not None:
            return mapped
        try:
            fd = os.open(_slab_path(worker_id), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            if st.st_size < _HEADER_BYTES:
                return None
            mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, slots, data_off, data_bytes = _HEADER.unpack_from(mm, 0)
        if magic != MAGIC or data_off + data_bytes > st.st_size:
            mm.close()
            return None
        mapped = self._maps[worker_id] = _Mapped(mm, st.st_ino, slots, data_off, data_bytes)
        return mapped

    def _recheck(self) -> None:
        """Drop the mappings whose owner's file is gone or was made anew (its old pages are freed with them)."""
        now = time.monotonic()
        if now - self._checked < _REMAP_CHECK_S:
            return
        self._checked = now
        for worker_id, mapped in list(self._maps.items()):
            self._replaced(worker_id, mapped)

    def _replaced(self, worker_id: str, mapped: _Mapped) -> bool:
        """Drop the mapping if the owner's file is gone or is another file now; True if it was dropped."""
        try:
            current = os.stat(_slab_path(worker_id)).st_ino
        except FileNotFoundError:
            current = -1
        if current == mapped.inode:
            return False
        self._drop(worker_id)
        return True

    def _drop(self, worker_id: str) -> None:
        self._maps.pop(worker_id).mm.close()
